// CpuBackend: the class that ties host memory (host_memory.h), the stream emulator (streams.h)
// and fault injection (faults.h) to the Backend primitives, and runs launches on the thread pool.
#include "metrale/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <unordered_map>
#include <unordered_set>

#include "core/log.h"
#include "core/published.h"
#include "cpu/faults.h"
#include "cpu/host_memory.h"
#include "cpu/streams.h"
#include "cpu/thread_pool.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

// Launch limits of current NVIDIA GPUs, enforced here too so a bad launch fails on the CPU
// before it ever reaches a GPU.
constexpr std::uint32_t kMaxGridX = 0x7fffffff;
constexpr std::uint32_t kMaxGridYZ = 65535;
constexpr std::uint64_t kMaxBlockThreads = 1024;
constexpr std::uint32_t kMaxSharedBytes = 232448;  // 227 KiB, Hopper's opt-in maximum

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
  cpu::FaultInjector faults;
  cpu::Streams streams;

  mutable std::mutex kernels_mu;
  std::unordered_map<std::uint64_t, std::string> kernel_names;  // resolved handles

  const HostKernel& kernel_of(std::string_view api, KernelHandle k) {
    std::lock_guard lock(kernels_mu);
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

// ---- launches ----

void CpuBackend::launch(KernelHandle kernel, Dim3 grid, Dim3 block, std::uint32_t shared_bytes,
                        StreamHandle stream, std::span<void*> params) {
  impl_->faults.point("launch");
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
  impl_->streams.submit("launch", stream,
                        [this, &k, name, grid, block, shared_bytes, storage, pointers] {
                          impl_->run_grid(k, name, grid, block, shared_bytes, pointers->data());
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

void CpuBackend::destroy_event(EventHandle event) {
  impl_->streams.destroy_event(event);
}

void CpuBackend::record_event(EventHandle event, StreamHandle stream) {
  impl_->faults.point("record_event");
  impl_->streams.check_event("record_event", event);
  // Work before it has already run (or is recorded before it in a capture): nothing to mark.
  impl_->streams.submit("record_event", stream, [] {});
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
  std::lock_guard lock(impl_->kernels_mu);
  const auto it = impl_->kernel_names.find(kernel.value());
  return it == impl_->kernel_names.end() ? Backend::kernel_name(kernel) : it->second;
}

OpCache& CpuBackend::op_cache() {
  return impl_->cache;
}

KernelHandle CpuBackend::resolve_kernel(std::string_view module_name, std::string_view function,
                                        const CallSite& site) {
  impl_->faults.point("kernel");
  const std::string full = fmt::format("{}::{}", module_name, function);
  if (const std::uint64_t id = impl_->streams.capturing_stream(); id != 0) {
    throw Error(ErrorCode::kCapture, "kernel",
                fmt::format("cannot resolve {} (from {}) while stream 0x{:x} is capturing: "
                            "resolve kernels before the capture begins",
                            full, site.str(), id));
  }
  impl_->faults.check_lookup(full, site.str());
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
  record_published(op_cache(), h, full, function,
                   [&](const std::string& symbol) -> std::optional<std::vector<std::byte>> {
                     if (const auto* bytes = m->find_symbol(symbol)) return *bytes;
                     return std::nullopt;
                   });
  std::lock_guard lock(impl_->kernels_mu);
  impl_->kernel_names.emplace(h.value(), full);
  return h;
}

}  // namespace metrale
