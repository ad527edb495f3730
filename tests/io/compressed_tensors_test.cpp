// compressed-tensors checkpoints made by the library itself (tests/fixtures/checkpoints:
// make_compressed_tensors.py runs llm-compressor's oneshot with the NVFP4A16 and MXFP4A16
// presets on a tiny transformers Llama) read by load_nvfp4_linear, and held to what
// compressed-tensors reads back from the same files (reference.safetensors beside each): every
// E2M1 value and block scale bit for bit, and each dequantized weight equal once rounded to BF16
// as the library returns it (within BF16's rounding everywhere: compressed-tensors divides the
// block scale by the global scale, the loader multiplies by the reciprocal it keeps as the
// tensor scale). Also: every quantized layer
// of the files is found, and the BF16 ones kept by the recipe are told apart.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/checkpoint_layers.h"
#include "metrale/error.h"
#include "metrale/modelopt.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "metrale/safetensors.h"
#include "metrale/sharded_checkpoint.h"

namespace metrale {
namespace {

std::string fixture(std::string_view folder, std::string_view file) {
  return fmt::format("{}/{}/{}", METRALE_CHECKPOINT_FIXTURES, folder, file);
}

// F32 tensor `name` of the reference file, as floats.
std::vector<float> f32_tensor(const SafetensorsFile& f, const std::string& name) {
  const auto bytes = f.bytes(name);
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

const std::vector<std::string> kQuantized = {
    "model.layers.0.mlp.down_proj",    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",      "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.v_proj"};

void expect_library_reading(const std::string& folder, WeightFormat format) {
  SCOPED_TRACE(folder);
  const SafetensorsFile model = SafetensorsFile::open(fixture(folder, "model.safetensors"));
  const SafetensorsFile ref = SafetensorsFile::open(fixture(folder, "reference.safetensors"));
  const bool mx = format == WeightFormat::kMxfp4;
  const LinearLayerScan scan = scan_linear_layers(model);
  // The 7 quantized linears and the 2 BF16 matrices the recipe kept (lm_head is ignored by it;
  // embeddings are not Linear); the norms are not candidates that look quantized.
  std::vector<std::string> want = kQuantized;
  want.insert(want.begin(), "lm_head");
  want.insert(want.begin() + 1, "model.embed_tokens");
  EXPECT_EQ(scan.layers, want);
  for (const RejectedLayer& r : scan.rejected) {
    EXPECT_FALSE(r.quantized) << r.tensor << ": " << r.why;
  }
  for (const std::string& layer : kQuantized) {
    SCOPED_TRACE(layer);
    const Nvfp4Linear l = load_nvfp4_linear(model, layer);
    EXPECT_EQ(l.source, mx ? "compressed-tensors MXFP4" : "compressed-tensors NVFP4");
    ASSERT_EQ(l.w.format, format);
    const std::vector<float> codes = f32_tensor(ref, layer + ".codes");
    const std::vector<float> block = f32_tensor(ref, layer + ".block_scale");
    const std::vector<float> deq = f32_tensor(ref, layer + ".dequantized");
    ASSERT_EQ(codes.size(), static_cast<std::size_t>(l.w.n * l.w.k));
    const std::int64_t group = mx ? num::kMxfp4Group : num::kNvfp4Group;
    ASSERT_EQ(block.size(), static_cast<std::size_t>(l.w.n * l.w.k / group));
    long code_bad = 0, scale_bad = 0, deq_bad = 0, deq_equal = 0;
    for (std::int64_t j = 0; j < l.w.n; ++j) {
      for (std::int64_t k = 0; k < l.w.k; ++k) {
        const auto at = static_cast<std::size_t>(j * l.w.k + k);
        code_bad += num::e2m1_to_f32(l.w.code(j, k)) != codes[at];
        // compressed-tensors returns BF16: code x (block scale / global scale), the quotient
        // rounded to FP32, the product to BF16. The loader's FP32 code x block x (1 / global)
        // is within two FP32 roundings of the product, so the two are within BF16's half step
        // (2^-9 of the value) and those roundings: 2^-8 bounds it. MXFP4 has no global scale
        // and both are exact.
        const float lib = deq[at], ours = l.w.weight(j, k);
        deq_bad += !(std::fabs(ours - lib) <= std::ldexp(std::fabs(lib), -8));
        deq_equal += num::bf16_to_f32(num::f32_to_bf16(ours)) == lib;
      }
      for (std::int64_t g = 0; g < l.w.k / group; ++g) {
        const std::uint8_t byte = l.w.scales[static_cast<std::size_t>(j * (l.w.k / group) + g)];
        const float ours = mx ? num::e8m0_to_f32(byte) : num::e4m3_to_f32(byte);
        scale_bad += ours != block[static_cast<std::size_t>(j * (l.w.k / group) + g)];
      }
    }
    EXPECT_EQ(code_bad, 0) << "E2M1 values that differ from compressed-tensors' unpacking";
    EXPECT_EQ(scale_bad, 0) << "block scales that differ from compressed-tensors' reading";
    EXPECT_EQ(deq_bad, 0) << "dequantized weights further apart than BF16's rounding";
    // Rounded to BF16 as the library rounds, all but the rare tie the two FP32 orders split.
    EXPECT_GE(deq_equal * 1000, 999 * static_cast<long>(codes.size()))
        << deq_equal << " of " << codes.size() << " equal after rounding to BF16";
    if (mx) {
      EXPECT_EQ(l.w.tensor_scale, 1.0f);
    }
  }
}

TEST(CompressedTensors, Nvfp4PackQuantizedIsReadAsTheLibraryReadsIt) {
  expect_library_reading("ct-nvfp4a16", WeightFormat::kNvfp4);
}

TEST(CompressedTensors, Mxfp4PackQuantizedIsReadAsTheLibraryReadsIt) {
  expect_library_reading("ct-mxfp4a16", WeightFormat::kMxfp4);
}

// The same model saved in shards (its index and 3 shard files; gate_proj's global scale lies in
// another shard than its codes): each layer gathered through the index loads exactly as from the
// single file, and the folder resolves to its index.
TEST(CompressedTensors, ShardedLayersGatheredAcrossShardsEqualTheSingleFile) {
  const std::string folder = fmt::format("{}/ct-nvfp4a16-sharded", METRALE_CHECKPOINT_FIXTURES);
  const std::string index = resolve_checkpoint_path(folder);
  EXPECT_TRUE(is_checkpoint_index(index)) << index;
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index);
  EXPECT_NE(ckpt.file_of("model.layers.0.mlp.gate_proj.weight_global_scale"),
            ckpt.file_of("model.layers.0.mlp.gate_proj.weight_packed"));
  const SafetensorsFile single = SafetensorsFile::open(fixture("ct-nvfp4a16", "model.safetensors"));
  std::vector<std::string> loaded;
  for (const std::string& prefix : tensor_prefixes(ckpt)) {
    const SafetensorsFile view = gather_layer(ckpt, prefix);
    for (const std::string& layer : scan_linear_layers(view).layers) {
      SCOPED_TRACE(layer);
      const Nvfp4Linear a = load_nvfp4_linear(view, layer), b = load_nvfp4_linear(single, layer);
      EXPECT_EQ(a.source, b.source);
      EXPECT_EQ(a.w.codes, b.w.codes);
      EXPECT_EQ(a.w.scales, b.w.scales);
      EXPECT_EQ(a.w.tensor_scale, b.w.tensor_scale);
      loaded.push_back(layer);
    }
  }
  EXPECT_EQ(loaded, scan_linear_layers(single).layers);
  EXPECT_EQ(resolve_checkpoint_path(fmt::format("{}/ct-nvfp4a16", METRALE_CHECKPOINT_FIXTURES)),
            fixture("ct-nvfp4a16", "model.safetensors"));
  try {
    (void)resolve_checkpoint_path(METRALE_CHECKPOINT_FIXTURES);
    ADD_FAILURE() << "a folder without a checkpoint resolved";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_NE(std::string(e.what()).find("holds neither"), std::string::npos) << e.what();
  }
}

// The recipe's BF16 layers load too, quantized on load, and say so.
TEST(CompressedTensors, TheBf16LayersTheRecipeKeptAreToldApart) {
  const SafetensorsFile model = SafetensorsFile::open(fixture("ct-nvfp4a16", "model.safetensors"));
  EXPECT_EQ(load_nvfp4_linear(model, "lm_head").source, "BF16, quantized to NVFP4 on load");
}

}  // namespace
}  // namespace metrale
