#include "metrale/stream_pool.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "core/log.h"
#include "metrale/backend.h"
#include "metrale/error.h"

namespace metrale {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

std::size_t round_up(std::size_t v, std::size_t to) {
  return (v + to - 1) / to * to;
}

}  // namespace

// One recorded event, destroyed when the last piece of its freed block is reaped.
struct StreamPool::EventRef {
  Backend& backend;
  EventHandle event;
  bool armed = true;  // false once the backend is going: it destroys its own events then
  EventRef(Backend& b, EventHandle e) : backend(b), event(e) {}
  EventRef(const EventRef&) = delete;
  EventRef& operator=(const EventRef&) = delete;
  ~EventRef() {
    if (!armed) return;
    try {
      backend.destroy_event(event);
    } catch (const std::exception& e) {
      log::warn("stream pool: destroying an event failed: {}", e.what());
    }
  }
};

StreamPool::StreamPool(Backend& backend, LazyBuffer buffer)
    : backend_(backend), buffer_(std::move(buffer)) {
  if (!buffer_.live()) {
    throw Error(ErrorCode::kInvalidArgument, "StreamPool", "the lazy buffer is empty or released");
  }
  top_ = buffer_.mapped_bytes();
  if (top_ > 0) ready_.emplace(0, top_);
}

StreamPool::~StreamPool() {
  if (released_) return;
  try {
    release();
  } catch (const std::exception& e) {
    log::warn("stream pool '{}': release at destruction failed: {}", buffer_.label(), e.what());
  }
}

DevicePtr StreamPool::at(std::size_t offset) const noexcept {
  return DevicePtr(buffer_.base().address() + offset);
}

DevicePtr StreamPool::base() const noexcept {
  return buffer_.base();
}

std::size_t StreamPool::budget_bytes() const noexcept {
  return buffer_.budget_bytes();
}

std::size_t StreamPool::granularity() const noexcept {
  return buffer_.granularity();
}

void StreamPool::add_ready_locked(std::size_t offset, std::size_t size) {
  auto next = ready_.lower_bound(offset);
  if (next != ready_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      ready_.erase(prev);
    }
  }
  if (next != ready_.end() && offset + size == next->first) {
    size += next->second;
    ready_.erase(next);
  }
  ready_.emplace(offset, size);
}

void StreamPool::reap_locked(bool wait) {
  std::vector<Pending> keep;
  for (Pending& p : pending_) {
    // An event's query or wait that fails leaves its block pending: never reused unsafely.
    bool done = false;
    try {
      if (wait) backend_.event_synchronize(p.event->event);
      done = backend_.event_query(p.event->event) == EventStatus::kDone;
    } catch (const std::exception& e) {
      log::warn("stream pool '{}': an event of a pending free failed: {}", buffer_.label(),
                e.what());
    }
    if (done) {
      add_ready_locked(p.offset, p.size);
    } else {
      keep.push_back(std::move(p));
    }
  }
  pending_.swap(keep);
}

std::size_t StreamPool::take_free_locked(std::size_t size, StreamHandle stream) {
  // This stream's own frees first: work queued after them on the stream runs after the work
  // that used them, so they are safe now. The smallest that fits.
  std::size_t best = kNone;
  for (std::size_t i = 0; i < pending_.size(); ++i) {
    if (pending_[i].stream == stream && pending_[i].size >= size &&
        (best == kNone || pending_[i].size < pending_[best].size)) {
      best = i;
    }
  }
  if (best != kNone) {
    Pending& p = pending_[best];
    const std::size_t offset = p.offset;
    if (p.size == size) {
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(best));
    } else {
      p.offset += size;  // the rest stays pending on the same event
      p.size -= size;
    }
    return offset;
  }
  auto fit = ready_.end();
  for (auto it = ready_.begin(); it != ready_.end(); ++it) {
    if (it->second >= size && (fit == ready_.end() || it->second < fit->second)) fit = it;
  }
  if (fit == ready_.end()) return kNone;
  const auto [offset, run] = *fit;
  ready_.erase(fit);
  if (run > size) ready_.emplace(offset + size, run - size);
  return offset;
}

std::size_t StreamPool::take_top_locked(std::size_t size) {
  // A ready run that ends at the top is extended rather than left behind.
  std::size_t start = top_;
  if (!ready_.empty()) {
    const auto last = std::prev(ready_.end());
    if (last->first + last->second == top_) start = last->first;
  }
  const std::size_t end = start + size;
  if (end > buffer_.mapped_bytes()) {
    buffer_.grow(end);  // throws, leaving the buffer as it was
    ++counts_.grows;
  }
  if (start < top_) ready_.erase(start);
  top_ = std::max(top_, end);
  // grow maps whole granules: what lies past end is free.
  if (buffer_.mapped_bytes() > top_) {
    add_ready_locked(top_, buffer_.mapped_bytes() - top_);
    top_ = buffer_.mapped_bytes();
  }
  return start;
}

DevicePtr StreamPool::allocate(std::size_t bytes, StreamHandle stream) {
  constexpr std::string_view kApi = "StreamPool::allocate";
  if (bytes == 0) throw Error(ErrorCode::kInvalidArgument, kApi, "a request of 0 bytes");
  if (bytes > budget_bytes()) {
    throw Error(ErrorCode::kOutOfMemory, kApi,
                fmt::format("{} bytes exceed the pool '{}''s budget of {} bytes", bytes,
                            buffer_.label(), budget_bytes()));
  }
  const std::size_t size = round_up(bytes, kAlign);
  std::lock_guard lock(mu_);
  if (released_) throw Error(ErrorCode::kState, kApi, "the pool is released");
  // Reaping queries the frees' events, which a capture in the driver's default mode refuses
  // (PyTorch's caching allocator skips its event processing during capture for the same
  // reason); a capturing stream takes only blocks already free. Note [foreign streams].
  if (!backend_.capturing(kApi, stream)) reap_locked(false);
  std::size_t offset = take_free_locked(size, stream);
  const bool reused = offset != kNone;
  if (!reused) {
    try {
      offset = take_top_locked(size);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kOutOfMemory || pending_.empty()) throw;
      // Out of budget or memory: the frees other streams have pending may make room.
      reap_locked(true);
      offset = take_free_locked(size, stream);
      if (offset == kNone) {
        const PoolStats s = stats_locked();
        throw Error(ErrorCode::kOutOfMemory, kApi,
                    fmt::format("{} bytes do not fit the pool '{}': {} in use, {} reserved of a "
                                "{}-byte budget, largest free run {} ({})",
                                bytes, buffer_.label(), s.current_bytes, s.reserved_bytes,
                                budget_bytes(), s.largest_free_bytes, e.message()));
      }
    }
  }
  used_.emplace(offset, size);
  counts_.current_bytes += size;
  counts_.peak_bytes = std::max(counts_.peak_bytes, counts_.current_bytes);
  ++counts_.allocations;
  if (reused) ++counts_.reuses;
  return at(offset);
}

void StreamPool::free(DevicePtr ptr, StreamHandle stream) {
  constexpr std::string_view kApi = "StreamPool::free";
  std::lock_guard lock(mu_);
  if (released_) throw Error(ErrorCode::kState, kApi, "the pool is released");
  const std::uint64_t base = buffer_.base().address();
  const auto it = ptr.address() >= base ? used_.find(static_cast<std::size_t>(ptr.address() - base))
                                        : used_.end();
  if (it == used_.end()) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("0x{:x} is not a block of the pool '{}' (never handed out, or "
                            "handed back already)",
                            ptr.address(), buffer_.label()));
  }
  if (backend_.is_capturing(stream)) {
    throw Error(ErrorCode::kCapture, kApi,
                fmt::format("0x{:x}: the stream is capturing, and a free's event would join "
                            "the graph; free the block after end_capture",
                            ptr.address()));
  }
  const EventHandle e = backend_.create_event();
  auto ref = std::make_shared<EventRef>(backend_, e);
  backend_.record_event(e, stream);  // throws: ref destroys the event, the block stays used
  pending_.push_back({it->first, it->second, stream, std::move(ref)});
  counts_.current_bytes -= it->second;
  used_.erase(it);
}

PoolStats StreamPool::stats_locked() const {
  PoolStats s = counts_;
  s.reserved_bytes = buffer_.live() ? buffer_.mapped_bytes() : 0;
  for (const auto& [offset, size] : ready_) {
    s.free_bytes += size;
    s.largest_free_bytes = std::max(s.largest_free_bytes, size);
  }
  for (const Pending& p : pending_) s.free_bytes += p.size;
  return s;
}

PoolStats StreamPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_locked();
}

void StreamPool::abandon() noexcept {
  std::lock_guard lock(mu_);
  released_ = true;
  for (Pending& p : pending_) p.event->armed = false;
  pending_.clear();
  ready_.clear();
  used_.clear();
  counts_.current_bytes = 0;
}

void StreamPool::release() {
  std::lock_guard lock(mu_);
  if (released_) {
    throw Error(ErrorCode::kState, "StreamPool::release",
                fmt::format("the pool '{}' is released already", buffer_.label()));
  }
  released_ = true;
  // Destroying an event that queued work has yet to reach is allowed (the driver frees it once
  // reached); the buffer's release then synchronizes the device before it unmaps anything.
  pending_.clear();  // destroys the events
  ready_.clear();
  used_.clear();
  counts_.current_bytes = 0;
  buffer_.release();  // synchronizes the device first
}

}  // namespace metrale
