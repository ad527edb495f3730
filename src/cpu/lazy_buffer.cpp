// The CPU backend's lazy buffers on mmap: the reservation is address space with no access
// (PROT_NONE, MAP_NORESERVE: no memory is committed), a granule is committed by mprotect to
// read/write, release is one munmap. Granules are 2 MiB, the CUDA granularity on every current
// GPU, so a budget or a pool built on a lazy buffer rounds alike on both backends; 2 MiB is also
// the transparent huge page, which the reservation is aligned to and advised for.
#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "cpu/backend_impl.h"
#include "metrale/error.h"

namespace metrale {
namespace {

constexpr std::size_t kGranule = cpu::kHugePage;

std::string os_error(int err) {
  return fmt::format("{} (errno {})", std::strerror(err), err);
}

class CpuLazyRegion final : public LazyRegion {
 public:
  CpuLazyRegion(cpu::HostMemory& memory, cpu::FaultInjector& faults, std::size_t bytes)
      : memory_(memory), faults_(faults), bytes_(bytes) {
    faults_.point("lazy_reserve");
    // Over-reserve by one granule and trim, so the base is granule-aligned.
    const std::size_t span = bytes + kGranule;
    void* p = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(
          ErrorCode::kOutOfMemory, "reserve_lazy",
          fmt::format("mmap of {} bytes of address space failed: {}", span, os_error(errno)));
    }
    const auto raw = reinterpret_cast<std::uintptr_t>(p);
    const std::uintptr_t base = (raw + kGranule - 1) / kGranule * kGranule;
    if (base > raw) ::munmap(p, base - raw);
    if (const std::size_t tail = raw + span - (base + bytes); tail > 0) {
      ::munmap(reinterpret_cast<void*>(base + bytes), tail);
    }
    base_ = base;
    memory_.add_lazy(base_, bytes_);
  }
  ~CpuLazyRegion() override {
    if (base_ != 0) {  // never released (a failure between reserve and the handle)
      memory_.remove_lazy(base_);
      ::munmap(reinterpret_cast<void*>(base_), bytes_);
    }
  }

  DevicePtr base() const noexcept override { return DevicePtr{base_}; }

  // Commits granule by granule (a fault point before each), so an injected failure at any
  // granule of a multi-granule growth leaves the earlier ones committed for the undo to take back.
  void map(std::size_t offset, std::size_t bytes) override {
    std::size_t done = 0;
    try {
      for (; done < bytes; done += kGranule) {
        faults_.point("lazy_commit");
        void* at = reinterpret_cast<void*>(base_ + offset + done);
        if (::mprotect(at, kGranule, PROT_READ | PROT_WRITE) != 0) {
          throw Error(ErrorCode::kOutOfMemory, "LazyBuffer::grow",
                      fmt::format("mprotect of {} bytes at 0x{:x} failed: {}", kGranule,
                                  base_ + offset + done, os_error(errno)));
        }
      }
    } catch (...) {
      decommit(offset, done);
      throw;
    }
    // Advice only: failure changes nothing but speed.
    ::madvise(reinterpret_cast<void*>(base_ + offset), bytes, MADV_HUGEPAGE);
    memory_.set_lazy_usable(base_, offset + bytes);
  }

  void release() override {
    memory_.remove_lazy(base_);
    const std::uintptr_t base = std::exchange(base_, 0);
    if (::munmap(reinterpret_cast<void*>(base), bytes_) != 0) {
      throw Error(
          ErrorCode::kDriver, "LazyBuffer::release",
          fmt::format("munmap of {} bytes at 0x{:x} failed: {}", bytes_, base, os_error(errno)));
    }
  }

 private:
  // Takes committed granules back: their pages are dropped and access removed again.
  void decommit(std::size_t offset, std::size_t bytes) noexcept {
    if (bytes == 0) return;
    void* at = reinterpret_cast<void*>(base_ + offset);
    ::madvise(at, bytes, MADV_DONTNEED);
    ::mprotect(at, bytes, PROT_NONE);
  }

  cpu::HostMemory& memory_;
  cpu::FaultInjector& faults_;
  std::size_t bytes_;
  std::uintptr_t base_ = 0;
};

}  // namespace

std::size_t CpuBackend::lazy_granularity() {
  return kGranule;
}

std::unique_ptr<LazyRegion> CpuBackend::raw_reserve_lazy(std::size_t bytes, std::size_t) {
  return std::make_unique<CpuLazyRegion>(impl_->memory, impl_->faults, bytes);
}

bool CpuBackend::capture_in_progress() {
  return impl_->streams.capturing_stream() != 0;
}

}  // namespace metrale
