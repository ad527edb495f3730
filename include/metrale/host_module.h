// Host modules: the CPU backend's equivalent of a GPU kernel module. A module has kernels
// (host functions run once per grid block) and published symbols (byte globals such as
// "<entry>_n_tile"), so lookup, metadata, grid sizing and launch behave as on a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/handles.h"

namespace metrale {

// What one invocation of a host kernel sees: the launch shape, its own block, its parameters
// (one pointer per argument, as cuLaunchKernel passes them) and a per-block shared buffer.
struct HostBlock {
  Dim3 grid, block, block_idx;
  std::uint32_t shared_bytes = 0;
  std::byte* shared = nullptr;  // shared_bytes of scratch private to this block
  void* const* params = nullptr;
};

// A kernel body: runs one grid block. Blocks may run concurrently on different threads and
// must write disjoint outputs, as on a GPU.
using HostKernelFn = void (*)(const HostBlock&);

struct HostKernel {
  std::string name;
  HostKernelFn fn = nullptr;
  std::vector<std::uint16_t> param_sizes;  // bytes of each parameter, for capture and checks
};

class HostModule {
 public:
  explicit HostModule(std::string name) : name_(std::move(name)) {}

  // Adds a kernel taking parameters of the given sizes in bytes.
  HostModule& add_kernel(std::string name, HostKernelFn fn,
                         std::initializer_list<std::uint16_t> param_sizes);
  // Publishes a global symbol with the given bytes (replaces an earlier one of that name).
  HostModule& publish(std::string symbol, std::vector<std::byte> bytes);
  // Publishes a 4-byte little-endian unsigned global, like `__device__ uint32_t x = v;`.
  HostModule& publish_u32(std::string symbol, std::uint32_t value);

  // The module name ("core", "w4a16").
  const std::string& name() const noexcept { return name_; }
  // The kernel of that name, or null.
  const HostKernel* find_kernel(std::string_view name) const;
  // The bytes of a published symbol, or null when it does not exist.
  const std::vector<std::byte>* find_symbol(std::string_view name) const;
  // Every kernel, in the order added.
  const std::vector<HostKernel>& kernels() const noexcept { return kernels_; }

 private:
  std::string name_;
  std::vector<HostKernel> kernels_;
  std::map<std::string, std::vector<std::byte>, std::less<>> symbols_;
};

// The modules every CPU backend loads by default (mirroring the GPU module names).
std::vector<HostModule> builtin_host_modules();

}  // namespace metrale
