// The CPU backend's table of host blocks: every allocation with its user size and capacity, so
// each API access is bounds-checked and a bad pointer gets a precise message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "metrale/handles.h"
#include "metrale/ledger.h"

namespace metrale::cpu {

inline constexpr std::size_t kHostAlignment = 256;              // matches cuMemAlloc's guarantee
inline constexpr std::size_t kHugePage = std::size_t{2} << 20;  // x86-64 transparent huge page
inline constexpr std::size_t kHugeBlockMin = std::size_t{8} << 20;  // blocks this large use them

class HostMemory {
 public:
  HostMemory() = default;
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  // Frees anything still allocated (the backend sweeps first; this is a last resort).
  ~HostMemory();

  // Allocates user_bytes + pad_bytes, 256-byte aligned; nullptr when the system has no memory.
  void* allocate(std::size_t user_bytes, std::size_t pad_bytes, MemoryKind kind);
  // Frees a block start; throws Error(kInvalidArgument) naming api when ptr is not one.
  void release(std::string_view api, std::uint64_t ptr);
  // Throws naming api unless [ptr, ptr + bytes) lies inside one block's user bytes.
  void check_range(std::string_view api, std::string_view what, std::uint64_t ptr,
                   std::size_t bytes) const;
  // Throws naming api unless ptr lies inside a pinned block (interior allowed).
  void check_pinned(std::string_view api, std::uint64_t ptr) const;
  // Whether [ptr, ptr + bytes) lies inside a pinned block.
  bool is_pinned(std::uint64_t ptr, std::size_t bytes) const;
  // Adds a lazy reservation of capacity bytes at ptr with nothing usable yet; the reservation
  // itself belongs to the caller (cpu/lazy_buffer.cpp), never freed here.
  void add_lazy(std::uint64_t ptr, std::size_t capacity);
  // Sets how many bytes of the lazy reservation at ptr are usable.
  void set_lazy_usable(std::uint64_t ptr, std::size_t bytes);
  // Takes the lazy reservation at ptr off the table.
  void remove_lazy(std::uint64_t ptr);
  // Adds bytes at ptr that another owner lent (Backend::borrow): checked like a block, never
  // freed here.
  void add_borrowed(std::uint64_t ptr, std::size_t bytes);
  // Takes the borrowed range at ptr off the table.
  void remove_borrowed(std::uint64_t ptr);
  // Words explaining where ptr falls ("an interior pointer, 64 bytes into ...").
  std::string describe(std::uint64_t ptr) const;

 private:
  struct Block {
    std::size_t user_bytes = 0;
    std::size_t capacity = 0;
    // kLazy: a reservation, kBorrowed: another owner's memory; neither from aligned_alloc.
    MemoryKind kind = MemoryKind::kDevice;
  };
  // The block containing ptr (within capacity), or end().
  std::map<std::uint64_t, Block>::const_iterator containing(std::uint64_t ptr) const;

  mutable std::mutex mu_;
  std::map<std::uint64_t, Block> blocks_;
};

}  // namespace metrale::cpu
