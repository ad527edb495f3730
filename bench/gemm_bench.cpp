// w4a16_gemm on the CPU backend next to the machine's own read bandwidth, measured in the same
// run by a multi-threaded read of a buffer larger than the caches. Decode (M ≤ 16) moves the
// weights once, so its goal is a share of that bandwidth; the figure is reported as
// pct_read_bw. Shapes: Llama-3 8B's linear layers (N×K). See docs/PERF.md for the method.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "roofline.h"

namespace {

using metrale::CpuBackend;

// Bytes per second of the machine's read roof (the CLI's measurement), measured once.
double read_bandwidth() {
  static const double bw = [] {
    CpuBackend b;
    return metrale::cli::measure_roofline(b).bandwidth;
  }();
  return bw;
}

void BM_ReadBandwidth(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(read_bandwidth());
  state.counters["GB/s"] = read_bandwidth() / 1e9;
}
BENCHMARK(BM_ReadBandwidth)->Iterations(1);

struct Fixture {
  CpuBackend backend;
  metrale::ops::QuantWeights w;
  metrale::DevicePtr a, c;
};

void BM_W4a16(benchmark::State& state) {
  const std::int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const auto format =
      state.range(3) ? metrale::WeightFormat::kMxfp4 : metrale::WeightFormat::kNvfp4;
  Fixture fx;
  std::mt19937 rng(1234);
  std::normal_distribution<float> d(0.0f, 0.02f);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (float& x : w) x = d(rng);
  const auto hq = format == metrale::WeightFormat::kNvfp4 ? metrale::quantize_nvfp4(w, n, k)
                                                          : metrale::quantize_mxfp4(w, n, k);
  fx.w = metrale::ops::upload_weights(fx.backend, hq);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k), 0x3F80);  // 1.0 in BF16
  fx.a = fx.backend.alloc(a.size() * 2);
  fx.c = fx.backend.alloc(static_cast<std::size_t>(m * n) * 2);
  fx.backend.copy_h2d(fx.a, a.data(), a.size() * 2);
  const auto stream = fx.backend.default_stream();
  metrale::ops::w4a16_gemm(fx.backend, stream, fx.a, m, fx.w, fx.c);  // warm-up
  for (auto _ : state) metrale::ops::w4a16_gemm(fx.backend, stream, fx.a, m, fx.w, fx.c);
  const double bytes = static_cast<double>(fx.w.codes_bytes + fx.w.scales_bytes) +
                       static_cast<double>(m * k * 2 + m * n * 2);
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(m * n * k),
                                                 benchmark::Counter::kIsIterationInvariantRate);
  state.counters["read_bw_GB/s"] = read_bandwidth() / 1e9;
  state.SetLabel(metrale::ops::to_string(metrale::ops::choose_route(fx.backend, m, fx.w)).data());
  metrale::ops::free_weights(fx.backend, fx.w);
  fx.backend.free(fx.a);
  fx.backend.free(fx.c);
}

// Llama-3 8B and 70B linear layers at decode (M = 1, 16) and a small prefill; NVFP4 (0) and
// MXFP4 (1). The CPU run is a subset of issue 4's M list: M = 4096 would take minutes per case.
BENCHMARK(BM_W4a16)
    ->ArgNames({"M", "N", "K", "mx"})
    ->Args({1, 6144, 4096, 0})
    ->Args({1, 4096, 4096, 0})
    ->Args({1, 28672, 4096, 0})
    ->Args({1, 4096, 14336, 0})
    ->Args({1, 28672, 4096, 1})
    ->Args({1, 10240, 8192, 0})
    ->Args({1, 8192, 8192, 0})
    ->Args({1, 57344, 8192, 0})
    ->Args({1, 8192, 28672, 0})
    ->Args({16, 28672, 4096, 0})
    ->Args({256, 4096, 4096, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
