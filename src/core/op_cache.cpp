#include "metrale/op_cache.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <future>
#include <optional>
#include <vector>

#include "core/log.h"
#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/stream_pool.h"

namespace metrale {

namespace {

// A word-at-a-time hash of one name, folded into h. Short names (the usual case) take two
// overlapping 4-byte loads, so hashing "module" and "function" costs a few multiplies instead
// of one dependent multiply per byte as in FNV-1a. The length is mixed in, so ("ab", "c") and
// ("a", "bc") differ.
std::uint64_t mix_name(std::uint64_t h, std::string_view s) noexcept {
  constexpr std::uint64_t kMul = 0x9E3779B97F4A7C15ull;
  const char* p = s.data();
  std::size_t n = s.size();
  while (n > 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 32;
    p += 8;
    n -= 8;
  }
  std::uint64_t w = 0;
  if (n >= 4) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + n - 4, 4);
    w = (std::uint64_t{hi} << 32) | lo;
  } else if (n > 0) {
    w = (std::uint64_t{static_cast<unsigned char>(p[0])} << 16) |
        (std::uint64_t{static_cast<unsigned char>(p[n / 2])} << 8) |
        static_cast<unsigned char>(p[n - 1]);
  }
  h = (h ^ w ^ (std::uint64_t{s.size()} << 56)) * kMul;
  return h ^ (h >> 29);
}

// Equality of two names without a call to memcmp for the short ones (the hit path's case):
// overlapping word loads cover every byte of names up to 16 bytes.
bool same_name(std::string_view a, std::string_view b) noexcept {
  const std::size_t n = a.size();
  if (n != b.size()) return false;
  if (n > 16) return a == b;
  const char* p = a.data();
  const char* q = b.data();
  if (n >= 8) {
    std::uint64_t a0, a1, b0, b1;
    std::memcpy(&a0, p, 8);
    std::memcpy(&a1, p + n - 8, 8);
    std::memcpy(&b0, q, 8);
    std::memcpy(&b1, q + n - 8, 8);
    return ((a0 ^ b0) | (a1 ^ b1)) == 0;
  }
  if (n >= 4) {
    std::uint32_t a0, a1, b0, b1;
    std::memcpy(&a0, p, 4);
    std::memcpy(&a1, p + n - 4, 4);
    std::memcpy(&b0, q, 4);
    std::memcpy(&b1, q + n - 4, 4);
    return ((a0 ^ b0) | (a1 ^ b1)) == 0;
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (p[i] != q[i]) return false;
  }
  return true;
}

std::uint64_t key_hash(std::string_view module, std::string_view function) noexcept {
  return mix_name(mix_name(0x243F6A8885A308D3ull, module), function);
}

}  // namespace

std::size_t OpCache::KeyHash::operator()(const KeyView& k) const noexcept {
  return static_cast<std::size_t>(key_hash(k.module, k.function));
}

std::size_t OpCache::ShapeHash::operator()(
    const std::tuple<std::uint64_t, std::uint32_t, std::uint32_t, std::uint32_t>& t)
    const noexcept {
  std::uint64_t h = std::get<0>(t);
  for (std::uint64_t v : {std::uint64_t{std::get<1>(t)}, std::uint64_t{std::get<2>(t)},
                          std::uint64_t{std::get<3>(t)}}) {
    h = (h ^ v) * 1099511628211ull;
  }
  return static_cast<std::size_t>(h);
}

namespace {

Error released_error(std::string_view api, std::string_view what) {
  return Error(ErrorCode::kState, api,
               fmt::format("{}: the op cache was released with its model (teardown); nothing is "
                           "handed out after that",
                           what));
}

}  // namespace

const ResolvedKernel& OpCache::kernel(Backend& backend, std::string_view module,
                                      std::string_view function, std::source_location loc) {
  // One load of a flag that is written once: the hit path stays within its budget.
  if (released_.load(std::memory_order_acquire)) {
    throw released_error("kernel", fmt::format("{}::{}", module, function));
  }
  // The hit path: no lock, one probe sequence in the published snapshot, which hands back the
  // handle and its metadata together.
  const std::uint64_t h = key_hash(module, function);
  if (const Snapshot* snap = snapshot_.load(std::memory_order_acquire)) {
    for (std::uint64_t i = h & snap->mask;; i = (i + 1) & snap->mask) {
      const Snapshot::Slot& slot = snap->slots[i];
      if (slot.kernel == nullptr) break;
      if (slot.hash == h && same_name(slot.module, module) && same_name(slot.function, function)) {
        return *slot.kernel;
      }
    }
  }
  {
    std::shared_lock lock(kernels_mu_);
    const auto it = kernels_.find(KeyView{module, function});
    if (it != kernels_.end() && it->second.resolved.handle) return it->second.resolved;
  }
  // A miss: the first thread to get here resolves, with no lock held across the backend call
  // (it may reach the driver, which can be slow); threads arriving meanwhile wait on its result.
  // So each key reaches the backend once, yet hits on other keys never wait for a lookup.
  std::promise<const ResolvedKernel*> promise;
  std::shared_future<const ResolvedKernel*> in_flight;
  {
    std::unique_lock lock(kernels_mu_);
    // Checked again under the lock release() takes: a miss never reaches the backend after it.
    if (released_.load(std::memory_order_relaxed)) {
      throw released_error("kernel", fmt::format("{}::{}", module, function));
    }
    const auto [it, inserted] =
        kernels_.try_emplace(KernelKey{std::string(module), std::string(function)});
    if (!inserted) {
      if (it->second.resolved.handle) return it->second.resolved;
      in_flight = it->second.pending;
    } else {
      it->second.pending = promise.get_future().share();
    }
  }
  if (in_flight.valid()) return *in_flight.get();  // rethrows the resolver's error

  ResolvedKernel resolved;
  try {
    resolved = backend.kernel(module, function, loc);
  } catch (...) {
    {
      // Failures are not memoized: the next request asks the backend again.
      std::unique_lock lock(kernels_mu_);
      kernels_.erase(kernels_.find(KeyView{module, function}));
    }
    promise.set_exception(std::current_exception());
    throw;
  }
  const ResolvedKernel* stored = nullptr;
  {
    // Map nodes never move, so the reference handed out stays valid for the cache's life.
    std::unique_lock lock(kernels_mu_);
    KernelEntry& e = kernels_.find(KeyView{module, function})->second;
    e.resolved = resolved;
    e.pending = {};
    stored = &e.resolved;
    publish_snapshot_locked();
  }
  promise.set_value(stored);
  return *stored;
}

void OpCache::publish_snapshot_locked() {
  auto snap = std::make_unique<Snapshot>();
  std::size_t size = 8;
  while (size < 2 * kernels_.size()) size *= 2;
  snap->slots.resize(size);
  snap->mask = size - 1;
  for (const auto& [key, entry] : kernels_) {
    if (!entry.resolved.handle) continue;
    const std::uint64_t hash = key_hash(key.module, key.function);
    std::uint64_t i = hash & snap->mask;
    while (snap->slots[i].kernel != nullptr) i = (i + 1) & snap->mask;
    snap->slots[i] = Snapshot::Slot{hash, key.module, key.function, &entry.resolved};
  }
  // Kept before it is published: if keeping it throws, no reader can have seen it.
  const Snapshot* published = snap.get();
  snapshots_.push_back(std::move(snap));
  snapshot_.store(published, std::memory_order_release);
}

std::optional<DevicePtr> OpCache::held_scratch(std::string_view tag, std::size_t bytes) const {
  if (bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "scratch",
                fmt::format("tag '{}': a scratch request of 0 bytes", tag));
  }
  std::lock_guard lock(scratch_mu_);
  if (released_.load(std::memory_order_relaxed)) {
    throw released_error("scratch", fmt::format("tag '{}'", tag));
  }
  const auto it = scratch_.find(std::string(tag));
  if (it != scratch_.end() && it->second.bytes >= bytes) return it->second.ptr;
  return std::nullopt;
}

DevicePtr OpCache::scratch(Backend& backend, std::string_view tag, std::size_t bytes,
                           std::source_location loc) {
  if (const std::optional<DevicePtr> held = held_scratch(tag, bytes)) return *held;
  const std::string key(tag);
  // Allocate outside the lock (never hold a lock across a driver call), then install unless
  // another thread installed a buffer that fits meanwhile, or the cache was released meanwhile
  // (then nobody would ever free it but the sweep).
  const DevicePtr fresh = backend.alloc(bytes, loc);
  std::optional<DevicePtr> winner;
  bool closed = false;
  {
    std::lock_guard lock(scratch_mu_);
    if (released_.load(std::memory_order_relaxed)) {
      closed = true;
    } else if (Scratch& slot = scratch_[key]; slot.ptr && slot.bytes >= bytes) {
      winner = slot.ptr;
    } else {
      // The replaced buffer is retired, not freed: work queued before this call may still
      // read it. release() frees it once the model's work is done.
      if (slot.ptr) retired_.push_back(slot);
      slot = Scratch{fresh, bytes, false, StreamHandle{}};
    }
  }
  if (closed || winner) backend.free(fresh);
  if (closed) throw released_error("scratch", fmt::format("tag '{}'", tag));
  return winner ? *winner : fresh;
}

namespace {

constexpr const char* kPoolSwitch = "METRALE_SCRATCH_POOL_MB";

// The scratch pool's budget: METRALE_SCRATCH_POOL_MB when set (0: no pool; anything but a
// decimal count of MiB is named in a warning and ignored), else a quarter of the device's
// memory. It is address space reserved, not memory: only what scratch uses is mapped.
std::size_t pool_budget(const Backend& backend) {
  const std::size_t fallback = backend.total_memory() / 4;
  const char* text = std::getenv(kPoolSwitch);
  if (text == nullptr || *text == '\0') return fallback;
  const std::string_view v(text);
  std::size_t mb = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), mb);
  if (ec != std::errc{} || end != v.data() + v.size() || mb > (SIZE_MAX >> 20)) {
    log::warn("{}={} is not a whole number of MiB; ignored", kPoolSwitch, text);
    return fallback;
  }
  return mb << 20;
}

}  // namespace

StreamPool* OpCache::pool_for(Backend& backend) {
  std::lock_guard lock(pool_mu_);
  if (pool_tried_) return pool_.get();
  pool_tried_ = true;
  const std::size_t budget = pool_budget(backend);
  if (budget == 0) {
    pool_off_ = fmt::format("off ({}=0)", kPoolSwitch);
    return nullptr;
  }
  try {
    pool_ = std::make_shared<StreamPool>(backend, backend.reserve_lazy(budget, "op scratch pool"));
  } catch (const Error& e) {
    // No lazy buffers (kUnavailable) or a reservation the backend refused: plain scratch.
    pool_off_ = fmt::format("off ({})", e.what());
    if (e.code() != ErrorCode::kUnavailable) log::warn("op scratch pool: {}", e.what());
  }
  return pool_.get();
}

std::optional<DevicePtr> OpCache::held_scratch(std::string_view tag, std::size_t bytes,
                                               bool captured) {
  const std::optional<DevicePtr> held = held_scratch(tag, bytes);
  if (held && captured) {
    std::lock_guard lock(scratch_mu_);
    if (const auto it = scratch_.find(std::string(tag)); it != scratch_.end()) {
      it->second.captured = true;
    }
  }
  return held;
}

DevicePtr OpCache::scratch(Backend& backend, std::string_view tag, std::size_t bytes,
                           StreamHandle stream, std::source_location loc) {
  // A block handed out while its stream captures may be used by every replay of the graph: it
  // must never go back to the pool.
  const bool captured = backend.capturing("scratch", stream);
  if (const std::optional<DevicePtr> held = held_scratch(tag, bytes, captured)) return *held;
  const std::string key(tag);
  StreamPool* pool = pool_for(backend);
  DevicePtr fresh;
  if (pool != nullptr) {
    try {
      fresh = pool->allocate(bytes, stream);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kOutOfMemory && e.code() != ErrorCode::kCapture) throw;
      if (!pool_fallback_logged_.exchange(true)) {
        log::warn("op scratch pool: tag '{}' ({} bytes) allocated outside the pool: {}", tag, bytes,
                  e.what());
      }
    }
  }
  if (!fresh) return scratch(backend, tag, bytes, loc);
  std::optional<DevicePtr> winner;
  std::optional<Scratch> replaced;
  bool closed = false;
  {
    std::lock_guard lock(scratch_mu_);
    if (released_.load(std::memory_order_relaxed)) {
      closed = true;
    } else if (Scratch& slot = scratch_[key]; slot.ptr && slot.bytes >= bytes) {
      winner = slot.ptr;
    } else {
      if (slot.ptr) replaced = slot;
      slot = Scratch{fresh, bytes, true, stream, captured};
    }
  }
  if (closed || winner) pool->free(fresh, stream);
  if (closed) throw released_error("scratch", fmt::format("tag '{}'", tag));
  if (replaced) {
    // Queued work on the tag's stream may still read the old block: the pool reuses it only
    // after that work (stream order). A block that cannot go back yet is retired as before.
    bool back = false;
    if (replaced->pooled && !replaced->captured) {
      try {
        pool->free(replaced->ptr, replaced->stream);
        back = true;
      } catch (const Error& e) {
        log::warn("op scratch pool: tag '{}' keeps its old block until release: {}", tag, e.what());
      }
    }
    if (!back) {
      std::lock_guard lock(scratch_mu_);
      retired_.push_back(*replaced);
    }
  }
  return winner ? *winner : fresh;
}

void OpCache::detach_pool() noexcept {
  std::shared_ptr<StreamPool> pool;
  {
    std::lock_guard lock(pool_mu_);
    pool = pool_;
  }
  if (pool) pool->abandon();
}

PoolStats OpCache::pool_stats() const {
  std::shared_ptr<StreamPool> pool;
  {
    std::lock_guard lock(pool_mu_);
    pool = pool_;
  }
  return pool ? pool->stats() : PoolStats{};
}

std::string OpCache::pool_summary() const {
  std::shared_ptr<StreamPool> pool;
  std::string off;
  {
    std::lock_guard lock(pool_mu_);
    if (!pool_tried_) return "not used yet";
    pool = pool_;
    off = pool_off_;
  }
  if (!pool) return off;
  const PoolStats s = pool->stats();
  return fmt::format(
      "{:.1f} MiB in use, peak {:.1f}, {:.1f} reserved of a {:.0f} MiB budget, fragmentation "
      "{:.2f}; {} blocks, {} reused, {} growths",
      static_cast<double>(s.current_bytes) / 1048576.0,
      static_cast<double>(s.peak_bytes) / 1048576.0,
      static_cast<double>(s.reserved_bytes) / 1048576.0,
      static_cast<double>(pool->budget_bytes()) / 1048576.0, s.fragmentation(), s.allocations,
      s.reuses, s.grows);
}

bool OpCache::first_n(std::string_view key, std::uint32_t n) {
  std::lock_guard lock(gates_mu_);
  auto it = counters_.find(std::string(key));
  if (it == counters_.end()) it = counters_.emplace(std::string(key), 0).first;
  // Saturate instead of wrapping, so a gate that closed stays closed.
  if (it->second < UINT32_MAX) ++it->second;
  return it->second <= n;
}

bool OpCache::first_shape(std::string_view name, std::uint32_t m, std::uint32_t n,
                          std::uint32_t k) {
  std::lock_guard lock(gates_mu_);
  return seen_shapes_.emplace(fnv1a64(name), m, n, k).second;
}

std::size_t OpCache::kernel_count() const {
  std::shared_lock lock(kernels_mu_);
  std::size_t n = 0;
  for (const auto& [_, e] : kernels_) n += e.resolved.handle ? 1 : 0;
  return n;
}

std::size_t OpCache::scratch_count() const {
  std::lock_guard lock(scratch_mu_);
  return scratch_.size();
}

std::size_t OpCache::retired_scratch_count() const {
  std::lock_guard lock(scratch_mu_);
  return retired_.size();
}

std::string OpCache::summary() const {
  return fmt::format("OpCache{{kernels: {}, scratch: {}}}", kernel_count(), scratch_count());
}

void OpCache::release(Backend& backend) {
  std::unordered_map<std::string, Scratch> taken;
  {
    // Both locks, so a miss in kernel() and a request in scratch() that check the flag under
    // theirs either finish first or see it. This is the only place that holds both.
    std::unique_lock kernels_lock(kernels_mu_);
    std::lock_guard scratch_lock(scratch_mu_);
    released_.store(true, std::memory_order_release);
    taken.swap(scratch_);
    for (std::size_t i = 0; i < retired_.size(); ++i) {
      taken.emplace(fmt::format("retired #{}", i), retired_[i]);
    }
    retired_.clear();
  }
  std::optional<Error> first;
  std::string first_other;
  for (const auto& [tag, s] : taken) {
    if (s.pooled) continue;  // the pool's release below takes it with the rest
    try {
      backend.free(s.ptr);
    } catch (const Error& e) {
      log::warn("op scratch: freeing '{}' failed: {}", tag, e.what());
      if (!first && first_other.empty()) first = e;
    } catch (const std::exception& e) {
      log::warn("op scratch: freeing '{}' failed: {}", tag, e.what());
      if (!first && first_other.empty()) first_other = e.what();
    }
  }
  std::shared_ptr<StreamPool> pool;
  {
    // Taken out, so a second release finds no pool to release twice.
    std::lock_guard lock(pool_mu_);
    pool.swap(pool_);
    pool_tried_ = true;
    pool_off_ = "released";
  }
  if (pool) {
    // Synchronizes the device, then unmaps: work queued on pooled blocks is done first.
    try {
      pool->release();
    } catch (const Error& e) {
      log::warn("op scratch: releasing the pool failed: {}", e.what());
      if (!first && first_other.empty()) first = e;
    }
  }
  if (first) throw *first;
  if (!first_other.empty()) throw Error(ErrorCode::kInternal, "op scratch", first_other);
}

}  // namespace metrale
