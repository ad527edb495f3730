// The state of one CpuBackend, shared by its files (backend.cpp, launch.cpp).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu/faults.h"
#include "cpu/host_memory.h"
#include "cpu/streams.h"
#include "cpu/thread_pool.h"
#include "metrale/cpu_backend.h"
#include "metrale/host_module.h"
#include "metrale/op_cache.h"

namespace metrale {

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

  // The kernel a handle from resolve_kernel stands for; Error(kInvalidArgument) naming api
  // for a handle this backend did not resolve.
  const HostKernel& kernel_of(std::string_view api, KernelHandle k);
  // Runs every block of the grid on the pool; a block that throws fails the launch with
  // Error(kDeviceFault) naming the kernel and its launch shape.
  void run_grid(const HostKernel& k, const std::string& name, Dim3 grid, Dim3 block,
                std::uint32_t shared_bytes, void* const* params);
};

}  // namespace metrale
