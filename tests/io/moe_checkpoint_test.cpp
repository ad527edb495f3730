// gpt-oss's packed MXFP4 experts (metrale/moe_checkpoint.h) on the checkpoint
// tests/fixtures/models/make_gptoss.py wrote in openai/gpt-oss-20b's layout: the scan finds each
// projection, and each expert's weights are the file's bytes read by the format's rule, written
// here from the layout's description (the low nibble the even k; E2M1; 2^(u - 127)), not from
// metrale's decoder; python/tests/test_torch_moe.py holds the same weights to transformers' own
// reader. Tensors that do not fit are rejected by name, never passed over.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/moe_checkpoint.h"
#include "metrale/safetensors.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;

const std::string& gptoss_file() {
  static const std::string path =
      fmt::format("{}/../models/gptoss-mxfp4/model.safetensors", METRALE_CHECKPOINT_FIXTURES);
  return path;
}

constexpr double kE2m1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

TEST(MoeCheckpoint, ScanFindsEveryPackedProjection) {
  const SafetensorsFile f = SafetensorsFile::open(gptoss_file());
  const PackedExpertsScan scan = scan_packed_experts(f);
  EXPECT_TRUE(scan.rejected.empty());
  ASSERT_EQ(scan.found.size(), 4u);
  for (const PackedExperts& e : scan.found) {
    SCOPED_TRACE(e.projection);
    const bool gate_up = e.projection.ends_with("gate_up_proj");
    EXPECT_EQ(e.experts, 8);
    EXPECT_EQ(e.n, 256);  // gate_up: 2 x intermediate 128; down: hidden 256
    EXPECT_EQ(e.k, gate_up ? 256 : 128);
    EXPECT_TRUE(e.bias);
    EXPECT_EQ(e.source, "gpt-oss MXFP4");
  }
  EXPECT_EQ(scan.found[0].projection, "model.layers.0.mlp.experts.down_proj");
}

TEST(MoeCheckpoint, EachExpertIsTheFilesBytesByTheLayoutsRule) {
  const SafetensorsFile f = SafetensorsFile::open(gptoss_file());
  for (const char* p :
       {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"}) {
    SCOPED_TRACE(p);
    const ExpertsWeights w = load_packed_experts(f, p);
    const auto blocks = f.bytes(std::string(p) + "_blocks");
    const auto scales = f.bytes(std::string(p) + "_scales");
    const auto bias = f.bytes(std::string(p) + "_bias");
    ASSERT_EQ(w.experts.size(), 8u);
    const std::int64_t n = w.experts[0].n, k = w.experts[0].k, groups = k / 32;
    long bad = 0;
    for (std::size_t e = 0; e < w.experts.size(); ++e) {
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int64_t c = 0; c < k; ++c) {
          // Block g = c / 32 of row r: byte (c % 32) / 2 holds c in its low nibble when c is even.
          const auto at =
              static_cast<std::size_t>(((e * n + r) * groups + c / 32) * 16 + c % 32 / 2);
          const auto byte = std::to_integer<unsigned>(blocks[at]);
          const unsigned code = c % 2 == 0 ? byte & 15u : byte >> 4;
          const auto u =
              std::to_integer<int>(scales[static_cast<std::size_t>((e * n + r) * groups + c / 32)]);
          bad += w.experts[e].exact_weight(r, c) != std::ldexp(kE2m1[code], u - 127);
        }
      }
    }
    EXPECT_EQ(bad, 0);
    ASSERT_EQ(w.bias.size() * 2, bias.size());
    EXPECT_EQ(std::memcmp(w.bias.data(), bias.data(), bias.size()), 0);
  }
}

// A copy of layer 0's gate_up tensors, one of them changed by `edit`.
SafetensorsFile edited(const std::function<void(std::vector<OwnedTensor>&)>& edit) {
  const SafetensorsFile f = SafetensorsFile::open(gptoss_file());
  std::vector<OwnedTensor> t;
  for (const char* part : {"_blocks", "_scales", "_bias"}) {
    const std::string name = std::string("model.layers.0.mlp.experts.gate_up_proj") + part;
    const auto b = f.bytes(name);
    t.push_back({name, f.info(name).dtype, f.info(name).shape, {b.begin(), b.end()}});
  }
  edit(t);
  return in_memory_safetensors("edited.safetensors", std::move(t));
}

TEST(MoeCheckpoint, TensorsThatDoNotFitAreRejectedByName) {
  const std::string p = "model.layers.0.mlp.experts.gate_up_proj";
  struct Case {
    const char* what;
    std::function<void(std::vector<OwnedTensor>&)> edit;
    const char* tensor;
    const char* why;
  };
  const Case cases[] = {
      {"no scales", [](auto& t) { t.erase(t.begin() + 1); }, "_scales", "missing"},
      {"scales of another shape",
       [](auto& t) {
         t[1].shape = {8, 128, 16};
       },
       "_scales", "expected U8 [8, 256, 8]"},
      {"blocks not U8", [](auto& t) { t[0].dtype = "I8"; }, "_blocks", "expected U8"},
      {"blocks of 32 bytes",
       [](auto& t) {
         t[0].shape = {8, 256, 4, 32};
       },
       "_blocks", "[experts, N, K/32, 16]"},
      {"an F32 bias",
       [](auto& t) {
         t[2].dtype = "F32";
         t[2].shape = {8, 128};
       },
       "_bias", "expected BF16 [8, 256]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const SafetensorsFile f = edited(c.edit);
    const PackedExpertsScan scan = scan_packed_experts(f);
    EXPECT_TRUE(scan.found.empty());
    ASSERT_EQ(scan.rejected.size(), 1u);
    EXPECT_EQ(scan.rejected[0].tensor, p + c.tensor);
    EXPECT_THAT(scan.rejected[0].why, HasSubstr(c.why));
    EXPECT_TRUE(scan.rejected[0].quantized);
    const Error e = testing::expect_error([&] { (void)load_packed_experts(f, p); });
    EXPECT_THAT(e.what(), HasSubstr(p + c.tensor));
  }
  // A BF16 parameter that merely ends in "_blocks", with no scales: not a projection, not refused.
  const SafetensorsFile plain = edited([](auto& t) {
    t.erase(t.begin() + 1);
    t[0].dtype = "BF16";
    t[0].shape = {8, 256, 8, 8};
  });
  const PackedExpertsScan none = scan_packed_experts(plain);
  EXPECT_TRUE(none.found.empty());
  EXPECT_TRUE(none.rejected.empty());
  // A NaN scale (E8M0 0xFF) passes the header and is refused on load, naming where it is.
  const SafetensorsFile nan =
      edited([](auto& t) { t[1].bytes[5 * 256 * 8 + 3 * 8 + 2] = std::byte{0xFF}; });
  EXPECT_EQ(scan_packed_experts(nan).found.size(), 1u);
  EXPECT_ERROR((void)load_packed_experts(nan, p), ErrorCode::kIo, "block scale [5, 3, 2] is NaN");
  EXPECT_ERROR((void)load_packed_experts(nan, "model.layers.0.mlp.experts.up_proj"),
               ErrorCode::kNotFound, "up_proj_blocks");
  // An empty projection ("_blocks", "_scales": the scan names none) is refused as an argument.
  std::vector<OwnedTensor> bare;
  for (const char* suffix : {"_blocks", "_scales"}) {
    const std::string name = p + suffix;
    const auto bytes = nan.bytes(name);
    bare.push_back({suffix, nan.info(name).dtype, nan.info(name).shape,
                    std::vector<std::byte>(bytes.begin(), bytes.end())});
  }
  const SafetensorsFile unnamed = in_memory_safetensors("unnamed", std::move(bare));
  EXPECT_TRUE(scan_packed_experts(unnamed).found.empty());
  EXPECT_ERROR((void)load_packed_experts(unnamed, ""), ErrorCode::kInvalidArgument,
               "load_packed_experts: the projection name is empty");
}

// transformers 5.17's FP8 Qwen3-MoE (make_moe_models.py): the experts it splits out of its fused
// FP8 module keep their block scales squeezed ([1, 2] stored as [2]); they load as the [1, 2] grid
// they are. A flattened grid with no side of one ([2, 2] as [4]) is still refused.
TEST(MoeCheckpoint, TransformersSqueezedFp8ExpertScalesLoad) {
  const SafetensorsFile f = SafetensorsFile::open(fmt::format(
      "{}/../models/qwen3moe-transformers-fp8/model.safetensors", METRALE_CHECKPOINT_FIXTURES));
  for (const char* layer :
       {"model.layers.0.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.7.down_proj"}) {
    SCOPED_TRACE(layer);
    const std::string scale = std::string(layer) + ".weight_scale_inv";
    ASSERT_EQ(f.info(scale).shape.size(), 1u);
    const E4m3BlockWeightsView w = load_fp8_linear(f, layer);
    const auto bytes = f.bytes(scale);
    ASSERT_EQ(w.scales.size() * 4, bytes.size());
    EXPECT_EQ(std::memcmp(w.scales.data(), bytes.data(), bytes.size()), 0);
  }
  const std::string q = "model.layers.0.self_attn.q_proj";
  std::vector<OwnedTensor> t;
  for (const char* part : {".weight", ".weight_scale_inv"}) {
    const std::string name = q + part;
    const auto b = f.bytes(name);
    t.push_back({name, f.info(name).dtype, f.info(name).shape, {b.begin(), b.end()}});
  }
  ASSERT_EQ(t[1].shape, (std::vector<std::int64_t>{2, 2}));
  t[1].shape = {4};
  const SafetensorsFile flat = in_memory_safetensors("flat.safetensors", std::move(t));
  EXPECT_ERROR((void)load_fp8_linear(flat, q), ErrorCode::kIo, "shape is [4]");
}

}  // namespace
}  // namespace metrale
