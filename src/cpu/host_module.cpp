#include "metrale/host_module.h"

#include <cstring>

namespace metrale {

HostModule& HostModule::add_kernel(std::string name, HostKernelFn fn,
                                   std::initializer_list<std::uint16_t> param_sizes) {
  kernels_.push_back(HostKernel{std::move(name), fn, param_sizes});
  return *this;
}

HostModule& HostModule::publish(std::string symbol, std::vector<std::byte> bytes) {
  symbols_[std::move(symbol)] = std::move(bytes);
  return *this;
}

HostModule& HostModule::publish_u32(std::string symbol, std::uint32_t value) {
  std::vector<std::byte> bytes(sizeof value);
  std::memcpy(bytes.data(), &value, sizeof value);
  return publish(std::move(symbol), std::move(bytes));
}

const HostKernel* HostModule::find_kernel(std::string_view name) const {
  for (const HostKernel& k : kernels_) {
    if (k.name == name) return &k;
  }
  return nullptr;
}

const std::vector<std::byte>* HostModule::find_symbol(std::string_view name) const {
  const auto it = symbols_.find(name);
  return it == symbols_.end() ? nullptr : &it->second;
}

}  // namespace metrale
