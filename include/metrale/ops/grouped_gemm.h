// The grouped quantized GEMM of a mixture-of-experts layer: every expert's GEMM over the rows
// routed to it, in one launch (plan → run, as ops/gemm.h). A holds the tokens permuted into expert
// order (ops/moe.h, moe_gather); expert e's rows are [offsets[e], offsets[e] + counts[e]), read on
// the device, so the plan depends on the row capacity and the weights alone, never on the routing
// (contiguous and masked layouts alike; CUDA-graph capturable). C has A's rows: each expert's
// rows hold its output; rows of no expert are left as they are.
#pragma once

#include <cstdint>
#include <source_location>
#include <span>
#include <string>
#include <vector>

#include "metrale/backend.h"
#include "metrale/model_scope.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"

namespace metrale::ops {

// E experts' weights of one format and shape, each tensor in one buffer with the experts laid end
// to end (expert e's codes at codes + e · codes_stride, its scales likewise).
struct GroupedWeights {
  // Every expert's description (format, layout, packing, N, K, INT4 fields), with expert 0's
  // buffers, tensor scale and fold.
  QuantWeights expert;
  std::int32_t experts = 0;
  std::uint64_t codes_stride = 0, scales_stride = 0;  // bytes, multiples of 256
  DevicePtr table;  // FP32 tensor scales [experts], then int32 folds [experts]
  // Act-ordered INT4 experts (GPTQ desc_act): int32 [experts, K], expert e's stored K order
  // (k_perm); its codes are uploaded in that order (in_stored_order), so its rows of A must come
  // gathered in it: moe_gather with MoeColumnOrder (Note [Experts' act order]). Null otherwise.
  DevicePtr k_order;
  std::vector<float> tensor_scales;  // host copies of the table
  std::vector<std::int32_t> folds;
  // Expert e as weights of its own, for ops/gemm.h (buffers inside this one's; with k_order, its
  // K is the stored order: A's columns must come in it); Error (kInvalidArgument) for e outside
  // [0, experts) or a table of another size.
  QuantWeights view(std::int32_t e) const;
};

// Host weights of E experts uploaded as GroupedWeights, owned as a model resource: three
// allocations (codes, scales, the table), and k_order for act-ordered experts, each expert
// rearranged as WeightsResource would (UploadLayout) and copied into its place.
class GroupedWeightsResource final : public ModelResource {
 public:
  // Checks that every expert has expert 0's format, shape, layout and INT4 fields (act order on
  // all experts or none, each a whole layer's), then allocates and fills; on any failure frees
  // what it allocated and throws (Error(kInvalidArgument) naming the expert).
  GroupedWeightsResource(Backend& backend, std::span<const HostQuantWeights> experts,
                         std::string label = "experts", UploadLayout upload = UploadLayout::kSource,
                         std::source_location loc = std::source_location::current());
  std::string label() const override { return label_; }
  // Frees the buffers (each even when another fails); a second call does nothing.
  void release(Backend& backend) override;
  const GroupedWeights& weights() const noexcept { return w_; }

 private:
  std::string label_;
  GroupedWeights w_;
};

struct GroupedGemmOptions {
  bool bias = false;     // run() takes a BF16 bias [experts, N]
  bool out_f32 = false;  // C as FP32 (GemmOptions::out_f32)
  // kDecode: the decode kernel of the weights' layout, per expert (every packing). kFused: the
  // prefill kernel over every expert's tiles, for weights in the decode layout (CUDA:
  // gemm_grouped_fused, wgmma; INT4 in the INT4 decode layout: gemm_grouped_int4_fused, which
  // rounds each weight to BF16 once as the dense dequant route does; Error(kUnavailable) where the
  // module has only its placeholder).
  // kAuto: kFused where the rows per expert on average pass the decode sizes and the module's
  // fused kernel is verified (the CPU's twin is the reference), else kDecode. Other routes are
  // Error(kInvalidArgument).
  GemmRoute route = GemmRoute::kAuto;
  // Run a kernel no device run has verified (the CUDA module's, today); without it such a kernel
  // is Error(kUnavailable).
  bool allow_unverified = false;
  // The caller gives each expert's rows of A in the expert's K order (GroupedWeights::k_order):
  // required for weights that have one, refused for weights that do not.
  bool a_in_k_order = false;
  // The most rows a routing gives the experts in all (tokens x top k), where the layout holds
  // more (the masked one: experts x capacity); 0: the row capacity. Only split-K reads it, to
  // bound the experts that can have rows: a routing past it is still computed exactly, with
  // the split planned for fewer. Error(kInvalidArgument) outside [0, rows].
  std::int64_t routed_rows = 0;
};

// Everything decided before a grouped GEMM runs; reusable for any routing of its row capacity on
// any stream. Its fields are for reading.
struct GroupedGemmPlan {
  Backend* backend = nullptr;
  std::int64_t rows = 0, n = 0, k = 0;  // rows: of A and C, the row capacity
  std::int32_t experts = 0;
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  WeightPacking packing = WeightPacking::kSource;
  std::int64_t group = 0;
  // Every expert's description as planned (no buffers): run() refuses weights described otherwise.
  QuantWeights expert;
  bool bias = false, out_f32 = false;
  bool a_in_k_order = false;             // planned for act-ordered experts (k_order)
  std::uint32_t flags = 0;               // the kernels' GemmFlags
  GemmRoute route = GemmRoute::kDecode;  // kDecode or kFused, as chosen
  // Grid (N tiles, experts, K slices); for a persistent kernel (gemm_grouped_fused) one wave of
  // blocks, or fewer where the row capacity cannot make that many tiles.
  PlannedLaunch launch;
  // Split-K (the decode route, where the kernel publishes _split_k): K in `splits` slices of
  // k_per_split, sized from the blocks the experts that can have rows make (at most min(experts,
  // rows) of them, whatever the routing) against the device's waves. Each slice writes FP32
  // partials, `workspace_bytes` = splits x rows x N x 4, which `reduce`
  // (gemm_grouped_split_reduce, grid (N / its tile, experts)) sums into C in slice order.
  std::int64_t splits = 1, k_per_split = 0;
  std::uint64_t workspace_bytes = 0;
  PlannedLaunch reduce;  // empty without split-K
  // One line, e.g. "grouped rows=4 N=5760 K=2880 x 32 experts: w4a16::gemm_grouped 180x32x2 x
  // 256 threads, w4a16::gemm_grouped_split_reduce 23x32x1 x 256 threads; split-K 2 x 2048;
  // workspace 184320 B".
  std::string describe() const;
};

// Plans C[rows, N] = expert-wise A · dequant(W_e)ᵀ (+ bias_e): checks the row capacity and the
// weights (as plan() does for one expert), picks the module's grouped kernel for their packing and
// sizes the launch from what it publishes. Throws Error(kInvalidArgument) for bad shapes or
// weights (act-ordered ones without options.a_in_k_order, or that option for others),
// Error(kUnavailable) for weights the backend's grouped kernel does not read or a kernel no device
// verified without allow_unverified, Error(kNotFound) for a missing kernel. Launches nothing.
GroupedGemmPlan plan_grouped(Backend& backend, std::int64_t rows, const GroupedWeights& w,
                             const GroupedGemmOptions& options = {});

// The scratch of one grouped run: the split-K partials (GroupedGemmPlan::workspace_bytes; null
// where the plan does not split K).
struct GroupedGemmWorkspace {
  DevicePtr split_k;
};

// Queues the planned GEMM on stream: A BF16 [rows, K], C [rows, N] (BF16, FP32 with out_f32),
// counts int32 [experts], offsets int32 [experts + 1] (moe_align's), bias BF16 [experts, N]
// when planned, the workspace the plan sizes (scratch_workspace); all inside the backend's
// allocations, C and the workspace overlapping no input nor each other, weights those the plan
// was made for. An expert whose rows a caller's counts and offsets put outside [0, rows) is
// skipped by the kernels, never read or written outside A, C and the workspace. When it throws,
// C is unwritten: a refused argument queues nothing, and a failed reduction launch leaves the
// split GEMM queued into the workspace.
void run_grouped(const GroupedGemmPlan& plan, StreamHandle stream, DevicePtr a,
                 const GroupedWeights& w, DevicePtr counts, DevicePtr offsets, DevicePtr c,
                 const GroupedGemmWorkspace& workspace, DevicePtr bias = {});

// The workspace of plan for work queued on stream: the OpCache's grow-only scratch under
// gemm_scratch_tag (the dense op's "gemm_split_k"), null where the plan does not split K.
GroupedGemmWorkspace scratch_workspace(const GroupedGemmPlan& plan, StreamHandle stream);

}  // namespace metrale::ops
