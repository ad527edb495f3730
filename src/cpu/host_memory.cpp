#include "cpu/host_memory.h"

#include <fmt/format.h>

#include <sys/mman.h>

#include <cstdlib>

#include "metrale/error.h"

namespace metrale::cpu {

HostMemory::~HostMemory() {
  for (const auto& [ptr, b] : blocks_) {
    if (b.kind != MemoryKind::kLazy && b.kind != MemoryKind::kBorrowed) {
      std::free(reinterpret_cast<void*>(ptr));
    }
  }
}

void* HostMemory::allocate(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind) {
  const std::size_t total = user_bytes + pad_bytes;
  if (total < user_bytes || total > SIZE_MAX - kHostAlignment) return nullptr;
  // Large blocks (weights) start on a 2 MiB boundary and ask for transparent huge pages: a GEMV
  // streams them once, and with 4 KiB pages every 4 KiB of weights costs a page walk (the kernel
  // treats the advice as optional, so failure changes nothing but speed).
  const std::size_t align = total >= kHugeBlockMin ? kHugePage : kHostAlignment;
  if (total > SIZE_MAX - align) return nullptr;
  const std::size_t rounded = (total + align - 1) / align * align;
  void* p = std::aligned_alloc(align, rounded);
  if (p == nullptr) return nullptr;
  if (align == kHugePage) ::madvise(p, rounded, MADV_HUGEPAGE);
  std::lock_guard lock(mu_);
  blocks_[reinterpret_cast<std::uintptr_t>(p)] = Block{user_bytes, total, kind};
  return p;
}

void HostMemory::release(std::string_view api, std::uint64_t ptr) {
  {
    std::lock_guard lock(mu_);
    const auto it = blocks_.find(ptr);
    if (it != blocks_.end() && it->second.kind != MemoryKind::kLazy &&
        it->second.kind != MemoryKind::kBorrowed) {
      blocks_.erase(it);
      std::free(reinterpret_cast<void*>(ptr));
      return;
    }
  }
  throw Error(
      ErrorCode::kInvalidArgument, api,
      fmt::format("0x{:x} is not an allocation of the cpu backend: {}", ptr, describe(ptr)));
}

std::map<std::uint64_t, HostMemory::Block>::const_iterator HostMemory::containing(
    std::uint64_t ptr) const {
  auto it = blocks_.upper_bound(ptr);
  if (it == blocks_.begin()) return blocks_.end();
  --it;
  return ptr < it->first + it->second.capacity ? it : blocks_.end();
}

void HostMemory::check_range(std::string_view api, std::string_view what, std::uint64_t ptr,
                             std::size_t bytes) const {
  std::lock_guard lock(mu_);
  const auto it = containing(ptr);
  if (it == blocks_.end()) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("{} 0x{:x} is not inside any allocation of the cpu backend", what, ptr));
  }
  const std::uint64_t end = it->first + it->second.user_bytes;
  if (ptr >= end || bytes > end - ptr) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} 0x{:x} + {} bytes overruns the allocation at 0x{:x} ({} bytes) by "
                            "{} bytes",
                            what, ptr, bytes, it->first, it->second.user_bytes, ptr + bytes - end));
  }
}

void HostMemory::add_borrowed(std::uint64_t ptr, std::size_t bytes) {
  std::lock_guard lock(mu_);
  blocks_[ptr] = Block{bytes, bytes, MemoryKind::kBorrowed};
}

void HostMemory::remove_borrowed(std::uint64_t ptr) {
  std::lock_guard lock(mu_);
  const auto it = blocks_.find(ptr);
  if (it != blocks_.end() && it->second.kind == MemoryKind::kBorrowed) blocks_.erase(it);
}

void HostMemory::add_lazy(std::uint64_t ptr, std::size_t capacity) {
  std::lock_guard lock(mu_);
  blocks_[ptr] = Block{0, capacity, MemoryKind::kLazy};
}

void HostMemory::set_lazy_usable(std::uint64_t ptr, std::size_t bytes) {
  std::lock_guard lock(mu_);
  const auto it = blocks_.find(ptr);
  if (it != blocks_.end() && it->second.kind == MemoryKind::kLazy) it->second.user_bytes = bytes;
}

void HostMemory::remove_lazy(std::uint64_t ptr) {
  std::lock_guard lock(mu_);
  const auto it = blocks_.find(ptr);
  if (it != blocks_.end() && it->second.kind == MemoryKind::kLazy) blocks_.erase(it);
}

bool HostMemory::is_pinned(std::uint64_t ptr, std::size_t bytes) const {
  std::lock_guard lock(mu_);
  const auto it = containing(ptr);
  return it != blocks_.end() && it->second.kind == MemoryKind::kPinnedHost &&
         ptr + bytes <= it->first + it->second.user_bytes;
}

void HostMemory::check_pinned(std::string_view api, std::uint64_t ptr) const {
  if (!is_pinned(ptr, 0)) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("0x{:x} is not inside a pinned host allocation of the cpu backend", ptr));
  }
}

std::string HostMemory::describe(std::uint64_t ptr) const {
  std::lock_guard lock(mu_);
  const auto it = containing(ptr);
  if (it == blocks_.end()) return "never allocated here, or already freed";
  return fmt::format("an interior pointer, {} bytes into the allocation at 0x{:x}", ptr - it->first,
                     it->first);
}

}  // namespace metrale::cpu
