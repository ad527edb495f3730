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
// or rearranged at upload into the decode layout (src/kernels/decode_layout.h), which only the
// decode route reads (gemm_decode_packed, at every M).
enum class WeightPacking { kSource, kDecode };

// Which layout an upload stores. kSource: the host's own. kDecode: the decode layout on every
// backend (the CPU runs it too, as a reference). kBackendPreferred: the decode layout where the
// backend's module publishes a decode kernel for it with a largest M (gemm_decode_packed_max_m:
// the CUDA module), else the host's own.
enum class UploadLayout { kSource, kDecode, kBackendPreferred };

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
};

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
  // on any failure frees what it allocated and throws (an empty codes or scales array, or
  // weights the decode layout cannot take: Error(kInvalidArgument)).
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
  // Seconds the upload spent rearranging the weights into the decode layout (0 when it kept
  // the host's layout).
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

// Whether an upload with `upload` stores the decode layout on backend.
bool uploads_decode_layout(Backend& backend, UploadLayout upload);

// Uploads host weights as WeightsResource does and hands the buffers to the caller (freed with
// free_weights): for code that owns the weights outside a ModelScope.
QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w,
                            UploadLayout upload = UploadLayout::kSource,
                            std::source_location loc = std::source_location::current());
// Frees what upload_weights allocated, as WeightsResource::release does.
void free_weights(Backend& backend, QuantWeights& w);

}  // namespace metrale::ops
