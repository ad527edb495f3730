// w4a16_gemm on INT4 weights uploaded in the int4 decode layout (kernels/int4_decode_layout.h;
// UploadLayout::kDecode): the decode route (gemm_int4_decode, after permute_a_int4 under act
// order) and the dequant route (dequant_int4_bf16 → dense BF16), every group the layout takes
// (32, 64, 128, 256 and per channel), symmetric and asymmetric, BF16 and FP16 scales, act order,
// bias, BF16 and FP32 C, against the float64 reference with each route's own tolerance
// (toolkit/gemm_tolerance.h). Outputs are poisoned and the bytes past C must stay poisoned. On
// the CPU the entries are the layout's twins (cpu/kernels/int4_packed_cpu.h); on a GPU these are
// the device check of the CUDA kernels (scripts/device-check.sh), skipped without one.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "kernels/int4_decode_layout.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "ops/int4_cases.h"

namespace metrale::testing::gemm {
namespace {

using ops::GemmRoute;

class GemmInt4Packed : public Int4GemmTest {
 protected:
  void SetUp() override {
    Int4GemmTest::SetUp();
    if (IsSkipped()) return;
    for (const char* e : {"gemm_int4_decode", "dequant_int4_bf16", "permute_a_int4"}) {
      const bool reads =
          module_provides(b(), e) &&
          b().op_cache().kernel(b(), "w4a16", e).meta.layout == int4_decode::kLayoutId;
      if (!reads) GTEST_SKIP() << b().name() << "'s w4a16 module has no " << e;
    }
  }

  bool has_dense() { return b().dense_gemm_unavailable(DenseKind::kBf16).empty(); }

  // One case in the int4 decode layout.
  GemmRoute run(const Int4Case& c) { return run_case(c, ops::UploadLayout::kDecode); }
};

// Every group the layout takes, both zero-point conventions and scale types, with and without act
// order, over M from 1 to 33 and N from 1 to 257, on the decode route, the dequant route (where
// the backend has a dense BF16 GEMM) and the automatic one; K ends on a partial 128-K block where
// the group allows.
TEST_P(GemmInt4Packed, EveryGroupZeroPointScaleTypeAndActOrderMatchesFloat64) {
  constexpr std::array<std::int64_t, 6> kMs = {1, 3, 9, 16, 17, 33};
  constexpr std::array<std::int64_t, 4> kNs = {1, 40, 65, 257};
  int i = 0;
  for (const std::int64_t group : {32, 64, 128, 256, 0}) {
    const std::vector<std::int64_t> ks = group == 32    ? std::vector<std::int64_t>{32, 160, 416}
                                         : group == 64  ? std::vector<std::int64_t>{64, 448}
                                         : group == 128 ? std::vector<std::int64_t>{128, 1152}
                                         : group == 256 ? std::vector<std::int64_t>{768}
                                                        : std::vector<std::int64_t>{128, 640};
    for (const bool zp : {false, true}) {
      for (const bool act : {false, true}) {
        for (const std::int64_t k : ks) {
          Int4Case c;
          c.k = k;
          c.group = group == 0 ? k : group;
          c.m = kMs[static_cast<std::size_t>(i) % kMs.size()];
          c.n = kNs[static_cast<std::size_t>(i / 2) % kNs.size()];
          c.zero_points = zp;
          c.act_order = act;
          c.fp16 = i % 3 == 0;
          c.bias = i % 2 == 0;
          const bool dequant = i % 3 == 2 && has_dense();
          c.out_f32 = !dequant && i % 5 == 1;
          c.route = i % 3 == 1 ? GemmRoute::kDecode
                    : dequant  ? GemmRoute::kDequant
                               : GemmRoute::kAuto;
          const GemmRoute taken = run(c);
          if (c.route != GemmRoute::kAuto) {
            EXPECT_EQ(taken, c.route) << c.str();
          }
          ++i;
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// Act order on the decode route is a gather of A into the workspace and then the decode kernel:
// two launches and M x K x 2 bytes of workspace; without act order, one launch and none.
TEST_P(GemmInt4Packed, ActOrderPlansTheGatherOfA) {
  Int4Case c;
  c.n = 40;
  c.k = 256;
  c.group = 128;
  c.act_order = true;
  const ops::QuantWeights w = upload_weights(random_int4(gen(), c), ops::UploadLayout::kDecode);
  EXPECT_EQ(w.packing, ops::WeightPacking::kDecode);
  ops::GemmOptions decode;
  decode.route = GemmRoute::kDecode;
  const ops::GemmPlan p = ops::plan(b(), 3, w, decode);
  EXPECT_EQ(p.workspace.a_perm, 3u * 256u * 2u);
  ASSERT_GE(p.launches.size(), 2u);
  EXPECT_NE(b().kernel_name(p.launches[0].kernel).find("permute_a_int4"), std::string::npos)
      << p.describe();
  c.act_order = false;
  const ops::QuantWeights plain = upload_weights(random_int4(gen(), c), ops::UploadLayout::kDecode);
  const ops::GemmPlan q = ops::plan(b(), 3, plain, decode);
  EXPECT_EQ(q.workspace.a_perm, 0u);
  EXPECT_EQ(b().kernel_name(q.launches[0].kernel).find("permute_a_int4"), std::string::npos);
  // A plan whose gather was edited out is refused, and so is one short of its workspace.
  ops::GemmPlan edited = p;
  edited.launches.erase(edited.launches.begin());
  const DevicePtr a = alloc(3 * 256 * 2), out = alloc(3 * 40 * 2);
  const Error e = expect_error(
      [&] { ops::run(edited, stream(), a, w, out, ops::scratch_workspace(p, stream())); });
  EXPECT_NE(std::string(e.what()).find("does not fit itself"), std::string::npos) << e.what();
  ops::GemmPlan short_ws = p;
  short_ws.workspace.a_perm -= 2;
  const Error f = expect_error(
      [&] { ops::run(short_ws, stream(), a, w, out, ops::scratch_workspace(p, stream())); });
  EXPECT_NE(std::string(f.what()).find("does not fit itself"), std::string::npos) << f.what();
  // Launches in another order (the GEMM before the gather; on the dequant route the dequantization
  // before it, which would write W into the gathered A's workspace) are refused, nothing run.
  std::vector<ops::GemmPlan> swapped{p};
  if (has_dense()) {
    ops::GemmOptions dequant;
    dequant.route = GemmRoute::kDequant;
    swapped.push_back(ops::plan(b(), 3, w, dequant));
  }
  for (ops::GemmPlan& s : swapped) {
    ASSERT_EQ(s.launches.size(), 2u) << s.describe();
    const ops::GemmWorkspace ws = ops::scratch_workspace(s, stream());
    std::swap(s.launches[0], s.launches[1]);
    const Error g = expect_error([&] { ops::run(s, stream(), a, w, out, ws); });
    EXPECT_NE(std::string(g.what()).find("does not fit itself"), std::string::npos) << g.what();
  }
}

// A rank's K slice of act-ordered weights (slice_columns: each group's run padded to blocks of 32,
// A's columns the slice's own; Note [Act order across ranks]) on the decode route and the dequant
// route, both gathering A with zeros for the padding, against the slice's float64 reference.
TEST_P(GemmInt4Packed, ActOrderedKSlicesOnBothRoutes) {
  for (const std::int64_t group : {64, 128}) {
    Int4Case c;
    c.n = 72;
    c.k = 1024;
    c.group = group;
    c.zero_points = group == 128;
    c.act_order = true;
    const HostQuantWeights whole = random_int4(gen(), c);
    for (const auto& [k0, k1] : {std::pair<std::int64_t, std::int64_t>{0, 512}, {768, 1024}}) {
      const HostQuantWeights mine = slice_columns(whole, k0, k1);
      ASSERT_GT(mine.k, k1 - k0) << "a random group order leaves runs off the 32-K blocks";
      Int4Case s = c;
      s.k = mine.k;
      s.group = mine.group;
      for (const GemmRoute route : {GemmRoute::kDecode, GemmRoute::kDequant}) {
        if (route == GemmRoute::kDequant && !has_dense()) continue;
        s.route = route;
        s.m = route == GemmRoute::kDecode ? 3 : 24;
        s.bias = route == GemmRoute::kDequant;
        EXPECT_EQ(run_weights(mine, s, ops::UploadLayout::kDecode), route);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Routes that read other layouts are refused by name for weights in the int4 decode layout.
TEST_P(GemmInt4Packed, OtherRoutesAreRefusedByName) {
  Int4Case c;
  c.k = 128;
  const ops::QuantWeights w = upload_weights(random_int4(gen(), c), ops::UploadLayout::kDecode);
  for (const GemmRoute route : {GemmRoute::kTiled, GemmRoute::kFused}) {
    ops::GemmOptions o;
    o.route = route;
    const Error e = expect_error([&] { (void)ops::plan(b(), 8, w, o); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("only the decode and dequant routes read"),
              std::string::npos)
        << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(, GemmInt4Packed, ::testing::Values("cpu", "cuda"), backend_name);

}  // namespace
}  // namespace metrale::testing::gemm
