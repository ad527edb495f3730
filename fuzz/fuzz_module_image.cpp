// Fuzz target: the kernel-module front end (src/cuda/module_image.h) that runs before the
// driver sees a blob. classify_image decides what cuModuleLoadData is told it gets; Target::parse
// and choose_target are what the registry's preflight does with a module's target list.
//
// Input: byte 0 and 1 pick a compute capability; the whole input is the image; the input as text,
// split at blank space and commas, is a target list.
//
// Invariants (any break is __builtin_trap(), so libFuzzer keeps the input):
//  - classify_image reads only its span (ASan: the input is an exact-size heap copy) and agrees
//    with an independent classifier written from the header's contract;
//  - Target::parse accepts exactly the canonical spellings: whatever it accepts prints back as
//    the same text and parses back to the same target;
//  - runs_on follows the compatibility rules written here from the header's comment;
//  - choose_target picks machine code over PTX, then the newest, then arch-specific over generic,
//    among the targets that run, and says no target runs only when none does.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/module_image.h"

namespace {

using metrale::cuda::ComputeCapability;
using metrale::cuda::ImageKind;
using metrale::cuda::Target;

void require(bool ok) {
  if (!ok) __builtin_trap();
}

// The contract of classify_image, written with string_view operations rather than indices.
ImageKind reference_kind(std::string_view s) {
  if (s.size() >= 4 && s.substr(0, 4) == std::string_view("\x50\xED\x55\xBA", 4)) {
    return ImageKind::kFatbin;
  }
  if (s.size() >= 4 && s.substr(0, 4) == std::string_view("\x7f"
                                                          "ELF",
                                                          4))
    return ImageKind::kElf;
  for (;;) {
    const std::size_t text = s.find_first_not_of(" \t\n\r");
    s.remove_prefix(text == std::string_view::npos ? s.size() : text);
    if (!s.starts_with("//")) break;
    const std::size_t eol = s.find('\n');
    s.remove_prefix(eol == std::string_view::npos ? s.size() : eol);
  }
  return s.starts_with(".version") ? ImageKind::kPtx : ImageKind::kUnknown;
}

// The header's rules: machine code within its major on equal or newer minors, arch-specific
// only on its exact capability, PTX on any equal or newer capability.
bool reference_runs(const Target& t, ComputeCapability cc) {
  const std::int64_t have = std::int64_t{cc.major} * 10 + cc.minor,
                     want = std::int64_t{t.major} * 10 + t.minor;  // minors are 0..9
  if (t.arch_specific) return have == want;
  if (t.ptx) return have >= want;
  return cc.major == t.major && have >= want;
}

// Larger is better: machine code, then newer, then arch-specific.
bool better(const Target& a, const Target& b) {
  if (a.ptx != b.ptx) return !a.ptx;
  if (a.major != b.major) return a.major > b.major;
  if (a.minor != b.minor) return a.minor > b.minor;
  return a.arch_specific && !b.arch_specific;
}

bool same(const Target& a, const Target& b) {
  return a.major == b.major && a.minor == b.minor && a.arch_specific == b.arch_specific &&
         a.ptx == b.ptx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const unsigned char> image(data, size);
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  const ImageKind kind = metrale::cuda::classify_image(image);
  require(kind == reference_kind(text));
  const char* name = metrale::cuda::to_string(kind);
  require(name != nullptr && name[0] != '\0');

  std::vector<Target> targets;
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t end = std::min(text.find_first_of(" \t\n\r,", i), text.size());
    const std::string_view token = text.substr(i, end - i);
    if (const std::optional<Target> t = Target::parse(token)) {
      require(t->str() == token);
      const std::optional<Target> again = Target::parse(t->str());
      require(again && same(*again, *t));
      require(t->major >= 1 && t->minor >= 0 && t->minor <= 9);
      targets.push_back(*t);
    }
    i = end + 1;
  }

  const ComputeCapability cc{size > 0 ? data[0] % 16 : 9, size > 1 ? data[1] % 10 : 0};
  const Target* best = nullptr;
  for (const Target& t : targets) {
    require(t.runs_on(cc) == reference_runs(t, cc));
    if (reference_runs(t, cc) && (best == nullptr || better(t, *best))) best = &t;
  }
  const metrale::cuda::TargetChoice choice = metrale::cuda::choose_target(targets, cc);
  require(choice.runs == (best != nullptr));
  if (best != nullptr) {
    require(choice.target == best->str());
    require(choice.via_ptx == best->ptx);
  } else {
    require(choice.target.empty() && !choice.via_ptx);
  }
  return 0;
}
