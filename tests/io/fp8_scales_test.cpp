// FP8 block-128 layers whose scales are stored otherwise than DeepSeek's F32 weight_scale_inv
// (fp8_scales_as_inv, metrale/fp8_checkpoint.h): compressed-tensors' FP8_BLOCK as llm-compressor
// saved it (tests/fixtures/checkpoints/ct-fp8-block, with what compressed-tensors reads back
// beside it), held to the library's own dequantization; and the other layouts, written here by
// the rules of ../shared/reference/formats.md (no library that writes them is installed in CI):
// ModelOpt's 4-D F32 weight_scale and DeepSeek's UE8M0 weight_scale_inv, each against the same
// layer in the F32 layout; anything else refused naming the scale and what it is.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "metrale/checkpoint_layers.h"
#include "metrale/e4m3_block.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/numerics.h"
#include "metrale/safetensors.h"

namespace metrale {
namespace {

std::string fixture(std::string_view file) {
  return fmt::format("{}/ct-fp8-block/{}", METRALE_CHECKPOINT_FIXTURES, file);
}

std::vector<float> f32_tensor(const SafetensorsFile& f, const std::string& name) {
  const auto bytes = f.bytes(name);
  std::vector<float> out(bytes.size() / 4);
  std::memcpy(out.data(), bytes.data(), out.size() * 4);
  return out;
}

std::vector<std::byte> as_bytes(const std::vector<float>& v) {
  std::vector<std::byte> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// compressed-tensors' dequantization returns BF16 (e4m3 x the BF16 scale, one rounding): the
// loader's FP32 product (exact: 4 x 8 significant bits) rounded once to BF16 equals it.
TEST(Fp8Scales, CompressedTensorsFp8BlockIsReadAsTheLibraryReadsIt) {
  const SafetensorsFile model = SafetensorsFile::open(fixture("model.safetensors"));
  const SafetensorsFile ref = SafetensorsFile::open(fixture("reference.safetensors"));
  const std::vector<std::string> layers = fp8_linear_layers(model);
  ASSERT_EQ(layers.size(), 7u);
  for (const std::string& layer : layers) {
    SCOPED_TRACE(layer);
    const std::optional<SafetensorsFile> rewritten = fp8_scales_as_inv(model, layer);
    ASSERT_TRUE(rewritten.has_value());
    const E4m3BlockWeightsView w = load_fp8_linear(*rewritten, layer);
    const std::vector<float> block = f32_tensor(ref, layer + ".block_scale");
    const std::vector<float> deq = f32_tensor(ref, layer + ".dequantized");
    ASSERT_EQ(std::vector<float>(w.scales.begin(), w.scales.end()), block);
    long bad = 0;
    for (std::int64_t j = 0; j < w.n; ++j) {
      for (std::int64_t k = 0; k < w.k; ++k) {
        const float ours = num::bf16_to_f32(num::f32_to_bf16(static_cast<float>(w.weight(j, k))));
        bad += ours != deq[static_cast<std::size_t>(j * w.k + k)];
      }
    }
    EXPECT_EQ(bad, 0) << "weights that differ from compressed-tensors' dequantization";
  }
}

// One FP8 layer [200, 300] (2 x 3 blocks, partial ones included) written with F32
// weight_scale_inv and with `scale` as given: both load to the same codes and scales.
void expect_same_layer(const std::string& scale_name, const std::string& dtype,
                       std::vector<std::int64_t> shape, std::vector<std::byte> scale_bytes,
                       const std::vector<float>& want_scales) {
  SCOPED_TRACE(scale_name + " " + dtype);
  std::vector<std::byte> codes(200 * 300);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = std::byte((i * 37 + 11) % 0x7E);
  const SafetensorsFile other = in_memory_safetensors(
      "other.safetensors",
      {OwnedTensor{"l.weight", "F8_E4M3", {200, 300}, codes},
       OwnedTensor{scale_name, dtype, std::move(shape), std::move(scale_bytes)}});
  const std::optional<SafetensorsFile> rewritten = fp8_scales_as_inv(other, "l");
  ASSERT_TRUE(rewritten.has_value());
  const E4m3BlockWeightsView w = load_fp8_linear(*rewritten, "l");
  EXPECT_EQ(std::vector<float>(w.scales.begin(), w.scales.end()), want_scales);
  EXPECT_EQ(std::memcmp(w.codes.data(), codes.data(), codes.size()), 0);
}

TEST(Fp8Scales, ModelOptAndUe8m0ScalesLoadAsTheF32Layout) {
  const std::vector<float> scales = {0.5f, 0.25f, 2.0f, 1.0f / 1024, 8.0f, 0.125f};
  // ModelOpt: F32 weight_scale [2, 1, 3, 1].
  expect_same_layer("l.weight_scale", "F32", {2, 1, 3, 1}, as_bytes(scales), scales);
  // DeepSeek UE8M0: F8_E8M0 weight_scale_inv [2, 3], 2^(e - 127).
  std::vector<std::byte> e8;
  for (const float s : scales) e8.push_back(std::byte(127 + std::ilogb(s)));
  expect_same_layer("l.weight_scale_inv", "F8_E8M0", {2, 3}, e8, scales);
  // The F32 layout itself is read in place: nothing to rewrite.
  const SafetensorsFile f32 = in_memory_safetensors(
      "f32.safetensors",
      {OwnedTensor{"l.weight", "F8_E4M3", {200, 300}, std::vector<std::byte>(200 * 300)},
       OwnedTensor{"l.weight_scale_inv", "F32", {2, 3}, as_bytes(scales)}});
  EXPECT_FALSE(fp8_scales_as_inv(f32, "l").has_value());
}

TEST(Fp8Scales, OtherScalesAreRefusedNamingTheScale) {
  const SafetensorsFile bad = in_memory_safetensors(
      "bad.safetensors",
      {OwnedTensor{"l.weight", "F8_E4M3", {200, 300}, std::vector<std::byte>(200 * 300)},
       OwnedTensor{"l.weight_scale", "F16", {2, 3}, std::vector<std::byte>(12)}});
  try {
    (void)fp8_scales_as_inv(bad, "l");
    ADD_FAILURE() << "an F16 weight_scale was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    const std::string what = e.what();
    EXPECT_NE(what.find("bad.safetensors: tensor 'l.weight_scale': is F16 [2, 3]"),
              std::string::npos)
        << what;
  }
  const SafetensorsFile nan = in_memory_safetensors(
      "nan.safetensors",
      {OwnedTensor{"l.weight", "F8_E4M3", {200, 300}, std::vector<std::byte>(200 * 300)},
       OwnedTensor{
           "l.weight_scale_inv", "F8_E8M0", {2, 3}, std::vector<std::byte>(6, std::byte{0xFF})}});
  EXPECT_THROW((void)fp8_scales_as_inv(nan, "l"), Error);
}

}  // namespace
}  // namespace metrale
