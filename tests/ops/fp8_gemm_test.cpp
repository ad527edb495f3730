// The W8A8 op (ops/fp8_gemm.h) on the CPU backend, end to end: A (BF16) cast by module "fp8",
// multiplied by E4M3 weights with 128 x 128 block scales in blas::gemm_e4m3_block128, against
// float64 references, with C poisoned first; M = 1, 3, 4, 5, 128, 300 (M and ceil(K/128) off and
// on multiples of 4: padded and unpadded scale layouts), ragged N and K, with and without a bias;
// the bad-input catalogue (nothing written on error); two streams; a backend without the dense
// kind.
//
// THE BOUNDS (per element, deterministic). Let Wd be the dequantized weights (exact in the
// reference), a the BF16 activations, a8 = e4m3(a / s)·s their cast with s the block's scale.
//  - A's cast: E4M3 keeps 4 significant bits, so RNE moves a / s by at most half a step: 2^-4 of
//    itself in the normal range (relative step 2^-3 at the bottom of a binade, half of it), and
//    2^-10 absolute in the subnormal range (step 2^-9), i.e. 2^-10·s in A's units; the FP32
//    quotient a / s adds 2^-24 of |a| before that rounding (we allow 2^-23). So
//    |a8 − a| ≤ E = max(2^-4·|a|, 2^-10·s) + 2^-23·|a|.
//  - The GEMM on a8 (the aware reference Σ a8·Wd): exact E4M3 products, then at most
//    K + 2·ceil(K/128) + 1 FP32 roundings (tests/cpu/dense_e4m3_test.cpp), so
//    |v − Σ a8·Wd − bias| ≤ (K + 2·ceil(K/128) + 8)·2^-23·S8, S8 = Σ |a8·Wd| + |bias|.
//  - The output rounding to BF16 adds 2^-8 of the value.
// Tight (against the aware reference): |out − ref8| ≤ 2^-8·|ref8| + (1 + 2^-8)·γ·S8.
// Against the exact reference Σ a·Wd: the above plus Σ E·|Wd| (triangle inequality), with
// 2^-8 of |ref| + Σ E·|Wd| in place of 2^-8·|ref8|.
// Normalized, against the exact reference: toolkit::kE4m3VsExactTol (2^-4/√3 + 2^-8, the
// statistical estimate of the RMS cast error, toolkit/gemm_tolerance.h), on shapes with at
// least kE4m3StatMinOutputs outputs and kE4m3StatMinActs activations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/fp8_gemm.h"
#include "ops/gemm_reference.h"
#include "support/fp8_reference.h"
#include "support/random.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale {
namespace {

using testing::expect_error;
using testing::rng;
namespace f8 = testing::fp8;

constexpr std::uint16_t kPoison = 0x7FC1;  // a BF16 NaN no GEMM writes

std::vector<std::uint16_t> random_a(std::size_t count) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-8, 2);
  std::vector<std::uint16_t> v(count);
  for (auto& x : v) x = num::f32_to_bf16(std::ldexp(u(rng()), e(rng())));
  return v;
}

struct Problem {
  std::int64_t m, n, k;
  bool bias;
};

// Runs one problem through w8a8_gemm (or plan + run with a carved caller workspace) and checks
// every element against both references.
// mma_term: the FP8 tensor cores' accumulation allowance per unit of S8 (0 on the CPU, whose
// reference accumulates in FP32).
void check_problem(Backend& be, const Problem& s, bool one_call, StreamHandle stream,
                   double mma_term = 0.0) {
  SCOPED_TRACE(::testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k
                                    << " bias=" << s.bias << " one_call=" << one_call);
  const f8::HostFp8Weights hw = f8::random_weights(s.n, s.k, rng());
  ops::Fp8Weights w = ops::upload_fp8_weights(be, hw.codes, hw.scale_bytes(), s.n, s.k);
  const auto ha = random_a(static_cast<std::size_t>(s.m * s.k));
  std::vector<std::uint16_t> hbias(static_cast<std::size_t>(s.n));
  for (auto& x : hbias) x = num::f32_to_bf16(std::uniform_real_distribution<float>(-1, 1)(rng()));
  const DevicePtr a = be.alloc(ha.size() * 2),
                  c = be.alloc(static_cast<std::size_t>(s.m * s.n) * 2),
                  bias = s.bias ? be.alloc(hbias.size() * 2) : DevicePtr{};
  be.copy_h2d(a, ha.data(), ha.size() * 2);
  if (s.bias) be.copy_h2d(bias, hbias.data(), hbias.size() * 2);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(s.m * s.n), kPoison);
  be.copy_h2d(c, out.data(), out.size() * 2);

  if (one_call) {
    ops::w8a8_gemm(be, stream, a, s.m, w, c, bias);
  } else {
    const ops::Fp8GemmPlan plan = ops::plan(be, s.m, w, ops::Fp8GemmOptions{bias});
    EXPECT_NE(plan.describe().find("fp8::cast_e4m3_block128"), std::string::npos)
        << plan.describe();
    const DevicePtr ws = be.alloc(plan.workspace.total());
    ops::run(plan, stream, a, w, c, ops::Fp8Workspace::carve(ws, plan.workspace), bias);
    be.synchronize(stream);
    be.free(ws);
  }
  be.synchronize(stream);
  be.copy_d2h(out.data(), c, out.size() * 2);

  const f8::CastA a8 = f8::cast_a(ha, s.m, s.k);
  const double gamma =
      static_cast<double>(s.k + 2 * f8::blocks(s.k) + 8) * std::ldexp(1.0, -23) + mma_term;
  const double u8 = std::ldexp(1.0, -8);
  double err2 = 0, ref2 = 0;
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      const double b = s.bias ? num::bf16_to_f32(hbias[static_cast<std::size_t>(j)]) : 0.0;
      double ref = b, ref8 = b, s8 = std::fabs(b), cast_err = 0;
      for (std::int64_t q = 0; q < s.k; ++q) {
        const auto at = static_cast<std::size_t>(i * s.k + q);
        const double wd = hw.at(j, q), x = num::bf16_to_f32(ha[at]);
        ref += x * wd;
        ref8 += a8.value[at] * wd;
        s8 += std::fabs(a8.value[at] * wd);
        const double e = std::max(std::ldexp(std::fabs(x), -4), std::ldexp(a8.scale[at], -10)) +
                         std::ldexp(std::fabs(x), -23);
        cast_err += e * std::fabs(wd);
      }
      const std::uint16_t bits = out[static_cast<std::size_t>(i * s.n + j)];
      ASSERT_NE(bits, kPoison) << "C[" << i << ", " << j << "] was not written";
      const double got = num::bf16_to_f32(bits);
      ASSERT_LE(std::fabs(got - ref8), u8 * std::fabs(ref8) + (1 + u8) * gamma * s8)
          << "C[" << i << ", " << j << "] = " << got << ", aware reference " << ref8;
      ASSERT_LE(std::fabs(got - ref),
                u8 * (std::fabs(ref) + cast_err) + cast_err + (1 + u8) * gamma * s8)
          << "C[" << i << ", " << j << "] = " << got << ", exact reference " << ref;
      err2 += (got - ref) * (got - ref);
      ref2 += ref * ref;
    }
  }
  if (s.m * s.n >= toolkit::kE4m3StatMinOutputs && s.m * s.k >= toolkit::kE4m3StatMinActs) {
    ASSERT_GT(ref2, 0.0);
    EXPECT_LE(std::sqrt(err2 / ref2), toolkit::kE4m3VsExactTol);
  }
  for (DevicePtr p : {a, c, bias}) {
    if (p) be.free(p);
  }
  ops::free_fp8_weights(be, w);
}

// The numerics suite's instances ("cpu", "cuda"; gpu.ops_numerics_suite runs the "/cuda" ones):
// a backend without the kE4m3Block128 dense GEMM skips, saying why.
class W8a8Numerics : public testing::gemm::W8a8BackendTest {};

TEST_P(W8a8Numerics, MatchesTheFloat64References) {
  // The GPU's FP8 tensor cores align products to the largest and keep about 13 fraction bits,
  // truncating (toolkit/gemm_tolerance.h): per MMA of 32 K into a fresh accumulator at most
  // (32 + 1)·2^-13 of its Σ|a8·w|. Allowed on a GPU backend until a device run measures
  // cuBLASLt's own; the CPU reference accumulates in FP32 and is held to the FP32 bound alone.
  const double mma = GetParam() == "cpu" ? 0.0 : 2 * toolkit::kFp8MmaTerm;
  // N and K within cuBLAS's FP8 rules (N % 8, K % 16), 128-blocks partial and whole, M on and
  // off multiples of 4: every backend runs these.
  std::vector<Problem> shapes = {Problem{1, 296, 208, false},  Problem{1, 64, 128, true},
                                 Problem{5, 136, 304, true},   Problem{128, 200, 272, false},
                                 Problem{300, 136, 144, true}, Problem{3, 72, 704, false},
                                 Problem{4, 64, 512, true}};
  // Any N and K on the CPU; on CUDA, cuBLASLt's FP8 rules refuse them by name at plan time.
  const std::vector<Problem> ragged = {Problem{1, 300, 200, false}, Problem{5, 129, 300, true},
                                       Problem{128, 200, 257, false}, Problem{300, 130, 130, true},
                                       Problem{3, 70, 700, false}};
  if (GetParam() == "cpu") {
    shapes.insert(shapes.end(), ragged.begin(), ragged.end());
  } else {
    for (const Problem& s : ragged) {
      const f8::HostFp8Weights hw = f8::random_weights(s.n, s.k, rng());
      ops::Fp8Weights w = ops::upload_fp8_weights(b(), hw.codes, hw.scale_bytes(), s.n, s.k);
      const Error e = expect_error([&] { (void)ops::plan(b(), s.m, w, {}); });
      EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
      EXPECT_NE(std::string(e.what()).find("is not a multiple of"), std::string::npos) << e.what();
      ops::free_fp8_weights(b(), w);
    }
  }
  for (const Problem& s : shapes) {
    check_problem(b(), s, /*one_call=*/true, stream(), mma);
    check_problem(b(), s, /*one_call=*/false, stream(), mma);
  }
}
INSTANTIATE_TEST_SUITE_P(, W8a8Numerics, ::testing::Values("cpu", "cuda"),
                         testing::gemm::backend_name);

TEST(W8a8Gemm, TwoStreamsKeepTheirOwnScratch) {
  CpuBackend be;
  const StreamHandle s1 = be.create_stream(), s2 = be.create_stream();
  check_problem(be, Problem{7, 150, 140, true}, true, s1);
  check_problem(be, Problem{9, 150, 140, false}, true, s2);
  const f8::HostFp8Weights hw = f8::random_weights(150, 140, rng());
  ops::Fp8Weights w = ops::upload_fp8_weights(be, hw.codes, hw.scale_bytes(), 150, 140);
  const ops::Fp8GemmPlan plan = ops::plan(be, 7, w, {});
  const ops::Fp8Workspace w1 = ops::scratch_workspace(plan, s1),
                          w2 = ops::scratch_workspace(plan, s2);
  EXPECT_NE(w1.a_codes, w2.a_codes);
  EXPECT_NE(w1.a_scales, w2.a_scales);
  ops::free_fp8_weights(be, w);
  be.destroy_stream(s1);
  be.destroy_stream(s2);
}

TEST(W8a8Gemm, RefusesBadInputsAndWritesNothing) {
  CpuBackend be;
  const std::int64_t m = 4, n = 130, k = 200;
  const f8::HostFp8Weights hw = f8::random_weights(n, k, rng());
  ops::Fp8Weights w = ops::upload_fp8_weights(be, hw.codes, hw.scale_bytes(), n, k);
  const DevicePtr a = be.alloc(static_cast<std::size_t>(m * k * 2)),
                  c = be.alloc(static_cast<std::size_t>(m * n * 2)), bias = be.alloc(n * 2),
                  big = be.alloc(static_cast<std::size_t>(m * k * 2 + m * n * 2));
  const std::vector<std::uint16_t> poison(static_cast<std::size_t>(m * n), kPoison);
  be.copy_h2d(c, poison.data(), poison.size() * 2);
  const auto untouched = [&] {
    std::vector<std::uint16_t> now(poison.size());
    be.copy_d2h(now.data(), c, now.size() * 2);
    EXPECT_EQ(now, poison) << "C was written by a refused call";
  };
  const auto refuse = [&](const std::function<void()>& call, const char* words,
                          ErrorCode code = ErrorCode::kInvalidArgument) {
    const Error e = expect_error(call);
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos)
        << "wanted \"" << words << "\" in: " << e.what();
    untouched();
  };
  const auto gemm = [&](DevicePtr pa, std::int64_t pm, const ops::Fp8Weights& pw, DevicePtr pc,
                        DevicePtr pb = {}) {
    return
        [&be, pa, pm, pw, pc, pb] { ops::w8a8_gemm(be, be.default_stream(), pa, pm, pw, pc, pb); };
  };
  ops::Fp8Weights x = w;
  x.scales_bytes -= 4;  // the device layout: 2 N blocks x round_up(2 K blocks, 4) FP32
  refuse(gemm(a, m, x, c), "weight scales are 28 bytes; E4M3 130x200 needs 32");
  x = w;
  x.codes_bytes += 1;
  refuse(gemm(a, m, x, c), "weight codes are 26001 bytes");
  x = w;
  x.k = 0;
  refuse(gemm(a, m, x, c), "N and K must be at least 1");
  x = w;
  x.codes = DevicePtr{};
  refuse(gemm(a, m, x, c), "weight codes is null");
  x = w;
  x.scales = w.scales.offset(4);
  refuse(gemm(a, m, x, c), "is not 16-byte aligned");
  refuse(gemm(a, 0, w, c), "M = 0");
  refuse(gemm(DevicePtr{}, m, w, c), "A is null");
  refuse(gemm(a, m, w, DevicePtr{}), "C is null");
  refuse(gemm(a, m, w, c, bias.offset(2)), "bias = 0x");
  refuse(gemm(big, m, w, big.offset(static_cast<std::uint64_t>(m * k * 2 - 16)), bias),
         "overlaps A");
  refuse(gemm(a, m + 1, w, c), "overruns");  // A's 5 rows overrun its allocation of 4
  refuse(gemm(a, m, w, c, c), "overlaps bias");

  // plan + run: a plan for other weights, a missing bias, a missing or overlapping workspace.
  const ops::Fp8GemmPlan plan = ops::plan(be, m, w, {});
  const DevicePtr ws = be.alloc(plan.workspace.total());
  const ops::Fp8Workspace good = ops::Fp8Workspace::carve(ws, plan.workspace);
  const auto run = [&](const ops::Fp8Weights& pw, ops::Fp8Workspace pws, DevicePtr pb = {}) {
    return [&, pw, pws, pb] { ops::run(plan, be.default_stream(), a, pw, c, pws, pb); };
  };
  x = w;
  x.n = 129;
  refuse(run(x, good), "the plan is for 130x200");
  refuse(run(w, good, bias), "the plan was made without one");
  ops::Fp8Workspace bad = good;
  bad.a_scales = DevicePtr{};
  refuse(run(w, bad), "A scales workspace is null");
  bad = good;
  bad.a_codes = a;
  refuse(run(w, bad), "E4M3 A workspace");
  refuse([&] { ops::run(ops::Fp8GemmPlan{}, be.default_stream(), a, w, c, good); },
         "the plan is empty");
  EXPECT_NO_THROW(run(w, good)());  // the catalogue's baseline runs

  for (DevicePtr p : {a, c, bias, big, ws}) be.free(p);
  ops::free_fp8_weights(be, w);
}

TEST(W8a8Gemm, UploadChecksTheHostBytes) {
  CpuBackend be;
  const f8::HostFp8Weights hw = f8::random_weights(3, 300, rng());
  auto scales = hw.scale_bytes();
  scales.pop_back();
  const Error e =
      expect_error([&] { (void)ops::upload_fp8_weights(be, hw.codes, scales, 3, 300); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("11 bytes"), std::string::npos) << e.what();
  // The padded device size is not the host layout: refused, naming the call and both sizes.
  const std::vector<std::uint8_t> padded(16);
  const Error p =
      expect_error([&] { (void)ops::upload_fp8_weights(be, hw.codes, padded, 3, 300); });
  EXPECT_EQ(p.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(p.what()).find("[upload_fp8_weights]"), std::string::npos) << p.what();
  EXPECT_NE(std::string(p.what()).find("codes and scales are 900 and 16 bytes"), std::string::npos)
      << p.what();
  EXPECT_NE(std::string(p.what()).find("need 900 ([N, K]) and 12 (FP32"), std::string::npos)
      << p.what();
  EXPECT_EQ(be.live_bytes(), 0u);
}

TEST(W8a8Gemm, UploadRepacksTheCheckpointScalesIntoTheDeviceLayout) {
  CpuBackend be;
  // N = 300, K = 300: host [3, 3] scales; device [3, round_up(3, 4) = 4], the pad written 0.
  const f8::HostFp8Weights hw = f8::random_weights(300, 300, rng());
  ASSERT_EQ(hw.scales.size(), 9u);
  ops::Fp8Weights w = ops::upload_fp8_weights(be, hw.codes, hw.scale_bytes(), 300, 300);
  EXPECT_EQ(w.scales_bytes, 3u * 4u * 4u);
  EXPECT_EQ(w.scales_bytes, ops::describe_fp8_weights("test", 300, 300).scales_bytes);
  std::vector<float> device(w.scales_bytes / 4);
  be.copy_d2h(device.data(), w.scales, w.scales_bytes);
  for (std::size_t r = 0; r < 3; ++r) {
    for (std::size_t c = 0; c < 4; ++c) {
      EXPECT_EQ(device[r * 4 + c], c < 3 ? hw.scales[r * 3 + c] : 0.0f)
          << "device scale [" << r << ", " << c << "]";
    }
  }
  std::vector<std::uint8_t> codes(w.codes_bytes);
  be.copy_d2h(codes.data(), w.codes, w.codes_bytes);
  EXPECT_EQ(codes, hw.codes);
  ops::free_fp8_weights(be, w);
}

TEST(W8a8Gemm, ABackendWithoutTheDenseKindIsUnavailable) {
  CpuBackendOptions options;
  std::erase_if(options.modules, [](const HostModule& m) { return m.name() == "blas"; });
  CpuBackend be(std::move(options));
  const f8::HostFp8Weights hw = f8::random_weights(8, 16, rng());
  ops::Fp8Weights w = ops::upload_fp8_weights(be, hw.codes, hw.scale_bytes(), 8, 16);
  const Error e = expect_error([&] { (void)ops::plan(be, 2, w, {}); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
  EXPECT_NE(std::string(e.what()).find("blas::gemm_e4m3_block128"), std::string::npos) << e.what();
  ops::free_fp8_weights(be, w);
}

}  // namespace
}  // namespace metrale
