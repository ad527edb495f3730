// The INT4 layouts, as the producers' own code writes them (what tests/fixtures/checkpoints/
// make_int4.py reproduces and checks against the libraries):
//  - compressed-tensors `pack-quantized` (compressed_tensors/compressors/quantized_compressors/
//    pack_quantized: pack_to_int32): "<l>.weight_packed" I32 [N, ceil(K/8)], word i of row n
//    holding k = 8i + j in bits 4j..4j+3 as the signed code plus 8 (so the stored nibble is the
//    unsigned code); "<l>.weight_scale" [N, K/g] ([N, 1] per channel) in the model's dtype;
//    "<l>.weight_zero_point" I32 [ceil(N/8), K/g] (asymmetric only) packed along N, plus 8 alike;
//    "<l>.weight_shape" I64 [2] = [N, K]; "<l>.weight_g_idx" I32 [K], k's group (act order).
//  - GPTQ (AutoGPTQ, GPTQModel: QuantLinear.pack): "<l>.qweight" I32 [K/8, N], word i of column n
//    holding k = 8i + j in bits 4j; "<l>.qzeros" I32 [K/g, N/8], word c holding n = 8c + j in bits
//    4j; "<l>.scales" F16 [K/g, N]; "<l>.g_idx" I32 [K]. The checkpoint format "gptq" (v1, what
//    GPTQ checkpoints ship as) stores the zero points minus one, subtracted from each word as one
//    32-bit integer (GPTQModel's convert_gptq_v2_to_v1_format: qzeros -= 0x11111111), so a zero
//    point of 0 borrows from the nibble above; it is read back the same way (+ 0x11111111 on the
//    word), which recovers every zero point of a GPTQModel file, 0 included (AutoGPTQ's packer ORs
//    a zero point of 0's −1 over the nibbles above it, which nothing recovers: Note [INT4
//    weights]). "gptq_v2" stores them as they are.
//  - AWQ (AutoAWQ WQLinear_GEMM.from_linear): "<l>.qweight" I32 [K, N/8], nibble i of word c
//    holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]; "<l>.qzeros" I32 [K/g, N/8] in the same order
//    (no minus one); "<l>.scales" F16 [K/g, N].
// W = (code − zero) × scale throughout.
#include "io/int4_layers.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "io/messages.h"
#include "metrale/numerics.h"

namespace metrale::io {
namespace {

constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

std::uint32_t word_at(std::span<const std::byte> bytes, std::int64_t i) {
  const std::byte* p = bytes.data() + 4 * i;
  return std::to_integer<std::uint32_t>(p[0]) | std::to_integer<std::uint32_t>(p[1]) << 8 |
         std::to_integer<std::uint32_t>(p[2]) << 16 | std::to_integer<std::uint32_t>(p[3]) << 24;
}

std::uint16_t half_at(std::span<const std::byte> bytes, std::int64_t i) {
  const std::byte* p = bytes.data() + 2 * i;
  return static_cast<std::uint16_t>(std::to_integer<unsigned>(p[0]) |
                                    std::to_integer<unsigned>(p[1]) << 8);
}

bool is_2d(const SafetensorsTensorInfo& t) {
  return t.shape.size() == 2 && t.shape[0] > 0 && t.shape[1] > 0;
}

std::optional<LayerProblem> problem(ErrorCode code, std::string tensor, std::string what) {
  return LayerProblem{code, std::move(tensor), std::move(what)};
}

std::optional<LayerProblem> need(const SafetensorsFile& f, const std::string& name,
                                 std::string_view why) {
  if (f.contains(name)) return std::nullopt;
  return problem(ErrorCode::kNotFound, name, fmt::format("not in the file, but {}", why));
}

std::optional<LayerProblem> expect_i32(const SafetensorsFile& f, const std::string& name,
                                       const std::vector<std::int64_t>& shape,
                                       std::string_view what) {
  const SafetensorsTensorInfo& t = f.info(name);
  if (t.dtype != "I32" || t.shape != shape) {
    return problem(ErrorCode::kIo, name,
                   fmt::format("is {} {}, but {} must be I32 {}", t.dtype, shape_str(t.shape), what,
                               shape_str(shape)));
  }
  return std::nullopt;
}

// The scales' dtype, shape and the group it makes.
std::optional<LayerProblem> plan_scales(const SafetensorsFile& f, Int4Plan& plan,
                                        std::int64_t groups, std::string_view layout) {
  const SafetensorsTensorInfo& s = f.info(plan.scales);
  if (s.dtype != "BF16" && s.dtype != "F16" && s.dtype != "F32") {
    return problem(
        ErrorCode::kIo, plan.scales,
        fmt::format("dtype is {}, but INT4 group scales must be BF16, F16 or F32", s.dtype));
  }
  if (groups <= 0 || plan.k % groups != 0 || !int4_group_ok(plan.k / groups, plan.k)) {
    return problem(ErrorCode::kIo, plan.scales,
                   fmt::format("shape is {}: {} groups over K = {} make no group metrale reads "
                               "(32, 64, a multiple of 128, or one per row; {})",
                               shape_str(s.shape), groups, plan.k, layout));
  }
  plan.group = plan.k / groups;
  return std::nullopt;
}

std::optional<LayerProblem> plan_compressed_tensors(const SafetensorsFile& f,
                                                    std::string_view layer, Int4Plan& plan) {
  plan.producer = Int4Producer::kCompressedTensors;
  plan.weight = fmt::format("{}.weight_packed", layer);
  plan.scales = fmt::format("{}.weight_scale", layer);
  const std::string shape = fmt::format("{}.weight_shape", layer);
  const SafetensorsTensorInfo& w = f.info(plan.weight);
  if (!is_2d(w)) {
    return problem(
        ErrorCode::kIo, plan.weight,
        fmt::format("shape is {}, but INT4 codes must be I32 [N, ceil(K/8)]", shape_str(w.shape)));
  }
  if (auto p = need(f, shape, "INT4 pack-quantized weights carry their [N, K] there")) return p;
  const SafetensorsTensorInfo& si = f.info(shape);
  if ((si.dtype != "I64" && si.dtype != "I32") || si.shape != std::vector<std::int64_t>{2}) {
    return problem(ErrorCode::kIo, shape,
                   fmt::format("is {} {}, but the weight shape must be I64 or I32 [2]", si.dtype,
                               shape_str(si.shape)));
  }
  const auto bytes = f.bytes(shape);
  const bool wide = si.dtype == "I64";
  const auto value = [&](int i) -> std::int64_t {
    if (!wide) return static_cast<std::int32_t>(word_at(bytes, i));
    return static_cast<std::int64_t>(std::uint64_t{word_at(bytes, 2 * i)} |
                                     std::uint64_t{word_at(bytes, 2 * i + 1)} << 32);
  };
  plan.n = value(0);
  plan.k = value(1);
  // K past 2^62 would overflow (K + 7) / 8 before the comparison: refused as a bad shape first.
  if (plan.n != w.shape[0] || plan.k <= 0 || plan.k > (std::int64_t{1} << 62) || plan.k % 2 != 0 ||
      (plan.k + 7) / 8 != w.shape[1]) {
    return problem(ErrorCode::kIo, shape,
                   fmt::format("says [{}, {}], but the codes are {} (want N rows of ceil(K/8) "
                               "words, K even)",
                               plan.n, plan.k, shape_str(w.shape)));
  }
  if (auto p = need(f, plan.scales, "INT4 weights need their group scales")) return p;
  const SafetensorsTensorInfo& s = f.info(plan.scales);
  if (s.shape.size() != 2 || s.shape[0] != plan.n) {
    return problem(ErrorCode::kIo, plan.scales,
                   fmt::format("shape is {}, but INT4 scales must be [N = {}, K/group]",
                               shape_str(s.shape), plan.n));
  }
  if (auto p = plan_scales(f, plan, s.shape[1], "scales [N, K/group]")) return p;
  const std::int64_t groups = plan.k / plan.group;
  const std::string zeros = fmt::format("{}.weight_zero_point", layer);
  if (f.contains(zeros)) {
    plan.zeros = zeros;
    if (auto p = expect_i32(f, zeros, {(plan.n + 7) / 8, groups}, "packed INT4 zero points")) {
      return p;
    }
  }
  const std::string g_idx = fmt::format("{}.weight_g_idx", layer);
  if (f.contains(g_idx)) {
    plan.g_idx = g_idx;
    if (auto p = expect_i32(f, g_idx, {plan.k}, "the act order's group indices")) return p;
  }
  return std::nullopt;
}

// GPTQ or AWQ: told apart by qweight's shape against the scales' N.
std::optional<LayerProblem> plan_qweight(const SafetensorsFile& f, std::string_view layer,
                                         Int4Plan& plan) {
  plan.weight = fmt::format("{}.qweight", layer);
  plan.scales = fmt::format("{}.scales", layer);
  plan.zeros = fmt::format("{}.qzeros", layer);
  const SafetensorsTensorInfo& w = f.info(plan.weight);
  if (w.dtype != "I32" || !is_2d(w)) {
    return problem(ErrorCode::kIo, plan.weight,
                   fmt::format("is {} {}, but GPTQ and AWQ codes are I32 [K/8, N] or [K, N/8]",
                               w.dtype, shape_str(w.shape)));
  }
  if (auto p = need(f, plan.scales, "GPTQ and AWQ weights need their group scales")) return p;
  const SafetensorsTensorInfo& s = f.info(plan.scales);
  if (!is_2d(s)) {
    return problem(
        ErrorCode::kIo, plan.scales,
        fmt::format("shape is {}, but the scales must be [K/group, N]", shape_str(s.shape)));
  }
  if (w.shape[1] == s.shape[1]) {
    plan.producer = Int4Producer::kGptq;
    plan.n = w.shape[1];
    plan.k = w.shape[0] * 8;
  } else if (w.shape[1] * 8 == s.shape[1]) {
    plan.producer = Int4Producer::kAwq;
    plan.n = s.shape[1];
    plan.k = w.shape[0];
    if (plan.k % 2 != 0) {
      return problem(ErrorCode::kIo, plan.weight,
                     fmt::format("shape is {}: K = {} is odd", shape_str(w.shape), plan.k));
    }
  } else {
    return problem(ErrorCode::kIo, plan.weight,
                   fmt::format("shape is {}, which neither GPTQ's [K/8, N] nor AWQ's [K, N/8] "
                               "makes with scales {}",
                               shape_str(w.shape), shape_str(s.shape)));
  }
  if (auto p = plan_scales(f, plan, s.shape[0], "scales [K/group, N]")) return p;
  if (auto p = need(f, plan.zeros, "GPTQ and AWQ weights need their zero points")) return p;
  if (auto p = expect_i32(f, plan.zeros, {plan.k / plan.group, (plan.n + 7) / 8},
                          "packed zero points [K/group, ceil(N/8)]")) {
    return p;
  }
  const std::string g_idx = fmt::format("{}.g_idx", layer);
  if (f.contains(g_idx)) {
    if (plan.producer == Int4Producer::kAwq) {
      return problem(ErrorCode::kIo, g_idx, "is present, but AWQ weights have no act order");
    }
    plan.g_idx = g_idx;
    if (auto p = expect_i32(f, g_idx, {plan.k}, "the act order's group indices")) return p;
  }
  return std::nullopt;
}

// The scales [N, groups] as BF16 or FP16 bytes, from [N, groups] or (transposed) [groups, N].
void read_scales(const SafetensorsFile& f, const Int4Plan& plan, bool transposed,
                 HostQuantWeights& w) {
  const SafetensorsTensorInfo& info = f.info(plan.scales);
  const auto bytes = f.bytes(plan.scales);
  const std::int64_t groups = plan.k / plan.group;
  std::vector<float> values(static_cast<std::size_t>(plan.n * groups));
  for (std::int64_t n = 0; n < plan.n; ++n) {
    for (std::int64_t g = 0; g < groups; ++g) {
      const std::int64_t i = transposed ? g * plan.n + n : n * groups + g;
      const float v = info.dtype == "F32"   ? num::bits_f32(word_at(bytes, i))
                      : info.dtype == "F16" ? num::f16_to_f32(half_at(bytes, i))
                                            : num::bf16_to_f32(half_at(bytes, i));
      if (!std::isfinite(v)) {
        fail_tensor(
            ErrorCode::kIo, f.path(), plan.scales,
            fmt::format("scale [{}] = {} is not finite",
                        transposed ? fmt::format("{}, {}", g, n) : fmt::format("{}, {}", n, g), v));
      }
      values[static_cast<std::size_t>(n * groups + g)] = v;
    }
  }
  // F32 scales are kept where BF16 (else FP16) holds every one exactly; never rounded.
  w.fp16_scales = info.dtype == "F16";
  if (info.dtype == "F32") {
    const auto exact = [&](bool fp16) {
      return std::all_of(values.begin(), values.end(), [&](float v) {
        return (fp16 ? num::f16_to_f32(num::f32_to_f16(v))
                     : num::bf16_to_f32(num::f32_to_bf16(v))) == v;
      });
    };
    if (!exact(false)) {
      if (!exact(true)) {
        fail_tensor(ErrorCode::kIo, f.path(), plan.scales,
                    "F32 scales that neither BF16 nor FP16 holds exactly are not read (metrale's "
                    "INT4 scales are 16-bit)");
      }
      w.fp16_scales = true;
    }
  }
  w.scales.resize(2 * values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint16_t bits =
        w.fp16_scales ? num::f32_to_f16(values[i]) : num::f32_to_bf16(values[i]);
    w.scales[2 * i] = static_cast<std::uint8_t>(bits & 0xFF);
    w.scales[2 * i + 1] = static_cast<std::uint8_t>(bits >> 8);
  }
}

void set_code(HostQuantWeights& w, std::int64_t n, std::int64_t k, std::uint32_t code) {
  std::uint8_t& byte = w.codes[static_cast<std::size_t>(n * (w.k / 2) + k / 2)];
  byte = (k & 1) ? static_cast<std::uint8_t>((byte & 0x0F) | (code << 4))
                 : static_cast<std::uint8_t>((byte & 0xF0) | code);
}

}  // namespace

bool looks_int4(const SafetensorsFile& f, std::string_view layer) {
  const std::string packed = fmt::format("{}.weight_packed", layer);
  return (f.contains(packed) && f.info(packed).dtype == "I32") ||
         f.contains(fmt::format("{}.qweight", layer));
}

std::optional<LayerProblem> plan_int4(const SafetensorsFile& f, std::string_view layer,
                                      Int4Plan& plan) {
  if (f.contains(fmt::format("{}.qweight", layer))) return plan_qweight(f, layer, plan);
  return plan_compressed_tensors(f, layer, plan);
}

HostQuantWeights read_int4(const SafetensorsFile& f, const Int4Plan& plan, GptqZeros zeros) {
  HostQuantWeights w;
  w.format = WeightFormat::kInt4;
  w.n = plan.n;
  w.k = plan.k;
  w.group = plan.group;
  w.codes.assign(static_cast<std::size_t>(plan.n * (plan.k / 2)), 0);
  const auto codes = f.bytes(plan.weight);
  const std::int64_t groups = plan.k / plan.group;
  switch (plan.producer) {
    case Int4Producer::kCompressedTensors: {
      // Each row's words, little-endian, are its codes two to a byte, low nibble first.
      const std::int64_t row_words = (plan.k + 7) / 8;
      for (std::int64_t n = 0; n < plan.n; ++n) {
        std::memcpy(w.codes.data() + n * (plan.k / 2), codes.data() + n * row_words * 4,
                    static_cast<std::size_t>(plan.k / 2));
      }
      break;
    }
    case Int4Producer::kGptq:
      for (std::int64_t i = 0; i < plan.k / 8; ++i) {
        for (std::int64_t n = 0; n < plan.n; ++n) {
          const std::uint32_t word = word_at(codes, i * plan.n + n);
          for (int b = 0; b < 4; ++b) {
            w.codes[static_cast<std::size_t>(n * (plan.k / 2) + 4 * i + b)] =
                static_cast<std::uint8_t>(word >> (8 * b));
          }
        }
      }
      break;
    case Int4Producer::kAwq:
      for (std::int64_t k = 0; k < plan.k; ++k) {
        for (std::int64_t c = 0; c < plan.n / 8; ++c) {
          const std::uint32_t word = word_at(codes, k * (plan.n / 8) + c);
          for (int i = 0; i < 8; ++i) set_code(w, 8 * c + kAwqOrder[i], k, (word >> (4 * i)) & 15);
        }
      }
      break;
  }
  read_scales(f, plan, plan.producer != Int4Producer::kCompressedTensors, w);
  if (!plan.zeros.empty()) {
    const auto z = f.bytes(plan.zeros);
    const std::int64_t words = (plan.n + 7) / 8;
    w.zeros.resize(static_cast<std::size_t>(plan.n * groups));
    for (std::int64_t n = 0; n < plan.n; ++n) {
      for (std::int64_t g = 0; g < groups; ++g) {
        std::uint32_t word = 0;
        int nibble = static_cast<int>(n % 8);
        if (plan.producer == Int4Producer::kCompressedTensors) {
          word = word_at(z, (n / 8) * groups + g);
        } else {
          word = word_at(z, g * words + n / 8);
          if (plan.producer == Int4Producer::kGptq && zeros == GptqZeros::kMinusOne) {
            word += 0x11111111u;
          }
          if (plan.producer == Int4Producer::kAwq) {
            nibble = static_cast<int>(std::find(kAwqOrder, kAwqOrder + 8, n % 8) - kAwqOrder);
          }
        }
        w.zeros[static_cast<std::size_t>(n * groups + g)] =
            static_cast<std::uint8_t>((word >> (4 * nibble)) & 15);
      }
    }
    if (std::all_of(w.zeros.begin(), w.zeros.end(), [](std::uint8_t x) { return x == 8; })) {
      w.zeros.clear();  // symmetric: the kernels skip the zero-point term
    }
  }
  if (!plan.g_idx.empty()) {
    const auto bytes = f.bytes(plan.g_idx);
    std::vector<std::int32_t> g_idx(static_cast<std::size_t>(plan.k));
    for (std::int64_t k = 0; k < plan.k; ++k) {
      g_idx[static_cast<std::size_t>(k)] = static_cast<std::int32_t>(word_at(bytes, k));
    }
    try {
      return with_act_order(w, g_idx);
    } catch (const Error& e) {
      fail_tensor(ErrorCode::kIo, f.path(), plan.g_idx, e.message());
    }
  }
  return w;
}

std::string int4_source(Int4Producer producer) {
  switch (producer) {
    case Int4Producer::kCompressedTensors:
      return "compressed-tensors INT4";
    case Int4Producer::kGptq:
      return "GPTQ INT4";
    case Int4Producer::kAwq:
      return "AWQ INT4";
  }
  return "INT4";
}

}  // namespace metrale::io
