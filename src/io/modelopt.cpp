#include "metrale/modelopt.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

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
  std::int64_t n = 0, k = 0;
  std::string weight, scale, scale2, input_scale;  // tensor names; input_scale empty if absent
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

std::optional<Problem> plan_layer(const SafetensorsFile& f, std::string_view layer,
                                  LayerPlan& plan) {
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

}  // namespace

Nvfp4Linear load_nvfp4_linear(const SafetensorsFile& file, std::string_view layer) {
  LayerPlan plan;
  if (const auto p = plan_layer(file, layer, plan)) {
    fail_tensor(p->code, file.path(), p->tensor, p->what);
  }
  Nvfp4Linear out;
  out.source_dtype = file.info(plan.weight).dtype;
  const auto n = plan.n, k = plan.k;
  if (plan.nvfp4) {
    HostQuantWeights& w = out.w;
    w.format = WeightFormat::kNvfp4;
    w.layout = WeightLayout::kRowMajor;
    w.n = n;
    w.k = k;
    const auto codes = file.bytes(plan.weight);
    const auto scales = file.bytes(plan.scale);
    w.codes.resize(codes.size());
    std::memcpy(w.codes.data(), codes.data(), codes.size());
    w.scales.resize(scales.size());
    std::memcpy(w.scales.data(), scales.data(), scales.size());
    for (std::size_t i = 0; i < w.scales.size(); ++i) {
      if ((w.scales[i] & 0x7Fu) == 0x7Fu) {
        const auto idx = static_cast<std::int64_t>(i);
        fail_tensor(ErrorCode::kIo, file.path(), plan.scale,
                    fmt::format("block scale [{}, {}] is NaN (0x{:02X})", idx / (k / 16),
                                idx % (k / 16), w.scales[i]));
      }
    }
    w.tensor_scale = read_scale(file, plan.scale2);
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
  }
  if (!plan.input_scale.empty()) out.input_scale = read_scale(file, plan.input_scale);
  return out;
}

LinearLayerScan scan_linear_layers(const SafetensorsFile& file) {
  constexpr std::string_view kSuffix = ".weight";
  LinearLayerScan out;
  for (const std::string& name : file.names()) {
    if (name.size() <= kSuffix.size() || !name.ends_with(kSuffix)) continue;
    const std::string_view layer = std::string_view(name).substr(0, name.size() - kSuffix.size());
    LayerPlan plan;
    if (auto p = plan_layer(file, layer, plan)) {
      out.rejected.push_back(
          RejectedLayer{std::string(layer), std::move(p->tensor), p->code, std::move(p->what)});
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
