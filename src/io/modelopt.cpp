#include "metrale/modelopt.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "io/int4_layers.h"
#include "io/messages.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {
namespace {

using io::fail_tensor;
using io::printable;
using io::shape_str;

struct Problem {
  ErrorCode code;
  std::string tensor;
  std::string what;
};

// What load_nvfp4_linear reads for a layer, found from the header alone.
struct LayerPlan {
  bool nvfp4 = false;  // U8 codes + scales, or else a BF16/F32 matrix to quantize
  // compressed-tensors' names (weight_packed, weight_global_scale: a divisor), or ModelOpt's.
  bool compressed_tensors = false;
  WeightFormat format = WeightFormat::kNvfp4;
  std::int64_t n = 0, k = 0;
  std::string weight, scale, scale2, input_scale;  // tensor names; scale2, input_scale may be empty
  std::optional<io::Int4Plan> int4;                // INT4 layers: what int4_layers.h reads
};

bool is_scalar(const SafetensorsTensorInfo& i) {
  return i.shape.empty() || (i.shape.size() == 1 && i.shape[0] == 1);
}

// A scalar F32 tensor's problem, if any.
std::optional<Problem> check_f32_scalar(const SafetensorsFile& f, const std::string& name,
                                        std::string_view role) {
  const SafetensorsTensorInfo& i = f.info(name);
  if (i.dtype != "F32") {
    return Problem{ErrorCode::kIo, name,
                   fmt::format("dtype is {}, but the {} must be F32", i.dtype, role)};
  }
  if (!is_scalar(i)) {
    return Problem{ErrorCode::kIo, name,
                   fmt::format("shape is {}, but the {} must be a scalar ([] or [1])",
                               shape_str(i.shape), role)};
  }
  return std::nullopt;
}

// A compressed-tensors `nvfp4-pack-quantized` or `mxfp4-pack-quantized` layer (the formats'
// tensors: ../shared/reference/formats.md, checked against files llm-compressor made,
// tests/fixtures/checkpoints): "<layer>.weight_packed" U8 [N, K/2] (low nibble = even k, as
// ModelOpt), "<layer>.weight_scale" F8_E4M3 [N, K/16] with "<layer>.weight_global_scale" F32 [1]
// (NVFP4: the tensor scale is 1 / it), or U8 E8M0 [N, K/32] (MXFP4); "<layer>.input_global_scale"
// (W4A4: the input scale is 1 / it).
std::optional<Problem> plan_compressed_tensors(const SafetensorsFile& f, std::string_view layer,
                                               LayerPlan& plan) {
  plan.compressed_tensors = true;
  plan.nvfp4 = true;
  plan.weight = fmt::format("{}.weight_packed", layer);
  plan.scale = fmt::format("{}.weight_scale", layer);
  const SafetensorsTensorInfo& w = f.info(plan.weight);
  if (w.dtype != "U8" || w.shape.size() != 2 || w.shape[0] == 0 || w.shape[1] == 0 ||
      w.shape[1] > std::numeric_limits<std::int64_t>::max() / 2) {
    return Problem{ErrorCode::kIo, plan.weight,
                   fmt::format("is {} {}, but packed FP4 codes must be a non-empty U8 [N, K/2] "
                               "(INT4 codes: I32)",
                               w.dtype, shape_str(w.shape))};
  }
  for (const char* unread : {"weight_zero_point", "weight_g_idx"}) {
    const std::string name = fmt::format("{}.{}", layer, unread);
    if (f.contains(name)) {
      return Problem{ErrorCode::kIo, name,
                     "is present: asymmetric or reordered FP4 weights are not read"};
    }
  }
  if (!f.contains(plan.scale)) {
    return Problem{ErrorCode::kNotFound, plan.scale,
                   fmt::format("not in the file, but packed FP4 weights '{}' need it",
                               printable(plan.weight))};
  }
  plan.n = w.shape[0];
  plan.k = w.shape[1] * 2;
  const SafetensorsTensorInfo& s = f.info(plan.scale);
  const bool mx = s.dtype == "U8";
  if (!mx && s.dtype != "F8_E4M3") {
    return Problem{ErrorCode::kIo, plan.scale,
                   fmt::format("dtype is {}, but FP4 block scales must be F8_E4M3 (NVFP4) or U8 "
                               "E8M0 (MXFP4)",
                               s.dtype)};
  }
  plan.format = mx ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
  const std::int64_t group = mx ? num::kMxfp4Group : num::kNvfp4Group;
  if (plan.k % group != 0) {
    return Problem{ErrorCode::kIo, plan.weight,
                   fmt::format("shape is {}: K = {} is not a multiple of {}, the {} block size",
                               shape_str(w.shape), plan.k, group, mx ? "MXFP4" : "NVFP4")};
  }
  const std::vector<std::int64_t> want{plan.n, plan.k / group};
  if (s.shape != want) {
    return Problem{
        ErrorCode::kIo, plan.scale,
        fmt::format("shape is {}, but weights U8 {} (N = {}, K = {}) need {}", shape_str(s.shape),
                    shape_str(w.shape), plan.n, plan.k, shape_str(want))};
  }
  const std::string global = fmt::format("{}.weight_global_scale", layer);
  if (mx) {
    if (f.contains(global)) {
      return Problem{ErrorCode::kIo, global,
                     "is present, but MXFP4 (E8M0 block scales) takes no global scale"};
    }
  } else {
    if (!f.contains(global)) {
      return Problem{
          ErrorCode::kNotFound, global,
          fmt::format("not in the file, but NVFP4 weights '{}' need it", printable(plan.weight))};
    }
    if (auto p = check_f32_scalar(f, global, "NVFP4 global scale")) return p;
    plan.scale2 = global;
  }
  const std::string input = fmt::format("{}.input_global_scale", layer);
  if (f.contains(input)) {
    if (auto p = check_f32_scalar(f, input, "input global scale")) return p;
    plan.input_scale = input;
  }
  return std::nullopt;
}

std::optional<Problem> plan_layer(const SafetensorsFile& f, std::string_view layer,
                                  LayerPlan& plan) {
  if (io::looks_int4(f, layer)) {
    plan.int4.emplace();
    if (auto p = io::plan_int4(f, layer, *plan.int4)) {
      return Problem{p->code, std::move(p->tensor), std::move(p->what)};
    }
    plan.weight = plan.int4->weight;
    plan.n = plan.int4->n;
    plan.k = plan.int4->k;
    return std::nullopt;
  }
  if (f.contains(fmt::format("{}.weight_packed", layer))) {
    return plan_compressed_tensors(f, layer, plan);
  }
  plan.weight = fmt::format("{}.weight", layer);
  plan.scale = fmt::format("{}.weight_scale", layer);
  plan.scale2 = fmt::format("{}.weight_scale_2", layer);
  if (!f.contains(plan.weight))
    return Problem{ErrorCode::kNotFound, plan.weight, "not in the file"};
  const SafetensorsTensorInfo& w = f.info(plan.weight);
  if (w.dtype == "U8") {
    plan.nvfp4 = true;
    if (w.shape.size() != 2 || w.shape[0] == 0 || w.shape[1] == 0) {
      return Problem{ErrorCode::kIo, plan.weight,
                     fmt::format("shape is {}, but NVFP4 codes (U8) must be a non-empty [N, K/2]",
                                 shape_str(w.shape))};
    }
    plan.n = w.shape[0];
    if (w.shape[1] > std::numeric_limits<std::int64_t>::max() / 2 || w.shape[1] * 2 % 16 != 0) {
      return Problem{ErrorCode::kIo, plan.weight,
                     fmt::format("shape is {}: K = 2 x {} is not a multiple of 16, the NVFP4 "
                                 "block size",
                                 shape_str(w.shape), w.shape[1])};
    }
    plan.k = w.shape[1] * 2;
    for (const std::string* name : {&plan.scale, &plan.scale2}) {
      if (!f.contains(*name)) {
        return Problem{ErrorCode::kNotFound, *name,
                       fmt::format("not in the file, but NVFP4 weights '{}' (U8) need it",
                                   printable(plan.weight))};
      }
    }
    const SafetensorsTensorInfo& s = f.info(plan.scale);
    if (s.dtype != "F8_E4M3") {
      return Problem{ErrorCode::kIo, plan.scale,
                     fmt::format("dtype is {}, but NVFP4 block scales must be F8_E4M3", s.dtype)};
    }
    const std::vector<std::int64_t> want{plan.n, plan.k / 16};
    if (s.shape != want) {
      return Problem{
          ErrorCode::kIo, plan.scale,
          fmt::format("shape is {}, but weights {} {} (N = {}, K = {}) need {}", shape_str(s.shape),
                      w.dtype, shape_str(w.shape), plan.n, plan.k, shape_str(want))};
    }
    if (auto p = check_f32_scalar(f, plan.scale2, "NVFP4 tensor scale")) return p;
  } else if (w.dtype == "BF16" || w.dtype == "F32") {
    if (w.shape.size() != 2 || w.shape[0] == 0 || w.shape[1] == 0 || w.shape[1] % 16 != 0) {
      return Problem{ErrorCode::kIo, plan.weight,
                     fmt::format("shape is {}, but {} weights must be [N, K] with K a positive "
                                 "multiple of 16",
                                 shape_str(w.shape), w.dtype)};
    }
    plan.n = w.shape[0];
    plan.k = w.shape[1];
    for (const std::string* name : {&plan.scale, &plan.scale2}) {
      if (f.contains(*name)) {
        return Problem{ErrorCode::kIo, *name,
                       fmt::format("is present, but weights '{}' are {}, not NVFP4 codes (U8)",
                                   printable(plan.weight), w.dtype)};
      }
    }
  } else {
    return Problem{ErrorCode::kIo, plan.weight,
                   fmt::format("dtype {} cannot be loaded as NVFP4: want U8 codes (with F8_E4M3 "
                               "weight_scale and F32 weight_scale_2), BF16 or F32",
                               w.dtype)};
  }
  const std::string input = fmt::format("{}.input_scale", layer);
  if (f.contains(input)) {
    if (auto p = check_f32_scalar(f, input, "input scale")) return p;
    plan.input_scale = input;
  }
  return std::nullopt;
}

std::uint32_t le_u32(const std::byte* p) {
  return std::to_integer<std::uint32_t>(p[0]) | std::to_integer<std::uint32_t>(p[1]) << 8 |
         std::to_integer<std::uint32_t>(p[2]) << 16 | std::to_integer<std::uint32_t>(p[3]) << 24;
}

// A scalar F32 tensor's value, which must be finite and non-negative.
float read_scale(const SafetensorsFile& f, const std::string& name) {
  const float v = num::bits_f32(le_u32(f.bytes(name).data()));
  if (!std::isfinite(v) || v < 0.0f) {
    fail_tensor(ErrorCode::kIo, f.path(), name,
                fmt::format("value {} is not a finite non-negative scale", v));
  }
  return v;
}

// A compressed-tensors global scale: a divisor, finite and positive; its reciprocal is the
// multiplier (what compressed-tensors' dequantization divides by, multiplied).
float read_divisor(const SafetensorsFile& f, const std::string& name) {
  const float v = num::bits_f32(le_u32(f.bytes(name).data()));
  if (!std::isfinite(v) || !(v > 0.0f)) {
    fail_tensor(ErrorCode::kIo, f.path(), name,
                fmt::format("value {} is not a finite positive global scale", v));
  }
  return 1.0f / v;
}

// What a planned layer reads as (Nvfp4Linear::source), weights of `dtype`.
std::string source_of(const LayerPlan& plan, std::string_view dtype) {
  if (plan.int4) return io::int4_source(plan.int4->producer);
  if (!plan.nvfp4) return fmt::format("{}, quantized to NVFP4 on load", dtype);
  if (!plan.compressed_tensors) return "ModelOpt NVFP4";
  return plan.format == WeightFormat::kMxfp4 ? "compressed-tensors MXFP4"
                                             : "compressed-tensors NVFP4";
}

// `layer`'s plan, or the error its header gives (a named empty layer as `api`'s argument).
LayerPlan planned(const SafetensorsFile& file, std::string_view layer, std::string_view api) {
  io::require_name(file.path(), api, layer);
  LayerPlan plan;
  if (const auto p = plan_layer(file, layer, plan)) {
    fail_tensor(p->code, file.path(), p->tensor, p->what);
  }
  return plan;
}

}  // namespace

std::string linear_layer_source(const SafetensorsFile& file, std::string_view layer) {
  const LayerPlan plan = planned(file, layer, "linear_layer_source");
  return source_of(plan, file.info(plan.weight).dtype);
}

Nvfp4Linear load_nvfp4_linear(const SafetensorsFile& file, std::string_view layer,
                              GptqZeros gptq_zeros) {
  const LayerPlan plan = planned(file, layer, "load_nvfp4_linear");
  Nvfp4Linear out;
  out.source_dtype = file.info(plan.weight).dtype;
  if (plan.int4) {
    out.w = io::read_int4(file, *plan.int4, gptq_zeros);
    out.source = source_of(plan, out.source_dtype);
    return out;
  }
  const auto n = plan.n, k = plan.k;
  if (plan.nvfp4) {
    HostQuantWeights& w = out.w;
    w.format = plan.format;
    w.layout = WeightLayout::kRowMajor;
    w.n = n;
    w.k = k;
    const auto codes = file.bytes(plan.weight);
    const auto scales = file.bytes(plan.scale);
    w.codes.resize(codes.size());
    std::memcpy(w.codes.data(), codes.data(), codes.size());
    w.scales.resize(scales.size());
    std::memcpy(w.scales.data(), scales.data(), scales.size());
    const bool mx = plan.format == WeightFormat::kMxfp4;
    const std::int64_t groups = k / (mx ? num::kMxfp4Group : num::kNvfp4Group);
    for (std::size_t i = 0; i < w.scales.size(); ++i) {
      // NaN: E4M3's S.1111.111, E8M0's 0xFF.
      if (mx ? w.scales[i] == 0xFFu : (w.scales[i] & 0x7Fu) == 0x7Fu) {
        const auto idx = static_cast<std::int64_t>(i);
        fail_tensor(ErrorCode::kIo, file.path(), plan.scale,
                    fmt::format("block scale [{}, {}] is NaN (0x{:02X})", idx / groups,
                                idx % groups, w.scales[i]));
      }
    }
    if (mx) {
      w.tensor_scale = 1.0f;
    } else {
      w.tensor_scale =
          plan.compressed_tensors ? read_divisor(file, plan.scale2) : read_scale(file, plan.scale2);
    }
    out.source = source_of(plan, out.source_dtype);
  } else {
    const auto bytes = file.bytes(plan.weight);
    const bool bf16 = out.source_dtype == "BF16";
    std::vector<float> values(static_cast<std::size_t>(n * k));
    for (std::size_t i = 0; i < values.size(); ++i) {
      const float v = bf16 ? num::bf16_to_f32(static_cast<std::uint16_t>(
                                 std::to_integer<unsigned>(bytes[2 * i]) |
                                 std::to_integer<unsigned>(bytes[2 * i + 1]) << 8))
                           : num::bits_f32(le_u32(bytes.data() + 4 * i));
      if (!std::isfinite(v)) {
        const auto idx = static_cast<std::int64_t>(i);
        fail_tensor(ErrorCode::kIo, file.path(), plan.weight,
                    fmt::format("weight [{}, {}] = {} is not finite", idx / k, idx % k, v));
      }
      values[i] = v;
    }
    out.w = quantize_nvfp4(values, n, k);
    out.source = source_of(plan, out.source_dtype);
  }
  if (!plan.input_scale.empty()) {
    out.input_scale = plan.compressed_tensors ? read_divisor(file, plan.input_scale)
                                              : read_scale(file, plan.input_scale);
  }
  return out;
}

LinearLayerScan scan_linear_layers(const SafetensorsFile& file) {
  LinearLayerScan out;
  for (const std::string& name : file.names()) {
    // A layer's weight: ModelOpt's (and plain) "<layer>.weight", compressed-tensors'
    // "<layer>.weight_packed" or GPTQ's and AWQ's "<layer>.qweight"; a layer with several is
    // listed once, as plan_layer plans it (qweight first, then weight_packed).
    std::string_view layer;
    if (name.ends_with(".qweight") && name.size() > 8) {
      layer = std::string_view(name).substr(0, name.size() - 8);
    } else if (name.ends_with(".weight_packed") && name.size() > 14) {
      layer = std::string_view(name).substr(0, name.size() - 14);
      if (file.contains(fmt::format("{}.qweight", layer))) continue;
    } else if (name.ends_with(".weight") && name.size() > 7) {
      layer = std::string_view(name).substr(0, name.size() - 7);
      if (file.contains(fmt::format("{}.weight_packed", layer)) ||
          file.contains(fmt::format("{}.qweight", layer))) {
        continue;
      }
    } else {
      continue;
    }
    LayerPlan plan;
    if (auto p = plan_layer(file, layer, plan)) {
      const std::string& dtype = file.info(name).dtype;
      // Quantized-looking: packed or FP8 or integer weights, or scales beside them.
      const bool quantized = name.ends_with(".weight_packed") || name.ends_with(".qweight") ||
                             dtype == "U8" || dtype == "I8" || dtype == "I32" ||
                             dtype.starts_with("F8") ||
                             file.contains(fmt::format("{}.weight_scale", layer));
      out.rejected.push_back(RejectedLayer{std::string(layer), std::move(p->tensor), p->code,
                                           std::move(p->what), quantized});
    } else {
      out.layers.emplace_back(layer);
    }
  }
  // "a" < "a.b", but "a.b.weight" < "a.weight": names() order is not layer order.
  std::sort(out.layers.begin(), out.layers.end());
  std::sort(out.rejected.begin(), out.rejected.end(),
            [](const RejectedLayer& a, const RejectedLayer& b) { return a.layer < b.layer; });
  return out;
}

std::vector<std::string> linear_layers(const SafetensorsFile& file) {
  return scan_linear_layers(file).layers;
}

std::vector<std::string> require_linear_layers(const SafetensorsFile& file) {
  LinearLayerScan scan = scan_linear_layers(file);
  if (!scan.layers.empty()) return std::move(scan.layers);
  if (scan.rejected.empty()) {
    io::fail_file(ErrorCode::kIo, file.path(),
                  "holds no linear layer metrale can load: no tensor is named '<layer>.weight'");
  }
  // Every candidate, so that a file whose layers all share one fault says which and why.
  std::string why = fmt::format(
      "holds no linear layer metrale can load; each of its {} candidate(s) was rejected:",
      scan.rejected.size());
  for (const RejectedLayer& r : scan.rejected) {
    why += fmt::format("\n  tensor '{}': {}", printable(r.tensor), r.why);
  }
  io::fail_file(ErrorCode::kIo, file.path(), why);
}

}  // namespace metrale
