// The grouped W8A8 GEMM of a mixture-of-experts layer whose experts are FP8 block-128 (DeepSeek-V3,
// Qwen3-MoE FP8): every expert's block-scaled FP8 GEMM over the rows routed to it, in one launch
// after one activation cast (plan → run, as ops/fp8_gemm.h and ops/grouped_gemm.h). A holds the
// tokens permuted into expert order (ops/moe.h); it is cast to E4M3 with one FP32 scale per row
// per 128 K (module "fp8"'s cast_e4m3_block128, the dense W8A8 op's cast), then expert e
// multiplies its rows [offsets[e], offsets[e] + counts[e]) by its own weights (module "fp8"'s
// gemm_grouped_e4m3_block128): the dense W8A8 op's product per expert (docs/CONTRACT.md, W8A8
// GEMM), with counts and offsets read on the device, so a plan never depends on the routing.
// cuBLASLt has no grouped GEMM with block scales, so both backends run a kernel of their own.
#pragma once

#include <cstdint>
#include <source_location>
#include <span>
#include <string>

#include "metrale/backend.h"
#include "metrale/e4m3_block.h"
#include "metrale/model_scope.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/gemm.h"  // GemmRoute
#include "metrale/ops/quant_weights.h"

namespace metrale::ops {

// E experts' E4M3 weights of one shape, each tensor in one buffer with the experts laid end to
// end (expert e's codes at codes + e · codes_stride, its scales likewise, in Fp8Weights' device
// layout).
// kPanels: each expert's codes in the CPU's panel layout (src/kernels/fp8_panel_layout.h, Note
// [E4M3 panels]) instead of row-major, fp8_panels::bytes(N, K) of them; its scales as ever.
struct GroupedFp8Weights {
  Fp8Weights expert;  // every expert's shape and byte sizes, with expert 0's buffers
  std::int32_t experts = 0;
  std::uint64_t codes_stride = 0, scales_stride = 0;  // bytes, multiples of 256
  WeightPacking packing = WeightPacking::kSource;     // kSource or kPanels
  // Expert e as weights of its own, for ops/fp8_gemm.h (buffers inside this one's);
  // Error(kInvalidArgument) for e outside [0, experts) or experts in the panel layout, which the
  // dense W8A8 op does not read.
  Fp8Weights view(std::int32_t e) const;
};

// Whether backend's grouped W8A8 kernel reads experts in the panel layout (it publishes `panels`:
// the CPU module).
bool reads_fp8_panel_layout(Backend& backend);

// E experts' host E4M3 weights uploaded as GroupedFp8Weights, owned as a model resource: two
// allocations, each expert's scales repacked into the device layout as Fp8WeightsResource does.
class GroupedFp8WeightsResource final : public ModelResource {
 public:
  // experts: each expert's codes [N, K] and the checkpoint's FP32 multipliers [ceil(N/128),
  // ceil(K/128)], one shape for all (views may share buffers). Checks the count, shapes and sizes
  // (Error(kInvalidArgument) naming the expert and what is wrong), allocates and fills in the
  // layout `upload` chooses; on any failure frees what it allocated and throws. upload: kSource
  // row-major codes; kPanels the panel layout, with K a multiple of 16 (else
  // Error(kInvalidArgument)) on a backend that reads it (else Error(kUnavailable));
  // kBackendPreferred the panel layout where both hold, else row-major; kDecode is refused
  // (Error(kInvalidArgument)): FP8 experts have no decode layout.
  GroupedFp8WeightsResource(Backend& backend, std::span<const E4m3BlockWeightsView> experts,
                            std::string label = "fp8 experts",
                            UploadLayout upload = UploadLayout::kSource,
                            std::source_location loc = std::source_location::current());
  std::string label() const override { return label_; }
  // Frees both buffers (the second even when the first free fails); a second call does nothing.
  void release(Backend& backend) override;
  const GroupedFp8Weights& weights() const noexcept { return w_; }
  // Seconds the upload spent rearranging the codes into the panel layout (0 for row-major).
  double pack_seconds() const noexcept { return pack_seconds_; }

 private:
  std::string label_;
  GroupedFp8Weights w_;
  double pack_seconds_ = 0.0;
};

struct GroupedFp8Options {
  bool bias = false;     // run() takes a BF16 bias [experts, N]
  bool out_f32 = false;  // C as FP32, the sum not rounded (Fp8GemmOptions::out_f32)
  // kDecode: gemm_grouped_e4m3_block128, which reads an expert's weights once per 2 of its rows
  // (the CPU's one kernel). kTiled: gemm_grouped_e4m3_block128_tiled, tiles of 128 rows on the
  // FP8 tensor cores (CUDA sm_90a; a placeholder elsewhere, refused). kAuto: kTiled where the
  // backend has it verified and the rows per expert on average reach its published _min_m, else
  // kDecode. Other routes are Error(kInvalidArgument).
  GemmRoute route = GemmRoute::kAuto;
  // Run a kernel no device run has verified (the CUDA module's, today); without it such a kernel
  // is Error(kUnavailable).
  bool allow_unverified = false;
};

// Everything decided before a grouped W8A8 GEMM runs; reusable for any routing of its row capacity
// on any stream. Its fields are for reading.
struct GroupedFp8Plan {
  Backend* backend = nullptr;
  std::int64_t rows = 0, n = 0, k = 0;  // rows: of A and C, the row capacity
  std::int32_t experts = 0;
  bool bias = false, out_f32 = false;
  WeightPacking packing = WeightPacking::kSource;  // of the weights it was made for
  GemmRoute route = GemmRoute::kDecode;            // kDecode or kTiled, as chosen
  PlannedLaunch cast;                              // fp8::cast_e4m3_block128 over all rows
  // kDecode: fp8::gemm_grouped_e4m3_block128, grid (N tiles, experts); kTiled:
  // fp8::gemm_grouped_e4m3_block128_tiled, one wave (or fewer blocks) walking the layer's tiles.
  PlannedLaunch gemm;
  Fp8WorkspaceBytes workspace;  // the cast A and its scales (no dense part)
  // One line, e.g. "grouped w8a8 rows=64 N=1536 K=2048 x 128 experts: fp8::cast_e4m3_block128
  // 16x1x1 x 256 threads, fp8::gemm_grouped_e4m3_block128 24x128x1 x 256 threads; workspace ...".
  std::string describe() const;
};

// Plans C[rows, N] = expert-wise e4m3(A) · Wₑᵀ (+ biasₑ): checks the row capacity and the weights
// (K a multiple of 16: the GPU kernels read 16 codes at a time), chooses the route and sizes both
// launches from what their kernels publish; the tiled route's grid from the row capacity alone.
// Throws Error(kInvalidArgument) for bad shapes, weights or route, Error(kUnavailable) for a
// kernel no device verified without allow_unverified (or one that does not write FP32 C when
// out_f32 asks it, reads no weights in the panel layout given, or is a placeholder on this
// target; for kTiled on a backend without the tiled kernel), Error(kNotFound) for another missing
// kernel. Launches nothing.
GroupedFp8Plan plan_grouped(Backend& backend, std::int64_t rows, const GroupedFp8Weights& w,
                            const GroupedFp8Options& options = {});

// Queues the planned GEMM on stream: A BF16 [rows, K], C [rows, N] (BF16, FP32 with out_f32),
// counts int32 [experts], offsets int32 [experts + 1] (moe_align's), bias BF16 [experts, N] when
// planned, the workspace the plan sizes (scratch_workspace); all inside the backend's
// allocations, C and the workspace overlapping no input, weights of the shape and layout the plan
// was made for.
// Rows of no expert are cast but not written in C; an expert whose rows a caller's counts and
// offsets put outside [0, rows) is skipped. A plan whose launches or workspace are not those
// plan_grouped makes for its own rows, N, K and experts (an edited plan) is refused. When it
// throws, C is unwritten: a refused argument queues nothing, and a failed GEMM launch leaves the
// cast queued into the workspace.
void run_grouped(const GroupedFp8Plan& plan, StreamHandle stream, DevicePtr a,
                 const GroupedFp8Weights& w, DevicePtr counts, DevicePtr offsets, DevicePtr c,
                 const Fp8Workspace& workspace, DevicePtr bias = {});

// The workspace of plan for work queued on stream: the OpCache's grow-only scratch under
// gemm_scratch_tag, the dense W8A8 op's tags ("w8a8_activation", "w8a8_activation_scales").
Fp8Workspace scratch_workspace(const GroupedFp8Plan& plan, StreamHandle stream);

}  // namespace metrale::ops
