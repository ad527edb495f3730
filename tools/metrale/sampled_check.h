// The check every benchmark makes before it times a GEMM: a sample of outputs against float64.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "metrale/quant.h"

namespace metrale::cli {

// Normalized error ‖got − ref‖ / ‖ref‖ over 96 sampled outputs of C[M, N] = A · dequant(W)ᵀ
// (BF16 A and C, row-major), against float64. With e4m3_activations the reference rounds A to
// E4M3 first, as the e4m3 route does. Infinity when the sampled reference is all zero.
double sampled_error(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& c,
                     const HostQuantWeights& w, std::int64_t m, bool e4m3_activations,
                     std::mt19937_64& rng);

}  // namespace metrale::cli
