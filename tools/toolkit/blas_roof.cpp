#include "toolkit/blas_roof.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "metrale/dense_gemm.h"
#include "metrale/error.h"

namespace metrale::toolkit {
namespace {

// Frees what the measurement allocated on every exit.
struct Buffers {
  Backend& backend;
  std::vector<DevicePtr> owned;

  ~Buffers() {
    for (DevicePtr p : owned) {
      try {
        backend.free(p);
      } catch (const Error&) {  // the ledger's sweep reports it at teardown
      }
    }
  }
  DevicePtr alloc(std::size_t bytes) {
    owned.push_back(backend.alloc(bytes));
    return owned.back();
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

// Seconds per C[M, N] = A[M, K] · W[N, K]ᵀ (BF16, row-major), the w4a16 GEMM's shape, through
// the backend's dense GEMM (the one cuBLASLt loader of the project); *describe gets its plan's.
double measure(Backend& backend, int m, int n, int k, std::string* describe) {
  backend.bind_to_thread();
  const DenseGemmPlan plan = backend.plan_dense_gemm({DenseKind::kBf16, m, n, k});
  *describe = plan.describe;
  Buffers s{backend, {}};
  const auto um = static_cast<std::size_t>(m), un = static_cast<std::size_t>(n),
             uk = static_cast<std::size_t>(k);
  const std::vector<std::uint16_t> host = random_bf16(std::max(um, un) * uk);
  DenseGemmArgs args;
  args.a = s.alloc(um * uk * 2);
  args.b = s.alloc(un * uk * 2);
  args.c = s.alloc(um * un * 2);
  if (plan.workspace_bytes != 0) {
    args.workspace = s.alloc(plan.workspace_bytes);
    args.workspace_bytes = plan.workspace_bytes;
  }
  backend.copy_h2d(args.a, host.data(), um * uk * 2);
  backend.copy_h2d(args.b, host.data(), un * uk * 2);
  const StreamHandle stream = backend.default_stream();
  for (int i = 0; i < 3; ++i) backend.run_dense_gemm(plan, args, stream);  // clocks up
  backend.synchronize(stream);
  constexpr int kIters = 20;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kIters; ++i) backend.run_dense_gemm(plan, args, stream);
  backend.synchronize(stream);
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
  if (std::string why = backend.dense_gemm_unavailable(DenseKind::kBf16); !why.empty()) {
    r.what = "not measured: " + why;
    return r;
  }
  try {
    std::string describe;
    r.seconds = measure(backend, m, n, k, &describe);
    r.flops = 2.0 * m * static_cast<double>(n) * k / r.seconds;
    r.what = fmt::format("{} BF16 GEMM {}x{}x{}, FP32 accumulation", describe, m, n, k);
  } catch (const Error& e) {
    r.flops = 0;
    r.what = fmt::format("not measured: {}", e.what());
  }
  return r;
}

}  // namespace metrale::toolkit
