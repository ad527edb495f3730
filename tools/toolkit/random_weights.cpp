#include "toolkit/random_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "metrale/error.h"

namespace metrale::toolkit {

HostQuantWeights random_weights(WeightFormat format, std::int64_t n, std::int64_t k,
                                std::mt19937_64& rng) {
  const int group = group_size(format);
  if (n < 1 || k < 1 || k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, "random_weights",
                fmt::format("{} weights of {} x {}: N must be at least 1 and K a positive "
                            "multiple of {}",
                            to_string(format), n, k, group));
  }
  HostQuantWeights w;
  w.format = format;
  w.n = n;
  w.k = k;
  w.codes.resize(static_cast<std::size_t>(n * k / 2));
  w.scales.resize(static_cast<std::size_t>(n * k / group));
  for (std::size_t i = 0; i < w.codes.size(); i += 8) {
    const std::uint64_t r = rng();
    std::memcpy(w.codes.data() + i, &r, std::min<std::size_t>(8, w.codes.size() - i));
  }
  // The same six octaves for both formats (see the header).
  std::uniform_int_distribution<int> octave(0, 5), mantissa(0, 7);
  if (format == WeightFormat::kNvfp4) {
    // E4M3 with exponent field 4..9 (bias 7): 2^-3 .. 1.875·2^2.
    for (auto& s : w.scales) {
      s = static_cast<std::uint8_t>(((4 + octave(rng)) << 3) | mantissa(rng));
    }
    w.tensor_scale = 1.0f / 64.0f;
  } else {
    // E8M0 (bias 127): 2^-9 .. 2^-4.
    for (auto& s : w.scales) s = static_cast<std::uint8_t>(127 - 9 + octave(rng));
    w.tensor_scale = 1.0f;
  }
  return w;
}

}  // namespace metrale::toolkit
