// Quantized GEMM ops on any backend, in two steps (CUTLASS's can-implement → workspace → run):
// plan() checks the shapes, chooses the route from M and from what the backend's modules offer,
// resolves the kernels through the OpCache and sizes each launch from what its kernel publishes;
// run() checks the buffers and launches. w4a16_gemm is run(plan(...)) with OpCache scratch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/op_cache.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"

namespace metrale::ops {

// Whether the caller accepts A cast to E4M3 (FP8 tensor cores) or needs exact BF16 activations.
enum class Activations { kExactBf16, kAllowE4m3 };

enum class GemmRoute {
  kAuto,    // choose from M and the backend's modules
  kDecode,  // small M: weights streamed once, dequantized in registers
  kTiled,   // large M: tiles of dequantized weights reused across rows of A
  kE4m3,    // A cast to E4M3, weights as E4M3, FP8 products, FP32 group scales
  // Large M, exact BF16 activations: the weights dequantized to BF16 W [N, K] (tensor scale
  // folded in, rounded once), then the backend's dense BF16 GEMM with the bias in its epilogue.
  // Needs the backend's dense GEMM; kAuto takes it from the M its dequant_bf16 publishes
  // (<fn>_min_m; none: never).
  kDequant,
  // Large M on weights in the decode layout: one warp-specialized kernel that dequantizes the
  // weights in registers and feeds them to the tensor cores as the register operand (CUDA:
  // gemm_fused, wgmma with A from registers). kAuto takes it for decode-layout weights above the
  // decode sizes, where the module has it verified on a device. On targets without wgmma the
  // entry is a placeholder (gemm_fused_absent) and asking for this route is Error(kUnavailable).
  kFused,
};
// "auto", "decode", "tiled", "e4m3", "dequant", "fused".
std::string_view to_string(GemmRoute route) noexcept;

struct GemmOptions {
  Activations activations = Activations::kExactBf16;
  GemmRoute route = GemmRoute::kAuto;
  DevicePtr bias;  // BF16 [N], optional
  // C as FP32 [M, N], the sum after tensor scale and bias with no rounding: a row-parallel
  // rank's partial (ops/parallel_linear.h), rounded once after the ranks' sum. Only where the
  // kernel that writes C publishes out_f32 (the CPU's); kAuto then never takes the dequant
  // route, whose dense GEMM writes BF16.
  bool out_f32 = false;
};

// The smallest M at which the e4m3 route can pay for its cast (below it the cast costs more than
// the FP8 rate saves): where the benchmarks start timing it. kAuto takes the route only from the
// M gemm_e4m3 publishes as its smallest (<fn>_min_m), and neither built-in module publishes one:
// both e4m3 kernels measured slower than the exact routes (docs/PERF.md), so kAuto never takes
// it there, whatever the caller allows.
inline constexpr std::int64_t kE4m3MinM = 64;

// One kernel launch of a plan, sized from what its kernel published.
struct PlannedLaunch {
  ResolvedKernel kernel;
  Dim3 grid, block;
  std::uint32_t smem_bytes = 0;
};

// Scratch a planned GEMM needs, in bytes; 0 for a part it does not use.
struct GemmWorkspaceBytes {
  std::uint64_t split_k = 0;  // FP32 partials [splits, M, N]
  std::uint64_t a_e4m3 = 0;   // the e4m3 route's cast A [M, K]
  std::uint64_t w_e4m3 = 0;   // the e4m3 route's E4M3 weights [N, K]
  std::uint64_t w_bf16 = 0;   // the dequant route's BF16 weights [N, K]
  std::uint64_t dense = 0;    // the dequant route's dense GEMM workspace (its plan's)
  std::uint64_t a_perm = 0;   // act-ordered INT4, every route: A [M, K] BF16 in the stored order
  // All parts laid end to end in one buffer, each on a 256-byte boundary (GemmWorkspace::carve).
  std::uint64_t total() const noexcept;
};

// The scratch buffers of one run; each at least the planned bytes (null where 0 are planned).
struct GemmWorkspace {
  DevicePtr split_k, a_e4m3, w_e4m3, w_bf16, dense, a_perm;
  // The parts of one buffer of at least bytes.total() bytes, in the order total() lays them out.
  static GemmWorkspace carve(DevicePtr base, const GemmWorkspaceBytes& bytes);
};

// Everything decided before a GEMM runs: checked shapes, the route, the resolved kernels with
// their published launch shapes, the grid, the split of K and the workspace. Valid for the
// backend it was made on until that backend's OpCache is released (run() then refuses it; it
// must not outlive the backend object itself); reusable on any stream for any A and C of its M
// and any weights of its shape, format and layout. Its fields are for reading: run() refuses a
// plan whose launches or workspace no longer fit its route, M, N, K and split.
struct GemmPlan {
  Backend* backend = nullptr;
  GemmRoute route = GemmRoute::kAuto;
  std::int64_t m = 0, n = 0, k = 0;
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  WeightPacking packing = WeightPacking::kSource;
  std::int32_t fold = 0;   // the weights' (QuantWeights::fold)
  std::int64_t group = 0;  // INT4: the weights' K per scale (QuantWeights::group)
  bool bias = false;
  bool out_f32 = false;     // C is FP32 (GemmOptions::out_f32)
  std::uint32_t flags = 0;  // the kernels' GemmFlags
  std::int64_t splits = 1, k_per_split = 0;
  // In launch order: [cast, dequant,] gemm[, split reduce]; the dequant route: its dequant.
  std::vector<PlannedLaunch> launches;
  // The dequant route's dense BF16 GEMM (C = A · W_bf16ᵀ + bias), run after the launches; the
  // backend's own plan for the shape (memoized by it). Empty on every other route.
  std::optional<DenseGemmPlan> dense;
  GemmWorkspaceBytes workspace;

  // One line, e.g. "decode M=1 N=4096 K=4096: w4a16::gemm_decode 128x1x4 x 256 threads,
  // w4a16::gemm_split_reduce 16x1x1 x 256 threads; split-K 4 x 1024; workspace 65536 B".
  std::string describe() const;
};

// Plans C[M, N] = A[M, K] · dequant(W)ᵀ (+ bias) on backend (K: a_columns(w), fewer than w.k for a
// padded act-order K slice): checks M and the weights' shape and
// sizes, chooses the route, resolves the kernels and sizes every launch from their published
// metadata. kAuto on weights in the decode layout: decode up to the M gemm_decode publishes as
// its largest, fused above it where the module has gemm_fused. kAuto takes gemm_fused, gemm_e4m3
// and dequant_bf16 only where their kernel is one a device run verified (published
// <entry>_verified_on; the CPU's host modules are the reference and count as verified); an
// unverified kernel runs when its route is asked for. On the source layout: e4m3 when
// the caller allows it and M ≥ what gemm_e4m3 publishes as its smallest (none: never); else
// decode up to gemm_decode's largest M; else dequant from the M dequant_bf16 publishes as its
// smallest where the backend has a dense BF16 GEMM; else tiled. So kAuto needs the module's
// gemm_decode, which both backends' modules have. Throws Error(kInvalidArgument) for bad shapes
// or options, Error(kNotFound) naming a kernel that is missing or publishes no tile or block
// size, Error(kUnavailable) with the backend's reason for kDequant on a backend without a dense
// BF16 GEMM, or for a route whose kernel is a placeholder on this target. Launches nothing.
GemmPlan plan(Backend& backend, std::int64_t m, const QuantWeights& w,
              const GemmOptions& options = {});

// Queues the planned GEMM on stream: checks that the weights match the plan, that A, C, the
// weights and the bias lie inside the backend's allocations (alignment, overlap, sizes), and
// that each workspace part lies inside one of the backend's own allocations, clear of every
// other buffer, and that the plan still fits itself (its launches, workspace, flags and K slices
// are those plan() makes for its route and shape: an edited plan is refused with
// Error(kInvalidArgument)); then launches. No lookup, no lock of the op layer and no formatting
// when it succeeds. A workspace must not be in use by work on another stream (scratch_workspace
// keeps one set per stream).
void run(const GemmPlan& plan, StreamHandle stream, DevicePtr a, const QuantWeights& w, DevicePtr c,
         const GemmWorkspace& workspace, DevicePtr bias = {});

// The workspace of plan for work queued on stream: the OpCache's grow-only scratch under
// gemm_scratch_tag ("gemm_split_k", "fp8_activation", "fp8_weights", "dequant_weights",
// "blas_workspace"), null for parts the plan does not use.
GemmWorkspace scratch_workspace(const GemmPlan& plan, StreamHandle stream);

// The route plan() would take for M and options, whatever the weights (throws as plan() would
// for a route the backend lacks or the options forbid).
GemmRoute choose_route(Backend& backend, std::int64_t m, const QuantWeights& w,
                       const GemmOptions& options = {});

// The largest M for which kAuto takes the decode route on backend: what its gemm_decode
// publishes (<fn>_max_m).
std::int64_t decode_max_m(Backend& backend);

// C[M, N] (BF16, row-major) = A[M, a_columns(w)] (BF16, row-major) · dequant(W)ᵀ (+ bias), queued
// on stream: run(plan(...)) with the workspace from the OpCache under gemm_scratch_tag. A, C and
// the weight buffers 16-byte aligned; C overlaps no input.
void w4a16_gemm(Backend& backend, StreamHandle stream, DevicePtr a, std::int64_t m,
                const QuantWeights& w, DevicePtr c, const GemmOptions& options = {});

// The OpCache tag under which w4a16_gemm keeps scratch `base` ("fp8_activation", "fp8_weights",
// "gemm_split_k", "dequant_weights", "blas_workspace") for work queued on `stream`: base itself on
// the backend's default stream, "base@<stream>" on any other, so GEMMs on two streams never share a
// buffer.
std::string gemm_scratch_tag(Backend& backend, StreamHandle stream, std::string_view base);

// out[i] (E4M3) = RNE-saturating cast of in[i] (BF16), no scale (docs/CONTRACT.md, E4M3 cast).
void cast_bf16_to_e4m3(Backend& backend, StreamHandle stream, DevicePtr in, DevicePtr out,
                       std::int64_t count);

}  // namespace metrale::ops
