// Quantized weight formats on the host: NVFP4 (E2M1 codes, E4M3 scales per 16 k, one FP32
// tensor scale) and MXFP4 (E2M1 codes, E8M0 scales per 32 k), their quantizers from FP32, and
// dequantizers. Layouts follow the contract (docs/CONTRACT.md, weight formats): row-major codes [N,
// K/2] (low nibble = even k) and scales [N, K/group]; the transposed variant stores codes [K/2, N]
// and scales [K/group, N].
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace metrale {

enum class WeightFormat { kNvfp4, kMxfp4 };
enum class WeightLayout {
  kRowMajor,    // codes [N, K/2], scales [N, K/group]
  kTransposed,  // codes [K/2, N], scales [K/group, N]
};

// "nvfp4" / "mxfp4".
std::string_view to_string(WeightFormat format) noexcept;
// K elements per block scale: 16 for NVFP4, 32 for MXFP4.
int group_size(WeightFormat format) noexcept;

// Quantized weights W[N, K] held in host memory.
struct HostQuantWeights {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  std::int64_t n = 0, k = 0;
  std::vector<std::uint8_t> codes;   // N*K/2 bytes
  std::vector<std::uint8_t> scales;  // N*K/group bytes: E4M3 (NVFP4) or E8M0 (MXFP4)
  float tensor_scale = 1.0f;         // NVFP4's per-tensor FP32 scale; 1 for MXFP4

  // The E2M1 code of W[n, k] (whatever the layout).
  std::uint8_t code(std::int64_t row, std::int64_t col) const;
  // The decoded block scale covering W[n, k], tensor scale included.
  float scale(std::int64_t row, std::int64_t col) const;
  // Dequantized W[n, k] = e2m1 × block scale × tensor scale.
  float weight(std::int64_t row, std::int64_t col) const;
  // W[n, k] in float64, unrounded: e2m1 x block scale x tensor scale is exact in a double.
  double exact_weight(std::int64_t row, std::int64_t col) const;
  // Rows [row0, row0 + rows) of W in float64 (exact_weight of each), row-major into out (rows·K
  // values): the weights are checked once, not per element. Throws Error(kInvalidArgument) for
  // rows outside W, an out of another size, or inconsistent weights.
  void exact_rows(std::int64_t row0, std::int64_t rows, std::span<double> out) const;
};

// Quantizes FP32 W[n, k] (row-major, k a multiple of 16) to NVFP4: tensor scale =
// absmax / (6 × 448) (1 when W is all zero); each block of 16 gets the E4M3 scale nearest to
// block absmax / 6 / tensor scale; each element the nearest E2M1 of w / (block scale × tensor
// scale). Throws Error(kInvalidArgument) for bad sizes or a non-finite weight.
HostQuantWeights quantize_nvfp4(std::span<const float> w, std::int64_t n, std::int64_t k);

// Quantizes FP32 W[n, k] (k a multiple of 32) to MXFP4 (OCP MX): each block of 32 gets the
// E8M0 scale 2^(floor(log2(block absmax)) − 2), each element the nearest E2M1 of w / scale
// (saturating at ±6).
HostQuantWeights quantize_mxfp4(std::span<const float> w, std::int64_t n, std::int64_t k);

// The dequantized weights, row-major [n, k].
std::vector<float> dequantize(const HostQuantWeights& w);

// The same weights in the other layout (codes and scales rearranged; values unchanged).
HostQuantWeights with_layout(const HostQuantWeights& w, WeightLayout layout);

// Rows [begin, end) of row-major W: a column-parallel rank's shard (the tensor scale is the whole
// layer's). Throws Error(kInvalidArgument) for a range outside W or the transposed layout.
HostQuantWeights slice_rows(const HostQuantWeights& w, std::int64_t begin, std::int64_t end);

// Columns [begin, end) of row-major W, both at multiples of the format's group: a row-parallel
// rank's shard. Throws Error(kInvalidArgument) for a range outside W, off the group, or the
// transposed layout.
HostQuantWeights slice_columns(const HostQuantWeights& w, std::int64_t begin, std::int64_t end);

}  // namespace metrale
