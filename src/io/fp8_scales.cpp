// FP8 block-128 layers whose block scales are stored otherwise than DeepSeek's F32
// weight_scale_inv, rewritten as one in-memory file that load_fp8_linear reads (the layouts:
// ../shared/reference/formats.md; compressed-tensors' FP8_BLOCK checked on a checkpoint
// llm-compressor made, tests/fixtures/checkpoints/ct-fp8-block).
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "io/messages.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/numerics.h"

namespace metrale {
namespace {

using io::fail_tensor;
using io::shape_str;

constexpr std::int64_t kBlock = 128;

std::int64_t blocks(std::int64_t extent) {
  return (extent + kBlock - 1) / kBlock;
}

std::uint16_t le_u16(const std::byte* p) {
  return static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) |
                                    std::to_integer<unsigned>(p[1]) << 8);
}

}  // namespace

std::optional<SafetensorsFile> fp8_scales_as_inv(const SafetensorsFile& file,
                                                 std::string_view layer) {
  const std::string weight = fmt::format("{}.weight", layer),
                    inv = fmt::format("{}.weight_scale_inv", layer),
                    scale = fmt::format("{}.weight_scale", layer);
  const bool has_inv = file.contains(inv), has_scale = file.contains(scale);
  if (has_inv && file.info(inv).dtype == "F32") return std::nullopt;  // DeepSeek's own layout
  if (!file.contains(weight) || (!has_inv && !has_scale)) return std::nullopt;  // refused later
  const SafetensorsTensorInfo& w = file.info(weight);
  if (w.dtype != "F8_E4M3" || w.shape.size() != 2) return std::nullopt;  // refused later
  const std::int64_t n = w.shape[0], k = w.shape[1];
  const std::vector<std::int64_t> grid{blocks(n), blocks(k)};
  const std::string& name = has_inv ? inv : scale;
  const SafetensorsTensorInfo& s = file.info(name);
  const auto src = file.bytes(name);
  std::vector<float> values;
  if (has_inv && s.dtype == "F8_E8M0" && s.shape == grid) {
    // DeepSeek's UE8M0 variant: 2^(e - 127) per block, 0xFF NaN.
    for (const std::byte b : src) {
      const auto e = std::to_integer<std::uint8_t>(b);
      if (e == 0xFF) fail_tensor(ErrorCode::kIo, file.path(), name, "a block scale is NaN (0xFF)");
      values.push_back(num::e8m0_to_f32(e));
    }
  } else if (!has_inv && s.dtype == "BF16" && s.shape == grid) {
    // compressed-tensors FP8_BLOCK: the multiplier in BF16.
    for (std::size_t i = 0; i < src.size() / 2; ++i) {
      values.push_back(num::bf16_to_f32(le_u16(src.data() + 2 * i)));
    }
  } else if (!has_inv && s.dtype == "F32" &&
             s.shape == std::vector<std::int64_t>{grid[0], 1, grid[1], 1}) {
    // ModelOpt's 2-D blockwise FP8: the multiplier, one per block, in a 4-D shape.
    values.resize(src.size() / 4);
    std::memcpy(values.data(), src.data(), src.size());
  } else {
    fail_tensor(
        ErrorCode::kIo, file.path(), name,
        fmt::format("is {} {}; FP8 weights {} {} take block scales as F32 "
                    "weight_scale_inv {} (DeepSeek, Qwen), F8_E8M0 weight_scale_inv {} "
                    "(UE8M0), BF16 weight_scale {} (compressed-tensors) or F32 "
                    "weight_scale {} (ModelOpt)",
                    s.dtype, shape_str(s.shape), w.dtype, shape_str(w.shape), shape_str(grid),
                    shape_str(grid), shape_str(grid), shape_str({grid[0], 1, grid[1], 1})));
  }
  std::vector<std::byte> scales(values.size() * 4);
  std::memcpy(scales.data(), values.data(), scales.size());
  const auto wb = file.bytes(weight);
  std::vector<OwnedTensor> tensors;
  tensors.push_back(OwnedTensor{weight, w.dtype, w.shape, {wb.begin(), wb.end()}});
  tensors.push_back(OwnedTensor{inv, "F32", grid, std::move(scales)});
  return in_memory_safetensors(file.path(), std::move(tensors));
}

std::string fp8_layer_source(const SafetensorsFile& file, std::string_view layer) {
  const std::string inv = fmt::format("{}.weight_scale_inv", layer),
                    scale = fmt::format("{}.weight_scale", layer);
  if (file.contains(inv)) {
    return file.info(inv).dtype == "F8_E8M0" ? "FP8 block-128 (UE8M0 weight_scale_inv)"
                                             : "FP8 block-128 (F32 weight_scale_inv)";
  }
  if (file.contains(scale) && file.info(scale).dtype == "BF16") {
    return "compressed-tensors FP8 block-128";
  }
  return "ModelOpt FP8 block-128";
}

}  // namespace metrale
