// The rules every backend's dense GEMM shares: shape and buffer checks before the library sees
// anything (the library itself bounds-checks nothing).
#include "metrale/dense_gemm.h"

#include <fmt/format.h>

#include <initializer_list>

#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

constexpr std::uint64_t kAlign = 16;

std::uint64_t product(std::string_view api, std::string_view what, std::uint64_t a, std::uint64_t b,
                      std::uint64_t c) {
  std::uint64_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("{} would be {} x {} x {} bytes, more than 64 bits can count", what, a, b, c));
  }
  return abc;
}

struct Part {
  const char* name;
  DevicePtr ptr;
  std::uint64_t bytes;
};

void check_part(std::string_view api, const Backend& backend, const Part& p) {
  if (p.bytes == 0) return;
  if (!p.ptr) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("{} is null", p.name));
  if (p.ptr.address() % kAlign != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} = 0x{:x} is not {}-byte aligned", p.name, p.ptr.address(), kAlign));
  }
  backend.check_range(api, p.name, p.ptr, p.bytes);
}

void check_clear(std::string_view api, const Part& out, std::initializer_list<Part> others) {
  for (const Part& in : others) {
    if (in.bytes == 0 || out.bytes == 0) continue;
    const std::uint64_t a = out.ptr.address(), b = in.ptr.address();
    if (a < b + in.bytes && b < a + out.bytes) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("{} [0x{:x}, +{}) overlaps {} [0x{:x}, +{})", out.name, a, out.bytes,
                              in.name, b, in.bytes));
    }
  }
}

}  // namespace

std::string_view to_string(DenseKind kind) noexcept {
  switch (kind) {
    case DenseKind::kBf16:
      return "bf16";
    case DenseKind::kE4m3Block128:
      return "e4m3-block128";
  }
  return "?";
}

DenseGemmBytes dense_gemm_bytes(std::string_view api, const DenseGemmShape& shape) {
  if (shape.m < 1 || shape.n < 1 || shape.k < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("dense GEMM M={} N={} K={}; each must be at least 1", shape.m, shape.n,
                            shape.k));
  }
  const auto m = static_cast<std::uint64_t>(shape.m), n = static_cast<std::uint64_t>(shape.n),
             k = static_cast<std::uint64_t>(shape.k);
  const bool e4m3 = shape.kind == DenseKind::kE4m3Block128;
  const std::uint64_t elem = e4m3 ? 1 : 2;
  DenseGemmBytes b;
  b.a = product(api, "A", m, k, elem);
  b.b = product(api, "B", n, k, elem);
  b.c = product(api, "C", m, n, shape.out_f32 ? 4 : 2);
  b.bias = shape.bias ? n * 2 : 0;
  if (e4m3) {
    // dense_gemm.h's padded leading dimensions, rounded here in 64 unsigned bits so that no M
    // or K an int64 holds can wrap.
    const std::uint64_t q = kDenseScaleBlock, r = kDenseScaleLdMultiple;
    const auto blocks = [q](std::uint64_t v) { return (v + q - 1) / q; };
    const auto round4 = [r](std::uint64_t v) { return (v + r - 1) / r * r; };
    b.a_scales = product(api, "A's scales", blocks(k), round4(m), sizeof(float));
    b.b_scales = product(api, "B's scales", blocks(n), round4(blocks(k)), sizeof(float));
  }
  return b;
}

std::string Backend::dense_gemm_unavailable(DenseKind kind) const {
  return fmt::format("the {} backend has no dense GEMM library for {}", name(), to_string(kind));
}

DenseGemmPlan Backend::plan_dense_gemm(const DenseGemmShape& shape) {
  constexpr std::string_view api = "plan_dense_gemm";
  (void)dense_gemm_bytes(api, shape);
  if (std::string why = dense_gemm_unavailable(shape.kind); !why.empty())
    throw Error(ErrorCode::kUnavailable, api, why);
  if (op_cache().released()) {
    throw Error(ErrorCode::kState, api, "the backend was torn down (its op cache is released)");
  }
  return plan_dense_gemm_checked(shape);
}

void Backend::run_dense_gemm(const DenseGemmPlan& plan, const DenseGemmArgs& args,
                             StreamHandle stream) {
  constexpr std::string_view api = "run_dense_gemm";
  const DenseGemmBytes need = dense_gemm_bytes(api, plan.shape);
  if (op_cache().released()) {
    throw Error(ErrorCode::kState, api,
                "the plan's backend was torn down (its op cache is released); plan again");
  }
  if (plan.shape.bias != static_cast<bool>(args.bias)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                plan.shape.bias ? "the plan adds a bias, but bias is null"
                                : "bias is given, but the plan was made without one");
  }
  const bool e4m3 = plan.shape.kind == DenseKind::kE4m3Block128;
  if (!e4m3 && (args.a_scales || args.b_scales)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "scales are given, but a bf16 dense GEMM takes none");
  }
  const Part a{"A", args.a, need.a}, b{"B", args.b, need.b}, c{"C", args.c, need.c},
      bias{"bias", args.bias, need.bias}, sa{"A's scales", args.a_scales, need.a_scales},
      sb{"B's scales", args.b_scales, need.b_scales},
      ws{"workspace", args.workspace, plan.workspace_bytes};
  for (const Part& p : {a, b, c, bias, sa, sb}) check_part(api, *this, p);
  check_clear(api, c, {a, b, bias, sa, sb});
  if (plan.workspace_bytes != 0) {
    if (args.workspace_bytes < plan.workspace_bytes) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("workspace_bytes = {}; the plan needs {}", args.workspace_bytes,
                              plan.workspace_bytes));
    }
    check_part(api, *this, ws);
    check_owned_range(api, "workspace", args.workspace, plan.workspace_bytes);
    check_clear(api, ws, {a, b, c, bias, sa, sb});
  }
  run_dense_gemm_checked(plan, args, stream);
}

DenseGemmPlan Backend::plan_dense_gemm_checked(const DenseGemmShape& shape) {
  throw Error(ErrorCode::kUnavailable, "plan_dense_gemm", dense_gemm_unavailable(shape.kind));
}

void Backend::run_dense_gemm_checked(const DenseGemmPlan& plan, const DenseGemmArgs&,
                                     StreamHandle) {
  throw Error(ErrorCode::kUnavailable, "run_dense_gemm", dense_gemm_unavailable(plan.shape.kind));
}

}  // namespace metrale
