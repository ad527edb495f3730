// Weights uploaded in the CPU's panel layout (UploadLayout::kPanels) end to end: the packer's
// moves (every code and scale code where panel_layout.h says), the upload's description, then
// w4a16_gemm and plan -> run on the automatic, decode and tiled routes against the float64
// reference of the SOURCE weights, with poisoned outputs and a poisoned tail past C. Both
// formats, both source layouts, N on both sides of the 32-column padding, K a multiple of the
// group but not of the 256-K panel, M across the small-M kernel's 4-row passes and the tiled
// route's 6-row tiles (up to 96 rows), 8-row tiles and 256-row blocks, bias, FP32 C, and
// refusals. Every E4M3 and E8M0 scale
// code on the panel layout: GemmNumerics.Every*BlockScaleCodeOnTheExactRoutes (gemm_test.cpp).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/panel_layout.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/panel_pack.h"

namespace metrale::testing::gemm {
namespace {

using ::testing::HasSubstr;

struct PanelCase {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  std::int64_t m = 1, n = 1, k = 16;
  bool bias = false;
  ops::GemmRoute route = ops::GemmRoute::kAuto;

  std::string str() const {
    return fmt::format("{} {} M={} N={} K={} {} route {}", to_string(format),
                       layout == WeightLayout::kRowMajor ? "row-major" : "transposed", m, n, k,
                       bias ? "with bias" : "no bias", ops::to_string(route));
  }
};

std::vector<PanelCase> cases() {
  constexpr std::array<std::int64_t, 11> kMs = {1, 2, 3, 4, 5, 8, 9, 16, 17, 40, 300};
  constexpr std::array<std::int64_t, 4> kNs = {45, 97, 32, 70};
  constexpr std::array<std::int64_t, 3> kNvfp4Ks = {80, 272, 528};
  constexpr std::array<std::int64_t, 3> kMxfp4Ks = {96, 288, 544};
  constexpr std::array<ops::GemmRoute, 3> kRoutes = {ops::GemmRoute::kAuto, ops::GemmRoute::kDecode,
                                                     ops::GemmRoute::kTiled};
  std::vector<PanelCase> out;
  std::size_t i = 0;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const WeightLayout l : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      for (const std::int64_t m : kMs) {
        const auto& ks = f == WeightFormat::kNvfp4 ? kNvfp4Ks : kMxfp4Ks;
        out.push_back(PanelCase{f, l, m, kNs[i % kNs.size()], ks[(i / 2) % ks.size()], i % 3 != 1,
                                kRoutes[i % kRoutes.size()]});
        ++i;
      }
    }
  }
  return out;
}

class GemmPanels : public GemmBackendTest {
 protected:
  void SetUp() override {
    GemmBackendTest::SetUp();
    if (IsSkipped()) return;
    if (!ops::reads_panel_layout(b())) {
      GTEST_SKIP() << b().name() << "'s w4a16 kernels do not read the panel layout";
    }
  }

  // C of one call (BF16, or FP32 when out_f32), poisoned first; the tail past C must stay
  // poisoned. Returns C as BF16 bits for compare(): an FP32 C is rounded here, once.
  std::vector<std::uint16_t> call(bool plan_run, const ops::QuantWeights& w, DevicePtr da,
                                  std::int64_t m, DevicePtr dbias, ops::GemmRoute route,
                                  bool out_f32) {
    const auto mn = static_cast<std::size_t>(m * w.n);
    const std::size_t elem = out_f32 ? 4 : 2;
    const DevicePtr dc = poisoned((mn + kTailElems) * elem);
    ops::GemmOptions options;
    options.bias = dbias;
    options.route = route;
    options.out_f32 = out_f32;
    const ops::GemmRoute expected = route != ops::GemmRoute::kAuto ? route
                                    : m <= ops::decode_max_m(b())  ? ops::GemmRoute::kDecode
                                                                   : ops::GemmRoute::kTiled;
    EXPECT_EQ(ops::choose_route(b(), m, w, options), expected);
    if (plan_run) {
      const ops::GemmPlan p = ops::plan(b(), m, w, options);
      EXPECT_EQ(p.route, expected);
      EXPECT_EQ(p.packing, ops::WeightPacking::kPanels);
      EXPECT_THAT(p.describe(), HasSubstr("panel"));
      ops::run(p, stream(), da, w, dc, ops::scratch_workspace(p, stream()), dbias);
    } else {
      ops::w4a16_gemm(b(), stream(), da, m, w, dc, options);
    }
    std::vector<std::uint8_t> raw = read<std::uint8_t>(dc, (mn + kTailElems) * elem);
    for (std::size_t i = mn * elem; i < raw.size(); ++i) {
      if (raw[i] != kPoisonByte) {
        ADD_FAILURE() << "wrote past C at byte " << i;
        break;
      }
    }
    std::vector<std::uint16_t> out(mn);
    for (std::size_t i = 0; i < mn; ++i) {
      if (out_f32) {
        float v = 0.0f;
        std::memcpy(&v, raw.data() + 4 * i, 4);
        // An unwritten FP32 element keeps the poison's bits: hand compare() the BF16 poison.
        std::uint32_t bits = 0;
        std::memcpy(&bits, &v, 4);
        const std::uint32_t poison4 = 0x01010101u * kPoisonByte;
        out[i] = bits == poison4 ? kPoisonBf16 : num::f32_to_bf16(v);
      } else {
        std::memcpy(&out[i], raw.data() + 2 * i, 2);
      }
    }
    return out;
  }

  void run_case(const PanelCase& c, HostQuantWeights row, bool out_f32 = false) {
    SCOPED_TRACE(c.str() + (out_f32 ? ", FP32 C" : ""));
    // NVFP4's quantizer picks a tensor scale of its own; MXFP4's is 1, so give it another.
    if (c.format == WeightFormat::kMxfp4) row.tensor_scale = 1.5f;
    const HostQuantWeights host = with_layout(row, c.layout);
    ops::WeightsResource r(b(), host, "panels", ops::UploadLayout::kPanels);
    const ops::QuantWeights& w = r.weights();
    EXPECT_EQ(w.packing, ops::WeightPacking::kPanels);
    EXPECT_EQ(w.layout, c.layout);
    EXPECT_EQ(w.codes_bytes, static_cast<std::size_t>(panel_layout::code_bytes(c.n, c.k)));
    EXPECT_EQ(w.scales_bytes,
              static_cast<std::size_t>(panel_layout::scale_bytes(c.n, c.k, group_size(c.format))));
    EXPECT_GT(r.pack_seconds(), 0.0);

    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(c.m * c.k));
    const std::vector<std::uint16_t> bias =
        c.bias ? random_bias(gen(), c.n) : std::vector<std::uint16_t>{};
    const DevicePtr da = upload(a);
    const DevicePtr dbias = c.bias ? upload(bias) : DevicePtr{};
    const Reference exact = reference(a, c.m, row, bias, AMode::kBf16);
    for (const bool plan_run : {false, true}) {
      SCOPED_TRACE(plan_run ? "plan -> run" : "w4a16_gemm");
      expect_close(compare(call(plan_run, w, da, c.m, dbias, c.route, out_f32), exact), kNormTol,
                   "against the float64 reference of the source weights");
    }
    free_all();
    r.release(b());
  }
};

TEST_P(GemmPanels, MatchesTheReferenceOfTheSourceWeights) {
  for (const PanelCase& c : cases()) {
    run_case(c, quantize(c.format, random_weight_values(gen(), c.n, c.k), c.n, c.k));
    if (HasFatalFailure()) return;
  }
}

TEST_P(GemmPanels, WritesFp32CWhenAsked) {
  for (const PanelCase& c : {PanelCase{WeightFormat::kNvfp4, WeightLayout::kRowMajor, 3, 70, 272,
                                       true, ops::GemmRoute::kAuto},
                             PanelCase{WeightFormat::kMxfp4, WeightLayout::kRowMajor, 300, 45, 288,
                                       false, ops::GemmRoute::kAuto}}) {
    run_case(c, quantize(c.format, random_weight_values(gen(), c.n, c.k), c.n, c.k), true);
  }
}

TEST_P(GemmPanels, OtherRoutesAreRefusedByName) {
  const HostQuantWeights host =
      quantize(WeightFormat::kNvfp4, random_weight_values(gen(), 64, 64), 64, 64);
  ops::WeightsResource r(b(), host, "panels", ops::UploadLayout::kPanels);
  for (const ops::GemmRoute route :
       {ops::GemmRoute::kDequant, ops::GemmRoute::kFused, ops::GemmRoute::kE4m3}) {
    ops::GemmOptions options;
    options.route = route;
    options.activations = ops::Activations::kAllowE4m3;
    try {
      (void)ops::plan(b(), 8, r.weights(), options);
      ADD_FAILURE() << "route " << ops::to_string(route) << " took panel weights";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_THAT(e.what(), HasSubstr("panel layout")) << e.what();
    }
  }
  // Buffers of the source size are not the panel layout's (N = 45 pads to 64).
  ops::WeightsResource odd(
      b(), quantize(WeightFormat::kNvfp4, random_weight_values(gen(), 45, 64), 45, 64), "odd",
      ops::UploadLayout::kPanels);
  ops::QuantWeights w = odd.weights();
  w.codes_bytes = 45 * 32;
  EXPECT_THROW((void)ops::plan(b(), 1, w, ops::GemmOptions{}), Error);
  odd.release(b());
  r.release(b());
}

INSTANTIATE_TEST_SUITE_P(, GemmPanels, ::testing::Values("cpu"), backend_name);

// Where the backend's kernels do not read the panel layout (the CUDA module; the CPU's below
// AVX-512 BF16: ops.gemm_isa_avx512 runs this with METRALE_CPU_ISA=avx512), an upload in it is
// refused by name with nothing left allocated, and the preference is another layout.
TEST(GemmPanelsRefused, AnUploadWhereTheKernelsDoNotReadItIsRefusedByName) {
  BackendOrReason r = make_backend("cpu");
  ASSERT_TRUE(r.backend) << r.reason;
  Backend& b = *r.backend;
  if (ops::reads_panel_layout(b)) GTEST_SKIP() << "the CPU's kernels read the panel layout here";
  EXPECT_NE(ops::upload_packing(b, ops::UploadLayout::kBackendPreferred),
            ops::WeightPacking::kPanels);
  std::mt19937_64 gen(fresh_seed());
  const HostQuantWeights host =
      quantize(WeightFormat::kNvfp4, random_weight_values(gen, 40, 64), 40, 64);
  try {
    ops::WeightsResource w(b, host, "panels", ops::UploadLayout::kPanels);
    ADD_FAILURE() << "uploaded in a layout the kernels do not read";
    w.release(b);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("panel layout")) << e.what();
  }
  b.op_cache().release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
}

// The packer moves codes and scale codes, never changes them: every one of the source's, in
// both layouts, read back where panel_layout.h says, and the padding zero.
TEST(PanelPack, EveryCodeAndScaleCodeWherePanelLayoutSays) {
  std::mt19937_64 gen(fresh_seed());
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const WeightLayout l : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      const std::int64_t n = 37, k = 96;
      const HostQuantWeights row = quantize(f, random_weight_values(gen, n, k), n, k);
      const HostQuantWeights host = with_layout(row, l);
      const ops::PackedPanelWeights p = ops::pack_for_panels(host);
      const int group = group_size(f);
      ASSERT_EQ(p.codes.size(), static_cast<std::size_t>(panel_layout::code_bytes(n, k)));
      ASSERT_EQ(p.scales.size(), static_cast<std::size_t>(panel_layout::scale_bytes(n, k, group)));
      for (std::int64_t r = 0; r < panel_layout::padded_n(n); ++r) {
        for (std::int64_t kk = 0; kk < k; ++kk) {
          const std::uint8_t want = r < n ? row.code(r, kk) : 0;
          ASSERT_EQ(panel_layout::code_at(p.codes.data(), k, r, kk), want)
              << to_string(f) << " row " << r << " k " << kk;
        }
        for (std::int64_t bl = 0; bl < k / group; ++bl) {
          const std::uint8_t want =
              r < n ? row.scales[static_cast<std::size_t>(r * (k / group) + bl)] : 0;
          ASSERT_EQ(panel_layout::scale_at(p.scales.data(), k, group, r, bl), want);
        }
      }
    }
  }
}

TEST(PanelPack, BadWeightsAreRefusedByName) {
  HostQuantWeights w;
  w.n = 4;
  w.k = 24;  // not a multiple of 16
  w.codes.resize(48);
  w.scales.resize(4);
  try {
    (void)ops::pack_for_panels(w);
    ADD_FAILURE() << "packed K = 24";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("[pack_for_panels] k = 24"));
  }
}

}  // namespace
}  // namespace metrale::testing::gemm
