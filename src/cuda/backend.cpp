#include "cuda/backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include "core/log.h"
#include "core/published.h"
#include "metrale/error.h"

namespace metrale {
namespace {

constexpr std::uint32_t kDefaultSharedLimit = 48 * 1024;  // above this a kernel must opt in

CUdeviceptr dptr(DevicePtr p) {
  return static_cast<CUdeviceptr>(p.address());
}
std::string dim_str(Dim3 d) {
  return fmt::format("({}, {}, {})", d.x, d.y, d.z);
}

// The calling thread's capture interaction mode set to relaxed for this scope (the driver's
// push-pop use of cuThreadExchangeStreamCaptureMode), so an allocation made while some stream
// captures is allowed. A failed swap throws, naming the call; a failed restore is a warning (the
// thread stays relaxed, which only lets later unsafe calls through, as it let this one).
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode(const cuda::DriverApi& api, std::string_view call) : api_(api) {
    if (const CUresult s = api_.cuThreadExchangeStreamCaptureMode(&mode_); s != CUDA_SUCCESS) {
      cuda::throw_status(&api_, call, "cuThreadExchangeStreamCaptureMode", s);
    }
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
  ~RelaxedCaptureMode() {
    if (const CUresult s = api_.cuThreadExchangeStreamCaptureMode(&mode_); s != CUDA_SUCCESS) {
      log::warn(
          "cuda: cuThreadExchangeStreamCaptureMode failed restoring the thread's capture "
          "mode: {}",
          cuda::describe_status(&api_, s));
    }
  }

 private:
  const cuda::DriverApi& api_;
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
};

std::size_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  std::size_t kb = 0;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

}  // namespace

using cuda::CudaHost;
using cuda::describe_status;
using cuda::DriverApi;
using cuda::is_context_gone;
using cuda::is_sticky_fault;
using cuda::ModuleRegistry;
using cuda::throw_status;

namespace {
// p, or Error(kInvalidArgument) when null: checked before any member uses it.
template <class T>
std::shared_ptr<T> required(std::shared_ptr<T> p) {
  if (!p) throw Error(ErrorCode::kInvalidArgument, "CudaBackend", "host and registry are required");
  return p;
}
}  // namespace

CudaBackend::CudaBackend(std::shared_ptr<CudaHost> host, std::shared_ptr<ModuleRegistry> registry)
    : host_(required(std::move(host))), registry_(required(std::move(registry))) {}

CudaBackend::~CudaBackend() {
  // The scratch pool's pending events are in events_, destroyed below: it must not reach them
  // again when the cache goes with the members.
  cache_.detach_pool();
  // A model may be dropped on a thread that never called into it.
  host_->bind_quietly();
  try {
    sweep_unreleased();
  } catch (const std::exception& e) {
    log::error("cuda backend: sweep at destruction failed: {}", e.what());
  }
  if (tracer() != nullptr) {
    try {
      drain_trace();
    } catch (const std::exception& e) {
      log::warn("cuda backend: collecting traced launches at destruction failed: {}", e.what());
    }
  }
  timer_.release();
  const DriverApi& api = host_->api();
  // Whatever the model left: graphs, events, streams. Statuses are only logged here.
  auto warn = [&](const char* call, CUresult s) {
    if (s != CUDA_SUCCESS && !is_context_gone(s)) {
      log::warn("cuda backend: {} at destruction failed: {}", call, describe_status(&api, s));
    }
  };
  for (std::uint64_t g : graphs_)
    warn("cuGraphExecDestroy", api.cuGraphExecDestroy(reinterpret_cast<CUgraphExec>(g)));
  for (std::uint64_t e : events_)
    warn("cuEventDestroy", api.cuEventDestroy(reinterpret_cast<CUevent>(e)));
  for (std::uint64_t s : streams_)
    warn("cuStreamDestroy", api.cuStreamDestroy(reinterpret_cast<CUstream>(s)));
}

void CudaBackend::enter(std::string_view api) const {
  host_->check_not_faulted(api);
  host_->bind();
}

void CudaBackend::fail(std::string_view api, std::string_view call, CUresult status,
                       bool probe) const {
  if (probe || is_sticky_fault(status)) host_->probe_fault();
  throw_status(&host_->api(), api, call, status);
}

CUstream CudaBackend::stream_of(std::string_view api, StreamHandle s) const {
  if (!s || reinterpret_cast<CUstream>(s.value()) == host_->stream()) return host_->stream();
  std::lock_guard lock(mu_);
  if (!streams_.contains(s.value()) && !foreign_.contains(s.value())) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("stream 0x{:x} is not a live stream of this cuda backend", s.value()));
  }
  return reinterpret_cast<CUstream>(s.value());
}

bool CudaBackend::is_pinned(const void* host, std::size_t bytes) const {
  const auto a = reinterpret_cast<std::uintptr_t>(host);
  std::lock_guard lock(mu_);
  auto it = pinned_.upper_bound(a);
  if (it == pinned_.begin()) return false;
  --it;
  return a + bytes <= it->first + it->second;
}

// ---- memory ----

DevicePtr CudaBackend::raw_alloc(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) {
  enter("alloc");
  const DriverApi& api = host_->api();
  // Legal while a stream captures: Note [allocations during capture].
  const RelaxedCaptureMode relaxed(api, kind == MemoryKind::kPinnedHost ? "alloc_pinned" : "alloc");
  const std::size_t bytes = user_bytes + pad_bytes;
  if (kind == MemoryKind::kPinnedHost) {
    void* p = nullptr;
    check("alloc_pinned", "cuMemHostAlloc",
          api.cuMemHostAlloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
    std::lock_guard lock(mu_);
    pinned_[reinterpret_cast<std::uintptr_t>(p)] = user_bytes;
    return DevicePtr{reinterpret_cast<std::uintptr_t>(p)};
  }
  CUdeviceptr p = 0;
  if (kind == MemoryKind::kManaged && host_->info().managed_memory) {
    check("alloc_managed", "cuMemAllocManaged",
          api.cuMemAllocManaged(&p, bytes, CU_MEM_ATTACH_GLOBAL));
  } else {
    check(kind == MemoryKind::kManaged ? "alloc_managed" : "alloc", "cuMemAlloc",
          api.cuMemAlloc(&p, bytes));
  }
  return DevicePtr{p};
}

void CudaBackend::raw_free(DevicePtr ptr, MemoryKind kind) {
  const DriverApi& api = host_->api();
  // Freeing must work on a faulted device too (teardown), so no enter() here; but without the
  // context current on this thread the driver would answer INVALID_CONTEXT, which reads as
  // "context already gone" below and would leak the memory silently.
  host_->bind_quietly();
  CUresult s;
  if (kind == MemoryKind::kPinnedHost) {
    {
      std::lock_guard lock(mu_);
      pinned_.erase(ptr.address());
    }
    s = api.cuMemFreeHost(reinterpret_cast<void*>(ptr.address()));
  } else {
    s = api.cuMemFree(dptr(ptr));
  }
  // A context that is already gone took the memory with it: not an error at teardown.
  if (s != CUDA_SUCCESS && !is_context_gone(s)) {
    throw_status(&api, "free", kind == MemoryKind::kPinnedHost ? "cuMemFreeHost" : "cuMemFree", s);
  }
}

void CudaBackend::raw_fill(DevicePtr ptr, std::uint8_t value, std::size_t bytes) {
  const DriverApi& api = host_->api();
  host_->bind_quietly();
  check("guard_bands", "cuMemsetD8Async",
        api.cuMemsetD8Async(dptr(ptr), value, bytes, host_->stream()));
  check("guard_bands", "cuStreamSynchronize", api.cuStreamSynchronize(host_->stream()));
}

void CudaBackend::raw_read(DevicePtr ptr, void* dst, std::size_t bytes) {
  const DriverApi& api = host_->api();
  host_->bind_quietly();
  check("scan_redzones", "cuMemcpyDtoHAsync",
        api.cuMemcpyDtoHAsync(dst, dptr(ptr), bytes, host_->stream()));
  check("scan_redzones", "cuStreamSynchronize", api.cuStreamSynchronize(host_->stream()));
}

DevicePtr CudaBackend::pinned_device_address(const void* host) const {
  if (!is_pinned(host, 1)) {  // the byte at host must be pinned (one past the end is not)
    throw Error(ErrorCode::kInvalidArgument, "pinned_device_address",
                fmt::format("0x{:x} is not inside pinned memory of this cuda backend",
                            reinterpret_cast<std::uintptr_t>(host)));
  }
  enter("pinned_device_address");
  CUdeviceptr d = 0;
  check("pinned_device_address", "cuMemHostGetDevicePointer",
        host_->api().cuMemHostGetDevicePointer(&d, const_cast<void*>(host), 0));
  return DevicePtr{d};
}

std::size_t CudaBackend::driver_free_memory() const {
  enter("driver_free_memory");
  std::size_t free = 0, total = 0;
  check("driver_free_memory", "cuMemGetInfo", host_->api().cuMemGetInfo(&free, &total));
  return free;
}

std::size_t CudaBackend::free_memory() const {
  // An integrated GPU shares host memory; the driver's figure can understate what is usable.
  const std::size_t driver = driver_free_memory();
  return host_->info().integrated ? std::max(driver, host_available_bytes()) : driver;
}

// ---- copies ----

void CudaBackend::copy_h2d(DevicePtr dst, const void* src, std::size_t bytes) {
  copy_h2d_async(dst, src, bytes, default_stream());
  synchronize(default_stream());
}

void CudaBackend::copy_d2h(void* dst, DevicePtr src, std::size_t bytes) {
  copy_d2h_after(dst, src, bytes, default_stream());
}

void CudaBackend::copy_d2d(DevicePtr dst, DevicePtr src, std::size_t bytes) {
  copy_d2d_async(dst, src, bytes, default_stream());
  synchronize(default_stream());
}

void CudaBackend::copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                                 StreamHandle stream) {
  if (bytes == 0) return;
  if (!dst || src == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "copy_h2d", "destination or source is null");
  }
  enter("copy_h2d");
  const CUstream s = stream_of("copy_h2d", stream);
  // From pinned memory the DMA reads after we return; wait so the caller may reuse src.
  // Inside a capture the copy is only recorded, and a wait would invalidate the capture. A failed
  // capture query is an error, asked before the copy is queued. See Note [pinned copy waits] in
  // docs/NOTES.md.
  const bool wait = is_pinned(src, bytes) && !capture_active("copy_h2d", stream);
  check("copy_h2d", "cuMemcpyHtoDAsync", host_->api().cuMemcpyHtoDAsync(dptr(dst), src, bytes, s));
  if (wait) check("copy_h2d", "cuStreamSynchronize", host_->api().cuStreamSynchronize(s));
}

void CudaBackend::copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                                 StreamHandle stream) {
  if (bytes == 0) return;
  if (!dst || !src) throw Error(ErrorCode::kInvalidArgument, "copy_d2d", "a pointer is null");
  enter("copy_d2d");
  check("copy_d2d", "cuMemcpyDtoDAsync",
        host_->api().cuMemcpyDtoDAsync(dptr(dst), dptr(src), bytes, stream_of("copy_d2d", stream)));
}

void CudaBackend::copy_d2h_after(void* dst, DevicePtr src, std::size_t bytes, StreamHandle stream) {
  if (bytes == 0) return;
  if (dst == nullptr || !src) {
    throw Error(ErrorCode::kInvalidArgument, "copy_d2h", "destination or source is null");
  }
  enter("copy_d2h");
  const CUstream s = stream_of("copy_d2h", stream);
  check("copy_d2h", "cuMemcpyDtoHAsync", host_->api().cuMemcpyDtoHAsync(dst, dptr(src), bytes, s));
  check("copy_d2h", "cuStreamSynchronize", host_->api().cuStreamSynchronize(s));
}

void CudaBackend::copy_2d_async(DevicePtr dst, std::size_t dst_pitch, DevicePtr src,
                                std::size_t src_pitch, std::size_t width_bytes, std::size_t height,
                                StreamHandle stream) {
  if (width_bytes == 0 || height == 0) return;
  if (width_bytes > dst_pitch || width_bytes > src_pitch) {
    throw Error(ErrorCode::kInvalidArgument, "copy_2d",
                fmt::format("width {} bytes exceeds a pitch (dst {}, src {})", width_bytes,
                            dst_pitch, src_pitch));
  }
  enter("copy_2d");
  CUDA_MEMCPY2D c{};
  c.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  c.srcDevice = dptr(src);
  c.srcPitch = src_pitch;
  c.dstMemoryType = CU_MEMORYTYPE_DEVICE;
  c.dstDevice = dptr(dst);
  c.dstPitch = dst_pitch;
  c.WidthInBytes = width_bytes;
  c.Height = height;
  check("copy_2d", "cuMemcpy2DAsync",
        host_->api().cuMemcpy2DAsync(&c, stream_of("copy_2d", stream)));
}

void CudaBackend::memset(DevicePtr dst, std::uint8_t value, std::size_t bytes) {
  memset_async(dst, value, bytes, default_stream());
  synchronize(default_stream());
}

void CudaBackend::memset_async(DevicePtr dst, std::uint8_t value, std::size_t bytes,
                               StreamHandle stream) {
  if (bytes == 0) return;
  if (!dst) throw Error(ErrorCode::kInvalidArgument, "memset", "destination is null");
  enter("memset");
  const CUresult s =
      host_->api().cuMemsetD8Async(dptr(dst), value, bytes, stream_of("memset", stream));
  if (s != CUDA_SUCCESS) fail("memset", "cuMemsetD8Async", s, /*probe=*/true);
}

// ---- launches ----

void CudaBackend::launch(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
                         StreamHandle stream, std::span<void*> params) {
  enter("launch");
  KernelInfo info;
  {
    std::lock_guard lock(mu_);
    const auto it = kernels_.find(kernel.value());
    if (it == kernels_.end()) {
      throw Error(
          ErrorCode::kInvalidArgument, "launch",
          fmt::format("kernel 0x{:x} was not resolved by this cuda backend", kernel.value()));
    }
    info = it->second;
  }
  const DriverApi& api = host_->api();
  const auto fn = reinterpret_cast<CUfunction>(kernel.value());
  const std::string where = fmt::format("{} grid {} block {} shared {} B", info.name, dim_str(grid),
                                        dim_str(block), shared_bytes);
  // Compared in 64 bits: a size above INT_MAX must not wrap negative and skip both checks.
  if (shared_bytes > kDefaultSharedLimit &&
      std::int64_t{shared_bytes} > std::int64_t{info.max_dynamic_smem}) {
    if (std::int64_t{shared_bytes} > std::int64_t{host_->info().max_shared_optin}) {
      throw Error(ErrorCode::kInvalidArgument, "launch",
                  fmt::format("{}: the device allows at most {} B of shared memory per block",
                              where, host_->info().max_shared_optin));
    }
    check("launch", fmt::format("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES) for {}", where),
          api.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 static_cast<int>(shared_bytes)));
    std::lock_guard lock(mu_);
    kernels_[kernel.value()].max_dynamic_smem = static_cast<int>(shared_bytes);
  }
  const CUstream s = stream_of("launch", stream);
  // Tracing (METRALE_TRACE) only: a timing event on each side of the launch.
  trace::LaunchTracer* const tr = tracer();
  const CUevent start = tr != nullptr ? timer_.begin(s, *tr) : nullptr;
  const CUresult r = api.cuLaunchKernel(fn, grid.x, grid.y, grid.z, block.x, block.y, block.z,
                                        shared_bytes, s, params.data(), nullptr);
  if (r != CUDA_SUCCESS) {
    if (start != nullptr) timer_.abandon(start);
    fail("launch", fmt::format("cuLaunchKernel {}", where), r, true);
  }
  if (start != nullptr) {
    timer_.end(start, s,
               {info.name, grid, block, shared_bytes, reinterpret_cast<std::uintptr_t>(s), 0, 0},
               *tr);
  }
  if (debug_sync() && !is_capturing(stream)) {
    const CUresult w = api.cuStreamSynchronize(s);
    if (w != CUDA_SUCCESS) {
      fail("launch", fmt::format("{} (debug sync after the launch)", where), w, true);
    }
  }
}

void CudaBackend::drain_trace() {
  if (tracer() == nullptr) return;
  host_->bind_quietly();  // any thread, a faulted device too: what cannot be timed is counted
  timer_.drain(*tracer());
}

// ---- dense GEMMs (cuBLASLt, cuda/dense_gemm.h) ----

DenseGemmPlan CudaBackend::plan_dense_gemm_checked(const DenseGemmShape& shape) {
  enter("plan_dense_gemm");
  return dense_.plan(shape);
}

void CudaBackend::run_dense_gemm_checked(const DenseGemmPlan& plan, const DenseGemmArgs& args,
                                         StreamHandle stream) {
  enter("run_dense_gemm");
  const CUstream s = stream_of("run_dense_gemm", stream);
  // Traced like a launch (METRALE_TRACE): the library's kernels between one event pair, as one
  // row named for the kind and shape, with no grid of ours to show.
  trace::LaunchTracer* const tr = tracer();
  const CUevent start = tr != nullptr ? timer_.begin(s, *tr) : nullptr;
  try {
    dense_.run(plan, args, s);
  } catch (...) {
    if (start != nullptr) timer_.abandon(start);
    throw;
  }
  if (start != nullptr) {
    const DenseGemmShape& sh = plan.shape;
    timer_.end(start, s,
               {fmt::format("cublasLt::{} M={} N={} K={}", to_string(sh.kind), sh.m, sh.n, sh.k),
                Dim3{}, Dim3{}, 0, reinterpret_cast<std::uintptr_t>(s), 0, 0},
               *tr);
  }
  if (debug_sync() && !is_capturing(stream)) {
    const CUresult w = host_->api().cuStreamSynchronize(s);
    if (w != CUDA_SUCCESS) fail("run_dense_gemm", "cuStreamSynchronize (debug sync)", w, true);
  }
}

// ---- streams and events ----

StreamHandle CudaBackend::default_stream() {
  return StreamHandle{reinterpret_cast<std::uintptr_t>(host_->stream())};
}

StreamHandle CudaBackend::create_stream() {
  enter("create_stream");
  CUstream s = nullptr;
  check("create_stream", "cuStreamCreate", host_->api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  std::lock_guard lock(mu_);
  streams_.insert(reinterpret_cast<std::uintptr_t>(s));
  return StreamHandle{reinterpret_cast<std::uintptr_t>(s)};
}

void CudaBackend::destroy_stream(StreamHandle stream) {
  const CUstream s = stream_of("destroy_stream", stream);
  if (s == host_->stream()) {
    throw Error(ErrorCode::kInvalidArgument, "destroy_stream",
                "the backend's default stream belongs to the process host");
  }
  {
    std::lock_guard lock(mu_);
    if (streams_.erase(stream.value()) == 0) {
      throw Error(ErrorCode::kInvalidArgument, "destroy_stream",
                  fmt::format("stream 0x{:x} was adopted (adopt_stream): its owner destroys it",
                              stream.value()));
    }
  }
  host_->bind_quietly();  // no enter(): destroying must work on a faulted device too
  check("destroy_stream", "cuStreamDestroy", host_->api().cuStreamDestroy(s));
}

StreamHandle CudaBackend::adopt_stream(std::uint64_t raw) {
  enter("adopt_stream");
  // 0 is the NULL stream, which here (a null StreamHandle) would mean the backend's own; in a
  // program built without per-thread default streams, as torch is, it is the legacy stream,
  // which CU_STREAM_LEGACY names without that ambiguity.
  constexpr std::uint64_t legacy = 0x1;      // CU_STREAM_LEGACY's value (cuda.h)
  constexpr std::uint64_t per_thread = 0x2;  // CU_STREAM_PER_THREAD's
  const std::uint64_t value = raw == 0 ? legacy : raw;
  if (value != legacy && value != per_thread) {
    // The special handles run in the current context, which enter() made ours.
    CUcontext ctx = nullptr;
    const CUresult s = host_->api().cuStreamGetCtx(reinterpret_cast<CUstream>(value), &ctx);
    if (s != CUDA_SUCCESS) {
      throw Error(ErrorCode::kInvalidArgument, "adopt_stream",
                  fmt::format("stream 0x{:x}: cuStreamGetCtx failed: {}", raw,
                              describe_status(&host_->api(), s)));
    }
    if (ctx != host_->context()) {
      throw Error(ErrorCode::kInvalidArgument, "adopt_stream",
                  fmt::format("stream 0x{:x} belongs to another context than device {}'s primary "
                              "context, where this backend runs",
                              raw, host_->info().ordinal));
    }
  }
  std::lock_guard lock(mu_);
  ++foreign_[value];
  return StreamHandle{value};
}

void CudaBackend::release_stream(StreamHandle stream) noexcept {
  std::lock_guard lock(mu_);
  const auto it = foreign_.find(stream.value());
  if (it != foreign_.end() && --it->second == 0) foreign_.erase(it);
}

void CudaBackend::synchronize(StreamHandle stream) {
  enter("synchronize");
  check("synchronize", "cuStreamSynchronize",
        host_->api().cuStreamSynchronize(stream_of("synchronize", stream)));
}

void CudaBackend::synchronize_device() {
  enter("synchronize_device");
  check("synchronize_device", "cuCtxSynchronize", host_->api().cuCtxSynchronize());
}

EventHandle CudaBackend::create_event() {
  enter("create_event");
  CUevent e = nullptr;
  check("create_event", "cuEventCreate", host_->api().cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
  std::lock_guard lock(mu_);
  events_.insert(reinterpret_cast<std::uintptr_t>(e));
  return EventHandle{reinterpret_cast<std::uintptr_t>(e)};
}

namespace {
CUevent event_of(std::mutex& mu, const std::set<std::uint64_t>& events, std::string_view api,
                 EventHandle e) {
  std::lock_guard lock(mu);
  if (!events.contains(e.value())) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("event 0x{:x} is not a live event of this cuda backend", e.value()));
  }
  return reinterpret_cast<CUevent>(e.value());
}
}  // namespace

EventHandle CudaBackend::create_timing_event() {
  enter("create_timing_event");
  CUevent e = nullptr;
  check("create_timing_event", "cuEventCreate", host_->api().cuEventCreate(&e, CU_EVENT_DEFAULT));
  std::lock_guard lock(mu_);
  events_.insert(reinterpret_cast<std::uintptr_t>(e));
  timing_events_.insert(reinterpret_cast<std::uintptr_t>(e));
  return EventHandle{reinterpret_cast<std::uintptr_t>(e)};
}

double CudaBackend::event_elapsed_ms(EventHandle start, EventHandle end) {
  constexpr std::string_view kApi = "event_elapsed_ms";
  const auto timing = [&](EventHandle e, std::string_view which) {
    const CUevent ev = event_of(mu_, events_, kApi, e);
    std::lock_guard lock(mu_);
    if (!timing_events_.contains(e.value())) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("{} event 0x{:x} was made by create_event, which keeps no time "
                              "(CU_EVENT_DISABLE_TIMING): make it with create_timing_event",
                              which, e.value()));
    }
    return ev;
  };
  const CUevent e0 = timing(start, "start");
  const CUevent e1 = timing(end, "end");
  enter(kApi);
  float ms = 0;
  const CUresult r = host_->api().cuEventElapsedTime(&ms, e0, e1);
  if (r == CUDA_ERROR_NOT_READY) {
    throw Error(ErrorCode::kState, kApi,
                fmt::format("cuEventElapsedTime: the work before event 0x{:x} or 0x{:x} is still "
                            "running: synchronize on the end event first",
                            start.value(), end.value()));
  }
  if (r == CUDA_ERROR_INVALID_HANDLE) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("cuEventElapsedTime: event 0x{:x} or 0x{:x} has not been recorded "
                            "(CUDA_ERROR_INVALID_HANDLE)",
                            start.value(), end.value()));
  }
  check(kApi, "cuEventElapsedTime", r);
  return ms;
}

void CudaBackend::destroy_event(EventHandle event) {
  const CUevent e = event_of(mu_, events_, "destroy_event", event);
  {
    std::lock_guard lock(mu_);
    events_.erase(event.value());
    timing_events_.erase(event.value());
  }
  host_->bind_quietly();
  check("destroy_event", "cuEventDestroy", host_->api().cuEventDestroy(e));
}

void CudaBackend::record_event(EventHandle event, StreamHandle stream) {
  const CUevent e = event_of(mu_, events_, "record_event", event);
  enter("record_event");
  check("record_event", "cuEventRecord",
        host_->api().cuEventRecord(e, stream_of("record_event", stream)));
}

void CudaBackend::wait_event(StreamHandle stream, EventHandle event) {
  const CUevent e = event_of(mu_, events_, "wait_event", event);
  enter("wait_event");
  check("wait_event", "cuStreamWaitEvent",
        host_->api().cuStreamWaitEvent(stream_of("wait_event", stream), e, 0));
}

void CudaBackend::event_synchronize(EventHandle event) {
  const CUevent e = event_of(mu_, events_, "event_synchronize", event);
  enter("event_synchronize");
  check("event_synchronize", "cuEventSynchronize", host_->api().cuEventSynchronize(e));
}

EventStatus CudaBackend::event_query(EventHandle event) {
  const CUevent e = event_of(mu_, events_, "event_query", event);
  enter("event_query");
  const CUresult s = host_->api().cuEventQuery(e);
  if (s == CUDA_SUCCESS) return EventStatus::kDone;
  if (s == CUDA_ERROR_NOT_READY) return EventStatus::kNotReady;
  fail("event_query", "cuEventQuery", s);
}

// ---- graphs ----

void CudaBackend::begin_capture(StreamHandle stream) {
  enter("begin_capture");
  // Relaxed: other threads may keep using the driver (allocations, lookups) during a capture.
  check("begin_capture", "cuStreamBeginCapture",
        host_->api().cuStreamBeginCapture(stream_of("begin_capture", stream),
                                          CU_STREAM_CAPTURE_MODE_RELAXED));
}

GraphHandle CudaBackend::end_capture(StreamHandle stream) {
  enter("end_capture");
  const DriverApi& api = host_->api();
  CUgraph graph = nullptr;
  check("end_capture", "cuStreamEndCapture",
        api.cuStreamEndCapture(stream_of("end_capture", stream), &graph));
  CUgraphExec exec = nullptr;
  const CUresult inst = api.cuGraphInstantiateWithFlags(&exec, graph, 0);
  // The template is destroyed whatever instantiation returned: only the exec is kept.
  const CUresult destroyed = api.cuGraphDestroy(graph);
  check("end_capture", "cuGraphInstantiateWithFlags", inst);
  if (destroyed != CUDA_SUCCESS) {
    api.cuGraphExecDestroy(exec);
    fail("end_capture", "cuGraphDestroy", destroyed);
  }
  std::lock_guard lock(mu_);
  graphs_.insert(reinterpret_cast<std::uintptr_t>(exec));
  return GraphHandle{reinterpret_cast<std::uintptr_t>(exec)};
}

void CudaBackend::launch_graph(GraphHandle graph, StreamHandle stream) {
  {
    std::lock_guard lock(mu_);
    if (!graphs_.contains(graph.value())) {
      throw Error(
          ErrorCode::kInvalidArgument, "launch_graph",
          fmt::format("graph 0x{:x} is not a live graph of this cuda backend", graph.value()));
    }
  }
  enter("launch_graph");
  check("launch_graph", "cuGraphLaunch",
        host_->api().cuGraphLaunch(reinterpret_cast<CUgraphExec>(graph.value()),
                                   stream_of("launch_graph", stream)));
}

void CudaBackend::destroy_graph(GraphHandle graph) {
  {
    std::lock_guard lock(mu_);
    if (graphs_.erase(graph.value()) == 0) {
      throw Error(
          ErrorCode::kInvalidArgument, "destroy_graph",
          fmt::format("graph 0x{:x} is not a live graph of this cuda backend", graph.value()));
    }
  }
  host_->bind_quietly();
  check("destroy_graph", "cuGraphExecDestroy",
        host_->api().cuGraphExecDestroy(reinterpret_cast<CUgraphExec>(graph.value())));
}

void CudaBackend::abort_capture(StreamHandle stream) noexcept {
  try {
    if (!is_capturing(stream)) return;
    CUgraph graph = nullptr;
    // Ending the capture is the only way to stop it; whatever it returns, drop the graph.
    host_->api().cuStreamEndCapture(stream_of("abort_capture", stream), &graph);
    if (graph != nullptr) host_->api().cuGraphDestroy(graph);
  } catch (const std::exception& e) {
    log::warn("cuda: abort_capture: {}", e.what());
  }
}

bool CudaBackend::is_capturing(StreamHandle stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUstream cu = stream_of("is_capturing", stream);
  host_->bind_quietly();  // unbound, the query would fail and count as capturing
  const CUresult s = host_->api().cuStreamIsCapturing(cu, &status);
  // A failed query counts as capturing: callers use this to avoid syncs that would break one.
  return s != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE;
}

bool CudaBackend::capture_active(std::string_view api, StreamHandle stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUstream cu = stream_of(api, stream);
  host_->bind_quietly();
  check(api, "cuStreamIsCapturing", host_->api().cuStreamIsCapturing(cu, &status));
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

bool CudaBackend::any_capturing(std::string_view api) {
  std::vector<std::uint64_t> streams;
  {
    std::lock_guard lock(mu_);
    streams.assign(streams_.begin(), streams_.end());
    for (const auto& [s, count] : foreign_) streams.push_back(s);
  }
  if (capture_active(api, default_stream())) return true;
  return std::any_of(streams.begin(), streams.end(),
                     [&](std::uint64_t s) { return capture_active(api, StreamHandle{s}); });
}

// ---- kernels ----

std::vector<ModuleListing> CudaBackend::modules() const {
  std::vector<ModuleListing> out;
  for (const ModuleRegistry::Loaded& l : registry_->loaded()) {
    ModuleListing m{std::string(l.module->name),
                    l.choice.target + (l.choice.via_ptx ? " (JIT from PTX)" : ""),
                    {}};
    for (std::string_view e : l.module->entries) m.kernels.emplace_back(e);
    out.push_back(std::move(m));
  }
  return out;
}

std::string CudaBackend::kernel_name(KernelHandle kernel) const {
  std::lock_guard lock(mu_);
  const auto it = kernels_.find(kernel.value());
  return it == kernels_.end() ? Backend::kernel_name(kernel) : it->second.name;
}

std::optional<std::vector<std::byte>> CudaBackend::read_global(CUmodule module,
                                                               const std::string& symbol,
                                                               const std::string& kernel) {
  const DriverApi& api = host_->api();
  CUdeviceptr where = 0;
  std::size_t size = 0;
  const CUresult s = api.cuModuleGetGlobal(&where, &size, module, symbol.c_str());
  if (s == CUDA_ERROR_NOT_FOUND) return std::nullopt;  // publishing nothing is allowed
  if (s != CUDA_SUCCESS) {
    fail("kernel",
         fmt::format("reading {}'s published symbol {} (cuModuleGetGlobal)", kernel, symbol), s);
  }
  std::vector<std::byte> bytes(size);
  if (size > 0) {
    check("kernel", fmt::format("reading {} (cuMemcpyDtoHAsync)", symbol),
          api.cuMemcpyDtoHAsync(bytes.data(), where, size, host_->stream()));
    check("kernel", fmt::format("reading {} (cuStreamSynchronize)", symbol),
          api.cuStreamSynchronize(host_->stream()));
  }
  return bytes;
}

ResolvedKernel CudaBackend::resolve_kernel(std::string_view module, std::string_view function,
                                           const CallSite& site) {
  enter("kernel");
  const std::string full = fmt::format("{}::{}", module, function);
  // Reading a module global copies device memory to the host: inside a capture that would be
  // recorded (or break the capture) instead of happening now. A failed query is an error naming
  // it, not "a stream is capturing" (which the fault sweep found blaming the caller).
  if (any_capturing("kernel")) {
    throw Error(ErrorCode::kCapture, "kernel",
                fmt::format("cannot resolve {} (from {}) while a stream is capturing: resolve "
                            "kernels before the capture begins",
                            full, site.str()));
  }
  const ModuleRegistry::Loaded* m = registry_->find(module);
  if (m == nullptr) {
    throw Error(ErrorCode::kNotFound, "kernel",
                fmt::format("module '{}' is not loaded on {} ({}); asked for {} from {}", module,
                            host_->info().name, host_->info().cc.str(), full, site.str()));
  }
  CUfunction fn = nullptr;
  const std::string fname(function);
  const CUresult s = host_->api().cuModuleGetFunction(&fn, m->handle, fname.c_str());
  if (s == CUDA_ERROR_NOT_FOUND) {
    throw Error(
        ErrorCode::kNotFound, "kernel",
        fmt::format("module '{}' has no kernel '{}'; asked from {}", module, function, site.str()));
  }
  check("kernel", fmt::format("cuModuleGetFunction({})", full), s);
  const KernelHandle h{reinterpret_cast<std::uintptr_t>(fn)};

  const KernelMeta meta = read_published(
      full, fname, [&](const std::string& symbol) { return read_global(m->handle, symbol, full); });
  std::lock_guard lock(mu_);
  kernels_.try_emplace(h.value(), KernelInfo{full, 0});
  return ResolvedKernel{h, meta};
}

void CudaBackend::require_kernels(std::span<const std::string> also_required, bool allow_missing) {
  std::vector<std::pair<std::string, std::string>> wanted;
  for (const ModuleRegistry::Loaded& l : registry_->loaded()) {
    for (std::string_view e : l.module->entries) wanted.emplace_back(l.module->name, e);
  }
  for (const std::string& r : also_required) {
    const auto sep = r.find("::");
    if (sep == std::string::npos) {
      throw Error(ErrorCode::kInvalidArgument, "require_kernels",
                  fmt::format("'{}' is not of the form module::function", r));
    }
    wanted.emplace_back(r.substr(0, sep), r.substr(sep + 2));
  }
  std::vector<std::string> missing;
  for (const auto& [module, function] : wanted) {
    try {
      op_cache().kernel(*this, module, function);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNotFound) throw;
      missing.push_back(fmt::format("{}::{}", module, function));
    }
  }
  if (missing.empty()) return;
  const std::string list = fmt::format("{}", fmt::join(missing, ", "));
  if (!allow_missing) {
    throw Error(ErrorCode::kNotFound, "require_kernels",
                fmt::format("{} kernel(s) this build should have did not resolve on {} ({}): {}",
                            missing.size(), host_->info().name, host_->info().cc.str(), list));
  }
  log::warn("cuda: {} kernel(s) did not resolve (allowed): {}", missing.size(), list);
}

}  // namespace metrale
