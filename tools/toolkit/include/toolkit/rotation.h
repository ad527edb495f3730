// How many copies of a benchmark's weights the timed calls cycle through. A model's forward pass
// reads each layer once, so a layer timed again and again would be read partly from a cache its
// own previous call filled (a 33 MB layer read at 115% of the roof on a 32 MiB L3; a layer below
// the 50 MB L2 of an H200 likewise). Copies join the turn until at least kRotationBytes lie
// between two reads of the same bytes, up to kMaxRotationCopies: a block of a few kilobytes, as
// the CLI tests bench, would otherwise be copied 10^5 times; such a block sits in cache whatever
// is done, and its timing says so. (Llama-3-8B's o projection needs 57 copies.)
//
// Every copy a benchmark times is checked (check_rotation): copy 0 with the full sample, every
// other with a smaller one, so a copy whose upload went wrong cannot be timed as if it were right.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include "toolkit/sampled_check.h"

namespace metrale::toolkit {

inline constexpr std::size_t kRotationBytes = std::size_t{512} << 20;
inline constexpr std::size_t kMaxRotationCopies = 64;

// Copies (the original included, at least 1) of a block of block_bytes to cycle through.
// Throws Error(kInvalidArgument) for a block of 0 bytes.
std::size_t rotation_copies(std::size_t block_bytes);

// Samples per copy after the first: enough that a copy whose weights are wrong throughout (a
// failed or misplaced upload) fails, at a sixth of copy 0's cost.
inline constexpr int kCopySamples = 16;
inline constexpr int kFirstCopySamples = 96;

// The checks of every copy of a rotation.
struct RotationCheck {
  SampledCheck first;                      // copy 0, kFirstCopySamples samples
  std::size_t copies = 0;                  // copies checked
  std::optional<std::size_t> failed_copy;  // the first copy whose check failed
  SampledCheck failed;                     // its check
  // Whether every copy passed.
  bool passed() const noexcept { return !failed_copy.has_value(); }
  // Copy 0's figures, and the copy that failed if one did.
  std::string str() const;
};

// Runs check_copy(r, samples) for copy 0 (kFirstCopySamples) and then each copy r < copies
// (kCopySamples), stopping at the first that fails. Throws Error(kInvalidArgument) for 0 copies.
RotationCheck check_rotation(
    std::size_t copies, const std::function<SampledCheck(std::size_t r, int samples)>& check_copy);

}  // namespace metrale::toolkit
