// The W8A8 op's device weights: their sizes, and the one upload of host bytes into them.
#include <fmt/format.h>

#include <utility>

#include "core/log.h"
#include "metrale/error.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/weights.h"

namespace metrale::ops {
namespace {

void free_quietly(Backend& backend, DevicePtr p) noexcept {
  if (!p) return;
  try {
    backend.free(p);
  } catch (const std::exception& e) {
    log::warn("{}: freeing 0x{:x} after an error failed too: {}", backend.name(), p.address(),
              e.what());
  }
}

}  // namespace

Fp8Weights describe_fp8_weights(std::string_view api, std::int64_t n, std::int64_t k) {
  if (n < 1 || k < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("FP8 weights are {}x{}; N and K must be at least 1", n, k));
  }
  // The dense GEMM's B and its scales are exactly these buffers; M = 1 only makes the shape whole.
  const DenseGemmBytes b = dense_gemm_bytes(api, DenseGemmShape{DenseKind::kE4m3Block128, 1, n, k});
  Fp8Weights w;
  w.n = n;
  w.k = k;
  w.codes_bytes = b.b;
  w.scales_bytes = b.b_scales;
  return w;
}

Fp8WeightsResource::Fp8WeightsResource(Backend& backend, std::span<const std::uint8_t> codes,
                                       std::span<const std::uint8_t> scales, std::int64_t n,
                                       std::int64_t k, std::string label, std::source_location loc)
    : label_(std::move(label)) {
  constexpr std::string_view api = "upload_fp8_weights";
  Fp8Weights w = describe_fp8_weights(api, n, k);
  if (codes.size() != w.codes_bytes || scales.size() != w.scales_bytes) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("codes and scales are {} and {} bytes; E4M3 weights {}x{} need {} "
                            "([N, K]) and {} (FP32 [ceil(N/128), ceil(K/128)])",
                            codes.size(), scales.size(), n, k, w.codes_bytes, w.scales_bytes));
  }
  // Locals until everything succeeded, as WeightsResource does (the catch block never reads a
  // half-built object).
  const DevicePtr dc = alloc_weights(backend, codes.size(), loc);
  DevicePtr ds;
  try {
    ds = alloc_weights(backend, scales.size(), loc);
    backend.copy_h2d(dc, codes.data(), codes.size());
    backend.copy_h2d(ds, scales.data(), scales.size());
  } catch (...) {
    free_quietly(backend, dc);
    free_quietly(backend, ds);
    throw;
  }
  w.codes = dc;
  w.scales = ds;
  w_ = w;
}

void Fp8WeightsResource::release(Backend& backend) {
  free_fp8_weights(backend, w_);
}

Fp8Weights Fp8WeightsResource::take() noexcept {
  Fp8Weights out = w_;
  w_.codes = w_.scales = DevicePtr{};
  return out;
}

Fp8Weights upload_fp8_weights(Backend& backend, std::span<const std::uint8_t> codes,
                              std::span<const std::uint8_t> scales, std::int64_t n, std::int64_t k,
                              std::source_location loc) {
  return Fp8WeightsResource(backend, codes, scales, n, k, "fp8 weights", loc).take();
}

void free_fp8_weights(Backend& backend, Fp8Weights& w) {
  const DevicePtr codes = std::exchange(w.codes, DevicePtr{});
  const DevicePtr scales = std::exchange(w.scales, DevicePtr{});
  try {
    if (codes) backend.free(codes);
  } catch (...) {
    free_quietly(backend, scales);
    throw;
  }
  if (scales) backend.free(scales);
}

}  // namespace metrale::ops
