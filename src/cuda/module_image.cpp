#include "cuda/module_image.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdint>
#include <cstring>

namespace metrale::cuda {

ImageKind classify_image(std::span<const unsigned char> bytes) noexcept {
  if (bytes.size() >= 4) {
    std::uint32_t magic = 0;
    std::memcpy(&magic, bytes.data(), 4);
    if (magic == 0xBA55ED50u) return ImageKind::kFatbin;
    if (bytes[0] == 0x7f && bytes[1] == 'E' && bytes[2] == 'L' && bytes[3] == 'F') {
      return ImageKind::kElf;
    }
  }
  // PTX: skip blank space and // comments; the first directive must be .version.
  std::size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char c = bytes[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
    } else if (c == '/' && i + 1 < bytes.size() && bytes[i + 1] == '/') {
      while (i < bytes.size() && bytes[i] != '\n') ++i;
    } else {
      break;
    }
  }
  constexpr std::string_view kVersion = ".version";
  if (bytes.size() - i >= kVersion.size() &&
      std::memcmp(bytes.data() + i, kVersion.data(), kVersion.size()) == 0) {
    return ImageKind::kPtx;
  }
  return ImageKind::kUnknown;
}

const char* to_string(ImageKind kind) noexcept {
  switch (kind) {
    case ImageKind::kFatbin:
      return "fatbin";
    case ImageKind::kElf:
      return "cubin (ELF)";
    case ImageKind::kPtx:
      return "PTX";
    case ImageKind::kUnknown:
      return "unknown";
  }
  return "unknown";
}

std::string ComputeCapability::str() const {
  return fmt::format("sm_{}{}", major, minor);
}

std::optional<Target> Target::parse(std::string_view text) {
  Target t;
  if (text.starts_with("sm_")) {
    text.remove_prefix(3);
  } else if (text.starts_with("compute_")) {
    text.remove_prefix(8);
    t.ptx = true;
  } else {
    return std::nullopt;
  }
  if (text.ends_with('a')) {
    t.arch_specific = true;
    text.remove_suffix(1);
  }
  // Digits only, no leading zero: "sm_090" is not a spelling of sm_90 (str() must give back
  // the text parsed, or a target list would print differently from what was built).
  if (text.size() < 2 || text.front() == '0') return std::nullopt;
  int number = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), number);
  if (ec != std::errc{} || end != text.data() + text.size() || number < 10) {
    return std::nullopt;
  }
  t.major = number / 10;
  t.minor = number % 10;
  return t;
}

std::string Target::str() const {
  return fmt::format("{}_{}{}{}", ptx ? "compute" : "sm", major, minor, arch_specific ? "a" : "");
}

bool Target::runs_on(ComputeCapability cc) const noexcept {
  if (arch_specific) return cc.major == major && cc.minor == minor;
  if (ptx) return cc.major > major || (cc.major == major && cc.minor >= minor);
  return cc.major == major && cc.minor >= minor;
}

TargetChoice choose_target(const std::vector<Target>& targets, ComputeCapability cc) {
  TargetChoice best;
  const Target* chosen = nullptr;
  auto newer = [](const Target& a, const Target& b) {
    return a.major != b.major ? a.major > b.major : a.minor > b.minor;
  };
  for (const Target& t : targets) {
    if (!t.runs_on(cc)) continue;
    if (chosen == nullptr || (chosen->ptx && !t.ptx) ||
        (chosen->ptx == t.ptx &&
         (newer(t, *chosen) || (t.arch_specific && !chosen->arch_specific &&
                                t.major == chosen->major && t.minor == chosen->minor)))) {
      chosen = &t;
    }
  }
  if (chosen != nullptr) best = TargetChoice{true, chosen->ptx, chosen->str()};
  return best;
}

}  // namespace metrale::cuda
