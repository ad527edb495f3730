// Lazy buffers (docs/CONTRACT.md, lazy buffers): address space reserved once, whose base never
// moves (so a graph captured on it stays valid), with memory mapped forward on demand up to a
// byte budget. Made by Backend::reserve_lazy; the CPU backend backs one with mmap, the CUDA
// backend with the driver's virtual memory calls. Everything mapped is on the ledger (kind
// kLazy, one entry at the base whose size is the mapped bytes) with the reserving call site.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "metrale/handles.h"
#include "metrale/model_scope.h"

namespace metrale {

class Backend;

// What a backend provides behind a LazyBuffer: a reservation of granule multiples and the
// primitives that map into it. Backend code implements it; users never see one.
class LazyRegion {
 public:
  virtual ~LazyRegion() = default;
  // The first reserved address.
  virtual DevicePtr base() const noexcept = 0;
  // Makes [base + offset, base + offset + bytes) usable (both granule multiples, inside the
  // reservation, past what is mapped). On failure undoes whatever it did, then throws Error.
  virtual void map(std::size_t offset, std::size_t bytes) = 0;
  // Unmaps everything, releases the memory and frees the reservation, trying every step even
  // after a failure; throws the first failure. Called once (the caller has synchronized).
  virtual void release() = 0;
};

namespace detail {
struct LazyState;
}  // namespace detail

// A handle on one lazy buffer. Move-only; not thread-safe for one object, but two buffers of one
// backend may be used from different threads.
class LazyBuffer {
 public:
  // An empty handle (holds no reservation).
  LazyBuffer() noexcept;
  LazyBuffer(LazyBuffer&& other) noexcept;
  // Releases what this handle holds (quietly, as the destructor), then takes other's.
  LazyBuffer& operator=(LazyBuffer&& other) noexcept;
  LazyBuffer(const LazyBuffer&) = delete;
  LazyBuffer& operator=(const LazyBuffer&) = delete;
  // Releases the buffer if release() was not called; a failure is logged, never thrown.
  ~LazyBuffer();

  // Maps forward so that at least bytes from the base are usable (rounded up to granularity());
  // returns mapped_bytes(). Never unmaps: a smaller request returns the current size. Throws,
  // leaving the buffer as it was: Error(kOutOfMemory) past budget_bytes() or when mapping would
  // leave free device memory below METRALE_LAZY_FREE_FLOOR_MB; Error(kCapture) while any stream
  // of the backend captures; Error(kState) once released; the backend's Error when mapping fails.
  std::size_t grow(std::size_t bytes);
  // Synchronizes the device, unmaps, releases the memory and frees the reservation, trying
  // every step; throws the first failure (the buffer is released either way). A second call
  // throws Error(kState) naming LazyBuffer::release; nothing is freed twice.
  void release();

  // The first address; stable for the buffer's life (null for an empty handle).
  DevicePtr base() const noexcept;
  // Bytes from base() that are usable now (0 once released).
  std::size_t mapped_bytes() const noexcept;
  // The most grow() may map: the requested budget rounded down to a granule multiple.
  std::size_t budget_bytes() const noexcept;
  // The mapping unit of the backend (2 MiB on both backends today).
  std::size_t granularity() const noexcept;
  // The label given to reserve_lazy ("" for an empty handle).
  const std::string& label() const noexcept;
  // Whether this handle holds a reservation that is not yet released.
  bool live() const noexcept;

 private:
  friend class Backend;
  explicit LazyBuffer(std::shared_ptr<detail::LazyState> state) noexcept;
  std::shared_ptr<detail::LazyState> state_;
};

// A lazy buffer owned by a model: ModelScope teardown releases it (once).
class LazyBufferResource final : public ModelResource {
 public:
  explicit LazyBufferResource(LazyBuffer buffer) : buffer_(std::move(buffer)) {}
  // The buffer's label.
  std::string label() const override { return buffer_.label(); }
  // Releases the buffer; a second call does nothing.
  void release(Backend& backend) override;
  // The buffer, to grow and read.
  LazyBuffer& buffer() noexcept { return buffer_; }

 private:
  LazyBuffer buffer_;
};

}  // namespace metrale
