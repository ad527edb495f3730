// Opaque handles of the backend interface. Each is a distinct type around a 64-bit value, so a
// stream cannot be passed where an event is expected. Zero is the null value of every handle.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace metrale {

// A device address. On the CPU backend it is a host address; on CUDA a CUdeviceptr.
class DevicePtr {
 public:
  constexpr DevicePtr() = default;
  constexpr explicit DevicePtr(std::uint64_t address) : address_(address) {}

  // The raw address; 0 means null.
  constexpr std::uint64_t address() const noexcept { return address_; }
  // True unless null.
  constexpr explicit operator bool() const noexcept { return address_ != 0; }
  // The address `bytes` further on; offsetting null stays null so a bad pointer is never made.
  constexpr DevicePtr offset(std::uint64_t bytes) const noexcept {
    return address_ == 0 ? DevicePtr{} : DevicePtr{address_ + bytes};
  }
  friend constexpr auto operator<=>(DevicePtr, DevicePtr) = default;

 private:
  std::uint64_t address_ = 0;
};

// A typed opaque handle; Tag only makes each instantiation a different type.
template <class Tag>
class Handle {
 public:
  constexpr Handle() = default;
  constexpr explicit Handle(std::uint64_t value) : value_(value) {}

  // The raw value; 0 means null.
  constexpr std::uint64_t value() const noexcept { return value_; }
  // True unless null.
  constexpr explicit operator bool() const noexcept { return value_ != 0; }
  friend constexpr auto operator<=>(Handle, Handle) = default;

 private:
  std::uint64_t value_ = 0;
};

struct KernelTag;
struct StreamTag;
struct EventTag;
struct GraphTag;

using KernelHandle = Handle<KernelTag>;  // a resolved kernel function of a loaded module
using StreamHandle = Handle<StreamTag>;  // an in-order queue of work
using EventHandle = Handle<EventTag>;    // a marker recorded on a stream
using GraphHandle = Handle<GraphTag>;    // an instantiated, replayable capture

// Three-dimensional launch extent, as in CUDA.
struct Dim3 {
  std::uint32_t x = 1, y = 1, z = 1;
  // Number of points covered (x * y * z).
  constexpr std::uint64_t volume() const noexcept {
    return std::uint64_t{x} * std::uint64_t{y} * std::uint64_t{z};
  }
  friend constexpr bool operator==(Dim3, Dim3) = default;
};

}  // namespace metrale

template <>
struct std::hash<metrale::DevicePtr> {
  std::size_t operator()(metrale::DevicePtr p) const noexcept {
    return std::hash<std::uint64_t>{}(p.address());
  }
};

template <class Tag>
struct std::hash<metrale::Handle<Tag>> {
  std::size_t operator()(metrale::Handle<Tag> h) const noexcept {
    return std::hash<std::uint64_t>{}(h.value());
  }
};
