// A stream-ordered pool on one lazy buffer (metrale/lazy_buffer.h): blocks carved from a base
// that never moves, so graphs captured on pool memory stay valid as the pool grows. A block
// freed on a stream is reused at once by later work on that stream (stream order makes it safe)
// and by other streams once an event recorded at the free has completed; the pool grows the
// lazy buffer only when no free block fits. See Note [stream-ordered pool] in docs/NOTES.md.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "metrale/handles.h"
#include "metrale/lazy_buffer.h"
#include "metrale/pool_stats.h"

namespace metrale {

class Backend;

class StreamPool {
 public:
  // Every block's alignment (the ops' 256-byte rule for workspaces).
  static constexpr std::size_t kAlign = 256;

  // A pool over buffer (empty, or grown already: its mapped bytes start free) on backend.
  // Throws Error(kInvalidArgument) for an empty or released buffer.
  StreamPool(Backend& backend, LazyBuffer buffer);
  StreamPool(const StreamPool&) = delete;
  StreamPool& operator=(const StreamPool&) = delete;
  // Releases the pool if release() was not called (quietly: a failure is logged).
  ~StreamPool();

  // A block of at least bytes (rounded up to kAlign) for work queued on stream: a free block of
  // this stream or a ready one, else the lazy buffer grows. When growth fails for lack of budget
  // or memory, waits for the frees other streams have pending and tries once more. Throws
  // Error(kInvalidArgument) for 0 bytes, Error(kOutOfMemory) naming the pool's figures when
  // nothing fits, Error(kCapture) when growth is needed while a stream captures, Error(kState)
  // once released.
  DevicePtr allocate(std::size_t bytes, StreamHandle stream);
  // Gives ptr (from allocate) back after the work queued on stream so far. Throws
  // Error(kInvalidArgument) for a pointer this pool did not hand out or handed back already,
  // Error(kCapture) while stream captures (the free's event would join the graph), Error(kState)
  // once released; the block stays allocated when it throws.
  void free(DevicePtr ptr, StreamHandle stream);

  // The figures now (pending frees whose event completed count as ready).
  PoolStats stats() const;
  // The lazy buffer's first address; stable for the pool's life.
  DevicePtr base() const noexcept;
  // The most the pool may map.
  std::size_t budget_bytes() const noexcept;
  // The lazy buffer's mapping unit: the pool grows by whole granules.
  std::size_t granularity() const noexcept;

  // Synchronizes the device, drops every block (handed out or not: the owner's queued work is
  // done) and releases the lazy buffer; throws its first failure. A second call throws
  // Error(kState) naming StreamPool::release.
  void release();
  // For a backend being destroyed, before its event table goes: the pool forgets its blocks and
  // pending events without another call into the backend (which destroys the events it still
  // holds; its ledger sweep releases the buffer). Later calls throw Error(kState).
  void abandon() noexcept;

 private:
  struct EventRef;
  struct Pending {
    std::size_t offset = 0, size = 0;
    StreamHandle stream;
    std::shared_ptr<EventRef> event;  // shared by the pieces of one freed block
  };
  // Moves pending frees whose event completed into ready_; with wait, waits for every one.
  void reap_locked(bool wait);
  // Adds [offset, offset + size) to ready_, merged with its neighbours.
  void add_ready_locked(std::size_t offset, std::size_t size);
  // A block of size from this stream's pending frees or ready_; npos when none fits.
  std::size_t take_free_locked(std::size_t size, StreamHandle stream);
  // A block of size at the top, growing the buffer.
  std::size_t take_top_locked(std::size_t size);
  PoolStats stats_locked() const;
  DevicePtr at(std::size_t offset) const noexcept;

  Backend& backend_;
  mutable std::mutex mu_;
  LazyBuffer buffer_;
  std::map<std::size_t, std::size_t> ready_;           // offset → size, merged runs
  std::vector<Pending> pending_;                       // freed, waiting on their event
  std::unordered_map<std::size_t, std::size_t> used_;  // offset → size, handed out
  std::size_t top_ = 0;                                // end of everything ever carved
  PoolStats counts_;                                   // the counters and the peak
  bool released_ = false;
};

}  // namespace metrale
