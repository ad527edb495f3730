// Quantized GEMM ops on any backend (docs/CONTRACT.md, GEMM routes). One sequence for every op and
// route: check arguments (clear error, nothing launched) → route from M and from what the backend's
// modules offer → scratch from the OpCache by tag → kernel handles from the OpCache → grid from
// each kernel's published N tile → launch on the stream.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "metrale/backend.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"

namespace metrale::ops {

// Whether the caller accepts A cast to E4M3 (FP8 tensor cores) or needs exact BF16 activations.
enum class Activations { kExactBf16, kAllowE4m3 };

enum class GemmRoute {
  kAuto,    // choose from M and the backend's modules
  kDecode,  // small M: weights streamed once, dequantized in registers
  kTiled,   // large M: tiles of dequantized weights reused across rows of A
  kE4m3,    // A cast to E4M3, weights as E4M3, FP8 products, FP32 group scales
};
// "auto", "decode", "tiled", "e4m3".
std::string_view to_string(GemmRoute route) noexcept;

struct GemmOptions {
  Activations activations = Activations::kExactBf16;
  GemmRoute route = GemmRoute::kAuto;
  DevicePtr bias;  // BF16 [N], optional
};

// The largest M the decode route takes under kAuto.
inline constexpr std::int64_t kDecodeMaxM = 16;
// The smallest M for which kAuto picks the E4M3 route when the caller allows it.
inline constexpr std::int64_t kE4m3MinM = 64;

// The route w4a16_gemm would take (throws as w4a16_gemm would for a route the backend lacks).
GemmRoute choose_route(Backend& backend, std::int64_t m, const QuantWeights& w,
                       const GemmOptions& options = {});

// C[M, N] (BF16, row-major) = A[M, K] (BF16, row-major) · dequant(W)ᵀ (+ bias), queued on
// stream. A, C and the weight buffers 16-byte aligned; C overlaps no input. Scratch (the E4M3
// route's cast operands, split-K partials) comes from the OpCache under gemm_scratch_tag.
void w4a16_gemm(Backend& backend, StreamHandle stream, DevicePtr a, std::int64_t m,
                const QuantWeights& w, DevicePtr c, const GemmOptions& options = {});

// The OpCache tag under which w4a16_gemm keeps scratch `base` ("fp8_activation", "fp8_weights",
// "gemm_split_k") for work queued on `stream`: base itself on the backend's default stream,
// "base@<stream>" on any other, so GEMMs on two streams never share a buffer.
std::string gemm_scratch_tag(Backend& backend, StreamHandle stream, std::string_view base);

// out[i] (E4M3) = RNE-saturating cast of in[i] (BF16), no scale (docs/CONTRACT.md, E4M3 cast).
void cast_bf16_to_e4m3(Backend& backend, StreamHandle stream, DevicePtr in, DevicePtr out,
                       std::int64_t count);

}  // namespace metrale::ops
