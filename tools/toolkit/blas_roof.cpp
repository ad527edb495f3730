#include "toolkit/blas_roof.h"

// The toolkit's headers are not written for this project's warnings; only types and enums are
// taken from them.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#include <cublasLt.h>
#pragma GCC diagnostic pop
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "metrale/error.h"

namespace metrale::toolkit {
namespace {

// The cuBLASLt entry points used, typed from the toolkit's header.
struct LtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

// Loads cuBLASLt once per process; null with *why set when it cannot be used. The library
// stays loaded: its functions may be called for the rest of the process.
const LtApi* load_lt(std::string* why) {
  static const std::pair<LtApi, std::string> loaded = []() -> std::pair<LtApi, std::string> {
    void* lib = nullptr;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      if ((lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    }
    if (lib == nullptr)
      return {{}, "cuBLASLt not found (libcublasLt.so.13/.12 not on the loader path)"};
    LtApi api;
    std::string missing;
    const auto get = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
      if (fn == nullptr) missing += fmt::format(" {}", symbol);
    };
    get(api.create, "cublasLtCreate");
    get(api.destroy, "cublasLtDestroy");
    get(api.desc_create, "cublasLtMatmulDescCreate");
    get(api.desc_destroy, "cublasLtMatmulDescDestroy");
    get(api.desc_set, "cublasLtMatmulDescSetAttribute");
    get(api.layout_create, "cublasLtMatrixLayoutCreate");
    get(api.layout_destroy, "cublasLtMatrixLayoutDestroy");
    get(api.pref_create, "cublasLtMatmulPreferenceCreate");
    get(api.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    get(api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    get(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    get(api.matmul, "cublasLtMatmul");
    if (!missing.empty()) return {{}, "cuBLASLt lacks" + missing};
    return {api, ""};
  }();
  if (!loaded.second.empty()) {
    *why = loaded.second;
    return nullptr;
  }
  return &loaded.first;
}

// Throws Error(kDriver) naming the cuBLASLt call when status is not success.
void check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(ErrorCode::kDriver, "bf16_gemm_rate",
                fmt::format("{} returned cuBLAS status {}", call, static_cast<int>(status)));
  }
}

// Owns whatever the measurement made, so every exit frees it.
struct Session {
  const LtApi& lt;
  Backend& backend;
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout[3] = {nullptr, nullptr, nullptr};
  cublasLtMatmulPreference_t pref = nullptr;
  std::vector<DevicePtr> buffers;

  ~Session() {
    for (DevicePtr p : buffers) {
      try {
        backend.free(p);
      } catch (const Error&) {  // the ledger's sweep reports it at teardown
      }
    }
    if (pref) lt.pref_destroy(pref);
    for (auto* l : layout) {
      if (l) lt.layout_destroy(l);
    }
    if (desc) lt.desc_destroy(desc);
    if (handle) lt.destroy(handle);
  }
  DevicePtr alloc(std::size_t bytes) {
    buffers.push_back(backend.alloc(bytes));
    return buffers.back();
  }
};

// Random BF16 values in [-1, 1) (data of a real GEMM draws more power than zeros would).
std::vector<std::uint16_t> random_bf16(std::size_t count) {
  std::vector<std::uint16_t> v(count);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (std::uint16_t& e : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    // Sign, exponent 0x70..0x7E (2^-15 .. 2^-1), random mantissa.
    e = static_cast<std::uint16_t>(((x >> 63) << 15) | ((0x70 + (x >> 8) % 15) << 7) | (x & 0x7F));
  }
  return v;
}

// Seconds per C[M, N] = A[M, K] · W[N, K]ᵀ (BF16, row-major), the w4a16 GEMM's shape.
double measure(const LtApi& lt, Backend& backend, int m, int n, int k) {
  Session s{lt, backend, nullptr, nullptr, {nullptr, nullptr, nullptr}, nullptr, {}};
  backend.bind_to_thread();
  const auto um = static_cast<std::size_t>(m), un = static_cast<std::size_t>(n),
             uk = static_cast<std::size_t>(k);
  const std::vector<std::uint16_t> host = random_bf16(std::max(um, un) * uk);
  const DevicePtr a = s.alloc(um * uk * 2), b = s.alloc(un * uk * 2), c = s.alloc(um * un * 2);
  constexpr std::size_t kWorkspace = std::size_t{64} << 20;
  const DevicePtr ws = s.alloc(kWorkspace);
  backend.copy_h2d(a, host.data(), um * uk * 2);
  backend.copy_h2d(b, host.data(), un * uk * 2);

  check(lt.create(&s.handle), "cublasLtCreate");
  check(lt.desc_create(&s.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  // Column-major, the "TN" form cuBLASLt's fastest BF16 kernels take: Cᵀ [N, M] = Wᵀᵀ · Aᵀ,
  // with W as a K x N column-major matrix (transposed) and A as K x M. Cᵀ column-major is C
  // row-major.
  const cublasOperation_t trans = CUBLAS_OP_T;
  check(lt.desc_set(s.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)),
        "cublasLtMatmulDescSetAttribute(TRANSA)");
  const auto u64 = [](int v) { return static_cast<std::uint64_t>(v); };
  check(lt.layout_create(&s.layout[0], CUDA_R_16BF, u64(k), u64(n), k),
        "cublasLtMatrixLayoutCreate(W)");
  check(lt.layout_create(&s.layout[1], CUDA_R_16BF, u64(k), u64(m), k),
        "cublasLtMatrixLayoutCreate(A)");
  check(lt.layout_create(&s.layout[2], CUDA_R_16BF, u64(n), u64(m), n),
        "cublasLtMatrixLayoutCreate(C)");
  check(lt.pref_create(&s.pref), "cublasLtMatmulPreferenceCreate");
  const std::uint64_t ws_bytes = kWorkspace;
  check(lt.pref_set(s.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)),
        "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
  cublasLtMatmulHeuristicResult_t best{};
  int found = 0;
  check(lt.heuristic(s.handle, s.desc, s.layout[0], s.layout[1], s.layout[2], s.layout[2], s.pref,
                     1, &best, &found),
        "cublasLtMatmulAlgoGetHeuristic");
  if (found == 0) {
    throw Error(ErrorCode::kUnavailable, "bf16_gemm_rate", "cuBLASLt has no BF16 GEMM algorithm");
  }

  const float alpha = 1.0f, beta = 0.0f;
  const auto ptr = [](DevicePtr p) {
    return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.address()));
  };
  // The legacy stream 0, synchronized through the backend (cuCtxSynchronize).
  const auto run = [&] {
    check(
        lt.matmul(s.handle, s.desc, &alpha, ptr(b), s.layout[0], ptr(a), s.layout[1], &beta, ptr(c),
                  s.layout[2], ptr(c), s.layout[2], &best.algo, ptr(ws), kWorkspace, nullptr),
        "cublasLtMatmul");
  };
  for (int i = 0; i < 3; ++i) run();  // warm-up: clocks up, kernels loaded
  backend.synchronize_device();
  constexpr int kIters = 20;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kIters; ++i) run();
  backend.synchronize_device();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return seconds / kIters;
}

}  // namespace

Bf16Rate measure_bf16_gemm_rate(Backend& backend, int n) {
  return measure_bf16_gemm(backend, n, n, n);
}

Bf16Rate measure_bf16_gemm(Backend& backend, int m, int n, int k) {
  Bf16Rate r;
  if (m <= 0 || n <= 0 || k <= 0 || m % 16 != 0 || n % 16 != 0 || k % 16 != 0) {
    r.what = fmt::format("not measured: {}x{}x{} is not made of positive multiples of 16", m, n, k);
    return r;
  }
  if (backend.name() != "cuda") {
    r.what = fmt::format("not measured: the {} backend is not a CUDA device", backend.name());
    return r;
  }
  std::string why;
  const LtApi* lt = load_lt(&why);
  if (lt == nullptr) {
    r.what = "not measured: " + why;
    return r;
  }
  try {
    r.seconds = measure(*lt, backend, m, n, k);
    r.flops = 2.0 * m * static_cast<double>(n) * k / r.seconds;
    r.what = fmt::format("cuBLASLt BF16 GEMM {}x{}x{}, FP32 accumulation", m, n, k);
  } catch (const Error& e) {
    r.flops = 0;
    r.what = fmt::format("not measured: {}", e.what());
  }
  return r;
}

}  // namespace metrale::toolkit
