#include "metrale/ops/quant_weights.h"

#include <fmt/format.h>

#include <chrono>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "core/log.h"
#include "core/published.h"
#include "core/quant_int4.h"
#include "kernels/decode_layout.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/int4_layout.h"
#include "kernels/panel_layout.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/weights.h"
#include "ops/decode_pack.h"
#include "ops/free_quietly.h"
#include "ops/int4_pack.h"
#include "ops/pack_source.h"
#include "ops/panel_pack.h"
#include "ops/weights_pack.h"

namespace metrale::ops {

QuantWeights describe_weights(const HostQuantWeights& w) {
  QuantWeights d;
  d.format = w.format;
  d.layout = w.layout;
  d.n = w.n;
  d.k = w.k;
  d.tensor_scale = w.tensor_scale;
  d.codes_bytes = w.codes.size();
  d.scales_bytes = w.scales.size();
  if (w.format == WeightFormat::kInt4) {
    d.group = w.group;
    d.fp16_scales = w.fp16_scales;
    d.zero_points = !w.zeros.empty();
    d.act_order = !w.k_perm.empty();
    if (d.act_order) d.a_k = a_columns(w);
    d.scales_bytes = int4_layout::side_of(w.n, w.k, w.group, d.zero_points, d.act_order).bytes;
  }
  return d;
}

namespace {}  // namespace

bool uploads_decode_layout(Backend& backend, UploadLayout upload) {
  return upload_packing(backend, upload) == WeightPacking::kDecode;
}

bool reads_panel_layout(Backend& backend) {
  constexpr std::string_view kModule = "w4a16";
  for (const std::string_view entry : {"gemm_decode", "gemm_tiled"}) {
    if (!backend.has_kernel(kModule, entry)) return false;
    if (!backend.op_cache().kernel(backend, kModule, entry).meta.panels) return false;
  }
  return true;
}

WeightPacking upload_packing(Backend& backend, UploadLayout upload) {
  switch (upload) {
    case UploadLayout::kSource:
      return WeightPacking::kSource;
    case UploadLayout::kDecode:
      return WeightPacking::kDecode;
    case UploadLayout::kPanels:
      return WeightPacking::kPanels;
    case UploadLayout::kBackendPreferred:
      break;
  }
  // The decode layout where its kernel says it is the best decode (a largest M) and a device run
  // verified it (core/published.h): an unverified kernel runs only when asked for by layout.
  if (reads_decode_layout(backend) &&
      automatic_choice_allowed(
          backend.op_cache().kernel(backend, "w4a16", "gemm_decode_packed").meta)) {
    return WeightPacking::kDecode;
  }
  return reads_panel_layout(backend) ? WeightPacking::kPanels : WeightPacking::kSource;
}

bool reads_decode_layout(Backend& backend) {
  constexpr std::string_view kModule = "w4a16", kEntry = "gemm_decode_packed";
  if (!backend.has_kernel(kModule, kEntry)) return false;
  const KernelMeta& meta = backend.op_cache().kernel(backend, kModule, kEntry).meta;
  return meta.layout == decode_layout::kLayoutId && meta.max_m != 0;
}

bool reads_int4_panel_layout(Backend& backend) {
  if (!reads_panel_layout(backend)) return false;
  for (const std::string_view entry : {"gemm_decode", "gemm_tiled"}) {
    if (!backend.op_cache().kernel(backend, "w4a16", entry).meta.int4) return false;
  }
  return true;
}

namespace {

// Whether the backend has the INT4 decode layout's kernels: gemm_int4_decode and
// dequant_int4_bf16 publishing that layout and int4 (kernels/int4_decode_layout.h).
bool reads_int4_decode_layout(Backend& backend) {
  for (const std::string_view entry : {"gemm_int4_decode", "dequant_int4_bf16"}) {
    if (!backend.has_kernel("w4a16", entry)) return false;
    const KernelMeta& meta = backend.op_cache().kernel(backend, "w4a16", entry).meta;
    if (meta.absent || !meta.int4 || meta.layout != int4_decode::kLayoutId) return false;
  }
  return true;
}

// Where INT4 weights go: the INT4 decode layout when asked for by name or, by preference, where
// its decode kernel publishes a largest M (it is the backend's best decode, not a reference) and a
// device run verified it (core/published.h); else the panel layout when asked for, or by
// preference where the backend reads it (the CPU with AVX-512 BF16) and K is a multiple of 32;
// else the source layout.
WeightPacking int4_packing(Backend& backend, UploadLayout upload, std::int64_t group,
                           std::int64_t k) {
  if (upload == UploadLayout::kSource) return WeightPacking::kSource;
  if (upload == UploadLayout::kPanels) {
    if (!int4_panels_ok(k)) {
      throw Error(ErrorCode::kInvalidArgument, "WeightsResource",
                  fmt::format("int4 weights with K = {} have no panel layout: it takes K a "
                              "multiple of {}; upload them with UploadLayout::kSource or "
                              "kBackendPreferred",
                              k, panel_layout::kInt4BlockK));
    }
    return WeightPacking::kPanels;
  }
  const bool readable = reads_int4_decode_layout(backend);
  if (upload == UploadLayout::kDecode) {
    if (!readable) {
      throw Error(ErrorCode::kUnavailable, "WeightsResource",
                  fmt::format("{} has no kernels that read int4 weights in the int4 decode layout "
                              "(gemm_int4_decode and dequant_int4_bf16 publishing layout {} and "
                              "int4); upload with UploadLayout::kSource or kBackendPreferred",
                              backend.name(), int4_decode::kLayoutId));
    }
    return WeightPacking::kDecode;
  }
  if (readable && int4_decode_layout_ok(group)) {
    const KernelMeta& meta = backend.op_cache().kernel(backend, "w4a16", "gemm_int4_decode").meta;
    if (meta.max_m != 0 && automatic_choice_allowed(meta)) return WeightPacking::kDecode;
  }
  return int4_panels_ok(k) && reads_int4_panel_layout(backend) ? WeightPacking::kPanels
                                                               : WeightPacking::kSource;
}

}  // namespace

HostPacked pack_host_weights(Backend& backend, const HostQuantWeights& host, UploadLayout upload) {
  const bool int4 = host.format == WeightFormat::kInt4;
  HostPacked out;
  out.packing =
      int4 ? int4_packing(backend, upload, host.group, host.k) : upload_packing(backend, upload);
  if (out.packing == WeightPacking::kPanels &&
      !(int4 ? reads_int4_panel_layout(backend) : reads_panel_layout(backend))) {
    throw Error(ErrorCode::kUnavailable, "WeightsResource",
                fmt::format("{} has no w4a16 decode and tiled kernels that read {}weights in the "
                            "panel layout (they publish no gemm_decode_panels and "
                            "gemm_tiled_panels{}); upload with UploadLayout::kSource or "
                            "kBackendPreferred",
                            backend.name(), int4 ? "int4 " : "", int4 ? " with _int4" : ""));
  }
  // FP4 weights uploaded as they are have no packing to check them: their sizes are checked here
  // (each packing checks its own, INT4's side buffer included), so nothing is allocated for codes
  // or scales that do not fit N and K.
  if (!int4 && out.packing == WeightPacking::kSource)
    pack::check_source("WeightsResource", host, 0, 0);
  const auto start = std::chrono::steady_clock::now();
  if (int4 && out.packing == WeightPacking::kDecode) {
    PackedInt4Weights packed = pack_int4_for_decode(host, "WeightsResource");
    out.owned_codes = std::move(packed.codes);
    out.owned_scales = std::move(packed.side);
  } else if (int4) {
    out.owned_scales = pack_int4_side(host, out.packing == WeightPacking::kPanels);
    if (out.packing == WeightPacking::kPanels) out.owned_codes = pack_int4_codes_for_panels(host);
  } else if (out.packing == WeightPacking::kDecode) {
    PackedDecodeWeights packed = pack_for_decode(host);
    out.owned_codes = std::move(packed.codes);
    out.owned_scales = std::move(packed.scales);
    out.fold = packed.fold;
  } else if (out.packing == WeightPacking::kPanels) {
    PackedPanelWeights packed = pack_for_panels(host);
    out.owned_codes = std::move(packed.codes);
    out.owned_scales = std::move(packed.scales);
  }
  if (out.packing != WeightPacking::kSource) {
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  out.codes = out.owned_codes ? std::span<const std::uint8_t>(*out.owned_codes)
                              : std::span<const std::uint8_t>(host.codes);
  out.scales = out.owned_scales ? std::span<const std::uint8_t>(*out.owned_scales)
                                : std::span<const std::uint8_t>(host.scales);
  return out;
}

WeightsResource::WeightsResource(Backend& backend, const HostQuantWeights& host, std::string label,
                                 UploadLayout upload, std::source_location loc)
    : label_(std::move(label)) {
  // Rearranged first (it checks the weights), so nothing is allocated for weights it refuses.
  const HostPacked packed = pack_host_weights(backend, host, upload);
  pack_seconds_ = packed.seconds;
  // The buffers live in locals until everything succeeded. The catch block must not read them
  // from a half-built object: GCC 12 at -O2 dropped such an object's member initializers on the
  // path that throws, and the fault sweep (tests/reliability) caught a catch block freeing stack
  // garbage.
  const DevicePtr codes = alloc_weights(backend, packed.codes.size(), loc);
  DevicePtr scales;
  try {
    scales = alloc_weights(backend, packed.scales.size(), loc);
    backend.copy_h2d(codes, packed.codes.data(), packed.codes.size());
    backend.copy_h2d(scales, packed.scales.data(), packed.scales.size());
  } catch (...) {
    free_quietly(backend, codes);
    free_quietly(backend, scales);
    throw;
  }
  w_ = describe_weights(host);
  w_.packing = packed.packing;
  w_.codes_bytes = packed.codes.size();
  w_.scales_bytes = packed.scales.size();
  w_.fold = packed.fold;
  w_.codes = codes;
  w_.scales = scales;
}

void WeightsResource::release(Backend& backend) {
  free_weights(backend, w_);
}

QuantWeights WeightsResource::take() noexcept {
  QuantWeights out = w_;
  w_.codes = w_.scales = DevicePtr{};
  return out;
}

std::unique_ptr<WeightsResource> make_weights_resource(Backend& backend,
                                                       const HostQuantWeights& host,
                                                       std::string label, UploadLayout upload,
                                                       std::source_location loc) {
  return std::make_unique<WeightsResource>(backend, host, std::move(label), upload, loc);
}

QuantWeights upload_weights(Backend& backend, const HostQuantWeights& w, UploadLayout upload,
                            std::source_location loc) {
  return WeightsResource(backend, w, "weights", upload, loc).take();
}

// Frees both buffers even when the first free fails (a refused free must not leave the other
// buffer to the ledger sweep), then throws the first failure.
void free_weights(Backend& backend, QuantWeights& w) {
  const DevicePtr codes = std::exchange(w.codes, DevicePtr{});
  const DevicePtr scales = std::exchange(w.scales, DevicePtr{});
  if (!codes && !scales) return;  // released already
  try {
    if (codes) backend.free(codes);
  } catch (...) {
    free_quietly(backend, scales);
    throw;
  }
  if (scales) backend.free(scales);
}

}  // namespace metrale::ops
