// The CUDA backend: the Backend interface on the driver API, reached only through the host's
// DriverApi table. One per model; it holds the model's module registry and its own OpCache,
// and sweeps its ledger when destroyed.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cuda/dense_gemm.h"
#include "cuda/host.h"
#include "cuda/launch_timer.h"
#include "cuda/module_registry.h"
#include "metrale/backend.h"
#include "metrale/op_cache.h"

namespace metrale {

// A backend class lives in metrale:: beside CpuBackend; its internals live in metrale::cuda.
class CudaBackend final : public Backend {
 public:
  // A backend on host running the modules of registry (both shared with their other users).
  CudaBackend(std::shared_ptr<cuda::CudaHost> host, std::shared_ptr<cuda::ModuleRegistry> registry);
  // Sweeps the ledger, then destroys the streams, events and graphs this backend made.
  ~CudaBackend() override;

  // The start-up gate: resolves every entry each loaded module must provide (and each extra
  // "module::function" in also_required). Throws Error(kNotFound) listing all that did not
  // resolve, unless allow_missing, in which case it only warns. Run before any capture.
  void require_kernels(std::span<const std::string> also_required = {}, bool allow_missing = false);
  // The module registry this backend runs.
  const cuda::ModuleRegistry& registry() const noexcept { return *registry_; }
  // The host (device info, fault latch).
  cuda::CudaHost& host() const noexcept { return *host_; }
  // The driver stream of a handle (null: this backend's default stream), for libraries that
  // enqueue on it (NCCL); Error(kInvalidArgument) under api for a stream this backend did not make.
  CUstream driver_stream(std::string_view api, StreamHandle s) const { return stream_of(api, s); }

  std::string_view name() const override { return "cuda"; }
  std::string device_name() const override { return host_->info().name; }
  DevicePtr pinned_device_address(const void* host) const override;

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
  StreamHandle adopt_stream(std::uint64_t raw) override;
  void release_stream(StreamHandle stream) noexcept override;
  void synchronize(StreamHandle stream) override;
  void synchronize_device() override;
  void bind_to_thread() override { host_->bind(); }
  EventHandle create_event() override;
  void destroy_event(EventHandle event) override;
  void record_event(EventHandle event, StreamHandle stream) override;
  void wait_event(StreamHandle stream, EventHandle event) override;
  void event_synchronize(EventHandle event) override;
  EventStatus event_query(EventHandle event) override;
  EventHandle create_timing_event() override;
  // cuEventElapsedTime; the driver's NOT_READY is Error(kState).
  double event_elapsed_ms(EventHandle start, EventHandle end) override;

  void begin_capture(StreamHandle stream) override;
  GraphHandle end_capture(StreamHandle stream) override;
  void launch_graph(GraphHandle graph, StreamHandle stream) override;
  void destroy_graph(GraphHandle graph) override;
  void abort_capture(StreamHandle stream) noexcept override;
  bool is_capturing(StreamHandle stream) override;
  bool capturing(std::string_view api, StreamHandle stream) override {
    return capture_active(api, stream);
  }

  std::size_t total_memory() const override { return host_->info().total_memory; }
  std::size_t free_memory() const override;
  std::size_t driver_free_memory() const override;
  std::uint32_t sm_count() const override {
    return static_cast<std::uint32_t>(host_->info().sm_count);
  }

  std::vector<ModuleListing> modules() const override;
  bool has_module(std::string_view module) const override { return registry_->has(module); }
  std::string kernel_name(KernelHandle kernel) const override;
  OpCache& op_cache() override { return cache_; }
  const OpCache& op_cache() const override { return cache_; }
  // cuBLASLt's reason when it is not loaded; for e4m3-block128 also a device of any compute
  // capability but 9.0 or a library older than 12.9. "" when this backend runs the kind.
  std::string dense_gemm_unavailable(DenseKind kind) const override {
    return dense_.unavailable(kind);
  }

 protected:
  DevicePtr raw_alloc(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) override;
  void raw_free(DevicePtr ptr, MemoryKind kind) override;
  void raw_fill(DevicePtr ptr, std::uint8_t value, std::size_t bytes) override;
  void raw_read(DevicePtr ptr, void* dst, std::size_t bytes) override;
  ResolvedKernel resolve_kernel(std::string_view module, std::string_view function,
                                const CallSite& site) override;
  std::size_t lazy_granularity() override;
  std::unique_ptr<LazyRegion> raw_reserve_lazy(std::size_t bytes, std::size_t granularity) override;
  // Asks every stream this backend knows; a failed query throws (any_capturing).
  bool capture_in_progress() override;
  DenseGemmPlan plan_dense_gemm_checked(const DenseGemmShape& shape) override;
  void run_dense_gemm_checked(const DenseGemmPlan& plan, const DenseGemmArgs& args,
                              StreamHandle stream) override;
  // Waits for the traced launches' event pairs and hands them to the tracer.
  void drain_trace() override;

 private:
  struct KernelInfo {
    std::string name;          // "module::function"
    int max_dynamic_smem = 0;  // the limit already raised with cuFuncSetAttribute
  };

  // The driver stream of a handle (null handle = this backend's default stream).
  CUstream stream_of(std::string_view api, StreamHandle s) const;
  // Throws when the device is faulted, then makes the context current on this thread.
  void enter(std::string_view api) const;
  // Throws the Error for status, after probing for a sticky fault when the call was a launch
  // or memset (the status alone may not say the context is gone).
  [[noreturn]] void fail(std::string_view api, std::string_view call, CUresult status,
                         bool probe = false) const;
  void check(std::string_view api, std::string_view call, CUresult status) const {
    if (status != CUDA_SUCCESS) fail(api, call, status);
  }
  // Whether stream is capturing; unlike is_capturing, a failed query throws Error naming
  // cuStreamIsCapturing under api, for callers whose next step depends on the answer.
  bool capture_active(std::string_view api, StreamHandle stream);
  // Whether any stream this backend knows is capturing; a failed query throws (capture_active).
  bool any_capturing(std::string_view api);
  // Whether [host, host + bytes) lies inside pinned memory of this backend.
  bool is_pinned(const void* host, std::size_t bytes) const;
  // Reads a published global of a module (nullopt when absent); throws when unreadable.
  std::optional<std::vector<std::byte>> read_global(CUmodule module, const std::string& symbol,
                                                    const std::string& kernel);

  std::shared_ptr<cuda::CudaHost> host_;
  std::shared_ptr<cuda::ModuleRegistry> registry_;
  OpCache cache_;
  // After host_: its cuBLASLt handle is destroyed while the host (context, table) still lives.
  cuda::DenseGemms dense_{*host_};
  // Event pairs of traced launches (used only while METRALE_TRACE is on).
  cuda::LaunchTimer timer_{host_->api()};

  mutable std::mutex mu_;  // the sets below; never held across a driver call
  std::set<std::uint64_t> streams_;
  std::map<std::uint64_t, std::size_t> foreign_;  // adopted streams → adoptions (never ours)
  std::set<std::uint64_t> events_;
  std::set<std::uint64_t> timing_events_;  // the events of events_ made with timing
  std::set<std::uint64_t> graphs_;
  std::map<std::uint64_t, KernelInfo> kernels_;
  std::map<std::uint64_t, std::size_t> pinned_;  // host address → bytes
};

}  // namespace metrale
