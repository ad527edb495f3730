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

// Device-resident quantized weights W[N, K] (formats and layouts in quant.h).
struct QuantWeights {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
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
  // Allocates and fills both buffers (the ledger names loc); on any failure frees what it
  // allocated and throws (an empty codes or scales array: Error(kInvalidArgument)).
  WeightsResource(Backend& backend, const HostQuantWeights& host, std::string label = "weights",
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

 private:
  std::string label_;
  QuantWeights w_;
};

// A WeightsResource for ModelScope::add whose ledger entries name the caller (std::make_unique
// would name itself: a defaulted source_location is taken where the constructor is called).
std::unique_ptr<WeightsResource> make_weights_resource(
    Backend& backend, const HostQuantWeights& host, std::string label = "weights",
    std::source_location loc = std::source_location::current());

// Uploads host weights as WeightsResource does and hands the buffers to the caller (freed with
// free_weights): for code that owns the weights outside a ModelScope.
QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w,
                            std::source_location loc = std::source_location::current());
// Frees what upload_weights allocated, as WeightsResource::release does.
void free_weights(Backend& backend, QuantWeights& w);

}  // namespace metrale::ops
