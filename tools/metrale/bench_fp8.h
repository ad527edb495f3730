// metrale bench's FP8 checkpoint layers (metrale/fp8_checkpoint.h): the W8A8 op is the only
// route that runs them, so each is checked and timed on it alone, as the main table's rows.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "bench_timing.h"
#include "metrale/e4m3_block.h"
#include "metrale/model_scope.h"

namespace metrale::cli {

struct Fp8Layer {
  std::string name;
  E4m3BlockWeightsView w;  // a view into the mapped file
};

// Uploads each layer (with copies for the rotation, toolkit/rotation.h), then at each M checks
// every layer's W8A8 GEMM on C poisoned against toolkit::sampled_check_w8a8 and times the ones
// that pass, in turns. Appends one case a layer and M (variant "auto", route "w8a8") and returns
// whether every check passed. The weights are the scope's resources.
bool bench_fp8_layers(ModelScope& scope, const std::vector<Fp8Layer>& layers,
                      const std::vector<std::int64_t>& ms, const LayerBenchRun& run,
                      std::mt19937_64& rng, std::vector<Case>& cases);

}  // namespace metrale::cli
