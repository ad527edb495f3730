// Quantized weight formats on the host: NVFP4 (E2M1 codes, E4M3 scales per 16 k, one FP32
// tensor scale), MXFP4 (E2M1 codes, E8M0 scales per 32 k) and INT4 (unsigned 4-bit codes, a
// BF16 or FP16 scale and a zero point per group of K: GPTQ, AWQ, compressed-tensors
// pack-quantized), their quantizers from FP32, and dequantizers. Layouts follow the contract
// (docs/CONTRACT.md, weight formats): row-major codes [N, K/2] (low nibble = even k) and scales
// [N, K/group]; the transposed variant (NVFP4 and MXFP4) stores codes [K/2, N] and scales
// [K/group, N].
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace metrale {

enum class WeightFormat { kNvfp4, kMxfp4, kInt4 };
enum class WeightLayout {
  kRowMajor,    // codes [N, K/2], scales [N, K/group]
  kTransposed,  // codes [K/2, N], scales [K/group, N]
};

// "nvfp4" / "mxfp4" / "int4".
std::string_view to_string(WeightFormat format) noexcept;
// K elements per block scale: 16 for NVFP4, 32 for MXFP4; 0 for INT4, whose weights each carry
// their own (HostQuantWeights::group).
int group_size(WeightFormat format) noexcept;

// Whether INT4 weights may have `group` K elements per scale with K = k: 32, 64, a multiple of
// 128, or K itself (one scale per row: compressed-tensors' channel strategy, GPTQ's group -1),
// dividing K. The vector kernels take 128 k per step, so a group of 32 or 64 divides a step, a
// multiple of 128 is whole steps, and one per row covers every step (its K past the last whole
// step in the scalar tail).
bool int4_group_ok(std::int64_t group, std::int64_t k) noexcept;

// Quantized weights W[N, K] held in host memory.
struct HostQuantWeights {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  std::int64_t n = 0, k = 0;
  std::vector<std::uint8_t> codes;   // N*K/2 bytes
  std::vector<std::uint8_t> scales;  // N*K/group bytes: E4M3 (NVFP4) or E8M0 (MXFP4)
  float tensor_scale = 1.0f;         // NVFP4's per-tensor FP32 scale; 1 for MXFP4 and INT4

  // INT4 only (Note [INT4 weights] in docs/NOTES.md). W[n, k] = (code - zero) x scale of k's
  // group, exact in float (a 5-bit integer times an 11-bit significand). `scales` then holds
  // [N, K/group] BF16 or FP16 scales, two little-endian bytes each.
  std::int64_t group = 0;    // K elements per scale (int4_group_ok)
  bool fp16_scales = false;  // scales are FP16 (GPTQ, AWQ), else BF16
  // Zero points [N, K/group], one byte each (0..15); empty: symmetric, every zero point 8.
  std::vector<std::uint8_t> zeros;
  // Act order (GPTQ's desc_act, compressed-tensors' weight_g_idx): the codes, scales and zero
  // points are stored with K permuted so that each group's columns are contiguous, and stored
  // column j holds W[:, k_perm[j]]. Empty: K in its own order. So C = A[:, k_perm] . Wsᵀ.
  // A K slice of such weights (slice_columns) pads each group's columns to whole 32-K blocks:
  // there k_perm[j] = -1 (a padding column: A reads 0 there, its codes are the zero point), and
  // the other entries are a permutation of [0, a_columns). K then counts the padding; W and A
  // have a_columns columns (Note [Act order across ranks]).
  std::vector<std::int32_t> k_perm;

  // The E2M1 (INT4: unsigned) code of W[n, k] (whatever the layout; k in W's own order).
  std::uint8_t code(std::int64_t row, std::int64_t col) const;
  // The decoded block scale covering W[n, k], tensor scale included.
  float scale(std::int64_t row, std::int64_t col) const;
  // Dequantized W[n, k] = e2m1 × block scale × tensor scale (INT4: (code − zero) × scale).
  float weight(std::int64_t row, std::int64_t col) const;
  // W[n, k] in float64, unrounded: e2m1 x block scale x tensor scale is exact in a double.
  double exact_weight(std::int64_t row, std::int64_t col) const;
  // Rows [row0, row0 + rows) of W in float64 (exact_weight of each), row-major into out
  // (rows·a_columns values): the weights are checked once, not per element. Throws
  // Error(kInvalidArgument) for rows outside W, an out of another size, or inconsistent weights.
  void exact_rows(std::int64_t row0, std::int64_t rows, std::span<double> out) const;
};

// W's columns, which A's rows hold: K, but for INT4 weights whose k_perm pads a K slice, its
// entries other than -1 (Note [Act order across ranks]).
std::int64_t a_columns(const HostQuantWeights& w) noexcept;

// Quantizes FP32 W[n, k] (row-major, k a multiple of 16) to NVFP4: tensor scale =
// absmax / (6 × 448) (1 when W is all zero); each block of 16 gets the E4M3 scale nearest to
// block absmax / 6 / tensor scale; each element the nearest E2M1 of w / (block scale × tensor
// scale). Throws Error(kInvalidArgument) for bad sizes or a non-finite weight.
HostQuantWeights quantize_nvfp4(std::span<const float> w, std::int64_t n, std::int64_t k);

// Quantizes FP32 W[n, k] (k a multiple of 32) to MXFP4 (OCP MX): each block of 32 gets the
// E8M0 scale 2^(floor(log2(block absmax)) − 2), each element the nearest E2M1 of w / scale
// (saturating at ±6).
HostQuantWeights quantize_mxfp4(std::span<const float> w, std::int64_t n, std::int64_t k);

// Quantizes FP32 W[n, k] to INT4 by rounding to nearest in groups of `group` (int4_group_ok):
// symmetric, scale = absmax / 7 (in the scale type, rounded to nearest) and zero point 8; with
// zero_points, scale = (max − min) / 15 and zero = round(−min / scale) clamped to 0..15. Codes are
// round(w / scale) + zero, clamped to 0..15. For tests and tools: the checkpoints' own quantizers
// (GPTQ, AWQ) choose scales by other rules, which the format does not depend on.
HostQuantWeights quantize_int4(std::span<const float> w, std::int64_t n, std::int64_t k,
                               std::int64_t group, bool zero_points, bool fp16_scales);

// INT4 weights given in K's own order with a g_idx (GPTQ act order: column k belongs to group
// g_idx[k], `zeros` and `scales` [N, K/group] indexed by group) stored as the format keeps them:
// K sorted by group (a stable sort), k_perm recording the order; no permutation when g_idx is
// k / group throughout. `w` has empty k_perm. Throws Error(kInvalidArgument) naming the group when
// g_idx's size is not K, an entry lies outside [0, K/group) or a group holds other than `group`
// columns.
HostQuantWeights with_act_order(const HostQuantWeights& w, std::span<const std::int32_t> g_idx);

// The dequantized weights, row-major [n, a_columns(w)].
std::vector<float> dequantize(const HostQuantWeights& w);

// The same weights in the other layout (codes and scales rearranged; values unchanged).
HostQuantWeights with_layout(const HostQuantWeights& w, WeightLayout layout);

// Rows [begin, end) of row-major W: a column-parallel rank's shard (the tensor scale is the whole
// layer's). Throws Error(kInvalidArgument) for a range outside W or the transposed layout.
HostQuantWeights slice_rows(const HostQuantWeights& w, std::int64_t begin, std::int64_t end);

// The rows of `parts` one after another: W = [parts[0]; parts[1]; ...] (an MoE expert's gate and
// up projections as one gate_up, say). Every part row-major, of one format, K, tensor scale and
// (INT4) group, scale type, zero-point kind and act order (none, or one k_perm for all). Throws
// Error(kInvalidArgument) naming the part and the field that differs, or for no parts.
HostQuantWeights stack_rows(std::span<const HostQuantWeights> parts);

// W' = W[rows, :]: row i of the result is row rows[i] of row-major W (an MoE expert's gate_up
// reordered to the K order of its down projection's act order: Note [Experts' act order]). Throws
// Error(kInvalidArgument) for no rows, a row outside W, or the transposed layout.
HostQuantWeights take_rows(const HostQuantWeights& w, std::span<const std::int64_t> rows);

// The act-ordered INT4 weights as weights without act order whose K is the stored order:
// W' = W[:, k_perm], so A' · W'ᵀ = A · Wᵀ for A' = A[:, k_perm] (a caller that gives A in the
// stored order; other weights come back as they are). Throws Error(kInvalidArgument) for
// inconsistent weights or a K slice (padded k_perm).
HostQuantWeights in_stored_order(const HostQuantWeights& w);

// Columns [begin, end) of row-major W, both at multiples of the format's group (INT4 with one
// scale per row: of 2): a row-parallel rank's shard, A's columns [begin, end) its input. Act-
// ordered INT4: the slice's columns in their stored order, each group's run padded to whole
// blocks of 32 K in groups of 32 (Note [Act order across ranks]). Throws
// Error(kInvalidArgument) for a range outside W, off the group, the transposed layout, or weights
// that are a slice already (padded k_perm).
HostQuantWeights slice_columns(const HostQuantWeights& w, std::int64_t begin, std::int64_t end);

}  // namespace metrale
