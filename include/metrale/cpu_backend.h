// The CPU backend: runs every op for real on the host. It is the default where there is no GPU
// and the reference every GPU result is checked against. Memory is host memory (256-byte
// aligned) checked on every access through the API; streams run their work in order at the
// time it is queued, so events are done once recorded; captures record work for replay.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/backend.h"
#include "metrale/host_module.h"

namespace metrale {

// Failures a test can inject into a CPU backend.
struct CpuFaults {
  // The Nth fallible call (1-based over every call CpuBackend::fault_call_names() lists, counted
  // from set_faults) fails before it does anything, with Error "[cpu] <call>: injected failure
  // (call #N)": kOutOfMemory for allocations, kDriver otherwise. 0: none.
  std::uint64_t fail_call_at = 0;
  // When set, fail_call_at counts only the calls whose name begins with this: "alloc" makes it
  // the Nth allocation of any kind (alloc, alloc_managed, alloc_pinned), "launch" the Nth
  // launch. The message then says "(alloc call #N, call #M of all)". set_faults refuses a value
  // that begins no call's name.
  std::string fail_call_of;
  // Device allocations above this many bytes (guard-band pad included) fail as out of memory.
  // This is not a call position, so fail_call_at cannot say it: it is a device too small for a
  // size, whichever call asks and however often, while managed and pinned memory still succeed
  // (what the managed-memory fallback is tested against).
  std::size_t max_device_alloc = SIZE_MAX;
  std::vector<std::string> deny_lookups;  // "module::function" lookups that fail as not found
  // Keep the name of every fallible call for fault_calls(). Off by default: the list grows with
  // every call, which only a fault-injection sweep wants.
  bool record_calls = false;
};

struct CpuBackendOptions {
  std::vector<HostModule> modules = builtin_host_modules();
  unsigned threads = 0;  // worker threads for launches; 0 = all hardware threads
};

// Another runtime's parallel loop: runs body(arg, begin, end) over disjoint ranges covering
// [0, n) on its threads and returns when all are done. body never throws.
struct CpuExecutor {
  void* ctx = nullptr;
  void (*parallel_for)(void* ctx, std::size_t n,
                       void (*body)(void* arg, std::size_t begin, std::size_t end),
                       void* arg) = nullptr;
};

// While one lives, every CPU backend's launches made by this thread run their blocks on
// `executor` instead of the backend's own pool: metrale.torch's C++ operator lends torch's
// intra-op threads so that the two pools do not spin against each other on the same cores
// (Note [one pool with torch]). Nests; restores the previous executor when it ends.
class ScopedCpuExecutor {
 public:
  explicit ScopedCpuExecutor(const CpuExecutor& executor) noexcept;
  ScopedCpuExecutor(const ScopedCpuExecutor&) = delete;
  ScopedCpuExecutor& operator=(const ScopedCpuExecutor&) = delete;
  ~ScopedCpuExecutor();

 private:
  const CpuExecutor* previous_;
};

// The instruction set the CPU's GEMM kernels use in this process: "avx512_bf16", "avx512",
// "avx2" or "portable", the processor's best lowered by METRALE_CPU_ISA (read once). Benchmarks
// print it with the roof they measured for it, so figures from different CPUs are not compared
// by accident.
std::string_view cpu_kernel_isa() noexcept;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(CpuBackendOptions options = {});
  // Sweeps the ledger (warning about anything left), then frees streams, events and graphs.
  ~CpuBackend() override;

  // Replaces the injected faults and restarts the call counts; Error(kInvalidArgument) for a
  // fail_call_of that names no call.
  void set_faults(CpuFaults faults);
  // Fallible calls made since set_faults (or construction): the positions fail_call_at can name.
  std::uint64_t fault_call_count() const;
  // The name of each of those calls in order ("alloc", "launch", ...); empty unless record_calls.
  std::vector<std::string> fault_calls() const;
  // Every name a fallible call can have. Releases (free, destroy_*) are not among them: on the
  // CPU they fail only for a handle that is not live, which is the caller's error, not a fault.
  static std::span<const std::string_view> fault_call_names() noexcept;
  // Names of the loaded modules, in load order.
  std::vector<std::string> module_names() const;
  // The loaded module of that name, or null.
  const HostModule* module(std::string_view name) const;
  // Streams, events and graphs currently alive (the default stream not counted).
  struct HandleCounts {
    std::size_t streams = 0, events = 0, graphs = 0;
  };
  HandleCounts handle_counts() const;

  std::string_view name() const override { return "cpu"; }
  std::string device_name() const override;
  DevicePtr pinned_device_address(const void* host) const override;
  // Kernels write host memory directly, so a range outside the allocations would corrupt the
  // process: every op's ranges are checked against the block table, as copies are.
  void check_range(std::string_view api, std::string_view what, DevicePtr ptr,
                   std::uint64_t bytes) const override;

  void copy_h2d(DevicePtr dst, const void* src, std::size_t bytes) override;
  void copy_d2h(void* dst, DevicePtr src, std::size_t bytes) override;
  void copy_d2d(DevicePtr dst, DevicePtr src, std::size_t bytes) override;
  void copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                      StreamHandle stream) override;
  void copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                      StreamHandle stream) override;
  void copy_d2h_after(void* dst, DevicePtr src, std::size_t bytes, StreamHandle stream) override;
  void copy_2d_async(DevicePtr dst, std::size_t dst_pitch, DevicePtr src, std::size_t src_pitch,
                     std::size_t width_bytes, std::size_t height, StreamHandle stream) override;
  void memset(DevicePtr dst, std::uint8_t value, std::size_t bytes) override;
  void memset_async(DevicePtr dst, std::uint8_t value, std::size_t bytes,
                    StreamHandle stream) override;

  void launch(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
              StreamHandle stream, std::span<void*> params) override;

  StreamHandle default_stream() override;
  StreamHandle create_stream() override;
  void destroy_stream(StreamHandle stream) override;
  void synchronize(StreamHandle stream) override;
  void synchronize_device() override;
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamHandle stream) override;
  void wait_event(StreamHandle stream, EventHandle event) override;
  void event_synchronize(EventHandle event) override;
  EventStatus event_query(EventHandle event) override;
  EventHandle create_timing_event() override;
  // The host clock's time between the moments the stream reached each record.
  double event_elapsed_ms(EventHandle start, EventHandle end) override;

  void begin_capture(StreamHandle stream) override;
  GraphHandle end_capture(StreamHandle stream) override;
  void launch_graph(GraphHandle graph, StreamHandle stream) override;
  void destroy_graph(GraphHandle graph) override;
  void abort_capture(StreamHandle stream) noexcept override;
  bool is_capturing(StreamHandle stream) override;

  std::size_t total_memory() const override;
  std::size_t free_memory() const override;
  std::size_t driver_free_memory() const override;
  std::uint32_t sm_count() const override;

  std::vector<ModuleListing> modules() const override;
  bool has_module(std::string_view module) const override;
  std::string kernel_name(KernelHandle kernel) const override;
  OpCache& op_cache() override;
  const OpCache& op_cache() const override;
  std::string dense_gemm_unavailable(DenseKind kind) const override;

 protected:
  DevicePtr raw_alloc(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) override;
  void raw_free(DevicePtr ptr, MemoryKind kind) override;
  // A borrowed range joins the block table, so copies and kernels reach it as an allocation.
  void raw_borrow(DevicePtr ptr, std::size_t bytes) override;
  void raw_unborrow(DevicePtr ptr) noexcept override;
  void raw_fill(DevicePtr ptr, std::uint8_t value, std::size_t bytes) override;
  void raw_read(DevicePtr ptr, void* dst, std::size_t bytes) override;
  ResolvedKernel resolve_kernel(std::string_view module, std::string_view function,
                                const CallSite& site) override;
  std::string describe_unknown_pointer(DevicePtr ptr) const override;
  std::size_t lazy_granularity() override;
  std::unique_ptr<LazyRegion> raw_reserve_lazy(std::size_t bytes, std::size_t granularity) override;
  bool capture_in_progress() override;
  void check_args(KernelHandle kernel, std::span<const KernelArg> args) override;
  DenseGemmPlan plan_dense_gemm_checked(const DenseGemmShape& shape) override;
  void run_dense_gemm_checked(const DenseGemmPlan& plan, const DenseGemmArgs& args,
                              StreamHandle stream) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace metrale
