// The W8A8 block-scaled FP8 GEMM op, for callers that allow E4M3 activations: A (BF16) is cast
// to E4M3 with one FP32 scale per row per 128 K (module "fp8"'s cast_e4m3_block128), and the
// backend's dense GEMM of kind kE4m3Block128 (cuBLASLt on CUDA sm_90, the "blas" reference on
// the CPU) multiplies it by E4M3 weights with one FP32 scale per 128 x 128 block, writing BF16
// (docs/CONTRACT.md, W8A8 GEMM). Plan, then run, as ops/gemm.h; w8a8_gemm is the one-call form.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <source_location>
#include <span>
#include <string>

#include "metrale/backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/model_scope.h"
#include "metrale/ops/gemm.h"

namespace metrale::ops {

// Device-resident E4M3 weights W[N, K], W[n, k] = e4m3(codes[n, k]) · scale(n/128, k/128).
// Two scale layouts:
//  - host (what upload_fp8_weights and Fp8WeightsResource take): FP32 row-major
//    [ceil(N/128), ceil(K/128)], the DeepSeek-V3 / Qwen FP8 checkpoint's `weight_scale_inv`;
//  - device (scales below): FP32 [ceil(N/128), ldb], ldb = dense_b_scales_ld(K) =
//    round_up(ceil(K/128), 4), scale(nb, kb) at nb·ldb + kb: the dense GEMM's b_scales, what
//    cuBLASLt reads. The pad entries are never read (the upload writes 0 there).
// codes are row-major [N, K] (float8_e4m3fn bytes, the checkpoint's `weight`) in both.
struct Fp8Weights {
  std::int64_t n = 0, k = 0;
  DevicePtr codes;   // codes_bytes bytes
  DevicePtr scales;  // scales_bytes bytes, the device layout
  std::size_t codes_bytes = 0;
  std::size_t scales_bytes = 0;
};

// The byte sizes of N x K weights' codes (N·K) and device scales
// (4·ceil(N/128)·round_up(ceil(K/128), 4)), with no buffers; Error(kInvalidArgument) naming api
// for N or K below 1 or sizes 64 bits cannot count.
Fp8Weights describe_fp8_weights(std::string_view api, std::int64_t n, std::int64_t k);

// Host bytes of E4M3 weights uploaded to a backend (both buffers from alloc_weights, as
// WeightsResource), owned as a model resource; release() frees them once.
class Fp8WeightsResource final : public ModelResource {
 public:
  // Checks that codes are describe_fp8_weights' codes_bytes and scales exactly
  // 4·ceil(N/128)·ceil(K/128) bytes (the host layout: FP32 in the host's byte order), allocates
  // both buffers (the ledger names loc), copies the codes and the scales repacked into the
  // device layout; on any failure frees what it allocated and throws.
  Fp8WeightsResource(Backend& backend, std::span<const std::uint8_t> codes,
                     std::span<const std::uint8_t> scales, std::int64_t n, std::int64_t k,
                     std::string label = "fp8 weights",
                     std::source_location loc = std::source_location::current());
  std::string label() const override { return label_; }
  // Frees both buffers (the second even when the first free fails); a second call does nothing.
  void release(Backend& backend) override;
  // The description the op takes; its buffers are null once released or taken.
  const Fp8Weights& weights() const noexcept { return w_; }
  // Hands the buffers to the caller (who frees them with free_fp8_weights).
  Fp8Weights take() noexcept;

 private:
  std::string label_;
  Fp8Weights w_;
};

// Uploads as Fp8WeightsResource does and hands the buffers to the caller.
Fp8Weights upload_fp8_weights(Backend& backend, std::span<const std::uint8_t> codes,
                              std::span<const std::uint8_t> scales, std::int64_t n, std::int64_t k,
                              std::source_location loc = std::source_location::current());
// Frees what upload_fp8_weights allocated and clears the pointers.
void free_fp8_weights(Backend& backend, Fp8Weights& w);

struct Fp8GemmOptions {
  DevicePtr bias;  // BF16 [N], optional
  // C in FP32 [M, N]: the dense GEMM's FP32 sum (and bias), not rounded; for row-parallel
  // partial sums (metrale/ops/parallel_linear.h). Rounding it to BF16 gives the BF16 C.
  bool out_f32 = false;
};

// Scratch of one W8A8 GEMM, in bytes.
struct Fp8WorkspaceBytes {
  std::uint64_t a_codes = 0;   // the cast A: E4M3 [M, K]
  std::uint64_t a_scales = 0;  // its scales: FP32 [ceil(K/128), round_up(M, 4)]
  std::uint64_t dense = 0;     // the dense GEMM's own (DenseGemmPlan::workspace_bytes)
  // All parts end to end, each on a 256-byte boundary (Fp8Workspace::carve).
  std::uint64_t total() const noexcept;
};

// The scratch buffers of one run; each at least the planned bytes (null where 0 are planned).
struct Fp8Workspace {
  DevicePtr a_codes, a_scales, dense;
  // The parts of one buffer of at least bytes.total() bytes, in the order total() lays them out.
  static Fp8Workspace carve(DevicePtr base, const Fp8WorkspaceBytes& bytes);
};

// Everything decided before a W8A8 GEMM runs: the cast launch (sized from what the cast kernel
// publishes), the backend's dense plan and the workspace. Valid on its backend until that
// backend's OpCache is released; reusable on any stream for any A and C of its M and any weights
// of its N and K.
struct Fp8GemmPlan {
  Backend* backend = nullptr;
  std::int64_t m = 0, n = 0, k = 0;
  bool bias = false;
  bool out_f32 = false;  // C is FP32 (Fp8GemmOptions::out_f32)
  PlannedLaunch cast;
  DenseGemmPlan dense;
  Fp8WorkspaceBytes workspace;
  // One line, e.g. "w8a8 M=5 N=300 K=300: fp8::cast_e4m3_block128 1x1x1 x 256 threads, cpu
  // reference blas::gemm_e4m3_block128; workspace 2048 B".
  std::string describe() const;
};

// Plans C[M, N] = A[M, K] · Wᵀ (+ bias) with A cast to E4M3 per row per 128 K: checks M and the
// weights (shape, buffers present and 16-byte aligned, byte sizes) and the bias pointer, then
// asks the backend. Throws Error(kInvalidArgument) for bad arguments, Error(kUnavailable) with
// the backend's reason when it has no kE4m3Block128 dense GEMM (CUDA without cuBLASLt, or below
// sm_90), Error(kNotFound) when its modules lack fp8::cast_e4m3_block128. Launches nothing.
Fp8GemmPlan plan(Backend& backend, std::int64_t m, const Fp8Weights& w,
                 const Fp8GemmOptions& options);

// Queues the planned GEMM on stream: checks that the weights and bias match the plan, that A, C,
// the weights and the bias are present, 16-byte aligned and inside the backend's allocations, that
// C overlaps no input, and that each workspace part is the backend's own memory clear of every
// other buffer; then launches the cast and the dense GEMM. Nothing is written when it throws.
void run(const Fp8GemmPlan& plan, StreamHandle stream, DevicePtr a, const Fp8Weights& w,
         DevicePtr c, const Fp8Workspace& workspace, DevicePtr bias = {});

// The workspace of plan for work queued on stream: the OpCache's grow-only scratch under
// gemm_scratch_tag ("w8a8_activation", "w8a8_activation_scales", "dense_gemm_workspace").
Fp8Workspace scratch_workspace(const Fp8GemmPlan& plan, StreamHandle stream);

// C[M, N] (BF16, row-major) = A[M, K] (BF16, row-major, cast to E4M3 per row per 128 K) · Wᵀ
// (+ bias), queued on stream: run(plan(...)) with scratch_workspace, every argument checked
// before anything is looked up or allocated.
void w8a8_gemm(Backend& backend, StreamHandle stream, DevicePtr a, std::int64_t m,
               const Fp8Weights& w, DevicePtr c, DevicePtr bias = {});

}  // namespace metrale::ops
