#include "roofline.h"

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace metrale::cli {
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

unsigned host_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

double cpu_read_bandwidth() {
  const std::size_t words = (std::size_t{512} << 20) / 8;  // 512 MiB: far beyond any cache
  std::vector<std::uint64_t> buf(words, 1);
  const unsigned threads = host_threads();
  return median_of(5, [&] {
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
  });
}

// 8 independent FMA chains of 8 lanes per thread: enough to fill two FMA pipes.
[[gnu::target("avx2,fma")]] double fma_loop(std::int64_t iters) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_set1_ps(1.0f);
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iters; ++i) {
    for (auto& a : acc) a = _mm256_fmadd_ps(a, x, y);
  }
  __m256 s = acc[0];
  for (int i = 1; i < 8; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}

double cpu_fma_rate() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return 0;
  const unsigned threads = host_threads();
  const std::int64_t iters = 20'000'000;
  return median_of(3, [&] {
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    std::vector<double> sink(threads);
    for (unsigned t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[t] = fma_loop(iters); });
    for (auto& th : pool) th.join();
    return static_cast<double>(threads) * static_cast<double>(iters) * 8 * 8 * 2 /
           seconds_since(t0);
  });
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

Roofline measure_roofline(Backend& backend) {
  Roofline r;
  if (backend.name() == "cpu") {
    r.bandwidth = cpu_read_bandwidth();
    r.bandwidth_of = "multi-threaded read of 512 MiB";
    r.flops = cpu_fma_rate();
    r.flops_of = "FP32 FMA (AVX2) on every thread";
  } else {
    r.bandwidth = device_copy_bandwidth(backend);
    r.bandwidth_of = "device-to-device copy of 1 GiB (read + write)";
    r.flops_of = "not measured (BF16 through cuBLASLt is not wired yet)";
  }
  return r;
}

}  // namespace metrale::cli
