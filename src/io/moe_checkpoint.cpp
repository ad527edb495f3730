#include "metrale/moe_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "io/messages.h"
#include "metrale/numerics.h"

namespace metrale {
namespace {

constexpr std::string_view kBlocks = "_blocks";
constexpr std::int64_t kBlockBytes = num::kMxfp4Group / 2;  // 16 bytes of E2M1 pairs

// Why projection p's tensors do not fit together, with the tensor at fault; nothing when they do.
std::optional<RejectedLayer> check(const SafetensorsFile& f, const std::string& p,
                                   PackedExperts& out) {
  const auto reject = [&](const std::string& tensor, ErrorCode code, std::string why) {
    return RejectedLayer{p, tensor, code, std::move(why), true};
  };
  const std::string blocks = p + std::string(kBlocks), scales = p + "_scales", bias = p + "_bias";
  const SafetensorsTensorInfo& b = f.info(blocks);
  if (b.dtype != "U8" || b.shape.size() != 4 || b.shape[3] != kBlockBytes || b.shape[0] < 1 ||
      b.shape[1] < 1 || b.shape[2] < 1) {
    return reject(blocks, ErrorCode::kIo,
                  fmt::format("{} {}, expected U8 [experts, N, K/32, 16] (gpt-oss MXFP4 blocks)",
                              b.dtype, io::shape_str(b.shape)));
  }
  if (b.shape[0] > INT32_MAX) {
    return reject(blocks, ErrorCode::kIo, fmt::format("{} experts", b.shape[0]));
  }
  if (!f.contains(scales)) {
    return reject(scales, ErrorCode::kNotFound, "missing (the blocks' E8M0 scales)");
  }
  const SafetensorsTensorInfo& s = f.info(scales);
  const std::vector<std::int64_t> want{b.shape[0], b.shape[1], b.shape[2]};
  if (s.dtype != "U8" || s.shape != want) {
    return reject(scales, ErrorCode::kIo,
                  fmt::format("{} {}, expected U8 {} (one E8M0 scale per block of {})", s.dtype,
                              io::shape_str(s.shape), io::shape_str(want), blocks));
  }
  out.projection = p;
  out.experts = static_cast<std::int32_t>(b.shape[0]);
  out.n = b.shape[1];
  out.k = b.shape[2] * num::kMxfp4Group;
  out.bias = f.contains(bias);
  if (out.bias) {
    const SafetensorsTensorInfo& c = f.info(bias);
    const std::vector<std::int64_t> shape{b.shape[0], b.shape[1]};
    if (c.dtype != "BF16" || c.shape != shape) {
      return reject(bias, ErrorCode::kIo,
                    fmt::format("{} {}, expected BF16 {}", c.dtype, io::shape_str(c.shape),
                                io::shape_str(shape)));
    }
  }
  return std::nullopt;
}

}  // namespace

PackedExpertsScan scan_packed_experts(const SafetensorsFile& file) {
  PackedExpertsScan scan;
  for (const std::string& name : file.names()) {
    if (name.size() <= kBlocks.size() || !name.ends_with(kBlocks)) continue;
    const std::string p = name.substr(0, name.size() - kBlocks.size());
    // A float parameter that happens to end in "_blocks" is no packed projection: only U8 blocks
    // or blocks with scales beside them are (and those that do not fit are rejected).
    if (file.info(name).dtype != "U8" && !file.contains(p + "_scales")) continue;
    PackedExperts e;
    if (auto why = check(file, p, e)) {
      scan.rejected.push_back(std::move(*why));
    } else {
      scan.found.push_back(std::move(e));
    }
  }
  return scan;
}

ExpertsWeights load_packed_experts(const SafetensorsFile& file, std::string_view projection) {
  io::require_name(file.path(), "load_packed_experts", projection, "projection");
  const std::string p(projection);
  const std::string blocks = p + std::string(kBlocks), scales = p + "_scales";
  if (!file.contains(blocks)) {
    io::fail_tensor(ErrorCode::kNotFound, file.path(), blocks, "missing (gpt-oss MXFP4 blocks)");
  }
  PackedExperts e;
  if (const auto why = check(file, p, e))
    io::fail_tensor(why->code, file.path(), why->tensor, why->why);
  const auto codes = file.bytes(blocks);
  const auto scale_bytes = file.bytes(scales);
  const auto code_stride = static_cast<std::size_t>(e.n * e.k / 2);
  const auto groups = e.k / num::kMxfp4Group;
  const auto scale_stride = static_cast<std::size_t>(e.n * groups);
  ExpertsWeights out;
  out.experts.reserve(static_cast<std::size_t>(e.experts));
  for (std::int32_t x = 0; x < e.experts; ++x) {
    HostQuantWeights w;
    w.format = WeightFormat::kMxfp4;
    w.layout = WeightLayout::kRowMajor;
    w.n = e.n;
    w.k = e.k;
    w.tensor_scale = 1.0f;
    const auto* c = reinterpret_cast<const std::uint8_t*>(codes.data()) + x * code_stride;
    const auto* s = reinterpret_cast<const std::uint8_t*>(scale_bytes.data()) + x * scale_stride;
    w.codes.assign(c, c + code_stride);
    w.scales.assign(s, s + scale_stride);
    for (std::size_t i = 0; i < scale_stride; ++i) {
      if (s[i] == 0xFFu) {  // E8M0's NaN
        const auto at = static_cast<std::int64_t>(i);
        io::fail_tensor(
            ErrorCode::kIo, file.path(), scales,
            fmt::format("block scale [{}, {}, {}] is NaN (0xFF)", x, at / groups, at % groups));
      }
    }
    out.experts.push_back(std::move(w));
  }
  if (e.bias) {
    const auto b = file.bytes(p + "_bias");
    out.bias.resize(b.size() / 2);
    std::memcpy(out.bias.data(), b.data(), b.size());
  }
  return out;
}

}  // namespace metrale
