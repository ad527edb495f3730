// The FP8 checkpoint loader (metrale/fp8_checkpoint.h) on the DeepSeek-V3 / Qwen layers that
// tests/io/make_safetensors.py writes with the reference Python package: a small model (layers
// with partial 128-blocks, its codes, scales and float64 dequantized weights in sidecars), a file
// of malformed layers, and a file whose scales the reference writer would never misalign.
// Every malformed layer must be an Error(kIo) whose message names the file and the tensor.
#include "metrale/fp8_checkpoint.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "io/generated_files.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/modelopt.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/safetensors.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/w8a8_reference.h"

namespace metrale {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::path_of;
using testing::read_bin;

const std::string kDown = "model.layers.0.mlp.down_proj";
const std::string kOProj = "model.layers.0.self_attn.o_proj";

template <class T>
std::vector<T> read_as(std::string_view name) {
  const std::vector<std::uint8_t> b = read_bin(name);
  std::vector<T> out(b.size() / sizeof(T));
  std::memcpy(out.data(), b.data(), out.size() * sizeof(T));
  return out;
}

TEST(SafetensorsFp8, LoadsTheLayersTheReferenceWriterWrote) {
  const auto f = SafetensorsFile::open(path_of("fp8_model.safetensors"));
  EXPECT_THAT(fp8_linear_layers(f), ElementsAre(kDown, kOProj));
  const E4m3BlockWeightsView w = load_fp8_linear(f, kDown);
  EXPECT_EQ(w.n, 200);
  EXPECT_EQ(w.k, 300);
  // A view into the map, no copy.
  EXPECT_EQ(static_cast<const void*>(w.codes.data()),
            static_cast<const void*>(f.bytes(kDown + ".weight").data()));
  EXPECT_EQ(static_cast<const void*>(w.scales.data()),
            static_cast<const void*>(f.bytes(kDown + ".weight_scale_inv").data()));
  EXPECT_EQ(std::vector<std::uint8_t>(w.codes.begin(), w.codes.end()),
            read_bin("fp8_down.codes.bin"));
  EXPECT_EQ(std::vector<float>(w.scales.begin(), w.scales.end()),
            read_as<float>("fp8_down.scales.bin"));
  ASSERT_EQ(w.scales.size(), 6u);  // [2, 3]
  // Every weight against Python's float64 e4m3 x scale.
  const std::vector<double> want = read_as<double>("fp8_down.dequant.bin");
  ASSERT_EQ(want.size(), 200u * 300u);
  for (std::int64_t r = 0; r < w.n; ++r) {
    for (std::int64_t c = 0; c < w.k; ++c) {
      ASSERT_EQ(w.weight(r, c), want[static_cast<std::size_t>(r * w.k + c)]) << r << ", " << c;
    }
  }
  const E4m3BlockWeightsView o = load_fp8_linear(f, kOProj);
  EXPECT_EQ(o.n, 128);
  EXPECT_EQ(o.k, 128);
  EXPECT_EQ(o.scales.size(), 1u);
}

// Both layers of the reference writer's file, uploaded from the map and run through the W8A8 op
// on the CPU backend, outputs poisoned, every element held to toolkit/w8a8_reference.h's bound
// around the float64 product of A and the file's weights, and the norm to A's cast alone.
TEST(SafetensorsFp8, LayersRunThroughTheW8a8Gemm) {
  const auto f = SafetensorsFile::open(path_of("fp8_model.safetensors"));
  CpuBackend b(CpuBackendOptions{builtin_host_modules(), 1});
  std::mt19937_64 gen(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const std::string& layer : {kDown, kOProj}) {
    SCOPED_TRACE(layer);
    const E4m3BlockWeightsView w = load_fp8_linear(f, layer);
    const std::span<const std::uint8_t> scale_bytes(
        reinterpret_cast<const std::uint8_t*>(w.scales.data()), w.scales.size_bytes());
    ops::Fp8Weights dw = ops::upload_fp8_weights(b, w.codes, scale_bytes, w.n, w.k);
    const std::int64_t m = 33;
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * w.k));
    for (auto& x : a) x = num::f32_to_bf16(u(gen));
    const DevicePtr da = b.alloc(a.size() * 2), dc = b.alloc(static_cast<std::size_t>(m * w.n) * 2);
    b.copy_h2d(da, a.data(), a.size() * 2);
    b.memset(dc, toolkit::kPoisonByte, static_cast<std::size_t>(m * w.n) * 2);
    ops::w8a8_gemm(b, b.default_stream(), da, m, dw, dc);
    std::vector<std::uint16_t> c(static_cast<std::size_t>(m * w.n));
    b.copy_d2h_after(c.data(), dc, c.size() * 2, b.default_stream());
    double err2 = 0, ref2 = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      const std::span<const std::uint16_t> row(a.data() + i * w.k, static_cast<std::size_t>(w.k));
      const toolkit::CastRow a8 = toolkit::cast_row(row);
      for (std::int64_t j = 0; j < w.n; ++j) {
        const toolkit::W8a8Element ref = toolkit::w8a8_reference_element(a8, row, w, j, 0.0, 0.0);
        const std::uint16_t bits = c[static_cast<std::size_t>(i * w.n + j)];
        ASSERT_NE(bits, toolkit::kPoisonBf16) << "C[" << i << ", " << j << "] unwritten";
        const double got = num::bf16_to_f32(bits);
        ASSERT_LE(std::fabs(got - ref.value), ref.bound)
            << "C[" << i << ", " << j << "] = " << got << ", reference " << ref.value;
        err2 += (got - ref.value) * (got - ref.value);
        ref2 += ref.value * ref.value;
      }
    }
    EXPECT_LE(std::sqrt(err2 / ref2), toolkit::kE4m3VsExactTol);
    b.free(da);
    b.free(dc);
    ops::free_fp8_weights(b, dw);
  }
  b.op_cache().release(b);  // the op's grow-only scratch
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(SafetensorsFp8, ListsEveryLayerTheFilePresentsAsFp8) {
  const auto f = SafetensorsFile::open(path_of("fp8_bad_layers.safetensors"));
  // Loadable or not: an F8_E4M3 weight, or a weight_scale_inv (no_weight, weight_bf16, ...).
  EXPECT_THAT(fp8_linear_layers(f),
              ElementsAre("inf_scale", "nan_code", "nan_scale", "neg_nan_code", "neg_scale",
                          "neg_zero_scale", "no_scale", "no_weight", "rank1", "rank3", "scale_bf16",
                          "scale_rank1", "scale_shape", "scale_transposed", "weight_bf16",
                          "weight_e5m2", "zero_k", "zero_n", "zero_scale"));
  // A file without FP8 layers lists none (its NVFP4 and BF16 layers are not FP8).
  EXPECT_TRUE(fp8_linear_layers(SafetensorsFile::open(path_of("model.safetensors"))).empty());
}

TEST(SafetensorsFp8, ZeroScalesLoad) {
  const auto f = SafetensorsFile::open(path_of("fp8_bad_layers.safetensors"));
  for (const char* layer : {"zero_scale", "neg_zero_scale"}) {
    const E4m3BlockWeightsView w = load_fp8_linear(f, layer);
    EXPECT_EQ(w.n, 4);
    EXPECT_EQ(w.k, 8);
    EXPECT_EQ(w.weight(3, 7), 0.0) << layer;
  }
}

struct BadLayer {
  const char* layer;
  const char* tensor;  // the tensor the message must name
  const char* what;    // and what it must say of it
};

const BadLayer kBadLayers[] = {
    {"no_scale", "no_scale.weight_scale_inv",
     "not in the file, but FP8 weights 'no_scale.weight' (F8_E4M3) need it"},
    {"no_weight", "no_weight.weight",
     "not in the file, but its FP8 scales 'no_weight.weight_scale_inv' are"},
    {"absent", "absent.weight", "not in the file"},
    {"weight_bf16", "weight_bf16.weight",
     "dtype is BF16, but FP8 weights must be F8_E4M3 (float8_e4m3fn)"},
    {"weight_e5m2", "weight_e5m2.weight",
     "dtype is F8_E5M2, but FP8 weights must be F8_E4M3 (float8_e4m3fn)"},
    {"rank1", "rank1.weight", "shape is [8], but FP8 weights must be a matrix [N, K]"},
    {"rank3", "rank3.weight", "shape is [2, 4, 8], but FP8 weights must be a matrix [N, K]"},
    {"zero_n", "zero_n.weight", "shape is [0, 8]: N and K must be positive"},
    {"zero_k", "zero_k.weight", "shape is [4, 0]: N and K must be positive"},
    {"scale_bf16", "scale_bf16.weight_scale_inv",
     "dtype is BF16, but FP8 block scales must be F32"},
    {"scale_shape", "scale_shape.weight_scale_inv",
     "shape is [2, 2], but weights F8_E4M3 [200, 300] (N = 200, K = 300) need [2, 3], one scale "
     "per 128 x 128 block"},
    {"scale_transposed", "scale_transposed.weight_scale_inv",
     "shape is [3, 2], but weights F8_E4M3 [130, 300] (N = 130, K = 300) need [2, 3]"},
    {"scale_rank1", "scale_rank1.weight_scale_inv",
     "shape is [1], but weights F8_E4M3 [4, 8] (N = 4, K = 8) need [1, 1]"},
    {"nan_scale", "nan_scale.weight_scale_inv",
     "scale [0, 1] = nan is not a finite non-negative scale"},
    {"inf_scale", "inf_scale.weight_scale_inv",
     "scale [0, 0] = inf is not a finite non-negative scale"},
    {"neg_scale", "neg_scale.weight_scale_inv",
     "scale [0, 0] = -0.5 is not a finite non-negative scale"},
    {"nan_code", "nan_code.weight", "weight [1, 3] is NaN (0x7F)"},
    {"neg_nan_code", "neg_nan_code.weight", "weight [3, 7] is NaN (0xFF)"},
};

TEST(SafetensorsFp8, EveryMalformedLayerIsAnIoErrorNamingTheFileAndTensor) {
  const std::string path = path_of("fp8_bad_layers.safetensors");
  const auto f = SafetensorsFile::open(path);
  for (const BadLayer& b : kBadLayers) {
    SCOPED_TRACE(b.layer);
    const Error e = testing::expect_error([&] { (void)load_fp8_linear(f, b.layer); });
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("[safetensors] {}: tensor '{}': {}", path, b.tensor,
                                                b.what)));
  }
}

TEST(SafetensorsFp8, MisalignedScalesAreRefused) {
  const std::string path = path_of("fp8_misaligned.safetensors");
  const auto f = SafetensorsFile::open(path);  // a valid file: the reader accepts it
  EXPECT_THAT(fp8_linear_layers(f), ElementsAre("m"));
  const Error e = testing::expect_error([&] { (void)load_fp8_linear(f, "m"); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format(
                            "[safetensors] {}: tensor 'm.weight_scale_inv': data starts at byte "
                            "3 of the data section, not a multiple of 4",
                            path)));
}

TEST(SafetensorsFp8, TheNvfp4LoaderRejectsFp8LayersByName) {
  // An FP8 file given to the NVFP4 path says why, not "no layers": each FP8 weight is a rejected
  // candidate with its dtype.
  const auto f = SafetensorsFile::open(path_of("fp8_model.safetensors"));
  const LinearLayerScan scan = scan_linear_layers(f);
  ASSERT_EQ(scan.rejected.size(), 3u);  // and the norm vector, not a matrix
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(scan.rejected[i].tensor, (i ? kOProj : kDown) + ".weight");
    EXPECT_THAT(scan.rejected[i].why, HasSubstr("dtype F8_E4M3 cannot be loaded as NVFP4"));
  }
}

}  // namespace
}  // namespace metrale
