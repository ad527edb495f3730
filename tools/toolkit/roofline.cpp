#include "toolkit/roofline.h"

#include <immintrin.h>
#include <sys/mman.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#if METRALE_TOOLKIT_HAVE_CUDA
#include "metrale/cpu_backend.h"
#include "toolkit/blas_roof.h"
#endif

namespace metrale::toolkit {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

template <class F>
double median_of(int reps, F&& f) {
  std::vector<double> v;
  for (int i = 0; i < reps; ++i) v.push_back(f());
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The highest of reps readings: a compute roof is the most the machine showed; on a loaded one a
// median reads low, and kernels timed in a quieter moment then land above it.
template <class F>
double highest_of(int reps, F&& f) {
  double best = 0;
  for (int i = 0; i < reps; ++i) best = std::max(best, f());
  return best;
}

unsigned host_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace

CpuReadProbe::CpuReadProbe() : words_(kBytes / 8), buf_(nullptr, &std::free) {
  // On 2 MiB transparent huge pages, as the CPU backend allocates weights: with 4 KiB pages the
  // read would pay page walks a kernel reading weights does not, and the roof would be low.
  buf_.reset(static_cast<std::uint64_t*>(std::aligned_alloc(std::size_t{2} << 20, kBytes)));
  if (!buf_) return;
  ::madvise(buf_.get(), kBytes, MADV_HUGEPAGE);
  std::fill(buf_.get(), buf_.get() + words_, std::uint64_t{1});
}

double CpuReadProbe::read() const {
  if (!buf_) return 0;
  const std::uint64_t* buf = buf_.get();
  const std::size_t words = words_;
  const unsigned threads = host_threads();
  std::vector<std::uint64_t> sums(threads);
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (std::size_t i = words * t / threads; i + 4 <= words * (t + 1) / threads; i += 4) {
        s0 += buf[i];
        s1 += buf[i + 1];
        s2 += buf[i + 2];
        s3 += buf[i + 3];
      }
      sums[t] = s0 + s1 + s2 + s3;
    });
  }
  for (auto& th : pool) th.join();
  const double s = seconds_since(t0);
  volatile std::uint64_t sink = sums[0];
  (void)sink;
  return static_cast<double>(words * 8) / s;
}

namespace {

double cpu_read_bandwidth() {
  const CpuReadProbe probe;
  return median_of(5, [&] { return probe.read(); });
}

// Twelve independent FMA chains per thread, enough to cover FMA latency on two pipes; named
// variables so they stay in registers. Returns a value so the loop is not optimized away.
#define METRALE_FMA_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

[[gnu::target("avx512f,fma")]] float fma_loop_avx512(std::int64_t iters) {
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
#define DECL(i) __m512 a##i = _mm512_set1_ps(1.0f + 0.01f * (i));
  METRALE_FMA_CHAINS(DECL)
#undef DECL
  for (std::int64_t n = 0; n < iters; ++n) {
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, x, y);
    METRALE_FMA_CHAINS(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
  METRALE_FMA_CHAINS(SUM)
#undef SUM
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0];
}

[[gnu::target("avx2,fma")]] float fma_loop_avx2(std::int64_t iters) {
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
#define DECL(i) __m256 a##i = _mm256_set1_ps(1.0f + 0.01f * (i));
  METRALE_FMA_CHAINS(DECL)
#undef DECL
  for (std::int64_t n = 0; n < iters; ++n) {
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, x, y);
    METRALE_FMA_CHAINS(STEP)
#undef STEP
  }
  __m256 s = _mm256_setzero_ps();
#define SUM(i) s = _mm256_add_ps(s, a##i);
  METRALE_FMA_CHAINS(SUM)
#undef SUM
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}

// The same for BF16 dot products (vdpbf16ps: 16 lanes, each two products added into FP32), the
// instruction the CPU GEMM kernels multiply with where the processor has AVX-512 BF16.
[[gnu::target("avx512f,avx512bf16")]] float bf16_dot_loop(std::int64_t iters) {
  const __m512bh x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(1e-3f));
#define DECL(i) __m512 a##i = _mm512_set1_ps(1.0f + 0.01f * (i));
  METRALE_FMA_CHAINS(DECL)
#undef DECL
  for (std::int64_t n = 0; n < iters; ++n) {
#define STEP(i) a##i = _mm512_dpbf16_ps(a##i, x, x);
    METRALE_FMA_CHAINS(STEP)
#undef STEP
  }
  __m512 s = _mm512_setzero_ps();
#define SUM(i) s = _mm512_add_ps(s, a##i);
  METRALE_FMA_CHAINS(SUM)
#undef SUM
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0];
}

// FLOP per second of loop (12 chains of one vector instruction, flops_per_step each per chain)
// run on every thread at once; the highest of 3.
double rate_on_every_thread(float (*loop)(std::int64_t), double flops_per_step) {
  const unsigned threads = host_threads();
  const std::int64_t iters = 10'000'000;
  return highest_of(3, [&] {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    std::vector<float> sink(threads);
    for (unsigned t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[t] = loop(iters); });
    for (auto& th : pool) th.join();
    return static_cast<double>(threads) * static_cast<double>(iters) * 12 * flops_per_step /
           seconds_since(t0);
  });
}

// The compute rate of every thread at once, for the instruction set the CPU's GEMM kernels use
// (cpu_kernel_isa, which METRALE_CPU_ISA lowers): BF16 dot products for avx512_bf16 (each does
// twice the multiply-adds of an FP32 FMA; an FP32 roof would read above 100%), else FP32 FMAs at
// the kernels' vector width; nothing for portable code.
double cpu_fma_rate(std::string* of) {
  const std::string_view isa = cpu_kernel_isa();
  if (isa == "avx512_bf16") {
    *of = "BF16 dot products (AVX-512 BF16, the CPU kernels' set) on every thread";
    return rate_on_every_thread(bf16_dot_loop, 16 * 2 * 2);  // 16 lanes, 2 products, mul + add
  }
  if (isa == "avx512") {
    *of = "FP32 FMA (AVX-512, the CPU kernels' set) on every thread";
    return rate_on_every_thread(fma_loop_avx512, 16 * 2);
  }
  if (isa == "avx2") {
    *of = "FP32 FMA (AVX2, the CPU kernels' set) on every thread";
    return rate_on_every_thread(fma_loop_avx2, 8 * 2);
  }
  *of = fmt::format("not measured: the CPU kernels use {} code, which has no vector roof", isa);
  return 0;
}

double device_copy_bandwidth(Backend& b) {
  const std::size_t bytes = std::size_t{1} << 30;
  const DevicePtr src = b.alloc(bytes), dst = b.alloc(bytes);
  const StreamHandle s = b.default_stream();
  double rate = 0;
  try {
    b.memset_async(src, 1, bytes, s);
    b.copy_d2d_async(dst, src, bytes, s);  // warm-up
    b.synchronize(s);
    rate = median_of(5, [&] {
      const auto t0 = Clock::now();
      b.copy_d2d_async(dst, src, bytes, s);
      b.synchronize(s);
      return 2.0 * static_cast<double>(bytes) / seconds_since(t0);
    });
  } catch (...) {
    b.free(src);
    b.free(dst);
    throw;
  }
  b.free(src);
  b.free(dst);
  return rate;
}

}  // namespace

double measure_bandwidth(Backend& backend) {
  return backend.name() == "cpu" ? cpu_read_bandwidth() : device_copy_bandwidth(backend);
}

Roofline measure_roofline(Backend& backend) {
  Roofline r;
  if (backend.name() == "cpu") {
    r.bandwidth = cpu_read_bandwidth();
    r.bandwidth_of = "multi-threaded read of 512 MiB on huge pages";
    r.flops = cpu_fma_rate(&r.flops_of);
  } else {
    r.bandwidth = device_copy_bandwidth(backend);
    r.bandwidth_of = "device-to-device copy of 1 GiB (read + write)";
#if METRALE_TOOLKIT_HAVE_CUDA
    const Bf16Rate rate = measure_bf16_gemm_rate(backend);
    r.flops = rate.flops;
    r.flops_of = rate.what;
#else
    r.flops_of = "not measured (built without the CUDA backend)";
#endif
  }
  return r;
}

double measure_cpu_compute(std::string* of) {
  return cpu_fma_rate(of);
}

double measure_compute(Backend& backend, std::string* of) {
  if (backend.name() == "cpu") return cpu_fma_rate(of);
#if METRALE_TOOLKIT_HAVE_CUDA
  const Bf16Rate rate = measure_bf16_gemm_rate(backend);
  *of = rate.what;
  return rate.flops;
#else
  *of = "not measured (built without the CUDA backend)";
  return 0;
#endif
}

}  // namespace metrale::toolkit
