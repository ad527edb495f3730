// What one core of an AVX-512 BF16 processor can issue for the decode kernels' product loop, in
// registers (no memory stream): the cycles of single instructions over eight independent chains,
// and of one 64-byte panel line (16 columns x 8 K of E2M1 codes, 128 weights) for 1 to 8 rows of
// A, in the loop the kernels run (panel_sums_avx512.h: three shifts and four vpermw a line, four
// vdpbf16ps a row) and in an FP32 alternative (seven shifts and eight vpermps a line, eight FMAs a
// row). At one row the line figure bounds the decode's rate per core before scales, prefetches
// and loads: 64 bytes x clock / cycles.
// Last, the decode kernel itself (w4a16_gemm at M = 1 on the CPU backend, every thread) on one
// copy of NVFP4 weights small enough to stay in the caches, so no memory stream limits it.
// Cycles are counted against a chain of dependent imuls (3 cycles each on every x86-64 core this
// project has met), so a VM's clock needs no counters. docs/PERF.md quotes it.
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "toolkit/random_weights.h"

// Vector arguments of functions with a target of their own, and GCC 12's intrinsics under such a
// target (their undefined-vector helpers), warn; as in the CPU kernels.
#pragma GCC diagnostic ignored "-Wpsabi"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

#define PROBE_TARGET gnu::target("avx512f,avx512bw,avx512vl,avx512bf16"), gnu::noinline

constexpr long kIterations = 20'000'000;
volatile float sink;

// Best of three, in nanoseconds per iteration.
template <class F>
double ns_per_iteration(F f) {
  double best = 1e30;
  for (int r = 0; r < 3; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    sink = f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = s < best ? s : best;
  }
  return best / kIterations * 1e9;
}

[[gnu::noinline]] float imul_chain() {  // 12 dependent imuls an iteration
  std::int64_t x = 3;
  for (long i = 0; i < kIterations; ++i) {
    asm volatile(
        "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
        "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0\n\t"
        "imul %0, %0\n\timul %0, %0\n\timul %0, %0\n\timul %0, %0"
        : "+r"(x));
  }
  return static_cast<float>(x & 1);
}

// Eight independent chains of one instruction an iteration each; the barrier keeps the compiler
// from proving the chains equal.
enum class Op { kDot, kFma, kPermw, kPermps, kShift };

template <Op O>
[[PROBE_TARGET]] float eight_chains() {
  __m512i v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm512_set1_epi32(i + 1);
  __m512i x = _mm512_set1_epi16(0x3F80);
  for (long it = 0; it < kIterations; ++it) {
    asm volatile("" : "+v"(x));
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      if constexpr (O == Op::kDot) {
        v[i] = _mm512_castps_si512(_mm512_dpbf16_ps(_mm512_castsi512_ps(v[i]),
                                                    reinterpret_cast<__m512bh>(x),
                                                    reinterpret_cast<__m512bh>(x)));
      } else if constexpr (O == Op::kFma) {
        v[i] = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(v[i]),
                                                   _mm512_castsi512_ps(x), _mm512_castsi512_ps(x)));
      } else if constexpr (O == Op::kPermw) {
        v[i] = _mm512_permutexvar_epi16(v[i], x);
      } else if constexpr (O == Op::kPermps) {
        v[i] = _mm512_castps_si512(_mm512_permutexvar_ps(v[i], _mm512_castsi512_ps(x)));
      } else {
        v[i] = _mm512_srli_epi16(v[i], 1);
      }
    }
  }
  __m512i all = v[0];
  for (int i = 1; i < 8; ++i) all = _mm512_xor_si512(all, v[i]);
  return static_cast<float>(_mm_cvtsi128_si32(_mm512_castsi512_si128(all)));
}

alignas(64) std::uint8_t g_codes[64 * 64];
constexpr int kMaxRows = 8, kRowStride = 1024;  // A's rows, as the kernels read them: lda apart
alignas(64) std::uint16_t g_a_bf16[kMaxRows * kRowStride];
alignas(64) float g_a_f32[kMaxRows * kRowStride];

// The line loops' [rows][groups][chains] accumulators: set to zero, and their total.
template <int MR, int P>
[[gnu::target("avx512f"), gnu::always_inline]] inline void zero_sums(__m512 (&acc)[MR][2][P]) {
  for (auto& row : acc) {
    for (auto& group : row) {
      for (__m512& x : group) x = _mm512_setzero_ps();
    }
  }
}
template <int MR, int P>
[[gnu::target("avx512f"), gnu::always_inline]] inline float total_of(__m512 (&acc)[MR][2][P]) {
  __m512 total = _mm512_setzero_ps();
  for (auto& row : acc) {
    for (auto& group : row) {
      for (__m512& x : group) total = _mm512_add_ps(total, x);
    }
  }
  return _mm512_reduce_add_ps(total);
}

// The kernels' loop (add_block in panel_sums_avx512.h) over two groups' lines, MR rows: each
// line's words shifted by 0, 4, 8, 12 look up BF16 pairs by vpermw, and each pair vector meets
// every row's broadcast A pair in a vdpbf16ps. One row keeps two sums a group so its products do
// not wait on each other (the kernels' block sums are as independent across blocks).
template <int MR>
[[PROBE_TARGET]] float dot_lines() {
  constexpr int P = MR == 1 ? 2 : 1;
  const __m512i lut = _mm512_set1_epi16(0x3F80);
  __m512 acc[MR][2][P];
  zero_sums(acc);
  for (long it = 0; it < kIterations / 2; ++it) {
    const std::uint8_t* c = g_codes + (it & 31) * 128;
    const std::uint16_t* a = g_a_bf16 + (it & 63) * 8;
    const __m512i v[2] = {_mm512_load_si512(c), _mm512_load_si512(c + 64)};
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      __m512bh w[2];
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        const __m512i idx = s == 0 ? v[g] : _mm512_srli_epi16(v[g], 4 * s);
        w[g] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(idx, lut));
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const auto x = reinterpret_cast<__m512bh>(
            _mm512_broadcastd_epi32(_mm_loadu_si32(a + r * kRowStride + 2 * s)));
#pragma GCC unroll 2
        for (int g = 0; g < 2; ++g) acc[r][g][s % P] = _mm512_dpbf16_ps(acc[r][g][s % P], w[g], x);
      }
    }
  }
  return total_of(acc);
}

// The FP32 alternative over the same lines: each column's dword shifted by 4q puts nibble q under
// vpermps' 4 index bits (an FP32 table of the 16 codes), and one FMA a row with the broadcast A[q]
// adds it; with fewer than four rows, 4 / MR sums a row and group keep eight chains in flight.
template <int MR>
[[PROBE_TARGET]] float fma_lines() {
  constexpr int P = MR >= 4 ? 1 : 4 / MR;
  const __m512 lut = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512 acc[MR][2][P];
  zero_sums(acc);
  for (long it = 0; it < kIterations / 2; ++it) {
    const std::uint8_t* c = g_codes + (it & 31) * 128;
    const float* a = g_a_f32 + (it & 63) * 8;
    const __m512i v[2] = {_mm512_load_si512(c), _mm512_load_si512(c + 64)};
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      __m512 w[2];
#pragma GCC unroll 2
      for (int g = 0; g < 2; ++g) {
        w[g] = _mm512_permutexvar_ps(q == 0 ? v[g] : _mm512_srli_epi32(v[g], 4 * q), lut);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512 x = _mm512_set1_ps(a[r * kRowStride + q]);
#pragma GCC unroll 2
        for (int g = 0; g < 2; ++g) acc[r][g][q % P] = _mm512_fmadd_ps(w[g], x, acc[r][g][q % P]);
      }
    }
  }
  return total_of(acc);
}

// GB/s of codes and scales the decode kernel reads from the caches: one upload of N x K NVFP4
// in the backend's preferred layout, the best of five passes of `calls` GEMMs.
double kernel_in_cache(std::int64_t n, std::int64_t k, int calls) {
  using namespace metrale;
  CpuBackend backend;
  std::mt19937_64 rng(1);
  const HostQuantWeights host = toolkit::random_weights(WeightFormat::kNvfp4, n, k, rng);
  ops::QuantWeights w = ops::upload_weights(backend, host, ops::UploadLayout::kBackendPreferred);
  const std::vector<std::uint16_t> a(static_cast<std::size_t>(k), 0x3F80);
  const DevicePtr da = backend.alloc(a.size() * 2),
                  dc = backend.alloc(static_cast<std::size_t>(n) * 2);
  backend.copy_h2d(da, a.data(), a.size() * 2);
  const StreamHandle stream = backend.default_stream();
  double best = 1e30;
  for (int pass = 0; pass < 6; ++pass) {  // the first warms the caches
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) ops::w4a16_gemm(backend, stream, da, 1, w, dc);
    backend.synchronize(stream);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (pass > 0) best = s < best ? s : best;
  }
  ops::free_weights(backend, w);
  backend.free(da);
  backend.free(dc);
  return static_cast<double>(host.codes.size() + host.scales.size()) * calls / best / 1e9;
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::puts("bench_decode_ports: this processor has no AVX-512 BF16; nothing to measure");
    return 0;
  }
  for (std::uint16_t& x : g_a_bf16) x = 0x3F80;
  for (float& x : g_a_f32) x = 1.0f;
  const double cycle_ns = ns_per_iteration(imul_chain) / 36.0;
  std::printf("clock ~%.2f GHz (a chain of dependent imuls, 3 cycles each)\n", 1.0 / cycle_ns);
  std::printf("\ncycles per instruction, eight independent chains:\n");
  const auto per_op = [&](const char* name, auto f) {
    std::printf("  %-22s %5.2f\n", name, ns_per_iteration(f) / 8.0 / cycle_ns);
  };
  per_op("vdpbf16ps zmm", eight_chains<Op::kDot>);
  per_op("vfmadd231ps zmm", eight_chains<Op::kFma>);
  per_op("vpermw zmm", eight_chains<Op::kPermw>);
  per_op("vpermps zmm", eight_chains<Op::kPermps>);
  per_op("vpsrlw zmm", eight_chains<Op::kShift>);
  std::printf(
      "\none 64-byte line of codes (128 weights) in registers, cycles (GB/s of codes a core):\n"
      "  kernels' loop: 3 shifts and 4 vpermw a line, 4 vdpbf16ps a row; FP32: 7 shifts and 8 "
      "vpermps a line, 8 FMAs a row\n  rows  kernels' loop       FP32                FP32's time / "
      "loop's\n");
  const auto rows = [&](int m, auto dot, auto fma) {
    const double d = ns_per_iteration(dot) / cycle_ns, f = ns_per_iteration(fma) / cycle_ns;
    std::printf("  %4d  %6.2f (%5.1f)      %6.2f (%5.1f)      %.2f\n", m, d, 64.0 / (d * cycle_ns),
                f, 64.0 / (f * cycle_ns), f / d);
  };
  rows(1, dot_lines<1>, fma_lines<1>);
  rows(2, dot_lines<2>, fma_lines<2>);
  rows(4, dot_lines<4>, fma_lines<4>);
  rows(8, dot_lines<8>, fma_lines<8>);
  std::printf("\nthe decode kernel (w4a16_gemm, M = 1, NVFP4, every thread), weights in cache:\n");
  for (const auto& [n, k, calls] : {std::tuple{2048, 2048, 2000}, std::tuple{4096, 4096, 200}}) {
    std::printf("  %5d x %-5d %5.1f GB/s\n", n, k, kernel_in_cache(n, k, calls));
  }
  return 0;
}
