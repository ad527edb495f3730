// 4-bit weights requantized into the W8A8 op's block-scaled E4M3 at upload (ops/fp8_requant.h).
#include "metrale/ops/fp8_requant.h"

#include <fmt/format.h>

#include <span>
#include <utility>

#include "metrale/e4m3_block.h"
#include "metrale/error.h"

namespace metrale::ops {

double Fp8RequantCost::ratio() const noexcept {
  return source == 0 ? 0.0 : static_cast<double>(fp8) / static_cast<double>(source);
}

Fp8RequantCost fp8_requant_cost(const HostQuantWeights& w) {
  const Fp8Weights d = describe_fp8_weights("fp8_requant_cost", w.n, w.k);
  if (w.format == WeightFormat::kInt4) {
    throw Error(ErrorCode::kInvalidArgument, "fp8_requant_cost",
                "it counts NVFP4 and MXFP4 weights, not int4");
  }
  const std::int64_t group = group_size(w.format);
  if (w.k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, "fp8_requant_cost",
                fmt::format("k = {} is not a multiple of {} (the {} block size)", w.k, group,
                            to_string(w.format)));
  }
  Fp8RequantCost cost;
  cost.fp8 = d.codes_bytes + d.scales_bytes;
  // One byte per two E2M1 codes, one per block scale (E4M3 or E8M0).
  cost.source = static_cast<std::uint64_t>(w.n) * static_cast<std::uint64_t>(w.k / 2 + w.k / group);
  return cost;
}

namespace {

// The host form upload_fp8_weights takes: codes as they are, scales as their bytes.
std::span<const std::uint8_t> scale_bytes(const HostE4m3BlockWeights& q) {
  return {reinterpret_cast<const std::uint8_t*>(q.scales.data()), q.scales.size() * sizeof(float)};
}

}  // namespace

Fp8Weights upload_requantized_fp8_weights(Backend& backend, const HostQuantWeights& w,
                                          std::source_location loc) {
  const HostE4m3BlockWeights q = requantize_e4m3_block128(w);
  return upload_fp8_weights(backend, q.codes, scale_bytes(q), q.n, q.k, loc);
}

std::unique_ptr<Fp8WeightsResource> make_requantized_fp8_resource(Backend& backend,
                                                                  const HostQuantWeights& w,
                                                                  std::string label,
                                                                  std::source_location loc) {
  const HostE4m3BlockWeights q = requantize_e4m3_block128(w);
  return std::make_unique<Fp8WeightsResource>(backend, q.codes, scale_bytes(q), q.n, q.k,
                                              std::move(label), loc);
}

}  // namespace metrale::ops
