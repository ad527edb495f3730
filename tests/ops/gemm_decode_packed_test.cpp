// Weights uploaded in the decode layout (UploadLayout::kDecode) end to end on every backend: the
// upload's description (packing, fold, padded buffer sizes, pack time), then w4a16_gemm and
// plan -> run (OpCache scratch and a caller's carved workspace) against the float64 reference of
// the SOURCE weights, with poisoned outputs and a poisoned tail past C. Both formats, both source
// layouts, ragged N, K a multiple of the group but not of the 128-K block, M on both sides of
// the decode kernels' 8 and 16 rows, bias on and off, tensor scales other than 1.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/decode_layout.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"
#include "ops/decode_pack.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr std::array<std::int64_t, 8> kMs = {1, 2, 7, 8, 9, 16, 17, 40};
constexpr std::array<std::int64_t, 4> kNs = {45, 97, 33, 70};  // none a multiple of 32
// Multiples of the group, none of the 128-K block.
constexpr std::array<std::int64_t, 3> kNvfp4Ks = {80, 272, 48};
constexpr std::array<std::int64_t, 3> kMxfp4Ks = {96, 288, 160};

struct PackedCase {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  std::int64_t m = 1, n = 1, k = 16;
  bool bias = false;

  std::string str() const {
    return fmt::format("{} {} M={} N={} K={} {}", to_string(format),
                       layout == WeightLayout::kRowMajor ? "row-major" : "transposed", m, n, k,
                       bias ? "with bias" : "no bias");
  }
};

std::vector<PackedCase> cases() {
  std::vector<PackedCase> out;
  std::size_t i = 0;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const WeightLayout l : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      for (const std::int64_t m : kMs) {
        const auto& ks = f == WeightFormat::kNvfp4 ? kNvfp4Ks : kMxfp4Ks;
        out.push_back(
            PackedCase{f, l, m, kNs[i % kNs.size()], ks[(i / 2) % ks.size()], i % 3 != 1});
        ++i;
      }
    }
  }
  return out;
}

class GemmDecodePacked : public GemmBackendTest {
 protected:
  // The three ways to run one uploaded case; each output is checked on its own.
  enum class Call { kW4a16Gemm, kPlanRunScratch, kPlanRunCarved };

  // C for one call, poisoned first; the tail past C must stay poisoned.
  std::vector<std::uint16_t> call(Call how, const ops::QuantWeights& w, DevicePtr da,
                                  std::int64_t m, DevicePtr dbias) {
    const auto mn = static_cast<std::size_t>(m * w.n);
    const DevicePtr dc = poisoned((mn + kTailElems) * 2);
    ops::GemmOptions options;
    options.bias = dbias;
    if (how == Call::kW4a16Gemm) {
      ops::w4a16_gemm(b(), stream(), da, m, w, dc, options);
    } else {
      const ops::GemmPlan p = ops::plan(b(), m, w, options);
      // Above the decode sizes the fused route reads the decode layout instead, where a device
      // verified it (else decode takes every M).
      const bool fused = m > ops::decode_max_m(b()) && auto_may_choose(b(), "gemm_fused");
      EXPECT_EQ(p.route, fused ? ops::GemmRoute::kFused : ops::GemmRoute::kDecode);
      EXPECT_EQ(p.packing, ops::WeightPacking::kDecode);
      EXPECT_EQ(p.fold, w.fold);
      EXPECT_THAT(p.describe(), StartsWith(fused ? "fused " : "decode "));
      EXPECT_THAT(p.describe(),
                  HasSubstr(fused ? "w4a16::gemm_fused " : "w4a16::gemm_decode_packed "));
      ops::GemmWorkspace ws;
      if (how == Call::kPlanRunScratch) {
        ws = ops::scratch_workspace(p, stream());
      } else if (p.workspace.total() != 0) {
        ws = ops::GemmWorkspace::carve(poisoned(p.workspace.total()), p.workspace);
      }
      ops::run(p, stream(), da, w, dc, ws, dbias);
    }
    std::vector<std::uint16_t> out = read<std::uint16_t>(dc, mn + kTailElems);
    EXPECT_EQ(std::count(out.begin() + static_cast<std::ptrdiff_t>(mn), out.end(), kPoisonBf16),
              static_cast<std::ptrdiff_t>(kTailElems))
        << "wrote past C";
    out.resize(mn);
    return out;
  }

  void run_case(const PackedCase& c) {
    SCOPED_TRACE(c.str());
    HostQuantWeights row = quantize(c.format, random_weight_values(gen(), c.n, c.k), c.n, c.k);
    // NVFP4's quantizer picks a tensor scale of its own; MXFP4's is 1, so give it another.
    if (c.format == WeightFormat::kMxfp4) row.tensor_scale = 1.5f;
    ASSERT_NE(row.tensor_scale, 1.0f);
    const HostQuantWeights host = with_layout(row, c.layout);
    const ops::PackedDecodeWeights packed = ops::pack_for_decode(host);

    ops::WeightsResource r(b(), host, "packed", ops::UploadLayout::kDecode);
    const ops::QuantWeights& w = r.weights();
    const bool mx = c.format == WeightFormat::kMxfp4;
    EXPECT_EQ(w.packing, ops::WeightPacking::kDecode);
    EXPECT_EQ(w.layout, c.layout);
    EXPECT_EQ(w.fold, packed.fold);
    EXPECT_EQ(w.codes_bytes, static_cast<std::size_t>(decode_layout::code_bytes(c.n, c.k)));
    EXPECT_EQ(w.scales_bytes, static_cast<std::size_t>(decode_layout::scale_bytes(c.n, c.k, mx)));
    EXPECT_EQ(w.tensor_scale, row.tensor_scale);
    EXPECT_GT(r.pack_seconds(), 0.0);

    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(c.m * c.k));
    const std::vector<std::uint16_t> bias =
        c.bias ? random_bias(gen(), c.n) : std::vector<std::uint16_t>{};
    const DevicePtr da = upload(a);
    const DevicePtr dbias = c.bias ? upload(bias) : DevicePtr{};
    // The reference of the row-major source weights, whatever was uploaded.
    const Reference exact = reference(a, c.m, row, bias, AMode::kBf16);
    EXPECT_EQ(ops::choose_route(b(), c.m, w, ops::GemmOptions{}),
              c.m > ops::decode_max_m(b()) && auto_may_choose(b(), "gemm_fused")
                  ? ops::GemmRoute::kFused
                  : ops::GemmRoute::kDecode);
    for (const Call how : {Call::kW4a16Gemm, Call::kPlanRunScratch, Call::kPlanRunCarved}) {
      SCOPED_TRACE(how == Call::kW4a16Gemm        ? "w4a16_gemm"
                   : how == Call::kPlanRunScratch ? "plan -> run, scratch workspace"
                                                  : "plan -> run, carved workspace");
      expect_close(compare(call(how, w, da, c.m, dbias), exact), kNormTol,
                   "against the float64 reference of the source weights");
    }
    free_all();
    r.release(b());
  }
};

TEST_P(GemmDecodePacked, MatchesTheReferenceOfTheSourceWeights) {
  for (const PackedCase& c : cases()) run_case(c);
}

TEST_P(GemmDecodePacked, ASourceUploadTakesNoPackTime) {
  const HostQuantWeights host =
      quantize(WeightFormat::kNvfp4, random_weight_values(gen(), 40, 64), 40, 64);
  ops::WeightsResource r(b(), host, "source", ops::UploadLayout::kSource);
  EXPECT_EQ(r.pack_seconds(), 0.0);
  EXPECT_EQ(r.weights().packing, ops::WeightPacking::kSource);
  EXPECT_EQ(r.weights().fold, 0);
  EXPECT_EQ(r.weights().codes_bytes, host.codes.size());
  EXPECT_EQ(r.weights().scales_bytes, host.scales.size());
  r.release(b());
}

TEST_P(GemmDecodePacked, AnExplicitDecodeUploadIsTheDecodeLayoutOnEveryBackend) {
  EXPECT_TRUE(ops::uploads_decode_layout(b(), ops::UploadLayout::kDecode));
  EXPECT_FALSE(ops::uploads_decode_layout(b(), ops::UploadLayout::kSource));
}

INSTANTIATE_TEST_SUITE_P(, GemmDecodePacked, ::testing::Values("cpu", "cuda"), backend_name);

// The CPU module's gemm_decode_packed is the reference of the layout, not the CPU's fastest
// decode (it publishes no largest M), so the backend's preference is never the decode layout:
// it is the panel layout where the CPU's kernels read it fast, else the source layout.
TEST(GemmDecodePackedCpu, TheBackendsPreferenceIsNotTheDecodeLayout) {
  BackendOrReason r = make_backend("cpu");
  ASSERT_TRUE(r.backend) << r.reason;
  Backend& b = *r.backend;
  EXPECT_FALSE(ops::uploads_decode_layout(b, ops::UploadLayout::kBackendPreferred));
  std::mt19937_64 gen(fresh_seed());
  const HostQuantWeights host =
      quantize(WeightFormat::kMxfp4, random_weight_values(gen, 33, 96), 33, 96);
  ops::WeightsResource w(b, host, "preferred", ops::UploadLayout::kBackendPreferred);
  if (ops::reads_panel_layout(b)) {
    EXPECT_EQ(w.weights().packing, ops::WeightPacking::kPanels);
    EXPECT_GT(w.pack_seconds(), 0.0);
  } else {
    EXPECT_EQ(w.weights().packing, ops::WeightPacking::kSource);
    EXPECT_EQ(w.weights().codes_bytes, host.codes.size());
    EXPECT_EQ(w.pack_seconds(), 0.0);
  }
  w.release(b);
  b.op_cache().release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale::testing::gemm
