// The GEMM protocol in two steps, on the CPU backend: plan() decides and can be inspected, run()
// checks buffers and launches, and w4a16_gemm is run(plan(...)) with OpCache scratch. Data are
// fresh random draws checked against the float64 reference of gemm_reference.h, with poisoned
// outputs so an unwritten element fails.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "ops/gemm_reference.h"

namespace metrale::ops {
namespace {

namespace ref = metrale::testing::gemm;
using metrale::testing::expect_error;
using ::testing::HasSubstr;

// One layer's data on a backend: weights, A, bias and a poisoned C.
struct Layer {
  Backend* backend;
  HostQuantWeights host;
  QuantWeights w;
  std::vector<std::uint16_t> a, bias;
  DevicePtr da, dc, dbias;
  std::int64_t m = 0;

  Layer(Backend& b, std::mt19937_64& gen, std::int64_t m_, std::int64_t n, std::int64_t k,
        bool with_bias)
      : backend(&b), m(m_) {
    const std::vector<float> wv = ref::random_weight_values(gen, n, k);
    host = ref::quantize(WeightFormat::kNvfp4, wv, n, k);
    w = upload_weights(b, host);
    a = ref::random_activations(gen, static_cast<std::size_t>(m * k));
    da = b.alloc(a.size() * 2);
    b.copy_h2d(da, a.data(), a.size() * 2);
    dc = b.alloc(static_cast<std::size_t>(m * n * 2));
    if (with_bias) {
      bias = ref::random_bias(gen, n);
      dbias = b.alloc(bias.size() * 2);
      b.copy_h2d(dbias, bias.data(), bias.size() * 2);
    }
    poison(b);
  }
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;
  ~Layer() {
    free_weights(*backend, w);
    for (const DevicePtr p : {da, dc, dbias}) backend->free(p);
  }
  void poison(Backend& b) const {
    b.memset(dc, ref::kPoisonByte, static_cast<std::size_t>(m * w.n * 2));
  }
  std::vector<std::uint16_t> out(Backend& b) const {
    b.synchronize(b.default_stream());
    std::vector<std::uint16_t> c(static_cast<std::size_t>(m * w.n));
    b.copy_d2h(c.data(), dc, c.size() * 2);
    return c;
  }
  ref::Reference reference(ref::AMode mode) const { return ref::reference(a, m, host, bias, mode); }
};

class PlanRun : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = ref::fresh_seed();
    gen_.seed(seed_);
  }
  CpuBackend b_;
  std::uint64_t seed_ = 0;
  std::mt19937_64 gen_;
};

TEST_F(PlanRun, APlanNamesItsRouteKernelsGridAndWorkspace) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  Layer l(b_, gen_, 3, 300, 256, false);
  const GemmPlan p = plan(b_, l.m, l.w);
  EXPECT_EQ(p.route, GemmRoute::kDecode);
  ASSERT_EQ(p.launches.size(), 1u);  // the CPU decode kernel does not split K
  const PlannedLaunch& g = p.launches[0];
  EXPECT_EQ(b_.kernel_name(g.kernel), "w4a16::gemm_decode");
  const std::uint32_t tile = g.kernel.meta.n_tile;
  ASSERT_GT(tile, 0u);
  EXPECT_EQ(g.grid.x, (300 + tile - 1) / tile);
  EXPECT_EQ(g.grid.y, 1u);
  EXPECT_EQ(g.grid.z, 1u);
  EXPECT_EQ(g.block.x, g.kernel.meta.block_threads);
  EXPECT_EQ(p.splits, 1);
  EXPECT_EQ(p.workspace.total(), 0u);
  EXPECT_THAT(p.describe(),
              HasSubstr("decode M=3 N=300 K=256: w4a16::gemm_decode 2x1x1 x 256 threads"));

  GemmOptions e4m3;
  e4m3.activations = Activations::kAllowE4m3;
  e4m3.route = GemmRoute::kE4m3;  // kAuto would keep the exact route (no module offers e4m3)
  const GemmPlan q = plan(b_, 64, l.w, e4m3);
  EXPECT_EQ(q.route, GemmRoute::kE4m3);
  ASSERT_EQ(q.launches.size(), 3u);
  EXPECT_EQ(b_.kernel_name(q.launches[0].kernel), "w4a16::bf16_to_fp8");
  EXPECT_EQ(b_.kernel_name(q.launches[1].kernel), "w4a16::dequant_e4m3");
  EXPECT_EQ(b_.kernel_name(q.launches[2].kernel), "w4a16::gemm_e4m3");
  EXPECT_EQ(q.workspace.a_e4m3, 64u * 256u);
  EXPECT_EQ(q.workspace.w_e4m3, 300u * 256u);
}

TEST_F(PlanRun, RunOfAPlanIsW4a16GemmBitForBitAndMatchesTheReference) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  for (const std::int64_t m : {std::int64_t{1}, std::int64_t{5}, std::int64_t{40}}) {
    SCOPED_TRACE(fmt::format("M = {}", m));
    Layer l(b_, gen_, m, 72, 512, true);
    GemmOptions o;
    o.bias = l.dbias;
    w4a16_gemm(b_, b_.default_stream(), l.da, m, l.w, l.dc, o);
    const std::vector<std::uint16_t> via_gemm = l.out(b_);
    l.poison(b_);
    const GemmPlan p = plan(b_, m, l.w, o);
    run(p, b_.default_stream(), l.da, l.w, l.dc, GemmWorkspace{}, l.dbias);
    const std::vector<std::uint16_t> via_run = l.out(b_);
    EXPECT_EQ(via_run, via_gemm);
    ref::expect_close(ref::compare(via_run, l.reference(ref::AMode::kBf16)), ref::kNormTol,
                      "run(plan)");
  }
}

TEST_F(PlanRun, TheE4m3RouteRunsOnACarvedWorkspaceOfTheCallersOwn) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  Layer l(b_, gen_, 64, 48, 256, false);
  GemmOptions o;
  o.activations = Activations::kAllowE4m3;
  o.route = GemmRoute::kE4m3;
  const GemmPlan p = plan(b_, l.m, l.w, o);
  ASSERT_EQ(p.route, GemmRoute::kE4m3);
  const std::uint64_t total = p.workspace.total();
  const DevicePtr buf = b_.alloc(total);
  const GemmWorkspace ws = GemmWorkspace::carve(buf, p.workspace);
  EXPECT_FALSE(ws.split_k);
  EXPECT_EQ(ws.a_e4m3.address() % 256, 0u);
  EXPECT_EQ(ws.w_e4m3.address() % 256, 0u);
  EXPECT_GE(ws.w_e4m3.address(), ws.a_e4m3.address() + p.workspace.a_e4m3);
  EXPECT_LE(ws.w_e4m3.address() + p.workspace.w_e4m3, buf.address() + total);
  const std::size_t scratch_before = b_.op_cache().scratch_count();
  run(p, b_.default_stream(), l.da, l.w, l.dc, ws);
  EXPECT_EQ(b_.op_cache().scratch_count(), scratch_before) << "run() took OpCache scratch";
  ref::expect_close(ref::compare(l.out(b_), l.reference(ref::AMode::kE4m3)), ref::kNormTol,
                    "e4m3 on a carved workspace");
  b_.free(buf);
}

TEST_F(PlanRun, RunLooksNothingUpAndAllocatesNothing) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  Layer l(b_, gen_, 2, 40, 128, false);
  const GemmPlan p = plan(b_, l.m, l.w);
  const std::size_t audit = b_.lookup_audit().size(), kernels = b_.op_cache().kernel_count();
  const std::size_t allocs = b_.live_alloc_count();
  for (int i = 0; i < 3; ++i) run(p, b_.default_stream(), l.da, l.w, l.dc, GemmWorkspace{});
  EXPECT_EQ(b_.lookup_audit().size(), audit);
  EXPECT_EQ(b_.op_cache().kernel_count(), kernels);
  EXPECT_EQ(b_.live_alloc_count(), allocs);
}

TEST_F(PlanRun, RunRefusesWeightsBiasAndWorkspaceThatDoNotFitThePlan) {
  SCOPED_TRACE(fmt::format("seed {}", seed_));
  Layer l(b_, gen_, 64, 32, 128, true);
  Layer other(b_, gen_, 64, 32, 256, false);
  const GemmPlan p = plan(b_, l.m, l.w);
  const auto refused = [&](auto call, const char* words) {
    l.poison(b_);
    const Error e = expect_error(call);
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_THAT(e.what(), HasSubstr("[run] "));
    EXPECT_THAT(e.what(), HasSubstr(words));
    const std::vector<std::uint16_t> c = l.out(b_);
    EXPECT_EQ(c, std::vector<std::uint16_t>(c.size(), ref::kPoisonBf16)) << "C was written";
  };
  refused([&] { run(p, b_.default_stream(), l.da, other.w, l.dc, {}); },
          "weights are nvfp4 32x256 row-major; the plan is for nvfp4 32x128 row-major");
  refused([&] { run(p, b_.default_stream(), l.da, l.w, l.dc, {}, l.dbias); },
          "bias is given, but the plan was made without one");
  refused([&] { run(GemmPlan{}, b_.default_stream(), l.da, l.w, l.dc, {}); }, "the plan is empty");
  GemmOptions with_bias;
  with_bias.bias = l.dbias;
  const GemmPlan pb = plan(b_, l.m, l.w, with_bias);
  refused([&] { run(pb, b_.default_stream(), l.da, l.w, l.dc, {}); },
          "the plan adds a bias, but bias is null");
  GemmOptions e4m3;
  e4m3.activations = Activations::kAllowE4m3;
  e4m3.route = GemmRoute::kE4m3;  // kAuto would keep the exact route (no module offers e4m3)
  const GemmPlan pe = plan(b_, l.m, l.w, e4m3);
  refused([&] { run(pe, b_.default_stream(), l.da, l.w, l.dc, {}); }, "E4M3 A workspace is null");
  const DevicePtr small = b_.alloc(pe.workspace.a_e4m3);  // no room for the weights after it
  refused(
      [&] {
        run(pe, b_.default_stream(), l.da, l.w, l.dc, GemmWorkspace::carve(small, pe.workspace));
      },
      "E4M3 weights workspace");
  b_.free(small);
  // A workspace over the caller's own buffers, or a plan edited after plan(), is refused too.
  const DevicePtr ws = b_.alloc(pe.workspace.total());
  GemmWorkspace over_a = GemmWorkspace::carve(ws, pe.workspace);
  over_a.a_e4m3 = l.da;
  refused([&] { run(pe, b_.default_stream(), l.da, l.w, l.dc, over_a); }, "E4M3 A workspace [");
  GemmWorkspace over_c = GemmWorkspace::carve(ws, pe.workspace);
  over_c.w_e4m3 = l.dc;  // C is M x N BF16: exactly the N x K bytes of the E4M3 weights here
  refused([&] { run(pe, b_.default_stream(), l.da, l.w, l.dc, over_c); }, "overlaps C [");
  GemmPlan edited = pe;
  edited.m = 2 * pe.m;
  refused(
      [&] {
        run(edited, b_.default_stream(), l.da, l.w, l.dc, GemmWorkspace::carve(ws, pe.workspace));
      },
      "the plan does not fit itself");
  b_.free(ws);
}

TEST(GemmPlanLifetime, APlanIsRefusedOnceItsModelIsTornDown) {
  ModelScope model(std::make_unique<CpuBackend>());
  Backend& b = model.backend();
  std::vector<float> wv(16 * 32, 0.5f);
  QuantWeights w = upload_weights(b, quantize_nvfp4(wv, 16, 32));
  const DevicePtr a = b.alloc(2 * 32 * 2), c = b.alloc(2 * 16 * 2);
  const GemmPlan p = plan(b, 2, w);
  b.op_cache().release(b);
  const Error e = expect_error([&] { run(p, b.default_stream(), a, w, c, {}); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[run] the plan's backend was torn down"));
  free_weights(b, w);
  b.free(a);
  b.free(c);
}

}  // namespace
}  // namespace metrale::ops
