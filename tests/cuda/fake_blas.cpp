// The fake cuBLASLt (fake_blas.h): descriptors as plain structs behind the opaque pointers, a
// heuristic that answers what the test set, and a matmul that computes on the host.
#include "cuda/fake_blas.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "cuda/fake_state.h"
#include "metrale/numerics.h"

namespace metrale::cuda::testing {
namespace fb {

struct Desc {
  std::int32_t transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  std::uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  std::int32_t bias_type = -1;  // -1: the type of D, as in cuBLASLt
  const void* bias = nullptr;
  std::int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  std::int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale_type = CUDA_R_32F;
};

struct Layout {
  cudaDataType_t type = CUDA_R_32F;
  std::uint64_t rows = 0, cols = 0;
  std::int64_t ld = 0;
};

struct Pref {
  std::uint64_t max_workspace = 0;
};

}  // namespace fb

struct FakeBlas::State {
  std::mutex mu;
  BlasApi api;
  std::map<std::string, std::uint64_t, std::less<>> calls;
  std::string load_failure;
  std::size_t version = 130100;
  cublasStatus_t heuristic_status = CUBLAS_STATUS_SUCCESS;
  bool no_algorithm = false;
  std::size_t workspace = 0;
  cublasStatus_t matmul_status = CUBLAS_STATUS_SUCCESS;
  std::uint64_t next_algo = 1;
  std::set<const void*> handles;
  std::map<const void*, std::unique_ptr<fb::Desc>> descs;
  std::map<const void*, std::unique_ptr<fb::Layout>> layouts;
  std::map<const void*, std::unique_ptr<fb::Pref>> prefs;
  std::vector<FakeMatmul> matmuls;
};

namespace fb {
namespace {

using num::bf16_to_f32;
using num::e4m3_to_f32;
using num::f32_to_bf16;

std::atomic<FakeBlas::State*> g_blas{nullptr};

// Counts the call under the state's lock (the name is the function's without "fake_").
struct Gate {
  FakeBlas::State* s;
  std::unique_lock<std::mutex> lock;
};
Gate enter(std::string_view name) {
  FakeBlas::State* s = g_blas.load();
  if (s == nullptr) throw std::logic_error("a fake cuBLASLt call after its FakeBlas is gone");
  Gate g{s, std::unique_lock(s->mu)};
  ++s->calls[std::string(name)];
  return g;
}
#define FAKE_BLAS_ENTER()                               \
  Gate g = enter(std::string_view(__func__).substr(5)); \
  [[maybe_unused]] FakeBlas::State& s = *g.s

std::uint64_t elem_bytes(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_8F_E4M3:
      return 1;
    case CUDA_R_16BF:
      return 2;
    case CUDA_R_32F:
      return 4;
    default:
      return 0;
  }
}

std::uint64_t round_up(std::uint64_t v, std::uint64_t to) {
  return (v + to - 1) / to * to;
}

// The problem a descriptor and four layouts describe, once checked the way the library would.
struct Problem {
  const Desc* desc = nullptr;
  const Layout *a = nullptr, *b = nullptr, *c = nullptr, *d = nullptr;
  std::uint64_t rows = 0, cols = 0, inner = 0;  // D is rows x cols; op(A) rows x inner
  bool fp8 = false;
};

template <class Map>
auto* find(Map& m, const void* p) {
  auto it = m.find(p);
  return it == m.end() ? nullptr : it->second.get();
}

bool block_mode(std::int32_t m) {
  return m == CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F ||
         m == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

// The compute capability of the fake driver's device current on this thread ({0, 0}: none).
std::pair<int, int> current_cc() {
  FakeDriver::State* d = fake::g_state.load();
  if (d == nullptr) return {0, 0};
  std::lock_guard lock(d->mutex);
  const int dev = fake::current_device(*d);
  if (dev < 0 || static_cast<std::size_t>(dev) >= d->devices.size()) return {0, 0};
  return {d->devices[static_cast<std::size_t>(dev)].cc_major,
          d->devices[static_cast<std::size_t>(dev)].cc_minor};
}

// The FP8 rules of cuBLAS's documentation (docs.nvidia.com/cuda/cublas, CUDA 13.x), all of which
// a problem must meet before the library offers or runs an algorithm; what breaks one is
// CUBLAS_STATUS_NOT_SUPPORTED ("the current implementation ... doesn't support the configured
// operation"). m, n, k are cuBLAS's: D is m x n, op(A) m x k, op(B) k x n.
//  - cublasLtMatmul(), FP8: "All matrix dimensions must meet the optimal requirements listed in
//    Tensor Core Usage", and 2.1.11 Tensor Core Usage lists, for each size in bytes:
//    (op_A == N ? m : k)·Asize, (op_B == N ? k : n)·Bsize, m·Csize, lda·Asize, ldb·Bsize and
//    ldc·Csize all multiples of 16.
//  - 3.1.4 "Scaling Mode Support Overview": tensorwide scaling on 8.9+, the 128-element 1D and
//    128x128 2D block scalings (VEC128_32F, BLK128x128_32F) on compute capability 9.0 only.
//  - 3.1.4.5: those two modes on A and B only, in the combinations of its table (BLK x BLK is
//    not one), D in BF16, FP16 or FP32; 3.1.4.5.1 Scaling factors layouts: "M and N must be
//    multiples of 4".
cublasStatus_t check_fp8_rules(const Problem& p) {
  const Desc& ds = *p.desc;
  const bool ta = ds.transa == CUBLAS_OP_T, tb = ds.transb == CUBLAS_OP_T;
  const std::uint64_t m = p.rows, n = p.cols, k = p.inner;
  const std::uint64_t as = elem_bytes(p.a->type), bs = elem_bytes(p.b->type),
                      cs = elem_bytes(p.c->type);
  const auto ld = [](const Layout* l) { return static_cast<std::uint64_t>(l->ld); };
  for (const std::uint64_t bytes : {(ta ? k : m) * as, (tb ? n : k) * bs, m * cs, ld(p.a) * as,
                                    ld(p.b) * bs, ld(p.c) * cs, ld(p.d) * cs}) {
    if (bytes % 16 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const auto [major, minor] = current_cc();
  const bool blocks = block_mode(ds.a_mode) || block_mode(ds.b_mode);
  if (!blocks)
    return major * 10 + minor >= 89 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
  if (major != 9 || minor != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (!block_mode(ds.a_mode) || !block_mode(ds.b_mode) ||
      (ds.a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F &&
       ds.b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m % 4 != 0 || n % 4 != 0) return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

// The bias type the cublasLtMatmul() datatype tables give (BIAS_DATA_TYPE -1 is the default):
// BF16 A/B take a bias of D's type (CUDA_R_16BF with BF16 C, CUDA_R_32F with FP32 C); E4M3 A/B
// take CUDA_R_16BF whether D is BF16 or FP32 (the FP8 table's rows; cublasLt.h's
// BIAS_DATA_TYPE: "fp8 kernels with an output type of CUDA_R_32F" are the exception to D's
// type).
cudaDataType_t required_bias_type(const Problem& p) {
  return p.fp8 ? CUDA_R_16BF : p.d->type;
}

cublasStatus_t check_problem(FakeBlas::State& s, const void* handle, const void* desc,
                             const void* a, const void* b, const void* c, const void* d,
                             Problem& out) {
  if (!s.handles.contains(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  out.desc = find(s.descs, desc);
  out.a = find(s.layouts, a);
  out.b = find(s.layouts, b);
  out.c = find(s.layouts, c);
  out.d = find(s.layouts, d);
  if (!out.desc || !out.a || !out.b || !out.c || !out.d) return CUBLAS_STATUS_INVALID_VALUE;
  const Desc& ds = *out.desc;
  const bool ta = ds.transa == CUBLAS_OP_T, tb = ds.transb == CUBLAS_OP_T;
  const std::uint64_t a_rows = ta ? out.a->cols : out.a->rows,
                      a_cols = ta ? out.a->rows : out.a->cols;
  const std::uint64_t b_rows = tb ? out.b->cols : out.b->rows,
                      b_cols = tb ? out.b->rows : out.b->cols;
  if (a_cols != b_rows || out.d->rows != a_rows || out.d->cols != b_cols) {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  for (const Layout* l : {out.a, out.b, out.c, out.d}) {
    if (l->ld < static_cast<std::int64_t>(l->rows) || elem_bytes(l->type) == 0) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
  }
  if (out.c->type != out.d->type || out.c->rows != out.d->rows || out.c->cols != out.d->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  // D in BF16 or FP32 (the type table's rows for BF16 and E4M3 inputs with FP32 compute).
  if (ds.compute != CUBLAS_COMPUTE_32F || ds.scale_type != CUDA_R_32F ||
      (out.d->type != CUDA_R_16BF && out.d->type != CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  out.rows = a_rows;
  out.cols = b_cols;
  out.inner = a_cols;
  if (out.a->type == CUDA_R_16BF && out.b->type == CUDA_R_16BF) {
    // 3.1.4: "If any scale is set for a non-narrow precisions matmul, cuBLAS will return an
    // error."
    if (ds.a_mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F ||
        ds.b_mode != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F || ds.a_scale || ds.b_scale)
      return CUBLAS_STATUS_NOT_SUPPORTED;
  } else if (out.a->type == CUDA_R_8F_E4M3 && out.b->type == CUDA_R_8F_E4M3) {
    // FP8 runs only in the "TN" form on 8.9, 9.0 and 12.x (cublasLtMatmul(), FP8).
    if (!ta || tb) return CUBLAS_STATUS_NOT_SUPPORTED;
    for (std::int32_t m : {ds.a_mode, ds.b_mode}) {
      if (m != CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F && !block_mode(m))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    out.fp8 = true;
    if (const cublasStatus_t st = check_fp8_rules(out); st != CUBLAS_STATUS_SUCCESS) return st;
  } else {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (ds.epilogue != CUBLASLT_EPILOGUE_DEFAULT && ds.epilogue != CUBLASLT_EPILOGUE_BIAS)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (ds.epilogue == CUBLASLT_EPILOGUE_BIAS && ds.bias_type != -1 &&
      ds.bias_type != required_bias_type(out))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}

// Bytes a column-major rows x cols matrix with leading dimension ld spans.
std::uint64_t span_bytes(const Layout& l) {
  return ((l.cols - 1) * static_cast<std::uint64_t>(l.ld) + l.rows) * elem_bytes(l.type);
}

// 3.1.4.5.1 Scaling factors layouts, for an operand whose scales cover outer x inner elements
// (outer: M for A, N for B, each a multiple of 4 by the rule above; inner: K), L = ceil(K/128):
//   VEC128_32F: "M-major for A with shape M x L" (N-major for B): the outer index fastest,
//     s[kb * outer + o];
//   BLK128x128_32F: "K-major and the stride between the consecutive columns must be a multiple
//     of 4", shape L4 x ceil(outer/128) with L4 = L rounded up to 4: s[(o / 128) * L4 + kb];
//   SCALAR_32F: s[0] (1 without a pointer).
// The FP32 count the tensor of mode spans.
std::uint64_t scale_span(std::int32_t mode, std::uint64_t outer, std::uint64_t inner) {
  const std::uint64_t kb = (inner + 127) / 128;
  switch (mode) {
    case CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
      return kb * outer;
    case CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
      return ((outer + 127) / 128 - 1) * round_up(kb, 4) + kb;
    default:
      return 1;
  }
}

float scale_at(std::int32_t mode, const void* p, std::uint64_t o, std::uint64_t kb,
               std::uint64_t outer, std::uint64_t inner) {
  if (p == nullptr) return 1.0f;
  const auto* f = static_cast<const float*>(p);
  switch (mode) {
    case CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F:
      return f[kb * outer + o];
    case CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F:
      return f[(o / 128) * round_up((inner + 127) / 128, 4) + kb];
    default:
      return f[0];
  }
}

// Whether [p, p + bytes) lies in a live allocation of the fake driver.
bool in_fake_memory(const void* p, std::uint64_t bytes) {
  FakeDriver::State* d = fake::g_state.load();
  if (d == nullptr) return false;
  std::lock_guard lock(d->mutex);
  return fake::range_live(*d, fake::to_dptr(p), bytes);
}

bool stream_live(cudaStream_t stream) {
  FakeDriver::State* d = fake::g_state.load();
  if (d == nullptr) return false;
  std::lock_guard lock(d->mutex);
  return fake::is_legacy(stream) || fake::find_stream(*d, stream) != nullptr;
}

void compute(const Problem& p, const void* A, const void* B, void* D, float alpha) {
  const Desc& ds = *p.desc;
  const bool ta = ds.transa == CUBLAS_OP_T, tb = ds.transb == CUBLAS_OP_T;
  // op(X)(r, c) of a column-major X.
  const auto at = [](const void* base, const Layout& l, bool t, std::uint64_t r, std::uint64_t c) {
    const std::uint64_t i =
        t ? r * static_cast<std::uint64_t>(l.ld) + c : c * static_cast<std::uint64_t>(l.ld) + r;
    if (l.type == CUDA_R_16BF) return bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
    return e4m3_to_f32(static_cast<const std::uint8_t*>(base)[i]);
  };
  const bool f32 = p.d->type == CUDA_R_32F;
  const bool bias_f32 = required_bias_type(p) == CUDA_R_32F;
  const auto bias_at = [&](std::uint64_t i) {
    if (bias_f32) return static_cast<const float*>(ds.bias)[i];
    return bf16_to_f32(static_cast<const std::uint16_t*>(ds.bias)[i]);
  };
  const std::uint64_t blocks = (p.inner + 127) / 128;
  for (std::uint64_t j = 0; j < p.cols; ++j) {
    for (std::uint64_t i = 0; i < p.rows; ++i) {
      float acc = 0.0f;
      if (!p.fp8) {
        for (std::uint64_t k = 0; k < p.inner; ++k)
          acc += at(A, *p.a, ta, i, k) * at(B, *p.b, tb, k, j);
      } else {
        for (std::uint64_t kb = 0; kb < blocks; ++kb) {
          float part = 0.0f;
          for (std::uint64_t k = kb * 128; k < std::min(p.inner, kb * 128 + 128); ++k)
            part += at(A, *p.a, ta, i, k) * at(B, *p.b, tb, k, j);
          acc += part * scale_at(ds.a_mode, ds.a_scale, i, kb, p.rows, p.inner) *
                 scale_at(ds.b_mode, ds.b_scale, j, kb, p.cols, p.inner);
        }
      }
      float v = alpha * acc;
      if (ds.epilogue == CUBLASLT_EPILOGUE_BIAS) v += bias_at(i);
      const std::uint64_t at_d = j * static_cast<std::uint64_t>(p.d->ld) + i;
      if (f32) {
        static_cast<float*>(D)[at_d] = v;
      } else {
        static_cast<std::uint16_t*>(D)[at_d] = f32_to_bf16(v);
      }
    }
  }
}

// ---- the entry points ----

size_t fake_cublasLtGetVersion() {
  FAKE_BLAS_ENTER();
  return s.version;
}

const char* fake_cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_UNKNOWN";
  }
}

cublasStatus_t fake_cublasLtCreate(cublasLtHandle_t* handle) {
  FAKE_BLAS_ENTER();
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  auto* h = new int(0);
  s.handles.insert(h);
  *handle = reinterpret_cast<cublasLtHandle_t>(h);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtDestroy(cublasLtHandle_t handle) {
  FAKE_BLAS_ENTER();
  if (s.handles.erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  delete reinterpret_cast<int*>(handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc,
                                             cublasComputeType_t compute,
                                             cudaDataType_t scale_type) {
  FAKE_BLAS_ENTER();
  auto d = std::make_unique<Desc>();
  d->compute = compute;
  d->scale_type = scale_type;
  *desc = reinterpret_cast<cublasLtMatmulDesc_t>(d.get());
  s.descs.emplace(d.get(), std::move(d));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  FAKE_BLAS_ENTER();
  return s.descs.erase(desc) == 1 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

// Copies an attribute of exactly sizeof(T) bytes, as the library requires.
template <class T>
cublasStatus_t take(T& field, const void* buf, size_t size) {
  if (size != sizeof(T) || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&field, buf, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                   cublasLtMatmulDescAttributes_t attr,
                                                   const void* buf, size_t size) {
  FAKE_BLAS_ENTER();
  Desc* d = find(s.descs, desc);
  if (d == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attr) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return take(d->transa, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return take(d->transb, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return take(d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return take(d->bias_type, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return take(d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_A_SCALE_MODE:
      return take(d->a_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_B_SCALE_MODE:
      return take(d->b_mode, buf, size);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return take(d->a_scale, buf, size);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return take(d->b_scale, buf, size);
    default:
      return CUBLAS_STATUS_INVALID_VALUE;  // an attribute the fake does not model
  }
}

cublasStatus_t fake_cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                               uint64_t rows, uint64_t cols, int64_t ld) {
  FAKE_BLAS_ENTER();
  if (rows == 0 || cols == 0) return CUBLAS_STATUS_INVALID_VALUE;
  auto l = std::make_unique<Layout>(Layout{type, rows, cols, ld});
  *layout = reinterpret_cast<cublasLtMatrixLayout_t>(l.get());
  s.layouts.emplace(l.get(), std::move(l));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  FAKE_BLAS_ENTER();
  return s.layouts.erase(layout) == 1 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t fake_cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  FAKE_BLAS_ENTER();
  auto p = std::make_unique<Pref>();
  *pref = reinterpret_cast<cublasLtMatmulPreference_t>(p.get());
  s.prefs.emplace(p.get(), std::move(p));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  FAKE_BLAS_ENTER();
  return s.prefs.erase(pref) == 1 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t fake_cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                         cublasLtMatmulPreferenceAttributes_t attr,
                                                         const void* buf, size_t size) {
  FAKE_BLAS_ENTER();
  Pref* p = find(s.prefs, pref);
  if (p == nullptr || attr != CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES)
    return CUBLAS_STATUS_INVALID_VALUE;
  return take(p->max_workspace, buf, size);
}

cublasStatus_t fake_cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t results[],
    int* returned) {
  FAKE_BLAS_ENTER();
  if (s.heuristic_status != CUBLAS_STATUS_SUCCESS) return s.heuristic_status;
  Pref* p = find(s.prefs, pref);
  if (p == nullptr || requested < 1 || results == nullptr || returned == nullptr)
    return CUBLAS_STATUS_INVALID_VALUE;
  Problem prob;
  if (const cublasStatus_t st = check_problem(s, handle, desc, a, b, c, d, prob);
      st != CUBLAS_STATUS_SUCCESS)
    return st;
  *returned = 0;
  // No algorithm fits a workspace smaller than what the test says the algorithm needs.
  if (s.no_algorithm || s.workspace > p->max_workspace) return CUBLAS_STATUS_SUCCESS;
  cublasLtMatmulHeuristicResult_t r{};
  r.algo.data[0] = s.next_algo++;  // the algorithm id
  r.algo.data[1] = s.workspace;    // what it needs, as the real descriptor encodes it somewhere
  r.algo.data[2] = 7;              // its tile id
  r.workspaceSize = s.workspace;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  results[0] = r;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatmulAlgoConfigGetAttribute(const cublasLtMatmulAlgo_t* algo,
                                                         cublasLtMatmulAlgoConfigAttributes_t attr,
                                                         void* buf, size_t size, size_t* written) {
  FAKE_BLAS_ENTER();
  if (algo == nullptr || buf == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_ALGO_CONFIG_ID && size == sizeof(std::int32_t)) {
    const auto v = static_cast<std::int32_t>(algo->data[0]);
    std::memcpy(buf, &v, sizeof v);
  } else if (attr == CUBLASLT_ALGO_CONFIG_TILE_ID && size == sizeof(std::uint32_t)) {
    const auto v = static_cast<std::uint32_t>(algo->data[2]);
    std::memcpy(buf, &v, sizeof v);
  } else {
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  if (written != nullptr) *written = size;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t fake_cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                   const void* alpha, const void* A, cublasLtMatrixLayout_t a,
                                   const void* B, cublasLtMatrixLayout_t b, const void* beta,
                                   const void* C, cublasLtMatrixLayout_t c, void* D,
                                   cublasLtMatrixLayout_t d, const cublasLtMatmulAlgo_t* algo,
                                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Problem prob;
  float alpha_v = 0.0f;
  {
    FAKE_BLAS_ENTER();
    if (s.matmul_status != CUBLAS_STATUS_SUCCESS) return s.matmul_status;
    if (const cublasStatus_t st = check_problem(s, handle, desc, a, b, c, d, prob);
        st != CUBLAS_STATUS_SUCCESS)
      return st;
    if (alpha == nullptr || beta == nullptr || A == nullptr || B == nullptr || D == nullptr)
      return CUBLAS_STATUS_INVALID_VALUE;
    // beta != 0 would read C, which the backend never asks for.
    if (*static_cast<const float*>(beta) != 0.0f || C != D) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (algo != nullptr && algo->data[1] > workspace_bytes) return CUBLAS_STATUS_INVALID_VALUE;
    if (workspace_bytes > 0 && workspace == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (prob.desc->epilogue == CUBLASLT_EPILOGUE_BIAS && prob.desc->bias == nullptr)
      return CUBLAS_STATUS_INVALID_VALUE;
    // FP8's pointers: Tensor Core Usage's intptr_t(A), (B), (C) % 16 == 0, and 3.1.4.5.1
    // "Starting addresses of scaling factors must be 16B aligned" (D is C here).
    if (prob.fp8) {
      const auto misaligned = [](const void* q) {
        return reinterpret_cast<std::uintptr_t>(q) % 16 != 0;
      };
      if (misaligned(A) || misaligned(B) || misaligned(C) ||
          (block_mode(prob.desc->a_mode) && misaligned(prob.desc->a_scale)) ||
          (block_mode(prob.desc->b_mode) && misaligned(prob.desc->b_scale)))
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    alpha_v = *static_cast<const float*>(alpha);
  }
  const Desc& ds = *prob.desc;
  // What a GPU would fault on: a buffer outside live memory, a stream that is not live.
  bool ok = in_fake_memory(A, span_bytes(*prob.a)) && in_fake_memory(B, span_bytes(*prob.b)) &&
            in_fake_memory(D, span_bytes(*prob.d)) && stream_live(stream) &&
            (workspace_bytes == 0 || in_fake_memory(workspace, workspace_bytes)) &&
            (ds.epilogue != CUBLASLT_EPILOGUE_BIAS ||
             in_fake_memory(ds.bias, prob.rows * elem_bytes(required_bias_type(prob))));
  if (prob.fp8) {
    ok = ok &&
         (ds.a_scale == nullptr ||
          in_fake_memory(ds.a_scale, scale_span(ds.a_mode, prob.rows, prob.inner) * 4)) &&
         (ds.b_scale == nullptr ||
          in_fake_memory(ds.b_scale, scale_span(ds.b_mode, prob.cols, prob.inner) * 4));
  }
  if (!ok) return CUBLAS_STATUS_EXECUTION_FAILED;
  compute(prob, A, B, D, alpha_v);
  FakeBlas::State* st = g_blas.load();
  std::lock_guard lock(st->mu);
  st->matmuls.push_back(
      FakeMatmul{stream, workspace, workspace_bytes, prob.rows, prob.cols, prob.inner});
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace fb

FakeBlas::FakeBlas() : state_(std::make_unique<State>()) {
  State* expected = nullptr;
  if (!fb::g_blas.compare_exchange_strong(expected, state_.get())) {
    throw std::logic_error("only one FakeBlas may exist at a time");
  }
#define METRALE_FAKE_BLAS_FILL(name) state_->api.name = &fb::fake_##name;
  METRALE_BLAS_FUNCTIONS(METRALE_FAKE_BLAS_FILL)
#undef METRALE_FAKE_BLAS_FILL
}

FakeBlas::~FakeBlas() {
  fb::g_blas.store(nullptr);
  for (const void* h : state_->handles) delete static_cast<const int*>(h);
}

BlasLoad FakeBlas::load() const {
  std::lock_guard lock(state_->mu);
  BlasLoad out;
  out.library = "fake cuBLASLt";
  if (!state_->load_failure.empty()) {
    out.reason = state_->load_failure;
    return out;
  }
  out.api = &state_->api;
  out.version = state_->version;
  return out;
}

BlasSource FakeBlas::source() const {
  return [this] { return load(); };
}

void FakeBlas::fail_load(std::string reason) {
  std::lock_guard lock(state_->mu);
  state_->load_failure = std::move(reason);
}
void FakeBlas::set_version(std::size_t version) {
  std::lock_guard lock(state_->mu);
  state_->version = version;
}
void FakeBlas::fail_heuristic(cublasStatus_t status) {
  std::lock_guard lock(state_->mu);
  state_->heuristic_status = status;
}
void FakeBlas::no_algorithm(bool none) {
  std::lock_guard lock(state_->mu);
  state_->no_algorithm = none;
}
void FakeBlas::set_workspace(std::size_t bytes) {
  std::lock_guard lock(state_->mu);
  state_->workspace = bytes;
}
void FakeBlas::fail_matmul(cublasStatus_t status) {
  std::lock_guard lock(state_->mu);
  state_->matmul_status = status;
}

std::uint64_t FakeBlas::calls(const std::string& call) const {
  static const std::set<std::string, std::less<>> names = {
#define METRALE_FAKE_BLAS_NAME(name) #name,
      METRALE_BLAS_FUNCTIONS(METRALE_FAKE_BLAS_NAME)
#undef METRALE_FAKE_BLAS_NAME
  };
  if (!names.contains(call)) throw std::invalid_argument("no cuBLASLt entry point " + call);
  std::lock_guard lock(state_->mu);
  auto it = state_->calls.find(call);
  return it == state_->calls.end() ? 0 : it->second;
}

int FakeBlas::live_handles() const {
  std::lock_guard lock(state_->mu);
  return static_cast<int>(state_->handles.size());
}

int FakeBlas::live_descriptors() const {
  std::lock_guard lock(state_->mu);
  return static_cast<int>(state_->descs.size() + state_->layouts.size() + state_->prefs.size());
}

std::vector<FakeMatmul> FakeBlas::matmuls() const {
  std::lock_guard lock(state_->mu);
  return state_->matmuls;
}

}  // namespace metrale::cuda::testing
