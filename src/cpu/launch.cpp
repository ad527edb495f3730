// CpuBackend's kernels and launches: lookups in the loaded host modules (with their published
// metadata), argument checks, and launches run block by block on the thread pool, checked
// against the limits of current NVIDIA GPUs.
#include <fmt/format.h>

#include <cstring>
#include <memory>

#include "core/launch_trace.h"
#include "core/published.h"
#include "cpu/backend_impl.h"
#include "metrale/error.h"

namespace metrale {
namespace {

// Launch limits of current NVIDIA GPUs, enforced here too so a bad launch fails on the CPU
// before it ever reaches a GPU.
constexpr std::uint32_t kMaxGridX = 0x7fffffff;
constexpr std::uint32_t kMaxGridYZ = 65535;
constexpr std::uint64_t kMaxBlockThreads = 1024;
constexpr std::uint32_t kMaxSharedBytes = 232448;  // 227 KiB, Hopper's opt-in maximum

std::string dim_str(Dim3 d) {
  return fmt::format("({}, {}, {})", d.x, d.y, d.z);
}

}  // namespace

const HostKernel& CpuBackend::Impl::kernel_of(std::string_view api, KernelHandle k) {
  std::lock_guard lock(kernels_mu);
  if (!kernel_names.contains(k.value())) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("kernel 0x{:x} was not resolved by this cpu backend", k.value()));
  }
  return *reinterpret_cast<const HostKernel*>(static_cast<std::uintptr_t>(k.value()));
}

void CpuBackend::Impl::run_grid(const HostKernel& k, const std::string& name, Dim3 grid, Dim3 block,
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
  // Traced on the host clock when the stream reaches the launch (at replay, for a captured one).
  trace::LaunchTracer* const tr = tracer();
  impl_->streams.submit(
      "launch", stream, [this, &k, name, grid, block, shared_bytes, storage, pointers, tr, stream] {
        const double t0 = tr != nullptr ? tr->now_us() : 0;
        impl_->run_grid(k, name, grid, block, shared_bytes, pointers->data());
        if (tr != nullptr) {
          tr->add("cpu", {name, grid, block, shared_bytes, stream.value(), t0, tr->now_us() - t0});
        }
      });
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

ResolvedKernel CpuBackend::resolve_kernel(std::string_view module_name, std::string_view function,
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
  const KernelMeta meta = read_published(
      full, function, [&](const std::string& symbol) -> std::optional<std::vector<std::byte>> {
        if (const auto* bytes = m->find_symbol(symbol)) return *bytes;
        return std::nullopt;
      });
  std::lock_guard lock(impl_->kernels_mu);
  impl_->kernel_names.emplace(h.value(), full);
  return ResolvedKernel{h, meta};
}

}  // namespace metrale
