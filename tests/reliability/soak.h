// Shared pieces of the soaks: how many cycles (METRALE_SOAK_CYCLES, default 10,000; the GPU
// soak's METRALE_GPU_SOAK_CYCLES, default 200) and the process's heap in use, which must not
// creep up from cycle to cycle.
#pragma once

#include <malloc.h>

#include <cstddef>
#include <cstdlib>

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

}  // namespace metrale::testing::reliability
