// The fake driver's virtual memory, with the driver's rules: a reservation is address space
// (host pages with no access) and not memory; cuMemCreate makes a physical allocation of
// granule multiples, counted against the device's memory; cuMemMap puts one at a granule-aligned
// place inside one reservation, never over another mapping; the memory is usable only once
// cuMemSetAccess made it read/write; a handle released while mapped lives until unmapped; a
// reservation is freed whole and only once nothing is mapped in it. Mapping is refused while any
// stream captures (what metrale's lazy buffers promise never to do). Each physical allocation is
// mapped at most once here: its bytes live at the address it is mapped at.
#include <sys/mman.h>

#include <iterator>

#include "cuda/fake_state.h"

namespace metrale::cuda::testing::fake {

namespace {

bool aligned(std::size_t v) {
  return v % kVmmGranule == 0;
}

// The reservation holding all of [p, p + bytes), or end().
std::map<CUdeviceptr, Reservation>::const_iterator reservation_of(const State& s, CUdeviceptr p,
                                                                  std::size_t bytes) {
  auto it = s.reservations.upper_bound(p);
  if (it == s.reservations.begin()) return s.reservations.end();
  --it;
  const std::size_t offset = p - it->first;
  if (offset >= it->second.size || bytes > it->second.size - offset) return s.reservations.end();
  return it;
}

// Whether any mapping overlaps [p, p + bytes).
bool overlaps_mapping(const State& s, CUdeviceptr p, std::size_t bytes) {
  auto it = s.mappings.lower_bound(p);
  if (it != s.mappings.end() && it->first < p + bytes) return true;
  if (it == s.mappings.begin()) return false;
  --it;
  return it->first + it->second.size > p;
}

// Visits the mappings that tile [p, p + bytes) exactly, in order; false (visiting nothing) when
// they do not: a gap, or a mapping that sticks out at either end.
template <class F>
bool for_each_tiling(State& s, CUdeviceptr p, std::size_t bytes, F f) {
  std::vector<std::map<CUdeviceptr, Mapping>::iterator> tiles;
  CUdeviceptr at = p;
  for (auto it = s.mappings.find(p); at < p + bytes; ++it) {
    if (it == s.mappings.end() || it->first != at || it->second.size > p + bytes - at) {
      return false;
    }
    tiles.push_back(it);
    at += it->second.size;
  }
  for (auto it : tiles) f(it);
  return true;
}

bool location_valid(const State& s, const CUmemLocation& loc) {
  return loc.type == CU_MEM_LOCATION_TYPE_DEVICE && loc.id >= 0 &&
         static_cast<std::size_t>(loc.id) < s.devices.size();
}

CUresult check_prop(const State& s, const CUmemAllocationProp* prop) {
  if (prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  return location_valid(s, prop->location) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

void* host(CUdeviceptr p) {
  return to_host(p);
}

}  // namespace

bool mapped_covers(const State& s, CUdeviceptr p, std::size_t bytes) {
  auto it = s.mappings.upper_bound(p);
  if (it == s.mappings.begin()) return false;
  --it;
  CUdeviceptr at = p;
  const CUdeviceptr end = p + bytes;
  while (it != s.mappings.end() && it->first <= at && at < it->first + it->second.size) {
    if (!it->second.accessible) return false;
    at = it->first + it->second.size;
    if (at >= end) return true;
    ++it;
  }
  return false;
}

std::size_t physical_bytes(const State& s, int device) {
  std::size_t total = 0;
  for (const auto& [h, ph] : s.physical) {
    if (device < 0 || ph.device == device) total += ph.size;
  }
  return total;
}

void drop_reservations(State& s) noexcept {
  for (const auto& [base, r] : s.reservations) ::munmap(host(base), r.size);
  s.reservations.clear();
}

CUresult fake_cuMemGetAllocationGranularity(std::size_t* granularity,
                                            const CUmemAllocationProp* prop,
                                            CUmemAllocationGranularity_flags option) {
  FAKE_ENTER(Need::kInit);
  if (granularity == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (const CUresult r = check_prop(s, prop); r != CUDA_SUCCESS) return r;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
      option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *granularity = kVmmGranule;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                                  CUdeviceptr addr, unsigned long long flags) {
  FAKE_ENTER(Need::kContext);
  (void)addr;  // a hint the driver may ignore; so does the fake
  if (ptr == nullptr || size == 0 || !aligned(size) || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  if (alignment == 0) alignment = kVmmGranule;
  if (!aligned(alignment) || (alignment & (alignment - 1)) != 0) return CUDA_ERROR_INVALID_VALUE;
  const std::size_t span = size + alignment;
  void* p = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUdeviceptr raw = to_dptr(p);
  const CUdeviceptr base = (raw + alignment - 1) / alignment * alignment;
  if (base > raw) ::munmap(p, base - raw);
  if (raw + span > base + size) ::munmap(host(base + size), raw + span - (base + size));
  s.reservations[base] = Reservation{size};
  *ptr = base;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressFree(CUdeviceptr ptr, std::size_t size) {
  FAKE_ENTER(Need::kContext);
  const auto it = s.reservations.find(ptr);
  if (it == s.reservations.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  if (overlaps_mapping(s, ptr, size)) return CUDA_ERROR_INVALID_VALUE;  // unmap first
  ::munmap(host(ptr), size);
  s.reservations.erase(it);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* handle, std::size_t size,
                          const CUmemAllocationProp* prop, unsigned long long flags) {
  FAKE_ENTER(Need::kContext);
  if (handle == nullptr || size == 0 || !aligned(size) || flags != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (const CUresult r = check_prop(s, prop); r != CUDA_SUCCESS) return r;
  const int dev = prop->location.id;
  if (size > s.devices[dev].total_memory - device_bytes(s, dev)) return CUDA_ERROR_OUT_OF_MEMORY;
  s.next_handle += 16;
  const CUmemGenericAllocationHandle h = s.next_handle;
  s.physical[h] = Physical{size, dev, false, 0};
  *handle = h;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemRelease(CUmemGenericAllocationHandle handle) {
  FAKE_ENTER(Need::kContext);
  const auto it = s.physical.find(handle);
  if (it == s.physical.end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  it->second.released = true;
  if (it->second.mappings == 0) s.physical.erase(it);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemMap(CUdeviceptr ptr, std::size_t size, std::size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags) {
  FAKE_ENTER(Need::kContext);
  if (size == 0 || !aligned(ptr) || !aligned(size) || !aligned(offset) || flags != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const auto ph = s.physical.find(handle);
  if (ph == s.physical.end() || ph->second.released) return CUDA_ERROR_INVALID_HANDLE;
  if (offset > ph->second.size || size > ph->second.size - offset) return CUDA_ERROR_INVALID_VALUE;
  if (ph->second.mappings > 0) return CUDA_ERROR_NOT_SUPPORTED;  // the fake maps a handle once
  if (reservation_of(s, ptr, size) == s.reservations.end()) return CUDA_ERROR_INVALID_VALUE;
  if (overlaps_mapping(s, ptr, size)) return CUDA_ERROR_INVALID_VALUE;
  for (const auto& [h, st] : s.streams) {
    if (st.capture != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  s.mappings[ptr] = Mapping{size, handle, false};
  ph->second.mappings += 1;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemUnmap(CUdeviceptr ptr, std::size_t size) {
  FAKE_ENTER(Need::kContext);
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  std::vector<CUdeviceptr> gone;
  if (!for_each_tiling(s, ptr, size, [&](auto it) { gone.push_back(it->first); })) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (const CUdeviceptr at : gone) {
    const auto it = s.mappings.find(at);
    // The pages go back to no access, their bytes dropped: memory gone, address space kept.
    ::madvise(host(at), it->second.size, MADV_DONTNEED);
    ::mprotect(host(at), it->second.size, PROT_NONE);
    const auto ph = s.physical.find(it->second.handle);
    if (ph != s.physical.end() && --ph->second.mappings == 0 && ph->second.released) {
      s.physical.erase(ph);
    }
    s.mappings.erase(it);
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemSetAccess(CUdeviceptr ptr, std::size_t size, const CUmemAccessDesc* desc,
                             std::size_t count) {
  FAKE_ENTER(Need::kContext);
  if (desc == nullptr || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
  int prot = PROT_NONE;
  for (std::size_t i = 0; i < count; ++i) {
    if (!location_valid(s, desc[i].location)) return CUDA_ERROR_INVALID_DEVICE;
    switch (desc[i].flags) {
      case CU_MEM_ACCESS_FLAGS_PROT_READWRITE:
        prot = PROT_READ | PROT_WRITE;
        break;
      case CU_MEM_ACCESS_FLAGS_PROT_READ:
        if (prot == PROT_NONE) prot = PROT_READ;
        break;
      case CU_MEM_ACCESS_FLAGS_PROT_NONE:
        break;
      default:
        return CUDA_ERROR_INVALID_VALUE;
    }
  }
  std::vector<Mapping*> tiles;
  if (!for_each_tiling(s, ptr, size, [&](auto it) { tiles.push_back(&it->second); })) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (::mprotect(host(ptr), size, prot) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  for (Mapping* m : tiles) m->accessible = (prot & PROT_WRITE) != 0;
  return CUDA_SUCCESS;
}

}  // namespace metrale::cuda::testing::fake
