// The glue of a mixture-of-experts layer on any backend (module "moe"): routing each token to its
// top-k experts, permuting the tokens into expert order for the grouped GEMM, and combining the
// experts' outputs back per token with the routing weights (docs/CONTRACT.md, MoE routing).
// Each op checks its arguments (nothing launched on error), then queues its kernels on stream;
// the launch shapes depend on the shape alone, never on the routing (CUDA-graph capturable).
#pragma once

#include <cstdint>
#include <string_view>

#include "metrale/backend.h"

namespace metrale::ops {

// How scores and weights come from the router's logits (Note [MoE routing]).
enum class MoeScoring {
  kSoftmax,      // Qwen3-MoE, Mixtral: softmax over all experts, then the top k
  kTopkSoftmax,  // gpt-oss: the top k logits, then a softmax over those k
  kSigmoid,      // DeepSeek-V3: sigmoid scores, chosen by score + bias within the best groups
};

struct MoeRouting {
  MoeScoring scoring = MoeScoring::kSoftmax;
  std::int32_t top_k = 0;    // experts per token, 1..32
  bool renormalize = false;  // kSoftmax, kSigmoid: the k weights divided by their sum
  float scale = 1.0f;        // every weight times this (DeepSeek's routed_scaling_factor)
  // kSigmoid: experts in `groups` equal groups; only the topk_groups best (by the sum of their two
  // best choice values) are chosen from. 1 and 1: no grouping.
  std::int32_t groups = 1, topk_groups = 1;
  DevicePtr bias;  // kSigmoid: FP32 [experts], added to the scores for the choice only; optional
};

// The sizes of one layer's routing. Rows of the permuted activations: contiguous (capacity 0),
// tokens · top_k rows, expert e's from offsets[e]; masked, experts · capacity rows, expert e's
// from e · capacity (capacity >= tokens, so that no token is dropped).
struct MoeShape {
  std::int64_t tokens = 0;
  std::int32_t experts = 0;  // 1..1024
  std::int32_t top_k = 0;
  std::int64_t capacity = 0;
  // Rows of the permuted activations (and of the grouped GEMM's A and C).
  std::int64_t row_capacity() const noexcept {
    return capacity > 0 ? experts * capacity : tokens * top_k;
  }
};

// Throws Error(kInvalidArgument) naming api and the bad value unless shape is one every op of
// this header takes (tokens in [1, 2^26], experts in [1, 1024], top_k in [1, 32], capacity 0 or
// at least tokens, rows below 2^31): for a caller that sizes buffers from a shape before it calls
// the ops. top_k may exceed experts: a rank holding some of a layer's experts aligns, gathers and
// combines each token's top_k ids, those held elsewhere as -1; moe_route alone needs top_k <=
// experts.
void check_moe_shape(std::string_view api, const MoeShape& shape);

struct MoeOptions {
  // Run a kernel that no device run has verified yet (<entry>_verified_on unpublished: the CUDA
  // module's, until the device check flips them). Without it such a kernel is Error(kUnavailable).
  bool allow_unverified = false;
};

// ids (int32 [tokens, top_k]) and weights (FP32 [tokens, top_k]) of each token's top_k experts,
// best first (ties: the lower expert), from logits (FP32 [tokens, experts]). Throws
// Error(kInvalidArgument) naming the bad value (top_k outside 1..min(32, allowed experts), groups
// not dividing experts or above 64, topk_groups outside 1..groups, a bias or grouping on another
// scoring, a scoring that is no MoeScoring, a scale that is not finite, a buffer null, misaligned
// (4 bytes) or outside the backend's allocations).
void moe_route(Backend& backend, StreamHandle stream, DevicePtr logits, const MoeShape& shape,
               const MoeRouting& routing, DevicePtr ids, DevicePtr weights,
               const MoeOptions& options = {});

// The rows of the permuted activations, all int32 device buffers.
struct MoeRows {
  DevicePtr counts;   // [experts]: rows expert e holds
  DevicePtr offsets;  // [experts + 1]: expert e's first row; [experts]: the end of the last
  DevicePtr rows;     // [tokens · top_k]: each (token, slot)'s row, -1 for an id outside [0, E)
};

// rows from ids (int32 [tokens, top_k]): expert by expert, each expert's entries in (token, slot)
// order. An id outside [0, experts) gets no row and is left out of the counts.
void moe_align(Backend& backend, StreamHandle stream, DevicePtr ids, const MoeShape& shape,
               const MoeRows& rows, const MoeOptions& options = {});

// The gated activation between the grouped gate_up and down GEMMs (Note [MoE routing]).
enum class MoeGlu {
  kSilu,           // Qwen3-MoE, Mixtral, DeepSeek: a row [gate | up]; SiLU(gate) · up
  kClampedSwiglu,  // gpt-oss: gate the even, up the odd columns; gate <= limit, |up| <= limit;
                   // gate · σ(alpha · gate) · (up + 1)
};

struct MoeActivation {
  MoeGlu glu = MoeGlu::kSilu;
  float alpha = 1.702f, limit = 7.0f;  // kClampedSwiglu: gpt-oss's values
};

// act[r] from y[r] for every row r that holds an expert's entry (by moe_align's counts and
// offsets in rows), in FP32 and rounded once to BF16: y BF16 [row_capacity, 2 · inter], act BF16
// [row_capacity, inter] (rows of no entry left as they are). inter a multiple of 8, y and act
// 16-byte aligned, not overlapping; alpha finite, limit positive (kClampedSwiglu).
void moe_glu(Backend& backend, StreamHandle stream, DevicePtr y, const MoeShape& shape,
             std::int64_t inter, const MoeActivation& activation, const MoeRows& rows,
             DevicePtr act, const MoeOptions& options = {});

// Each expert's own order of x's columns, for experts whose weights read A in it (act-ordered
// INT4 experts: GroupedWeights::k_order; Note [Experts' act order]).
struct MoeColumnOrder {
  DevicePtr ids;      // int32 [tokens, top_k]: each (token, slot)'s expert, as moe_align took it
  DevicePtr columns;  // int32 [experts, width]: expert e's row c takes x's column columns[e, c]
};

// x_perm[rows[t, j]] = x[t] for every (token, slot) with a row: x BF16 [tokens, width], x_perm BF16
// [row_capacity, width] (rows without an entry left as they are). width a multiple of 8, x and
// x_perm 16-byte aligned. With `order` (both or neither of its buffers, 4-byte aligned),
// x_perm[rows[t, j], c] = x[t, columns[ids[t, j], c]]; a column outside [0, width) gives 0.
void moe_gather(Backend& backend, StreamHandle stream, DevicePtr x, const MoeShape& shape,
                std::int64_t width, DevicePtr rows, DevicePtr x_perm,
                const MoeOptions& options = {}, const MoeColumnOrder& order = {});

// out[t] = Σ_j weights[t, j] · y[rows[t, j]] over the slots with a row, summed in FP32 in slot
// order and rounded once to BF16: y BF16 [row_capacity, width], out BF16 [tokens, width].
void moe_combine(Backend& backend, StreamHandle stream, DevicePtr y, const MoeShape& shape,
                 std::int64_t width, DevicePtr rows, DevicePtr weights, DevicePtr out,
                 const MoeOptions& options = {});

}  // namespace metrale::ops
