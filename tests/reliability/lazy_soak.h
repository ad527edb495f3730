// The lazy-buffer soak shared by the CPU and fake-driver runs: METRALE_LAZY_SOAK_CYCLES (default
// 10,000, under ASan too: a cycle is a few system calls) reserve-grow-grow-write-release cycles,
// each leaving the ledger empty and whatever the caller checks; the heap no larger at the end
// than after cycle 100.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <iostream>

#include "metrale/backend.h"
#include "reliability/soak.h"

namespace metrale::testing::reliability {

// One cycle on b; a fatal gtest failure when anything is left on the ledger.
inline void lazy_cycle(Backend& b, std::size_t i) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  LazyBuffer buf = b.reserve_lazy(8 * kMiB, "soak");
  buf.grow(1 + i % (2 * kMiB));
  const std::uint64_t word = i;
  b.copy_h2d(buf.base(), &word, sizeof word);
  buf.grow(8 * kMiB - (i % 3) * 2 * kMiB);
  std::uint64_t back = 0;
  b.copy_d2h(&back, buf.base(), sizeof back);
  ASSERT_EQ(back, word) << "cycle " << i;
  buf.release();
  ASSERT_EQ(b.live_bytes(), 0u) << "cycle " << i;
  ASSERT_EQ(b.live_alloc_count(), 0u) << "cycle " << i;
}

// Runs the cycles; after_cycle(i) checks what the backend's driver holds.
template <class AfterCycle>
void run_lazy_soak(const char* what, Backend& b, AfterCycle after_cycle) {
  const std::size_t cycles = soak_cycles("METRALE_LAZY_SOAK_CYCLES");
  std::size_t heap_warm = 0;
  LogCapture logs(log::Level::kWarn);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 1; i <= cycles; ++i) {
    lazy_cycle(b, i);
    after_cycle(i);
    if (::testing::Test::HasFatalFailure()) return;
    if (i == 100) heap_warm = heap_in_use();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (cycles >= 100) {
    EXPECT_LE(heap_in_use(), heap_warm + kHeapSlack) << what;
  }
  EXPECT_TRUE(logs.lines().empty()) << what << ": " << logs.lines().front().text;
  std::cout << "lazy soak " << what << ": " << cycles << " cycles in " << secs << " s\n";
}

}  // namespace metrale::testing::reliability
