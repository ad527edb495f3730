// Tokens into expert order and back (module "moe": moe_count, moe_scatter, moe_gather,
// moe_combine), shared by the CPU and GPU kernels. The routing's ids [tokens, top_k] become, per
// expert e, its rows [offsets[e], offsets[e] + counts[e]) of the permuted activations: the
// contiguous layout (offsets the prefix sums of counts) or the masked one (offsets e · capacity,
// a fixed launch shape for CUDA graphs). Each (token, slot) entry's row is in rows; within an
// expert the rows follow the entries' order, so every backend permutes alike. Plain data and
// __host__ __device__ rules only.
#pragma once

#include <cmath>
#include <cstdint>

#include "metrale/numerics.h"

namespace metrale {

// Arguments of moe_count and moe_scatter, by value.
struct MoeAlignParams {
  std::uint64_t ids = 0;      // int32 [entries]: each (token, slot)'s expert
  std::uint64_t counts = 0;   // int32 [experts], out: rows each expert holds
  std::uint64_t offsets = 0;  // int32 [experts + 1], out: each expert's first row; [E] the end
  std::uint64_t rows = 0;     // int32 [entries], out: each entry's row, -1 when it has none
  std::int64_t entries = 0;   // tokens · top_k
  std::int32_t experts = 0;
  std::int32_t pad = 0;
  std::int64_t capacity = 0;  // rows per expert in the masked layout; 0: contiguous
};

// Arguments of moe_gather (x_perm[rows[i]] = x[i / top_k]) and moe_combine
// (out[t] = Σ_j weights[t, j] · y[rows[t, j]], FP32 in slot order, rounded once to BF16).
struct MoePermuteParams {
  std::uint64_t in = 0;       // gather: x BF16 [tokens, width]; combine: y BF16 [row cap, width]
  std::uint64_t out = 0;      // gather: x_perm BF16 [row cap, width]; combine: BF16 [tokens, width]
  std::uint64_t rows = 0;     // int32 [tokens · top_k]
  std::uint64_t weights = 0;  // combine: FP32 [tokens, top_k]
  std::int64_t tokens = 0, width = 0;
  std::int32_t top_k = 0;
  std::int32_t pad = 0;
  // Rows of x_perm or y: a row index at or past it (only a caller's own rows can hold one) is
  // skipped like -1, so no index read from memory reaches outside the buffer the op checked.
  std::int64_t row_capacity = 0;
  // gather with a column order (act-ordered experts, Note [Experts' act order]): ids int32
  // [tokens · top_k], columns int32 [experts, width]; 0 without one.
  std::uint64_t ids = 0, columns = 0;
  std::int32_t experts = 0;
  std::int32_t pad2 = 0;
};

namespace moe {

// Whether an id names an expert; an entry whose id does not (a caller's -1 for an expert held
// elsewhere, say) gets no row: it is neither computed nor combined.
METRALE_HD bool valid_id(std::int32_t id, std::int32_t experts) {
  return id >= 0 && id < experts;
}

// The row of expert e's rank-th entry, or -1 past a masked expert's capacity (reached only when
// a token names one expert twice: with distinct experts per token, capacity >= tokens holds all).
METRALE_HD std::int32_t row_of(const MoeAlignParams& p, std::int32_t e, std::int64_t rank) {
  if (p.capacity > 0 && rank >= p.capacity) return -1;
  return static_cast<std::int32_t>(reinterpret_cast<const std::int32_t*>(p.offsets)[e] + rank);
}

// The offsets from the counts (which moe_count has clamped to the capacity when masked).
METRALE_HD void write_offsets(const MoeAlignParams& p) {
  const auto* counts = reinterpret_cast<const std::int32_t*>(p.counts);
  auto* offsets = reinterpret_cast<std::int32_t*>(p.offsets);
  std::int64_t at = 0;
  for (std::int32_t e = 0; e < p.experts; ++e) {
    offsets[e] = static_cast<std::int32_t>(p.capacity > 0 ? e * p.capacity : at);
    at += counts[e];
  }
  offsets[p.experts] = static_cast<std::int32_t>(p.capacity > 0 ? p.experts * p.capacity : at);
}

// Whether a row read from rows names a row of the buffer.
METRALE_HD bool has_row(const MoePermuteParams& p, std::int32_t row) {
  return row >= 0 && row < p.row_capacity;
}

// x_perm[rows[i], c] for gather with a column order: x[i / top_k, columns[e, c]] for entry i's
// expert e. An expert or column index outside its range (only a caller's own ids and orders can
// hold one) gives 0, so no index read from memory reaches outside x.
METRALE_HD std::uint16_t gather_element(const MoePermuteParams& p, std::int64_t i, std::int64_t c) {
  const std::int32_t e = reinterpret_cast<const std::int32_t*>(p.ids)[i];
  if (!valid_id(e, p.experts)) return 0;
  const std::int32_t from = reinterpret_cast<const std::int32_t*>(p.columns)[e * p.width + c];
  if (from < 0 || from >= p.width) return 0;
  return reinterpret_cast<const std::uint16_t*>(p.in)[i / p.top_k * p.width + from];
}

// out[t, c] for combine: the weighted sum over token t's slots with a row, in slot order.
METRALE_HD std::uint16_t combine_element(const MoePermuteParams& p, std::int64_t t,
                                         std::int64_t c) {
  const auto* rows = reinterpret_cast<const std::int32_t*>(p.rows) + t * p.top_k;
  const auto* w = reinterpret_cast<const float*>(p.weights) + t * p.top_k;
  const auto* y = reinterpret_cast<const std::uint16_t*>(p.in);
  float sum = 0.0f;
  for (std::int32_t j = 0; j < p.top_k; ++j) {
    // fmaf spelled out: nvcc contracts a * b + c into an FMA and the host compiler does not,
    // so each would round differently.
    if (has_row(p, rows[j])) sum = fmaf(w[j], num::bf16_to_f32(y[rows[j] * p.width + c]), sum);
  }
  return num::f32_to_bf16(sum);
}

}  // namespace moe
}  // namespace metrale
