// FP32 output of the w4a16 GEMM (GemmOptions::out_f32), the row-parallel layer's partial sums,
// on the CPU backend: on every route whose kernel publishes out_f32 the FP32 C is the same sum
// the BF16 C rounds (rounding it gives the BF16 output bit for bit), it is within FP32
// accumulation of the float64 reference, every element is written, and the routes and buffers
// that cannot take it are refused by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "ops/gemm_reference.h"

namespace metrale::ops {
namespace {

namespace ref = metrale::testing::gemm;
using metrale::testing::expect_error;
using ::testing::HasSubstr;

struct Case {
  GemmRoute route;
  std::int64_t m;
  UploadLayout upload;
  bool bias;
};

// A backend: the numerics suite's instances ("cpu", "cuda"; gpu.ops_numerics_suite runs the
// "/cuda" ones).
class OutF32 : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    ref::BackendOrReason r = ref::make_backend(GetParam());
    if (!r.backend) GTEST_SKIP() << r.reason;
    backend_ = std::move(r.backend);
  }
  void TearDown() override {
    if (backend_) backend_->op_cache().release(*backend_);
  }
  // One case: FP32 C against BF16 C and the float64 reference.
  void check(const Case& cs);
  std::unique_ptr<Backend> backend_;
};

void OutF32::check(const Case& cs) {
  Backend& b_ = *backend_;
  const std::uint64_t seed = ref::fresh_seed();
  std::mt19937_64 gen(seed);
  const std::int64_t n = 16 * static_cast<std::int64_t>(1 + gen() % 12) + 8;
  const std::int64_t k = 32 * static_cast<std::int64_t>(1 + gen() % 16);
  const HostQuantWeights host =
      ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, n, k), n, k);
  QuantWeights w = upload_weights(b_, host, cs.upload);
  const std::vector<std::uint16_t> a =
      ref::random_activations(gen, static_cast<std::size_t>(cs.m * k));
  const std::vector<std::uint16_t> bias =
      cs.bias ? ref::random_bias(gen, n) : std::vector<std::uint16_t>{};
  const auto mn = static_cast<std::size_t>(cs.m * n);
  const DevicePtr da = b_.alloc(a.size() * 2), c16 = b_.alloc(mn * 2), c32 = b_.alloc(mn * 4);
  const DevicePtr db = cs.bias ? b_.alloc(bias.size() * 2) : DevicePtr{};
  b_.copy_h2d(da, a.data(), a.size() * 2);
  if (cs.bias) b_.copy_h2d(db, bias.data(), bias.size() * 2);
  b_.memset(c32, 0xFF, mn * 4);  // NaN: an unwritten element fails
  b_.memset(c16, ref::kPoisonByte, mn * 2);

  GemmOptions o;
  o.route = cs.route;
  o.activations = Activations::kAllowE4m3;
  o.bias = db;
  const StreamHandle s = b_.default_stream();
  const GemmPlan p16 = plan(b_, cs.m, w, o);
  o.out_f32 = true;
  const GemmPlan p32 = plan(b_, cs.m, w, o);
  EXPECT_EQ(p32.route, p16.route);
  EXPECT_THAT(p32.describe(), HasSubstr("FP32 C"));
  run(p16, s, da, w, c16, scratch_workspace(p16, s), db);
  run(p32, s, da, w, c32, scratch_workspace(p32, s), db);
  std::vector<std::uint16_t> out16(mn);
  std::vector<float> out32(mn);
  b_.copy_d2h(out16.data(), c16, mn * 2);
  b_.copy_d2h(out32.data(), c32, mn * 4);

  const std::string what = fmt::format("seed {} route {} M={} N={} K={}{}", seed,
                                       to_string(p32.route), cs.m, n, k, cs.bias ? " +bias" : "");
  for (std::size_t i = 0; i < mn; ++i) {
    ASSERT_FALSE(std::isnan(out32[i])) << what << ": element " << i << " unwritten";
    ASSERT_EQ(num::f32_to_bf16(out32[i]), out16[i]) << what << ": element " << i;
  }
  if (p32.route != GemmRoute::kE4m3) {  // the e4m3 route's A is cast: its reference differs
    const ref::Reference r = ref::reference(a, cs.m, host, bias, ref::AMode::kBf16);
    // FP32 accumulation alone (no output rounding): K roundings of 2^-24 of the magnitude at
    // worst, plus the tensor scale's and the bias's. Twice that on a GPU: the PTX ISA does not
    // promise that tensor-core FP32 accumulation rounds to nearest.
    const int ulp = b_.name() == "cpu" ? -24 : -23;
    for (std::size_t i = 0; i < mn; ++i) {
      const double bound = (static_cast<double>(k) + 2) * std::ldexp(r.abs_sum[i], ulp) + 1e-30;
      ASSERT_LE(std::fabs(out32[i] - r.value[i]), bound) << what << ": element " << i;
    }
  }
  for (const DevicePtr d : {da, c16, c32, db}) b_.free(d);
  free_weights(b_, w);
}

TEST_P(OutF32, IsTheSumTheBf16OutputRoundsOnce) {
  for (const Case& cs : {Case{GemmRoute::kAuto, 1, UploadLayout::kSource, false},
                         Case{GemmRoute::kAuto, 3, UploadLayout::kSource, true},
                         Case{GemmRoute::kAuto, 37, UploadLayout::kSource, true},
                         Case{GemmRoute::kTiled, 64, UploadLayout::kSource, false},
                         // Past one block of rows (the CPU's tiled blocks are 256 tall).
                         Case{GemmRoute::kTiled, 300, UploadLayout::kSource, true},
                         Case{GemmRoute::kE4m3, 20, UploadLayout::kSource, true},
                         Case{GemmRoute::kDecode, 2, UploadLayout::kDecode, true},
                         Case{GemmRoute::kAuto, 300, UploadLayout::kDecode, true}}) {
    check(cs);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(, OutF32, ::testing::Values("cpu", "cuda"), ref::backend_name);

class OutF32Refusals : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 gen(ref::fresh_seed());
    host_ = ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, 64, 128), 64, 128);
    w_ = upload_weights(b_, host_);
  }
  void TearDown() override { free_weights(b_, w_); }
  CpuBackend b_;
  HostQuantWeights host_;
  QuantWeights w_;
};

TEST_F(OutF32Refusals, TheDequantRouteWritesBf16Only) {
  GemmOptions o;
  o.route = GemmRoute::kDequant;
  o.out_f32 = true;
  const Error e = expect_error([&] { (void)plan(b_, 64, w_, o); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(e.what(), HasSubstr("dense GEMM, in BF16 only"));
  o.route = GemmRoute::kAuto;
  for (const std::int64_t m : {1, 16, 300, 2048}) {
    EXPECT_NE(plan(b_, m, w_, o).route, GemmRoute::kDequant) << "M=" << m;
  }
}

TEST_F(OutF32Refusals, ACSizedForBf16IsRefused) {
  GemmOptions o;
  o.out_f32 = true;
  const GemmPlan p = plan(b_, 4, w_, o);
  const DevicePtr a = b_.alloc(4 * 128 * 2), c = b_.alloc(4 * 64 * 2);
  const Error e = expect_error(
      [&] { run(p, b_.default_stream(), a, w_, c, scratch_workspace(p, b_.default_stream())); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("C"));
  b_.free(a);
  b_.free(c);
}

TEST_F(OutF32Refusals, APlanEditedToFp32WithoutItsFlagIsRefused) {
  GemmPlan p = plan(b_, 4, w_);
  p.out_f32 = true;  // flags still say BF16: run() must not trust the field alone
  const DevicePtr a = b_.alloc(4 * 128 * 2), c = b_.alloc(4 * 64 * 4);
  const Error e = expect_error(
      [&] { run(p, b_.default_stream(), a, w_, c, scratch_workspace(p, b_.default_stream())); });
  EXPECT_THAT(e.what(), HasSubstr("kernel flags"));
  b_.free(a);
  b_.free(c);
}

}  // namespace
}  // namespace metrale::ops
