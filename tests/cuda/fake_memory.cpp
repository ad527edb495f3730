// The fake driver's memory: device, managed and mapped host allocations (real host memory, so
// bytes really move), copies, memsets and 2D copies.
#include "cuda/fake_state.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace metrale::cuda::testing::fake {

// The live block holding all of [p, p + bytes) (bytes > 0), or null.
const Alloc* find_range(const State& s, CUdeviceptr p, std::size_t bytes) {
  auto it = s.allocs.upper_bound(p);
  if (it == s.allocs.begin()) return nullptr;
  --it;
  const std::size_t offset = p - it->first;
  if (offset >= it->second.size || bytes > it->second.size - offset) return nullptr;
  return &it->second;
}

bool range_live(const State& s, CUdeviceptr p, std::size_t bytes) {
  return find_range(s, p, bytes) != nullptr || mapped_covers(s, p, bytes);
}

bool ranges_valid(const State& s, const MemOp& op) {
  for (const MemOp::Range& r : op.ranges) {
    if (r.bytes != 0 && !range_live(s, r.start, r.bytes)) return false;
  }
  return true;
}

// Real host memory, 256-byte aligned, filled with kFreshByte; 0 when the host is out.
CUdeviceptr allocate(State& s, std::size_t bytes, Kind kind, int device) {
  if (bytes > SIZE_MAX - kAlign) return 0;
  const std::size_t capacity = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, capacity == 0 ? kAlign : capacity);
  if (p == nullptr) return 0;
  std::memset(p, kFreshByte, capacity);
  s.allocs[to_dptr(p)] = Alloc{bytes, kind, device};
  return to_dptr(p);
}

// Frees the block based exactly at p if it is of kind k.
CUresult release(State& s, CUdeviceptr p, std::initializer_list<Kind> kinds) {
  auto it = s.allocs.find(p);
  if (it == s.allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  if (std::find(kinds.begin(), kinds.end(), it->second.kind) == kinds.end()) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::free(to_host(p));
  s.allocs.erase(it);
  return CUDA_SUCCESS;
}

std::size_t device_bytes(const State& s, int device) {
  std::size_t total = physical_bytes(s, device);
  for (const auto& [base, a] : s.allocs) {
    if (a.kind == Kind::kDevice && (device < 0 || a.device == device)) total += a.size;
  }
  return total;
}

std::size_t count_allocs(const State& s, std::initializer_list<Kind> kinds) {
  std::size_t n = 0;
  for (const auto& [base, a] : s.allocs) {
    n += std::find(kinds.begin(), kinds.end(), a.kind) != kinds.end() ? 1 : 0;
  }
  return n;
}

MemOp copy_op(void* dst, const void* src, std::size_t n, std::vector<MemOp::Range> ranges) {
  return MemOp{std::move(ranges), [=] {
                 if (n != 0) std::memmove(dst, src, n);  // either may be null when n is 0
               }};
}

CUresult fake_cuMemAlloc(CUdeviceptr* dptr, std::size_t bytes) {
  FAKE_ENTER(Need::kContext);
  if (const CUresult c = refuse_unsafe_in_capture(s); c != CUDA_SUCCESS) return c;
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  const int dev = current_device(s);
  const std::size_t used = device_bytes(s, dev);
  if (bytes > s.devices[dev].total_memory - used) return CUDA_ERROR_OUT_OF_MEMORY;
  const CUdeviceptr p = allocate(s, bytes, Kind::kDevice, dev);
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *dptr = p;
  return CUDA_SUCCESS;
}

// Managed memory is not counted against total_memory (it can oversubscribe).
CUresult fake_cuMemAllocManaged(CUdeviceptr* dptr, std::size_t bytes, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (const CUresult c = refuse_unsafe_in_capture(s); c != CUDA_SUCCESS) return c;
  if (dptr == nullptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
  if (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const int dev = current_device(s);
  if (!s.devices[dev].managed_memory) return CUDA_ERROR_NOT_SUPPORTED;
  const CUdeviceptr p = allocate(s, bytes, Kind::kManaged, dev);
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *dptr = p;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemFree(CUdeviceptr dptr) {
  FAKE_ENTER(Need::kContext);
  if (const CUresult c = refuse_unsafe_in_capture(s); c != CUDA_SUCCESS) return c;
  return release(s, dptr, {Kind::kDevice, Kind::kManaged});
}

CUresult fake_cuMemHostAlloc(void** pp, std::size_t bytes, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (const CUresult c = refuse_unsafe_in_capture(s); c != CUDA_SUCCESS) return c;
  const unsigned known =
      CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED;
  if (pp == nullptr || bytes == 0 || (flags & ~known) != 0) return CUDA_ERROR_INVALID_VALUE;
  const CUdeviceptr p = allocate(s, bytes, Kind::kHost, current_device(s));
  if (p == 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *pp = to_host(p);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemFreeHost(void* p) {
  FAKE_ENTER(Need::kContext);
  if (const CUresult c = refuse_unsafe_in_capture(s); c != CUDA_SUCCESS) return c;
  return release(s, to_dptr(p), {Kind::kHost});
}

// Mapped host memory has the same address on both sides (unified addressing).
CUresult fake_cuMemHostGetDevicePointer(CUdeviceptr* dptr, void* p, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (dptr == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  const Alloc* a = find_range(s, to_dptr(p), 1);
  if (a == nullptr || a->kind != Kind::kHost) return CUDA_ERROR_INVALID_VALUE;
  *dptr = to_dptr(p);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetInfo(std::size_t* free_bytes, std::size_t* total_bytes) {
  FAKE_ENTER(Need::kContext);
  if (free_bytes == nullptr || total_bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const int dev = current_device(s);
  *total_bytes = s.devices[dev].total_memory;
  *free_bytes = *total_bytes - device_bytes(s, dev);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemcpyHtoDAsync(CUdeviceptr dst, const void* src, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  if (src == nullptr && n != 0) return CUDA_ERROR_INVALID_VALUE;
  return submit(s, st, copy_op(to_host(dst), src, n, {{dst, n}}), false);
}

CUresult fake_cuMemcpyDtoHAsync(void* dst, CUdeviceptr src, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  if (dst == nullptr && n != 0) return CUDA_ERROR_INVALID_VALUE;
  return submit(s, st, copy_op(dst, to_host(src), n, {{src, n}}), true);
}

CUresult fake_cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  return submit(s, st, copy_op(to_host(dst), to_host(src), n, {{dst, n}, {src, n}}), false);
}

CUresult fake_cuMemsetD8Async(CUdeviceptr dst, unsigned char value, std::size_t n, CUstream st) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  MemOp op{{{dst, n}}, [=] {
             if (n != 0) std::memset(to_host(dst), value, n);
           }};
  return submit(s, st, std::move(op), false);
}

// One side of a 2D copy: its first byte, and the device range it spans (empty for host).
struct Side {
  char* first = nullptr;
  MemOp::Range range;
};

// Host and device (or unified, taken as device) memory; arrays are not supported.
bool copy_side(CUmemorytype type, const void* host, CUdeviceptr dev, std::size_t x, std::size_t y,
               std::size_t pitch, const CUDA_MEMCPY2D& c, Side& out) {
  const std::size_t offset = y * pitch + x;
  const std::size_t span = c.Height == 0 ? 0 : (c.Height - 1) * pitch + c.WidthInBytes;
  if (type == CU_MEMORYTYPE_HOST) {
    if (host == nullptr) return false;
    out.first = static_cast<char*>(const_cast<void*>(host)) + offset;
    return true;
  }
  if (type != CU_MEMORYTYPE_DEVICE && type != CU_MEMORYTYPE_UNIFIED) return false;
  out.first = static_cast<char*>(to_host(dev)) + offset;
  out.range = {dev + offset, span};
  return true;
}

CUresult fake_cuMemcpy2DAsync(const CUDA_MEMCPY2D* c, CUstream stream) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  if (c == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (c->WidthInBytes == 0 || c->Height == 0) return CUDA_SUCCESS;
  if (c->Height > 1 && (c->srcPitch < c->WidthInBytes || c->dstPitch < c->WidthInBytes)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  Side src, dst;
  if (!copy_side(c->srcMemoryType, c->srcHost, c->srcDevice, c->srcXInBytes, c->srcY, c->srcPitch,
                 *c, src) ||
      !copy_side(c->dstMemoryType, c->dstHost, c->dstDevice, c->dstXInBytes, c->dstY, c->dstPitch,
                 *c, dst)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const std::size_t width = c->WidthInBytes, height = c->Height;
  const std::size_t sp = c->srcPitch, dp = c->dstPitch;
  MemOp op{{src.range, dst.range}, [=] {
             for (std::size_t row = 0; row < height; ++row) {
               std::memmove(dst.first + row * dp, src.first + row * sp, width);
             }
           }};
  return submit(s, stream, std::move(op), c->dstMemoryType == CU_MEMORYTYPE_HOST);
}

}  // namespace metrale::cuda::testing::fake
