// Random quantized weights for benchmarks, made directly as codes and scales: quantizing the
// 470 M floats of Llama-3-70B's gate/up projection on the host would take longer than the
// benchmark itself. (The tests draw FP32 values and quantize them instead: they test the
// quantizer too.)
#pragma once

#include <cstdint>
#include <random>

#include "metrale/e4m3_block.h"
#include "metrale/quant.h"

namespace metrale::toolkit {

// Row-major W[n, k] in format: uniformly random E2M1 codes, and block scales spread over six
// octaves so that a kernel reading the wrong scale is far off. Every block scale times the
// tensor scale lies in [2^-9, 2^-3) for both formats (NVFP4: E4M3 scales 2^-3 .. 1.875·2^2
// with tensor scale 1/64; MXFP4: E8M0 scales 2^-9 .. 2^-4), so with activations in [-1, 1]
// the outputs of any K stay well inside BF16's range. Throws Error(kInvalidArgument) unless
// n ≥ 1 and k is a positive multiple of the format's group.
HostQuantWeights random_weights(WeightFormat format, std::int64_t n, std::int64_t k,
                                std::mt19937_64& rng);

// INT4 W[n, k] as GPTQ and AWQ checkpoints mostly are: groups of `group` (int4_group_ok), FP16
// scales spread over six octaves (2^-9 .. 2^-4, as above), zero points uniform in 0..15 and, with
// act_order, K in a random group order (every group `group` columns). Throws as quantize_int4.
HostQuantWeights random_int4_weights(std::int64_t n, std::int64_t k, std::int64_t group,
                                     bool act_order, std::mt19937_64& rng);

// E4M3 W[n, k] with FP32 scales per 128 x 128 block, as FP8 checkpoints are: uniformly random
// finite codes (no NaN), block scales 2^-12 .. 2^-7 (six octaves), so every weight lies below 7 in
// magnitude and outputs on activations in [-1, 1] stay well inside BF16's range. Throws
// Error(kInvalidArgument) unless n, k ≥ 1.
HostE4m3BlockWeights random_e4m3_weights(std::int64_t n, std::int64_t k, std::mt19937_64& rng);

}  // namespace metrale::toolkit
