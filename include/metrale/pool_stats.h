// The figures of a stream-ordered pool (metrale/stream_pool.h), part of a backend's usage
// (AllocStats::scratch_pool, metrale/ledger.h).
#pragma once

#include <cstddef>

namespace metrale {

// A pool's usage, in bytes (PyTorch's caching-allocator figures, in our terms).
struct PoolStats {
  std::size_t current_bytes = 0;       // in blocks handed out now
  std::size_t peak_bytes = 0;          // the most current_bytes has been
  std::size_t reserved_bytes = 0;      // mapped in the lazy buffer
  std::size_t free_bytes = 0;          // mapped, not handed out (ready or awaiting an event)
  std::size_t largest_free_bytes = 0;  // the largest run of ready free bytes
  std::size_t allocations = 0;         // blocks handed out so far
  std::size_t reuses = 0;              // of them, served from mapped memory (no growth)
  std::size_t grows = 0;               // times the lazy buffer was grown
  // 1 − largest_free / free: 0 when the free bytes are one run (or there are none), towards 1
  // as they splinter.
  double fragmentation() const noexcept {
    return free_bytes == 0
               ? 0.0
               : 1.0 - static_cast<double>(largest_free_bytes) / static_cast<double>(free_bytes);
  }
};

}  // namespace metrale
