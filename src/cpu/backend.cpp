// CpuBackend: the class that ties host memory (host_memory.h), the stream emulator (streams.h)
// and fault injection (faults.h) to the Backend primitives: memory, copies, streams and queries.
// Kernels and launches are launch.cpp.
#include "metrale/cpu_backend.h"

#include <fmt/format.h>

#include <cstring>
#include <fstream>
#include <unordered_set>

#include "core/log.h"
#include "cpu/backend_impl.h"
#include "cpu/kernels/w4a16_cpu.h"
#include "metrale/error.h"

namespace metrale {
namespace {

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
  // The cache outlives the streams in impl_: its scratch pool must not reach them again.
  impl_->cache.detach_pool();
  try {
    sweep_unreleased();
  } catch (const std::exception& e) {
    log::error("cpu backend: sweep at destruction failed: {}", e.what());
  }
}

void CpuBackend::set_faults(CpuFaults faults) {
  impl_->faults.set(std::move(faults));
}

std::uint64_t CpuBackend::fault_call_count() const {
  return impl_->faults.count();
}

std::vector<std::string> CpuBackend::fault_calls() const {
  return impl_->faults.calls();
}

std::span<const std::string_view> CpuBackend::fault_call_names() noexcept {
  return cpu::fault_call_names();
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
  return impl_->streams.counts();
}

std::string_view cpu_kernel_isa() noexcept {
  return cpu::w4a16::to_string(cpu::w4a16::best_isa());
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
  return fmt::format("{} ({} threads, {} kernels)", model, impl_->pool.size(), cpu_kernel_isa());
}

DevicePtr CpuBackend::pinned_device_address(const void* host) const {
  const auto addr = reinterpret_cast<std::uintptr_t>(host);
  impl_->memory.check_pinned("pinned_device_address", addr);
  return DevicePtr{addr};
}

void CpuBackend::check_range(std::string_view api, std::string_view what, DevicePtr ptr,
                             std::uint64_t bytes) const {
  check_lazy_range(api, what, ptr, bytes);
  impl_->memory.check_range(api, what, ptr.address(), bytes);
}

// ---- memory primitives ----

DevicePtr CpuBackend::raw_alloc(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) {
  impl_->faults.point(alloc_call(kind));
  if (kind == MemoryKind::kDevice) impl_->faults.check_device_alloc(user_bytes, pad_bytes);
  void* p = impl_->memory.allocate(user_bytes, pad_bytes, kind);
  if (p == nullptr) {
    throw Error(ErrorCode::kOutOfMemory, "alloc", "the host allocator returned no memory");
  }
  return DevicePtr{reinterpret_cast<std::uintptr_t>(p)};
}

void CpuBackend::raw_free(DevicePtr ptr, MemoryKind) {
  impl_->memory.release("free", ptr.address());
}

void CpuBackend::raw_borrow(DevicePtr ptr, std::size_t bytes) {
  impl_->memory.add_borrowed(ptr.address(), bytes);
}

void CpuBackend::raw_unborrow(DevicePtr ptr) noexcept {
  impl_->memory.remove_borrowed(ptr.address());
}

void CpuBackend::raw_fill(DevicePtr ptr, std::uint8_t value, std::size_t bytes) {
  std::memset(reinterpret_cast<void*>(ptr.address()), value, bytes);
}

void CpuBackend::raw_read(DevicePtr ptr, void* dst, std::size_t bytes) {
  std::memcpy(dst, reinterpret_cast<const void*>(ptr.address()), bytes);
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
  impl_->streams.forbid_capture("copy_h2d", default_stream());
  copy_h2d_async(dst, src, bytes, default_stream());
}

void CpuBackend::copy_d2h(void* dst, DevicePtr src, std::size_t bytes) {
  copy_d2h_after(dst, src, bytes, default_stream());
}

void CpuBackend::copy_d2d(DevicePtr dst, DevicePtr src, std::size_t bytes) {
  impl_->streams.forbid_capture("copy_d2d", default_stream());
  copy_d2d_async(dst, src, bytes, default_stream());
}

void CpuBackend::copy_h2d_async(DevicePtr dst, const void* src, std::size_t bytes,
                                StreamHandle stream) {
  if (bytes == 0) return;
  impl_->faults.point("copy_h2d");
  if (src == nullptr) throw Error(ErrorCode::kInvalidArgument, "copy_h2d", "source is null");
  impl_->memory.check_range("copy_h2d", "destination", dst.address(), bytes);
  // Work re-checks its range when it runs, so a replayed graph whose buffer was freed fails
  // cleanly instead of writing freed memory.
  impl_->streams.submit("copy_h2d", stream, [this, dst, src, bytes] {
    impl_->memory.check_range("copy_h2d", "destination", dst.address(), bytes);
    std::memcpy(host(dst), src, bytes);
  });
}

void CpuBackend::copy_d2d_async(DevicePtr dst, DevicePtr src, std::size_t bytes,
                                StreamHandle stream) {
  if (bytes == 0) return;
  impl_->faults.point("copy_d2d");
  auto check = [this, dst, src, bytes] {
    impl_->memory.check_range("copy_d2d", "destination", dst.address(), bytes);
    impl_->memory.check_range("copy_d2d", "source", src.address(), bytes);
  };
  check();
  impl_->streams.submit("copy_d2d", stream, [check, dst, src, bytes] {
    check();
    std::memmove(host(dst), host(src), bytes);
  });
}

void CpuBackend::copy_d2h_after(void* dst, DevicePtr src, std::size_t bytes, StreamHandle stream) {
  impl_->streams.forbid_capture("copy_d2h", stream);
  if (bytes == 0) return;
  impl_->faults.point("copy_d2h");
  if (dst == nullptr) throw Error(ErrorCode::kInvalidArgument, "copy_d2h", "destination is null");
  impl_->memory.check_range("copy_d2h", "source", src.address(), bytes);
  std::memcpy(dst, host(src), bytes);
}

void CpuBackend::copy_2d_async(DevicePtr dst, std::size_t dst_pitch, DevicePtr src,
                               std::size_t src_pitch, std::size_t width_bytes, std::size_t height,
                               StreamHandle stream) {
  if (width_bytes == 0 || height == 0) return;
  impl_->faults.point("copy_2d");
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
  impl_->streams.submit("copy_2d", stream, [=] {
    check();
    for (std::size_t r = 0; r < height; ++r) {
      std::memmove(host(dst.offset(r * dst_pitch)), host(src.offset(r * src_pitch)), width_bytes);
    }
  });
}

void CpuBackend::memset(DevicePtr dst, std::uint8_t value, std::size_t bytes) {
  impl_->streams.forbid_capture("memset", default_stream());
  memset_async(dst, value, bytes, default_stream());
}

void CpuBackend::memset_async(DevicePtr dst, std::uint8_t value, std::size_t bytes,
                              StreamHandle stream) {
  if (bytes == 0) return;
  impl_->faults.point("memset");
  impl_->memory.check_range("memset", "destination", dst.address(), bytes);
  impl_->streams.submit("memset", stream, [this, dst, value, bytes] {
    impl_->memory.check_range("memset", "destination", dst.address(), bytes);
    std::memset(host(dst), value, bytes);
  });
}

// ---- streams and events ----

StreamHandle CpuBackend::default_stream() {
  return StreamHandle{cpu::Streams::kDefault};
}

StreamHandle CpuBackend::create_stream() {
  impl_->faults.point("create_stream");
  return impl_->streams.create_stream();
}

void CpuBackend::destroy_stream(StreamHandle stream) {
  impl_->streams.destroy_stream(stream);
}

void CpuBackend::synchronize(StreamHandle stream) {
  impl_->faults.point("synchronize");
  impl_->streams.forbid_capture("synchronize", stream);
}

void CpuBackend::synchronize_device() {
  impl_->faults.point("synchronize_device");
  impl_->streams.forbid_capture_anywhere("synchronize_device");
}

EventHandle CpuBackend::create_event() {
  impl_->faults.point("create_event");
  return impl_->streams.create_event();
}

EventHandle CpuBackend::create_timing_event() {
  impl_->faults.point("create_timing_event");
  return impl_->streams.create_event(true);
}

double CpuBackend::event_elapsed_ms(EventHandle start, EventHandle end) {
  return impl_->streams.elapsed_ms(start, end);
}

void CpuBackend::destroy_event(EventHandle event) {
  impl_->streams.destroy_event(event);
}

void CpuBackend::record_event(EventHandle event, StreamHandle stream) {
  impl_->faults.point("record_event");
  impl_->streams.check_event("record_event", event);
  // Work before it has already run (or is recorded before it in a capture); the stamp is taken
  // when the stream reaches the record (at replay, for a captured one).
  impl_->streams.submit("record_event", stream, [this, event] { impl_->streams.stamp(event); });
}

void CpuBackend::wait_event(StreamHandle stream, EventHandle event) {
  impl_->faults.point("wait_event");
  impl_->streams.check_event("wait_event", event);
  impl_->streams.submit("wait_event", stream, [] {});
}

void CpuBackend::event_synchronize(EventHandle event) {
  impl_->faults.point("event_synchronize");
  impl_->streams.check_event("event_synchronize", event);
}

EventStatus CpuBackend::event_query(EventHandle event) {
  impl_->streams.check_event("event_query", event);
  return EventStatus::kDone;
}

// ---- graphs ----

void CpuBackend::begin_capture(StreamHandle stream) {
  impl_->faults.point("begin_capture");
  impl_->streams.begin_capture(stream);
}

// An injected failure leaves the stream capturing, as a failed cuStreamEndCapture may: error
// paths end it with abort_capture.
GraphHandle CpuBackend::end_capture(StreamHandle stream) {
  impl_->faults.point("end_capture");
  return impl_->streams.end_capture(stream);
}

void CpuBackend::launch_graph(GraphHandle graph, StreamHandle stream) {
  impl_->faults.point("launch_graph");
  std::shared_ptr<const std::vector<cpu::Work>> work = impl_->streams.graph(graph);
  impl_->streams.submit("launch_graph", stream, [work] {
    for (const cpu::Work& w : *work) w();
  });
}

void CpuBackend::destroy_graph(GraphHandle graph) {
  impl_->streams.destroy_graph(graph);
}

void CpuBackend::abort_capture(StreamHandle stream) noexcept {
  impl_->streams.abort_capture(stream);
}

bool CpuBackend::is_capturing(StreamHandle stream) {
  return impl_->streams.is_capturing(stream);
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

// ---- the op cache ----

OpCache& CpuBackend::op_cache() {
  return impl_->cache;
}

const OpCache& CpuBackend::op_cache() const {
  return impl_->cache;
}

}  // namespace metrale
