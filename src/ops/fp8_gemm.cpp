// The W8A8 block-scaled FP8 GEMM: module "fp8"'s activation cast, then the backend's dense GEMM
// of kind kE4m3Block128 on the cast A and the E4M3 weights.
#include "metrale/ops/fp8_gemm.h"

#include <fmt/format.h>

#include <array>
#include <initializer_list>

#include "core/nvtx.h"
#include "kernels/fp8_cast.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "ops/buffer_checks.h"

namespace metrale::ops {
namespace {

constexpr std::string_view kModule = "fp8";
constexpr std::string_view kCast = "cast_e4m3_block128";
// The cast writes the scales the dense GEMM reads: the same padded leading dimension.
static_assert(fp8::scales_ld(1) == dense_a_scales_ld(1) &&
              fp8::scales_ld(4) == dense_a_scales_ld(4) &&
              fp8::scales_ld(5) == dense_a_scales_ld(5) &&
              fp8::scales_ld(7) == dense_a_scales_ld(7));
// The weights' shape, byte sizes and buffers.
void check_weights(std::string_view api, const Fp8Weights& w) {
  const Fp8Weights need = describe_fp8_weights(api, w.n, w.k);
  if (w.codes_bytes != need.codes_bytes) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weight codes are {} bytes; E4M3 {}x{} needs {} ([N, K])",
                            w.codes_bytes, w.n, w.k, need.codes_bytes));
  }
  if (w.scales_bytes != need.scales_bytes) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weight scales are {} bytes; E4M3 {}x{} needs {} (FP32 "
                            "[ceil(N/128), round_up(ceil(K/128), 4)], the device layout)",
                            w.scales_bytes, w.n, w.k, need.scales_bytes));
  }
  check_pointer(api, "weight codes", w.codes);
  check_pointer(api, "weight scales", w.scales);
}

// M, the weights, and the sizes of A and C (dense_gemm_bytes counts them in 64 bits).
DenseGemmShape check_args(std::string_view api, std::int64_t m, const Fp8Weights& w, bool bias,
                          bool out_f32) {
  if (m < 1)
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("M = {}; it must be at least 1", m));
  check_weights(api, w);
  const DenseGemmShape shape{DenseKind::kE4m3Block128, m, w.n, w.k, bias, out_f32};
  const DenseGemmBytes b = dense_gemm_bytes(api, shape);
  if (b.a > UINT64_MAX / 2) {  // A is BF16 here: twice the dense GEMM's E4M3 A
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("A would be {} x {} x 2 bytes, more than 64 bits can count", m, w.k));
  }
  return shape;
}

// check_call_buffers for W: A [M, K] BF16 and C as the dense shape sizes it (check_args counted
// both in 64 bits).
CallRanges check_buffers(std::string_view api, Backend& backend, const DenseGemmShape& shape,
                         const Fp8Weights& w, DevicePtr a, DevicePtr c, DevicePtr bias) {
  const auto um = static_cast<std::uint64_t>(shape.m), un = static_cast<std::uint64_t>(w.n),
             uk = static_cast<std::uint64_t>(w.k);
  return check_call_buffers(api, backend, a, um * uk * 2, c, dense_gemm_bytes(api, shape).c,
                            w.codes, w.codes_bytes, w.scales, w.scales_bytes, bias, un * 2);
}

Fp8GemmPlan plan_checked(std::string_view api, Backend& backend, const DenseGemmShape& shape) {
  if (std::string why = backend.dense_gemm_unavailable(shape.kind); !why.empty()) {
    throw Error(ErrorCode::kUnavailable, api,
                fmt::format("the W8A8 GEMM needs the backend's {} dense GEMM: {}",
                            to_string(shape.kind), why));
  }
  Fp8GemmPlan p;
  p.backend = &backend;
  p.m = shape.m;
  p.n = shape.n;
  p.k = shape.k;
  p.bias = shape.bias;
  p.out_f32 = shape.out_f32;
  const ResolvedKernel& cast = backend.op_cache().kernel(backend, kModule, kCast);
  if (cast.meta.block_threads == 0) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} publishes no block size (its <entry>_block_threads symbol is "
                            "missing or 0); a launcher cannot assume one",
                            backend.kernel_name(cast)));
  }
  const std::uint64_t tile = backend.kernel_n_tile(cast);
  const auto kblocks = static_cast<std::uint64_t>(dense_scale_blocks(shape.k));
  const std::uint64_t pairs = static_cast<std::uint64_t>(shape.m) * kblocks;
  const std::uint64_t blocks = (pairs + tile - 1) / tile;
  if (blocks > 0x7FFFFFFFu) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("M = {} x {} K blocks needs {} blocks of {}; one launch holds at most "
                            "2^31 - 1",
                            shape.m, kblocks, blocks, tile));
  }
  p.cast = PlannedLaunch{cast, Dim3{static_cast<std::uint32_t>(blocks)},
                         Dim3{cast.meta.block_threads}, 0};
  p.dense = backend.plan_dense_gemm(shape);
  const DenseGemmBytes b = dense_gemm_bytes(api, shape);
  p.workspace.a_codes = b.a;
  p.workspace.a_scales = b.a_scales;
  p.workspace.dense = p.dense.workspace_bytes;
  std::uint64_t total = 0;
  for (const std::uint64_t part : {b.a, b.a_scales, p.dense.workspace_bytes}) {
    if (part > UINT64_MAX - kWorkspaceAlign ||
        __builtin_add_overflow(total, align_up(part), &total)) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("the workspace of M={} N={} K={} would be more bytes than 64 bits "
                              "can count",
                              shape.m, shape.n, shape.k));
    }
  }
  return p;
}

// The cast, then the dense GEMM, on checked buffers.
void launch_planned(const Fp8GemmPlan& plan, StreamHandle stream, DevicePtr a, const Fp8Weights& w,
                    DevicePtr c, const Fp8Workspace& ws, DevicePtr bias) {
  Backend& backend = *plan.backend;
  const Fp8CastParams cast{a.address(), ws.a_codes.address(), ws.a_scales.address(), plan.m,
                           plan.k};
  backend.launch_typed(plan.cast.kernel, plan.cast.grid, plan.cast.block, plan.cast.smem_bytes,
                       stream, std::array{KernelArg::value(cast)});
  DenseGemmArgs args;
  args.a = ws.a_codes;
  args.b = w.codes;
  args.c = c;
  args.bias = bias;
  args.a_scales = ws.a_scales;
  args.b_scales = w.scales;
  args.workspace = ws.dense;
  args.workspace_bytes = plan.workspace.dense;
  backend.run_dense_gemm(plan.dense, args, stream);
}

}  // namespace

std::uint64_t Fp8WorkspaceBytes::total() const noexcept {
  return align_up(a_codes) + align_up(a_scales) + align_up(dense);
}

Fp8Workspace Fp8Workspace::carve(DevicePtr base, const Fp8WorkspaceBytes& bytes) {
  Fp8Workspace w;
  std::uint64_t at = 0;
  const auto take = [&](std::uint64_t n) {
    if (n == 0) return DevicePtr{};
    const DevicePtr p = base.offset(at);
    at += align_up(n);
    return p;
  };
  w.a_codes = take(bytes.a_codes);
  w.a_scales = take(bytes.a_scales);
  w.dense = take(bytes.dense);
  return w;
}

std::string Fp8GemmPlan::describe() const {
  return fmt::format("w8a8 M={} N={} K={}: {} {}x{}x{} x {} threads, {}; workspace {} B{}", m, n, k,
                     backend->kernel_name(cast.kernel), cast.grid.x, cast.grid.y, cast.grid.z,
                     cast.block.x, dense.describe, workspace.total(), out_f32 ? "; FP32 C" : "");
}

Fp8GemmPlan plan(Backend& backend, std::int64_t m, const Fp8Weights& w,
                 const Fp8GemmOptions& options) {
  constexpr std::string_view api = "plan_w8a8";
  const DenseGemmShape shape =
      check_args(api, m, w, static_cast<bool>(options.bias), options.out_f32);
  if (options.bias) check_pointer(api, "bias", options.bias);
  return plan_checked(api, backend, shape);
}

void run(const Fp8GemmPlan& plan, StreamHandle stream, DevicePtr a, const Fp8Weights& w,
         DevicePtr c, const Fp8Workspace& workspace, DevicePtr bias) {
  constexpr std::string_view api = "run_w8a8";
  const nvtx::Range range("metrale::ops::run (w8a8)");
  if (plan.backend == nullptr || !plan.cast.kernel.handle) {
    throw Error(ErrorCode::kInvalidArgument, api, "the plan is empty (made by no call to plan())");
  }
  Backend& backend = *plan.backend;
  if (backend.op_cache().released()) {
    throw Error(ErrorCode::kState, api,
                "the plan's backend was torn down (its op cache is released); plan again on a "
                "live backend");
  }
  if (w.n != plan.n || w.k != plan.k) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weights are {}x{}; the plan is for {}x{}", w.n, w.k, plan.n, plan.k));
  }
  if (plan.bias != static_cast<bool>(bias)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                plan.bias ? "the plan adds a bias, but bias is null"
                          : "bias is given, but the plan was made without one");
  }
  const DenseGemmShape shape = check_args(api, plan.m, w, plan.bias, plan.out_f32);
  const DenseGemmBytes need = dense_gemm_bytes(api, shape);
  if (!(plan.dense.shape == shape) || plan.workspace.a_codes < need.a ||
      plan.workspace.a_scales < need.a_scales ||
      plan.workspace.dense < plan.dense.workspace_bytes) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("the plan's dense GEMM or workspace does not fit its own M={} N={} "
                            "K={}: make it with plan()",
                            plan.m, plan.n, plan.k));
  }
  const CallRanges r = check_buffers(api, backend, shape, w, a, c, bias);
  const Range rc{"E4M3 A workspace", workspace.a_codes.address(), plan.workspace.a_codes},
      rs{"A scales workspace", workspace.a_scales.address(), plan.workspace.a_scales},
      rd{"dense GEMM workspace", workspace.dense.address(), plan.workspace.dense};
  check_workspace_part(api, backend, rc, workspace.a_codes,
                       {r.a, r.c, r.codes, r.scales, r.bias, rs, rd});
  check_workspace_part(api, backend, rs, workspace.a_scales,
                       {r.a, r.c, r.codes, r.scales, r.bias, rd});
  check_workspace_part(api, backend, rd, workspace.dense, {r.a, r.c, r.codes, r.scales, r.bias});
  launch_planned(plan, stream, a, w, c, workspace, bias);
}

Fp8Workspace scratch_workspace(const Fp8GemmPlan& plan, StreamHandle stream) {
  if (plan.backend == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "scratch_workspace",
                "the plan is empty (made by no call to plan())");
  }
  Backend& backend = *plan.backend;
  OpCache& cache = backend.op_cache();
  const auto part = [&](std::string_view tag, std::uint64_t bytes) {
    return bytes == 0
               ? DevicePtr{}
               : cache.scratch(backend, gemm_scratch_tag(backend, stream, tag), bytes, stream);
  };
  Fp8Workspace ws;
  ws.a_codes = part("w8a8_activation", plan.workspace.a_codes);
  ws.a_scales = part("w8a8_activation_scales", plan.workspace.a_scales);
  ws.dense = part("dense_gemm_workspace", plan.workspace.dense);
  return ws;
}

void w8a8_gemm(Backend& backend, StreamHandle stream, DevicePtr a, std::int64_t m,
               const Fp8Weights& w, DevicePtr c, DevicePtr bias) {
  constexpr std::string_view api = "w8a8_gemm";
  const nvtx::Range range("metrale::ops::w8a8_gemm");
  // Bad arguments are refused before any kernel is looked up or any scratch allocated.
  const DenseGemmShape shape = check_args(api, m, w, static_cast<bool>(bias), false);
  (void)check_buffers(api, backend, shape, w, a, c, bias);
  const Fp8GemmPlan p = plan_checked(api, backend, shape);
  launch_planned(p, stream, a, w, c, scratch_workspace(p, stream), bias);
}

}  // namespace metrale::ops
