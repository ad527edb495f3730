#include "metrale/fp8_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>

#include "io/messages.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {
namespace {

using io::fail_tensor;
using io::printable;
using io::shape_str;

// The scales are handed out as floats in place, which reads the file's little-endian bytes.
static_assert(std::endian::native == std::endian::little, "FP8 scales are viewed in place");

constexpr std::string_view kWeightSuffix = ".weight";
constexpr std::string_view kScaleSuffix = ".weight_scale_inv";

}  // namespace

E4m3BlockWeightsView load_fp8_linear(const SafetensorsFile& file, std::string_view layer) {
  io::require_name(file.path(), "load_fp8_linear", layer);
  const std::string weight = fmt::format("{}{}", layer, kWeightSuffix);
  const std::string scale = fmt::format("{}{}", layer, kScaleSuffix);
  const auto fail = [&](const std::string& tensor, const std::string& what) {
    fail_tensor(ErrorCode::kIo, file.path(), tensor, what);
  };
  if (!file.contains(weight)) {
    fail(weight, file.contains(scale)
                     ? fmt::format("not in the file, but its FP8 scales '{}' are", printable(scale))
                     : std::string("not in the file"));
  }
  const SafetensorsTensorInfo& w = file.info(weight);
  if (w.dtype != "F8_E4M3") {
    fail(weight,
         fmt::format("dtype is {}, but FP8 weights must be F8_E4M3 (float8_e4m3fn)", w.dtype));
  }
  if (w.shape.size() != 2) {
    fail(weight,
         fmt::format("shape is {}, but FP8 weights must be a matrix [N, K]", shape_str(w.shape)));
  }
  if (w.shape[0] == 0 || w.shape[1] == 0) {
    fail(weight, fmt::format("shape is {}: N and K must be positive", shape_str(w.shape)));
  }
  const std::int64_t n = w.shape[0], k = w.shape[1];
  if (!file.contains(scale)) {
    fail(scale,
         fmt::format("not in the file, but FP8 weights '{}' (F8_E4M3) need it", printable(weight)));
  }
  const SafetensorsTensorInfo& s = file.info(scale);
  if (s.dtype != "F32") {
    fail(scale, fmt::format("dtype is {}, but FP8 block scales must be F32", s.dtype));
  }
  const std::vector<std::int64_t> want{e4m3_blocks(n), e4m3_blocks(k)};
  // transformers 5.17 saves the experts it splits out of a fused FP8 module with their scales
  // squeezed (core_model_loading.py, SplitModulelist: chunk.squeeze()), so a grid with a side of
  // one block is stored without it ([1, 2] as [2]): the same values in the same order.
  std::vector<std::int64_t> squeezed;
  for (const std::int64_t d : want) {
    if (d != 1) squeezed.push_back(d);
  }
  if (s.shape != want && s.shape != squeezed) {
    fail(scale, fmt::format("shape is {}, but weights F8_E4M3 {} (N = {}, K = {}) need {}, one "
                            "scale per 128 x 128 block",
                            shape_str(s.shape), shape_str(w.shape), n, k, shape_str(want)));
  }
  const std::span<const std::byte> code_bytes = file.bytes(weight);
  const std::span<const std::byte> scale_bytes = file.bytes(scale);
  if (reinterpret_cast<std::uintptr_t>(scale_bytes.data()) % alignof(float) != 0) {
    fail(scale, fmt::format("data starts at byte {} of the data section, not a multiple of 4: "
                            "the scales are read in place as F32 (the reference writer aligns "
                            "them)",
                            s.offset));
  }
  E4m3BlockWeightsView out;
  out.n = n;
  out.k = k;
  out.codes = {reinterpret_cast<const std::uint8_t*>(code_bytes.data()), code_bytes.size()};
  out.scales = {reinterpret_cast<const float*>(scale_bytes.data()),
                scale_bytes.size() / sizeof(float)};
  for (std::size_t i = 0; i < out.scales.size(); ++i) {
    const float v = out.scales[i];
    if (!std::isfinite(v) || v < 0.0f) {
      const auto idx = static_cast<std::int64_t>(i);
      fail(scale, fmt::format("scale [{}, {}] = {} is not a finite non-negative scale",
                              idx / want[1], idx % want[1], v));
    }
  }
  for (std::size_t i = 0; i < out.codes.size(); ++i) {
    if ((out.codes[i] & 0x7Fu) == 0x7Fu) {
      const auto idx = static_cast<std::int64_t>(i);
      fail(weight,
           fmt::format("weight [{}, {}] is NaN (0x{:02X})", idx / k, idx % k, out.codes[i]));
    }
  }
  return out;
}

std::vector<std::string> fp8_linear_layers(const SafetensorsFile& file) {
  std::vector<std::string> out;
  for (const std::string& name : file.names()) {
    if (name.size() > kScaleSuffix.size() && name.ends_with(kScaleSuffix)) {
      out.push_back(name.substr(0, name.size() - kScaleSuffix.size()));
    } else if (name.size() > kWeightSuffix.size() && name.ends_with(kWeightSuffix) &&
               file.info(name).dtype == "F8_E4M3") {
      out.push_back(name.substr(0, name.size() - kWeightSuffix.size()));
    }
  }
  // names() order is not layer order ("a.b.weight" < "a.weight"), and a layer appears twice.
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace metrale
