// Kernel arguments and their packing into 64-bit slots (docs/CONTRACT.md, kernel arguments): a
// buffer takes one slot; a byte blob takes ceil(len/8) slots, zero padded; each argument gets one
// parameter pointer to its first slot. The packed form is what an untyped launch takes on every
// backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>
#include <variant>
#include <vector>

#include "metrale/handles.h"

namespace metrale {

// One kernel argument: a device buffer or a small trivially-copyable value as bytes.
class KernelArg {
 public:
  // A device buffer argument (one slot holding the address).
  static KernelArg buffer(DevicePtr ptr) { return KernelArg(ptr); }

  // A by-value argument; T must be trivially copyable (ints, floats, small structs).
  template <class T>
  static KernelArg value(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel arguments are copied as bytes");
    std::vector<std::byte> bytes(sizeof(T));
    std::memcpy(bytes.data(), &v, sizeof(T));
    return KernelArg(std::move(bytes));
  }

  // True for a buffer argument.
  bool is_buffer() const noexcept { return std::holds_alternative<DevicePtr>(data_); }
  // The buffer; only meaningful when is_buffer().
  DevicePtr ptr() const noexcept { return is_buffer() ? std::get<DevicePtr>(data_) : DevicePtr{}; }
  // The blob bytes; empty for a buffer.
  std::span<const std::byte> bytes() const noexcept;

 private:
  explicit KernelArg(DevicePtr p) : data_(p) {}
  explicit KernelArg(std::vector<std::byte> b) : data_(std::move(b)) {}
  std::variant<DevicePtr, std::vector<std::byte>> data_;
};

// Arguments packed for an untyped launch. Move-only in spirit: params() points into slots().
class PackedArgs {
 public:
  // Packs args into 64-bit slots and builds one parameter pointer per argument.
  explicit PackedArgs(std::span<const KernelArg> args);
  PackedArgs(const PackedArgs&) = delete;
  PackedArgs& operator=(const PackedArgs&) = delete;

  // One pointer per argument, each to the argument's first slot (cuLaunchKernel's layout).
  void** params() noexcept { return params_.data(); }
  // Number of arguments.
  std::size_t count() const noexcept { return params_.size(); }
  // The slots themselves, for inspection and tests.
  std::span<const std::uint64_t> slots() const noexcept { return slots_; }

 private:
  std::vector<std::uint64_t> slots_;
  std::vector<void*> params_;
};

// Reads parameter `index` of an untyped launch as T (host kernels use this to unpack).
template <class T>
T read_param(void* const* params, std::size_t index) {
  static_assert(std::is_trivially_copyable_v<T>);
  T out;
  std::memcpy(&out, params[index], sizeof(T));
  return out;
}

}  // namespace metrale
