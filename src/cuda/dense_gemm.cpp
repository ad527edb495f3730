#include "cuda/dense_gemm.h"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>

#include "core/log.h"
#include "cuda/driver_api.h"
#include "cuda/status.h"
#include "metrale/error.h"

namespace metrale::cuda {
namespace {

// How our row-major contract maps onto cuBLASLt's column-major "TN" call. A row-major [R, C]
// matrix is a column-major C x R matrix with leading dimension C, so our C[M, N] = A · Bᵀ is
// cuBLASLt's D (N x M column-major, ld N) = op(A_lt) · op(B_lt) with
//   A_lt = our B: K x N column-major, ld K, op T (so N x K);
//   B_lt = our A: K x M column-major, ld K, op N;
//   bias  = our bias[N], one per row of D (CUBLASLT_EPILOGUE_BIAS adds it per row of D).
// So cuBLAS's m is our N and its n is our M.
//
// Block scaling (e4m3-block128), as cuBLAS's documentation lays the scales out (3.1.4.5.1
// "Scaling factors layouts"), inner dimension K for both operands, L = ceil(K/128):
//   A_lt (our B, the weights) BLK128x128_32F: K-major, [ceil(N/128), round_up(L, 4)] = our
//     b_scales [ceil(N/128), dense_b_scales_ld(K)];
//   B_lt (our A, the activations) VEC128_32F: "N-major ... with shape N x L", cuBLAS's N being
//     our M: [L, M] = our a_scales [ceil(K/128), dense_a_scales_ld(M)] once M is a multiple of 4.
// The rules the same documentation sets for these FP8 calls, and what we do about each:
//   - "M and N must be multiples of 4" (3.1.4.5.1): our N must be (below); our M is padded:
//     the library runs on round_up(M, 4) rows, A's extra rows zero codes in the workspace, D in
//     the workspace, the first M rows copied to C. The activation scales' leading dimension is
//     already round_up(M, 4), so the library reads the scales in place: the padding entries
//     scale only the zero rows, whose outputs are never copied out.
//   - Tensor Core Usage (2.1.11), required for FP8 by cublasLtMatmul(): K·1, lda·1 and ldb·1
//     (both K) and m·size(C), ldc·size(C) (both our N) multiples of 16 bytes, pointers 16-byte
//     aligned: K % 16 == 0, and N % 8 with BF16 C or N % 4 with FP32 C. Such an N or K is
//     refused by name at plan time (padding them would copy the weights on every call).
//   - Scaling Mode Support Overview: the two block scalings run on compute capability 9.0 only.
//   - The datatype tables' bias types: BF16 A/B take a bias of C's type (CUDA_R_32F with FP32
//     C), FP8 A/B a CUDA_R_16BF bias for BF16 and FP32 C alike. Our bias is BF16: for a BF16
//     GEMM with FP32 C it is widened exactly (BF16 is the high half of an FP32) into the
//     workspace by a zero fill and a strided copy.

// Where a plan's extra buffers sit in the caller's workspace (0 bytes: none).
struct Extras {
  std::int64_t rows = 0;      // the library's n: M, or round_up(M, 4) for the block scalings
  std::uint64_t a_at = 0;     // the padded A codes [rows, K] (when rows != M)
  std::uint64_t d_at = 0;     // the padded D [rows, N] (when rows != M)
  std::uint64_t bias_at = 0;  // the FP32 bias [N] (BF16 with FP32 C and a bias)
  std::uint64_t total = 0;    // the whole workspace the plan needs
  bool padded = false, bias_f32 = false;
};

constexpr std::uint64_t kPartAlign =
    256;  // cublasLtMatmul's workspace alignment, kept by each part

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

// The scale pointers a block-scaled FP8 plan asks the heuristic with: 256-byte aligned, never
// read. See Note [block scales at plan time] in docs/NOTES.md.
constexpr std::uintptr_t kScaleStandIn = 0x100;

// The matmul descriptor and the three layouts of one shape, destroyed with this object.
struct Descriptors {
  const BlasApi& api;
  std::string_view where;
  const DenseGemmShape& shape;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;

  // rows: the library's n (our M, padded for the block scalings).
  Descriptors(const BlasApi& lt, std::string_view w, const DenseGemmShape& s, std::int64_t rows)
      : api(lt), where(w), shape(s) {
    check("cublasLtMatmulDescCreate",
          api.cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const std::int32_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    set("cublasLtMatmulDescSetAttribute(TRANSA)", CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
    set("cublasLtMatmulDescSetAttribute(TRANSB)", CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
    if (shape.bias) {
      const std::uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const std::int32_t bias_type =
          shape.kind == DenseKind::kBf16 && shape.out_f32 ? CUDA_R_32F : CUDA_R_16BF;
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
      // The heuristic is asked with stand-in scale pointers, run() sets the real ones: Note
      // [block scales at plan time] in docs/NOTES.md.
      void* const stand_in = reinterpret_cast<void*>(kScaleStandIn);
      set("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)", CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
          stand_in);
      set("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)", CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
          stand_in);
    }
    const cudaDataType_t in = e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    const auto u = [](std::int64_t v) { return static_cast<std::uint64_t>(v); };
    check("cublasLtMatrixLayoutCreate(A)",
          api.cublasLtMatrixLayoutCreate(&a, in, u(shape.k), u(shape.n), shape.k));
    check("cublasLtMatrixLayoutCreate(B)",
          api.cublasLtMatrixLayoutCreate(&b, in, u(shape.k), u(rows), shape.k));
    check("cublasLtMatrixLayoutCreate(D)",
          api.cublasLtMatrixLayoutCreate(&d, shape.out_f32 ? CUDA_R_32F : CUDA_R_16BF, u(shape.n),
                                         u(rows), shape.n));
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

std::uint64_t align_part(std::uint64_t v) {
  return (v + kPartAlign - 1) / kPartAlign * kPartAlign;
}

// The FP8 shape rules the library documents for our N and K (see the mapping above): "" when
// shape meets them.
std::string fp8_shape_refusal(const DenseGemmShape& s) {
  if (s.kind != DenseKind::kE4m3Block128) return {};
  if (s.k % 16 != 0) {
    return fmt::format(
        "cuBLASLt's FP8 matmul needs K a multiple of 16 (cuBLAS Tensor Core Usage: K bytes of "
        "each K-major E4M3 operand and its leading dimension a multiple of 16); K = {} is not a "
        "multiple of 16",
        s.k);
  }
  const std::int64_t multiple = s.out_f32 ? 4 : 8;
  if (s.n % multiple != 0) {
    return fmt::format(
        "cuBLASLt's FP8 matmul needs N x {} bytes a multiple of 16 (cuBLAS Tensor Core Usage: "
        "C's rows, N {} elements, and its leading dimension): N = {} is not a multiple of {}",
        s.out_f32 ? 4 : 2, s.out_f32 ? "FP32" : "BF16", s.n, multiple);
  }
  return {};
}

// The extra buffers of shape after the library's own lib_workspace bytes; Error naming where
// when a size does not fit 64 bits.
Extras extras_of(std::string_view where, const DenseGemmShape& s, std::uint64_t lib_workspace) {
  Extras e;
  e.rows = s.m;
  if (s.kind == DenseKind::kE4m3Block128) e.rows = dense_a_scales_ld(s.m);
  e.padded = e.rows != s.m;
  e.bias_f32 = s.kind == DenseKind::kBf16 && s.out_f32 && s.bias;
  const auto rows = static_cast<std::uint64_t>(e.rows), n = static_cast<std::uint64_t>(s.n),
             k = static_cast<std::uint64_t>(s.k);
  std::uint64_t at = lib_workspace, a_bytes = 0, d_bytes = 0;
  const bool fits = !__builtin_mul_overflow(rows, k, &a_bytes) &&
                    !__builtin_mul_overflow(rows * (s.out_f32 ? 4 : 2), n, &d_bytes) &&
                    a_bytes < (std::uint64_t{1} << 62) && d_bytes < (std::uint64_t{1} << 62) &&
                    lib_workspace < (std::uint64_t{1} << 62);
  if (!fits) {
    throw Error(ErrorCode::kInvalidArgument, where,
                fmt::format("the padded buffers of the dense GEMM {} would be more bytes than 64 "
                            "bits can count",
                            shape_str(s)));
  }
  const auto take = [&](std::uint64_t bytes) {
    at = align_part(at);
    const std::uint64_t p = at;
    at += bytes;
    return p;
  };
  if (e.padded) {
    e.a_at = take(a_bytes);
    e.d_at = take(d_bytes);
  }
  if (e.bias_f32) e.bias_at = take(n * 4);
  e.total = at;
  return e;
}

}  // namespace

std::string dense_gemm_unavailable(const BlasLoad& blas, ComputeCapability cc, DenseKind kind) {
  if (blas.api == nullptr) return blas.reason;
  if (kind != DenseKind::kE4m3Block128) return {};
  // cuBLAS's "Scaling Mode Support Overview" lists the 128-element 1D and 128x128 2D block
  // scalings for compute capability 9.0, and for no other (Blackwell's are the 16/32-element
  // ones with 8-bit scales).
  if (cc.major != 9 || cc.minor != 0) {
    return fmt::format(
        "cuBLASLt's block-scaled FP8 (e4m3-block128: VEC128_32F and BLK128x128_32F scales) is "
        "documented for compute capability 9.0 only; this device is {}",
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
  if (std::string why = fp8_shape_refusal(shape); !why.empty()) {
    throw Error(ErrorCode::kUnavailable, where,
                fmt::format("the dense GEMM {}: {}", shape_str(shape), why));
  }
  const Key key{static_cast<int>(shape.kind), shape.m, shape.n, shape.k, shape.bias, shape.out_f32};
  const std::int64_t rows = extras_of(where, shape, 0).rows;
  std::lock_guard lock(mu_);
  auto found = index_.find(key);
  if (found == index_.end()) {
    const BlasApi& lt = api();
    const cublasLtHandle_t h = handle_locked(where);
    Descriptors d(lt, where, shape, rows);
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
    c.total = extras_of(where, shape, c.workspace).total;
    c.describe = fmt::format("cuBLASLt {} {} {}", blas_version_string(host_.blas().version),
                             to_string(shape.kind), algo_str(lt, best.algo));
    memo_.push_back(std::move(c));
    found = index_.emplace(key, memo_.size() - 1).first;
  }
  const Choice& c = memo_[found->second];
  DenseGemmPlan p;
  p.shape = shape;
  p.workspace_bytes = c.total;
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
  if (plan.workspace_bytes < c.total) {
    throw Error(
        ErrorCode::kInvalidArgument, where,
        fmt::format("the plan says {} bytes of workspace; its algorithm and padding need {}",
                    plan.workspace_bytes, c.total));
  }
  const Extras e = extras_of(where, shape, c.workspace);
  const DriverApi& drv = host_.api();
  const auto driver = [&](std::string_view call, CUresult r) {
    if (r == CUDA_SUCCESS) return;
    if (is_sticky_fault(r)) host_.probe_fault();
    throw_status(&drv, where, call, r);
  };
  const auto at = [&](std::uint64_t offset) {
    return static_cast<CUdeviceptr>(args.workspace.address() + offset);
  };
  const auto dev = [](DevicePtr p) { return static_cast<CUdeviceptr>(p.address()); };
  const auto m = static_cast<std::uint64_t>(shape.m), n = static_cast<std::uint64_t>(shape.n),
             k = static_cast<std::uint64_t>(shape.k), rows = static_cast<std::uint64_t>(e.rows);
  const std::uint64_t c_elem = shape.out_f32 ? 4 : 2;
  void* a_lt = ptr(args.a);
  void* d_lt = ptr(args.c);
  if (e.padded) {
    // A's rows, then zero codes for the padding rows (their products are exact zeros).
    driver("cuMemcpyDtoDAsync (A into its padded copy)",
           drv.cuMemcpyDtoDAsync(at(e.a_at), dev(args.a), m * k, stream));
    driver("cuMemsetD8Async (A's padding rows)",
           drv.cuMemsetD8Async(at(e.a_at + m * k), 0, (rows - m) * k, stream));
    a_lt = reinterpret_cast<void*>(at(e.a_at));
    d_lt = reinterpret_cast<void*>(at(e.d_at));
  }
  const BlasApi& lt = api();
  Descriptors d(lt, where, shape, e.rows);
  if (shape.bias) {
    void* bias = ptr(args.bias);
    if (e.bias_f32) {
      // BF16 x -> FP32 x exactly: the 16 bits are the high half of the little-endian FP32 word,
      // whose low half the fill zeroed.
      driver("cuMemsetD8Async (the FP32 bias)",
             drv.cuMemsetD8Async(at(e.bias_at), 0, n * 4, stream));
      CUDA_MEMCPY2D widen{};
      widen.srcMemoryType = CU_MEMORYTYPE_DEVICE;
      widen.srcDevice = dev(args.bias);
      widen.srcPitch = 2;
      widen.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      widen.dstDevice = at(e.bias_at) + 2;
      widen.dstPitch = 4;
      widen.WidthInBytes = 2;
      widen.Height = n;
      driver("cuMemcpy2DAsync (the bias widened to FP32)", drv.cuMemcpy2DAsync(&widen, stream));
      bias = reinterpret_cast<void*>(at(e.bias_at));
    }
    d.set("cublasLtMatmulDescSetAttribute(BIAS_POINTER)", CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias);
  }
  if (shape.kind == DenseKind::kE4m3Block128) {
    // cuBLASLt's A is our B (the weights), its B is our A (see the mapping above).
    d.set("cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)", CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
          ptr(args.b_scales));
    d.set("cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)", CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
          ptr(args.a_scales));
  }
  const float alpha = 1.0f, beta = 0.0f;
  // The workspace is the caller's (per stream); the algorithm's part is its start.
  const std::size_t ws_bytes = c.workspace;
  const cublasStatus_t s = lt.cublasLtMatmul(
      h, d.desc, &alpha, ptr(args.b), d.a, a_lt, d.b, &beta, d_lt, d.d, d_lt, d.d, &c.algo,
      c.workspace == 0 ? nullptr : ptr(args.workspace), ws_bytes, stream);
  if (s == CUBLAS_STATUS_SUCCESS) {
    if (e.padded) {
      // D's first M columns (our C's rows) are contiguous: ld N.
      driver("cuMemcpyDtoDAsync (D's real rows into C)",
             drv.cuMemcpyDtoDAsync(dev(args.c), at(e.d_at), m * n * c_elem, stream));
    }
    return;
  }
  if (s == CUBLAS_STATUS_EXECUTION_FAILED) host_.probe_fault();
  fail(lt, where, "cublasLtMatmul", s, shape);
}

}  // namespace metrale::cuda
