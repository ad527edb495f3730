// The hit cost of OpCache::kernel next to a plain std::unordered_map lookup, in the same run,
// at 1 and 2 threads. The OpCache hit hashes two names and probes a lock-free snapshot; the
// baseline has no lock and one prebuilt std::string key. See docs/PERF.md for the method.
#include <benchmark/benchmark.h>

#include <string>
#include <unordered_map>

#include "metrale/cpu_backend.h"
#include "metrale/op_cache.h"

namespace {

metrale::CpuBackend& backend() {
  static metrale::CpuBackend b(metrale::CpuBackendOptions{metrale::builtin_host_modules(), 1});
  return b;
}

void BM_OpCacheHit(benchmark::State& state) {
  metrale::CpuBackend& b = backend();
  metrale::OpCache& cache = b.op_cache();
  cache.kernel(b, "core", "axpy_f32");  // the miss happens before timing
  for (auto _ : state) {
    benchmark::DoNotOptimize(cache.kernel(b, "core", "axpy_f32"));
  }
}
BENCHMARK(BM_OpCacheHit)->Threads(1)->Threads(2)->UseRealTime();

void BM_UnorderedMapHit(benchmark::State& state) {
  static const std::unordered_map<std::string, std::uint64_t> map = [] {
    std::unordered_map<std::string, std::uint64_t> m;
    m.emplace("core::fill_u32", 1);
    m.emplace("core::axpy_f32", 2);
    return m;
  }();
  const std::string key = "core::axpy_f32";
  for (auto _ : state) {
    benchmark::DoNotOptimize(map.find(key)->second);
  }
}
BENCHMARK(BM_UnorderedMapHit)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
