// w4a16_gemm on INT4 weights in the CPU's panel layout (Note [INT4 weights], Note [CPU panel
// layout]): fresh random data over every group size (32, 64, 128, 256 and one scale per row),
// symmetric and asymmetric, BF16 and FP16 scales, with and without act order, on the decode and
// tiled routes (the tiles that decode the lines themselves up to 16 rows, the panels decoded once
// per block past it) and the automatic one, against the float64 reference, C poisoned first and
// the bytes past it checked untouched. The packer moves every code and pads with 8; uploads take
// the layout where the kernels read it and K allows, and refuse it by name where not.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "kernels/panel_layout.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"
#include "ops/panel_pack.h"

namespace metrale::testing::gemm {
namespace {

using ops::GemmRoute;

// Ks the layout takes (multiples of 32) for a group: one block, several, and a last 256-K chunk
// that is short.
std::vector<std::int64_t> ks_of(std::int64_t group) {
  switch (group) {
    case 32:
      return {32, 96, 416};
    case 64:
      return {64, 448};
    case 128:
      return {128, 384, 1152};
    case 256:
      return {256, 768};
    default:  // one scale per row: blocks of 32, 64 and 128 K
      return {96, 192, 640};
  }
}

class GemmInt4Panels : public Int4GemmTest {
 protected:
  void SetUp() override {
    Int4GemmTest::SetUp();
    if (IsSkipped()) return;
    if (!ops::reads_panel_layout(b()) ||
        !b().op_cache().kernel(b(), "w4a16", "gemm_decode").meta.int4) {
      GTEST_SKIP() << b().name() << "'s w4a16 kernels do not read INT4 weights in the panel layout";
    }
  }

  GemmRoute run(const Int4Case& c) { return run_case(c, ops::UploadLayout::kPanels); }
};

TEST_P(GemmInt4Panels, EveryGroupZeroPointScaleTypeAndActOrderMatchesFloat64) {
  constexpr std::array<std::int64_t, 8> kMs = {1, 2, 5, 16, 17, 33, 97, 130};
  constexpr std::array<std::int64_t, 5> kNs = {1, 7, 33, 65, 257};
  int i = 0;
  for (const std::int64_t group : {32, 64, 128, 256, 0}) {
    for (const bool zp : {false, true}) {
      for (const bool act : {false, true}) {
        for (const std::int64_t k : ks_of(group)) {
          Int4Case c;
          c.k = k;
          c.group = group == 0 ? c.k : group;
          c.m = kMs[static_cast<std::size_t>(i) % kMs.size()];
          c.n = kNs[static_cast<std::size_t>(i / 2) % kNs.size()];
          c.zero_points = zp;
          c.act_order = act;
          c.fp16 = i % 3 == 0;
          c.bias = i % 2 == 0;
          c.out_f32 = i % 5 == 1;
          c.route = i % 3 == 1   ? GemmRoute::kDecode
                    : i % 3 == 2 ? GemmRoute::kTiled
                                 : GemmRoute::kAuto;
          const GemmRoute taken = run(c);
          if (c.route != GemmRoute::kAuto) {
            EXPECT_EQ(taken, c.route) << c.str();
          }
          if (HasFatalFailure()) return;
          ++i;
        }
      }
    }
  }
}

// Every M from 1 to 40 on both routes (6-row tiles as even as they come; the tiled route changes
// kernel past 16 rows), and two taller blocks.
TEST_P(GemmInt4Panels, EveryRowBlockOnBothRoutes) {
  std::vector<std::int64_t> ms;
  for (std::int64_t m = 1; m <= 40; ++m) ms.push_back(m);
  for (const std::int64_t m : {64, 200}) ms.push_back(m);
  for (const std::int64_t m : ms) {
    for (const GemmRoute route : {GemmRoute::kDecode, GemmRoute::kTiled}) {
      Int4Case c;
      c.m = m;
      c.n = 45;
      c.k = m % 2 == 0 ? 288 : 512;
      c.group = m % 2 == 0 ? 32 : 128;
      c.zero_points = m % 3 != 0;
      c.act_order = m % 4 == 0;
      c.route = route;
      run(c);
      if (HasFatalFailure()) return;
    }
  }
}

// The packer moves every code to where panel_layout::code_at reads it and pads N with code 8.
TEST_P(GemmInt4Panels, ThePackerMovesEveryCodeAndPadsWithEight) {
  Int4Case c;
  c.n = 37;
  c.k = 160;
  c.group = 32;
  c.zero_points = true;
  const HostQuantWeights host = random_int4(gen(), c);
  const std::vector<std::uint8_t> codes = ops::pack_int4_codes_for_panels(host);
  ASSERT_EQ(codes.size(), static_cast<std::size_t>(panel_layout::code_bytes(c.n, c.k)));
  for (std::int64_t n = 0; n < panel_layout::padded_n(c.n); ++n) {
    for (std::int64_t k = 0; k < c.k; ++k) {
      const std::uint8_t byte =
          n < c.n ? host.codes[static_cast<std::size_t>(n * c.k / 2 + k / 2)] : std::uint8_t{0x88};
      const int want = k % 2 == 0 ? byte & 0xF : byte >> 4;
      ASSERT_EQ(panel_layout::code_at(codes.data(), c.k, n, k), want) << "n " << n << " k " << k;
    }
  }
}

// The backend's preference takes the panel layout for INT4 weights whose K is a multiple of 32 and
// the source layout otherwise; asked for by name, such a K is refused, naming it.
TEST_P(GemmInt4Panels, UploadsTakeThePanelLayoutWhereKAllows) {
  Int4Case c;
  c.n = 16;
  c.k = 256;
  c.group = 128;
  EXPECT_EQ(upload_weights(random_int4(gen(), c), ops::UploadLayout::kBackendPreferred).packing,
            ops::WeightPacking::kPanels);
  c.k = c.group = 40;  // one scale per row, K not a multiple of 32
  const HostQuantWeights odd = random_int4(gen(), c);
  EXPECT_EQ(upload_weights(odd, ops::UploadLayout::kBackendPreferred).packing,
            ops::WeightPacking::kSource);
  EXPECT_ERROR(ops::upload_weights(b(), odd, ops::UploadLayout::kPanels),
               ErrorCode::kInvalidArgument,
               "int4 weights with K = 40 have no panel layout: it takes K a multiple of 32");
  // A description that says the panel layout with such a K is refused at plan().
  c.k = c.group = 64;
  ops::QuantWeights w = upload_weights(random_int4(gen(), c), ops::UploadLayout::kPanels);
  ASSERT_EQ(w.packing, ops::WeightPacking::kPanels);
  w.k = w.group = 48;
  EXPECT_ERROR(ops::plan(b(), 1, w), ErrorCode::kInvalidArgument,
               "int4 weights in the panel layout with K = 48");
  // The source layout's buffer sizes for panel-layout weights (N = 16 pads to 32 rows of codes).
  w.k = w.group = 64;
  w.codes_bytes = 16 * 64 / 2;
  EXPECT_ERROR(ops::plan(b(), 1, w), ErrorCode::kInvalidArgument,
               "in the panel layout needs 1024 and 32");
}

INSTANTIATE_TEST_SUITE_P(, GemmInt4Panels, ::testing::Values("cpu", "cuda"), backend_name);

}  // namespace
}  // namespace metrale::testing::gemm
