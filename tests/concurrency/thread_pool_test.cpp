// The CPU backend's thread pool on its own: every index runs exactly once per loop whether the
// workers are still spinning from the last loop or asleep, exceptions reach the caller and leave
// the pool usable, calls from inside a loop run inline, and a pool can be destroyed at any
// moment of its workers' spin. Under ThreadSanitizer (the tsan preset) these also check that
// the spin-then-sleep hand-off publishes the loop's state to the workers.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "concurrency/stress.h"
#include "cpu/thread_pool.h"
#include "metrale/cpu_backend.h"

namespace metrale::testing {
namespace {

using cpu::ThreadPool;

// Runs one loop of n indices and checks each ran exactly once, on at most pool.size() threads.
void expect_each_index_once(ThreadPool& pool, std::size_t n) {
  std::vector<std::atomic<int>> hits(n);
  pool.parallel_for(n, [&](std::size_t i) { hits[i].fetch_add(1, std::memory_order_relaxed); });
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "index " << i << " of " << n;
}

TEST(ThreadPool, BackToBackLoopsRunEveryIndexOnce) {
  // Back to back: the workers are caught while still spinning from the previous loop.
  ThreadPool pool(4);
  const int loops = stress_iterations(2000);
  for (int l = 0; l < loops; ++l) {
    expect_each_index_once(pool, static_cast<std::size_t>(1 + l % 97));
    if (HasFatalFailure()) return;
  }
}

TEST(ThreadPool, LoopsAfterTheWorkersFellAsleepRunEveryIndexOnce) {
  // 2 ms apart, well past the spin: every loop has to wake sleeping workers.
  ThreadPool pool(3);
  for (int l = 0; l < 20; ++l) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    expect_each_index_once(pool, 64);
    if (HasFatalFailure()) return;
  }
}

TEST(ThreadPool, EveryThreadOfThePoolTakesPart) {
  // Indices that wait for each other can only finish if the workers really run them.
  ThreadPool pool(2);
  std::atomic<int> arrived{0};
  pool.parallel_for(2, [&](std::size_t) {
    arrived.fetch_add(1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (arrived.load() < 2 && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  });
  EXPECT_EQ(arrived.load(), 2);
}

TEST(ThreadPool, AnExceptionReachesTheCallerAndThePoolStaysUsable) {
  ThreadPool pool(4);
  for (int l = 0; l < 50; ++l) {
    EXPECT_THROW(pool.parallel_for(256,
                                   [&](std::size_t i) {
                                     if (i == static_cast<std::size_t>(l) % 256) {
                                       throw std::runtime_error("index failed");
                                     }
                                   }),
                 std::runtime_error);
    expect_each_index_once(pool, 300);
    if (HasFatalFailure()) return;
  }
}

TEST(ThreadPool, ALoopInsideALoopRunsInline) {
  ThreadPool pool(4);
  std::atomic<int> inner{0};
  pool.parallel_for(8, [&](std::size_t) {
    pool.parallel_for(5, [&](std::size_t) { inner.fetch_add(1, std::memory_order_relaxed); });
  });
  EXPECT_EQ(inner.load(), 40);
}

TEST(ThreadPool, DestroyedAtAnyMomentOfTheSpin) {
  // Destroyed right after a loop (workers spinning), after a short pause (some asleep), and
  // never used at all; each must join without hanging.
  const int rounds = stress_iterations(200);
  for (int r = 0; r < rounds; ++r) {
    ThreadPool pool(3);
    if (r % 3 != 2) expect_each_index_once(pool, 16);
    if (r % 3 == 1) std::this_thread::sleep_for(std::chrono::microseconds(50 * (r % 7)));
  }
}

// An executor of two threads that splits [0, n) in two halves, as an OpenMP runtime's static
// schedule would, and counts its loops and the threads it ran them on.
struct TwoThreadExecutor {
  std::atomic<int> loops{0};
  std::vector<std::thread::id> threads;
  std::mutex mu;

  CpuExecutor executor() {
    return {this,
            [](void* ctx, std::size_t n, void (*body)(void*, std::size_t, std::size_t), void* arg) {
              auto& self = *static_cast<TwoThreadExecutor*>(ctx);
              self.loops += 1;
              const auto run = [&](std::size_t b, std::size_t e) {
                {
                  std::lock_guard lock(self.mu);
                  self.threads.push_back(std::this_thread::get_id());
                }
                body(arg, b, e);
              };
              std::thread other(run, n / 2, n);
              run(0, n / 2);
              other.join();
            }};
  }
};

TEST(ThreadPool, ALentExecutorRunsTheLoopsOfItsThread) {
  ThreadPool pool(4);
  TwoThreadExecutor lent;
  const CpuExecutor executor = lent.executor();
  {
    const ScopedCpuExecutor scope(executor);
    expect_each_index_once(pool, 97);
    EXPECT_EQ(lent.loops.load(), 1);
    EXPECT_EQ(lent.threads.size(), 2u);
    // Another thread's loops stay on the pool.
    std::thread([&] { expect_each_index_once(pool, 50); }).join();
    EXPECT_EQ(lent.loops.load(), 1);
    // A loop inside a loop runs inline, as on the pool.
    pool.parallel_for(4, [&](std::size_t) { expect_each_index_once(pool, 8); });
    EXPECT_EQ(lent.loops.load(), 2);
  }
  expect_each_index_once(pool, 97);  // the scope ended: the pool's again
  EXPECT_EQ(lent.loops.load(), 2);
}

TEST(ThreadPool, AnExceptionOnALentExecutorReachesTheCaller) {
  ThreadPool pool(2);
  TwoThreadExecutor lent;
  const CpuExecutor executor = lent.executor();
  const ScopedCpuExecutor scope(executor);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.parallel_for(64,
                                 [&](std::size_t i) {
                                   ran += 1;
                                   if (i == 40) throw std::runtime_error("index failed");
                                 }),
               std::runtime_error);
  EXPECT_LT(ran.load(), 64);  // the rest of the failing range was skipped
  expect_each_index_once(pool, 64);
}

TEST(ThreadPool, LentExecutorsNest) {
  ThreadPool pool(2);
  TwoThreadExecutor outer, inner;
  const CpuExecutor a = outer.executor(), b = inner.executor();
  {
    const ScopedCpuExecutor first(a);
    {
      const ScopedCpuExecutor second(b);
      expect_each_index_once(pool, 10);
    }
    expect_each_index_once(pool, 10);
  }
  EXPECT_EQ(std::make_pair(outer.loops.load(), inner.loops.load()), std::make_pair(1, 1));
}

}  // namespace
}  // namespace metrale::testing
