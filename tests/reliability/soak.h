// Shared pieces of the soaks: how many cycles (METRALE_SOAK_CYCLES, default 10,000; the GPU
// soak's METRALE_GPU_SOAK_CYCLES, default 200) and the process's heap in use, which must not
// creep up from cycle to cycle.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <iostream>
#include <string_view>

#include "support/log_capture.h"

namespace metrale::testing::reliability {

// The positive number in environment variable var, else fallback.
inline std::size_t soak_cycles(const char* var = "METRALE_SOAK_CYCLES",
                               std::size_t fallback = 10000) {
  const char* v = std::getenv(var);
  if (v == nullptr || *v == '\0') return fallback;
  const long long n = std::atoll(v);
  return n > 0 ? static_cast<std::size_t>(n) : fallback;
}

// Bytes the allocator has handed out and not taken back; 0 where it cannot say (a sanitizer's
// allocator replaces malloc's counters, and its leak check covers the same ground at exit).
inline std::size_t heap_in_use() {
#if defined(__SANITIZE_ADDRESS__)
  return 0;
#else
  return mallinfo2().uordblks;
#endif
}

// Heap growth allowed between an early cycle and the last: allocator slack and caches that
// reach their size once (log sinks, thread-local buffers), far below what a leak of one buffer
// per cycle would add over thousands of cycles.
inline constexpr std::size_t kHeapSlack = std::size_t{1} << 20;

// The soak loop: cycle(i) for i = 1 .. soak_cycles() (it asserts what each cycle must leave),
// stopping at the first fatal failure; then the heap no larger than after cycle 100 (or the
// last, if fewer), no warning logged, and one "soak <what>: ..." line with the time per cycle.
template <class Cycle>
void run_soak(std::string_view what, Cycle&& cycle) {
  const std::size_t cycles = soak_cycles();
  const std::size_t warm = std::min<std::size_t>(cycles, 100);
  std::size_t heap_warm = 0;
  LogCapture logs(log::Level::kWarn);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 1; i <= cycles; ++i) {
    cycle(i);
    if (::testing::Test::HasFatalFailure()) return;
    if (i == warm) heap_warm = heap_in_use();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LE(heap_in_use(), heap_warm + kHeapSlack) << "the heap grew after cycle " << warm;
  EXPECT_TRUE(logs.lines().empty()) << logs.lines().front().text;
  std::cout << fmt::format("soak {}: {} cycles in {:.1f} s ({:.2f} ms per cycle)\n", what, cycles,
                           secs, 1e3 * secs / static_cast<double>(cycles));
}

}  // namespace metrale::testing::reliability
