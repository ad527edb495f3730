// Quantized weights on a device: the description the GEMM ops take, and the upload of host
// weights into it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "metrale/backend.h"
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
// with no buffers yet (for loaders that allocate the buffers their own way).
QuantWeights describe_weights(const HostQuantWeights& w);
// Copies host weights to new allocations on backend (freed with free_weights).
QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w);
// Frees what upload_weights allocated.
void free_weights(Backend& backend, QuantWeights& w);

}  // namespace metrale::ops
