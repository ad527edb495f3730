// The backend interface: everything an op or a loader needs from a device
// (docs/CONTRACT.md, backend interface). Backend implements the rules every device shares once
// (ledger, call sites, guard bands, typed-argument packing, metadata lookup through the OpCache); a
// concrete backend supplies the raw primitives. Methods are thread-safe unless they say otherwise.
// Errors are metrale::Error with the API name first.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/dense_gemm.h"
#include "metrale/guard_bands.h"
#include "metrale/handles.h"
#include "metrale/kernel_args.h"
#include "metrale/lazy_buffer.h"
#include "metrale/ledger.h"

namespace metrale {

class OpCache;
struct ResolvedKernel;
namespace trace {
class LaunchTracer;  // the launch trace (METRALE_TRACE), internal
}

// One kernel lookup as the audit saw it.
struct KernelLookup {
  std::string module, function;
  bool resolved = false;
  CallSite site;      // who asked
  std::string error;  // why it failed, when it did
};

// A loaded module as a backend lists it: the target it runs as and the kernels it provides.
struct ModuleListing {
  std::string name;
  std::string target;  // "host", "sm_90a", "compute_80 (JIT)"
  std::vector<std::string> kernels;
};

// Result of an event query; a failed query throws instead.
enum class EventStatus { kDone, kNotReady };

class Backend {
 public:
  Backend();
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  // Concrete backends sweep the ledger in their destructor (they own the raw free).
  virtual ~Backend();

  // ---- identity ----
  // Short backend name: "cpu", "cuda".
  virtual std::string_view name() const = 0;
  // The device's marketing or model name.
  virtual std::string device_name() const = 0;

  // ---- memory ----
  // Device memory of at least bytes (> 0), recorded on the ledger with the caller's file:line.
  DevicePtr alloc(std::size_t bytes, std::source_location loc = std::source_location::current());
  // Managed (host-migratable) memory; plain device memory where the backend has none.
  DevicePtr alloc_managed(std::size_t bytes,
                          std::source_location loc = std::source_location::current());
  // Frees an allocation of this backend; null is a no-op. The ledger entry is taken off before
  // the raw free, whatever it returns. Interior, foreign or already-freed pointers throw.
  void free(DevicePtr ptr);
  // Frees everything still on the ledger, warning once with the count, total and five largest
  // call sites; failures are logged and skipped. Returns the entries it found (size and call
  // site of each), so a caller can fail a leak check and name where each leak was made.
  std::vector<LedgerEntry> sweep_unreleased_entries();
  // As sweep_unreleased_entries, returning only how many entries it found.
  std::size_t sweep_unreleased() { return sweep_unreleased_entries().size(); }
  // Bytes currently on the ledger (pinned host memory included).
  std::size_t live_bytes() const { return ledger_->live_bytes(); }
  // Allocations currently on the ledger.
  std::size_t live_alloc_count() const { return ledger_->live_count(); }
  // AllocationLedger::report for this backend.
  std::string alloc_report(std::size_t top_n = 10, double min_mb = 0.0) const {
    return ledger_->report(top_n, min_mb);
  }
  // Usage counters of this backend's ledger, with its OpCache's scratch pool figures.
  AllocStats alloc_stats() const;
  // A read-only view of the ledger that outlives this backend.
  LedgerProbe ledger_probe() const { return LedgerProbe(ledger_); }

  // A lazy buffer (lazy_buffer.h) of at most budget_bytes, rounded down to the granularity;
  // nothing mapped yet. On the ledger from now on, under label's call site. Throws
  // Error(kInvalidArgument) for a budget below one granule, Error(kUnavailable) on a backend
  // without lazy buffers, the backend's Error when the reservation fails.
  LazyBuffer reserve_lazy(std::size_t budget_bytes, std::string label,
                          std::source_location loc = std::source_location::current());

  // ---- borrowed memory (Note [borrowed memory] in docs/NOTES.md) ----
  // Lends this backend [ptr, ptr + bytes) of memory another owner keeps (an array taken in by
  // DLPack): ops and copies may read and write it until unborrow, metrale never frees it, and
  // the ledger counts it apart from owned bytes (AllocStats::borrowed_*). `release` (may be
  // empty) runs once, when the memory is given back: by unborrow or by the sweep. Throws
  // Error(kInvalidArgument) "[borrow] ..." for a null pointer, bytes == 0, a range that wraps,
  // or one that overlaps a live allocation or borrow of this backend (naming its call site);
  // the concrete backend may refuse memory its kernels cannot address.
  void borrow(DevicePtr ptr, std::size_t bytes, std::function<void()> release = {},
              std::source_location loc = std::source_location::current());
  // Gives back the borrow that starts at ptr: waits until every stream's queued work is done
  // (it may still read or write the memory), takes it off the ledger, then runs its release.
  // Throws Error(kInvalidArgument) "[unborrow] ..." when ptr starts no live borrow.
  void unborrow(DevicePtr ptr);
  // As unborrow, without the wait: for memory whose owner reuses it only after the work queued
  // so far on the stream the borrow was used on (torch's caching allocator does for a tensor
  // used on its own stream). Safe inside a capture. Note [foreign streams].
  void unborrow_ordered(DevicePtr ptr);

  // Page-locked host memory of bytes (> 0) that the device can read directly; on the ledger.
  void* alloc_pinned(std::size_t bytes, std::source_location loc = std::source_location::current());
  // Frees memory from alloc_pinned; null is a no-op; anything else throws.
  void free_pinned(void* host);
  // The device address through which kernels read the pinned host pointer (interior allowed).
  virtual DevicePtr pinned_device_address(const void* host) const = 0;
  // Throws Error(kInvalidArgument) "[api] <what> ..." when [ptr, ptr + bytes) is not inside one
  // live allocation of this backend. Ops check every range a kernel will touch with it before
  // they launch anything. The default judges by the ledger: a range starting inside an
  // allocation must end inside it; a pointer into none is accepted (memory from elsewhere). The
  // CPU backend, which owns all memory its kernels can reach, refuses those too.
  virtual void check_range(std::string_view api, std::string_view what, DevicePtr ptr,
                           std::uint64_t bytes) const;
  // Throws Error(kInvalidArgument) "[api] <what> ..." unless [ptr, ptr + bytes) lies inside one
  // allocation on this backend's ledger: for buffers that must be the backend's own (a GEMM's
  // workspace), where check_range would let memory from elsewhere through.
  void check_owned_range(std::string_view api, std::string_view what, DevicePtr ptr,
                         std::uint64_t bytes) const;

  // ---- copies (bytes == 0 is a no-op; ranges must lie inside one allocation) ----
  // Blocking host-to-device copy.
  virtual void copy_h2d(DevicePtr dst, const void* src, std::size_t bytes) = 0;
  // Blocking device-to-host copy (waits for the backend's default stream first).
  virtual void copy_d2h(void* dst, DevicePtr src, std::size_t bytes) = 0;
  // Blocking device-to-device copy.
  virtual void copy_d2d(DevicePtr dst, DevicePtr src, std::size_t bytes) = 0;
  // Host-to-device copy queued on stream; when src is registered pinned memory the call waits
  // for the copy before returning (the DMA would otherwise read src after return).
  virtual void copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                              StreamHandle stream) = 0;
  // Device-to-device copy queued on stream.
  virtual void copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                              StreamHandle stream) = 0;
  // Blocking device-to-host copy ordered after all work queued on stream so far.
  virtual void copy_d2h_after(void* dst, DevicePtr src, std::size_t bytes, StreamHandle stream) = 0;
  // Pitched 2-D device-to-device copy of height rows of width_bytes, queued on stream.
  virtual void copy_2d_async(DevicePtr dst, std::size_t dst_pitch, DevicePtr src,
                             std::size_t src_pitch, std::size_t width_bytes, std::size_t height,
                             StreamHandle stream) = 0;
  // Blocking fill of bytes with value.
  virtual void memset(DevicePtr dst, std::uint8_t value, std::size_t bytes) = 0;
  // Fill of bytes with value, queued on stream.
  virtual void memset_async(DevicePtr dst, std::uint8_t value, std::size_t bytes,
                            StreamHandle stream) = 0;

  // ---- launches ----
  // Queues kernel on stream with params in cuLaunchKernel's layout (one pointer per argument).
  // Dynamic shared memory above 48 KiB raises the kernel's limit first. With debug_sync() on,
  // waits and names the kernel, grid, block and shared memory in any error.
  virtual void launch(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
                      StreamHandle stream, std::span<void*> params) = 0;
  // Checks args against the kernel's parameter list where the backend knows it, packs them into
  // 64-bit slots (kernel_args.h) and calls launch().
  void launch_typed(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
                    StreamHandle stream, std::span<const KernelArg> args);

  // ---- streams and events ----
  // The backend's own stream (non-blocking on CUDA); never destroyed by callers.
  virtual StreamHandle default_stream() = 0;
  // A new stream; destroy it with destroy_stream.
  virtual StreamHandle create_stream() = 0;
  // Destroys a stream made by create_stream (waits for its work first).
  virtual void destroy_stream(StreamHandle stream) = 0;
  // Waits until all work queued on stream is done. Inside a capture this invalidates it.
  virtual void synchronize(StreamHandle stream) = 0;
  // Waits until all work on every stream of this backend is done.
  virtual void synchronize_device() = 0;
  // ---- foreign streams (Note [foreign streams] in docs/NOTES.md) ----
  // Lets this backend queue work on a stream another library made and keeps (raw: the driver's
  // handle, as torch.cuda.Stream.cuda_stream gives it; 0 is the legacy default stream): the
  // handle to pass wherever a StreamHandle goes, until release_stream. metrale never destroys it
  // and never synchronizes it for the caller. Adoptions are counted per stream. raw must be a
  // live stream or 0 (the driver's cuStreamGetCtx, which tells whose a stream is, is undefined
  // for anything else). Throws Error(kInvalidArgument) "[adopt_stream] ..." for a stream of
  // another device or context, or one the driver refuses to describe. Default:
  // Error(kUnavailable), a backend with no streams to share.
  virtual StreamHandle adopt_stream(std::uint64_t raw);
  // Ends one adoption of a handle adopt_stream returned; the stream is left as it is. Unknown
  // handles are ignored. Never throws.
  virtual void release_stream(StreamHandle stream) noexcept;
  // Makes the backend's context current on the calling thread. Optional: default does nothing.
  virtual void bind_to_thread() {}
  // A new event; destroy it with destroy_event.
  virtual EventHandle create_event() = 0;
  // Destroys an event.
  virtual void destroy_event(EventHandle event) = 0;
  // Marks event done once the work queued on stream so far is done.
  virtual void record_event(EventHandle event, StreamHandle stream) = 0;
  // Makes later work on stream wait for event.
  virtual void wait_event(StreamHandle stream, EventHandle event) = 0;
  // Waits until event is done.
  virtual void event_synchronize(EventHandle event) = 0;
  // Done or not ready; a device error throws.
  virtual EventStatus event_query(EventHandle event) = 0;

  // ---- event timing and the launch trace ----
  // A new event that keeps the time it is reached (create_event's do not: on CUDA timing costs
  // the record a timestamp); destroy it with destroy_event.
  virtual EventHandle create_timing_event() = 0;
  // Milliseconds between the moments the streams reached two recorded timing events (negative
  // when end came first). Error "[event_elapsed_ms] ..." of kInvalidArgument for an event that
  // is not live on this backend, was made by create_event, or was never recorded; of kState
  // while one's work is still running (synchronize first).
  virtual double event_elapsed_ms(EventHandle start, EventHandle end) = 0;
  // Writes the launch trace file (METRALE_TRACE=path: every launch as Chrome trace JSON,
  // docs/TRACING.md) now, waiting for launches still running; the destructor does it too.
  // No-op when tracing is off; never throws (a failed write is a warning).
  void flush_trace() noexcept;

  // ---- graphs ----
  // Starts recording work queued on stream instead of running it (relaxed mode).
  virtual void begin_capture(StreamHandle stream) = 0;
  // Ends the capture and returns a replayable graph; the template is always destroyed. Throws
  // if the capture was invalidated (a sync or device-to-host copy inside it).
  virtual GraphHandle end_capture(StreamHandle stream) = 0;
  // Replays graph on stream.
  virtual void launch_graph(GraphHandle graph, StreamHandle stream) = 0;
  // Destroys a graph from end_capture.
  virtual void destroy_graph(GraphHandle graph) = 0;
  // Ends and discards an active capture on stream (for error paths); no-op when none. Never
  // throws.
  virtual void abort_capture(StreamHandle stream) noexcept = 0;
  // Whether stream is capturing; a failed driver query counts as capturing (so callers skip
  // syncs that would break a capture). A handle that is no stream of this backend throws.
  virtual bool is_capturing(StreamHandle stream) = 0;
  // Whether stream is capturing, for callers whose next step depends on the answer: a failed
  // driver query throws Error naming it under api. Default: is_capturing (whose queries do not
  // fail).
  virtual bool capturing(std::string_view api, StreamHandle stream);

  // ---- device queries ----
  // Total device memory in bytes.
  virtual std::size_t total_memory() const = 0;
  // Memory a new allocation can use (integrated GPUs: max of driver and host available).
  virtual std::size_t free_memory() const = 0;
  // The driver's own free figure.
  virtual std::size_t driver_free_memory() const = 0;
  // Streaming multiprocessors (CPU: hardware threads).
  virtual std::uint32_t sm_count() const = 0;

  // ---- kernels ----
  // Resolves module::function with its published metadata; the caller's file:line goes to the
  // lookup audit. Ops call op_cache().kernel(), which memoizes this.
  ResolvedKernel kernel(std::string_view module, std::string_view function,
                        std::source_location loc = std::source_location::current());
  // The first 4096 lookups of this backend, in order.
  std::vector<KernelLookup> lookup_audit() const;
  // The loaded modules and the kernels each provides, in load order.
  virtual std::vector<ModuleListing> modules() const = 0;
  // Whether a module of that name is loaded for this model.
  virtual bool has_module(std::string_view module) const = 0;
  // Whether a loaded module of that name lists the kernel (no lookup, nothing resolved).
  bool has_kernel(std::string_view module, std::string_view function) const;
  // The N tile the kernel publishes (<function>_n_tile); Error(kNotFound) naming the kernel when
  // it publishes none or 0.
  std::uint32_t kernel_n_tile(const ResolvedKernel& kernel) const;
  // Whether the kernel publishes a non-zero <function>_a_e4m3 (casts A to E4M3, no scale).
  static bool kernel_casts_a_to_e4m3(const ResolvedKernel& kernel);
  // "module::function" of a resolved handle, for messages. Optional: default prints the value.
  virtual std::string kernel_name(KernelHandle kernel) const;
  // This backend's OpCache; every backend owns exactly one.
  virtual OpCache& op_cache() = 0;
  // The same, read-only (usage figures).
  virtual const OpCache& op_cache() const = 0;

  // ---- dense GEMMs (dense_gemm.h: the library a backend has, cuBLASLt on CUDA) ----
  // Why this backend runs no dense GEMM of kind, or "" when it does. Default: it has no library.
  virtual std::string dense_gemm_unavailable(DenseKind kind) const;
  // The plan for shape: checks the shape, then asks the library (once per shape: the backend
  // memoizes it) for its algorithm and workspace. Throws Error(kInvalidArgument) for a bad
  // shape, Error(kUnavailable) with dense_gemm_unavailable's reason, Error(kNotFound) when the
  // library has no algorithm for the shape.
  DenseGemmPlan plan_dense_gemm(const DenseGemmShape& shape);
  // Queues the planned GEMM on stream: checks that every buffer of args is present, aligned and
  // inside one allocation, that C overlaps no input and that the workspace is this backend's own
  // memory of at least the plan's bytes, clear of the other buffers; then runs it. Throws
  // Error(kInvalidArgument) naming the buffer, Error(kState) once the OpCache was released.
  void run_dense_gemm(const DenseGemmPlan& plan, const DenseGemmArgs& args, StreamHandle stream);

  // ---- guard bands and debugging ----
  // Sets the guard-band policy for later allocations (initially from METRALE_REDZONE*).
  void set_guard_bands(const GuardBandConfig& config) { guards_.configure(config); }
  // Checks every guard band, logs each violation, refills it; returns the violated count.
  std::size_t scan_redzones();
  // Refills pads of allocations with index in [lo, hi) with 0xEE and the others with 0x00.
  void poison_redzones(std::size_t lo, std::size_t hi);
  // Whether launches synchronize and report errors at the kernel (METRALE_DEBUG_SYNC_KERNELS).
  bool debug_sync() const noexcept { return debug_sync_.load(std::memory_order_relaxed); }
  // Switches debug synchronization on or off.
  void set_debug_sync(bool on) noexcept { debug_sync_.store(on, std::memory_order_relaxed); }

 protected:
  // Raw allocation of user_bytes + pad_bytes of kind; throws Error(kOutOfMemory) on failure.
  // Pinned host memory is returned as its host address.
  virtual DevicePtr raw_alloc(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) = 0;
  // Raw free of a pointer from raw_alloc; must not consult the ledger (already updated).
  virtual void raw_free(DevicePtr ptr, MemoryKind kind) = 0;
  // Makes a range that borrow has checked reachable by this backend's copies and kernels, or
  // throws Error(kInvalidArgument) "[borrow] ..." for memory they cannot address. Default:
  // nothing to do (the ledger's record is enough).
  virtual void raw_borrow(DevicePtr ptr, std::size_t bytes);
  // Undoes raw_borrow once the borrow is off the ledger; never throws. Default: nothing.
  virtual void raw_unborrow(DevicePtr ptr) noexcept;
  // Fills bytes at ptr with value, ignoring allocation bounds (guard bands use it).
  virtual void raw_fill(DevicePtr ptr, std::uint8_t value, std::size_t bytes) = 0;
  // Reads bytes at ptr into host dst, ignoring allocation bounds (guard bands use it).
  virtual void raw_read(DevicePtr ptr, void* dst, std::size_t bytes) = 0;
  // Resolves a kernel and reads its published metadata (core/published.h); site is the caller.
  virtual ResolvedKernel resolve_kernel(std::string_view module, std::string_view function,
                                        const CallSite& site) = 0;
  // Throws kInvalidArgument when args do not fit kernel's parameters. Optional: the default
  // accepts anything (the CUDA driver does not say what a kernel takes).
  virtual void check_args(KernelHandle kernel, std::span<const KernelArg> args);
  // The library's plan for a checked shape (plan_dense_gemm has checked it and that the kind is
  // available). Default: throws Error(kUnavailable) with dense_gemm_unavailable's reason.
  virtual DenseGemmPlan plan_dense_gemm_checked(const DenseGemmShape& shape);
  // Queues a checked run (run_dense_gemm has checked every buffer). Default: throws as above.
  virtual void run_dense_gemm_checked(const DenseGemmPlan& plan, const DenseGemmArgs& args,
                                      StreamHandle stream);
  // The mapping unit of lazy buffers. Default: throws Error(kUnavailable) (no lazy buffers).
  virtual std::size_t lazy_granularity();
  // Reserves bytes (a multiple of granularity, lazy_granularity's answer) of address space
  // aligned to granularity, nothing mapped. Default: throws as lazy_granularity.
  virtual std::unique_ptr<LazyRegion> raw_reserve_lazy(std::size_t bytes, std::size_t granularity);
  // Whether any stream of this backend is capturing (a failed query counts as capturing, or
  // throws). Default: asks is_capturing of the default stream.
  virtual bool capture_in_progress();
  // Throws Error(kInvalidArgument) "[api] <what> ..." when [ptr, ptr + bytes) touches a lazy
  // buffer's reservation beyond what is mapped; check_range calls it first.
  void check_lazy_range(std::string_view api, std::string_view what, DevicePtr ptr,
                        std::uint64_t bytes) const;
  // Extra words for a pointer free() did not find on the ledger. Optional: default "".
  virtual std::string describe_unknown_pointer(DevicePtr ptr) const;
  // The ledger, for subclasses that sweep in their destructor.
  AllocationLedger& ledger() noexcept { return *ledger_; }
  // The launch tracer, or null when tracing is off (METRALE_TRACE unset or unwritable).
  trace::LaunchTracer* tracer() const noexcept { return tracer_.get(); }
  // Hands the tracer every traced launch whose time is still pending (CUDA: event pairs),
  // waiting for them; flush_trace calls it. Optional: default does nothing.
  virtual void drain_trace() {}

 private:
  friend class LazyBuffer;
  std::size_t lazy_grow(detail::LazyState& state, std::size_t bytes);
  void lazy_release(detail::LazyState& state);
  // Releases a lazy buffer the sweep found (its owner never did); logs failures.
  void sweep_lazy(const LedgerEntry& entry) noexcept;
  DevicePtr allocate(std::string_view api, std::size_t bytes, MemoryKind kind, CallSite site);
  void release(std::string_view api, DevicePtr ptr, bool pinned);
  // Undoes raw_borrow for a borrow already off the ledger, then runs and forgets its release
  // (none: nothing), logging what it throws.
  void give_back(DevicePtr ptr) noexcept;
  // unborrow and unborrow_ordered: checks ptr starts a live borrow, waits for every stream when
  // wait, then takes it off the ledger and gives it back.
  void give_back_borrow(std::string_view api, DevicePtr ptr, bool wait);

  std::shared_ptr<AllocationLedger> ledger_;
  GuardBands guards_;
  mutable std::mutex audit_mu_;
  std::vector<KernelLookup> audit_;
  std::atomic<bool> debug_sync_;
  std::unique_ptr<trace::LaunchTracer> tracer_;
  mutable std::mutex lazy_mu_;  // lazy_; never held across a backend call
  std::map<std::uint64_t, std::shared_ptr<detail::LazyState>> lazy_;  // by base address
  // borrow_release_, and each borrow's check and record (raw_borrow included); never held
  // while a release runs.
  std::mutex borrow_mu_;
  std::map<std::uint64_t, std::function<void()>> borrow_release_;  // by start address
};

}  // namespace metrale
