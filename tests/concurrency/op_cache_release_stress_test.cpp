// The OpCache on its own, without the ModelScope gate: 8 workers look kernels up and request
// scratch of growing sizes on shared and private tags while another thread releases the cache
// at a random moment (issue 7). The backend outlives the cache's release, as a backend whose
// model scope is mid-teardown does. Asserted: every call succeeds or is refused with
// Error(kState) "[kernel] ..." / "[scratch] ..."; a call that began after release() returned
// is refused; once a worker was refused it is refused ever after; until the release begins
// every scratch pointer handed out is on the ledger; the backend was asked for each kernel at
// most once; and after the release no allocation stays on the ledger that no worker received
// (a scratch request racing the release frees what it allocated).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <iostream>
#include <latch>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "concurrency/stress.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::Failures;
using testing::is_refusal;
using testing::rng;

constexpr std::size_t kWorkers = 8;
constexpr int kMaxCalls = 200;  // per worker and iteration; a worker stops once refused twice

struct Shared {
  CpuBackend& backend;
  OpCache cache;
  LedgerProbe probe;
  Failures& failures;
  std::uint64_t seed;
  std::atomic<int> calls{0};
  std::atomic<bool> release_began{false};
  std::atomic<bool> released{false};  // set once release() has returned
  std::atomic<int> refusals{0};
  std::mutex received_mu{};
  std::set<std::uint64_t> received{};  // every scratch pointer a worker got

  void fail(std::string_view what) { failures.add(fmt::format("seed {}: {}", seed, what)); }
};

void worker(Shared& s, std::size_t id, std::uint64_t seed, std::latch& start) {
  std::mt19937_64 gen(seed);
  const char* kernels[] = {"fill_u32", "axpy_f32"};
  start.arrive_and_wait();
  int refusals = 0;
  for (int call = 0; call < kMaxCalls && refusals < 2; ++call) {
    const bool after_release = s.released.load();
    const bool lookup = gen() % 3 == 0;
    try {
      if (lookup) {
        if (!s.cache.kernel(s.backend, "core", kernels[gen() % 2])) s.fail("a null handle");
      } else {
        // Shared tags grow under one another; a private one grows with the call count.
        const bool shared = gen() % 2 == 0;
        const std::size_t bytes = shared ? 64 * (1 + gen() % 64) : 16 * (1 + call) + id;
        const std::string tag =
            shared ? fmt::format("shared{}", gen() % 2) : fmt::format("w{}", id);
        const DevicePtr p = s.cache.scratch(s.backend, tag, bytes);
        {
          std::lock_guard lock(s.received_mu);
          s.received.insert(p.address());
        }
        const auto entry = s.probe.find(p);
        // Read after the find: when the release had not begun by then, p had to be there.
        if ((!entry || entry->bytes < bytes) && !s.release_began.load()) {
          s.fail(
              fmt::format("scratch '{}' handed out 0x{:x}, which is not a live allocation of "
                          "{} bytes",
                          tag, p.address(), bytes));
        }
      }
      if (after_release) {
        s.fail(fmt::format("worker {}: a {} that began after release() returned succeeded", id,
                           lookup ? "lookup" : "scratch request"));
      }
      if (refusals > 0) s.fail(fmt::format("worker {}: a call succeeded after a refusal", id));
    } catch (const Error& e) {
      if (!is_refusal(e, {"[kernel]", "[scratch]"}) ||
          std::string_view(e.what()).find("the op cache was released") == std::string_view::npos) {
        s.fail(fmt::format("worker {}: {}", id, e.what()));
      }
      ++refusals;
      ++s.refusals;
    }
    ++s.calls;
  }
}

// Returns whether the release met workers still calling (some were refused).
bool run_iteration(std::uint64_t seed, Failures& failures) {
  CpuBackend backend(CpuBackendOptions{builtin_host_modules(), 1});
  Shared s{backend, {}, backend.ledger_probe(), failures, seed};
  std::mt19937_64 gen(seed);
  const int target = static_cast<int>(gen() % (kWorkers * kMaxCalls / 2 + 1));
  std::latch start(kWorkers + 1);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < kWorkers; ++w) {
    threads.emplace_back(worker, std::ref(s), w, gen(), std::ref(start));
  }
  threads.emplace_back([&] {
    start.arrive_and_wait();
    while (s.calls.load() < target) std::this_thread::yield();
    s.release_began = true;
    try {
      s.cache.release(backend);
    } catch (const std::exception& e) {
      s.fail(fmt::format("release threw: {}", e.what()));
    }
    s.released = true;
  });
  for (std::thread& t : threads) t.join();

  // Each kernel reached the backend at most once, though lookups raced the release.
  std::map<std::string, int> asked;
  for (const KernelLookup& l : backend.lookup_audit()) ++asked[l.function];
  for (const auto& [fn, n] : asked) {
    if (n > 1) s.fail(fmt::format("{} was resolved {} times", fn, n));
  }
  // What is left on the ledger are outgrown scratch buffers, each received by some worker:
  // nothing was allocated past the release and kept.
  std::size_t left_received = 0;
  for (const std::uint64_t p : s.received) left_received += s.probe.find(DevicePtr{p}) ? 1 : 0;
  if (left_received != s.probe.live_count()) {
    s.fail(fmt::format("{} allocation(s) are live after the release, {} of them received",
                       s.probe.live_count(), left_received));
  }
  const testing::LogCapture quiet(log::Level::kError);  // the sweep names each outgrown buffer
  backend.sweep_unreleased();
  return s.refusals.load() > 0;
}

TEST(ConcurrencyOpCacheRelease, EightWorkersAndAReleaseAtARandomMoment) {
  const int iterations = testing::stress_iterations(200);
  Failures failures;
  int overlapped = 0;
  for (int i = 0; i < iterations && failures.count() == 0; ++i) {
    overlapped += run_iteration(rng()(), failures) ? 1 : 0;
  }
  EXPECT_EQ(failures.count(), 0u) << failures.summary();
  EXPECT_GT(overlapped, 0) << "the release never met workers still calling";
  std::cout << fmt::format("[ STRESS   ] {} iterations, release met workers still calling in {}\n",
                           iterations, overlapped);
}

}  // namespace
}  // namespace metrale
