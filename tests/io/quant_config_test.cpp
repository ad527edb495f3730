// read_declared_quantization on the configs the producers wrote (tests/fixtures/checkpoints:
// llm-compressor's compressed-tensors NVFP4A16, MXFP4A16, FP8_BLOCK and INT4 W4A16, ModelOpt's
// NVFP4 export with its hf_quant_config.json; tests/fixtures/models: whole small models), and
// check_declared holding tensors to a declaration: each planted disagreement (another format,
// an ignored layer held quantized, a skipped layer, a format metrale does not read) refused by
// name. Folders with rewritten configs are written under the test's temporary directory.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "metrale/error.h"
#include "metrale/quant_config.h"

namespace metrale {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string checkpoint(std::string_view folder) {
  return fmt::format("{}/{}", METRALE_CHECKPOINT_FIXTURES, folder);
}

std::string model(std::string_view folder) {
  return fmt::format("{}/../models/{}", METRALE_CHECKPOINT_FIXTURES, folder);
}

// A folder holding config.json (and hf_quant_config.json when given) with these texts.
std::string folder_with(std::string_view name, std::string_view config,
                        std::string_view hf_quant = {}) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / "quant_config" / name;
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << config;
  if (!hf_quant.empty()) std::ofstream(dir / "hf_quant_config.json") << hf_quant;
  return dir.string();
}

const std::vector<std::pair<std::string, std::string>> kCtNvfp4 = {
    {"model.layers.0.mlp.down_proj", "compressed-tensors NVFP4"},
    {"model.layers.0.self_attn.q_proj", "compressed-tensors NVFP4"}};

// The message check_declared throws for these layers, or "" when it accepts them.
std::string refusal(const DeclaredQuantization& d,
                    const std::vector<std::pair<std::string, std::string>>& quantized,
                    const std::vector<std::string>& plain) {
  try {
    check_declared(d, "test", quantized, plain);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    return e.what();
  }
  return "";
}

TEST(DeclaredQuantization, CompressedTensorsFormatsAsWritten) {
  const auto nv = read_declared_quantization(checkpoint("ct-nvfp4a16"));
  ASSERT_TRUE(nv.has_value());
  EXPECT_EQ(nv->file, checkpoint("ct-nvfp4a16") + "/config.json (quantization_config)");
  EXPECT_EQ(nv->describe(), "compressed-tensors 'nvfp4-pack-quantized' (" + nv->file + ")");
  EXPECT_THAT(nv->layer_sources, ElementsAre("compressed-tensors NVFP4"));
  EXPECT_THAT(nv->ignore, ElementsAre("lm_head"));
  EXPECT_TRUE(nv->every_linear);
  EXPECT_FALSE(nv->quantized_activations);
  EXPECT_EQ(nv->activations, "");

  const auto mx = read_declared_quantization(model("qwen3-ct-mxfp4a16"));
  ASSERT_TRUE(mx.has_value());
  EXPECT_THAT(mx->layer_sources, ElementsAre("compressed-tensors MXFP4"));

  // FP8_BLOCK with dynamic per-token-group activations: what the W8A8 op does.
  const auto fp8 = read_declared_quantization(checkpoint("ct-fp8-block"));
  ASSERT_TRUE(fp8.has_value());
  EXPECT_EQ(fp8->format, "float-quantized (FP8 block [128, 128])");
  EXPECT_THAT(fp8->layer_sources, ElementsAre("compressed-tensors FP8 block-128"));
  EXPECT_TRUE(fp8->quantized_activations);
  EXPECT_THAT(fp8->activations, HasSubstr("dynamic per-token-group"));

  // INT4 pack-quantized (W4A16, groups of 32): compressed-tensors INT4 layers.
  const auto int4 = read_declared_quantization(checkpoint("ct-w4a16"));
  ASSERT_TRUE(int4.has_value());
  EXPECT_EQ(int4->format, "pack-quantized");
  EXPECT_THAT(int4->layer_sources, ElementsAre("compressed-tensors INT4"));
  EXPECT_FALSE(int4->quantized_activations);
}

TEST(DeclaredQuantization, ModelOptW4A4AndW4A16) {
  // The export writes both config.json's quantization_config and hf_quant_config.json; the
  // first is read, and says W4A4 (input_activations of 4 bits), which metrale runs as W4A16.
  const auto w4a4 = read_declared_quantization(checkpoint("modelopt-nvfp4"));
  ASSERT_TRUE(w4a4.has_value());
  EXPECT_EQ(w4a4->describe(), "modelopt 'NVFP4' (" + checkpoint("modelopt-nvfp4") +
                                  "/config.json (quantization_config))");
  EXPECT_THAT(w4a4->layer_sources, ElementsAre("ModelOpt NVFP4"));
  EXPECT_THAT(w4a4->ignore, ElementsAre("lm_head", "model.embed_tokens"));
  EXPECT_TRUE(w4a4->quantized_activations);
  EXPECT_THAT(w4a4->activations, HasSubstr("metrale keeps them BF16 and runs W4A16"));

  // An older export: hf_quant_config.json alone, with a W4A16 algorithm and wildcards.
  const std::string dir = folder_with("modelopt_w4a16", R"({"model_type": "llama"})",
                                      R"({"quantization": {"quant_algo": "W4A16_NVFP4",
                                          "exclude_modules": ["lm_head", "*.mlp.gate"]}})");
  const auto w4a16 = read_declared_quantization(dir);
  ASSERT_TRUE(w4a16.has_value());
  EXPECT_EQ(w4a16->file, dir + "/hf_quant_config.json");
  EXPECT_FALSE(w4a16->quantized_activations);
  EXPECT_EQ(w4a16->activations, "");
  EXPECT_TRUE(declared_ignores(*w4a16, "model.layers.3.mlp.gate"));
  EXPECT_FALSE(declared_ignores(*w4a16, "model.layers.3.mlp.gate_proj"));
}

TEST(DeclaredQuantization, Fp8BlockConfigs) {
  const std::string deepseek =
      folder_with("fp8_ue8m0", R"({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                       "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                       "scale_fmt": "ue8m0"}})");
  auto d = read_declared_quantization(deepseek);
  ASSERT_TRUE(d.has_value());
  EXPECT_THAT(d->layer_sources, ElementsAre("FP8 block-128 (UE8M0 weight_scale_inv)"));
  // No list given: transformers leaves lm_head unconverted.
  EXPECT_THAT(d->ignore, ElementsAre("lm_head"));
  EXPECT_EQ(refusal(*d, {{"model.layers.0.mlp.up_proj", "FP8 block-128 (UE8M0 weight_scale_inv)"}},
                    {"lm_head"}),
            "");
  // F32 scales where the config says UE8M0: another format.
  EXPECT_THAT(
      refusal(*d, {{"model.layers.0.mlp.up_proj", "FP8 block-128 (F32 weight_scale_inv)"}}, {}),
      HasSubstr("these layers hold another format: model.layers.0.mlp.up_proj (FP8 "
                "block-128 (F32 weight_scale_inv))"));
  // transformers' own reading of modules_to_not_convert (should_convert_module): a regex from
  // the name's start, or a suffix of it; not a glob, not a substring.
  const auto listed = read_declared_quantization(
      folder_with("fp8_skips", R"({"quantization_config": {"quant_method": "fp8",
                       "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                       "modules_to_not_convert": ["lm_head", ".*self_attn", "mlp.gate"]}})"));
  ASSERT_TRUE(listed.has_value());
  EXPECT_TRUE(declared_ignores(*listed, "lm_head"));
  EXPECT_TRUE(declared_ignores(*listed, "model.layers.0.self_attn.q_a_proj"));
  EXPECT_TRUE(declared_ignores(*listed, "model.layers.3.mlp.gate"));
  EXPECT_FALSE(declared_ignores(*listed, "model.layers.3.mlp.gate_proj"));
  EXPECT_FALSE(declared_ignores(*listed, "model.layers.0.mlp.up_proj"));
  d->ignore = {"self_attn"};  // matches neither from the start nor as a suffix
  EXPECT_FALSE(declared_ignores(*d, "model.layers.0.self_attn.q_proj"));
  // Per-tensor FP8 is not read.
  const auto per_tensor = read_declared_quantization(folder_with(
      "fp8_per_tensor",
      R"({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})"));
  ASSERT_TRUE(per_tensor.has_value());
  EXPECT_THAT(refusal(*per_tensor, {}, {}), HasSubstr("which metrale does not read"));
}

// gpt-oss (transformers' Mxfp4Config): only the experts are quantized, packed; its
// modules_to_not_convert is the ignore list, and plain Linears elsewhere are not skipped layers.
TEST(DeclaredQuantization, GptOssMxfp4Experts) {
  const auto d = read_declared_quantization(model("gptoss-mxfp4"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->producer, "mxfp4");
  EXPECT_THAT(d->layer_sources, ElementsAre("gpt-oss MXFP4"));
  EXPECT_THAT(d->ignore, ElementsAre("model.layers.*.self_attn", "model.layers.*.mlp.router",
                                     "model.embed_tokens", "lm_head"));
  const std::pair<std::string, std::string> experts{"model.layers.0.mlp.experts.gate_up_proj",
                                                    "gpt-oss MXFP4"};
  EXPECT_EQ(refusal(*d, {experts}, {"lm_head", "model.layers.0.self_attn.q_proj"}), "");
  // Planted: an expert projection of another format.
  EXPECT_THAT(refusal(*d, {{experts.first, "compressed-tensors MXFP4"}}, {}),
              HasSubstr("these layers hold another format"));
  // The experts module (what the caller passes for packed projections) on an ignore list as
  // transformers reads it: by name, as a regex from the start, or as the name's end. Each would
  // leave the experts in BF16 in transformers, so packed ones contradict the config.
  const std::pair<std::string, std::string> module{"model.layers.0.mlp.experts", "gpt-oss MXFP4"};
  for (const char* pattern : {"model.layers.0.mlp.experts", "model.layers.*.mlp", "experts"}) {
    SCOPED_TRACE(pattern);
    DeclaredQuantization ignoring = *d;
    ignoring.ignore.emplace_back(pattern);
    EXPECT_THAT(refusal(ignoring, {module}, {}),
                HasSubstr("ignores model.layers.0.mlp.experts, which the checkpoint holds"));
  }
  EXPECT_EQ(refusal(*d, {module}, {}), "");
}

TEST(DeclaredQuantization, TensorsHeldToIt) {
  const auto d = read_declared_quantization(checkpoint("ct-nvfp4a16"));
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(refusal(*d, kCtNvfp4, {"lm_head"}), "");
  // Planted: a layer of another format.
  EXPECT_THAT(
      refusal(*d, {kCtNvfp4[0], {"model.layers.0.self_attn.q_proj", "compressed-tensors MXFP4"}},
              {"lm_head"}),
      HasSubstr("declares compressed-tensors 'nvfp4-pack-quantized' (compressed-tensors "
                "NVFP4 layers), but these layers hold another format: "
                "model.layers.0.self_attn.q_proj (compressed-tensors MXFP4)"));
  // Planted: the ignored lm_head held quantized.
  EXPECT_THAT(refusal(*d, {kCtNvfp4[0], {"lm_head", "compressed-tensors NVFP4"}}, {}),
              HasSubstr("and ignores lm_head, which the checkpoint holds quantized"));
  // Planted: a layer the quantizer skipped, left in BF16.
  EXPECT_THAT(refusal(*d, {kCtNvfp4[0]}, {"lm_head", "model.layers.0.self_attn.q_proj"}),
              HasSubstr("yet the checkpoint holds these in plain floats: "
                        "model.layers.0.self_attn.q_proj"));
}

TEST(DeclaredQuantization, IgnorePatterns) {
  DeclaredQuantization d;
  d.ignore = {"lm_head", "re:.*mlp\\.gate$", "model.layers.[0-1].*", "model.embed_?okens"};
  EXPECT_TRUE(declared_ignores(d, "lm_head"));
  EXPECT_FALSE(declared_ignores(d, "lm_head2"));
  // compressed-tensors' "re:" is re.match: anchored at the start, not at the end.
  EXPECT_TRUE(declared_ignores(d, "model.layers.7.mlp.gate"));
  EXPECT_FALSE(declared_ignores(d, "model.layers.7.mlp.gate_proj"));
  d.ignore.push_back("re:model");
  EXPECT_TRUE(declared_ignores(d, "model.layers.7.mlp.up_proj"));
  EXPECT_FALSE(declared_ignores(d, "x.model"));
  d.ignore.pop_back();
  EXPECT_TRUE(declared_ignores(d, "model.layers.1.self_attn.q_proj"));
  EXPECT_FALSE(declared_ignores(d, "model.layers.2.self_attn.q_proj"));
  EXPECT_TRUE(declared_ignores(d, "model.embed_tokens"));
  d.ignore = {"model.layers.[!0].x"};
  EXPECT_TRUE(declared_ignores(d, "model.layers.3.x"));
  EXPECT_FALSE(declared_ignores(d, "model.layers.0.x"));
}

// GPTQModel's "dynamic" rules (vLLM's get_dynamic_override): in the file's order, the first
// whose regex matches from the name's start decides; "-:" leaves the module unquantized, an
// override keeps it quantized, and an override to another bit width is a format metrale does not
// read, named with its rule.
TEST(DeclaredQuantization, GptqModelDynamicRules) {
  const auto d = read_declared_quantization(folder_with("gptq_dynamic", R"({"quantization_config": {
      "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": null,
      "checkpoint_format": "gptq",
      "dynamic": {"+:model\\.layers\\.1\\..*": {"group_size": 32},
                  "-:model\\.layers\\.[01]\\.mlp\\.down_proj": {},
                  "-:.*gate_proj": {}}}})"));
  ASSERT_TRUE(d.has_value());
  EXPECT_THAT(d->layer_sources, ElementsAre("GPTQ INT4"));
  EXPECT_TRUE(declared_ignores(*d, "model.layers.0.mlp.down_proj"));
  EXPECT_TRUE(declared_ignores(*d, "model.layers.0.mlp.gate_proj"));
  EXPECT_FALSE(declared_ignores(*d, "model.layers.0.mlp.up_proj"));
  // Layer 1's override comes first: its down_proj and gate_proj stay quantized.
  EXPECT_FALSE(declared_ignores(*d, "model.layers.1.mlp.down_proj"));
  EXPECT_FALSE(declared_ignores(*d, "model.layers.1.mlp.gate_proj"));
  EXPECT_TRUE(declared_ignores(*d, "lm_head"));  // lm_head is false by default
  const std::vector<std::pair<std::string, std::string>> quantized = {
      {"model.layers.0.mlp.up_proj", "GPTQ INT4"}, {"model.layers.1.mlp.down_proj", "GPTQ INT4"}};
  EXPECT_EQ(refusal(*d, quantized, {"lm_head", "model.layers.0.mlp.down_proj"}), "");
  EXPECT_THAT(refusal(*d, quantized, {"model.layers.1.mlp.gate_proj"}),
              HasSubstr("in plain floats: model.layers.1.mlp.gate_proj"));
  EXPECT_THAT(refusal(*d, {{"model.layers.0.mlp.down_proj", "GPTQ INT4"}}, {}),
              HasSubstr("ignores model.layers.0.mlp.down_proj, which the checkpoint holds"));

  const auto eight =
      read_declared_quantization(folder_with("gptq_dynamic_8", R"({"quantization_config": {
      "quant_method": "gptq", "bits": 4, "group_size": 128,
      "dynamic": {"-:lm_head": {}, "+:model\\.layers\\.1\\..*": {"bits": 8}}}})"));
  ASSERT_TRUE(eight.has_value());
  EXPECT_TRUE(eight->layer_sources.empty());
  EXPECT_THAT(refusal(*eight, quantized, {}),
              HasSubstr("dynamic rule \"+:model\\.layers\\.1\\..*\" sets 8 bits', which "
                        "metrale does not read"));
}

// A key of the wrong type is Error(kIo) naming the file and the key (nlohmann's own type_error
// escaped before), null reads as absent, and a fraction is no bit width.
TEST(DeclaredQuantization, KeysOfTheWrongTypeAreRefusedByName) {
  const auto refused = [](const char* name, const char* q) {
    try {
      (void)read_declared_quantization(
          folder_with(name, fmt::format(R"({{"quantization_config": {}}})", q)));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kIo);
      EXPECT_THAT(e.what(), HasSubstr(fmt::format("{}/config.json", name)));
      return std::string(e.what());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a metrale::Error: " << e.what();
    }
    return std::string("read");
  };
  EXPECT_THAT(refused("gptq_bits_string", R"({"quant_method": "gptq", "bits": "4"})"),
              HasSubstr("\"bits\" is \"4\", expected an integer"));
  EXPECT_THAT(refused("gptq_bits_fraction", R"({"quant_method": "gptq", "bits": 4.5})"),
              HasSubstr("\"bits\" is 4.5, expected an integer"));
  EXPECT_THAT(refused("gptq_lm_head", R"({"quant_method": "gptq", "bits": 4, "lm_head": 1})"),
              HasSubstr("\"lm_head\" is 1, expected true or false"));
  EXPECT_THAT(refused("gptq_dynamic", R"({"quant_method": "gptq", "bits": 4, "dynamic": []})"),
              HasSubstr("\"dynamic\" is [], expected an object of rules"));
  EXPECT_THAT(refused("gptq_rule", R"({"quant_method": "gptq", "bits": 4, "dynamic": {"+:x": 8}})"),
              HasSubstr("dynamic rule \"+:x\" is 8, expected an object"));
  EXPECT_THAT(refused("awq_zero_point", R"({"quant_method": "awq", "bits": 4, "version": "gemm",
                                            "zero_point": "yes"})"),
              HasSubstr("\"zero_point\" is \"yes\", expected true or false"));
  EXPECT_THAT(refused("ct_num_bits", R"({"quant_method": "compressed-tensors",
      "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
      "weights": {"num_bits": "4", "type": "int"}}}})"),
              HasSubstr("\"num_bits\" is \"4\", expected an integer"));
  EXPECT_THAT(refused("ct_type", R"({"quant_method": "compressed-tensors",
      "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
      "weights": {"num_bits": 4, "type": 4}}}})"),
              HasSubstr("\"type\" is 4, expected a string"));
  // null is absent: desc_act and lm_head false, zero_point true.
  EXPECT_EQ(refused("gptq_nulls", R"({"quant_method": "gptq", "bits": 4, "desc_act": null,
                                      "lm_head": null})"),
            "read");
  EXPECT_EQ(refused("awq_null", R"({"quant_method": "awq", "bits": 4, "version": "gemm",
                                    "zero_point": null})"),
            "read");
}

// compressed-tensors INT4 with quantized activations (a W4A8 scheme): the weights are read, and
// the declaration says the activations stay BF16.
TEST(DeclaredQuantization, Int4WithQuantizedActivationsSaysTheyStayBf16) {
  const auto d = read_declared_quantization(folder_with("ct_w4a8", R"({"quantization_config": {
      "quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
          "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
          "input_activations": {"num_bits": 8, "type": "int", "dynamic": true}}}}})"));
  ASSERT_TRUE(d.has_value());
  EXPECT_THAT(d->layer_sources, ElementsAre("compressed-tensors INT4"));
  EXPECT_TRUE(d->quantized_activations);
  EXPECT_THAT(d->activations, HasSubstr("W4A8); metrale keeps them BF16"));
}

TEST(DeclaredQuantization, NoneOrMalformed) {
  EXPECT_FALSE(read_declared_quantization(folder_with("plain", R"({"model_type": "llama"})")));
  EXPECT_FALSE(read_declared_quantization(
      (std::filesystem::path(::testing::TempDir()) / "quant_config" / "absent").string()));
  try {
    (void)read_declared_quantization(folder_with("broken", R"({"quantization_config": )"));
    FAIL() << "a config.json that does not parse was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_THAT(e.what(), HasSubstr("config.json: not a JSON object"));
  }
  try {
    (void)read_declared_quantization(folder_with(
        "wrong_type",
        R"({"quantization_config": {"quant_method": "compressed-tensors", "ignore": "lm_head"}})"));
    FAIL() << "an ignore list that is a string was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_THAT(e.what(), HasSubstr("\"ignore\" is \"lm_head\", expected a list of strings"));
  }
}

}  // namespace
}  // namespace metrale
