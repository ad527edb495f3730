// The CUDA backend's lazy buffers on the driver's virtual memory calls: the reservation is
// cuMemAddressReserve, each growth one physical allocation (cuMemCreate, pinned on the device)
// mapped at the end of what is mapped (cuMemMap) and made read/write for the device
// (cuMemSetAccess); release unmaps and releases every piece, then frees the reservation. The
// granularity is the driver's minimum for such an allocation (2 MiB on every current GPU).
#include <fmt/format.h>

#include <vector>

#include "core/log.h"
#include "cuda/backend.h"
#include "cuda/status.h"
#include "metrale/error.h"

namespace metrale {
namespace {

CUmemAllocationProp device_prop(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  return prop;
}

class CudaLazyRegion final : public LazyRegion {
 public:
  CudaLazyRegion(std::shared_ptr<cuda::CudaHost> host, std::size_t bytes, std::size_t granularity)
      : host_(std::move(host)), bytes_(bytes) {
    host_->bind();
    const CUresult s = api().cuMemAddressReserve(&base_, bytes, granularity, 0, 0);
    if (s != CUDA_SUCCESS) cuda::throw_status(&api(), "reserve_lazy", "cuMemAddressReserve", s);
  }
  ~CudaLazyRegion() override {
    if (base_ == 0) return;  // released
    try {
      release();
    } catch (const std::exception& e) {
      log::warn("cuda lazy buffer: releasing an unreleased reservation failed: {}", e.what());
    }
  }

  DevicePtr base() const noexcept override { return DevicePtr{base_}; }

  void map(std::size_t offset, std::size_t bytes) override {
    constexpr std::string_view kApi = "LazyBuffer::grow";
    host_->check_not_faulted(kApi);
    host_->bind();
    const CUmemAllocationProp prop = device_prop(host_->info().ordinal);
    CUmemGenericAllocationHandle handle = 0;
    CUresult s = api().cuMemCreate(&handle, bytes, &prop, 0);
    if (s != CUDA_SUCCESS) cuda::throw_status(&api(), kApi, "cuMemCreate", s);
    const CUdeviceptr at = base_ + offset;
    s = api().cuMemMap(at, bytes, 0, handle, 0);
    if (s != CUDA_SUCCESS) {
      undo(handle, at, bytes, false);
      cuda::throw_status(&api(), kApi, "cuMemMap", s);
    }
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    s = api().cuMemSetAccess(at, bytes, &access, 1);
    if (s != CUDA_SUCCESS) {
      undo(handle, at, bytes, true);
      cuda::throw_status(&api(), kApi, "cuMemSetAccess", s);
    }
    pieces_.push_back(Piece{at, bytes, handle});
  }

  void release() override {
    host_->bind_quietly();
    std::string first;
    const auto note = [&](const char* call, CUresult s) {
      // A context that is already gone took the memory with it: not an error at teardown.
      if (s == CUDA_SUCCESS || cuda::is_context_gone(s) || !first.empty()) return;
      first = fmt::format("{} failed: {}", call, cuda::describe_status(&api(), s));
      code_ = s;
    };
    for (auto it = pieces_.rbegin(); it != pieces_.rend(); ++it) {
      note("cuMemUnmap", api().cuMemUnmap(it->at, it->bytes));
      note("cuMemRelease", api().cuMemRelease(it->handle));
    }
    pieces_.clear();
    note("cuMemAddressFree", api().cuMemAddressFree(std::exchange(base_, 0), bytes_));
    if (!first.empty()) {
      throw Error(cuda::is_sticky_fault(code_) ? ErrorCode::kDeviceFault : ErrorCode::kDriver,
                  "LazyBuffer::release", first);
    }
  }

 private:
  struct Piece {
    CUdeviceptr at = 0;
    std::size_t bytes = 0;
    CUmemGenericAllocationHandle handle = 0;
  };
  const cuda::DriverApi& api() const { return host_->api(); }
  // Takes back a growth that failed part-way; what cannot be taken back is logged (it leaks).
  void undo(CUmemGenericAllocationHandle handle, CUdeviceptr at, std::size_t bytes, bool mapped) {
    if (mapped) {
      if (const CUresult s = api().cuMemUnmap(at, bytes); s != CUDA_SUCCESS) {
        log::warn("LazyBuffer::grow: undoing a failed growth: cuMemUnmap failed: {}",
                  cuda::describe_status(&api(), s));
      }
    }
    if (const CUresult s = api().cuMemRelease(handle); s != CUDA_SUCCESS) {
      log::warn("LazyBuffer::grow: undoing a failed growth: cuMemRelease failed: {}",
                cuda::describe_status(&api(), s));
    }
  }

  std::shared_ptr<cuda::CudaHost> host_;
  std::size_t bytes_;
  CUdeviceptr base_ = 0;
  std::vector<Piece> pieces_;
  CUresult code_ = CUDA_SUCCESS;
};

}  // namespace

std::size_t CudaBackend::lazy_granularity() {
  enter("reserve_lazy");
  const CUmemAllocationProp prop = device_prop(host_->info().ordinal);
  std::size_t g = 0;
  check("reserve_lazy", "cuMemGetAllocationGranularity",
        host_->api().cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if (g == 0) {
    throw Error(ErrorCode::kDriver, "reserve_lazy",
                "cuMemGetAllocationGranularity answered a granularity of 0");
  }
  return g;
}

std::unique_ptr<LazyRegion> CudaBackend::raw_reserve_lazy(std::size_t bytes,
                                                          std::size_t granularity) {
  enter("reserve_lazy");
  return std::make_unique<CudaLazyRegion>(host_, bytes, granularity);
}

bool CudaBackend::capture_in_progress() {
  return any_capturing("LazyBuffer::grow");
}

}  // namespace metrale
