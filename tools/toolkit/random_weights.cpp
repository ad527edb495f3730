#include "toolkit/random_weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "metrale/error.h"

namespace metrale::toolkit {

HostQuantWeights random_weights(WeightFormat format, std::int64_t n, std::int64_t k,
                                std::mt19937_64& rng) {
  if (format == WeightFormat::kInt4) return random_int4_weights(n, k, 128, false, rng);
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

HostQuantWeights random_int4_weights(std::int64_t n, std::int64_t k, std::int64_t group,
                                     bool act_order, std::mt19937_64& rng) {
  // The quantizer checks the shape and group, on a row of zeros (cheap), then the fields are
  // drawn directly.
  HostQuantWeights w =
      quantize_int4(std::vector<float>(static_cast<std::size_t>(k), 0.0f), 1, k, group, true, true);
  w.n = n;
  w.codes.resize(static_cast<std::size_t>(n * k / 2));
  for (std::size_t i = 0; i < w.codes.size(); i += 8) {
    const std::uint64_t r = rng();
    std::memcpy(w.codes.data() + i, &r, std::min<std::size_t>(8, w.codes.size() - i));
  }
  const auto groups = static_cast<std::size_t>(n * (k / group));
  std::uniform_int_distribution<int> octave(0, 5), mantissa(0, 1023), zero(0, 15);
  w.scales.resize(2 * groups);
  w.zeros.resize(groups);
  for (std::size_t i = 0; i < groups; ++i) {
    // FP16 exponent field 6..11 (bias 15): 2^-9 .. 2^-4.
    const auto bits = static_cast<std::uint16_t>(((6 + octave(rng)) << 10) | mantissa(rng));
    w.scales[2 * i] = static_cast<std::uint8_t>(bits & 0xFF);
    w.scales[2 * i + 1] = static_cast<std::uint8_t>(bits >> 8);
    w.zeros[i] = static_cast<std::uint8_t>(zero(rng));
  }
  if (act_order) {
    w.k_perm.resize(static_cast<std::size_t>(k));
    std::iota(w.k_perm.begin(), w.k_perm.end(), 0);
    std::shuffle(w.k_perm.begin(), w.k_perm.end(), rng);
  }
  return w;
}

HostE4m3BlockWeights random_e4m3_weights(std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  if (n < 1 || k < 1) {
    throw Error(ErrorCode::kInvalidArgument, "random_e4m3_weights",
                fmt::format("E4M3 weights of {} x {}: N and K must be at least 1", n, k));
  }
  HostE4m3BlockWeights w;
  w.n = n;
  w.k = k;
  w.codes.resize(static_cast<std::size_t>(n * k));
  for (std::size_t i = 0; i < w.codes.size(); i += 8) {
    const std::uint64_t r = rng();
    std::memcpy(w.codes.data() + i, &r, std::min<std::size_t>(8, w.codes.size() - i));
  }
  for (auto& c : w.codes) {
    if ((c & 0x7F) == 0x7F) c = static_cast<std::uint8_t>(c & 0xFE);  // NaN to ±448
  }
  std::uniform_int_distribution<int> octave(0, 5);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  w.scales.resize(static_cast<std::size_t>(e4m3_blocks(n) * e4m3_blocks(k)));
  for (auto& s : w.scales) s = std::ldexp(mantissa(rng), -12 + octave(rng));
  return w;
}

}  // namespace metrale::toolkit
