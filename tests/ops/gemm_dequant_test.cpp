// The dequant route on the CPU backend: dequant_bf16 alone, bit for bit against a host
// dequantization computed in double; the route (dequant_bf16, then the backend's dense BF16 GEMM
// with the bias in its epilogue) against the float64 reference and its tolerance table entry;
// its plan, workspace and refusals; two streams with their own workspace.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "kernels/dequant_bf16.h"
#include "kernels/gemm_params.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "ops/gemm_reference.h"

namespace metrale::ops {
namespace {

namespace ref = metrale::testing::gemm;
using metrale::testing::expect_error;

const ops::GemmOptions kDequantOpts{Activations::kExactBf16, GemmRoute::kDequant, DevicePtr{}};

// The exact product e2m1 × block scale × ts (exact in double: at most 2 + 4 + 24 significant
// bits) rounded once to BF16, nearest even, by scaling its significand to 8 bits: the host's own
// arithmetic, not kernels/dequant_bf16.h's. Normal range only (the tests' weights are).
std::uint16_t host_bf16(double x) {
  if (x == 0.0) return std::signbit(x) ? 0x8000 : 0x0000;
  int e = 0;
  const double frac = std::frexp(x, &e);  // |frac| in [0.5, 1)
  const double r = std::ldexp(std::nearbyint(std::ldexp(frac, 8)), e - 8);
  return static_cast<std::uint16_t>(num::f32_bits(static_cast<float>(r)) >> 16);
}

std::vector<std::uint16_t> host_dequant(const HostQuantWeights& w) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(w.n * w.k));
  const int group = group_size(w.format);
  for (std::int64_t n = 0; n < w.n; ++n) {
    for (std::int64_t k = 0; k < w.k; ++k) {
      const std::int64_t g = k / group, groups = w.k / group;
      const std::uint8_t s = w.layout == WeightLayout::kTransposed
                                 ? w.scales[static_cast<std::size_t>(g * w.n + n)]
                                 : w.scales[static_cast<std::size_t>(n * groups + g)];
      const double scale =
          w.format == WeightFormat::kMxfp4 ? num::e8m0_to_f32(s) : num::e4m3_to_f32(s);
      out[static_cast<std::size_t>(n * w.k + k)] =
          host_bf16(double{num::e2m1_to_f32(w.code(n, k))} * scale * double{w.tensor_scale});
    }
  }
  return out;
}

HostQuantWeights make_weights(std::mt19937_64& gen, WeightFormat f, WeightLayout layout,
                              std::int64_t n, std::int64_t k, float tensor_scale) {
  HostQuantWeights h = ref::quantize(f, ref::random_weight_values(gen, n, k), n, k);
  if (tensor_scale > 0.0f) h.tensor_scale = tensor_scale;
  return with_layout(h, layout);
}

const char* layout_name(WeightLayout l) {
  return l == WeightLayout::kTransposed ? "transposed" : "row-major";
}

// The CPU modules without "blas": a backend with no dense GEMM.
CpuBackendOptions without_blas() {
  CpuBackendOptions o;
  std::erase_if(o.modules, [](const HostModule& m) { return m.name() == "blas"; });
  return o;
}

class DequantRoute : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = ref::fresh_seed();
    gen_.seed(seed_);
  }
  void TearDown() override {
    b_.synchronize(b_.default_stream());
    for (const DevicePtr p : owned_) b_.free(p);
    b_.op_cache().release(b_);
  }
  DevicePtr alloc(std::size_t bytes) {
    owned_.push_back(b_.alloc(bytes));
    return owned_.back();
  }
  DevicePtr upload(const std::vector<std::uint16_t>& v) {
    const DevicePtr p = alloc(std::max<std::size_t>(v.size() * 2, 2));
    b_.copy_h2d(p, v.data(), v.size() * 2);
    return p;
  }
  QuantWeights upload(const HostQuantWeights& h, UploadLayout l = UploadLayout::kSource) {
    QuantWeights w = upload_weights(b_, h, l);
    owned_.push_back(w.codes);
    owned_.push_back(w.scales);
    return w;
  }
  std::vector<std::uint16_t> read(DevicePtr p, std::size_t count) {
    b_.synchronize(b_.default_stream());
    std::vector<std::uint16_t> out(count);
    b_.copy_d2h(out.data(), p, count * 2);
    return out;
  }

  // One GEMM of the route on fresh data: its comparison with the float64 reference under the
  // route's tolerance (`tol`), the output poisoned first.
  ref::Comparison gemm(WeightFormat f, WeightLayout layout, std::int64_t m, std::int64_t n,
                       std::int64_t k, bool bias, float tensor_scale,
                       const toolkit::GemmTolerance& tol) {
    const HostQuantWeights h = make_weights(gen_, f, layout, n, k, tensor_scale);
    const QuantWeights w = upload(h);
    const std::vector<std::uint16_t> a = ref::random_activations(gen_, std::size_t(m * k));
    const std::vector<std::uint16_t> hb =
        bias ? ref::random_bias(gen_, n) : std::vector<std::uint16_t>{};
    const DevicePtr da = upload(a), dc = alloc(std::size_t(m * n) * 2);
    b_.memset(dc, ref::kPoisonByte, std::size_t(m * n) * 2);
    GemmOptions o = kDequantOpts;
    if (bias) o.bias = upload(hb);
    const GemmPlan p = plan(b_, m, w, o);
    run(p, b_.default_stream(), da, w, dc, scratch_workspace(p, b_.default_stream()), o.bias);
    return toolkit::compare(read(dc, std::size_t(m * n)), toolkit::reference(a, m, h, hb, tol));
  }

  CpuBackend b_;
  std::uint64_t seed_ = 0;
  std::mt19937_64 gen_;
  std::vector<DevicePtr> owned_;
};

// dequant_bf16 launched on its own: every weight bit-exact against host_bf16 of its exact value,
// for both formats and layouts, K and N·K not multiples of 32 (tail units), tensor scales that
// round and one that does not; nothing written past W.
TEST_F(DequantRoute, KernelIsBitExactAgainstTheHost) {
  SCOPED_TRACE(seed_);
  const ResolvedKernel& kern = b_.op_cache().kernel(b_, "w4a16", "dequant_bf16");
  constexpr std::size_t kTail = 32;  // bytes after W that must keep the poison
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{1, 32},
                                 {7, 96},
                                 {33, f == WeightFormat::kNvfp4 ? 48 : 64},
                                 {130, 160}}) {
        for (const float ts : {0.0f, 0.00123f, 3.7f, 0.25f}) {  // 0: the quantizer's own
          SCOPED_TRACE(
              fmt::format("{} {} {}x{} ts {}", to_string(f), layout_name(layout), n, k, ts));
          const HostQuantWeights h = make_weights(gen_, f, layout, n, k, ts);
          const QuantWeights w = upload(h);
          const std::size_t bytes = std::size_t(n * k) * 2;
          const DevicePtr out = alloc(bytes + kTail);
          b_.memset(out, ref::kPoisonByte, bytes + kTail);
          GemmParams p;
          p.codes = w.codes.address();
          p.scales = w.scales.address();
          p.out = out.address();
          p.n = n;
          p.k = k;
          p.tensor_scale = h.tensor_scale;
          p.flags = (f == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u) |
                    (layout == WeightLayout::kTransposed ? kGemmTransposed : 0u);
          const std::uint64_t units = static_cast<std::uint64_t>(dequant::unit_count(n, k));
          const auto grid =
              static_cast<std::uint32_t>((units + kern.meta.n_tile - 1) / kern.meta.n_tile);
          b_.launch_typed(kern, Dim3{grid}, Dim3{kern.meta.block_threads}, 0, b_.default_stream(),
                          std::array{KernelArg::value(p)});
          const std::vector<std::uint16_t> got = read(out, (bytes + kTail) / 2);
          const std::vector<std::uint16_t> want = host_dequant(h);
          std::int64_t wrong = 0, first = -1;
          for (std::size_t i = 0; i < want.size(); ++i) {
            if (got[i] != want[i] && wrong++ == 0) first = static_cast<std::int64_t>(i);
          }
          EXPECT_EQ(wrong, 0) << "first at W[" << first / k << ", " << first % k << "]: 0x"
                              << std::hex << got[std::size_t(std::max<std::int64_t>(first, 0))]
                              << " vs 0x" << want[std::size_t(std::max<std::int64_t>(first, 0))];
          for (std::size_t i = want.size(); i < got.size(); ++i) {
            EXPECT_EQ(got[i], ref::kPoisonBf16) << "written past W at element " << i;
          }
        }
      }
    }
  }
}

// The route against float64 over both formats and layouts, ragged N and K, M = 1, 17, 64, bias
// on and off and tensor scales that round: held to its table entry. With a power-of-two tensor
// scale the weights are exact, and the route meets the exact routes' own bounds.
TEST_F(DequantRoute, MatchesTheReference) {
  SCOPED_TRACE(seed_);
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(GemmRoute::kDequant, f);
    const toolkit::GemmTolerance exact = toolkit::gemm_tolerance(GemmRoute::kTiled, f);
    for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
      for (const std::int64_t m : {1, 17, 64}) {
        for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{37, 96}, {300, 288}}) {
          for (const bool bias : {false, true}) {
            const std::string what =
                fmt::format("{} {} M={} N={} K={}{}", to_string(f), layout_name(layout), m, n, k,
                            bias ? " +bias" : "");
            for (const float ts : {0.0f, 0.0371f}) {
              const ref::Comparison c = gemm(f, layout, m, n, k, bias, ts, tol);
              EXPECT_TRUE(toolkit::within(c, tol)) << what << " ts " << ts << ": " << c.str();
              EXPECT_EQ(c.unwritten, 0) << what;
            }
            const ref::Comparison c = gemm(f, layout, m, n, k, bias, 0.125f, exact);
            EXPECT_TRUE(toolkit::within(c, exact)) << what << " ts 2^-3 (exact): " << c.str();
          }
        }
      }
    }
  }
}

TEST_F(DequantRoute, PlanShowsTheDequantAndTheDenseGemm) {
  const HostQuantWeights h =
      make_weights(gen_, WeightFormat::kNvfp4, WeightLayout::kRowMajor, 300, 272, 0.0f);
  const QuantWeights w = upload(h);
  GemmOptions o = kDequantOpts;
  o.bias = alloc(600);
  const GemmPlan p = plan(b_, 64, w, o);
  EXPECT_EQ(p.route, GemmRoute::kDequant);
  ASSERT_EQ(p.launches.size(), 1u);
  EXPECT_EQ(b_.kernel_name(p.launches[0].kernel), "w4a16::dequant_bf16");
  EXPECT_EQ(p.launches[0].grid.x, 1u);  // 300 x 9 units, 4096 per CPU block
  ASSERT_TRUE(p.dense.has_value());
  EXPECT_EQ(p.dense->shape, (DenseGemmShape{DenseKind::kBf16, 64, 300, 272, true}));
  EXPECT_EQ(p.workspace.w_bf16, 300u * 272u * 2u);
  EXPECT_EQ(p.workspace.dense, p.dense->workspace_bytes);
  EXPECT_EQ(p.workspace.split_k + p.workspace.a_e4m3 + p.workspace.w_e4m3, 0u);
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.describe(),
            "dequant M=64 N=300 K=272: w4a16::dequant_bf16 1x1x1 x 256 threads, dense bf16 "
            "64x300x272 +bias: cpu reference blas::gemm_bf16; split-K 1 x 272; workspace 163328 B");
  // The automatic route is unchanged: it never takes the dequant route.
  EXPECT_EQ(choose_route(b_, 64, w), GemmRoute::kTiled);
  EXPECT_EQ(choose_route(b_, 4096, w), GemmRoute::kTiled);
  EXPECT_EQ(choose_route(b_, 64, w, kDequantOpts), GemmRoute::kDequant);
}

// Refused: packed weights; a workspace part missing, too small, or overlapping C; a plan whose
// dense GEMM was edited away; a backend without a dense GEMM (kUnavailable, its reason named).
TEST_F(DequantRoute, RefusesBadInput) {
  const HostQuantWeights h =
      make_weights(gen_, WeightFormat::kNvfp4, WeightLayout::kRowMajor, 64, 128, 0.0f);
  const QuantWeights packed = upload(h, UploadLayout::kDecode);
  const Error e1 = expect_error([&] { (void)plan(b_, 64, packed, kDequantOpts); });
  EXPECT_EQ(e1.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e1.what()).find("route dequant reads weights in their source layout"),
            std::string::npos)
      << e1.what();

  const QuantWeights w = upload(h);
  const std::int64_t m = 8;
  const DevicePtr da = upload(ref::random_activations(gen_, std::size_t(m * 128)));
  const DevicePtr dc = alloc(std::size_t(m * 64) * 2);
  const GemmPlan p = plan(b_, m, w, kDequantOpts);
  const StreamHandle s = b_.default_stream();
  const auto refused = [&](const GemmPlan& pl, const GemmWorkspace& ws, const std::string& part) {
    const Error e = expect_error([&] { run(pl, s, da, w, dc, ws, {}); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  };
  GemmWorkspace ws = scratch_workspace(p, s);
  ASSERT_TRUE(ws.w_bf16);
  GemmWorkspace missing = ws;
  missing.w_bf16 = {};
  refused(p, missing, "BF16 weights workspace is null");
  GemmWorkspace small = ws;
  small.w_bf16 = alloc(p.workspace.w_bf16 - 256);
  refused(p, small, "BF16 weights workspace");
  {
    // C inside a buffer that is big enough for W too, and W placed on it.
    const DevicePtr big = alloc(p.workspace.w_bf16 + 1024);
    GemmWorkspace over_c = ws;
    over_c.w_bf16 = big;
    const Error e = expect_error([&] { run(p, s, da, w, big, over_c, {}); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("BF16 weights workspace"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("overlaps C"), std::string::npos) << e.what();
  }
  // A dense workspace (none on the CPU) that the plan asks for must be there too.
  GemmPlan with_dense = p;
  with_dense.workspace.dense = 4096;
  refused(with_dense, ws, "dense GEMM workspace is null");
  GemmWorkspace dense_over_w = ws;
  dense_over_w.dense = ws.w_bf16;
  refused(with_dense, dense_over_w, "dense GEMM workspace");
  GemmPlan no_dense = p;
  no_dense.dense.reset();
  refused(no_dense, ws, "does not fit itself");
  GemmPlan wrong_shape = p;
  wrong_shape.dense->shape.k = 64;
  refused(wrong_shape, ws, "does not fit itself");

  // No dense GEMM: every entry point refuses the route with the backend's reason.
  CpuBackend bare(without_blas());
  QuantWeights wb = upload_weights(bare, h);
  for (const auto& call :
       std::vector<std::function<void()>>{[&] { (void)plan(bare, m, wb, kDequantOpts); },
                                          [&] { (void)choose_route(bare, m, wb, kDequantOpts); }}) {
    const Error e = expect_error(call);
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find("blas::gemm_bf16"), std::string::npos) << e.what();
  }
  // The other routes still run there: auto chooses as it would without the dense route.
  EXPECT_EQ(choose_route(bare, m, wb),
            m <= ops::decode_max_m(bare) ? GemmRoute::kDecode : GemmRoute::kTiled);
  free_weights(bare, wb);
}

// w4a16_gemm takes the route's scratch per stream: two streams get their own BF16 weights and
// both results are right.
TEST_F(DequantRoute, TwoStreamsHaveTheirOwnWorkspace) {
  SCOPED_TRACE(seed_);
  const HostQuantWeights h =
      make_weights(gen_, WeightFormat::kMxfp4, WeightLayout::kTransposed, 96, 192, 0.3f);
  const QuantWeights w = upload(h);
  const std::int64_t m = 17;
  const StreamHandle s1 = b_.create_stream(), s2 = b_.create_stream();
  const GemmPlan p = plan(b_, m, w, kDequantOpts);
  const GemmWorkspace w1 = scratch_workspace(p, s1), w2 = scratch_workspace(p, s2);
  EXPECT_NE(w1.w_bf16, w2.w_bf16);
  EXPECT_EQ(scratch_workspace(p, s1).w_bf16, w1.w_bf16);  // memoized per stream
  const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(GemmRoute::kDequant, h.format);
  std::vector<std::vector<std::uint16_t>> as;
  std::vector<DevicePtr> cs;
  for (const StreamHandle s : {s1, s2}) {
    as.push_back(ref::random_activations(gen_, std::size_t(m * 192)));
    const DevicePtr da = upload(as.back()), dc = alloc(std::size_t(m * 96) * 2);
    b_.memset(dc, ref::kPoisonByte, std::size_t(m * 96) * 2);
    w4a16_gemm(b_, s, da, m, w, dc, kDequantOpts);
    cs.push_back(dc);
  }
  for (std::size_t i = 0; i < 2; ++i) {
    b_.synchronize(i == 0 ? s1 : s2);
    const ref::Comparison c = toolkit::compare(read(cs[i], std::size_t(m * 96)),
                                               toolkit::reference(as[i], m, h, {}, tol));
    EXPECT_TRUE(toolkit::within(c, tol)) << "stream " << i << ": " << c.str();
  }
  b_.destroy_stream(s1);
  b_.destroy_stream(s2);
}

}  // namespace
}  // namespace metrale::ops
