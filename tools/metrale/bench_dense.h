// metrale bench's BF16 layers that a quantized checkpoint kept in BF16 (its lm_head, a layer its
// quantizer was told to leave): run as they would be served, on the backend's dense BF16 GEMM
// (cuBLASLt on CUDA), not quantized behind the user's back; each checked and timed as the main
// table's rows.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "metrale/model_scope.h"

namespace metrale::cli {

struct DenseLayer {
  std::string name;
  std::int64_t n = 0, k = 0;
  std::vector<std::uint16_t> w;  // BF16 [N, K], row-major
};

// Uploads each layer (with copies for the rotation, toolkit/rotation.h), then at each M checks
// every layer's dense BF16 GEMM on C poisoned against toolkit::sampled_check_dense_bf16 and
// times the ones that pass, in turns. Appends one case a layer and M (variant "auto", route
// "bf16") and returns whether every check passed. The weights are the scope's buffers.
bool bench_dense_layers(ModelScope& scope, const std::vector<DenseLayer>& layers,
                        const std::vector<std::int64_t>& ms, const LayerBenchRun& run,
                        std::mt19937_64& rng, std::vector<Case>& cases);

}  // namespace metrale::cli
