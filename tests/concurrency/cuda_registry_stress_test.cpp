// The CUDA backend and its ModuleRegistry on the fake driver under 8 worker threads while
// another thread tears the model down at a random moment (issue 7). Workers, each holding a
// ModelScope::Use per unit of work and its own reference to the registry, look kernels up
// through the OpCache, resolve them directly (each resolution reads the module's published
// symbols through the backend: cuModuleGetGlobal and a device-to-host copy), query the
// registry, try to release it (refused: others hold it), launch, allocate and free, and read
// reports and guard bands. Asserted: every call succeeds or is refused with Error(kState)
// naming the API; every pointer is on the ledger while used; registry releases are refused
// until every holder is gone and then unload everything; the fake driver is left holding
// nothing of the model.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iostream>
#include <latch>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "concurrency/stress.h"
#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::Failures;
using metrale::testing::is_refusal;
using metrale::testing::LogCapture;
using metrale::testing::rng;

constexpr std::size_t kWorkers = 8;
constexpr int kMaxOps = 32;
constexpr std::uint32_t kTile = 256;

enum class Op { kLookup, kResolve, kRegistry, kFill, kAllocFree, kReports, kCount };

struct Shared {
  Rig& rig;
  ModelScope& scope;
  LedgerProbe probe;
  Failures& failures;
  std::uint64_t seed;
  std::atomic<int> ops_done{0};
  std::atomic<std::size_t> workers_done{0};
  std::atomic<bool> torn{false};
  std::atomic<int> refused{0};

  void fail(std::string_view what) { failures.add(fmt::format("seed {}: {}", seed, what)); }
  void expect_owned(DevicePtr p, std::size_t bytes, std::string_view what) {
    const auto e = probe.find(p);
    if (!e || e->bytes < bytes) {
      fail(fmt::format("{}: 0x{:x} is not a live allocation of {} bytes while in use", what,
                       p.address(), bytes));
    }
  }
  void expect_words(Backend& b, DevicePtr p, std::size_t n, std::uint32_t value,
                    std::string_view what) {
    std::vector<std::uint32_t> got(n);
    b.copy_d2h(got.data(), p, n * 4);
    if (std::any_of(got.begin(), got.end(), [&](std::uint32_t w) { return w != value; })) {
      fail(fmt::format("{}: 0x{:x} does not hold what was written", what, p.address()));
    }
  }
};

// Tries to release the registry through a worker's own reference: refused while others hold it.
void expect_release_refused(Shared& s, std::shared_ptr<ModuleRegistry>& mine) {
  try {
    ModuleRegistry::release(mine);
    s.fail("release_registry unloaded the modules while others held the registry");
  } catch (const Error& e) {
    if (!is_refusal(e, {"[release_registry]"})) s.fail(fmt::format("release threw: {}", e.what()));
  }
  if (!mine) s.fail("a refused release dropped the caller's reference");
}

void one_op(Shared& s, Backend& b, std::shared_ptr<ModuleRegistry>& mine, Op op, std::size_t worker,
            int step, std::mt19937_64& gen) {
  const char* fn = gen() % 2 ? "fill_u32" : "axpy_f32";
  switch (op) {
    case Op::kLookup: {
      const ResolvedKernel& h = b.op_cache().kernel(b, "core", fn);
      if (b.kernel_n_tile(h) != kTile) s.fail(fmt::format("{} lost its published tile", fn));
      return;
    }
    case Op::kResolve: {
      // Straight to the backend, past the memo: reads the published symbols again.
      const ResolvedKernel h = b.kernel("core", fn);
      if (h != b.op_cache().kernel(b, "core", fn)) s.fail("two handles for one kernel");
      if (b.kernel_n_tile(h) != kTile) s.fail(fmt::format("{} lost its published tile", fn));
      return;
    }
    case Op::kRegistry: {
      if (mine->find("core") == nullptr || !b.has_module("core") || b.modules().size() != 1) {
        s.fail("the registry lost its module");
      }
      expect_release_refused(s, mine);
      if (s.rig.fd.outstanding().modules != 1) s.fail("a module was unloaded while in use");
      return;
    }
    case Op::kFill: {
      const std::size_t words = 64 * (1 + step % 8) + worker;
      const DevicePtr p = b.op_cache().scratch(b, fmt::format("w{}", worker), words * 4);
      s.expect_owned(p, words * 4, "scratch");
      const auto value = static_cast<std::uint32_t>(gen());
      ops::fill_u32(b, b.default_stream(), p, words, value);
      s.expect_words(b, p, words, value, "scratch");
      return;
    }
    case Op::kAllocFree: {
      const std::size_t bytes = 4 * (1 + gen() % 512);
      const DevicePtr p = b.alloc(bytes);
      s.expect_owned(p, bytes, "alloc");
      const auto byte = static_cast<std::uint8_t>(gen());
      b.memset(p, byte, bytes);
      s.expect_words(b, p, bytes / 4, 0x01010101u * byte, "alloc");
      b.free(p);
      return;
    }
    case Op::kReports: {
      const AllocStats st = b.alloc_stats();
      if (st.allocation_count != st.free_count + st.current_count) s.fail("inconsistent stats");
      if (!b.alloc_report(3).starts_with("allocation ledger: ")) s.fail("alloc_report: no header");
      if (b.scan_redzones() != 0) s.fail("a guard band was overwritten");
      return;
    }
    case Op::kCount:
      break;
  }
}

void worker(Shared& s, std::shared_ptr<ModuleRegistry> mine, std::size_t id, std::uint64_t seed,
            std::latch& start) {
  std::mt19937_64 gen(seed);
  start.arrive_and_wait();
  for (int step = 0; step < kMaxOps;) {
    std::optional<ModelScope::Use> use;
    try {
      use.emplace(s.scope.use());
    } catch (const Error& e) {
      if (!is_refusal(e, {"[ModelScope::use]"})) s.fail(fmt::format("use() threw: {}", e.what()));
      ++s.refused;
      // The backend is gone (or going), but this thread still holds the registry.
      expect_release_refused(s, mine);
      return;
    }
    Backend& b = use->backend();
    for (int k = 1 + static_cast<int>(gen() % 3); k > 0 && step < kMaxOps; --k, ++step) {
      const Op op = static_cast<Op>(gen() % static_cast<int>(Op::kCount));
      try {
        one_op(s, b, mine, op, id, step, gen);
      } catch (const std::exception& e) {
        s.fail(fmt::format("worker {} op {} inside a Use: {}", id, static_cast<int>(op), e.what()));
      }
      ++s.ops_done;
    }
  }
  ++s.workers_done;
}

void run_iteration(std::uint64_t seed, Failures& failures, int& overlapped, int& ops) {
  Rig rig({.modules = {core_module(kTile)}, .make_backend = false});
  auto owned = std::make_unique<CudaBackend>(rig.host, rig.registry);
  owned->set_guard_bands(GuardBandConfig{.pad_bytes = 32});
  owned->set_debug_sync(false);
  ModelScope scope(std::move(owned));
  Shared s{rig, scope, scope.backend().ledger_probe(), failures, seed};

  std::mt19937_64 gen(seed);
  const int target = static_cast<int>(gen() % (kWorkers * kMaxOps * 3 / 4 + 1));
  std::latch start(kWorkers + 1);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back(worker, std::ref(s), rig.registry, w, gen(), std::ref(start));
  }
  threads.emplace_back([&] {
    start.arrive_and_wait();
    while (s.ops_done.load() < target && s.workers_done.load() < kWorkers) {
      std::this_thread::yield();
    }
    overlapped += scope.live_uses() > 0 ? 1 : 0;
    const TeardownReport report = scope.teardown();
    s.torn = true;
    for (const auto& f : report.failures)
      s.fail(fmt::format("teardown: {}: {}", f.label, f.message));
    if (report.live_bytes_after != 0) s.fail("teardown left live bytes");
    // The sweep frees what no resource released: anything it found is a leak.
    if (report.swept != 0) s.fail("the ledger sweep freed " + report.leak_summary());
  });
  for (std::thread& t : threads) t.join();

  // Every worker's reference is gone with its thread: now the registry can go.
  if (rig.fd.outstanding().modules != 1)
    s.fail("a module was unloaded before the last holder left");
  try {
    ModuleRegistry::release(rig.registry);
  } catch (const std::exception& e) {
    s.fail(fmt::format("the last holder's release threw: {}", e.what()));
  }
  ops += s.ops_done.load();
  const FakeOutstanding left = rig.fd.outstanding();
  if (left.modules != 0 || left.allocations != 0 || left.events != 0 || left.graphs != 0 ||
      left.streams != 1) {  // the host's own stream lives with the host
    s.fail(fmt::format("the fake still holds {} module(s), {} allocation(s), {} stream(s)",
                       left.modules, left.allocations, left.streams));
  }
}

TEST(ConcurrencyCudaRegistry, EightWorkersOnTheFakeDriverAndATeardownAtARandomMoment) {
  const int iterations = metrale::testing::stress_iterations(150);
  const LogCapture logs(log::Level::kError);  // the sweep warns about outgrown scratch
  Failures failures;
  int overlapped = 0, ops = 0;
  for (int i = 0; i < iterations && failures.count() == 0; ++i) {
    run_iteration(rng()(), failures, overlapped, ops);
  }
  EXPECT_EQ(failures.count(), 0u) << failures.summary();
  EXPECT_TRUE(logs.lines().empty()) << logs.lines().front().text;
  EXPECT_GT(overlapped, 0) << "teardown never met a live use";
  std::cout << fmt::format("[ STRESS   ] {} iterations, {} ops, teardown met live uses in {}\n",
                           iterations, ops, overlapped);
}

}  // namespace
}  // namespace metrale::cuda::testing
