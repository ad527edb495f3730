// INT4 checkpoints (Note [INT4 weights]) read by load_nvfp4_linear and held to what their
// producers' own readers make of the same files (tests/fixtures/checkpoints, make_int4.py):
// compressed-tensors `pack-quantized` written by llm-compressor (symmetric groups of 32,
// asymmetric groups of 128, one scale per row, GPTQ's column order) and read back by
// compressed-tensors; GPTQ (v1 and v2 zero points, act order) and AWQ packed from those
// libraries' published code and read back by an unpacker written from their readers. Every
// code, zero point and scale is compared, and each dequantized weight: exactly for GPTQ and AWQ
// (FP16 scales: (code − zero)·scale is exact in float), after rounding to BF16 for
// compressed-tensors (its reader rounds the product to the scale's dtype). Each convention
// (nibble orders, GPTQ's zeros minus one, scales [N, G] or [G, N]) is shown to matter: read the
// other way, the same file does not match.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/expect_error.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/error.h"
#include "metrale/modelopt.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "metrale/quant_config.h"
#include "metrale/safetensors.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;

std::string folder_of(std::string_view name) {
  return fmt::format("{}/{}", METRALE_CHECKPOINT_FIXTURES, name);
}

template <class T>
std::vector<T> tensor(const SafetensorsFile& f, const std::string& name) {
  const auto bytes = f.bytes(name);
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

const std::vector<std::string> kQuantized = {
    "model.layers.0.mlp.down_proj",    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",      "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.v_proj"};

struct Fixture {
  const char* folder;
  const char* source;
  std::int64_t group;  // 0: one scale per row
  bool zero_points;    // asymmetric (else every zero point is 8 and none is kept)
  bool act_order;
  bool bf16_reference;  // the reader rounds W to BF16 (compressed-tensors)
};

constexpr Fixture kFixtures[] = {
    {"ct-w4a16", "compressed-tensors INT4", 32, false, false, true},
    {"ct-w4a16-asym", "compressed-tensors INT4", 128, true, false, true},
    {"ct-w4a16-channel", "compressed-tensors INT4", 0, false, false, true},
    {"ct-w4a16-actorder", "compressed-tensors INT4", 32, false, false, true},
    {"gptq-v1", "GPTQ INT4", 32, true, false, false},
    {"gptq-v2", "GPTQ INT4", 32, true, false, false},
    {"gptq-desc-act", "GPTQ INT4", 32, false, true, false},
    {"awq", "AWQ INT4", 128, true, false, false},
};

// How the folder's config says GPTQ zero points are stored.
GptqZeros zeros_of(const std::string& folder) {
  const auto declared = read_declared_quantization(folder);
  return declared && declared->gptq_v2 ? GptqZeros::kAsStored : GptqZeros::kMinusOne;
}

// Counts of codes, zero points, scales and weights that differ from the reference's, over a layer.
struct Mismatches {
  long codes = 0, zeros = 0, scales = 0, weights = 0;
};

Mismatches compare_layer(const HostQuantWeights& w, const SafetensorsFile& ref,
                         const std::string& layer, bool bf16_reference) {
  const auto codes = tensor<std::uint8_t>(ref, layer + ".codes");
  const auto zeros = tensor<std::uint8_t>(ref, layer + ".zeros");
  const auto scales = tensor<float>(ref, layer + ".scales");
  const auto deq = tensor<float>(ref, layer + ".dequantized");
  const std::int64_t groups = static_cast<std::int64_t>(scales.size()) / w.n;
  const std::int64_t ref_group = w.k / groups;
  std::vector<double> exact(static_cast<std::size_t>(w.n * w.k));
  w.exact_rows(0, w.n, exact);
  Mismatches m;
  for (std::int64_t n = 0; n < w.n; ++n) {
    for (std::int64_t k = 0; k < w.k; ++k) {
      const auto at = static_cast<std::size_t>(n * w.k + k);
      m.codes += w.code(n, k) != codes[at];
      const auto x = static_cast<float>(exact[at]);
      m.weights += (bf16_reference ? num::bf16_to_f32(num::f32_to_bf16(x)) : x) != deq[at];
      // The reference's zero point and scale of k's group, against ours (k's own).
      if (k % ref_group == 0 || !w.k_perm.empty()) {
        const auto g = static_cast<std::size_t>(n * groups + k / ref_group);
        if (w.k_perm.empty()) {
          m.scales += w.scale(n, k) != scales[g];
        }
        const int zero = w.code(n, k) - static_cast<int>(std::lround(exact[at] / w.scale(n, k)));
        if (w.scale(n, k) != 0.0f && w.k_perm.empty()) m.zeros += zero != zeros[g];
      }
    }
  }
  return m;
}

TEST(Int4Checkpoints, EveryLayerIsReadAsItsProducerReadsIt) {
  for (const Fixture& fx : kFixtures) {
    SCOPED_TRACE(fx.folder);
    const std::string folder = folder_of(fx.folder);
    const SafetensorsFile model = SafetensorsFile::open(folder + "/model.safetensors");
    const SafetensorsFile ref = SafetensorsFile::open(folder + "/reference.safetensors");
    const LinearLayerScan scan = scan_linear_layers(model);
    std::vector<std::string> want = kQuantized;
    want.insert(want.begin(), {"lm_head", "model.embed_tokens"});
    EXPECT_EQ(scan.layers, want);
    for (const RejectedLayer& r : scan.rejected) EXPECT_FALSE(r.quantized) << r.tensor << r.why;
    for (const std::string& layer : kQuantized) {
      SCOPED_TRACE(layer);
      const Nvfp4Linear l = load_nvfp4_linear(model, layer, zeros_of(folder));
      EXPECT_EQ(l.source, fx.source);
      EXPECT_EQ(l.source_dtype, "I32");
      ASSERT_EQ(l.w.format, WeightFormat::kInt4);
      EXPECT_EQ(l.w.group, fx.group == 0 ? l.w.k : fx.group);
      EXPECT_EQ(l.w.zeros.empty(), !fx.zero_points);
      EXPECT_EQ(l.w.k_perm.empty(), !fx.act_order);
      const Mismatches m = compare_layer(l.w, ref, layer, fx.bf16_reference);
      EXPECT_EQ(m.codes, 0);
      EXPECT_EQ(m.zeros, 0);
      EXPECT_EQ(m.scales, 0);
      EXPECT_EQ(m.weights, 0);
    }
  }
}

// GPTQ's historical layout stores each zero point minus one, subtracted from the packed word as one
// integer (a zero of 0 borrows from the nibble above). Read as stored, or one nibble at a time
// plus one (as AutoGPTQ's and vLLM's readers do), the v1 file does not give the zero points back.
TEST(Int4Checkpoints, GptqZerosMinusOneIsReadWordWise) {
  const std::string folder = folder_of("gptq-v1");
  const SafetensorsFile model = SafetensorsFile::open(folder + "/model.safetensors");
  const SafetensorsFile ref = SafetensorsFile::open(folder + "/reference.safetensors");
  long as_stored = 0, borrowed = 0;
  for (const std::string& layer : kQuantized) {
    const Nvfp4Linear v2 = load_nvfp4_linear(model, layer, GptqZeros::kAsStored);
    as_stored += compare_layer(v2.w, ref, layer, false).zeros;
    const auto zeros = tensor<std::uint8_t>(ref, layer + ".zeros");
    const auto nibble = tensor<std::uint8_t>(ref, layer + ".zeros_nibble_plus_one");
    const Nvfp4Linear v1 = load_nvfp4_linear(model, layer);
    for (std::size_t i = 0; i < zeros.size(); ++i) {
      if (zeros[i] != nibble[i]) {
        ++borrowed;
        EXPECT_EQ(v1.w.zeros[i], zeros[i]) << layer << " zero point " << i;
      }
    }
  }
  EXPECT_GT(as_stored, 1000) << "v1 zero points read as stored should be off by one";
  EXPECT_GT(borrowed, 100) << "the fixture should hold zero points of 0 (a borrow)";
  // And the v2 file read as v1 is off too: the config's checkpoint_format decides.
  const SafetensorsFile v2 = SafetensorsFile::open(folder_of("gptq-v2") + "/model.safetensors");
  const SafetensorsFile v2ref =
      SafetensorsFile::open(folder_of("gptq-v2") + "/reference.safetensors");
  EXPECT_EQ(zeros_of(folder_of("gptq-v2")), GptqZeros::kAsStored);
  EXPECT_EQ(zeros_of(folder), GptqZeros::kMinusOne);
  EXPECT_GT(
      compare_layer(load_nvfp4_linear(v2, kQuantized[0]).w, v2ref, kQuantized[0], false).zeros,
      100);
}

// The nibble orders and scale layouts: AWQ's file read with GPTQ's column order, or with its codes
// transposed back as GPTQ's, does not match. (The loader tells the two by qweight's shape; here the
// AWQ words are re-labelled as a GPTQ file of the same bytes.)
TEST(Int4Checkpoints, AwqOrderAndGptqOrderAreNotInterchangeable) {
  const std::string folder = folder_of("awq");
  const SafetensorsFile model = SafetensorsFile::open(folder + "/model.safetensors");
  const SafetensorsFile ref = SafetensorsFile::open(folder + "/reference.safetensors");
  const std::string layer = "model.layers.0.mlp.gate_proj";
  // The same qweight words as a compressed-tensors row order ([N, K/8] words of K order): K = 128
  // and N = 256 let the AWQ words [128, 32] pass as [N = 128 ...]; instead, unpack them with
  // sequential nibbles and compare with the reference codes.
  const auto words = tensor<std::uint32_t>(model, layer + ".qweight");
  const auto codes = tensor<std::uint8_t>(ref, layer + ".codes");
  const std::int64_t n = 256, k = 128;
  long sequential_bad = 0;
  for (std::int64_t kk = 0; kk < k; ++kk) {
    for (std::int64_t c = 0; c < n / 8; ++c) {
      for (int i = 0; i < 8; ++i) {
        const auto code = (words[static_cast<std::size_t>(kk * (n / 8) + c)] >> (4 * i)) & 15;
        sequential_bad += code != codes[static_cast<std::size_t>((8 * c + i) * k + kk)];
      }
    }
  }
  EXPECT_GT(sequential_bad, n * k / 2) << "AWQ's order read sequentially should not match";
  EXPECT_EQ(compare_layer(load_nvfp4_linear(model, layer).w, ref, layer, false).codes, 0);
}

// GPTQ act order: g_idx groups the columns of a permutation; the weights keep K sorted by group
// and k_perm says where each column went, so W itself (in its own K order) is the reference's.
TEST(Int4Checkpoints, GptqActOrderKeepsWInItsOwnOrder) {
  const std::string folder = folder_of("gptq-desc-act");
  const SafetensorsFile model = SafetensorsFile::open(folder + "/model.safetensors");
  const std::string layer = "model.layers.0.mlp.down_proj";
  const auto g_idx = tensor<std::int32_t>(model, layer + ".g_idx");
  const Nvfp4Linear l = load_nvfp4_linear(model, layer);
  ASSERT_EQ(l.w.k_perm.size(), g_idx.size());
  bool trivial = true;
  for (std::size_t k = 0; k < g_idx.size(); ++k) {
    trivial = trivial && g_idx[k] == static_cast<std::int32_t>(k / 32);
  }
  EXPECT_FALSE(trivial) << "the fixture's g_idx should permute the columns";
  for (std::size_t j = 0; j < l.w.k_perm.size(); ++j) {
    EXPECT_EQ(g_idx[static_cast<std::size_t>(l.w.k_perm[j])], static_cast<std::int32_t>(j / 32))
        << "stored column " << j;
  }
}

// compressed-tensors' weight_g_idx (older llm-compressor with actorder "group"; none of these
// versions writes it): the ct-w4a16 layer with a g_idx added reads as W[n, k] = (code − 8)·scale
// of group g_idx[k], read here straight from the file's tensors.
TEST(Int4Checkpoints, CompressedTensorsGIdxGroupsTheColumns) {
  const SafetensorsFile model = SafetensorsFile::open(folder_of("ct-w4a16") + "/model.safetensors");
  const std::string layer = "model.layers.0.mlp.up_proj";
  std::vector<OwnedTensor> tensors;
  for (const char* part : {"weight_packed", "weight_scale", "weight_shape"}) {
    const std::string name = layer + "." + part;
    const auto bytes = model.bytes(name);
    tensors.push_back({name, model.info(name).dtype, model.info(name).shape,
                       std::vector<std::byte>(bytes.begin(), bytes.end())});
  }
  const std::int64_t n = model.info(layer + ".weight_scale").shape[0], k = 64, group = 32;
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i)
    g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i / group);
  std::mt19937 gen(std::random_device{}());
  std::shuffle(g_idx.begin(), g_idx.end(), gen);
  std::vector<std::byte> gbytes(g_idx.size() * 4);
  std::memcpy(gbytes.data(), g_idx.data(), gbytes.size());
  tensors.push_back({layer + ".weight_g_idx", "I32", {k}, gbytes});
  const SafetensorsFile file = in_memory_safetensors("g_idx.safetensors", std::move(tensors));
  const HostQuantWeights w = load_nvfp4_linear(file, layer).w;
  ASSERT_FALSE(w.k_perm.empty());
  const auto words = tensor<std::uint32_t>(file, layer + ".weight_packed");
  const auto scales = tensor<std::uint16_t>(file, layer + ".weight_scale");
  long bad = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t c = 0; c < k; ++c) {
      const auto code = static_cast<int>(
          (words[static_cast<std::size_t>(r * (k / 8) + c / 8)] >> (4 * (c % 8))) & 15);
      const double s = num::bf16_to_f32(
          scales[static_cast<std::size_t>(r * (k / group) + g_idx[static_cast<std::size_t>(c)])]);
      bad += w.exact_weight(r, c) != (code - 8) * s;
    }
  }
  EXPECT_EQ(bad, 0);
}

// Layers that cannot be read are refused by name: missing zero points, a g_idx that does not put
// `group` columns in each group, F32 scales no 16-bit type holds, groups the kernels do not take.
// Tensors "<layer>.<part>" of `model`, copied for an in-memory file.
std::vector<OwnedTensor> copied(const SafetensorsFile& model, const std::string& layer,
                                std::initializer_list<const char*> parts) {
  std::vector<OwnedTensor> out;
  for (const char* part : parts) {
    const std::string name = layer + "." + part;
    const auto bytes = model.bytes(name);
    out.push_back({name, model.info(name).dtype, model.info(name).shape,
                   std::vector<std::byte>(bytes.begin(), bytes.end())});
  }
  return out;
}

TEST(Int4Checkpoints, BadLayersAreRefusedByName) {
  const SafetensorsFile model = SafetensorsFile::open(folder_of("gptq-v1") + "/model.safetensors");
  const std::string layer = "model.layers.0.self_attn.q_proj";
  const auto copy = [&](std::initializer_list<const char*> parts) {
    return copied(model, layer, parts);
  };
  {
    const SafetensorsFile f = in_memory_safetensors("no-zeros", copy({"qweight", "scales"}));
    const Error e = testing::expect_error([&] { (void)load_nvfp4_linear(f, layer); });
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_THAT(e.what(), HasSubstr("q_proj.qzeros"));
  }
  {
    std::vector<OwnedTensor> t = copy({"qweight", "scales", "qzeros", "g_idx"});
    std::memset(t[3].bytes.data(), 0, t[3].bytes.size());  // every column in group 0
    const SafetensorsFile f = in_memory_safetensors("bad-g_idx", std::move(t));
    const Error e = testing::expect_error([&] { (void)load_nvfp4_linear(f, layer); });
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_THAT(e.what(), HasSubstr("q_proj.g_idx"));
    EXPECT_THAT(e.what(), HasSubstr("puts 128 columns in group 0"));
  }
  {
    std::vector<OwnedTensor> t = copy({"qweight", "scales", "qzeros"});
    // F32 scales: 1 + 2^-20 fits neither BF16 nor FP16.
    const std::int64_t count = t[1].shape[0] * t[1].shape[1];
    std::vector<float> f32(static_cast<std::size_t>(count), 1.0f + std::ldexp(1.0f, -20));
    t[1].dtype = "F32";
    t[1].bytes.resize(f32.size() * 4);
    std::memcpy(t[1].bytes.data(), f32.data(), t[1].bytes.size());
    const SafetensorsFile f = in_memory_safetensors("f32-scales", std::move(t));
    const Error e = testing::expect_error([&] { (void)load_nvfp4_linear(f, layer); });
    EXPECT_THAT(e.what(), HasSubstr("neither BF16 nor FP16 holds exactly"));
  }
  {
    std::vector<OwnedTensor> t = copy({"qweight", "scales", "qzeros"});
    // 128 / 16 groups = 8 per group: no group the kernels take.
    t[1].shape = {16, t[1].shape[1]};
    t[1].bytes.resize(static_cast<std::size_t>(16 * t[1].shape[1] * 2));
    t[2].shape = {16, t[2].shape[1]};
    t[2].bytes.resize(static_cast<std::size_t>(16 * t[2].shape[1] * 4));
    const SafetensorsFile f = in_memory_safetensors("group-8", std::move(t));
    const LinearLayerScan scan = scan_linear_layers(f);
    ASSERT_EQ(scan.rejected.size(), 1u);
    EXPECT_TRUE(scan.rejected[0].quantized);
    EXPECT_THAT(scan.rejected[0].why, HasSubstr("16 groups over K = 128"));
  }
}

// A layer with a qweight and a weight (or a weight_packed) beside it is listed once, as
// load_nvfp4_linear plans it: from its qweight.
TEST(Int4Checkpoints, ALayerWithTwoWeightsIsListedOnce) {
  const SafetensorsFile model = SafetensorsFile::open(folder_of("gptq-v1") + "/model.safetensors");
  const std::string layer = "model.layers.0.self_attn.q_proj";
  const std::vector<OwnedTensor> t = copied(model, layer, {"qweight", "scales", "qzeros"});
  for (const char* extra : {"weight", "weight_packed"}) {
    SCOPED_TRACE(extra);
    std::vector<OwnedTensor> two = t;
    const bool bf16 = std::string_view(extra) == "weight";
    two.push_back({layer + "." + extra,
                   bf16 ? "BF16" : "I32",
                   {4, 16},
                   std::vector<std::byte>(bf16 ? 128 : 256)});
    const SafetensorsFile f = in_memory_safetensors("two-weights", std::move(two));
    EXPECT_THAT(linear_layers(f), ::testing::ElementsAre(layer));
    EXPECT_TRUE(scan_linear_layers(f).rejected.empty());
    EXPECT_EQ(load_nvfp4_linear(f, layer).source, "GPTQ INT4");
  }
}

// The declarations: compressed-tensors' pack-quantized INT4, GPTQ (v1 and v2) and AWQ GEMM are
// read; the loaded layers' sources are the ones they declare.
TEST(Int4Checkpoints, TheDeclarationsNameTheLayersSources) {
  for (const Fixture& fx : kFixtures) {
    SCOPED_TRACE(fx.folder);
    const auto declared = read_declared_quantization(folder_of(fx.folder));
    ASSERT_TRUE(declared.has_value());
    EXPECT_THAT(declared->layer_sources, ::testing::ElementsAre(fx.source));
    EXPECT_TRUE(declared->every_linear);
    const SafetensorsFile f = SafetensorsFile::open(folder_of(fx.folder) + "/model.safetensors");
    for (const std::string& layer : kQuantized) {
      EXPECT_EQ(linear_layer_source(f, layer), fx.source) << layer;
    }
    std::vector<std::pair<std::string, std::string>> quantized;
    for (const std::string& layer : kQuantized) quantized.emplace_back(layer, fx.source);
    EXPECT_NO_THROW(check_declared(*declared, "test", quantized, {"lm_head"}));
    // A layer the quantizer skipped is named.
    const Error e = testing::expect_error([&] {
      check_declared(*declared, "test", quantized, {"lm_head", "model.layers.0.mlp.extra"});
    });
    EXPECT_THAT(e.what(), HasSubstr("model.layers.0.mlp.extra"));
  }
}

}  // namespace
}  // namespace metrale
