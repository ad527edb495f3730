// Kernel module images and the targets they carry: what kind of blob an image is, and whether
// a device of a given compute capability can run it. Pure functions, tested on the host.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::cuda {

// What cuModuleLoadData will be given.
enum class ImageKind { kFatbin, kElf, kPtx, kUnknown };

// Classifies by content: fatbin magic 0xBA55ED50, ELF "\x7fELF", PTX text (".version" first
// among directives, after comments and blank space).
ImageKind classify_image(std::span<const unsigned char> bytes) noexcept;
// "fatbin", "cubin (ELF)", "PTX", "unknown".
const char* to_string(ImageKind kind) noexcept;

struct ComputeCapability {
  int major = 0, minor = 0;
  // "sm_90" style.
  std::string str() const;
  friend bool operator==(ComputeCapability, ComputeCapability) = default;
};

// One target of a module: machine code (sm_XY[a]) or PTX (compute_XY[a]).
struct Target {
  int major = 0, minor = 0;
  bool arch_specific = false;  // the "a" suffix: runs on exactly this capability
  bool ptx = false;            // compute_XY: JIT-compiled by the driver at load
  // Parses "sm_90a" or "compute_90"; nullopt for anything else.
  static std::optional<Target> parse(std::string_view text);
  // Back to "sm_90a" / "compute_90".
  std::string str() const;
  // Whether a device of capability cc can run this target. Machine code runs within its major
  // version on equal or newer minors; arch-specific code only on its exact capability; PTX on
  // any equal or newer capability (arch-specific PTX only on its exact one).
  bool runs_on(ComputeCapability cc) const noexcept;
};

// How a module would load on a device: the best target that runs there.
struct TargetChoice {
  bool runs = false;
  bool via_ptx = false;  // only PTX fits: the driver JIT-compiles at load (slow start-up)
  std::string target;    // the chosen target, e.g. "sm_90a"
};

// Picks machine code over PTX, and among machine code the newest that runs.
TargetChoice choose_target(const std::vector<Target>& targets, ComputeCapability cc);

}  // namespace metrale::cuda
