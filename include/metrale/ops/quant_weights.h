// Quantized weights on a device: the description the GEMM ops take, and the one upload of host
// weights into it, a model resource allocated with the weights policy of metrale/weights.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <source_location>
#include <string>

#include "metrale/backend.h"
#include "metrale/model_scope.h"
#include "metrale/quant.h"

namespace metrale::ops {

// How the device buffers hold the codes and scales: as the host gave them (`layout` says which),
// rearranged at upload into the decode layout (src/kernels/decode_layout.h), which only the
// decode route reads (gemm_decode_packed, at every M), or into the CPU's panel layout
// (src/kernels/panel_layout.h), which the CPU's decode and tiled routes read.
enum class WeightPacking { kSource, kDecode, kPanels };

// Which layout an upload stores. kSource: the host's own. kDecode: the decode layout on every
// backend (the CPU runs it too, as a reference); for INT4 weights the int4 decode layout
// (src/kernels/int4_decode_layout.h), on a backend whose kernels read it. kPanels: the panel
// layout, on a backend whose decode and tiled kernels publish that they read it (the CPU
// module), else refused; INT4 weights take it with K a multiple of 32. kBackendPreferred: the
// decode layout where the backend's module publishes a decode kernel for it with a largest M
// (gemm_decode_packed_max_m, gemm_int4_decode_max_m: the CUDA module) that a device run verified
// (<entry>_verified_on, src/kernels/published.def); else the panel layout where the decode and
// tiled kernels publish it (the CPU module on processors with AVX-512 BF16) and the weights fit
// it; else the host's own.
enum class UploadLayout { kSource, kDecode, kBackendPreferred, kPanels };

// Device-resident quantized weights W[N, K] (formats and layouts in quant.h).
struct QuantWeights {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;  // of the host weights they came from
  WeightPacking packing = WeightPacking::kSource;
  std::int32_t fold = 0;  // kDecode: the buffers hold the weights times 2^-fold
  std::int64_t n = 0, k = 0;
  DevicePtr codes;   // codes_bytes bytes
  DevicePtr scales;  // scales_bytes bytes
  std::size_t codes_bytes = 0;
  std::size_t scales_bytes = 0;
  float tensor_scale = 1.0f;
  // INT4 only: K per scale, and what the scales buffer holds besides the scales
  // (kernels/int4_layout.h: zero points, the act order's K permutation).
  std::int64_t group = 0;
  bool fp16_scales = false, zero_points = false, act_order = false;
  // Act order only: A's columns (metrale/quant.h, a_columns), fewer than K for a padded K slice;
  // 0 also means K. Read it through a_columns.
  std::int64_t a_k = 0;
};

// A's columns for weights w (the K of A [M, K] that a GEMM on them takes): K, or a padded K
// slice's own under act order (a_k).
inline std::int64_t a_columns(const QuantWeights& w) noexcept {
  return w.act_order && w.a_k > 0 ? w.a_k : w.k;
}

// The device description of host weights: format, layout, shape, tensor scale and buffer sizes,
// with no buffers yet.
QuantWeights describe_weights(const HostQuantWeights& w);

// Host weights uploaded to a backend, owned as a model resource. Both buffers come from
// alloc_weights: device memory first; on out-of-memory one warning, the fallback latched in the
// backend's OpCache, managed memory from then on (a new backend tries device memory again).
// release() frees them once. Not released by the destructor: a ModelScope (or whoever holds
// it outside one) calls release, as for every ModelResource.
class WeightsResource final : public ModelResource {
 public:
  // Allocates and fills both buffers (the ledger names loc), in the layout `upload` chooses;
  // on any failure frees what it allocated and throws (codes or scales whose sizes do not fit
  // the format, N and K, or weights the decode or panel layout cannot take:
  // Error(kInvalidArgument), before anything is allocated; kPanels on a backend that does not
  // read it: Error(kUnavailable)).
  WeightsResource(Backend& backend, const HostQuantWeights& host, std::string label = "weights",
                  UploadLayout upload = UploadLayout::kSource,
                  std::source_location loc = std::source_location::current());
  std::string label() const override { return label_; }
  // Frees both buffers, the second even when the first free fails (then throws that failure);
  // the pointers are cleared first, so a second call does nothing.
  void release(Backend& backend) override;
  // The description the GEMM ops take; its buffers are null once released or taken.
  const QuantWeights& weights() const noexcept { return w_; }
  // Hands the buffers to the caller (who frees them with free_weights); the resource then holds
  // nothing to release.
  QuantWeights take() noexcept;
  // Seconds the upload spent rearranging the weights into the decode or panel layout (0 when it
  // kept the host's layout).
  double pack_seconds() const noexcept { return pack_seconds_; }

 private:
  std::string label_;
  QuantWeights w_;
  double pack_seconds_ = 0.0;
};

// A WeightsResource for ModelScope::add whose ledger entries name the caller (std::make_unique
// would name itself: a defaulted source_location is taken where the constructor is called).
std::unique_ptr<WeightsResource> make_weights_resource(
    Backend& backend, const HostQuantWeights& host, std::string label = "weights",
    UploadLayout upload = UploadLayout::kSource,
    std::source_location loc = std::source_location::current());

// The packing an upload of NVFP4 or MXFP4 weights with `upload` stores on backend (kPanels asked
// of a backend that does not read it is refused at upload, not here).
WeightPacking upload_packing(Backend& backend, UploadLayout upload);

// Whether an upload with `upload` stores the decode layout on backend.
bool uploads_decode_layout(Backend& backend, UploadLayout upload);
// Whether backend has a decode kernel that reads the decode layout (verified on a device or not:
// benchmarks and checks that ask for the layout by name run it either way).
bool reads_decode_layout(Backend& backend);

// Whether backend's decode and tiled kernels read the panel layout (they publish `panels`).
bool reads_panel_layout(Backend& backend);
// Whether INT4 weights with this K can take the panel layout (K a multiple of 32).
bool int4_panels_ok(std::int64_t k) noexcept;
// Whether backend's decode and tiled kernels read INT4 weights in the panel layout (they publish
// `panels` and `int4`).
bool reads_int4_panel_layout(Backend& backend);

// Uploads host weights as WeightsResource does and hands the buffers to the caller (freed with
// free_weights): for code that owns the weights outside a ModelScope.
QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w,
                            UploadLayout upload = UploadLayout::kSource,
                            std::source_location loc = std::source_location::current());
// Frees what upload_weights allocated, as WeightsResource::release does.
void free_weights(Backend& backend, QuantWeights& w);

}  // namespace metrale::ops
