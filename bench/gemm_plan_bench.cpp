// The cost of the GEMM protocol on the CPU backend, apart from any kernel's work: the module's
// entries are replaced by kernels that return at once (with the real module's published
// metadata), so each figure is the op layer plus the backend's launch. Side by side in one run:
//   BM_RawLaunch   launch_typed of the planned GEMM kernel with a prepared argument block
//   BM_Run         ops::run(plan, ...): buffer checks, then that launch
//   BM_Plan        ops::plan(...): checks, route, lookups (OpCache hits), grid and workspace
//   BM_W4a16Gemm   ops::w4a16_gemm: checks, plan, scratch workspace, launch
// run() − raw launch is the protocol's per-call overhead (docs/PERF.md, "GEMM plan and run").
#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/gemm_params.h"
#include "kernels/manifest.h"
#include "metrale/cpu_backend.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"

namespace {

using namespace metrale;

void noop(const HostBlock&) {}

// The built-in modules with every w4a16 entry a no-op that publishes what the real one does.
CpuBackendOptions noop_w4a16() {
  CpuBackendOptions o{builtin_host_modules(), 1};
  for (HostModule& m : o.modules) {
    if (m.name() != "w4a16") continue;
    HostModule fake("w4a16");
    for (const HostKernel& k : m.kernels()) {
      fake.add_kernel(k.name, noop, {k.param_sizes.at(0)});  // one argument block each
      for (const std::string_view suffix : manifest::kPublishedSuffixes) {
        const std::string symbol = k.name + std::string(suffix);
        if (const auto* bytes = m.find_symbol(symbol)) fake.publish(symbol, *bytes);
      }
    }
    m = std::move(fake);
  }
  return o;
}

// One decode-sized layer (M = 1, 4096 x 4096 NVFP4) with its buffers.
struct Fixture {
  CpuBackend b{noop_w4a16()};
  ops::QuantWeights w;
  DevicePtr a, c;
  std::int64_t m = 1;
  Fixture() {
    const std::int64_t n = 4096, k = 4096;
    w.format = WeightFormat::kNvfp4;
    w.n = n;
    w.k = k;
    w.codes_bytes = static_cast<std::size_t>(n * k / 2);
    w.scales_bytes = static_cast<std::size_t>(n * k / 16);
    w.codes = b.alloc(w.codes_bytes);
    w.scales = b.alloc(w.scales_bytes);
    a = b.alloc(static_cast<std::size_t>(m * k * 2));
    c = b.alloc(static_cast<std::size_t>(m * n * 2));
  }
  ~Fixture() {
    for (const DevicePtr p : {w.codes, w.scales, a, c}) b.free(p);
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_RawLaunch(benchmark::State& state) {
  Fixture& f = fixture();
  const ops::GemmPlan p = ops::plan(f.b, f.m, f.w);
  const ops::PlannedLaunch& l = p.launches.back();
  GemmParams params;
  params.a = f.a.address();
  params.codes = f.w.codes.address();
  params.scales = f.w.scales.address();
  params.out = f.c.address();
  params.m = f.m;
  params.n = f.w.n;
  params.k = f.w.k;
  params.k_per_split = f.w.k;
  const StreamHandle s = f.b.default_stream();
  for (auto _ : state) {
    f.b.launch_typed(l.kernel, l.grid, l.block, 0, s, std::array{KernelArg::value(params)});
  }
}
BENCHMARK(BM_RawLaunch);

void BM_Run(benchmark::State& state) {
  Fixture& f = fixture();
  const ops::GemmPlan p = ops::plan(f.b, f.m, f.w);
  const StreamHandle s = f.b.default_stream();
  for (auto _ : state) ops::run(p, s, f.a, f.w, f.c, {});
}
BENCHMARK(BM_Run);

void BM_Plan(benchmark::State& state) {
  Fixture& f = fixture();
  for (auto _ : state) benchmark::DoNotOptimize(ops::plan(f.b, f.m, f.w));
}
BENCHMARK(BM_Plan);

void BM_W4a16Gemm(benchmark::State& state) {
  Fixture& f = fixture();
  const StreamHandle s = f.b.default_stream();
  for (auto _ : state) ops::w4a16_gemm(f.b, s, f.a, f.m, f.w, f.c);
}
BENCHMARK(BM_W4a16Gemm);

}  // namespace
