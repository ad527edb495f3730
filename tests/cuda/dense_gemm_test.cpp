// The CUDA backend's dense GEMMs on cuBLASLt, against the fake library (fake_blas.h) on the fake
// driver: loading and its failures, availability per kind, the heuristic memo, workspace sizes
// and growth, the numbers (BF16, bias, block-scaled E4M3) against a float64 reference, one
// workspace per stream, and the handle's life.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/expect_error.h"
#include "cuda/blas_loader.h"
#include "cuda/discovery.h"
#include "cuda/fake_blas.h"
#include "cuda/rig.h"
#include "metrale/dense_gemm.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "support/read_back.h"
#include "support/trace_file.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::upload;

using metrale::testing::expect_error;
using num::bf16_to_f32;
using num::e4m3_to_f32;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// A fake cuBLASLt, then a fake driver with host, registry and backend that use it. The fake
// library is declared first, so it outlives the host that holds its table.
struct BlasRig {
  explicit BlasRig(FakeDevice device = {}) : rig(options(fb, device)) {}
  static RigOptions options(const FakeBlas& fb, FakeDevice device) {
    RigOptions o;
    o.devices = {device};
    // Machine code for exactly this device, so the registry runs the module on it.
    o.modules[0].targets = {fmt::format("sm_{}{}", device.cc_major, device.cc_minor)};
    o.blas = fb.source();
    return o;
  }
  CudaBackend& b() { return rig.b(); }

  FakeBlas fb;
  Rig rig;
};

std::uint64_t next(std::uint64_t& x) {
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  return x;
}

// BF16 values in about [-1, 1), of every exponent from 2^-8.
std::vector<std::uint16_t> random_bf16(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint16_t> v(n);
  for (auto& e : v) {
    const std::uint64_t r = next(seed);
    e = static_cast<std::uint16_t>(((r >> 63) << 15) | ((0x77 + (r >> 8) % 8) << 7) | (r & 0x7F));
  }
  return v;
}

// Finite E4M3 codes (no NaN: 0x7F / 0xFF).
std::vector<std::uint8_t> random_e4m3(std::size_t n, std::uint64_t seed) {
  std::vector<std::uint8_t> v(n);
  for (auto& e : v) {
    e = static_cast<std::uint8_t>(next(seed) % 0x7F);
    if (next(seed) & 1) e |= 0x80;
  }
  return v;
}

// Scales in [0.25, 4): far enough apart that a scale read from the wrong place shows.
std::vector<float> random_scales(std::size_t n, std::uint64_t seed) {
  std::vector<float> v(n);
  for (auto& e : v) e = 0.25f * static_cast<float>(1 + next(seed) % 15);
  return v;
}

// ‖out − ref‖ / ‖ref‖ over C[M, N] (BF16 out); infinite when out holds a NaN (the poison).
double normalized_error(const std::vector<std::uint16_t>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double o = bf16_to_f32(out[i]);
    if (!std::isfinite(o)) return INFINITY;
    num += (o - ref[i]) * (o - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

// The contract's C = A · Bᵀ (+ bias) in float64, row-major.
std::vector<double> reference_bf16(const DenseGemmShape& s, const std::vector<std::uint16_t>& a,
                                   const std::vector<std::uint16_t>& b,
                                   const std::vector<std::uint16_t>& bias) {
  std::vector<double> c(static_cast<std::size_t>(s.m * s.n));
  for (std::int64_t m = 0; m < s.m; ++m) {
    for (std::int64_t n = 0; n < s.n; ++n) {
      double acc = s.bias ? bf16_to_f32(bias[static_cast<std::size_t>(n)]) : 0.0;
      for (std::int64_t k = 0; k < s.k; ++k) {
        acc += double(bf16_to_f32(a[static_cast<std::size_t>(m * s.k + k)])) *
               bf16_to_f32(b[static_cast<std::size_t>(n * s.k + k)]);
      }
      c[static_cast<std::size_t>(m * s.n + n)] = acc;
    }
  }
  return c;
}

// The contract's block-scaled E4M3 product in float64: a_scales[kb * lda + m],
// b_scales[(n / 128) * ldb + kb], lda = round_up(M, 4), ldb = round_up(ceil(K/128), 4).
std::vector<double> reference_e4m3(const DenseGemmShape& s, const std::vector<std::uint8_t>& a,
                                   const std::vector<std::uint8_t>& b, const std::vector<float>& sa,
                                   const std::vector<float>& sb) {
  const std::int64_t kbs = (s.k + 127) / 128, lda = (s.m + 3) / 4 * 4, ldb = (kbs + 3) / 4 * 4;
  std::vector<double> c(static_cast<std::size_t>(s.m * s.n));
  for (std::int64_t m = 0; m < s.m; ++m) {
    for (std::int64_t n = 0; n < s.n; ++n) {
      double acc = 0;
      for (std::int64_t kb = 0; kb < kbs; ++kb) {
        double part = 0;
        for (std::int64_t k = kb * 128; k < std::min(s.k, kb * 128 + 128); ++k) {
          part += double(e4m3_to_f32(a[static_cast<std::size_t>(m * s.k + k)])) *
                  e4m3_to_f32(b[static_cast<std::size_t>(n * s.k + k)]);
        }
        acc += part * sa[static_cast<std::size_t>(kb * lda + m)] *
               sb[static_cast<std::size_t>((n / 128) * ldb + kb)];
      }
      c[static_cast<std::size_t>(m * s.n + n)] = acc;
    }
  }
  return c;
}

// rows x ld random scales whose columns from cols on (the padding) hold pad.
std::vector<float> padded_scales(std::int64_t rows, std::int64_t cols, std::int64_t ld, float pad,
                                 std::uint64_t seed) {
  std::vector<float> v = random_scales(static_cast<std::size_t>(rows * ld), seed);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = cols; c < ld; ++c) v[static_cast<std::size_t>(r * ld + c)] = pad;
  return v;
}

// C poisoned with BF16 NaN, so an element the GEMM leaves unwritten shows.
DevicePtr poisoned_c(Backend& b, const DenseGemmShape& s) {
  const std::size_t bytes = static_cast<std::size_t>(s.m * s.n) * 2;
  const DevicePtr c = b.alloc(bytes);
  b.memset(c, 0xFF, bytes);
  return c;
}

std::vector<std::uint16_t> download_c(Backend& b, DevicePtr c, const DenseGemmShape& s) {
  std::vector<std::uint16_t> out(static_cast<std::size_t>(s.m * s.n));
  b.copy_d2h(out.data(), c, out.size() * 2);
  return out;
}

// A workspace of the plan's size for args (none when it needs none); the caller frees it.
void give_workspace(Backend& b, const DenseGemmPlan& plan, DenseGemmArgs& args) {
  args.workspace = plan.workspace_bytes == 0 ? DevicePtr{} : b.alloc(plan.workspace_bytes);
  args.workspace_bytes = plan.workspace_bytes;
}

// One BF16 GEMM of shape on the rig; the normalized error against float64.
double bf16_error(BlasRig& r, const DenseGemmShape& s) {
  Backend& b = r.b();
  const auto a = random_bf16(static_cast<std::size_t>(s.m * s.k), 11);
  const auto w = random_bf16(static_cast<std::size_t>(s.n * s.k), 23);
  const auto bias = random_bf16(static_cast<std::size_t>(s.n), 37);
  const DenseGemmPlan plan = b.plan_dense_gemm(s);
  DenseGemmArgs args;
  args.a = upload(b, a);
  args.b = upload(b, w);
  args.c = poisoned_c(b, s);
  if (s.bias) args.bias = upload(b, bias);
  give_workspace(b, plan, args);
  b.run_dense_gemm(plan, args, b.default_stream());
  b.synchronize(b.default_stream());
  const double err = normalized_error(download_c(b, args.c, s), reference_bf16(s, a, w, bias));
  for (DevicePtr p : {args.a, args.b, args.c, args.bias, args.workspace}) {
    if (p) b.free(p);
  }
  return err;
}

// BF16 output: one rounding (2^-9 relative) over FP32 sums of exact products.
constexpr double kBf16OutTolerance = 4e-3;

// ---- loading ----

TEST(BlasLoader, AMissingLibraryIsAReasonNotACrash) {
  const BlasLoad load = load_blas_from("libcublasLt-that-does-not-exist.so.13");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_THAT(load.reason,
              StartsWith("cuBLASLt unavailable: cannot load libcublasLt-that-does-not-exist"));
}

TEST(BlasLoader, ALibraryWithoutTheEntryPointsIsRefused) {
  // libm is on every machine and exports none of cuBLASLt's entry points.
  const BlasLoad load = load_blas_from("libm.so.6");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_THAT(load.reason, StartsWith("cuBLASLt unavailable: libm.so.6 lacks cublasLtGetVersion"));
}

TEST(BlasLoader, VersionsReadAsMajorMinorPatch) {
  EXPECT_EQ(blas_version_string(130100), "13.1.0");
  EXPECT_EQ(blas_version_string(kBlockScaledBlasVersion), "12.9.0");
}

// ---- availability ----

TEST(DenseGemm, ALoadFailureMakesEveryKindUnavailableWithItsReason) {
  BlasRig r;
  r.fb.fail_load("cuBLASLt unavailable: cannot load libcublasLt.so.13 (not here)");
  for (DenseKind kind : {DenseKind::kBf16, DenseKind::kE4m3Block128}) {
    EXPECT_EQ(r.b().dense_gemm_unavailable(kind),
              "cuBLASLt unavailable: cannot load libcublasLt.so.13 (not here)");
  }
  const Error e = expect_error([&] { r.b().plan_dense_gemm({DenseKind::kBf16, 16, 16, 16}); });
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(e.what(), HasSubstr("cannot load libcublasLt.so.13"));
  EXPECT_EQ(r.fb.calls("cublasLtCreate"), 0u);
}

TEST(DenseGemm, AHostWithoutALibrarySaysSo) {
  Rig rig;  // no blas source
  EXPECT_EQ(rig.b().dense_gemm_unavailable(DenseKind::kBf16),
            "cuBLASLt unavailable: this CUDA host was made without the library");
}

TEST(DenseGemm, BlockScaledE4m3NeedsSm90AndCublasLt129) {
  {
    BlasRig r;
    EXPECT_EQ(r.b().dense_gemm_unavailable(DenseKind::kBf16), "");
    EXPECT_EQ(r.b().dense_gemm_unavailable(DenseKind::kE4m3Block128), "");
  }
  {
    FakeDevice ada;
    ada.cc_major = 8;
    ada.cc_minor = 9;
    BlasRig r(ada);
    EXPECT_EQ(r.b().dense_gemm_unavailable(DenseKind::kBf16), "");
    EXPECT_THAT(r.b().dense_gemm_unavailable(DenseKind::kE4m3Block128),
                HasSubstr("documented for compute capability 9.0 only; this device is sm_89"));
  }
  {
    BlasRig r;
    r.fb.set_version(120800);
    EXPECT_EQ(r.b().dense_gemm_unavailable(DenseKind::kBf16), "");
    EXPECT_THAT(r.b().dense_gemm_unavailable(DenseKind::kE4m3Block128),
                HasSubstr("cuBLASLt 12.8.0 (fake cuBLASLt) has no block-scaled FP8"));
  }
}

TEST(DenseGemm, InfoSaysWhichLibraryAndWhichKinds) {
  BlasRig r;
  EXPECT_EQ(describe_dense_gemms(r.rig.host->blas(), {9, 0}),
            "cuBLASLt 13.1.0 (fake cuBLASLt): bf16, e4m3-block128");
  EXPECT_EQ(describe_dense_gemms(r.rig.host->blas(), {8, 0}),
            "cuBLASLt 13.1.0 (fake cuBLASLt): bf16; not e4m3-block128: cuBLASLt's block-scaled "
            "FP8 (e4m3-block128: VEC128_32F and BLK128x128_32F scales) is documented for compute "
            "capability 9.0 only; this device is sm_80");
  BlasLoad missing;
  missing.reason = "cuBLASLt unavailable: cannot load libcublasLt.so.13 (gone)";
  EXPECT_EQ(describe_dense_gemms(missing, {9, 0}),
            "none (cuBLASLt unavailable: cannot load libcublasLt.so.13 (gone))");
  const auto properties = device_properties(r.b());
  EXPECT_THAT(properties,
              ::testing::Contains(std::pair<std::string, std::string>{
                  "dense GEMMs", "cuBLASLt 13.1.0 (fake cuBLASLt): bf16, e4m3-block128"}));
}

// ---- the heuristic ----

TEST(DenseGemm, AFailedHeuristicIsAnErrorNamingTheCallAndTheShape) {
  BlasRig r;
  r.fb.fail_heuristic(CUBLAS_STATUS_INTERNAL_ERROR);
  const DenseGemmShape s{DenseKind::kBf16, 64, 32, 48};
  Error e = expect_error([&] { r.b().plan_dense_gemm(s); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[plan_dense_gemm] cublasLtMatmulAlgoGetHeuristic returned "
                                  "CUBLAS_STATUS_INTERNAL_ERROR (14) for the dense GEMM bf16 "
                                  "M=64 N=32 K=48"));
  r.fb.fail_heuristic(CUBLAS_STATUS_SUCCESS);
  r.fb.no_algorithm(true);
  e = expect_error([&] { r.b().plan_dense_gemm(s); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("cublasLtMatmulAlgoGetHeuristic has no algorithm for the dense "
                                  "GEMM bf16 M=64 N=32 K=48"));
  // A failure is not memoized: the next plan asks again, and nothing leaked meanwhile.
  r.fb.no_algorithm(false);
  EXPECT_NO_THROW(r.b().plan_dense_gemm(s));
  EXPECT_EQ(r.fb.calls("cublasLtMatmulAlgoGetHeuristic"), 3u);
  EXPECT_EQ(r.fb.live_descriptors(), 0);
}

TEST(DenseGemm, TheHeuristicIsAskedOncePerShape) {
  BlasRig r;
  const DenseGemmShape s1{DenseKind::kBf16, 64, 32, 48};
  const DenseGemmShape s2{DenseKind::kBf16, 64, 32, 48, true};
  const DenseGemmPlan p1 = r.b().plan_dense_gemm(s1);
  const DenseGemmPlan again = r.b().plan_dense_gemm(s1);
  EXPECT_EQ(r.fb.calls("cublasLtMatmulAlgoGetHeuristic"), 1u);
  EXPECT_EQ(again.algorithm, p1.algorithm);
  EXPECT_EQ(again.describe, p1.describe);
  const DenseGemmPlan p2 = r.b().plan_dense_gemm(s2);
  EXPECT_EQ(r.fb.calls("cublasLtMatmulAlgoGetHeuristic"), 2u);
  EXPECT_NE(p2.algorithm, p1.algorithm);
  EXPECT_EQ(p1.describe, "cuBLASLt 13.1.0 bf16 algo 1 tile 7");
  EXPECT_EQ(r.fb.live_descriptors(), 0);
}

// ---- workspace ----

TEST(DenseGemm, AShapeThatNeedsMoreWorkspaceGrowsTheStreamsScratch) {
  BlasRig r;
  CudaBackend& b = r.b();
  const StreamHandle stream = b.default_stream();
  const std::string tag = fmt::format("dense-gemm-workspace:{:x}", stream.value());
  r.fb.set_workspace(std::size_t{1} << 20);
  const DenseGemmShape small{DenseKind::kBf16, 16, 16, 16};
  const DenseGemmPlan p1 = b.plan_dense_gemm(small);
  EXPECT_EQ(p1.workspace_bytes, std::uint64_t{1} << 20);
  r.fb.set_workspace(std::size_t{4} << 20);
  const DenseGemmShape big{DenseKind::kBf16, 32, 16, 16};
  const DenseGemmPlan p2 = b.plan_dense_gemm(big);
  EXPECT_EQ(p2.workspace_bytes, std::uint64_t{4} << 20);

  DenseGemmArgs args;
  const auto data = random_bf16(32 * 16, 5);
  args.a = upload(b, data);
  args.b = upload(b, data);
  args.c = b.alloc(32 * 16 * 2);
  args.workspace = b.op_cache().scratch(b, tag, p1.workspace_bytes);
  args.workspace_bytes = p1.workspace_bytes;
  EXPECT_NO_THROW(b.run_dense_gemm(p1, args, stream));
  // The first shape's workspace is too small for the second: refused before the library runs.
  const Error e = expect_error([&] { b.run_dense_gemm(p2, args, stream); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("workspace_bytes = 1048576; the plan needs 4194304"));
  EXPECT_EQ(r.fb.matmuls().size(), 1u);
  // The stream's scratch grows (the old buffer is retired, not freed) and the run goes through.
  args.workspace = b.op_cache().scratch(b, tag, p2.workspace_bytes);
  args.workspace_bytes = p2.workspace_bytes;
  EXPECT_EQ(b.op_cache().retired_scratch_count(), 1u);
  EXPECT_NO_THROW(b.run_dense_gemm(p2, args, stream));
  ASSERT_EQ(r.fb.matmuls().size(), 2u);
  EXPECT_EQ(r.fb.matmuls()[1].workspace_bytes, std::size_t{4} << 20);
  for (DevicePtr p : {args.a, args.b, args.c}) b.free(p);
  b.op_cache().release(b);
}

TEST(DenseGemm, AnAlgorithmNeedingMoreThanTheMaximumWorkspaceIsNotChosen) {
  BlasRig r;
  r.fb.set_workspace(kMaxDenseWorkspace + 1);
  const Error e = expect_error([&] { r.b().plan_dense_gemm({DenseKind::kBf16, 16, 16, 16}); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("within 32 MiB of workspace"));
}

TEST(DenseGemm, TwoStreamsRunWithTheirOwnWorkspaces) {
  BlasRig r;
  CudaBackend& b = r.b();
  r.fb.set_workspace(64 << 10);
  const DenseGemmShape s{DenseKind::kBf16, 16, 32, 64};
  const DenseGemmPlan plan = b.plan_dense_gemm(s);
  const StreamHandle streams[2] = {b.create_stream(), b.create_stream()};
  const auto data = random_bf16(32 * 64, 9);
  DenseGemmArgs args[2];
  for (int i = 0; i < 2; ++i) {
    args[i].a = upload(b, data);
    args[i].b = upload(b, data);
    args[i].c = b.alloc(16 * 32 * 2);
    args[i].workspace = b.op_cache().scratch(
        b, fmt::format("dense-gemm-workspace:{:x}", streams[i].value()), plan.workspace_bytes);
    args[i].workspace_bytes = plan.workspace_bytes;
    b.run_dense_gemm(plan, args[i], streams[i]);
  }
  const std::vector<FakeMatmul> runs = r.fb.matmuls();
  ASSERT_EQ(runs.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(runs[i].stream), streams[i].value());
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(runs[i].workspace), args[i].workspace.address());
  }
  const std::uint64_t w0 = args[0].workspace.address(), w1 = args[1].workspace.address();
  EXPECT_TRUE(w0 + plan.workspace_bytes <= w1 || w1 + plan.workspace_bytes <= w0)
      << "the two streams' workspaces overlap";
  for (auto& a : args) {
    for (DevicePtr p : {a.a, a.b, a.c}) b.free(p);
  }
  for (StreamHandle st : streams) b.destroy_stream(st);
  b.op_cache().release(b);
}

// ---- numbers ----

TEST(DenseGemm, Bf16MatchesTheFloat64Reference) {
  BlasRig r;
  EXPECT_LT(bf16_error(r, {DenseKind::kBf16, 24, 40, 200}), kBf16OutTolerance);
  EXPECT_LT(bf16_error(r, {DenseKind::kBf16, 1, 8, 16}), kBf16OutTolerance);
}

// With METRALE_TRACE set, a dense GEMM is one trace row between an event pair, named for its
// kind and shape (docs/TRACING.md).
TEST(DenseGemm, ARunIsARowOfTheLaunchTrace) {
  metrale::testing::TraceSwitch trace;
  {
    BlasRig r;
    EXPECT_LT(bf16_error(r, {DenseKind::kBf16, 24, 40, 200}), kBf16OutTolerance);
  }
  const auto launches =
      metrale::testing::traced_launches(metrale::testing::read_trace(trace.path()));
  std::size_t gemms = 0;
  for (const auto& l : launches) {
    if (l["name"] == "cublasLt::bf16 M=24 N=40 K=200") {
      ++gemms;
      EXPECT_GE(l["dur"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(gemms, 1u);
}

TEST(DenseGemm, TheBiasIsAddedPerOutputColumn) {
  BlasRig r;
  EXPECT_LT(bf16_error(r, {DenseKind::kBf16, 24, 40, 200, true}), kBf16OutTolerance);
}

// One block-scaled E4M3 GEMM of s on the rig, the scales in the padded layouts with pad in
// every padding entry; the normalized error against float64.
double e4m3_error(BlasRig& r, const DenseGemmShape& s, float pad) {
  Backend& b = r.b();
  const std::int64_t kbs = (s.k + 127) / 128, nbs = (s.n + 127) / 128;
  const std::int64_t lda = (s.m + 3) / 4 * 4, ldb = (kbs + 3) / 4 * 4;
  const auto a = random_e4m3(static_cast<std::size_t>(s.m * s.k), 3);
  const auto w = random_e4m3(static_cast<std::size_t>(s.n * s.k), 4);
  const auto sa = padded_scales(kbs, s.m, lda, pad, 5);
  const auto sb = padded_scales(nbs, kbs, ldb, pad, 6);
  const DenseGemmBytes bytes = dense_gemm_bytes("test", s);
  EXPECT_EQ(bytes.a_scales, sa.size() * 4);
  EXPECT_EQ(bytes.b_scales, sb.size() * 4);
  const DenseGemmPlan plan = b.plan_dense_gemm(s);
  EXPECT_THAT(plan.describe, StartsWith("cuBLASLt 13.1.0 e4m3-block128 algo"));
  DenseGemmArgs args;
  args.a = upload(b, a);
  args.b = upload(b, w);
  args.a_scales = upload(b, sa);
  args.b_scales = upload(b, sb);
  if (s.bias) args.bias = upload(b, random_bf16(static_cast<std::size_t>(s.n), 7));
  args.c = poisoned_c(b, s);
  give_workspace(b, plan, args);
  b.run_dense_gemm(plan, args, b.default_stream());
  b.synchronize(b.default_stream());
  std::vector<double> ref = reference_e4m3(s, a, w, sa, sb);
  if (s.bias) {
    std::vector<std::uint16_t> bias(static_cast<std::size_t>(s.n));
    b.copy_d2h(bias.data(), args.bias, bias.size() * 2);
    for (std::size_t i = 0; i < ref.size(); ++i) ref[i] += bf16_to_f32(bias[i % bias.size()]);
  }
  const double err = normalized_error(download_c(b, args.c, s), ref);
  for (DevicePtr p :
       {args.a, args.b, args.a_scales, args.b_scales, args.c, args.bias, args.workspace}) {
    if (p) b.free(p);
  }
  return err;
}

TEST(DenseGemm, BlockScaledE4m3MatchesTheFloat64Reference) {
  BlasRig r;
  // Two N blocks (the second partial), four K blocks (the last partial), scales all distinct.
  EXPECT_LT(e4m3_error(r, {DenseKind::kE4m3Block128, 8, 200, 448}, 1024.0f), kBf16OutTolerance);
}

// FP32 C (the row-parallel partials): a shape of its own to the heuristic (its D layout is
// FP32), every element written, and the FP32 value the BF16 C's one rounding of it.
TEST(DenseGemm, Fp32OutputIsItsOwnShapeAndTheSumBf16Rounds) {
  BlasRig r;
  Backend& b = r.b();
  const DenseGemmShape s16{DenseKind::kE4m3Block128, 5, 200, 304, true};
  DenseGemmShape s32 = s16;
  s32.out_f32 = true;
  const std::int64_t kbs = 3, lda = 8, ldb = 4;
  const DenseGemmBytes bytes = dense_gemm_bytes("test", s32);
  EXPECT_EQ(bytes.c, static_cast<std::uint64_t>(s32.m * s32.n) * 4);
  DenseGemmArgs args;
  args.a = upload(b, random_e4m3(static_cast<std::size_t>(s16.m * s16.k), 7));
  args.b = upload(b, random_e4m3(static_cast<std::size_t>(s16.n * s16.k), 8));
  args.a_scales = upload(b, padded_scales(kbs, s16.m, lda, 1.0f, 9));
  args.b_scales = upload(b, padded_scales(2, kbs, ldb, 1.0f, 10));
  args.bias = upload(b, random_bf16(static_cast<std::size_t>(s16.n), 12));
  const DenseGemmPlan p16 = b.plan_dense_gemm(s16), p32 = b.plan_dense_gemm(s32);
  EXPECT_EQ(r.fb.calls("cublasLtMatmulAlgoGetHeuristic"), 2u) << "one memo for both shapes";
  const auto mn = static_cast<std::size_t>(s16.m * s16.n);
  args.c = poisoned_c(b, s16);
  give_workspace(b, p16, args);
  b.run_dense_gemm(p16, args, b.default_stream());
  const DevicePtr c16 = args.c, ws16 = args.workspace;
  args.c = b.alloc(mn * 4);
  b.memset(args.c, 0xFF, mn * 4);
  give_workspace(b, p32, args);
  b.run_dense_gemm(p32, args, b.default_stream());
  b.synchronize(b.default_stream());
  const std::vector<std::uint16_t> out16 = download_c(b, c16, s16);
  std::vector<float> out32(mn);
  b.copy_d2h(out32.data(), args.c, mn * 4);
  for (std::size_t i = 0; i < mn; ++i) {
    ASSERT_FALSE(std::isnan(out32[i])) << "element " << i << " unwritten";
    ASSERT_EQ(num::f32_to_bf16(out32[i]), out16[i]) << "element " << i;
  }
  for (DevicePtr p : {args.a, args.b, args.a_scales, args.b_scales, args.bias, args.c, c16, ws16,
                      args.workspace}) {
    b.free(p);
  }
}

TEST(DenseGemm, BlockScaledShapesWithPaddedScalesRun) {
  BlasRig r;
  // M % 4 != 0 (A's scales padded to round_up(M, 4)) and ceil(K/128) % 4 != 0 (B's padded to
  // round_up(ceil(K/128), 4)): decode's M = 1 among them. Finite padding far from any scale.
  for (const DenseGemmShape& s : {DenseGemmShape{DenseKind::kE4m3Block128, 1, 296, 208},
                                  DenseGemmShape{DenseKind::kE4m3Block128, 5, 136, 304},
                                  DenseGemmShape{DenseKind::kE4m3Block128, 6, 128, 512},
                                  DenseGemmShape{DenseKind::kE4m3Block128, 8, 128, 256},
                                  DenseGemmShape{DenseKind::kE4m3Block128, 3, 40, 48}}) {
    SCOPED_TRACE(fmt::format("M={} N={} K={}", s.m, s.n, s.k));
    EXPECT_LT(e4m3_error(r, s, 1024.0f), kBf16OutTolerance);
  }
  EXPECT_EQ(r.fb.calls("cublasLtMatmul"), 5u);
}

TEST(DenseGemm, ThePaddingOfTheScalesNeverReachesC) {
  BlasRig r;
  // NaN in every padding entry: one that reaches C makes an output NaN (an infinite error). The
  // library reads A's padding entries for the zero rows M pads to a multiple of 4, whose outputs
  // stay in the workspace; B's it never reads.
  for (const DenseGemmShape& s : {DenseGemmShape{DenseKind::kE4m3Block128, 1, 296, 208},
                                  DenseGemmShape{DenseKind::kE4m3Block128, 7, 136, 704}}) {
    SCOPED_TRACE(fmt::format("M={} N={} K={}", s.m, s.n, s.k));
    EXPECT_LT(e4m3_error(r, s, std::nanf("")), kBf16OutTolerance);
  }
}

// cuBLAS's block scalings need the matmul's M and N multiples of 4 (3.1.4.5.1), and our M is
// the library's N: decode's M = 1 and every M off a multiple of 4 run on rows padded with zero
// codes, the real rows copied back. The fake refuses the unpadded call (NOT_SUPPORTED from the
// heuristic) and reads the scales by the documented layout, so a wrong padding shows as an
// error, a NaN or a wrong number.
TEST(DenseGemm, BlockScaledMOffAMultipleOfFourRunsOnPaddedRows) {
  BlasRig r;
  for (const std::int64_t m : {1, 2, 3, 5, 6}) {
    // N = 136 (a partial second N block), K = 208 (a partial second K block, ldb padded).
    const DenseGemmShape s{DenseKind::kE4m3Block128, m, 136, 208};
    SCOPED_TRACE(fmt::format("M={}", m));
    EXPECT_LT(e4m3_error(r, s, 1024.0f), kBf16OutTolerance);
    ASSERT_FALSE(r.fb.matmuls().empty());
    EXPECT_EQ(r.fb.matmuls().back().cols, static_cast<std::uint64_t>((m + 3) / 4 * 4));
    EXPECT_EQ(r.fb.matmuls().back().rows, 136u);
  }
  // With a bias and FP32 C too.
  DenseGemmShape s{DenseKind::kE4m3Block128, 1, 64, 128, true};
  EXPECT_LT(e4m3_error(r, s, std::nanf("")), kBf16OutTolerance);
  s.out_f32 = true;
  EXPECT_NO_THROW(r.b().plan_dense_gemm(s));
}

// What Tensor Core Usage excludes for FP8 (K a multiple of 16; N·size of C a multiple of 16:
// N % 8 with BF16 C, N % 4 with FP32 C) is refused by name before the heuristic is asked.
TEST(DenseGemm, BlockScaledNOrKTheLibraryExcludesIsRefusedByName) {
  BlasRig r;
  const auto refused = [&](DenseGemmShape s, const char* words) {
    SCOPED_TRACE(fmt::format("M={} N={} K={} f32={}", s.m, s.n, s.k, s.out_f32));
    const Error e = expect_error([&] { r.b().plan_dense_gemm(s); });
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_THAT(e.what(), HasSubstr(words));
  };
  refused({DenseKind::kE4m3Block128, 4, 128, 200}, "K = 200 is not a multiple of 16");
  refused({DenseKind::kE4m3Block128, 4, 132, 256}, "N = 132 is not a multiple of 8");
  refused({DenseKind::kE4m3Block128, 4, 130, 256, false, true}, "N = 130 is not a multiple of 4");
  EXPECT_EQ(r.fb.calls("cublasLtMatmulAlgoGetHeuristic"), 0u);
  // N % 4 is enough with FP32 C.
  EXPECT_NO_THROW(r.b().plan_dense_gemm({DenseKind::kE4m3Block128, 4, 132, 256, false, true}));
  // BF16 has no such rule ("Aside from FP8, there are no longer any restrictions").
  EXPECT_LT(bf16_error(r, {DenseKind::kBf16, 3, 13, 7}), kBf16OutTolerance);
}

// The block scalings are documented for compute capability 9.0 only ("Scaling Mode Support
// Overview"): elsewhere the kind is unavailable, naming the device, and nothing asks the library.
TEST(DenseGemm, BlockScaledE4m3IsUnavailableOffComputeCapability90) {
  for (const auto& [major, minor] : {std::pair{10, 0}, std::pair{8, 9}, std::pair{12, 0}}) {
    FakeDevice d;
    d.cc_major = major;
    d.cc_minor = minor;
    BlasRig r(d);
    SCOPED_TRACE(fmt::format("sm_{}{}", major, minor));
    EXPECT_EQ(r.b().dense_gemm_unavailable(DenseKind::kBf16), "");
    EXPECT_THAT(r.b().dense_gemm_unavailable(DenseKind::kE4m3Block128),
                HasSubstr(fmt::format("compute capability 9.0 only; this device is sm_{}{}", major,
                                      minor)));
    const Error e = expect_error([&] {
      r.b().plan_dense_gemm({DenseKind::kE4m3Block128, 4, 128, 128});
    });
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_EQ(r.fb.calls("cublasLtMatmulAlgoGetHeuristic"), 0u);
  }
}

// BF16 A/B with FP32 C take a CUDA_R_32F bias (the cublasLtMatmul() datatype table); the
// contract's bias is BF16, widened exactly into the workspace.
TEST(DenseGemm, ABf16GemmWithFp32OutputTakesItsBiasAsFp32) {
  BlasRig r;
  Backend& b = r.b();
  const DenseGemmShape s{DenseKind::kBf16, 5, 24, 40, true, true};
  const auto a = random_bf16(static_cast<std::size_t>(s.m * s.k), 41);
  const auto w = random_bf16(static_cast<std::size_t>(s.n * s.k), 43);
  auto bias = random_bf16(static_cast<std::size_t>(s.n), 47);
  bias[3] = 0x0001;  // a subnormal, kept exactly
  const DenseGemmPlan plan = b.plan_dense_gemm(s);
  EXPECT_GE(plan.workspace_bytes, static_cast<std::uint64_t>(s.n) * 4);
  DenseGemmArgs args;
  args.a = upload(b, a);
  args.b = upload(b, w);
  args.bias = upload(b, bias);
  const auto mn = static_cast<std::size_t>(s.m * s.n);
  args.c = b.alloc(mn * 4);
  b.memset(args.c, 0xFF, mn * 4);
  args.workspace = b.alloc(plan.workspace_bytes);
  args.workspace_bytes = plan.workspace_bytes;
  b.run_dense_gemm(plan, args, b.default_stream());
  b.synchronize(b.default_stream());
  std::vector<float> out(mn);
  b.copy_d2h(out.data(), args.c, mn * 4);
  const std::vector<double> ref = reference_bf16(s, a, w, bias);
  for (std::size_t i = 0; i < mn; ++i) {
    ASSERT_FALSE(std::isnan(out[i])) << "element " << i << " unwritten";
    // FP32 sums of exact products: K + 1 roundings of 2^-24.
    double sum_abs = std::fabs(bf16_to_f32(bias[i % 24]));
    for (std::int64_t k = 0; k < s.k; ++k) {
      sum_abs += std::fabs(double(bf16_to_f32(a[(i / 24) * 40 + static_cast<std::size_t>(k)])) *
                           bf16_to_f32(w[(i % 24) * 40 + static_cast<std::size_t>(k)]));
    }
    ASSERT_LE(std::fabs(out[i] - ref[i]), double(s.k + 2) * std::ldexp(1.0, -24) * sum_abs)
        << "element " << i;
  }
  for (DevicePtr p : {args.a, args.b, args.bias, args.c, args.workspace}) b.free(p);
}

// ---- the fake library's own rules (its table called directly, no mapping of ours) ----

// One FP8 or BF16 problem posed to the fake as a caller of cuBLASLt would: D = op(A) op(B),
// m x n, inner k, in the "TN" form, with the given scale modes, D type and bias type.
constexpr std::int32_t kNoBias = -2;  // no bias epilogue (CUDA_R_32F is 0)
struct LtCall {
  cudaDataType_t in = CUDA_R_8F_E4M3, d_type = CUDA_R_16BF;
  std::uint64_t m = 128, n = 4, k = 128;
  std::int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
               b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  std::int32_t bias_type = kNoBias;
};

cublasStatus_t ask_heuristic(const BlasApi& lt, const LtCall& c) {
  cublasLtHandle_t h = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  EXPECT_EQ(lt.cublasLtCreate(&h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(lt.cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
            CUBLAS_STATUS_SUCCESS);
  const std::int32_t t = CUBLAS_OP_T, nop = CUBLAS_OP_N;
  lt.cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t);
  lt.cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nop, sizeof nop);
  if (c.in == CUDA_R_8F_E4M3) {
    lt.cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &c.a_mode,
                                      sizeof c.a_mode);
    lt.cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &c.b_mode,
                                      sizeof c.b_mode);
  }
  if (c.bias_type != kNoBias) {
    const std::uint32_t epi = CUBLASLT_EPILOGUE_BIAS;
    lt.cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
    lt.cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &c.bias_type,
                                      sizeof c.bias_type);
  }
  const auto k = static_cast<std::int64_t>(c.k), m = static_cast<std::int64_t>(c.m);
  lt.cublasLtMatrixLayoutCreate(&a, c.in, c.k, c.m, k);
  lt.cublasLtMatrixLayoutCreate(&b, c.in, c.k, c.n, k);
  lt.cublasLtMatrixLayoutCreate(&d, c.d_type, c.m, c.n, m);
  lt.cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulHeuristicResult_t result{};
  int count = 0;
  const cublasStatus_t st =
      lt.cublasLtMatmulAlgoGetHeuristic(h, desc, a, b, d, d, pref, 1, &result, &count);
  lt.cublasLtMatmulPreferenceDestroy(pref);
  for (cublasLtMatrixLayout_t l : {a, b, d}) lt.cublasLtMatrixLayoutDestroy(l);
  lt.cublasLtMatmulDescDestroy(desc);
  lt.cublasLtDestroy(h);
  return st == CUBLAS_STATUS_SUCCESS && count == 0 ? CUBLAS_STATUS_NOT_SUPPORTED : st;
}

TEST(FakeBlasRules, TheHeuristicRefusesWhatTheDocumentationExcludes) {
  BlasRig r;
  r.b().plan_dense_gemm({DenseKind::kBf16, 4, 8, 16});  // the context current on this thread
  const BlasApi& lt = *r.fb.load().api;
  const auto ask = [&](LtCall c) { return ask_heuristic(lt, c); };
  EXPECT_EQ(ask({}), CUBLAS_STATUS_SUCCESS);
  LtCall c;
  c.n = 1;  // 3.1.4.5.1: M and N multiples of 4
  EXPECT_EQ(ask(c), CUBLAS_STATUS_NOT_SUPPORTED);
  c = {};
  c.m = 132;  // Tensor Core Usage: m x size(C) a multiple of 16 (BF16 C)
  EXPECT_EQ(ask(c), CUBLAS_STATUS_NOT_SUPPORTED);
  c.d_type = CUDA_R_32F;  // 132 x 4 bytes is
  EXPECT_EQ(ask(c), CUBLAS_STATUS_SUCCESS);
  c = {};
  c.k = 200;  // Tensor Core Usage: k x 1 byte a multiple of 16
  EXPECT_EQ(ask(c), CUBLAS_STATUS_NOT_SUPPORTED);
  c = {};
  c.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;  // BLK x BLK: not in the table
  EXPECT_EQ(ask(c), CUBLAS_STATUS_NOT_SUPPORTED);
  c.a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;  // VEC x BLK is
  EXPECT_EQ(ask(c), CUBLAS_STATUS_SUCCESS);
  // The datatype tables' bias types: FP8 takes BF16 with BF16 and FP32 D alike.
  c = {};
  c.bias_type = CUDA_R_16BF;
  EXPECT_EQ(ask(c), CUBLAS_STATUS_SUCCESS);
  c.d_type = CUDA_R_32F;
  EXPECT_EQ(ask(c), CUBLAS_STATUS_SUCCESS);
  c.bias_type = CUDA_R_32F;
  EXPECT_EQ(ask(c), CUBLAS_STATUS_NOT_SUPPORTED);
  // BF16 inputs take a bias of D's type: FP32 with FP32 D, and no FP8 rule on their shape.
  c = {};
  c.in = CUDA_R_16BF;
  c.m = 13;
  c.n = 1;
  c.k = 7;
  c.d_type = CUDA_R_32F;
  c.bias_type = CUDA_R_16BF;
  EXPECT_EQ(ask(c), CUBLAS_STATUS_NOT_SUPPORTED);
  c.bias_type = CUDA_R_32F;
  EXPECT_EQ(ask(c), CUBLAS_STATUS_SUCCESS);
}

TEST(FakeBlasRules, BlockScalingIsRefusedOffComputeCapability90) {
  FakeDevice blackwell;
  blackwell.cc_major = 10;
  BlasRig r(blackwell);
  r.b().plan_dense_gemm({DenseKind::kBf16, 4, 8, 16});
  const BlasApi& lt = *r.fb.load().api;
  EXPECT_EQ(ask_heuristic(lt, {}), CUBLAS_STATUS_NOT_SUPPORTED);
  LtCall tensorwide;  // SCALAR_32F on both: 8.9+
  tensorwide.a_mode = tensorwide.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  EXPECT_EQ(ask_heuristic(lt, tensorwide), CUBLAS_STATUS_SUCCESS);
}

// ---- failures and life ----

TEST(DenseGemm, AFailedMatmulIsAnErrorNamingTheCall) {
  BlasRig r;
  Backend& b = r.b();
  const DenseGemmShape s{DenseKind::kBf16, 16, 16, 16};
  const DenseGemmPlan plan = b.plan_dense_gemm(s);
  const auto data = random_bf16(16 * 16, 1);
  DenseGemmArgs args;
  args.a = upload(b, data);
  args.b = upload(b, data);
  args.c = b.alloc(16 * 16 * 2);
  r.fb.fail_matmul(CUBLAS_STATUS_NOT_SUPPORTED);
  const Error e = expect_error([&] { b.run_dense_gemm(plan, args, b.default_stream()); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[run_dense_gemm] cublasLtMatmul returned "
                                  "CUBLAS_STATUS_NOT_SUPPORTED (15) for the dense GEMM bf16"));
  EXPECT_EQ(r.fb.live_descriptors(), 0);
  for (DevicePtr p : {args.a, args.b, args.c}) b.free(p);
}

TEST(DenseGemm, APlanOfAnotherBackendIsRefused) {
  BlasRig r;
  const DenseGemmShape s{DenseKind::kBf16, 16, 16, 16};
  const DenseGemmPlan plan = r.b().plan_dense_gemm(s);
  CudaBackend other(r.rig.host, r.rig.registry);
  // The other backend's memo has a slot 1 too, for another shape: the key alone is not enough.
  other.plan_dense_gemm({DenseKind::kBf16, 32, 16, 16});
  const auto data = random_bf16(16 * 16, 1);
  DenseGemmArgs args;
  args.a = upload(other, data);
  args.b = upload(other, data);
  args.c = other.alloc(16 * 16 * 2);
  const Error e = expect_error([&] { other.run_dense_gemm(plan, args, other.default_stream()); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("algorithm 1 is not this backend's plan"));
  for (DevicePtr p : {args.a, args.b, args.c}) other.free(p);
}

TEST(DenseGemm, TheHandleIsMadeOnFirstUseAndDestroyedWithTheBackend) {
  BlasRig r;
  EXPECT_EQ(r.fb.live_handles(), 0);  // a backend that runs no dense GEMM makes none
  r.b().plan_dense_gemm({DenseKind::kBf16, 16, 16, 16});
  r.b().plan_dense_gemm({DenseKind::kBf16, 32, 16, 16});
  EXPECT_EQ(r.fb.live_handles(), 1);
  EXPECT_EQ(r.fb.calls("cublasLtCreate"), 1u);
  r.rig.backend.reset();
  EXPECT_EQ(r.fb.live_handles(), 0);
  EXPECT_EQ(r.fb.calls("cublasLtDestroy"), 1u);
}

}  // namespace
}  // namespace metrale::cuda::testing
