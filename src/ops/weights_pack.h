// Host weights rearranged into the layout an upload stores, before any device memory is taken:
// what WeightsResource uploads, and what the grouped weights (ops/grouped_gemm.h) lay end to end
// per expert.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "metrale/backend.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"

namespace metrale::ops {

// The bytes of each buffer in the stored layout: the host's own (spans into it) or a rearranged
// copy (owned here).
struct HostPacked {
  WeightPacking packing = WeightPacking::kSource;
  std::int32_t fold = 0;  // QuantWeights::fold
  double seconds = 0.0;   // time spent rearranging (0 for the host's layout)
  std::span<const std::uint8_t> codes, scales;
  std::optional<std::vector<std::uint8_t>> owned_codes, owned_scales;
};

// host in the layout `upload` chooses on backend (WeightsResource's rules); throws as its
// constructor does for weights or a layout it refuses. The spans stay valid while both host and
// the result live (moving the result keeps them: a vector's move keeps its buffer).
HostPacked pack_host_weights(Backend& backend, const HostQuantWeights& host, UploadLayout upload);

}  // namespace metrale::ops
