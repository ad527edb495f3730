#include "metrale/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "core/log.h"
#include "core/published.h"
#include "cpu/host_memory.h"
#include "cpu/thread_pool.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

using Work = std::function<void()>;

constexpr std::uint64_t kDefaultStream = 1;
// Launch limits of current NVIDIA GPUs, enforced here too so a bad launch fails on the CPU
// before it ever reaches a GPU.
constexpr std::uint32_t kMaxGridX = 0x7fffffff;
constexpr std::uint32_t kMaxGridYZ = 65535;
constexpr std::uint64_t kMaxBlockThreads = 1024;
constexpr std::uint32_t kMaxSharedBytes = 232448;  // 227 KiB, Hopper's opt-in maximum

struct StreamState {
  bool capturing = false;
  bool invalidated = false;
  std::string invalidated_by;
  std::vector<Work> recorded;
};

// Every fallible primitive (CpuBackend::fault_call_names). Each counts as one numbered call for
// CpuFaults::fail_call_at and fails, when chosen, before it does anything. Releases are left out:
// on the CPU they fail only for a handle that is not live, which is the caller's error.
constexpr std::string_view kFaultCalls[] = {
    "alloc",        "alloc_managed", "alloc_pinned",  "create_stream",      "create_event",
    "record_event", "wait_event",    "synchronize",   "synchronize_device", "event_synchronize",
    "kernel",       "launch",        "copy_h2d",      "copy_d2h",           "copy_d2d",
    "copy_2d",      "memset",        "begin_capture", "end_capture",        "launch_graph",
};

std::string_view alloc_call(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kManaged:
      return "alloc_managed";
    case MemoryKind::kPinnedHost:
      return "alloc_pinned";
    default:
      return "alloc";
  }
}

std::string dim_str(Dim3 d) {
  return fmt::format("({}, {}, {})", d.x, d.y, d.z);
}

// Reads "Key:   12345 kB" from /proc/meminfo; 0 when missing.
std::size_t meminfo_bytes(std::string_view key) {
  std::ifstream in("/proc/meminfo");
  std::string name;
  std::size_t kb = 0;
  std::string unit;
  while (in >> name >> kb) {
    std::getline(in, unit);
    if (name.size() == key.size() + 1 && name.compare(0, key.size(), key) == 0) return kb * 1024;
  }
  return 0;
}

}  // namespace

struct CpuBackend::Impl {
  explicit Impl(CpuBackendOptions o) : modules(std::move(o.modules)), pool(o.threads) {}

  std::vector<HostModule> modules;
  cpu::ThreadPool pool;
  cpu::HostMemory memory;
  OpCache cache;

  mutable std::mutex faults_mu;
  CpuFaults faults;
  std::uint64_t alloc_calls = 0;
  std::uint64_t fault_calls = 0;
  std::vector<std::string_view> call_log;  // names from kFaultCalls, when faults.record_calls

  // Counts one fallible call (call is one of kFaultCalls) and throws when it is the one chosen
  // to fail. Every primitive calls this before any side effect, so a failure leaves nothing
  // half-done.
  void fault_point(std::string_view call) {
    std::lock_guard lock(faults_mu);
    const std::uint64_t n = ++fault_calls;
    if (faults.record_calls) call_log.push_back(call);
    if (faults.fail_call_at != n) return;
    const bool alloc = call.starts_with("alloc");
    throw Error(alloc ? ErrorCode::kOutOfMemory : ErrorCode::kDriver, "cpu",
                fmt::format("{}: injected failure (call #{})", call, n));
  }

  mutable std::mutex mu;  // streams, events, graphs, kernels
  std::unordered_map<std::uint64_t, StreamState> streams{{kDefaultStream, StreamState{}}};
  std::unordered_set<std::uint64_t> events;
  std::unordered_map<std::uint64_t, std::shared_ptr<const std::vector<Work>>> graphs;
  std::unordered_map<std::uint64_t, std::string> kernel_names;  // resolved handles
  std::uint64_t next_id = kDefaultStream + 1;

  StreamState& stream_locked(std::string_view api, StreamHandle s) {
    const auto it = streams.find(s.value());
    if (it == streams.end()) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("stream 0x{:x} is not a live stream of the cpu backend", s.value()));
    }
    return it->second;
  }

  // Runs work now, or records it when the stream is capturing.
  void submit(std::string_view api, StreamHandle s, Work work) {
    {
      std::lock_guard lock(mu);
      StreamState& st = stream_locked(api, s);
      if (st.capturing) {
        if (st.invalidated) {
          throw Error(ErrorCode::kCapture, api,
                      fmt::format("the capture on stream 0x{:x} was invalidated by {}", s.value(),
                                  st.invalidated_by));
        }
        st.recorded.push_back(std::move(work));
        return;
      }
    }
    work();
  }

  // Blocking work on stream s: not allowed while s captures (and it spoils the capture).
  void forbid_capture(std::string_view api, StreamHandle s) {
    std::lock_guard lock(mu);
    StreamState& st = stream_locked(api, s);
    if (!st.capturing) return;
    st.invalidated = true;
    if (st.invalidated_by.empty()) st.invalidated_by = std::string(api);
    throw Error(ErrorCode::kCapture, api,
                fmt::format("stream 0x{:x} is capturing: a synchronizing call inside a capture "
                            "invalidates it",
                            s.value()));
  }

  const HostKernel& kernel_of(std::string_view api, KernelHandle k) {
    std::lock_guard lock(mu);
    if (!kernel_names.contains(k.value())) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("kernel 0x{:x} was not resolved by this cpu backend", k.value()));
    }
    return *reinterpret_cast<const HostKernel*>(static_cast<std::uintptr_t>(k.value()));
  }

  void run_grid(const HostKernel& k, const std::string& name, Dim3 grid, Dim3 block,
                std::uint32_t shared_bytes, void* const* params) {
    const std::uint64_t gx = grid.x, gxy = std::uint64_t{grid.x} * grid.y;
    try {
      pool.parallel_for(grid.volume(), [&](std::size_t i) {
        thread_local std::vector<std::byte> shared;
        if (shared.size() < shared_bytes) shared.resize(shared_bytes);
        HostBlock hb;
        hb.grid = grid;
        hb.block = block;
        hb.block_idx =
            Dim3{static_cast<std::uint32_t>(i % gx), static_cast<std::uint32_t>((i / gx) % grid.y),
                 static_cast<std::uint32_t>(i / gxy)};
        hb.shared_bytes = shared_bytes;
        hb.shared = shared.data();
        hb.params = params;
        k.fn(hb);
      });
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kDeviceFault, "launch",
                  fmt::format("{} grid {} block {} shared {} B failed: {}", name, dim_str(grid),
                              dim_str(block), shared_bytes, e.what()));
    }
  }
};

CpuBackend::CpuBackend(CpuBackendOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  std::unordered_set<std::string> names;
  for (const HostModule& m : impl_->modules) {
    if (!names.insert(m.name()).second) {
      throw Error(ErrorCode::kInvalidArgument, "CpuBackend",
                  fmt::format("module '{}' is given twice", m.name()));
    }
  }
}

CpuBackend::~CpuBackend() {
  try {
    sweep_unreleased();
  } catch (const std::exception& e) {
    log::error("cpu backend: sweep at destruction failed: {}", e.what());
  }
}

void CpuBackend::set_faults(CpuFaults faults) {
  std::lock_guard lock(impl_->faults_mu);
  impl_->faults = std::move(faults);
  impl_->alloc_calls = 0;
  impl_->fault_calls = 0;
  impl_->call_log.clear();
}

std::uint64_t CpuBackend::fault_call_count() const {
  std::lock_guard lock(impl_->faults_mu);
  return impl_->fault_calls;
}

std::vector<std::string> CpuBackend::fault_calls() const {
  std::lock_guard lock(impl_->faults_mu);
  return {impl_->call_log.begin(), impl_->call_log.end()};
}

std::span<const std::string_view> CpuBackend::fault_call_names() noexcept {
  return kFaultCalls;
}

std::vector<std::string> CpuBackend::module_names() const {
  std::vector<std::string> out;
  for (const HostModule& m : impl_->modules) out.push_back(m.name());
  return out;
}

const HostModule* CpuBackend::module(std::string_view name) const {
  for (const HostModule& m : impl_->modules) {
    if (m.name() == name) return &m;
  }
  return nullptr;
}

CpuBackend::HandleCounts CpuBackend::handle_counts() const {
  std::lock_guard lock(impl_->mu);
  return HandleCounts{impl_->streams.size() - 1, impl_->events.size(), impl_->graphs.size()};
}

std::string CpuBackend::device_name() const {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      const auto text = colon == std::string::npos ? colon : line.find_first_not_of(' ', colon + 1);
      if (text != std::string::npos) model = line.substr(text);
      break;
    }
  }
  return fmt::format("{} ({} threads)", model, impl_->pool.size());
}

DevicePtr CpuBackend::pinned_device_address(const void* host) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(host);
  impl_->memory.check_pinned("pinned_device_address", addr);
  return DevicePtr{addr};
}

void CpuBackend::check_range(std::string_view api, std::string_view what, DevicePtr ptr,
                             std::uint64_t bytes) const {
  impl_->memory.check_range(api, what, ptr.address(), bytes);
}

// ---- memory primitives ----

DevicePtr CpuBackend::raw_alloc(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) {
  impl_->fault_point(alloc_call(kind));
  {
    std::lock_guard lock(impl_->faults_mu);
    const std::uint64_t n = ++impl_->alloc_calls;
    if (impl_->faults.fail_alloc_at == n) {
      throw Error(ErrorCode::kOutOfMemory, "alloc",
                  fmt::format("injected failure of allocation #{}", n));
    }
    if (kind == MemoryKind::kDevice && (user_bytes > impl_->faults.max_device_alloc ||
                                        pad_bytes > impl_->faults.max_device_alloc - user_bytes)) {
      throw Error(ErrorCode::kOutOfMemory, "alloc",
                  fmt::format("{} exceeds the injected device allocation cap of {}",
                              format_bytes(user_bytes + pad_bytes),
                              format_bytes(impl_->faults.max_device_alloc)));
    }
  }
  void* p = impl_->memory.allocate(user_bytes, pad_bytes, kind);
  if (p == nullptr) {
    throw Error(ErrorCode::kOutOfMemory, "alloc", "the host allocator returned no memory");
  }
  return DevicePtr{reinterpret_cast<std::uintptr_t>(p)};
}

void CpuBackend::raw_free(DevicePtr ptr, MemoryKind) {
  impl_->memory.release("free", ptr.address());
}

void CpuBackend::raw_fill(DevicePtr ptr, std::uint8_t value, std::size_t bytes) {
  std::memset(reinterpret_cast<void*>(ptr.address()), value, bytes);
}

void CpuBackend::raw_read(DevicePtr ptr, void* dst, std::size_t bytes) {
  std::memcpy(dst, reinterpret_cast<const void*>(ptr.address()), bytes);
}

void CpuBackend::check_args(KernelHandle kernel, std::span<const KernelArg> args) {
  const HostKernel& k = impl_->kernel_of("launch", kernel);
  if (args.size() != k.param_sizes.size()) {
    throw Error(ErrorCode::kInvalidArgument, "launch",
                fmt::format("{} takes {} parameter(s), got {}", kernel_name(kernel),
                            k.param_sizes.size(), args.size()));
  }
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::size_t given = args[i].is_buffer() ? sizeof(std::uint64_t) : args[i].bytes().size();
    if (given != k.param_sizes[i]) {
      throw Error(ErrorCode::kInvalidArgument, "launch",
                  fmt::format("{} parameter {} is {} byte(s), the argument given is {}",
                              kernel_name(kernel), i, k.param_sizes[i], given));
    }
  }
}

std::string CpuBackend::describe_unknown_pointer(DevicePtr ptr) const {
  return impl_->memory.describe(ptr.address());
}

// ---- copies ----

namespace {
void* host(DevicePtr p) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.address()));
}
}  // namespace

void CpuBackend::copy_h2d(DevicePtr dst, const void* src, std::size_t bytes) {
  impl_->forbid_capture("copy_h2d", default_stream());
  copy_h2d_async(dst, src, bytes, default_stream());
}

void CpuBackend::copy_d2h(void* dst, DevicePtr src, std::size_t bytes) {
  copy_d2h_after(dst, src, bytes, default_stream());
}

void CpuBackend::copy_d2d(DevicePtr dst, DevicePtr src, std::size_t bytes) {
  impl_->forbid_capture("copy_d2d", default_stream());
  copy_d2d_async(dst, src, bytes, default_stream());
}

void CpuBackend::copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                                StreamHandle stream) {
  if (bytes == 0) return;
  impl_->fault_point("copy_h2d");
  if (src == nullptr) throw Error(ErrorCode::kInvalidArgument, "copy_h2d", "source is null");
  impl_->memory.check_range("copy_h2d", "destination", dst.address(), bytes);
  // Work re-checks its range when it runs, so a replayed graph whose buffer was freed fails
  // cleanly instead of writing freed memory.
  impl_->submit("copy_h2d", stream, [this, dst, src, bytes] {
    impl_->memory.check_range("copy_h2d", "destination", dst.address(), bytes);
    std::memcpy(host(dst), src, bytes);
  });
}

void CpuBackend::copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                                StreamHandle stream) {
  if (bytes == 0) return;
  impl_->fault_point("copy_d2d");
  auto check = [this, dst, src, bytes] {
    impl_->memory.check_range("copy_d2d", "destination", dst.address(), bytes);
    impl_->memory.check_range("copy_d2d", "source", src.address(), bytes);
  };
  check();
  impl_->submit("copy_d2d", stream, [check, dst, src, bytes] {
    check();
    std::memmove(host(dst), host(src), bytes);
  });
}

void CpuBackend::copy_d2h_after(void* dst, DevicePtr src, std::size_t bytes, StreamHandle stream) {
  impl_->forbid_capture("copy_d2h", stream);
  if (bytes == 0) return;
  impl_->fault_point("copy_d2h");
  if (dst == nullptr) throw Error(ErrorCode::kInvalidArgument, "copy_d2h", "destination is null");
  impl_->memory.check_range("copy_d2h", "source", src.address(), bytes);
  std::memcpy(dst, host(src), bytes);
}

void CpuBackend::copy_2d_async(DevicePtr dst, std::size_t dst_pitch, DevicePtr src,
                               std::size_t src_pitch, std::size_t width_bytes, std::size_t height,
                               StreamHandle stream) {
  if (width_bytes == 0 || height == 0) return;
  impl_->fault_point("copy_2d");
  if (width_bytes > dst_pitch || width_bytes > src_pitch) {
    throw Error(ErrorCode::kInvalidArgument, "copy_2d",
                fmt::format("width {} bytes exceeds a pitch (dst {}, src {})", width_bytes,
                            dst_pitch, src_pitch));
  }
  auto check = [this, dst, dst_pitch, src, src_pitch, width_bytes, height] {
    impl_->memory.check_range("copy_2d", "destination", dst.address(),
                              (height - 1) * dst_pitch + width_bytes);
    impl_->memory.check_range("copy_2d", "source", src.address(),
                              (height - 1) * src_pitch + width_bytes);
  };
  check();
  impl_->submit("copy_2d", stream, [=] {
    check();
    for (std::size_t r = 0; r < height; ++r) {
      std::memmove(host(dst.offset(r * dst_pitch)), host(src.offset(r * src_pitch)), width_bytes);
    }
  });
}

void CpuBackend::memset(DevicePtr dst, std::uint8_t value, std::size_t bytes) {
  impl_->forbid_capture("memset", default_stream());
  memset_async(dst, value, bytes, default_stream());
}

void CpuBackend::memset_async(DevicePtr dst, std::uint8_t value, std::size_t bytes,
                              StreamHandle stream) {
  if (bytes == 0) return;
  impl_->fault_point("memset");
  impl_->memory.check_range("memset", "destination", dst.address(), bytes);
  impl_->submit("memset", stream, [this, dst, value, bytes] {
    impl_->memory.check_range("memset", "destination", dst.address(), bytes);
    std::memset(host(dst), value, bytes);
  });
}

// ---- launches ----

void CpuBackend::launch(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
                        StreamHandle stream, std::span<void*> params) {
  impl_->fault_point("launch");
  const HostKernel& k = impl_->kernel_of("launch", kernel);
  const std::string name = kernel_name(kernel);
  auto bad = [&](std::string what) {
    return Error(ErrorCode::kInvalidArgument, "launch",
                 fmt::format("{} grid {} block {} shared {} B: {}", name, dim_str(grid),
                             dim_str(block), shared_bytes, what));
  };
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > kMaxGridX || grid.y > kMaxGridYZ ||
      grid.z > kMaxGridYZ) {
    throw bad("grid out of range");
  }
  if (block.x == 0 || block.y == 0 || block.z == 0 || block.volume() > kMaxBlockThreads) {
    throw bad(fmt::format("block must have 1..{} threads", kMaxBlockThreads));
  }
  if (shared_bytes > kMaxSharedBytes) {
    throw bad(
        fmt::format("more dynamic shared memory than the {} B a block can have", kMaxSharedBytes));
  }
  if (params.size() != k.param_sizes.size()) {
    throw bad(fmt::format("the kernel takes {} parameter(s), got {}", k.param_sizes.size(),
                          params.size()));
  }
  // Copy the parameter values now, as the driver does, so the caller's storage may go away
  // and a captured launch replays with the values it was captured with.
  std::vector<std::size_t> first;
  std::size_t slots = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i] == nullptr) throw bad(fmt::format("parameter {} is null", i));
    first.push_back(slots);
    slots += (k.param_sizes[i] + 7) / 8;
  }
  auto storage = std::make_shared<std::vector<std::uint64_t>>(slots, 0);
  auto pointers = std::make_shared<std::vector<void*>>();
  for (std::size_t i = 0; i < params.size(); ++i) {
    std::memcpy(storage->data() + first[i], params[i], k.param_sizes[i]);
    pointers->push_back(storage->data() + first[i]);
  }
  impl_->submit("launch", stream, [this, &k, name, grid, block, shared_bytes, storage, pointers] {
    impl_->run_grid(k, name, grid, block, shared_bytes, pointers->data());
  });
}

// ---- streams and events ----

StreamHandle CpuBackend::default_stream() {
  return StreamHandle{kDefaultStream};
}

StreamHandle CpuBackend::create_stream() {
  impl_->fault_point("create_stream");
  std::lock_guard lock(impl_->mu);
  const std::uint64_t id = impl_->next_id++;
  impl_->streams.emplace(id, StreamState{});
  return StreamHandle{id};
}

void CpuBackend::destroy_stream(StreamHandle stream) {
  std::lock_guard lock(impl_->mu);
  if (stream.value() == kDefaultStream) {
    throw Error(ErrorCode::kInvalidArgument, "destroy_stream",
                "the backend's default stream belongs to the backend");
  }
  if (impl_->streams.erase(stream.value()) == 0) {
    throw Error(
        ErrorCode::kInvalidArgument, "destroy_stream",
        fmt::format("stream 0x{:x} is not a live stream of the cpu backend", stream.value()));
  }
}

void CpuBackend::synchronize(StreamHandle stream) {
  impl_->fault_point("synchronize");
  impl_->forbid_capture("synchronize", stream);
}

void CpuBackend::synchronize_device() {
  impl_->fault_point("synchronize_device");
  std::vector<std::uint64_t> ids;
  {
    std::lock_guard lock(impl_->mu);
    for (const auto& [id, _] : impl_->streams) ids.push_back(id);
  }
  for (std::uint64_t id : ids) {
    try {
      impl_->forbid_capture("synchronize_device", StreamHandle{id});
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kCapture) throw;
      // A stream destroyed meanwhile has nothing left to wait for.
    }
  }
}

EventHandle CpuBackend::create_event() {
  impl_->fault_point("create_event");
  std::lock_guard lock(impl_->mu);
  const std::uint64_t id = impl_->next_id++;
  impl_->events.insert(id);
  return EventHandle{id};
}

namespace {
Error unknown_event(std::string_view api, EventHandle e) {
  return Error(ErrorCode::kInvalidArgument, api,
               fmt::format("event 0x{:x} is not a live event of the cpu backend", e.value()));
}
}  // namespace

void CpuBackend::destroy_event(EventHandle event) {
  std::lock_guard lock(impl_->mu);
  if (impl_->events.erase(event.value()) == 0) throw unknown_event("destroy_event", event);
}

void CpuBackend::record_event(EventHandle event, StreamHandle stream) {
  impl_->fault_point("record_event");
  {
    std::lock_guard lock(impl_->mu);
    if (!impl_->events.contains(event.value())) throw unknown_event("record_event", event);
  }
  // Work before it has already run (or is recorded before it in a capture): nothing to mark.
  impl_->submit("record_event", stream, [] {});
}

void CpuBackend::wait_event(StreamHandle stream, EventHandle event) {
  impl_->fault_point("wait_event");
  {
    std::lock_guard lock(impl_->mu);
    if (!impl_->events.contains(event.value())) throw unknown_event("wait_event", event);
  }
  impl_->submit("wait_event", stream, [] {});
}

void CpuBackend::event_synchronize(EventHandle event) {
  impl_->fault_point("event_synchronize");
  std::lock_guard lock(impl_->mu);
  if (!impl_->events.contains(event.value())) throw unknown_event("event_synchronize", event);
}

EventStatus CpuBackend::event_query(EventHandle event) {
  std::lock_guard lock(impl_->mu);
  if (!impl_->events.contains(event.value())) throw unknown_event("event_query", event);
  return EventStatus::kDone;
}

// ---- graphs ----

void CpuBackend::begin_capture(StreamHandle stream) {
  impl_->fault_point("begin_capture");
  std::lock_guard lock(impl_->mu);
  StreamState& st = impl_->stream_locked("begin_capture", stream);
  if (st.capturing) {
    throw Error(ErrorCode::kCapture, "begin_capture",
                fmt::format("stream 0x{:x} is already capturing", stream.value()));
  }
  st = StreamState{};
  st.capturing = true;
}

// An injected failure leaves the stream capturing, as a failed cuStreamEndCapture may: error
// paths end it with abort_capture.
GraphHandle CpuBackend::end_capture(StreamHandle stream) {
  impl_->fault_point("end_capture");
  std::lock_guard lock(impl_->mu);
  StreamState& st = impl_->stream_locked("end_capture", stream);
  if (!st.capturing) {
    throw Error(ErrorCode::kCapture, "end_capture",
                fmt::format("stream 0x{:x} is not capturing", stream.value()));
  }
  StreamState done = std::move(st);
  st = StreamState{};
  if (done.invalidated) {
    throw Error(ErrorCode::kCapture, "end_capture",
                fmt::format("the capture on stream 0x{:x} was invalidated by {}; nothing was "
                            "instantiated",
                            stream.value(), done.invalidated_by));
  }
  const std::uint64_t id = impl_->next_id++;
  impl_->graphs.emplace(id, std::make_shared<const std::vector<Work>>(std::move(done.recorded)));
  return GraphHandle{id};
}

void CpuBackend::launch_graph(GraphHandle graph, StreamHandle stream) {
  impl_->fault_point("launch_graph");
  std::shared_ptr<const std::vector<Work>> work;
  {
    std::lock_guard lock(impl_->mu);
    const auto it = impl_->graphs.find(graph.value());
    if (it == impl_->graphs.end()) {
      throw Error(
          ErrorCode::kInvalidArgument, "launch_graph",
          fmt::format("graph 0x{:x} is not a live graph of the cpu backend", graph.value()));
    }
    work = it->second;
  }
  impl_->submit("launch_graph", stream, [work] {
    for (const Work& w : *work) w();
  });
}

void CpuBackend::destroy_graph(GraphHandle graph) {
  std::lock_guard lock(impl_->mu);
  if (impl_->graphs.erase(graph.value()) == 0) {
    throw Error(ErrorCode::kInvalidArgument, "destroy_graph",
                fmt::format("graph 0x{:x} is not a live graph of the cpu backend", graph.value()));
  }
}

void CpuBackend::abort_capture(StreamHandle stream) noexcept {
  std::lock_guard lock(impl_->mu);
  const auto it = impl_->streams.find(stream.value());
  if (it != impl_->streams.end()) it->second = StreamState{};
}

bool CpuBackend::is_capturing(StreamHandle stream) {
  std::lock_guard lock(impl_->mu);
  return impl_->stream_locked("is_capturing", stream).capturing;
}

// ---- queries ----

std::size_t CpuBackend::total_memory() const {
  return meminfo_bytes("MemTotal");
}
std::size_t CpuBackend::free_memory() const {
  return meminfo_bytes("MemAvailable");
}
std::size_t CpuBackend::driver_free_memory() const {
  return meminfo_bytes("MemAvailable");
}
std::uint32_t CpuBackend::sm_count() const {
  return impl_->pool.size();
}

// ---- kernels ----

bool CpuBackend::has_module(std::string_view module) const {
  return this->module(module) != nullptr;
}

std::vector<ModuleListing> CpuBackend::modules() const {
  std::vector<ModuleListing> out;
  for (const HostModule& m : impl_->modules) {
    ModuleListing l{m.name(), "host", {}};
    for (const HostKernel& k : m.kernels()) l.kernels.push_back(k.name);
    out.push_back(std::move(l));
  }
  return out;
}

std::string CpuBackend::kernel_name(KernelHandle kernel) const {
  std::lock_guard lock(impl_->mu);
  const auto it = impl_->kernel_names.find(kernel.value());
  return it == impl_->kernel_names.end() ? Backend::kernel_name(kernel) : it->second;
}

OpCache& CpuBackend::op_cache() {
  return impl_->cache;
}

ResolvedKernel CpuBackend::resolve_kernel(std::string_view module_name, std::string_view function,
                                          const CallSite& site) {
  impl_->fault_point("kernel");
  const std::string full = fmt::format("{}::{}", module_name, function);
  {
    std::lock_guard lock(impl_->mu);
    for (const auto& [id, st] : impl_->streams) {
      if (st.capturing) {
        throw Error(ErrorCode::kCapture, "kernel",
                    fmt::format("cannot resolve {} (from {}) while stream 0x{:x} is capturing: "
                                "resolve kernels before the capture begins",
                                full, site.str(), id));
      }
    }
  }
  {
    std::lock_guard lock(impl_->faults_mu);
    const auto& deny = impl_->faults.deny_lookups;
    if (std::find(deny.begin(), deny.end(), full) != deny.end()) {
      throw Error(ErrorCode::kNotFound, "kernel",
                  fmt::format("{} (from {}) denied by fault injection", full, site.str()));
    }
  }
  const HostModule* m = module(module_name);
  if (m == nullptr) {
    throw Error(ErrorCode::kNotFound, "kernel",
                fmt::format("module '{}' is not loaded on the cpu backend (loaded: {}); asked "
                            "for {} from {}",
                            module_name, fmt::join(module_names(), ", "), full, site.str()));
  }
  const HostKernel* k = m->find_kernel(function);
  if (k == nullptr) {
    std::vector<std::string> have;
    for (const HostKernel& x : m->kernels()) have.push_back(x.name);
    throw Error(ErrorCode::kNotFound, "kernel",
                fmt::format("module '{}' has no kernel '{}' (it has: {}); asked from {}",
                            module_name, function, fmt::join(have, ", "), site.str()));
  }
  const KernelHandle h{reinterpret_cast<std::uintptr_t>(k)};
  // Published metadata, read by the same rules as the CUDA backend's module globals.
  const KernelMeta meta = read_published(
      full, function, [&](const std::string& symbol) -> std::optional<std::vector<std::byte>> {
        if (const auto* bytes = m->find_symbol(symbol)) return *bytes;
        return std::nullopt;
      });
  std::lock_guard lock(impl_->mu);
  impl_->kernel_names.emplace(h.value(), full);
  return ResolvedKernel{h, meta};
}

}  // namespace metrale
