#include "metrale/ops/gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/log.h"
#include "core/nvtx.h"
#include "core/published.h"
#include "kernels/decode_layout.h"
#include "kernels/dequant_bf16.h"
#include "kernels/dequant_int4.h"
#include "kernels/gemm_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/int4_layout.h"
#include "kernels/int4_permute.h"
#include "kernels/panel_layout.h"
#include "kernels/tile_math.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "ops/buffer_checks.h"
#include "ops/published_block.h"

namespace metrale::ops {
namespace {

constexpr std::string_view kModule = "w4a16";

// METRALE_GEMM_SHAPE_LOG=1 adds one info line per (route, M, N, K) with its FLOP count.
bool shape_log_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("METRALE_GEMM_SHAPE_LOG");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

// The manifest's route column, as GemmRoute (kNone: a helper entry, no route of its own).
namespace manifest_route {
constexpr GemmRoute kNone = GemmRoute::kAuto, kDecode = GemmRoute::kDecode,
                    kTiled = GemmRoute::kTiled, kE4m3 = GemmRoute::kE4m3;
}  // namespace manifest_route

struct RouteEntry {
  GemmRoute route;
  const char* entry;
};
constexpr RouteEntry kRouteEntries[] = {
#define METRALE_W4A16_ENTRY(entry, Params, route) RouteEntry{manifest_route::route, #entry},
#include "kernels/w4a16.def"
#undef METRALE_W4A16_ENTRY
};

// The manifest's entry for a route: its first (the one for weights in their source layout).
const char* entry_of(GemmRoute route) {
  for (const RouteEntry& e : kRouteEntries) {
    if (e.route == route && route != GemmRoute::kAuto) return e.entry;
  }
  return "?";
}

// The decode route's kernel for weights in the decode layout.
constexpr const char* kPackedDecodeEntry = "gemm_decode_packed";
// The fused route's kernel: prefill on weights in the decode layout.
constexpr const char* kFusedEntry = "gemm_fused";
// The dequant route's one kernel (its GEMM is the backend's dense GEMM).
constexpr const char* kDequantEntry = "dequant_bf16";
// INT4 weights in the INT4 decode layout: the decode route's kernel, the dequant route's
// dequantization, and act order's gather of A before the decode kernel.
constexpr const char* kInt4DecodeEntry = "gemm_int4_decode";
constexpr const char* kInt4DequantEntry = "dequant_int4_bf16";
constexpr const char* kInt4PermuteEntry = "permute_a_int4";

// a × b × c bytes; Error(kInvalidArgument) when that does not fit 64 bits. No buffer holds that
// much, and a size that wrapped around would pass the range checks (fuzz_gemm_args found N × K
// overflowing int64 here; M × N × 2 and M × K × 2 wrapped the same way in uint64).
std::uint64_t bytes_of(std::string_view api, std::string_view what, std::uint64_t a,
                       std::uint64_t b, std::uint64_t c) {
  std::uint64_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("{} would be {} x {} x {} bytes, more than 64 bits can count", what, a, b, c));
  }
  return abc;
}

// Buffers of weights rearranged at upload must have the sizes their layout gives.
void check_layout_bytes(std::string_view api, const QuantWeights& w, std::string_view layout,
                        std::uint64_t codes, std::uint64_t scales) {
  if (w.codes_bytes != codes || w.scales_bytes != scales) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("packed weight codes and scales are {} and {} bytes; {} {}x{} in the "
                            "{} layout needs {} and {}",
                            w.codes_bytes, w.scales_bytes, to_string(w.format), w.n, w.k, layout,
                            codes, scales));
  }
}

// Weights in the decode layout: its padded buffer sizes (kernels/decode_layout.h) and a fold
// whose power of two a float holds.
void check_packed_weights(std::string_view api, const QuantWeights& w) {
  const bool mx = w.format == WeightFormat::kMxfp4;
  // N and K are at least 1 here; past 2^40 the padded sizes below could not be counted.
  if (w.n > (std::int64_t{1} << 40) || w.k > (std::int64_t{1} << 40)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("packed weights are {}x{}; the decode layout takes N and K up to 2^40",
                            w.n, w.k));
  }
  // Counted in 64 unsigned bits, checked: decode_layout::code_bytes' signed product of the padded
  // N and K wraps past 2^63 (2^32 rows of 2^32 - 16 K padded to 0 bytes of codes).
  const std::uint64_t codes =
      bytes_of(api, "the packed weights", static_cast<std::uint64_t>(decode_layout::padded_n(w.n)),
               static_cast<std::uint64_t>(decode_layout::padded_k(w.k)), 1) /
      2;
  const auto scales = static_cast<std::uint64_t>(decode_layout::scale_bytes(w.n, w.k, mx));
  check_layout_bytes(api, w, "decode", codes, scales);
  if (w.fold < -128 || w.fold > 127) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("packed weights fold {}; it must lie in [-128, 127]", w.fold));
  }
}

// Weights in the panel layout: buffers of the padded sizes panel_layout.h gives, counted in 64
// unsigned bits, checked (N is padded by up to 31 rows past what the source size counted).
void check_panel_weights(std::string_view api, const QuantWeights& w) {
  const auto padded = static_cast<std::uint64_t>(panel_layout::padded_n(w.n));
  const auto uk = static_cast<std::uint64_t>(w.k);
  const std::uint64_t codes = bytes_of(api, "the panel-layout weights", padded, uk, 1) / 2;
  const std::uint64_t scales = padded * (uk / static_cast<std::uint64_t>(group_size(w.format)));
  check_layout_bytes(api, w, "panel", codes, scales);
}

// INT4 weights: row-major, in their source layout, the INT4 decode layout or the panel layout, a
// group the kernels take, and the buffer sizes that layout gives (kernels/int4_layout.h for the
// source's and the panel layout's side buffer, kernels/int4_decode_layout.h for the decode
// layout's).
void check_int4_weights(std::string_view api, const QuantWeights& w) {
  const bool packed = w.packing == WeightPacking::kDecode;
  const bool panels = w.packing == WeightPacking::kPanels;
  if (w.layout != WeightLayout::kRowMajor) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "int4 weights are row-major only (in their source layout, the int4 decode layout "
                "or the panel layout)");
  }
  if (panels && w.k % panel_layout::kInt4BlockK != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 weights in the panel layout with K = {}: the layout takes K a "
                            "multiple of {}",
                            w.k, panel_layout::kInt4BlockK));
  }
  if (w.k % 2 != 0 || !int4_group_ok(w.group, w.k) || (packed && !int4_decode::group_ok(w.group))) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 group {} for K = {}: the group must divide K and be 32, 64, a "
                            "multiple of 128{}",
                            w.group, w.k, packed ? " (the decode layout)" : " or K itself"));
  }
  const auto un = static_cast<std::uint64_t>(w.n), uk = static_cast<std::uint64_t>(w.k);
  std::uint64_t codes = bytes_of(api, "the weights", un, uk, 1) / 2, side = 0;
  if (packed) {
    // N and K at most 2^40 keep the padded sizes countable (as check_packed_weights).
    if (w.n > (std::int64_t{1} << 40) || w.k > (std::int64_t{1} << 40)) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("packed int4 weights are {}x{}; the decode layout takes N and K up "
                              "to 2^40",
                              w.n, w.k));
    }
    // Counted in 64 unsigned bits, checked: sizes_of's signed products of the padded sizes wrap
    // (2^32 rows of 2^32 - 96 K padded to 0 bytes of codes), as check_packed_weights says.
    const auto pn = static_cast<std::uint64_t>(decode_layout::padded_n(w.n));
    const auto pk = static_cast<std::uint64_t>(decode_layout::padded_k(w.k));
    codes = bytes_of(api, "the packed int4 weights", pn, pk, 1) / 2;
    side = bytes_of(
        api, "the packed int4 side buffer", pn / decode_layout::kTileN, pk / decode_layout::kBlockK,
        static_cast<std::uint64_t>(int4_decode::side_block_bytes(int4_decode::entries(w.group))));
    if (w.act_order && __builtin_add_overflow(side, 4 * uk, &side)) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  "the packed int4 side buffer would be more bytes than 64 bits can count");
    }
  } else {
    side = int4_layout::side_of(w.n, w.k, w.group, w.zero_points, w.act_order).bytes;
    // The panel layout pads N to 32 (kernels/panel_layout.h), counted as check_panel_weights.
    if (panels) {
      codes = bytes_of(api, "the panel-layout int4 weights",
                       static_cast<std::uint64_t>(panel_layout::padded_n(w.n)), uk, 1) /
              2;
    }
  }
  if (w.codes_bytes != codes || w.scales_bytes != side) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("int4 weight codes and scales are {} and {} bytes; {}x{} in groups of "
                    "{}{}{} in the {} layout needs {} and {}",
                    w.codes_bytes, w.scales_bytes, w.n, w.k, w.group,
                    w.zero_points ? " with zero points" : "", w.act_order ? " and act order" : "",
                    packed   ? "int4 decode"
                    : panels ? "panel"
                             : "source",
                    codes, side));
  }
}

void check_weights(std::string_view api, const QuantWeights& w) {
  if (w.n < 1 || w.k < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weights are {}x{}; N and K must be at least 1", w.n, w.k));
  }
  if (w.act_order && (w.a_k < 0 || w.a_k > w.k)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("the weights' a_k (A's columns) is {}; it is 0 (K) or 1 to K = {}",
                            w.a_k, w.k));
  }
  if (w.format == WeightFormat::kInt4) {
    check_pointer(api, "weight codes", w.codes);
    check_pointer(api, "weight scales", w.scales);
    check_int4_weights(api, w);
    if (w.tensor_scale != 1.0f) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("int4 weights have no tensor scale, but it is {}", w.tensor_scale));
    }
    return;
  }
  const int group = group_size(w.format);
  if (w.k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("K = {} is not a multiple of {} ({} block size)", w.k, group,
                            to_string(w.format)));
  }
  check_pointer(api, "weight codes", w.codes);
  check_pointer(api, "weight scales", w.scales);
  const auto un = static_cast<std::uint64_t>(w.n), uk = static_cast<std::uint64_t>(w.k);
  const std::uint64_t codes = bytes_of(api, "the weights", un, uk, 1) / 2;  // [N, K/2]
  const std::uint64_t scales = un * (uk / static_cast<std::uint64_t>(group));
  if (w.packing == WeightPacking::kDecode) {
    check_packed_weights(api, w);
  } else if (w.packing == WeightPacking::kPanels) {
    check_panel_weights(api, w);
  } else {
    if (w.codes_bytes != codes) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("weight codes are {} bytes; {} {}x{} needs {} ([N, K/2])",
                              w.codes_bytes, to_string(w.format), w.n, w.k, codes));
    }
    if (w.scales_bytes != scales) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("weight scales are {} bytes; {} {}x{} needs {} ([N, K/{}])",
                              w.scales_bytes, to_string(w.format), w.n, w.k, scales, group));
    }
  }
  if (!(w.tensor_scale > 0.0f) || !std::isfinite(w.tensor_scale)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("tensor scale {} is not a positive finite number", w.tensor_scale));
  }
}

// ceil(count / tile) as a grid dimension; Error(kInvalidArgument) past what a launch can hold.
std::uint32_t blocks_of(std::string_view api, std::string_view what, std::int64_t count,
                        std::uint64_t tile, std::uint64_t limit) {
  const std::uint64_t blocks = (static_cast<std::uint64_t>(count) + tile - 1) / tile;
  if (blocks > limit) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} = {} needs {} blocks of {}; one launch holds at most {}", what,
                            count, blocks, tile, limit));
  }
  return static_cast<std::uint32_t>(blocks);
}

// A one-dimensional launch over count items by the kernel's published N tile.
PlannedLaunch flat_launch(std::string_view api, Backend& backend, const ResolvedKernel& k,
                          std::int64_t count) {
  return PlannedLaunch{
      k, Dim3{blocks_of(api, "the grid", count, backend.kernel_n_tile(k), 0x7FFFFFFFu)},
      published_block(api, backend, k), 0};
}

// Whether the automatic route may take module w4a16's entry: the module has it and it is a kernel
// a device run verified (or a host module's, the reference), not a placeholder
// (core/published.h). Unverified kernels run only when a caller asks for their route or layout.
bool auto_may_take(Backend& backend, const char* entry) {
  return backend.has_kernel(kModule, entry) &&
         automatic_choice_allowed(backend.op_cache().kernel(backend, kModule, entry).meta);
}

std::int64_t decode_max_m_as(std::string_view api, Backend& backend) {
  const ResolvedKernel& k =
      backend.op_cache().kernel(backend, kModule, entry_of(GemmRoute::kDecode));
  if (k.meta.max_m == 0) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} publishes no largest M (gemm_decode_max_m is missing or 0): the "
                            "automatic route cannot tell decode from tiled",
                            backend.kernel_name(k)));
  }
  return k.meta.max_m;
}

GemmRoute route_of(std::string_view api, Backend& backend, std::int64_t m, const QuantWeights& w,
                   const GemmOptions& options) {
  if (options.route != GemmRoute::kAuto) return options.route;
  // INT4 in the INT4 decode layout: its decode kernel up to the largest M it publishes (every M
  // where it publishes none: the CPU's reference), above that dequantize → dense BF16 where the
  // backend has the dense GEMM (and C is BF16). The caller chose these kernels by uploading in
  // that layout, verified or not (ops/quant_weights.cpp prefers it only where verified).
  if (w.format == WeightFormat::kInt4 && w.packing == WeightPacking::kDecode) {
    if (!backend.has_kernel(kModule, kInt4DecodeEntry)) return GemmRoute::kDecode;  // refused next
    const std::uint32_t max_m =
        backend.op_cache().kernel(backend, kModule, kInt4DecodeEntry).meta.max_m;
    const bool dequant = !options.out_f32 && backend.has_kernel(kModule, kInt4DequantEntry) &&
                         backend.dense_gemm_unavailable(DenseKind::kBf16).empty();
    return max_m == 0 || m <= max_m || !dequant ? GemmRoute::kDecode : GemmRoute::kDequant;
  }
  // INT4 in its source or the panel layout: decode up to its largest M, else tiled; check_route
  // refuses a kernel that does not read INT4 (or not in the panel layout).
  if (w.format == WeightFormat::kInt4) {
    return m <= decode_max_m_as(api, backend) ? GemmRoute::kDecode : GemmRoute::kTiled;
  }
  // Weights in the panel layout: the decode route's kernel up to its largest M, the tiled one
  // above (both read it, Note [CPU panel layout]).
  if (w.packing == WeightPacking::kPanels) {
    return m <= decode_max_m_as(api, backend) ? GemmRoute::kDecode : GemmRoute::kTiled;
  }
  // Weights in the decode layout: the decode route, or above its sizes the fused prefill kernel
  // where the module has a verified one (both read that layout; the decode route takes every M).
  if (w.packing == WeightPacking::kDecode) {
    return m > decode_max_m_as(api, backend) && auto_may_take(backend, kFusedEntry)
               ? GemmRoute::kFused
               : GemmRoute::kDecode;
  }
  // E4M3 activations, where allowed, from the M gemm_e4m3 publishes as its smallest (none: the
  // module's kernel is never the faster choice).
  if (options.activations == Activations::kAllowE4m3 &&
      auto_may_take(backend, entry_of(GemmRoute::kE4m3))) {
    const ResolvedKernel& e =
        backend.op_cache().kernel(backend, kModule, entry_of(GemmRoute::kE4m3));
    if (e.meta.min_m != 0 && m >= e.meta.min_m) return GemmRoute::kE4m3;
  }
  if (m <= decode_max_m_as(api, backend)) return GemmRoute::kDecode;
  if (options.out_f32) return GemmRoute::kTiled;  // the dense GEMM writes BF16 only
  // Dequantize → dense BF16 from the M its kernel publishes as the crossover (none: never), where
  // the backend has the dense GEMM. See Note [route crossovers] in docs/NOTES.md.
  if (auto_may_take(backend, kDequantEntry)) {
    const ResolvedKernel& dq = backend.op_cache().kernel(backend, kModule, kDequantEntry);
    if (dq.meta.min_m != 0 && m >= dq.meta.min_m &&
        backend.dense_gemm_unavailable(DenseKind::kBf16).empty()) {
      return GemmRoute::kDequant;
    }
  }
  return GemmRoute::kTiled;
}

// The kernel of INT4 weights in the INT4 decode layout for `route`: gemm_int4_decode (decode) or
// dequant_int4_bf16 (dequant, with the backend's dense BF16 GEMM), each publishing that layout
// and int4; every other route reads another layout.
const ResolvedKernel& check_int4_packed_route(std::string_view api, Backend& backend,
                                              GemmRoute route) {
  if (route != GemmRoute::kDecode && route != GemmRoute::kDequant) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("route {}: these int4 weights are in the int4 decode layout, which "
                            "only the decode and dequant routes read",
                            to_string(route)));
  }
  const char* entry = route == GemmRoute::kDecode ? kInt4DecodeEntry : kInt4DequantEntry;
  const ResolvedKernel& k = backend.op_cache().kernel(backend, kModule, entry);
  if (k.meta.absent || !k.meta.int4 || k.meta.layout != int4_decode::kLayoutId) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} does not read int4 weights in the int4 decode layout (it publishes "
                            "layout {}{}; the layout is {})",
                            backend.kernel_name(k), k.meta.layout, k.meta.int4 ? "" : ", no int4",
                            int4_decode::kLayoutId));
  }
  if (route == GemmRoute::kDequant) {
    if (const std::string why = backend.dense_gemm_unavailable(DenseKind::kBf16); !why.empty()) {
      throw Error(ErrorCode::kUnavailable, api,
                  fmt::format("the dequant route runs a dense BF16 GEMM, which this backend "
                              "lacks: {}",
                              why));
    }
  }
  return k;
}

// The route's GEMM kernel, refused where it would cast A to E4M3 for a caller that asked for
// exact BF16 activations.
const ResolvedKernel& check_route(std::string_view api, Backend& backend, GemmRoute route,
                                  const QuantWeights& w, const GemmOptions& options) {
  if (route == GemmRoute::kE4m3 && options.activations != Activations::kAllowE4m3) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "the e4m3 route casts A to E4M3, but the caller asked for exact BF16 activations");
  }
  if (w.format == WeightFormat::kInt4 && w.packing == WeightPacking::kDecode) {
    return check_int4_packed_route(api, backend, route);
  }
  if (w.packing == WeightPacking::kPanels) {
    if (route != GemmRoute::kDecode && route != GemmRoute::kTiled) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("route {} reads weights in their source layout, but these were "
                              "uploaded in the panel layout (only the decode and tiled routes "
                              "read it)",
                              to_string(route)));
    }
    const ResolvedKernel& gemm = backend.op_cache().kernel(backend, kModule, entry_of(route));
    if (!gemm.meta.panels) {
      throw Error(ErrorCode::kNotFound, api,
                  fmt::format("{} does not read the panel layout these weights are in (it "
                              "publishes no {}_panels)",
                              backend.kernel_name(gemm), entry_of(route)));
    }
    if (w.format == WeightFormat::kInt4 && !gemm.meta.int4) {
      throw Error(ErrorCode::kUnavailable, api,
                  fmt::format("route {}: {} does not read int4 weights (it publishes no {}_int4)",
                              to_string(route), backend.kernel_name(gemm), entry_of(route)));
    }
    return gemm;
  }
  const bool packed = w.packing == WeightPacking::kDecode;
  if (packed && route != GemmRoute::kDecode && route != GemmRoute::kFused) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("route {} reads weights in their source layout, but these were "
                            "uploaded in the decode layout (only the decode and fused routes "
                            "read it)",
                            to_string(route)));
  }
  if (!packed && route == GemmRoute::kFused) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "the fused route reads weights in the decode layout, but these are in their "
                "source layout (upload them with UploadLayout::kDecode)");
  }
  if (route == GemmRoute::kDequant) {
    const ResolvedKernel& dq = backend.op_cache().kernel(backend, kModule, kDequantEntry);
    if (w.format == WeightFormat::kInt4 && !dq.meta.int4) {
      throw Error(ErrorCode::kUnavailable, api,
                  fmt::format("route dequant: {} does not read int4 weights in their source "
                              "layout (dequant_bf16 publishes no int4 flag); dequant_int4_bf16 "
                              "reads them in the int4 decode layout (UploadLayout::kDecode)",
                              backend.kernel_name(dq)));
    }
    // Its GEMM is the backend's library, not a module kernel: refused with the backend's reason
    // where it has none. The dequantization itself keeps A exact, whatever the caller allows.
    if (const std::string why = backend.dense_gemm_unavailable(DenseKind::kBf16); !why.empty()) {
      throw Error(ErrorCode::kUnavailable, api,
                  fmt::format("the dequant route runs a dense BF16 GEMM, which this backend "
                              "lacks: {}",
                              why));
    }
    return dq;
  }
  const ResolvedKernel& gemm = backend.op_cache().kernel(backend, kModule,
                                                         route == GemmRoute::kFused ? kFusedEntry
                                                         : packed ? kPackedDecodeEntry
                                                                  : entry_of(route));
  if (gemm.meta.absent) {
    throw Error(ErrorCode::kUnavailable, api,
                fmt::format("route {}: {} is a placeholder on this device's target (it publishes "
                            "{}_absent); this target has no such kernel",
                            to_string(route), backend.kernel_name(gemm),
                            route == GemmRoute::kFused ? kFusedEntry : entry_of(route)));
  }
  if (w.format == WeightFormat::kInt4 && !gemm.meta.int4) {
    throw Error(ErrorCode::kUnavailable, api,
                fmt::format("route {}: {} does not read int4 weights (it publishes no {}_int4)",
                            to_string(route), backend.kernel_name(gemm), entry_of(route)));
  }
  if (packed && gemm.meta.layout != decode_layout::kLayoutId) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} publishes layout {}, not the decode layout ({}) these weights are "
                            "in",
                            backend.kernel_name(gemm), gemm.meta.layout, decode_layout::kLayoutId));
  }
  if (route != GemmRoute::kE4m3 && options.activations == Activations::kExactBf16 &&
      Backend::kernel_casts_a_to_e4m3(gemm)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} casts A to E4M3 (it publishes {}_a_e4m3), but the caller asked "
                            "for exact BF16 activations",
                            backend.kernel_name(gemm), entry_of(route)));
  }
  return gemm;
}

void log_route(Backend& backend, GemmRoute route, std::int64_t m, std::int64_t n, std::int64_t k) {
  const auto mm = static_cast<std::uint32_t>(m), nn = static_cast<std::uint32_t>(n),
             kk = static_cast<std::uint32_t>(k);
  if (!backend.op_cache().first_shape(to_string(route), mm, nn, kk)) return;
  log::debug("{} w4a16_gemm: route {} for M={} N={} K={}", backend.name(), to_string(route), m, n,
             k);
  if (shape_log_enabled()) {
    log::info("{} w4a16_gemm shape M={} N={} K={}: {:.3g} GFLOP", backend.name(), m, n, k,
              2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / 1e9);
  }
}

const char* layout_name(WeightLayout layout) {
  return layout == WeightLayout::kTransposed ? "transposed" : "row-major";
}

const char* packing_name(WeightPacking packing) {
  switch (packing) {
    case WeightPacking::kDecode:
      return "decode";
    case WeightPacking::kPanels:
      return "panel";
    case WeightPacking::kSource:
      break;
  }
  return "source";
}

// The kernels' GemmFlags for weights of this format, source layout and packing, with or without
// a bias. Packed weights carry no source layout for a kernel to read: their flag says the
// decode one.
std::uint32_t gemm_flags(WeightFormat format, WeightLayout layout, WeightPacking packing, bool bias,
                         bool out_f32) {
  const bool packed = packing == WeightPacking::kDecode;
  const bool panels = packing == WeightPacking::kPanels;
  return (format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u) |
         (format == WeightFormat::kInt4 ? kGemmInt4 : 0u) |
         (!packed && !panels && layout == WeightLayout::kTransposed ? kGemmTransposed : 0u) |
         (packed ? kGemmDecodePacked : 0u) | (panels ? kGemmPanels : 0u) | (bias ? kGemmBias : 0u) |
         (out_f32 ? kGemmOutF32 : 0u);
}

// The INT4 flags of weights beside kGemmInt4: what their side buffer holds.
constexpr std::uint32_t kInt4Detail = kGemmFp16Scales | kGemmZeroPoints | kGemmActOrder;
std::uint32_t int4_flags(const QuantWeights& w) {
  if (w.format != WeightFormat::kInt4) return 0;
  return (w.fp16_scales ? kGemmFp16Scales : 0u) | (w.zero_points ? kGemmZeroPoints : 0u) |
         (w.act_order ? kGemmActOrder : 0u);
}

// Whether the plan gathers A into the stored K order first (permute_a_int4): act-ordered INT4
// weights, every route (the dequant route's W then stays in the stored order, written in whole
// rows rather than scattered, and a padded K slice's columns need A's zeros: Note [Act order
// across ranks]). Once per call: a kernel that gathered A itself did it once per block of
// columns, which on the CPU's tiled route took 1.7-1.9x the time of the same weights without act
// order (docs/PERF.md).
bool permutes_a(const GemmPlan& plan) {
  return plan.format == WeightFormat::kInt4 && (plan.flags & kGemmActOrder) != 0;
}

// Whether the plan's K slices are the ones a kernel takes (tile_math.h, split_k_range): one
// slice of all of K, or `splits` slices of k_per_split, a multiple of the split unit the GEMM's
// kernel publishes, none empty and the last reaching K. An edited k_per_split would leave part of
// K unsummed, or start slices off the kernels' K blocks.
bool k_slices_fit(const GemmPlan& plan) {
  if (plan.splits == 1) return plan.k_per_split == plan.k;
  if (plan.splits < 2 || plan.k_per_split < 1) return false;
  std::int64_t covered = 0;
  if (__builtin_mul_overflow(plan.splits, plan.k_per_split, &covered) || covered < plan.k ||
      covered - plan.k_per_split >= plan.k) {
    return false;
  }
  return std::any_of(plan.launches.begin(), plan.launches.end(), [&](const PlannedLaunch& l) {
    return l.grid.z == static_cast<std::uint64_t>(plan.splits) && l.kernel.meta.split_k != 0 &&
           plan.k_per_split % l.kernel.meta.split_k == 0;
  });
}

// Whether the planned launches are the kernels their places need: the gather first under act
// order, the E4M3 casts next on the e4m3 route, the split-K reduce last when K is split, and in
// between one kernel that is none of those. A plan whose launches were reordered would otherwise
// run a kernel on another's buffers (dequant into the gathered A's workspace, the reduce before
// the partials). The count is checked first; the kernels are then looked up in the OpCache, where
// plan() resolved them (hits).
bool launch_roles_fit(const GemmPlan& plan, bool permute, bool e4m3) {
  const bool reduce = plan.splits > 1;
  const std::size_t first = (permute ? 1u : 0u) + (e4m3 ? 2u : 0u);
  if (plan.launches.size() != first + 1 + (reduce ? 1u : 0u)) return false;
  Backend& backend = *plan.backend;
  OpCache& cache = backend.op_cache();
  std::vector<KernelHandle> before;
  if (permute) before.push_back(cache.kernel(backend, kModule, kInt4PermuteEntry).handle);
  if (e4m3) {
    before.push_back(cache.kernel(backend, kModule, "bf16_to_fp8").handle);
    before.push_back(cache.kernel(backend, kModule, "dequant_e4m3").handle);
  }
  const KernelHandle reducer =
      reduce ? cache.kernel(backend, kModule, "gemm_split_reduce").handle : KernelHandle{};
  for (std::size_t i = 0; i < first; ++i) {
    if (plan.launches[i].kernel.handle != before[i]) return false;
  }
  const KernelHandle main = plan.launches[first].kernel.handle;
  if (std::find(before.begin(), before.end(), main) != before.end() ||
      (reduce && main == reducer)) {
    return false;
  }
  return !reduce || plan.launches.back().kernel.handle == reducer;
}

// A plan is plain data a caller can edit: run() refuses one whose launches or workspace do not
// fit its own route, M, N, K and split, or whose kernel flags do not say its own weights (so no
// kernel runs on a grid, buffer or layout meant for another).
void check_plan(std::string_view api, const GemmPlan& plan) {
  const bool e4m3 = plan.route == GemmRoute::kE4m3;
  const bool dequant = plan.route == GemmRoute::kDequant;
  // The dequant route: its dequant_bf16 launch, then the dense GEMM, which never splits K. Act-
  // ordered INT4 weights: permute_a_int4 first, on every route.
  const bool permute = permutes_a(plan);
  const auto um = static_cast<std::uint64_t>(plan.m), un = static_cast<std::uint64_t>(plan.n),
             uk = static_cast<std::uint64_t>(plan.k);
  const DenseGemmShape dense_shape{DenseKind::kBf16, plan.m, plan.n, plan.k, plan.bias};
  const bool dense_fits = dequant ? plan.dense.has_value() && plan.dense->shape == dense_shape &&
                                        plan.splits == 1 && plan.workspace.w_bf16 / 2 / uk >= un &&
                                        plan.workspace.dense >= plan.dense->workspace_bytes
                                  : !plan.dense.has_value();
  const bool sizes =
      plan.m >= 1 && plan.n >= 1 && plan.k >= 1 && plan.splits >= 1 && dense_fits &&
      (!e4m3 || (plan.workspace.a_e4m3 >= um * uk && plan.workspace.w_e4m3 >= un * uk)) &&
      (!permute || plan.workspace.a_perm / 2 / uk >= um) &&
      (plan.splits == 1 || plan.workspace.split_k / (um * un * sizeof(float)) >=
                               static_cast<std::uint64_t>(plan.splits));
  const std::uint32_t flags =
      gemm_flags(plan.format, plan.layout, plan.packing, plan.bias, plan.out_f32);
  if ((plan.flags & ~kInt4Detail) != flags ||
      ((plan.flags & kInt4Detail) != 0 && plan.format != WeightFormat::kInt4)) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("the plan's kernel flags are {:#x}, but its weights ({} {}, {} layout{}) "
                    "need {:#x}: make it with plan()",
                    plan.flags, to_string(plan.format), layout_name(plan.layout),
                    packing_name(plan.packing), plan.bias ? ", bias" : "", flags));
  }
  if (!sizes || !k_slices_fit(plan) || !launch_roles_fit(plan, permute, e4m3)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("the plan does not fit itself ({} launch(es) for route {} with {} "
                            "split(s) of {} K; M={} N={} K={}): make it with plan()",
                            plan.launches.size(), to_string(plan.route), plan.splits,
                            plan.k_per_split, plan.m, plan.n, plan.k));
  }
}

}  // namespace

std::string_view to_string(GemmRoute route) noexcept {
  switch (route) {
    case GemmRoute::kAuto:
      return "auto";
    case GemmRoute::kDecode:
      return "decode";
    case GemmRoute::kTiled:
      return "tiled";
    case GemmRoute::kE4m3:
      return "e4m3";
    case GemmRoute::kDequant:
      return "dequant";
    case GemmRoute::kFused:
      return "fused";
  }
  return "?";
}

std::uint64_t GemmWorkspaceBytes::total() const noexcept {
  return align_up(split_k) + align_up(a_e4m3) + align_up(w_e4m3) + align_up(w_bf16) +
         align_up(dense) + align_up(a_perm);
}

GemmWorkspace GemmWorkspace::carve(DevicePtr base, const GemmWorkspaceBytes& bytes) {
  GemmWorkspace w;
  std::uint64_t at = 0;
  const auto take = [&](std::uint64_t n) {
    if (n == 0) return DevicePtr{};
    const DevicePtr p = base.offset(at);
    at += align_up(n);
    return p;
  };
  w.split_k = take(bytes.split_k);
  w.a_e4m3 = take(bytes.a_e4m3);
  w.w_e4m3 = take(bytes.w_e4m3);
  w.w_bf16 = take(bytes.w_bf16);
  w.dense = take(bytes.dense);
  w.a_perm = take(bytes.a_perm);
  return w;
}

std::string GemmPlan::describe() const {
  std::string s = fmt::format("{} M={} N={} K={}:", to_string(route), m, n, k);
  const char* sep = " ";
  for (const PlannedLaunch& l : launches) {
    s += fmt::format("{}{} {}x{}x{} x {} threads", sep, backend->kernel_name(l.kernel), l.grid.x,
                     l.grid.y, l.grid.z, l.block.x);
    if (l.smem_bytes != 0) s += fmt::format(" + {} B shared", l.smem_bytes);
    sep = ", ";
  }
  if (dense) {
    s += fmt::format("{}dense {} {}x{}x{}{}: {}", sep, to_string(dense->shape.kind), dense->shape.m,
                     dense->shape.n, dense->shape.k, dense->shape.bias ? " +bias" : "",
                     dense->describe);
  }
  s += fmt::format("; split-K {} x {}; workspace {} B", splits, k_per_split, workspace.total());
  if (out_f32) s += "; FP32 C";
  if (packing == WeightPacking::kPanels) s += "; panel layout";
  return s;
}

std::int64_t decode_max_m(Backend& backend) {
  return decode_max_m_as("decode_max_m", backend);
}

namespace {

// check_call_buffers for W: A [M, K] BF16 and C [M, N] (BF16, or FP32 when out_f32), counted
// in 64 bits.
CallRanges check_buffers(std::string_view api, Backend& backend, std::int64_t m,
                         const QuantWeights& w, DevicePtr a, DevicePtr c, DevicePtr bias,
                         bool out_f32) {
  const auto um = static_cast<std::uint64_t>(m), un = static_cast<std::uint64_t>(w.n),
             ua = static_cast<std::uint64_t>(a_columns(w));
  return check_call_buffers(api, backend, a, bytes_of(api, "A", um, ua, 2), c,
                            bytes_of(api, "C", um, un, out_f32 ? 4 : 2), w.codes, w.codes_bytes,
                            w.scales, w.scales_bytes, bias, un * 2);
}

// The planned launches, in order, on checked buffers.
void launch_planned(const GemmPlan& plan, StreamHandle stream, DevicePtr a, const QuantWeights& w,
                    DevicePtr c, const GemmWorkspace& workspace, DevicePtr bias) {
  Backend& backend = *plan.backend;
  GemmParams params;
  params.a = a.address();
  params.codes = w.codes.address();
  params.scales = w.scales.address();
  params.out = c.address();
  params.bias = bias.address();
  params.m = plan.m;
  params.n = w.n;
  params.k = w.k;
  params.tensor_scale = w.tensor_scale;
  params.flags = plan.flags;
  params.weight_fold = plan.fold;
  params.splits = plan.splits;
  params.k_per_split = plan.k_per_split;
  params.group = w.group;
  params.a_k = a_columns(w);
  params.workspace = workspace.split_k.address();

  std::size_t i = 0;
  if (permutes_a(plan)) {
    // A in the weights' stored K order into the workspace, then the decode kernel reads that.
    GemmParams perm = params;
    perm.out = workspace.a_perm.address();
    const PlannedLaunch& lp = plan.launches[i++];
    backend.launch_typed(lp.kernel, lp.grid, lp.block, lp.smem_bytes, stream,
                         std::array{KernelArg::value(perm)});
    // The GEMM reads that A as it is: without kGemmActOrder (which would gather it again).
    params.a = workspace.a_perm.address();
    params.flags &= ~kGemmActOrder;
  }
  if (plan.route == GemmRoute::kE4m3) {
    // params.a: A as the GEMM reads it (the gathered A where act order gathered it first).
    const CastParams cast{params.a, workspace.a_e4m3.address(), plan.m * w.k, 0, 0};
    const PlannedLaunch& lc = plan.launches[i++];
    backend.launch_typed(lc.kernel, lc.grid, lc.block, lc.smem_bytes, stream,
                         std::array{KernelArg::value(cast)});
    const CastParams deq{w.codes.address(), workspace.w_e4m3.address(), w.n, w.k, plan.flags};
    const PlannedLaunch& ld = plan.launches[i++];
    backend.launch_typed(ld.kernel, ld.grid, ld.block, ld.smem_bytes, stream,
                         std::array{KernelArg::value(deq)});
    params.a = workspace.a_e4m3.address();
    params.codes = workspace.w_e4m3.address();
  }
  if (plan.route == GemmRoute::kDequant) {
    // BF16 W [N, K] into the workspace (the kernel reads codes, scales, tensor scale and flags;
    // its output is W), then C = A · Wᵀ + bias by the backend's dense GEMM.
    GemmParams deq = params;
    deq.out = workspace.w_bf16.address();
    const PlannedLaunch& ld = plan.launches[i];
    backend.launch_typed(ld.kernel, ld.grid, ld.block, ld.smem_bytes, stream,
                         std::array{KernelArg::value(deq)});
    DenseGemmArgs args;
    args.a = permutes_a(plan) ? workspace.a_perm : a;
    args.b = workspace.w_bf16;
    args.c = c;
    args.bias = bias;
    args.workspace = workspace.dense;
    args.workspace_bytes = plan.workspace.dense;
    backend.run_dense_gemm(*plan.dense, args, stream);
    return;
  }
  for (; i < plan.launches.size(); ++i) {
    const PlannedLaunch& l = plan.launches[i];
    backend.launch_typed(l.kernel, l.grid, l.block, l.smem_bytes, stream,
                         std::array{KernelArg::value(params)});
  }
}

// What plan() checks before it looks anything up: M, the weights, and A and C sizes that 64
// bits can count.
void check_plan_args(std::string_view api, std::int64_t m, const QuantWeights& w) {
  if (m < 1)
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("M = {}; it must be at least 1", m));
  check_weights(api, w);
  const auto um = static_cast<std::uint64_t>(m), un = static_cast<std::uint64_t>(w.n),
             uk = static_cast<std::uint64_t>(w.k);
  (void)bytes_of(api, "A", um, uk, 2);
  (void)bytes_of(api, "C", um, un, 2);
}

// The end of planning: a workspace whose parts laid end to end are countable (total() and carve()
// do not check again), and the route's log line.
GemmPlan finish_plan(std::string_view api, Backend& backend, GemmPlan& p) {
  std::uint64_t total = 0;
  const GemmWorkspaceBytes& ws = p.workspace;
  for (const std::uint64_t part :
       {ws.split_k, ws.a_e4m3, ws.w_e4m3, ws.w_bf16, ws.dense, ws.a_perm}) {
    if (part > UINT64_MAX - kWorkspaceAlign ||
        __builtin_add_overflow(total, align_up(part), &total)) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("the workspace of M={} N={} K={} would be more bytes than 64 bits "
                              "can count",
                              p.m, p.n, p.k));
    }
  }
  // FP32 C only from a kernel that says it writes one: the last launch writes C.
  if (p.out_f32 && !p.launches.empty() && !p.launches.back().kernel.meta.out_f32) {
    throw Error(ErrorCode::kUnavailable, api,
                fmt::format("the {} backend's {} kernel writes C in BF16 only (it publishes no "
                            "out_f32), so FP32 output is not available on the {} route",
                            backend.name(), backend.kernel_name(p.launches.back().kernel),
                            to_string(p.route)));
  }
  log_route(backend, p.route, p.m, p.n, p.k);
  return std::move(p);
}

// The plan of arguments check_plan_args has passed: route, kernels, launches, workspace.
GemmPlan plan_checked(std::string_view api, Backend& backend, std::int64_t m, const QuantWeights& w,
                      const GemmOptions& options) {
  if (options.bias) check_pointer(api, "bias", options.bias);
  const auto um = static_cast<std::uint64_t>(m), un = static_cast<std::uint64_t>(w.n),
             uk = static_cast<std::uint64_t>(w.k);

  GemmPlan p;
  p.backend = &backend;
  p.route = route_of(api, backend, m, w, options);
  p.m = m;
  p.n = w.n;
  p.k = w.k;
  p.format = w.format;
  p.layout = w.layout;
  p.packing = w.packing;
  p.fold = w.fold;
  p.bias = static_cast<bool>(options.bias);
  p.out_f32 = options.out_f32;
  p.flags = gemm_flags(w.format, w.layout, w.packing, p.bias, p.out_f32) | int4_flags(w);
  p.group = w.group;
  if (p.out_f32 && p.route == GemmRoute::kDequant) {
    throw Error(ErrorCode::kUnavailable, api,
                "the dequant route writes C through the backend's dense GEMM, in BF16 only; "
                "FP32 output needs another route");
  }
  OpCache& cache = backend.op_cache();
  const ResolvedKernel& gemm = check_route(api, backend, p.route, w, options);

  if (permutes_a(p)) {
    p.launches.push_back(flat_launch(api, backend,
                                     cache.kernel(backend, kModule, kInt4PermuteEntry),
                                     int4_permute::unit_count(m, w.k)));
    p.workspace.a_perm = bytes_of(api, "the permuted A", um, uk, 2);
  }
  if (p.route == GemmRoute::kDequant) {
    // One dequant_bf16 thread per unit of 32 weights; the dense GEMM planned (and memoized) by the
    // backend for this shape. Workspace: W in BF16, and whatever the GEMM library asks for.
    const bool int4 = w.format == WeightFormat::kInt4;
    p.launches.push_back(
        flat_launch(api, backend, gemm,
                    int4 ? dequant_int4::unit_count(w.n, w.k) : dequant::unit_count(w.n, w.k)));
    p.workspace.w_bf16 = bytes_of(api, "the BF16 weights", un, uk, 2);
    p.dense = backend.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, m, w.n, w.k, p.bias});
    p.workspace.dense = p.dense->workspace_bytes;
    p.k_per_split = w.k;
    return finish_plan(api, backend, p);
  }

  if (p.route == GemmRoute::kE4m3) {
    p.launches.push_back(
        flat_launch(api, backend, cache.kernel(backend, kModule, "bf16_to_fp8"), m * w.k));
    p.launches.push_back(
        flat_launch(api, backend, cache.kernel(backend, kModule, "dequant_e4m3"), w.n));
    p.workspace.a_e4m3 = um * uk;
    p.workspace.w_e4m3 = bytes_of(api, "the E4M3 weights", un, uk, 1);
  }

  // The GEMM itself, sized from what its kernel publishes alone: grid x over N by the N tile,
  // grid y over M by the M tile (where published), grid z over K slices (where it can split K
  // and that fills the waves of the SMs better), and its dynamic shared memory. A wave is as
  // many blocks as the SMs hold at once, by the occupancy the kernel is compiled for.
  PlannedLaunch g{gemm, {}, published_block(api, backend, gemm), gemm.meta.smem_bytes};
  g.grid.x = blocks_of(api, "N", w.n, backend.kernel_n_tile(gemm), 0x7FFFFFFFu);
  g.grid.y = gemm.meta.m_tile != 0 ? blocks_of(api, "M", m, gemm.meta.m_tile, 0xFFFFu) : 1;
  const auto blocks = static_cast<std::int64_t>(g.grid.x) * g.grid.y;
  tiles::SplitK split{1, w.k};
  if (gemm.meta.persistent) {
    // The kernel loops over the tiles itself: one wave, or a block per tile where that is fewer
    // (and never more than grid x holds; any grid covers every tile). It counts the tiles in 32
    // bits (fewer registers across its MMA loop), so more than 2^31 - 1 are refused.
    if (blocks > 0x7FFFFFFF) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("M={} N={} makes {} tiles for {}, which counts at most 2^31 - 1", m,
                              w.n, blocks, backend.kernel_name(gemm)));
    }
    const std::int64_t wave = wave_blocks(api, backend, gemm);
    g.grid = Dim3{static_cast<std::uint32_t>(std::min({blocks, wave, std::int64_t{0x7FFFFFFF}}))};
  } else if (gemm.meta.split_k != 0) {
    split = tiles::plan_split_k_waves(w.k, gemm.meta.split_k, blocks,
                                      wave_blocks(api, backend, gemm), kMaxSplits);
  }
  g.grid.z = static_cast<std::uint32_t>(split.splits);
  p.splits = split.splits;
  p.k_per_split = split.k_per_split;
  p.launches.push_back(g);
  if (split.splits > 1) {
    // FP32 partials [splits, M, N], summed in slice order by gemm_split_reduce: the result does
    // not depend on which slice finishes first.
    p.workspace.split_k =
        bytes_of(api, "the split-K workspace", static_cast<std::uint64_t>(split.splits) * um, un,
                 sizeof(float));
    p.launches.push_back(
        flat_launch(api, backend, cache.kernel(backend, kModule, "gemm_split_reduce"), m * w.n));
  }
  return finish_plan(api, backend, p);
}

void run_as(std::string_view api, const GemmPlan& plan, StreamHandle stream, DevicePtr a,
            const QuantWeights& w, DevicePtr c, const GemmWorkspace& workspace, DevicePtr bias) {
  if (plan.backend == nullptr || plan.launches.empty()) {
    throw Error(ErrorCode::kInvalidArgument, api, "the plan is empty (made by no call to plan())");
  }
  Backend& backend = *plan.backend;
  // A plan's handles belong to its backend's modules: refused once teardown released them.
  if (backend.op_cache().released()) {
    throw Error(ErrorCode::kState, api,
                "the plan's backend was torn down (its op cache is released); plan again on a "
                "live backend");
  }
  if (w.packing != plan.packing || w.fold != plan.fold) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("weights are in the {} layout (fold {}); the plan is for the {} "
                    "layout (fold {})",
                    packing_name(w.packing), w.fold, packing_name(plan.packing), plan.fold));
  }
  if (w.format == WeightFormat::kInt4 &&
      (w.group != plan.group || int4_flags(w) != (plan.flags & kInt4Detail))) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("int4 weights in groups of {} (flags {:#x}); the plan is for groups "
                            "of {} (flags {:#x})",
                            w.group, int4_flags(w), plan.group, plan.flags & kInt4Detail));
  }
  if (w.n != plan.n || w.k != plan.k || w.format != plan.format || w.layout != plan.layout) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weights are {} {}x{} {}; the plan is for {} {}x{} {}",
                            to_string(w.format), w.n, w.k, layout_name(w.layout),
                            to_string(plan.format), plan.n, plan.k, layout_name(plan.layout)));
  }
  if (plan.bias != static_cast<bool>(bias)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                plan.bias ? "the plan adds a bias, but bias is null"
                          : "bias is given, but the plan was made without one");
  }
  check_plan(api, plan);
  check_weights(api, w);
  const CallRanges r = check_buffers(api, backend, plan.m, w, a, c, bias, plan.out_f32);
  const GemmWorkspaceBytes& need = plan.workspace;
  const Range rsplit{"split-K workspace", workspace.split_k.address(), need.split_k},
      ra8{"E4M3 A workspace", workspace.a_e4m3.address(), need.a_e4m3},
      rw8{"E4M3 weights workspace", workspace.w_e4m3.address(), need.w_e4m3},
      rwb{"BF16 weights workspace", workspace.w_bf16.address(), need.w_bf16},
      rdense{"dense GEMM workspace", workspace.dense.address(), need.dense},
      rperm{"permuted A workspace", workspace.a_perm.address(), need.a_perm};
  check_workspace_part(api, backend, rsplit, workspace.split_k,
                       {r.a, r.c, r.codes, r.scales, r.bias, ra8, rw8, rwb, rdense, rperm});
  check_workspace_part(api, backend, ra8, workspace.a_e4m3,
                       {r.a, r.c, r.codes, r.scales, r.bias, rw8, rwb, rdense, rperm});
  check_workspace_part(api, backend, rw8, workspace.w_e4m3,
                       {r.a, r.c, r.codes, r.scales, r.bias, rwb, rdense, rperm});
  check_workspace_part(api, backend, rwb, workspace.w_bf16,
                       {r.a, r.c, r.codes, r.scales, r.bias, rdense, rperm});
  check_workspace_part(api, backend, rdense, workspace.dense,
                       {r.a, r.c, r.codes, r.scales, r.bias, rperm});
  check_workspace_part(api, backend, rperm, workspace.a_perm,
                       {r.a, r.c, r.codes, r.scales, r.bias});

  launch_planned(plan, stream, a, w, c, workspace, bias);
}

}  // namespace

GemmPlan plan(Backend& backend, std::int64_t m, const QuantWeights& w, const GemmOptions& options) {
  constexpr std::string_view api = "plan";
  check_plan_args(api, m, w);
  return plan_checked(api, backend, m, w, options);
}

void run(const GemmPlan& plan, StreamHandle stream, DevicePtr a, const QuantWeights& w, DevicePtr c,
         const GemmWorkspace& workspace, DevicePtr bias) {
  const nvtx::Range range("metrale::ops::run");
  run_as("run", plan, stream, a, w, c, workspace, bias);
}

GemmWorkspace scratch_workspace(const GemmPlan& plan, StreamHandle stream) {
  if (plan.backend == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "scratch_workspace",
                "the plan is empty (made by no call to plan())");
  }
  // The contract's scratch tags, grow-only in the OpCache, one set per stream (docs/CONTRACT.md,
  // OpCache).
  Backend& backend = *plan.backend;
  OpCache& cache = backend.op_cache();
  GemmWorkspace ws;
  const auto part = [&](std::string_view tag, std::uint64_t bytes) {
    return bytes == 0
               ? DevicePtr{}
               : cache.scratch(backend, gemm_scratch_tag(backend, stream, tag), bytes, stream);
  };
  ws.split_k = part("gemm_split_k", plan.workspace.split_k);
  ws.a_e4m3 = part("fp8_activation", plan.workspace.a_e4m3);
  ws.w_e4m3 = part("fp8_weights", plan.workspace.w_e4m3);
  ws.w_bf16 = part("dequant_weights", plan.workspace.w_bf16);
  ws.dense = part("blas_workspace", plan.workspace.dense);
  ws.a_perm = part("int4_permuted_a", plan.workspace.a_perm);
  return ws;
}

GemmRoute choose_route(Backend& backend, std::int64_t m, const QuantWeights& w,
                       const GemmOptions& options) {
  constexpr std::string_view api = "w4a16_gemm";
  const GemmRoute route = route_of(api, backend, m, w, options);
  check_route(api, backend, route, w, options);
  return route;
}

void w4a16_gemm(Backend& backend, StreamHandle stream, DevicePtr a, std::int64_t m,
                const QuantWeights& w, DevicePtr c, const GemmOptions& options) {
  constexpr std::string_view api = "w4a16_gemm";
  const nvtx::Range range("metrale::ops::w4a16_gemm");
  // Bad arguments are refused before any kernel is looked up or any scratch allocated.
  check_plan_args(api, m, w);
  (void)check_buffers(api, backend, m, w, a, c, options.bias, options.out_f32);
  const GemmPlan p = plan_checked(api, backend, m, w, options);
  const GemmWorkspace ws = scratch_workspace(p, stream);
  launch_planned(p, stream, a, w, c, ws, options.bias);
}

std::string gemm_scratch_tag(Backend& backend, StreamHandle stream, std::string_view base) {
  if (stream == backend.default_stream()) return std::string(base);
  return fmt::format("{}@{:x}", base, stream.value());
}

void cast_bf16_to_e4m3(Backend& backend, StreamHandle stream, DevicePtr in, DevicePtr out,
                       std::int64_t count) {
  constexpr std::string_view api = "cast_bf16_to_e4m3";
  const nvtx::Range range("metrale::ops::cast_bf16_to_e4m3");
  if (count < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("count = {}; it must be at least 1", count));
  }
  check_pointer(api, "in", in);
  check_pointer(api, "out", out);
  const auto n = static_cast<std::uint64_t>(count);
  check_no_overlap(api, Range{"out", out.address(), n}, {Range{"in", in.address(), n * 2}});
  backend.check_range(api, "in", in, n * 2);
  backend.check_range(api, "out", out, n);
  const PlannedLaunch l =
      flat_launch(api, backend, backend.op_cache().kernel(backend, kModule, "bf16_to_fp8"), count);
  const CastParams params{in.address(), out.address(), count, 0, 0};
  backend.launch_typed(l.kernel, l.grid, l.block, 0, stream, std::array{KernelArg::value(params)});
}

}  // namespace metrale::ops
