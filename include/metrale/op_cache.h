// OpCache: one backend's memo of kernel handles with their published metadata, its grow-only
// scratch buffers, the managed-memory fallback latch, and the once / first-N gates of
// diagnostics. Per backend, never process-wide, so a later model cannot reach handles or
// scratch of a model that is gone. Thread-safe; a throwing operation leaves it usable.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <source_location>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "metrale/handles.h"
#include "metrale/model_scope.h"
#include "metrale/pool_stats.h"

namespace metrale {

class Backend;
class StreamPool;

// 64-bit FNV-1a of bytes; the key hash of first_shape.
constexpr std::uint64_t fnv1a64(std::string_view bytes) noexcept {
  std::uint64_t h = 14695981039346656037ull;
  for (char c : bytes) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// What a kernel publishes about itself (<function>_<field> symbols, read once at lookup; the
// list is src/kernels/published.def). 0 where it publishes nothing.
struct KernelMeta {
  std::uint32_t n_tile = 0;         // grid x: output columns (or elements) per block
  std::uint32_t m_tile = 0;         // grid y: rows of M per block (0: one block row covers all M)
  std::uint32_t smem_bytes = 0;     // dynamic shared memory per block
  std::uint32_t split_k = 0;        // K per split-K unit (0: no split-K)
  std::uint32_t block_threads = 0;  // threads per block the kernel is written for
  std::uint32_t max_m = 0;          // the largest M the kernel is the best route for (0: unsaid)
  std::uint32_t min_m = 0;          // the smallest M from which it is the best route (0: never)
  std::uint32_t layout = 0;         // weights it reads: 1 the decode layout, 0 the source layout
  std::uint32_t blocks_per_sm = 0;  // blocks one SM holds at once, as compiled (0: unsaid)
  std::uint32_t verified = 0;       // YYYYMMDD of the device run that verified it (0: none)
  std::uint32_t verified_on = 0;    // that run's device (kernels/verified_devices.h); 0: none
  bool a_e4m3 = false;              // casts its BF16 A operand to E4M3 with no scale
  bool out_f32 = false;             // writes C as FP32 when asked (GemmFlags kGemmOutF32)
  bool absent = false;              // a placeholder: this target has no such kernel
  bool panels = false;              // also reads the CPU panel layout (GemmFlags kGemmPanels)
  bool persistent = false;          // loops over its tiles: launched as one wave (published.def)
  bool int4 = false;                // reads INT4 weights (GemmFlags kGemmInt4)
};

// A resolved kernel: its handle and what it published, returned together by one lookup.
struct ResolvedKernel {
  KernelHandle handle;
  KernelMeta meta;
  // Launches take the handle.
  operator KernelHandle() const noexcept { return handle; }  // NOLINT(google-explicit-constructor)
  // Whether a kernel was resolved.
  explicit operator bool() const noexcept { return static_cast<bool>(handle); }
  // The same kernel (its metadata follows from the handle).
  friend bool operator==(const ResolvedKernel& a, const ResolvedKernel& b) noexcept {
    return a.handle == b.handle;
  }
};

class OpCache final : public ModelResource {
 public:
  OpCache() = default;
  OpCache(const OpCache&) = delete;
  OpCache& operator=(const OpCache&) = delete;

  // The handle of module::function with its published metadata: backend.kernel() once per key
  // (concurrent first requests wait for that one lookup), one lock-free probe after that. The
  // reference stays valid for the cache's life. Lookup failures are not memoized: every waiter
  // gets the error, and a later call asks the backend again. After release() it throws
  // Error(kState) and asks the backend nothing.
  const ResolvedKernel& kernel(Backend& backend, std::string_view module, std::string_view function,
                               std::source_location loc = std::source_location::current());

  // A scratch buffer of at least bytes, memoized under tag. Grow-only: a request that fits
  // returns the stored pointer; a larger one allocates anew and retires the old buffer without
  // freeing it (work already queued may still read it): it stays on the ledger, under the call
  // site that asked for it, until release() frees it with the rest. bytes == 0 is an error. After
  // release() it throws Error(kState) and allocates nothing: a released cache hands out no pointer,
  // stale or new.
  DevicePtr scratch(Backend& backend, std::string_view tag, std::size_t bytes,
                    std::source_location loc = std::source_location::current());

  // A scratch buffer of at least bytes for work queued on stream, memoized under tag (a tag
  // belongs to one stream: ops::gemm_scratch_tag names it). Where the backend has lazy buffers
  // it comes from this cache's stream-ordered pool (metrale/stream_pool.h): a larger request
  // hands the old block back to the pool in stream order instead of retiring it, so growth
  // costs no driver allocation once the pool holds the memory. Otherwise (no lazy buffers,
  // METRALE_SCRATCH_POOL_MB=0, the pool full, or a growth refused during a capture) it is the
  // scratch() above, and the first such fallback is logged once.
  DevicePtr scratch(Backend& backend, std::string_view tag, std::size_t bytes, StreamHandle stream,
                    std::source_location loc = std::source_location::current());
  // For a backend's destructor, before its streams and events go: the scratch pool stops calling
  // into the backend (StreamPool::abandon). The cache is not usable for pooled scratch after.
  void detach_pool() noexcept;
  // The scratch pool's figures (all zero before its first request, or without a pool).
  PoolStats pool_stats() const;
  // One line on the scratch pool: its budget and use, or why scratch does not come from one.
  std::string pool_summary() const;

  // Whether a loader latched the managed-memory fallback on this backend.
  bool alloc_fell_back() const noexcept { return fell_back_.load(std::memory_order_relaxed); }
  // Latches the managed-memory fallback for the rest of this backend's life.
  void note_alloc_fallback() noexcept { fell_back_.store(true, std::memory_order_relaxed); }

  // True for the first n times this cache reaches key (counted per key).
  bool first_n(std::string_view key, std::uint32_t n);
  // True the first time this cache reaches key; shares first_shape's set as (key, 0, 0, 0).
  bool once(std::string_view key) { return first_shape(key, 0, 0, 0); }
  // True the first time this cache sees (name, m, n, k); de-duplicates route and shape lines.
  bool first_shape(std::string_view name, std::uint32_t m, std::uint32_t n, std::uint32_t k);

  // Number of memoized kernel handles.
  std::size_t kernel_count() const;
  // Number of scratch tags holding a buffer.
  std::size_t scratch_count() const;
  // Number of buffers retired by a larger request and not yet freed (by release()).
  std::size_t retired_scratch_count() const;
  // "OpCache{kernels: K, scratch: S}", for debug logs.
  std::string summary() const;

  // ModelResource: "op scratch".
  std::string label() const override { return "op scratch"; }
  // Closes the cache (later kernel() and scratch() calls throw kState), takes the scratch map
  // out (so a second release does nothing and no lookup finds a freed pointer), frees every
  // pointer even after a failure, rethrows the first error. Pointers handed out before stay
  // the caller's problem: ModelScope::teardown releases only once no ModelScope::Use is alive.
  void release(Backend& backend) override;
  // Whether release() has run.
  bool released() const noexcept { return released_.load(std::memory_order_acquire); }

 private:
  struct KernelKey {
    std::string module, function;
  };
  struct KeyView {
    std::string_view module, function;
  };
  struct KeyHash {
    using is_transparent = void;
    std::size_t operator()(const KeyView& k) const noexcept;
    std::size_t operator()(const KernelKey& k) const noexcept {
      return (*this)(KeyView{k.module, k.function});
    }
  };
  struct KeyEq {
    using is_transparent = void;
    static KeyView view(const KernelKey& k) noexcept { return {k.module, k.function}; }
    static KeyView view(const KeyView& k) noexcept { return k; }
    template <class A, class B>
    bool operator()(const A& a, const B& b) const noexcept {
      return view(a).module == view(b).module && view(a).function == view(b).function;
    }
  };
  struct Scratch {
    DevicePtr ptr;
    std::size_t bytes = 0;
    bool pooled = false;  // a block of pool_, handed back to it rather than freed
    StreamHandle stream;  // for a pooled block: the stream it serves
    // Handed out while its stream captured: a graph may hold it, so a larger request retires it
    // instead of handing it back to the pool (Note [foreign streams]).
    bool captured = false;
  };
  // The tag's buffer when it holds at least bytes, else nullopt; Error for 0 bytes or a released
  // cache.
  std::optional<DevicePtr> held_scratch(std::string_view tag, std::size_t bytes) const;
  // held_scratch, marking the tag's block captured when it is returned and `captured`.
  std::optional<DevicePtr> held_scratch(std::string_view tag, std::size_t bytes, bool captured);
  // The pool, made on the first stream-ordered request (null when the backend has none or the
  // switch turns it off; pool_off_ then says why).
  StreamPool* pool_for(Backend& backend);
  struct ShapeHash {
    std::size_t operator()(const std::tuple<std::uint64_t, std::uint32_t, std::uint32_t,
                                            std::uint32_t>& t) const noexcept;
  };

  // An immutable open-addressing copy of the resolved handles, read without any lock: a shared
  // lock alone costs ~30 ns here (two atomic read-modify-writes on a shared line), three times
  // the hit budget. Writers rebuild and publish a new one after each insert.
  struct Snapshot {
    struct Slot {
      std::uint64_t hash = 0;
      std::string_view module, function;       // point into kernels_' keys, which never move
      const ResolvedKernel* kernel = nullptr;  // into kernels_' entries; null: empty slot
    };
    std::vector<Slot> slots;  // power-of-two size, at most half full
    std::uint64_t mask = 0;
  };
  // Publishes a snapshot of every resolved entry; kernels_mu_ must be held exclusively.
  void publish_snapshot_locked();

  struct KernelEntry {
    ResolvedKernel resolved;  // handle null while the first lookup is in flight
    std::shared_future<const ResolvedKernel*> pending;  // that lookup, for threads that wait
  };
  mutable std::shared_mutex kernels_mu_;
  std::unordered_map<KernelKey, KernelEntry, KeyHash, KeyEq> kernels_;
  std::atomic<const Snapshot*> snapshot_{nullptr};
  // Every snapshot ever published, freed only with the cache: a reader may still be walking an
  // old one, and with a few dozen kernels per model the copies cost kilobytes.
  std::vector<std::unique_ptr<const Snapshot>> snapshots_;

  mutable std::mutex scratch_mu_;
  std::unordered_map<std::string, Scratch> scratch_;
  std::vector<Scratch> retired_;  // replaced by a larger buffer; freed by release()
  mutable std::mutex pool_mu_;    // pool_ and pool_off_; never held across a pool call
  std::shared_ptr<StreamPool> pool_;
  bool pool_tried_ = false;
  std::string pool_off_;  // why there is no pool
  std::atomic<bool> pool_fallback_logged_{false};

  std::mutex gates_mu_;
  std::unordered_set<std::tuple<std::uint64_t, std::uint32_t, std::uint32_t, std::uint32_t>,
                     ShapeHash>
      seen_shapes_;
  std::unordered_map<std::string, std::uint32_t> counters_;

  std::atomic<bool> fell_back_{false};
  // Set by release() while holding kernels_mu_ and scratch_mu_, so a miss or a scratch request
  // that checks it under its lock either finishes before the release or sees it.
  std::atomic<bool> released_{false};
};

}  // namespace metrale
