// How many copies of a benchmark's weights the timed calls cycle through. A model's forward pass
// reads each layer once, so a layer timed again and again would be read partly from a cache its
// own previous call filled (a 33 MB layer read at 115% of the roof on a 32 MiB L3; a layer below
// the 50 MB L2 of an H200 likewise). Copies join the turn until at least kRotationBytes lie
// between two reads of the same bytes, up to kMaxRotationCopies: a block of a few kilobytes, as
// the CLI tests bench, would otherwise be copied 10^5 times; such a block sits in cache whatever
// is done, and its timing says so. (Llama-3-8B's o projection needs 57 copies.)
#pragma once

#include <cstddef>

namespace metrale::toolkit {

inline constexpr std::size_t kRotationBytes = std::size_t{512} << 20;
inline constexpr std::size_t kMaxRotationCopies = 64;

// Copies (the original included, at least 1) of a block of block_bytes to cycle through.
// Throws Error(kInvalidArgument) for a block of 0 bytes.
std::size_t rotation_copies(std::size_t block_bytes);

}  // namespace metrale::toolkit
