// NVFP4 / MXFP4 weights on the W8A8 route (ops/fp8_gemm.h), opt-in at upload: each layer is
// requantized on the host into 128 x 128 block-scaled E4M3 (requantize_e4m3_block128,
// metrale/e4m3_block.h) and uploaded as Fp8Weights, which the W8A8 op then multiplies by A cast
// to E4M3. The 4-bit weights are not kept on the device: a model that wants both the W4A16 and
// the W8A8 routes uploads both.
//
// Memory: 1 byte a weight plus the block scales (4 bytes per 128 x 128 block, as
// describe_fp8_weights lays them out), about 1.78x NVFP4's 0.5625 bytes a weight and 1.88x
// MXFP4's 0.53125. fp8_requant_cost states it before anything is allocated.
//
// Numerics: each weight is moved by at most half an E4M3 step of its block (2^-4 of itself, or
// 2^-10 of the block's scale in E4M3's subnormal range), on top of A's cast; the numerics suite
// holds the result to the float64 product of the 4-bit weights (toolkit/w8a8_reference.h).
#pragma once

#include <cstdint>
#include <memory>
#include <source_location>
#include <string>

#include "metrale/backend.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/quant.h"

namespace metrale::ops {

// What requantizing one layer costs on the device, in bytes.
struct Fp8RequantCost {
  std::uint64_t fp8 = 0;     // the requantized weights: codes + scales (describe_fp8_weights)
  std::uint64_t source = 0;  // the 4-bit weights it stands in for: codes + block scales
  // fp8 / source (0 when source is 0).
  double ratio() const noexcept;
};

// The cost of requantizing w, from its shape alone; Error(kInvalidArgument) naming the call for
// a shape describe_fp8_weights refuses.
Fp8RequantCost fp8_requant_cost(const HostQuantWeights& w);

// Requantizes w on the host and uploads it as upload_fp8_weights does (the ledger names loc).
// Throws what requantize_e4m3_block128 throws for inconsistent or non-finite weights, before
// anything is allocated, and what upload_fp8_weights throws.
Fp8Weights upload_requantized_fp8_weights(
    Backend& backend, const HostQuantWeights& w,
    std::source_location loc = std::source_location::current());

// The same, owned as a model resource (released by its ModelScope).
std::unique_ptr<Fp8WeightsResource> make_requantized_fp8_resource(
    Backend& backend, const HostQuantWeights& w, std::string label = "fp8 weights (requantized)",
    std::source_location loc = std::source_location::current());

}  // namespace metrale::ops
