// The NVFP4 checkpoint NVIDIA ModelOpt itself exported (tests/fixtures/checkpoints/modelopt-nvfp4:
// make_modelopt.py runs mtq.quantize with NVFP4_DEFAULT_CFG on a tiny transformers Llama, then
// export_hf_checkpoint) read by load_nvfp4_linear and held to what ModelOpt's own
// NVFP4QTensor.dequantize reads from the same tensors (reference.safetensors beside it): every
// weight within one FP32 rounding (ModelOpt multiplies the code by block x tensor scale, the
// loader by the block scale, then the tensor scale; how many are equal is printed). The layers its
// hf_quant_config.json excludes (lm_head, the embeddings) are BF16 and load as such, named.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/modelopt.h"
#include "metrale/safetensors.h"

namespace metrale {
namespace {

std::string fixture(std::string_view file) {
  return fmt::format("{}/modelopt-nvfp4/{}", METRALE_CHECKPOINT_FIXTURES, file);
}

TEST(ModeloptFixture, ExportedNvfp4IsReadAsModeloptReadsIt) {
  const SafetensorsFile model = SafetensorsFile::open(fixture("model.safetensors"));
  const SafetensorsFile ref = SafetensorsFile::open(fixture("reference.safetensors"));
  const LinearLayerScan scan = scan_linear_layers(model);
  ASSERT_EQ(scan.layers.size(), 9u);  // 7 NVFP4 linears, lm_head and the embeddings in BF16
  for (const RejectedLayer& r : scan.rejected) EXPECT_FALSE(r.quantized) << r.tensor;
  int nvfp4 = 0;
  for (const std::string& layer : scan.layers) {
    SCOPED_TRACE(layer);
    const Nvfp4Linear l = load_nvfp4_linear(model, layer);
    if (layer == "lm_head" || layer == "model.embed_tokens") {
      EXPECT_EQ(l.source, "BF16, quantized to NVFP4 on load");
      continue;
    }
    ++nvfp4;
    EXPECT_EQ(l.source, "ModelOpt NVFP4");
    const auto bytes = ref.bytes(layer + ".dequantized");
    std::vector<float> deq(bytes.size() / 4);
    std::memcpy(deq.data(), bytes.data(), bytes.size());
    ASSERT_EQ(deq.size(), static_cast<std::size_t>(l.w.n * l.w.k));
    long bad = 0, equal = 0;
    for (std::int64_t j = 0; j < l.w.n; ++j) {
      for (std::int64_t k = 0; k < l.w.k; ++k) {
        const float lib = deq[static_cast<std::size_t>(j * l.w.k + k)], ours = l.w.weight(j, k);
        bad += !(std::fabs(ours - lib) <= std::ldexp(std::fabs(lib), -23));
        equal += ours == lib;
      }
    }
    EXPECT_EQ(bad, 0) << "weights more than one FP32 rounding from ModelOpt's";
    std::printf("  %s: %ld of %zu weights equal to ModelOpt's, the rest one rounding apart\n",
                layer.c_str(), equal, deq.size());
  }
  EXPECT_EQ(nvfp4, 7);
}

}  // namespace
}  // namespace metrale
