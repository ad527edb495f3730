// Borrows raced (ctest -L concurrency): four threads lend the CPU backend the same range at the
// same moment. Exactly one borrow may be made; the others are refused as overlapping, and the one
// made stays whole (the caller's memory still reachable, its release run once when given back).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "concurrency/stress.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"

namespace metrale::testing {
namespace {

TEST(ConcurrencyBorrow, FourThreadsLendingOneRangeMakeExactlyOneBorrow) {
  constexpr int kThreads = 4;
  const int iterations = stress_iterations(300);
  CpuBackend b;
  std::vector<std::uint8_t> host(4096, 0);
  const DevicePtr p{reinterpret_cast<std::uintptr_t>(host.data())};
  Failures failures;
  for (int it = 0; it < iterations; ++it) {
    std::atomic<int> made{0}, released{0};
    std::latch start(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        start.arrive_and_wait();
        try {
          // A different start each thread, all overlapping the same bytes.
          b.borrow(p.offset(static_cast<std::int64_t>(t)), host.size() - 8,
                   [&] { released.fetch_add(1); });
          made.fetch_add(1);
        } catch (const Error& e) {
          const std::string what = e.what();
          if (e.code() != ErrorCode::kInvalidArgument ||
              what.find("overlaps borrowed memory") == std::string::npos) {
            failures.add(fmt::format("iteration {}: {}", it, what));
          }
        }
      });
    }
    for (std::thread& th : threads) th.join();
    if (made.load() != 1) {
      failures.add(fmt::format("iteration {}: {} borrows made", it, made.load()));
    }
    if (b.alloc_stats().borrowed_count != 1) {
      failures.add(fmt::format("iteration {}: {} borrows on the ledger", it,
                               b.alloc_stats().borrowed_count));
    }
    // The borrow made is whole: its range takes a fill, and it gives back once.
    for (int t = 0; t < kThreads; ++t) {
      const DevicePtr start_at = p.offset(t);
      try {
        b.memset(start_at, static_cast<std::uint8_t>(it), 16);
        b.unborrow(start_at);
        break;
      } catch (const Error&) {
        // not this thread's start
      }
      if (t == kThreads - 1) failures.add(fmt::format("iteration {}: no usable borrow", it));
    }
    if (released.load() != 1) {
      failures.add(fmt::format("iteration {}: {} releases ran", it, released.load()));
    }
  }
  EXPECT_EQ(failures.count(), 0u) << failures.summary();
  EXPECT_EQ(b.alloc_stats().borrowed_count, 0u);
}

}  // namespace
}  // namespace metrale::testing
