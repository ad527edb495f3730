// MoE layers' grouped GEMMs (ops/grouped_gemm.h) on the CPU backend, next to the machine's read
// roof measured in the same moments. A layer's experts are read only where tokens were routed, so
// the figure is the bytes of the experts actually touched (their codes and scales, plus A and C)
// per second, and pct_read_bw its share of a multi-threaded read of 512 MiB, by paired rounds as
// bench_gemm's (docs/PERF.md). Shapes: gpt-oss-20b and -120b (MXFP4, 32 and 128 experts, top 4,
// H = I = 2880), Qwen3-30B-A3B (128 experts, top 8, H 2048, I 768) in NVFP4 and INT4, DeepSeek-V3
// (256 experts, top 8, H 7168, I 2048) in NVFP4. Routings drawn with expert e weighted
// (e + 1)^-skew (skew 0: uniform; 1.2: the skew of a popular few), cycled with copies of the
// weights. At one token the routings are disjoint (a random permutation of the experts, k at a
// time), so a cycle reads every expert of every copy once and no run finds its experts in the
// caches; a cycle covers at least 1 GiB of weights (this VM reports a 480 MiB L3).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/quant.h"
#include "toolkit/moe_routing.h"
#include "toolkit/random_weights.h"
#include "toolkit/roofline.h"

namespace {

using metrale::CpuBackend;
using metrale::DevicePtr;

constexpr int kPairedRounds = 7;
constexpr int kComputeRounds = 3;
constexpr int kRoutings = 8;  // above one token; at one token E / k disjoint ones
// Copies of the weights: a cycle over all of them reads at least this much.
constexpr std::size_t kMinCycleBytes = std::size_t{1} << 30;

// A routing with its counts and offsets on the device.
struct Routing : metrale::toolkit::MoeRoutingCounts {
  DevicePtr d_counts, d_offsets;
};

void BM_MoeGrouped(benchmark::State& state) {
  const std::int64_t tokens = state.range(0), n = state.range(1), k = state.range(2);
  const auto experts = static_cast<int>(state.range(3));
  const auto top_k = static_cast<int>(state.range(4));
  const auto fmt_id = state.range(5);  // 0 NVFP4, 1 MXFP4, 2 INT4 (groups of 128, zero points)
  const double skew = static_cast<double>(state.range(6)) / 10.0;
  const auto format = fmt_id == 0   ? metrale::WeightFormat::kNvfp4
                      : fmt_id == 1 ? metrale::WeightFormat::kMxfp4
                                    : metrale::WeightFormat::kInt4;
  CpuBackend backend;
  std::mt19937_64 rng(4321);
  // One expert's random weights, uploaded E times: the kernels' work and bytes are those of E
  // distinct experts; drawing E sets would only lengthen the set-up.
  const metrale::HostQuantWeights one =
      format == metrale::WeightFormat::kInt4
          ? metrale::toolkit::random_int4_weights(n, k, 128, false, rng)
          : metrale::toolkit::random_weights(format, n, k, rng);
  const std::vector<metrale::HostQuantWeights> host(static_cast<std::size_t>(experts), one);
  std::vector<Routing> routings;
  for (metrale::toolkit::MoeRoutingCounts& r :
       metrale::toolkit::moe_routings(rng, tokens, experts, top_k, skew, kRoutings)) {
    routings.push_back({std::move(r), {}, {}});
  }
  const double expert_bytes = static_cast<double>(one.codes.size() + one.scales.size());
  double touched_per_pass = 0.0;
  for (const Routing& r : routings) touched_per_pass += static_cast<double>(r.touched);
  const auto copies = static_cast<std::size_t>(
      std::max(1.0, std::ceil(static_cast<double>(kMinCycleBytes) / (experts * expert_bytes))));
  std::vector<std::unique_ptr<metrale::ops::GroupedWeightsResource>> weights;
  for (std::size_t i = 0; i < copies; ++i) {
    weights.push_back(std::make_unique<metrale::ops::GroupedWeightsResource>(
        backend, host, "experts", metrale::ops::UploadLayout::kBackendPreferred));
  }
  for (Routing& r : routings) {
    r.d_counts = backend.alloc(r.counts.size() * 4);
    r.d_offsets = backend.alloc(r.offsets.size() * 4);
    backend.copy_h2d(r.d_counts, r.counts.data(), r.counts.size() * 4);
    backend.copy_h2d(r.d_offsets, r.offsets.data(), r.offsets.size() * 4);
  }
  const std::int64_t rows = tokens * top_k;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(rows * k), 0x3F80);  // 1.0 in BF16
  const DevicePtr da = backend.alloc(a.size() * 2);
  const DevicePtr dc = backend.alloc(static_cast<std::size_t>(rows * n) * 2);
  backend.copy_h2d(da, a.data(), a.size() * 2);
  const metrale::ops::GroupedGemmPlan plan =
      metrale::ops::plan_grouped(backend, rows, weights.front()->weights());
  const auto stream = backend.default_stream();
  const metrale::ops::GroupedGemmWorkspace ws = metrale::ops::scratch_workspace(plan, stream);
  const auto run = [&](std::size_t copy, const Routing& r) {
    metrale::ops::run_grouped(plan, stream, da, weights[copy]->weights(), r.d_counts, r.d_offsets,
                              dc, ws);
  };
  // One pass: every copy with every routing.
  const auto pass = [&] {
    for (std::size_t c = 0; c < copies; ++c) {
      for (const Routing& r : routings) run(c, r);
    }
    backend.synchronize(stream);
  };
  pass();
  std::size_t next = 0;
  for (auto _ : state) {
    run(next / routings.size(), routings[next % routings.size()]);
    backend.synchronize(stream);
    next = (next + 1) % (copies * routings.size());
  }
  const double io = static_cast<double>(rows * k * 2 + rows * n * 2);
  const auto runs = static_cast<double>(routings.size());
  const double per_run = touched_per_pass / runs * expert_bytes + io;
  state.counters["touched_GB/s"] =
      benchmark::Counter(per_run, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["experts_touched"] = touched_per_pass / runs;
  state.counters["MB_per_token"] =
      touched_per_pass / runs * expert_bytes / 1e6 / static_cast<double>(tokens);
  // The same work as one dense GEMM per expert with rows (ops/gemm.h on the expert's view): what
  // a runtime without the grouped op would launch.
  const auto pass_per_expert = [&] {
    for (std::size_t c = 0; c < copies; ++c) {
      const metrale::ops::GroupedWeights& w = weights[c]->weights();
      for (const Routing& r : routings) {
        for (int e = 0; e < experts; ++e) {
          if (r.counts[e] == 0) continue;
          const auto first = static_cast<std::uint64_t>(r.offsets[e]);
          metrale::ops::w4a16_gemm(backend, stream, da.offset(first * k * 2), r.counts[e],
                                   w.view(e), dc.offset(first * n * 2));
        }
      }
    }
    backend.synchronize(stream);
  };
  // Paired rounds: a pass, a pass of per-expert GEMMs, then a reading of the read roof; the
  // median ratio of the pass's touched bytes per second to the roof's, and of the two passes'
  // times.
  static const metrale::toolkit::CpuReadProbe roof;
  std::vector<double> ratios, roofs, vs_dense;
  for (int round = 0; round < kPairedRounds; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    const auto t1 = std::chrono::steady_clock::now();
    pass_per_expert();
    const double s = std::chrono::duration<double>(t1 - t0).count();
    vs_dense.push_back(
        s / std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count());
    roofs.push_back(roof.read());
    const double moved =
        (touched_per_pass * expert_bytes + io * runs) * static_cast<double>(copies);
    ratios.push_back(moved / s / roofs.back());
  }
  std::sort(ratios.begin(), ratios.end());
  std::sort(roofs.begin(), roofs.end());
  std::sort(vs_dense.begin(), vs_dense.end());
  state.counters["time_vs_per_expert"] = vs_dense[vs_dense.size() / 2];
  state.counters["pct_read_bw"] = 100.0 * ratios[ratios.size() / 2];
  // From 16 rows an expert on (the batched goal), the dot products set the pace: the
  // share of the compute roof by paired rounds (a pass, then a reading of the roof).
  const double rows_per_expert = static_cast<double>(rows) * runs / touched_per_pass;
  state.counters["rows_per_expert"] = rows_per_expert;
  std::string of;
  static const bool has_compute_roof = metrale::toolkit::measure_cpu_compute(&of) > 0;
  if (rows_per_expert >= 16 && has_compute_roof) {
    std::vector<double> shares;
    const double flops =
        2.0 * static_cast<double>(rows * n * k) * runs * static_cast<double>(copies);
    for (int round = 0; round < kComputeRounds; ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      pass();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      shares.push_back(flops / s / metrale::toolkit::measure_cpu_compute(&of));
    }
    std::sort(shares.begin(), shares.end());
    state.counters["pct_dot_roof"] = 100.0 * shares[shares.size() / 2];
  }
  state.counters["read_bw_GB/s"] = roofs[roofs.size() / 2] / 1e9;
  state.SetLabel(fmt::format(
      "{} {}, {}", metrale::to_string(format),
      weights.front()->weights().expert.packing == metrale::ops::WeightPacking::kPanels ? "panels"
                                                                                        : "source",
      metrale::cpu_kernel_isa()));
  for (Routing& r : routings) {
    backend.free(r.d_counts);
    backend.free(r.d_offsets);
  }
  backend.free(da);
  backend.free(dc);
  for (auto& w : weights) w->release(backend);
}

// tokens, N, K, experts, top_k, fmt, skew x 10. gate_up (N = 2I) and down (K = I) of each model.
BENCHMARK(BM_MoeGrouped)
    ->ArgNames({"T", "N", "K", "E", "k", "fmt", "skew10"})
    // gpt-oss-20b, MXFP4
    ->Args({1, 5760, 2880, 32, 4, 1, 0})
    ->Args({1, 2880, 2880, 32, 4, 1, 0})
    ->Args({16, 5760, 2880, 32, 4, 1, 0})
    ->Args({16, 5760, 2880, 32, 4, 1, 12})
    ->Args({64, 5760, 2880, 32, 4, 1, 12})
    // gpt-oss-120b, MXFP4
    ->Args({1, 5760, 2880, 128, 4, 1, 0})
    // Qwen3-30B-A3B, NVFP4 and INT4
    ->Args({1, 1536, 2048, 128, 8, 0, 0})
    ->Args({1, 2048, 768, 128, 8, 0, 0})
    ->Args({16, 1536, 2048, 128, 8, 0, 12})
    ->Args({1, 1536, 2048, 128, 8, 2, 0})
    // About 16 rows an expert (uniform): the batched goal's share of the dot roof
    ->Args({128, 5760, 2880, 32, 4, 1, 0})
    ->Args({256, 1536, 2048, 128, 8, 0, 0})
    // DeepSeek-V3, NVFP4
    ->Args({1, 4096, 7168, 256, 8, 0, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
