// The W8A8 op's device weights: their sizes, and the one upload of host bytes (the checkpoint's
// scale layout) into them (the dense GEMM's padded scale layout).
#include <fmt/format.h>

#include <cstring>
#include <utility>
#include <vector>

#include "core/log.h"
#include "metrale/error.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/weights.h"
#include "ops/free_quietly.h"

namespace metrale::ops {
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
  // The host scales are the checkpoint's [ceil(N/128), ceil(K/128)]; no bigger than the padded
  // device scales describe_fp8_weights already counted, so this product cannot overflow.
  const auto rows = static_cast<std::size_t>(dense_scale_blocks(n)),
             cols = static_cast<std::size_t>(dense_scale_blocks(k)),
             ld = static_cast<std::size_t>(dense_b_scales_ld(k));
  const std::size_t host_scales = rows * cols * sizeof(float);
  if (codes.size() != w.codes_bytes || scales.size() != host_scales) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("codes and scales are {} and {} bytes; E4M3 weights {}x{} need {} "
                    "([N, K]) and {} (FP32 [ceil(N/128), ceil(K/128)] = [{}, {}])",
                    codes.size(), scales.size(), n, k, w.codes_bytes, host_scales, rows, cols));
  }
  // The device rows are ld = round_up(ceil(K/128), 4) scales apart (dense_gemm.h); the pad
  // entries are never read and are written 0 so the buffer's bytes are defined.
  std::vector<std::uint8_t> padded(w.scales_bytes, 0);
  for (std::size_t r = 0; r < rows; ++r) {
    std::memcpy(padded.data() + r * ld * sizeof(float), scales.data() + r * cols * sizeof(float),
                cols * sizeof(float));
  }
  // Locals until everything succeeded, as WeightsResource does (the catch block never reads a
  // half-built object).
  const DevicePtr dc = alloc_weights(backend, codes.size(), loc);
  DevicePtr ds;
  try {
    ds = alloc_weights(backend, padded.size(), loc);
    backend.copy_h2d(dc, codes.data(), codes.size());
    backend.copy_h2d(ds, padded.data(), padded.size());
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
