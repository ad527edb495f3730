// w4a16_gemm on the CPU backend next to the machine's own roofs, measured in the same moments:
// a multi-threaded read of a buffer larger than the caches, and the dot products (or FMAs) the
// kernels multiply with, on every thread. Decode (M ≤ 16) moves the weights once, so its goal is
// a share of that bandwidth (pct_read_bw); from M = 16 on, a share of the compute roof
// (pct_dot_roof: BF16 dot products or FP32 FMAs, whichever the kernels' set uses; the label names
// the set). Both are paired rounds, see below. Shapes: Llama-3 8B's and 70B's linear
// layers (N×K), uploaded in the source layout or the backend's preferred one (the panel layout
// where the CPU has AVX-512 BF16), side by side in one run. See docs/PERF.md for the method.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "toolkit/random_weights.h"
#include "toolkit/roofline.h"
#include "toolkit/rotation.h"

namespace {

using metrale::CpuBackend;

// The benchmark cycles through copies of a layer's weights (toolkit/rotation.h), as a forward
// pass reads each layer once.
// Paired rounds (kernel pass, roof read) per decode case for pct_read_bw, and (kernel pass, roof
// reading) per compute-bound case for pct_dot_roof (each pass is long there).
constexpr int kPairedRounds = 15;
constexpr int kComputeRounds = 5;

struct Fixture {
  CpuBackend backend;
  std::vector<metrale::ops::QuantWeights> copies;
  metrale::DevicePtr a, c;
};

void BM_W4a16(benchmark::State& state) {
  const std::int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  // fmt: 0 NVFP4, 1 MXFP4, 2 INT4 (groups of 128, FP16 scales, zero points: GPTQ's and AWQ's
  // usual form), 3 the same with act order, 4 and 5 rank 0's K slice of those act-ordered weights
  // split along K over 2 and 4 ranks (slice_columns: each group's run padded to 32-K blocks), 6
  // INT4 in groups of 32 (what such a slice's kernels run).
  const auto fmt_id = state.range(3);
  const std::int64_t ranks = fmt_id == 4 ? 2 : fmt_id == 5 ? 4 : 1;
  const auto format = fmt_id == 0   ? metrale::WeightFormat::kNvfp4
                      : fmt_id == 1 ? metrale::WeightFormat::kMxfp4
                                    : metrale::WeightFormat::kInt4;
  const auto layout = state.range(4) ? metrale::ops::UploadLayout::kBackendPreferred
                                     : metrale::ops::UploadLayout::kSource;
  Fixture fx;
  std::mt19937_64 rng(1234);
  metrale::HostQuantWeights hq =
      format == metrale::WeightFormat::kInt4
          ? metrale::toolkit::random_int4_weights(n, k, fmt_id == 6 ? 32 : 128,
                                                  fmt_id >= 3 && fmt_id <= 5, rng)
          : metrale::toolkit::random_weights(format, n, k, rng);
  if (ranks > 1) hq = metrale::slice_columns(hq, 0, k / ranks);
  const std::int64_t a_k = metrale::a_columns(hq);
  const std::size_t copies = metrale::toolkit::rotation_copies(hq.codes.size() + hq.scales.size());
  for (std::size_t i = 0; i < copies; ++i) {
    fx.copies.push_back(metrale::ops::upload_weights(fx.backend, hq, layout));
  }
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * a_k), 0x3F80);  // 1.0 in BF16
  fx.a = fx.backend.alloc(a.size() * 2);
  fx.c = fx.backend.alloc(static_cast<std::size_t>(m * n) * 2);
  fx.backend.copy_h2d(fx.a, a.data(), a.size() * 2);
  const auto stream = fx.backend.default_stream();
  for (const auto& w : fx.copies) metrale::ops::w4a16_gemm(fx.backend, stream, fx.a, m, w, fx.c);
  std::size_t next = 0;
  for (auto _ : state) {
    metrale::ops::w4a16_gemm(fx.backend, stream, fx.a, m, fx.copies[next], fx.c);
    next = next + 1 == fx.copies.size() ? 0 : next + 1;
  }
  const metrale::ops::QuantWeights& w0 = fx.copies.front();
  const double bytes = static_cast<double>(w0.codes_bytes + w0.scales_bytes) +
                       static_cast<double>(m * a_k * 2 + m * n * 2);
  state.counters["GB/s"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  if (ranks > 1) state.counters["stored_K"] = static_cast<double>(hq.k);
  // FLOPs of W's own columns (a padded slice's zeros are work, not output).
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * static_cast<double>(m * n * a_k),
                                                 benchmark::Counter::kIsIterationInvariantRate);

  // A share of a roof by paired rounds: one pass over every copy (at least 512 MiB of weights),
  // then one reading of the roof, back to back; the median of the rounds' ratios of the pass's
  // rate (work per second) to the roof's, and the median roof. The VM's bandwidth drifts with
  // other tenants between about 30 and 50 GB/s, so a roof read once per run (or per case)
  // compared moments, not kernels.
  const auto paired = [&](int rounds, double work_per_copy, const auto& read_roof) {
    std::vector<double> ratios, roofs;
    for (int round = 0; round < rounds; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& w : fx.copies) {
        metrale::ops::w4a16_gemm(fx.backend, stream, fx.a, m, w, fx.c);
      }
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      roofs.push_back(read_roof());
      ratios.push_back(work_per_copy * static_cast<double>(fx.copies.size()) / s / roofs.back());
    }
    std::sort(ratios.begin(), ratios.end());
    std::sort(roofs.begin(), roofs.end());
    return std::pair{ratios[ratios.size() / 2], roofs[roofs.size() / 2]};
  };
  if (m <= 16) {
    // Up to 16 rows the weights' bytes set the pace (the decode route moves them once): the read
    // roof's 512 MiB.
    static const metrale::toolkit::CpuReadProbe roof;
    const auto [share, read_bw] = paired(kPairedRounds, bytes, [&] { return roof.read(); });
    state.counters["pct_read_bw"] = 100.0 * share;
    state.counters["read_bw_GB/s"] = read_bw / 1e9;
  }
  // From 16 rows on, the dot products (or FMAs) set it, where this processor has a vector roof.
  std::string of;
  static const bool has_compute_roof = metrale::toolkit::measure_cpu_compute(&of) > 0;
  if (m >= 16 && has_compute_roof) {
    const double share = paired(kComputeRounds, 2.0 * static_cast<double>(m * n * a_k), [&] {
                           return metrale::toolkit::measure_cpu_compute(&of);
                         }).first;
    state.counters["pct_dot_roof"] = 100.0 * share;
  }
  state.SetLabel(fmt::format("{}{}, {}",
                             metrale::ops::to_string(metrale::ops::choose_route(fx.backend, m, w0)),
                             w0.packing == metrale::ops::WeightPacking::kPanels ? ", panels" : "",
                             metrale::cpu_kernel_isa()));
  for (auto& w : fx.copies) metrale::ops::free_weights(fx.backend, w);
  fx.backend.free(fx.a);
  fx.backend.free(fx.c);
}

// Llama-3 8B and 70B linear layers at decode (M = 1, 16) and batches of 64 and 256; NVFP4 (fmt 0),
// MXFP4 (fmt 1) and INT4 (fmt 2; fmt 3 with act order; 4 and 5 a K slice of that over 2 and 4
// ranks, against fmt 2 at K / ranks; 6 groups of 32); the source layout (panels 0) or the
// backend's preferred one (panels 1). The
// CPU run is a subset of the M list (docs/CONTRACT.md, GEMM goals): M = 4096 would
// take minutes per case.
BENCHMARK(BM_W4a16)
    ->ArgNames({"M", "N", "K", "fmt", "panels"})
    ->Args({1, 6144, 4096, 0, 0})
    ->Args({1, 4096, 4096, 0, 0})
    ->Args({1, 28672, 4096, 0, 0})
    ->Args({1, 4096, 14336, 0, 0})
    ->Args({1, 28672, 4096, 1, 0})
    ->Args({1, 10240, 8192, 0, 0})
    ->Args({1, 8192, 8192, 0, 0})
    ->Args({1, 57344, 8192, 0, 0})
    ->Args({1, 8192, 28672, 0, 0})
    ->Args({16, 28672, 4096, 0, 0})
    ->Args({16, 28672, 4096, 0, 1})
    ->Args({64, 28672, 4096, 0, 0})
    ->Args({64, 28672, 4096, 0, 1})
    ->Args({256, 4096, 4096, 0, 0})
    ->Args({256, 4096, 4096, 0, 1})
    ->Args({1, 4096, 14336, 2, 0})
    ->Args({1, 4096, 14336, 3, 0})
    ->Args({1, 28672, 4096, 2, 0})
    ->Args({16, 28672, 4096, 2, 0})
    ->Args({16, 28672, 4096, 3, 0})
    ->Args({64, 28672, 4096, 2, 0})
    ->Args({64, 28672, 4096, 3, 0})
    ->Args({256, 4096, 4096, 2, 0})
    ->Args({1, 4096, 14336, 2, 1})
    ->Args({4, 28672, 4096, 2, 0})
    ->Args({4, 28672, 4096, 2, 1})
    ->Args({1, 4096, 14336, 3, 1})
    ->Args({1, 28672, 4096, 2, 1})
    ->Args({16, 28672, 4096, 2, 1})
    ->Args({16, 28672, 4096, 3, 1})
    ->Args({64, 28672, 4096, 2, 1})
    ->Args({64, 28672, 4096, 3, 1})
    ->Args({256, 4096, 4096, 2, 1})
    ->Args({1, 4096, 7168, 2, 1})
    ->Args({1, 4096, 7168, 6, 1})
    ->Args({1, 4096, 14336, 4, 1})
    ->Args({1, 4096, 3584, 2, 1})
    ->Args({1, 4096, 14336, 5, 1})
    ->Args({16, 4096, 7168, 2, 1})
    ->Args({16, 4096, 14336, 4, 1})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
