#include "cuda/dense_gemm.h"

#include <fmt/format.h>

#include <cstddef>

#include "core/log.h"
#include "metrale/error.h"

namespace metrale::cuda {
namespace {

// How our row-major contract maps onto cuBLASLt's column-major "TN" call. A row-major [R, C]
// matrix is a column-major C x R matrix with leading dimension C, so our C[M, N] = A · Bᵀ is
// cuBLASLt's D (N x M column-major, ld N) = op(A_lt) · op(B_lt) with
//   A_lt = our B: K x N column-major, ld K, op T (so N x K);
//   B_lt = our A: K x M column-major, ld K, op N;
//   bias  = our bias[N], one per row of D (CUBLASLT_EPILOGUE_BIAS adds it per row of D).
// Block scaling (e4m3-block128), each operand's scales as cuBLASLt reads them, inner dimension
// K for both, each with its leading dimension rounded up to a multiple of 4 (no attribute sets
// it):
//   A_lt (our B, the weights) BLK128x128_32F: one FP32 per 128 x 128 block, [outer blocks,
//     round_up(inner blocks, 4)] with the inner (K) blocks fastest = our b_scales
//     [ceil(N/128), dense_b_scales_ld(K)].
//   B_lt (our A, the activations) VEC128_32F: one FP32 per row per 128 K, outer dimension (M)
//     fastest with ld round_up(M, 4) = our a_scales [ceil(K/128), dense_a_scales_ld(M)].
// The contract's layouts are exactly these (dense_gemm.h), so every shape passes its scale
// pointers through untouched.

std::string shape_str(const DenseGemmShape& s) {
  return fmt::format("{} M={} N={} K={}{}{}", to_string(s.kind), s.m, s.n, s.k,
                     s.bias ? " +bias" : "", s.out_f32 ? " FP32 C" : "");
}

void* ptr(DevicePtr p) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.address()));
}

std::string status_str(const BlasApi& api, cublasStatus_t s) {
  const char* name = api.cublasLtGetStatusName(s);
  return fmt::format("{} ({})", name != nullptr ? name : "CUBLAS_STATUS_?", static_cast<int>(s));
}

[[noreturn]] void fail(const BlasApi& api, std::string_view where, std::string_view call,
                       cublasStatus_t s, const DenseGemmShape& shape) {
  throw Error(ErrorCode::kDriver, where,
              fmt::format("{} returned {} for the dense GEMM {}", call, status_str(api, s),
                          shape_str(shape)));
}

// The matmul descriptor and the three layouts of one shape, destroyed with this object.
struct Descriptors {
  const BlasApi& api;
  std::string_view where;
  const DenseGemmShape& shape;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;

  Descriptors(const BlasApi& lt, std::string_view w, const DenseGemmShape& s)
      : api(lt), where(w), shape(s) {
    check("cublasLtMatmulDescCreate",
          api.cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const std::int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    set("cublasLtMatmulDescSetAttribute(TRANSA)", CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
    set("cublasLtMatmulDescSetAttribute(TRANSB)", CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
    if (shape.bias) {
      const std::uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const std::int32_t bias_type = CUDA_R_16BF;
      set("cublasLtMatmulDescSetAttribute(EPILOGUE)", CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
      set("cublasLtMatmulDescSetAttribute(BIAS_DATA_TYPE)", CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
          bias_type);
    }
    const bool e4m3 = shape.kind == DenseKind::kE4m3Block128;
    if (e4m3) {
      const std::int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const std::int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      set("cublasLtMatmulDescSetAttribute(A_SCALE_MODE)", CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
          a_mode);
      set("cublasLtMatmulDescSetAttribute(B_SCALE_MODE)", CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
          b_mode);
    }
    const cudaDataType_t in = e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    check("cublasLtMatrixLayoutCreate(A)",
          api.cublasLtMatrixLayoutCreate(&a, in, u(shape.k), u(shape.n), shape.k));
    check("cublasLtMatrixLayoutCreate(B)",
          api.cublasLtMatrixLayoutCreate(&b, in, u(shape.k), u(shape.m), shape.k));
    check("cublasLtMatrixLayoutCreate(D)",
          api.cublasLtMatrixLayoutCreate(&d, shape.out_f32 ? CUDA_R_32F : CUDA_R_16BF, u(shape.n),
                                         u(shape.m), shape.n));
  }
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors() {
    for (cublasLtMatrixLayout_t l : {a, b, d}) {
      if (l != nullptr) static_cast<void>(api.cublasLtMatrixLayoutDestroy(l));
    }
    if (desc != nullptr) static_cast<void>(api.cublasLtMatmulDescDestroy(desc));
  }

  void check(std::string_view call, cublasStatus_t s) const {
    if (s != CUBLAS_STATUS_SUCCESS) fail(api, where, call, s, shape);
  }
  template <class T>
  void set(std::string_view call, cublasLtMatmulDescAttributes_t attr, const T& value) {
    check(call, api.cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof value));
  }
};

// "algo 66 tile 24" from the algorithm's configuration (what the library lets us read).
std::string algo_str(const BlasApi& api, const cublasLtMatmulAlgo_t& algo) {
  std::int32_t id = -1;
  std::uint32_t tile = 0;
  std::size_t written = 0;
  std::string out;
  if (api.cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id,
                                               &written) == CUBLAS_STATUS_SUCCESS) {
    out += fmt::format("algo {}", id);
  }
  if (api.cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                               sizeof tile, &written) == CUBLAS_STATUS_SUCCESS) {
    out += fmt::format("{}tile {}", out.empty() ? "" : " ", tile);
  }
  return out.empty() ? "algo ?" : out;
}

}  // namespace

std::string dense_gemm_unavailable(const BlasLoad& blas, ComputeCapability cc, DenseKind kind) {
  if (blas.api == nullptr) return blas.reason;
  if (kind != DenseKind::kE4m3Block128) return {};
  if (cc.major < 9) {
    return fmt::format(
        "cuBLASLt's block-scaled FP8 (e4m3-block128) needs sm_90 or newer; this device is {}",
        cc.str());
  }
  if (blas.version < kBlockScaledBlasVersion) {
    return fmt::format(
        "cuBLASLt {} ({}) has no block-scaled FP8 (e4m3-block128); it needs {} or newer",
        blas_version_string(blas.version), blas.library,
        blas_version_string(kBlockScaledBlasVersion));
  }
  return {};
}

std::string describe_dense_gemms(const BlasLoad& blas, ComputeCapability cc) {
  if (blas.api == nullptr) return fmt::format("none ({})", blas.reason);
  std::string offered, refused;
  for (DenseKind kind : {DenseKind::kBf16, DenseKind::kE4m3Block128}) {
    const std::string why = dense_gemm_unavailable(blas, cc, kind);
    if (why.empty()) {
      offered += fmt::format("{}{}", offered.empty() ? "" : ", ", to_string(kind));
    } else {
      refused += fmt::format("; not {}: {}", to_string(kind), why);
    }
  }
  return fmt::format("cuBLASLt {} ({}): {}{}", blas_version_string(blas.version), blas.library,
                     offered.empty() ? "none" : offered, refused);
}

DenseGemms::~DenseGemms() {
  if (handle_ == nullptr) return;
  host_.bind_quietly();  // a backend may be dropped on a thread that never used it
  if (const cublasStatus_t s = api().cublasLtDestroy(handle_); s != CUBLAS_STATUS_SUCCESS) {
    log::warn("cuda backend: cublasLtDestroy at destruction failed: {}", status_str(api(), s));
  }
}

std::string DenseGemms::unavailable(DenseKind kind) const {
  return dense_gemm_unavailable(host_.blas(), host_.info().cc, kind);
}

cublasLtHandle_t DenseGemms::handle_locked(std::string_view where) {
  if (handle_ != nullptr) return handle_;
  cublasLtHandle_t h = nullptr;
  if (const cublasStatus_t s = api().cublasLtCreate(&h); s != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::kDriver, where,
                fmt::format("cublasLtCreate returned {}", status_str(api(), s)));
  }
  handle_ = h;
  return handle_;
}

DenseGemmPlan DenseGemms::plan(const DenseGemmShape& shape) {
  constexpr std::string_view where = "plan_dense_gemm";
  const Key key{static_cast<int>(shape.kind), shape.m, shape.n, shape.k, shape.bias, shape.out_f32};
  std::lock_guard lock(mu_);
  auto found = index_.find(key);
  if (found == index_.end()) {
    const BlasApi& lt = api();
    const cublasLtHandle_t h = handle_locked(where);
    Descriptors d(lt, where, shape);
    cublasLtMatmulPreference_t pref = nullptr;
    d.check("cublasLtMatmulPreferenceCreate", lt.cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t max_ws = kMaxDenseWorkspace;
    const cublasStatus_t set_status = lt.cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws);
    cublasLtMatmulHeuristicResult_t best{};
    int count = 0;
    const cublasStatus_t s = set_status != CUBLAS_STATUS_SUCCESS
                                 ? set_status
                                 : lt.cublasLtMatmulAlgoGetHeuristic(h, d.desc, d.a, d.b, d.d, d.d,
                                                                     pref, 1, &best, &count);
    static_cast<void>(lt.cublasLtMatmulPreferenceDestroy(pref));
    if (set_status != CUBLAS_STATUS_SUCCESS) {
      fail(lt, where, "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", set_status,
           shape);
    }
    if (s == CUBLAS_STATUS_NOT_SUPPORTED || (s == CUBLAS_STATUS_SUCCESS && count == 0)) {
      throw Error(
          ErrorCode::kNotFound, where,
          fmt::format("cublasLtMatmulAlgoGetHeuristic has no algorithm for the dense "
                      "GEMM {} within {} MiB of workspace ({}, {} results)",
                      shape_str(shape), kMaxDenseWorkspace >> 20, status_str(lt, s), count));
    }
    if (s != CUBLAS_STATUS_SUCCESS) fail(lt, where, "cublasLtMatmulAlgoGetHeuristic", s, shape);
    Choice c;
    c.shape = shape;
    c.algo = best.algo;
    c.workspace = best.workspaceSize;
    c.describe = fmt::format("cuBLASLt {} {} {}", blas_version_string(host_.blas().version),
                             to_string(shape.kind), algo_str(lt, best.algo));
    memo_.push_back(std::move(c));
    found = index_.emplace(key, memo_.size() - 1).first;
  }
  const Choice& c = memo_[found->second];
  DenseGemmPlan p;
  p.shape = shape;
  p.workspace_bytes = c.workspace;
  p.algorithm = found->second + 1;
  p.describe = c.describe;
  return p;
}

void DenseGemms::run(const DenseGemmPlan& plan, const DenseGemmArgs& args, CUstream stream) {
  constexpr std::string_view where = "run_dense_gemm";
  const DenseGemmShape& shape = plan.shape;
  Choice c;
  cublasLtHandle_t h = nullptr;
  {
    std::lock_guard lock(mu_);
    if (plan.algorithm == 0 || plan.algorithm > memo_.size() ||
        !(memo_[plan.algorithm - 1].shape == shape)) {
      throw Error(ErrorCode::kInvalidArgument, where,
                  fmt::format("algorithm {} is not this backend's plan for the dense GEMM {}; "
                              "plan it on this backend",
                              plan.algorithm, shape_str(shape)));
    }
    c = memo_[plan.algorithm - 1];
    h = handle_;
  }
  if (plan.workspace_bytes < c.workspace) {
    throw Error(ErrorCode::kInvalidArgument, where,
                fmt::format("the plan says {} bytes of workspace; its algorithm needs {}",
                            plan.workspace_bytes, c.workspace));
  }
  const BlasApi& lt = api();
  Descriptors d(lt, where, shape);
  if (shape.bias) {
    d.set("cublasLtMatmulDescSetAttribute(BIAS_POINTER)", CUBLASLT_MATMUL_DESC_BIAS_POINTER,
          ptr(args.bias));
  }
  if (shape.kind == DenseKind::kE4m3Block128) {
    // cuBLASLt's A is our B (the weights), its B is our A (see the mapping above).
    d.set("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)", CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
          ptr(args.b_scales));
    d.set("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)", CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
          ptr(args.a_scales));
  }
  const float alpha = 1.0f, beta = 0.0f;
  // The workspace is the caller's (per stream); only what the algorithm needs is promised.
  const std::size_t ws_bytes = c.workspace == 0 ? 0 : args.workspace_bytes;
  const cublasStatus_t s = lt.cublasLtMatmul(
      h, d.desc, &alpha, ptr(args.b), d.a, ptr(args.a), d.b, &beta, ptr(args.c), d.d, ptr(args.c),
      d.d, &c.algo, c.workspace == 0 ? nullptr : ptr(args.workspace), ws_bytes, stream);
  if (s == CUBLAS_STATUS_SUCCESS) return;
  if (s == CUBLAS_STATUS_EXECUTION_FAILED) host_.probe_fault();
  fail(lt, where, "cublasLtMatmul", s, shape);
}

}  // namespace metrale::cuda
