// The rest of the w4a16_gemm contract on every backend: a one-row case checked element by
// element against values computed by hand, the route rules, the debug route line and the
// METRALE_GEMM_SHAPE_LOG info line, the OpCache scratch of the e4m3 route, and bad arguments
// (kInvalidArgument naming the op and the bad value; nothing looked up, launched or written).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"
#include "support/log_capture.h"

namespace metrale::testing::gemm {
namespace {

using ops::Activations;
using ops::GemmRoute;
using ::testing::HasSubstr;

// ---- a one-row GEMM computed by hand ----
//
// W is 3 × 32. A[k] = 1, 0.5 for even, odd k < 16 and 2, -1 for even, odd k >= 16, so a swapped
// nibble, a wrong group or a wrong scale changes the result. Codes per row:
//   row 0: every code 2 (1.0);
//   row 1: even k code 7 (6.0), odd k code 9 (-0.5);
//   row 2: k < 16: code k % 8 (0, .5, 1, 1.5, 2, 3, 4, 6); k >= 16: code 8 + k % 8 (their
//          negatives).
// Per-row sums of A·e2m1 for the k < 16 group (g0) and the k >= 16 group (g1):
//   row 0: g0 = 8·1 + 8·0.5 = 12;             g1 = 8·2 + 8·(-1) = 8
//   row 1: g0 = 8·6·1 + 8·(-.5)·.5 = 46;      g1 = 8·6·2 + 8·(-.5)·(-1) = 100
//   row 2: g0 = 2·(0+1+2+4)·1 + 2·(.5+1.5+3+6)·.5 = 25;  g1 = 2·(-7)·2 + 2·(-11)·(-1) = -6
// NVFP4 (groups of 16), E4M3 block scales {1, .5}, {2, .125}, {1, .25}, tensor scale .25:
//   row 0: (12·1 + 8·.5)·.25 = 4;  row 1: (46·2 + 100·.125)·.25 = 26.125;
//   row 2: (25·1 - 6·.25)·.25 = 5.875
// MXFP4 (one group of 32), E8M0 scales 2^0, 2^-1, 2^2, tensor scale 1:
//   row 0: 20;  row 1: 146·.5 = 73;  row 2: 19·4 = 76
// Bias {0.5, -1, -6} adds to each. Every value is exact in BF16 (and every partial sum in FP32,
// and A in E4M3), so every route must produce exactly these numbers.
constexpr std::int64_t kHandN = 3, kHandK = 32;
constexpr std::array<float, 3> kHandBias = {0.5f, -1.0f, -6.0f};
constexpr std::array<float, 3> kHandNvfp4 = {4.0f, 26.125f, 5.875f};
constexpr std::array<float, 3> kHandNvfp4Bias = {4.5f, 25.125f, -0.125f};
constexpr std::array<float, 3> kHandMxfp4 = {20.0f, 73.0f, 76.0f};
constexpr std::array<float, 3> kHandMxfp4Bias = {20.5f, 72.0f, 70.0f};

std::vector<std::uint16_t> hand_activations() {
  std::vector<std::uint16_t> a(kHandK);
  for (std::int64_t k = 0; k < kHandK; ++k) {
    const float v = k < 16 ? (k % 2 ? 0.5f : 1.0f) : (k % 2 ? -1.0f : 2.0f);
    a[static_cast<std::size_t>(k)] = num::f32_to_bf16(v);
  }
  return a;
}

HostQuantWeights hand_weights(WeightFormat format) {
  HostQuantWeights w;
  w.format = format;
  w.layout = WeightLayout::kRowMajor;
  w.n = kHandN;
  w.k = kHandK;
  w.codes.resize(kHandN * kHandK / 2);
  for (std::int64_t k = 0; k < kHandK; k += 2) {
    const auto byte = [](std::int64_t lo, std::int64_t hi) {
      return static_cast<std::uint8_t>(lo | (hi << 4));
    };
    const std::int64_t base = k < 16 ? 0 : 8;
    const auto i = static_cast<std::size_t>(k / 2);
    w.codes[i] = byte(2, 2);
    w.codes[16 + i] = byte(7, 9);
    w.codes[32 + i] = byte(base + k % 8, base + (k + 1) % 8);
  }
  if (format == WeightFormat::kNvfp4) {
    // E4M3: 1.0 = 0x38, 0.5 = 0x30, 2.0 = 0x40, 0.125 = 0x20, 0.25 = 0x28.
    w.scales = {0x38, 0x30, 0x40, 0x20, 0x38, 0x28};
    w.tensor_scale = 0.25f;
  } else {
    // E8M0: 2^(e - 127).
    w.scales = {127, 126, 129};
    w.tensor_scale = 1.0f;
  }
  return w;
}

class GemmHandComputed : public GemmBackendTest {};
INSTANTIATE_TEST_SUITE_P(, GemmHandComputed, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GemmHandComputed, OneRowMatchesHandComputedValuesOnEveryRoute) {
  const std::vector<std::uint16_t> a = hand_activations();
  std::vector<std::uint16_t> bias;
  for (const float v : kHandBias) bias.push_back(num::f32_to_bf16(v));
  const DevicePtr da = upload(a), dbias = upload(bias);
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    const HostQuantWeights row = hand_weights(f);
    for (const bool with_bias : {false, true}) {
      const auto& expected = f == WeightFormat::kNvfp4 ? (with_bias ? kHandNvfp4Bias : kHandNvfp4)
                                                       : (with_bias ? kHandMxfp4Bias : kHandMxfp4);
      // The float64 reference of the other tests agrees with the hand (it is checked too).
      const Reference ref =
          reference(a, 1, row, with_bias ? bias : std::vector<std::uint16_t>{}, AMode::kBf16);
      for (std::int64_t j = 0; j < kHandN; ++j) {
        EXPECT_EQ(ref.value[static_cast<std::size_t>(j)], expected[static_cast<std::size_t>(j)])
            << "reference, column " << j;
      }
      for (const WeightLayout layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
        const ops::QuantWeights w = upload_weights(with_layout(row, layout));
        // The dequant route too where the backend has a dense BF16 GEMM: the hand weights' tensor
        // scales (1/4, 1) are powers of two, so its BF16 weights are exact.
        for (const GemmRoute r : {GemmRoute::kAuto, GemmRoute::kDecode, GemmRoute::kTiled,
                                  GemmRoute::kE4m3, GemmRoute::kDequant}) {
          if (r == GemmRoute::kE4m3 && !module_provides(b(), "gemm_e4m3")) continue;
          if (r == GemmRoute::kDequant && !b().dense_gemm_unavailable(DenseKind::kBf16).empty()) {
            continue;
          }
          const std::string what =
              fmt::format("{} {} {} route {}", to_string(f),
                          layout == WeightLayout::kRowMajor ? "row-major" : "transposed",
                          with_bias ? "with bias" : "no bias", ops::to_string(r));
          const DevicePtr dc = poisoned(kHandN * 2);
          const ops::GemmOptions o{
              r == GemmRoute::kE4m3 ? Activations::kAllowE4m3 : Activations::kExactBf16, r,
              with_bias ? dbias : DevicePtr{}};
          ops::w4a16_gemm(b(), stream(), da, 1, w, dc, o);
          const auto out = read<std::uint16_t>(dc, kHandN);
          for (std::int64_t j = 0; j < kHandN; ++j) {
            EXPECT_EQ(num::bf16_to_f32(out[static_cast<std::size_t>(j)]),
                      expected[static_cast<std::size_t>(j)])
                << what << ", C[0, " << j << "] (bits 0x" << std::hex
                << out[static_cast<std::size_t>(j)] << std::dec << ")";
          }
        }
      }
    }
  }
}

// ---- route rules ----

class GemmRoutes : public GemmBackendTest {
 protected:
  ops::QuantWeights small_weights() {
    const HostQuantWeights row =
        quantize(WeightFormat::kNvfp4, random_weight_values(gen(), 7, 16), 7, 16);
    return upload_weights(row);
  }
};
INSTANTIATE_TEST_SUITE_P(, GemmRoutes, ::testing::Values("cpu", "cuda"), backend_name);

// The exact route kAuto takes above the decode sizes: dequant → dense BF16 from the M
// dequant_bf16 publishes (CUDA with cuBLASLt: 256) once a device verified it, else tiled (the
// CPU publishes none).
GemmRoute exact_above_decode(Backend& b, std::int64_t m) {
  const std::uint32_t from = auto_may_choose(b, "dequant_bf16")
                                 ? b.op_cache().kernel(b, "w4a16", "dequant_bf16").meta.min_m
                                 : 0;
  return from != 0 && m >= from && b.dense_gemm_unavailable(DenseKind::kBf16).empty()
             ? GemmRoute::kDequant
             : GemmRoute::kTiled;
}

TEST_P(GemmRoutes, AutoPicksDecodeUpToDecodeMaxMAndTiledAbove) {
  const ops::QuantWeights w = small_weights();
  // The threshold is what gemm_decode publishes: 16 rows on a GPU; on the CPU 4, whose tiled
  // panels are faster from 5 rows on, or 6 where the kernels use AVX2, whose 6-row FP32 tiles
  // are not faster before 7 (cpu/modules/w4a16_module.cpp).
  const std::int64_t max_m = ops::decode_max_m(b());
  const std::int64_t cpu_max_m = cpu_kernel_isa() == std::string_view("avx2") ? 6 : 4;
  EXPECT_EQ(max_m, GetParam() == std::string("cpu") ? cpu_max_m : 16);
  for (const std::int64_t m : {std::int64_t{1}, std::int64_t{2}, max_m - 1, max_m}) {
    EXPECT_EQ(ops::choose_route(b(), m, w), GemmRoute::kDecode) << "M = " << m;
  }
  for (const std::int64_t m : {max_m + 1, ops::kE4m3MinM, std::int64_t{4096}}) {
    EXPECT_EQ(ops::choose_route(b(), m, w), exact_above_decode(b(), m)) << "M = " << m;
  }
}

TEST_P(GemmRoutes, AutoPicksE4m3OnlyWhereItsKernelOffersItself) {
  const ops::QuantWeights w = small_weights();
  const ops::GemmOptions allow{Activations::kAllowE4m3, GemmRoute::kAuto, DevicePtr{}};
  // Neither built-in module offers its e4m3 kernel to kAuto (both measured slower than the
  // exact routes: no gemm_e4m3_min_m), so allowing E4M3 changes no choice here; a module that
  // publishes kE4m3MinM gets the route from there (tests/reliability's fake model does).
  const bool has_e4m3 = module_provides(b(), "gemm_e4m3") &&
                        b().op_cache().kernel(b(), "w4a16", "gemm_e4m3").meta.min_m != 0;
  EXPECT_FALSE(has_e4m3);
  const std::int64_t max_m = ops::decode_max_m(b());
  EXPECT_EQ(ops::choose_route(b(), 1, w, allow), GemmRoute::kDecode);
  EXPECT_EQ(ops::choose_route(b(), max_m, w, allow), GemmRoute::kDecode);
  EXPECT_EQ(ops::choose_route(b(), max_m + 1, w, allow), GemmRoute::kTiled);
  EXPECT_EQ(ops::choose_route(b(), ops::kE4m3MinM - 1, w, allow), GemmRoute::kTiled);
  for (const std::int64_t m : {ops::kE4m3MinM, ops::kE4m3MinM + 1, std::int64_t{4096}}) {
    EXPECT_EQ(ops::choose_route(b(), m, w, allow),
              has_e4m3 ? GemmRoute::kE4m3 : exact_above_decode(b(), m))
        << "M = " << m;
    EXPECT_EQ(ops::choose_route(b(), m, w), exact_above_decode(b(), m))
        << "M = " << m << ", exact BF16";
  }
}

TEST_P(GemmRoutes, AForcedRouteIsTakenForAnyM) {
  const ops::QuantWeights w = small_weights();
  for (const std::int64_t m : {std::int64_t{1}, std::int64_t{17}, std::int64_t{4096}}) {
    for (const GemmRoute r : {GemmRoute::kDecode, GemmRoute::kTiled}) {
      for (const Activations act : {Activations::kExactBf16, Activations::kAllowE4m3}) {
        EXPECT_EQ(ops::choose_route(b(), m, w, {act, r, DevicePtr{}}), r)
            << "M = " << m << " " << ops::to_string(r);
      }
    }
    if (module_provides(b(), "gemm_e4m3")) {
      EXPECT_EQ(ops::choose_route(b(), m, w, {Activations::kAllowE4m3, GemmRoute::kE4m3, {}}),
                GemmRoute::kE4m3);
    }
  }
}

TEST_P(GemmRoutes, ForcingE4m3WithExactBf16IsRefusedWithNothingLaunchedOrWritten) {
  const std::size_t audit0 = b().lookup_audit().size();
  const ops::QuantWeights w = small_weights();
  const std::int64_t m = 64;
  const DevicePtr da = upload(random_activations(gen(), m * 16));
  const DevicePtr dc = poisoned(m * 7 * 2);
  const ops::GemmOptions o{Activations::kExactBf16, GemmRoute::kE4m3, DevicePtr{}};
  for (const Error& e : {expect_error([&] { ops::choose_route(b(), m, w, o); }),
                         expect_error([&] { ops::w4a16_gemm(b(), stream(), da, m, w, dc, o); })}) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("[w4a16_gemm]"));
    EXPECT_THAT(e.what(), HasSubstr("casts A to E4M3"));
    EXPECT_THAT(e.what(), HasSubstr("exact BF16"));
  }
  EXPECT_EQ(b().lookup_audit().size(), audit0) << "a kernel was looked up";
  EXPECT_EQ(b().op_cache().scratch_count(), 0u);
  const auto out = read<std::uint16_t>(dc, m * 7);
  EXPECT_EQ(std::count(out.begin(), out.end(), kPoisonBf16), m * 7) << "C was written";
}

// ---- diagnostics ----

class GemmLogs : public GemmBackendTest {
 protected:
  // Runs a GEMM of M × N × K (NVFP4) on backend with options.
  void gemm(Backend& backend, std::int64_t m, std::int64_t n, std::int64_t k,
            const ops::GemmOptions& o = {}) {
    const HostQuantWeights row =
        quantize(WeightFormat::kNvfp4, random_weight_values(gen(), n, k), n, k);
    ops::QuantWeights w = ops::upload_weights(backend, row);
    const std::vector<std::uint16_t> a = random_activations(gen(), m * k);
    const DevicePtr da = backend.alloc(a.size() * 2), dc = backend.alloc(m * n * 2);
    backend.copy_h2d(da, a.data(), a.size() * 2);
    ops::w4a16_gemm(backend, backend.default_stream(), da, m, w, dc, o);
    backend.synchronize(backend.default_stream());
    backend.free(da);
    backend.free(dc);
    ops::free_weights(backend, w);
  }
  static std::string route_line(Backend& backend, std::string_view route, std::int64_t m,
                                std::int64_t n, std::int64_t k) {
    return fmt::format("{} w4a16_gemm: route {} for M={} N={} K={}", backend.name(), route, m, n,
                       k);
  }
};
INSTANTIATE_TEST_SUITE_P(, GemmLogs, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GemmLogs, TheRouteLineIsLoggedOncePerRouteAndShapePerBackend) {
  const LogCapture logs(log::Level::kDebug);
  auto count = [&](const std::string& line) { return logs.count(log::Level::kDebug, line); };
  const std::string first = route_line(b(), "decode", 1, 7, 16);
  gemm(b(), 1, 7, 16);
  EXPECT_EQ(count(first), 1u);
  gemm(b(), 1, 7, 16);
  EXPECT_EQ(count(first), 1u) << "an identical call logged again";
  gemm(b(), 2, 7, 16);
  EXPECT_EQ(count(route_line(b(), "decode", 2, 7, 16)), 1u) << "another M";
  gemm(b(), 1, 7, 32);
  EXPECT_EQ(count(route_line(b(), "decode", 1, 7, 32)), 1u) << "another K";
  gemm(b(), 1, 7, 16, {Activations::kExactBf16, GemmRoute::kTiled, DevicePtr{}});
  EXPECT_EQ(count(route_line(b(), "tiled", 1, 7, 16)), 1u) << "another route, same shape";
  gemm(b(), 17, 9, 16);
  EXPECT_EQ(count(route_line(b(), "tiled", 17, 9, 16)), 1u);
  EXPECT_EQ(count(first), 1u);
  // A second backend (a new model) logs its own line for a shape the first has seen.
  BackendOrReason other = make_backend(GetParam());
  ASSERT_TRUE(other.backend) << other.reason;
  gemm(*other.backend, 1, 7, 16);
  EXPECT_EQ(count(first), 2u) << "the second backend did not log its own route line";
  gemm(*other.backend, 1, 7, 16);
  EXPECT_EQ(count(first), 2u);
  gemm(b(), 1, 7, 16);
  EXPECT_EQ(count(first), 2u);
  other.backend->op_cache().release(*other.backend);
  EXPECT_EQ(logs.count(log::Level::kInfo, "GFLOP"), std::getenv("METRALE_GEMM_SHAPE_LOG") ? 6u : 0u)
      << "one shape line per route line, only with METRALE_GEMM_SHAPE_LOG=1";
}

bool shape_log_switch_on() {
  const char* v = std::getenv("METRALE_GEMM_SHAPE_LOG");
  return v != nullptr && std::string_view(v) == "1";
}

// Runs only where ctest sets METRALE_GEMM_SHAPE_LOG=1 (the ops.gemm_shape_log entry): the switch
// is read once per process.
TEST_P(GemmLogs, ShapeLogSwitchAddsAnInfoLineWithTheFlopCount) {
  if (!shape_log_switch_on()) GTEST_SKIP() << "METRALE_GEMM_SHAPE_LOG=1 is not set";
  const LogCapture logs(log::Level::kInfo);
  // 2·3·7·16 = 672 FLOP; 2·64·300·1040 = 39,936,000 FLOP.
  const std::string small =
      fmt::format("{} w4a16_gemm shape M=3 N=7 K=16: 6.72e-07 GFLOP", b().name());
  const std::string large =
      fmt::format("{} w4a16_gemm shape M=64 N=300 K=1040: 0.0399 GFLOP", b().name());
  gemm(b(), 3, 7, 16);
  EXPECT_EQ(logs.count(log::Level::kInfo, small), 1u);
  gemm(b(), 3, 7, 16);
  EXPECT_EQ(logs.count(log::Level::kInfo, small), 1u) << "an identical call logged again";
  gemm(b(), 64, 300, 1040);
  EXPECT_EQ(logs.count(log::Level::kInfo, large), 1u);
  EXPECT_EQ(logs.count(log::Level::kInfo, "GFLOP"), 2u);
  EXPECT_EQ(logs.count(log::Level::kDebug, "route"), 0u) << "debug lines at info level";
}

TEST_P(GemmLogs, NoShapeLineWithoutTheSwitch) {
  if (shape_log_switch_on()) GTEST_SKIP() << "METRALE_GEMM_SHAPE_LOG=1 is set";
  const LogCapture logs(log::Level::kDebug);
  gemm(b(), 3, 7, 16);
  gemm(b(), 64, 300, 48);
  EXPECT_EQ(logs.count(log::Level::kDebug, "w4a16_gemm: route"), 2u);
  EXPECT_EQ(logs.count(log::Level::kInfo, "GFLOP"), 0u);
}

// ---- OpCache scratch of the e4m3 route ----

class GemmScratch : public GemmBackendTest {
 protected:
  void SetUp() override {
    GemmBackendTest::SetUp();
    if (IsSkipped()) return;
    if (!module_provides(b(), "gemm_e4m3")) {
      GTEST_SKIP() << b().name() << "'s w4a16 module has no gemm_e4m3";
    }
  }
  // An e4m3-route GEMM on fresh data, checked against the e4m3-aware reference.
  void e4m3_gemm(std::int64_t m, std::int64_t n, std::int64_t k) {
    SCOPED_TRACE(fmt::format("M={} N={} K={}", m, n, k));
    const HostQuantWeights row =
        quantize(WeightFormat::kNvfp4, random_weight_values(gen(), n, k), n, k);
    const std::vector<std::uint16_t> a = random_activations(gen(), m * k);
    // Uploads before the count is taken: only what the op allocates is counted.
    const ops::QuantWeights w = upload_weights(row);
    const DevicePtr da = upload(a), dc = poisoned(m * n * 2);
    const AllocStats before = b().alloc_stats();
    ops::w4a16_gemm(b(), stream(), da, m, w, dc,
                    {Activations::kAllowE4m3, GemmRoute::kE4m3, DevicePtr{}});
    allocated_ = scratch_blocks_since(before);
    expect_close(compare(read<std::uint16_t>(dc, m * n), reference(a, m, row, {}, AMode::kE4m3)),
                 kNormTol, "e4m3 route");
  }
  // Whether the cache holds the GEMM's scratch `base` for the fixture's stream with at least
  // bytes (asking allocates nothing if so).
  bool holds(std::string_view base, std::size_t bytes) {
    const AllocStats before = b().alloc_stats();
    b().op_cache().scratch(b(), ops::gemm_scratch_tag(b(), stream(), base), bytes, stream());
    return scratch_blocks_since(before) == 0 &&
           b().alloc_stats().allocation_count == before.allocation_count;
  }
  // Scratch buffers handed out since before: blocks of the OpCache's pool where it has one
  // (whose growth is one ledger entry for many blocks), else the ledger's allocations.
  std::size_t scratch_blocks_since(const AllocStats& before) {
    const AllocStats now = b().alloc_stats();
    return now.scratch_pool.allocations > 0
               ? now.scratch_pool.allocations - before.scratch_pool.allocations
               : now.allocation_count - before.allocation_count;
  }
  std::size_t allocated_ = 0;
};
INSTANTIATE_TEST_SUITE_P(, GemmScratch, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GemmScratch, E4m3RouteUsesTheFp8ActivationAndFp8WeightsTags) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  OpCache& cache = b().op_cache();
  ASSERT_EQ(cache.scratch_count(), 0u);
  e4m3_gemm(64, 65, 96);
  EXPECT_EQ(allocated_, 2u) << "the first e4m3 GEMM allocates its two scratch buffers";
  EXPECT_EQ(cache.scratch_count(), 2u);
  EXPECT_TRUE(holds("fp8_activation", 64 * 96)) << "no fp8_activation scratch of M·K bytes";
  EXPECT_TRUE(holds("fp8_weights", 65 * 96)) << "no fp8_weights scratch of N·K bytes";
  EXPECT_EQ(cache.scratch_count(), 2u);
  // The same size and smaller ones reuse them.
  e4m3_gemm(64, 65, 96);
  EXPECT_EQ(allocated_, 0u) << "same size";
  e4m3_gemm(64, 7, 32);
  EXPECT_EQ(allocated_, 0u) << "smaller";
  e4m3_gemm(3, 65, 16);
  EXPECT_EQ(allocated_, 0u) << "smaller";
  EXPECT_EQ(cache.scratch_count(), 2u);
  // Larger activations grow fp8_activation alone; larger weights fp8_weights alone.
  e4m3_gemm(128, 65, 96);
  EXPECT_EQ(allocated_, 1u) << "larger M·K";
  EXPECT_TRUE(holds("fp8_activation", 128 * 96));
  e4m3_gemm(64, 130, 96);
  EXPECT_EQ(allocated_, 1u) << "larger N·K";
  EXPECT_TRUE(holds("fp8_weights", 130 * 96));
  EXPECT_EQ(cache.scratch_count(), 2u);
}

TEST_P(GemmScratch, TagsAreTheSeedsOnTheDefaultStreamAndPerStreamElsewhere) {
  EXPECT_EQ(ops::gemm_scratch_tag(b(), b().default_stream(), "fp8_activation"), "fp8_activation");
  const std::string mine = ops::gemm_scratch_tag(b(), stream(), "fp8_activation");
  EXPECT_NE(mine, "fp8_activation");
  const StreamHandle other = b().create_stream();
  EXPECT_NE(ops::gemm_scratch_tag(b(), other, "fp8_activation"), mine);
  b().destroy_stream(other);
}

// GEMMs queued on two streams at once must not cast into one buffer: each stream gets its own
// scratch, and both results are right.
TEST_P(GemmScratch, TwoStreamsNeverShareScratch) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  const std::int64_t m = 64, n = 48, k = 96;
  const StreamHandle s2 = b().create_stream();
  const HostQuantWeights row =
      quantize(WeightFormat::kNvfp4, random_weight_values(gen(), n, k), n, k);
  const ops::QuantWeights w = upload_weights(row);
  const std::vector<std::uint16_t> a1 = random_activations(gen(), m * k),
                                   a2 = random_activations(gen(), m * k);
  const DevicePtr d1 = upload(a1), d2 = upload(a2), c1 = poisoned(m * n * 2),
                  c2 = poisoned(m * n * 2);
  const ops::GemmOptions e4m3{Activations::kAllowE4m3, GemmRoute::kE4m3, DevicePtr{}};
  ops::w4a16_gemm(b(), stream(), d1, m, w, c1, e4m3);
  ops::w4a16_gemm(b(), s2, d2, m, w, c2, e4m3);
  b().synchronize(stream());
  b().synchronize(s2);
  EXPECT_EQ(b().op_cache().scratch_count(), 4u) << "two buffers per stream";
  expect_close(compare(read<std::uint16_t>(c1, m * n), reference(a1, m, row, {}, AMode::kE4m3)),
               kNormTol, "stream 1");
  expect_close(compare(read<std::uint16_t>(c2, m * n), reference(a2, m, row, {}, AMode::kE4m3)),
               kNormTol, "stream 2");
  b().destroy_stream(s2);
}

TEST_P(GemmScratch, ExactRoutesAllocateNothing) {
  const HostQuantWeights row =
      quantize(WeightFormat::kMxfp4, random_weight_values(gen(), 65, 96), 65, 96);
  const ops::QuantWeights w = upload_weights(row);
  const DevicePtr da = upload(random_activations(gen(), 100 * 96));
  const DevicePtr dc = poisoned(100 * 65 * 2);
  const std::size_t before = b().alloc_stats().allocation_count;
  for (const std::int64_t m : {1, 16, 17, 100}) {
    ops::w4a16_gemm(b(), stream(), da, m, w, dc);
    ops::w4a16_gemm(b(), stream(), da, m, w, dc,
                    {Activations::kAllowE4m3,
                     m < ops::kE4m3MinM ? GemmRoute::kAuto : GemmRoute::kTiled, DevicePtr{}});
  }
  b().synchronize(stream());
  EXPECT_EQ(b().alloc_stats().allocation_count, before);
  EXPECT_EQ(b().op_cache().scratch_count(), 0u);
}

// ---- bad arguments ----

class GemmArgs : public GemmBackendTest {
 protected:
  static constexpr std::int64_t kM = 3, kN = 65, kK = 48;
  static constexpr std::size_t kSlot = 4096;  // bytes per input slot of the arena

  void SetUp() override {
    GemmBackendTest::SetUp();
    if (IsSkipped()) return;
    audit0_ = b().lookup_audit().size();
    kernels0_ = b().op_cache().kernel_count();
    // One arena holds A, codes, scales and bias, each at the start of a 4 KiB slot, so that a C
    // placed to overlap any of them stays inside the arena even if the op wrongly ran.
    arena_ = alloc(5 * kSlot);
    arena_host_.resize(5 * kSlot);
    for (std::size_t i = 0; i < arena_host_.size(); ++i) {
      arena_host_[i] = static_cast<std::uint8_t>(i * 7 + 3);
    }
    row_ = quantize(WeightFormat::kNvfp4, random_weight_values(gen(), kN, kK), kN, kK);
    const std::vector<std::uint16_t> a = random_activations(gen(), kM * kK);
    const std::vector<std::uint16_t> bias = random_bias(gen(), kN);
    std::memcpy(arena_host_.data(), a.data(), a.size() * 2);
    std::memcpy(arena_host_.data() + kSlot, row_.codes.data(), row_.codes.size());
    std::memcpy(arena_host_.data() + 2 * kSlot, row_.scales.data(), row_.scales.size());
    std::memcpy(arena_host_.data() + 3 * kSlot, bias.data(), bias.size() * 2);
    b().copy_h2d(arena_, arena_host_.data(), arena_host_.size());
    a_ = arena_;
    bias_ = arena_.offset(3 * kSlot);
    w_.format = WeightFormat::kNvfp4;
    w_.n = kN;
    w_.k = kK;
    w_.codes = arena_.offset(kSlot);
    w_.scales = arena_.offset(2 * kSlot);
    w_.codes_bytes = row_.codes.size();
    w_.scales_bytes = row_.scales.size();
    w_.tensor_scale = row_.tensor_scale;
    c_ = poisoned(kM * kN * 2);
  }

  // The call must throw kInvalidArgument "[w4a16_gemm] ..." containing every word.
  void expect_rejected(DevicePtr a, std::int64_t m, const ops::QuantWeights& w, DevicePtr c,
                       const ops::GemmOptions& o, std::initializer_list<std::string> words) {
    const Error e = expect_error([&] { ops::w4a16_gemm(b(), stream(), a, m, w, c, o); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_THAT(e.what(), ::testing::StartsWith("[w4a16_gemm] "));
    for (const std::string& word : words) EXPECT_THAT(e.what(), HasSubstr(word));
  }

  // Nothing was looked up (so nothing launched), C still poisoned, the inputs unchanged.
  void expect_untouched() {
    EXPECT_EQ(b().lookup_audit().size(), audit0_) << "a kernel was looked up";
    EXPECT_EQ(b().op_cache().kernel_count(), kernels0_);
    EXPECT_EQ(b().op_cache().scratch_count(), 0u);
    const auto out = read<std::uint16_t>(c_, kM * kN);
    EXPECT_EQ(std::count(out.begin(), out.end(), kPoisonBf16), kM * kN) << "C was written";
    EXPECT_EQ(read<std::uint8_t>(arena_, arena_host_.size()), arena_host_)
        << "an input was written";
  }

  static std::string hex(DevicePtr p) { return fmt::format("0x{:x}", p.address()); }

  std::size_t audit0_ = 0, kernels0_ = 0;
  DevicePtr arena_, a_, bias_, c_;
  std::vector<std::uint8_t> arena_host_;
  HostQuantWeights row_;
  ops::QuantWeights w_;
};
INSTANTIATE_TEST_SUITE_P(, GemmArgs, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GemmArgs, TheArgumentsAreValidAsBuilt) {
  // The fixture's arguments work (so each test below fails for its one bad value alone)...
  ops::w4a16_gemm(b(), stream(), a_, kM, w_, c_,
                  {Activations::kExactBf16, GemmRoute::kAuto, bias_});
  const auto out = read<std::uint16_t>(c_, kM * kN);
  std::vector<std::uint16_t> a(kM * kK), bias(kN);
  std::memcpy(a.data(), arena_host_.data(), a.size() * 2);
  std::memcpy(bias.data(), arena_host_.data() + 3 * kSlot, bias.size() * 2);
  expect_close(compare(out, reference(a, kM, row_, bias, AMode::kBf16)), kNormTol, "fixture");
}

TEST_P(GemmArgs, KNotAMultipleOfTheBlockSize) {
  ops::QuantWeights w = w_;
  w.k = 40;
  expect_rejected(a_, kM, w, c_, {}, {"K = 40", "multiple of 16", "nvfp4"});
  w.k = 8;
  expect_rejected(a_, kM, w, c_, {}, {"K = 8", "multiple of 16"});
  w.format = WeightFormat::kMxfp4;
  w.k = 48;  // a multiple of 16 but not of 32
  expect_rejected(a_, kM, w, c_, {}, {"K = 48", "multiple of 32", "mxfp4"});
  expect_untouched();
}

TEST_P(GemmArgs, MOrNBelowOne) {
  expect_rejected(a_, 0, w_, c_, {}, {"M = 0"});
  expect_rejected(a_, -3, w_, c_, {}, {"M = -3"});
  ops::QuantWeights w = w_;
  w.n = 0;
  expect_rejected(a_, kM, w, c_, {}, {"N and K must be at least 1"});
  w = w_;
  w.k = 0;
  expect_rejected(a_, kM, w, c_, {}, {"N and K must be at least 1"});
  expect_untouched();
}

TEST_P(GemmArgs, NullPointers) {
  const ops::GemmOptions none{};
  expect_rejected(DevicePtr{}, kM, w_, c_, none, {"A is null"});
  expect_rejected(a_, kM, w_, DevicePtr{}, none, {"C is null"});
  ops::QuantWeights w = w_;
  w.codes = DevicePtr{};
  expect_rejected(a_, kM, w, c_, none, {"weight codes is null"});
  w = w_;
  w.scales = DevicePtr{};
  expect_rejected(a_, kM, w, c_, none, {"weight scales is null"});
  expect_untouched();
}

// Sizes are computed without overflow: N x K past 2^63 was signed overflow (fuzz_gemm_args), and
// a wrapped M x N x 2 would pass the range checks.
TEST_P(GemmArgs, ShapesWhoseByteSizesOverflowAreRefused) {
  const ops::GemmOptions none{};
  ops::QuantWeights w = w_;
  w.n = std::int64_t{1} << 40;
  w.k = std::int64_t{1} << 40;
  expect_rejected(a_, kM, w, c_, none, {"the weights would be", "more than 64 bits"});
  expect_rejected(a_, std::int64_t{1} << 62, w_, c_, none, {"A would be", "more than 64 bits"});
  expect_untouched();
}

// Kernels write host memory directly on the CPU, so ranges outside the allocations are refused
// before anything runs (fuzz_gemm_args found fill_u32 and w4a16_gemm writing past them).
TEST_P(GemmArgs, RangesOutsideAnAllocationOnTheCpu) {
  if (b().name() != "cpu") GTEST_SKIP() << "only the cpu backend checks ranges against its blocks";
  const ops::GemmOptions none{};
  const DevicePtr short_c = poisoned(kM * kN * 2 - 2);
  expect_rejected(a_, kM, w_, short_c, none, {"C 0x", "overruns the allocation", "by 2 bytes"});
  // A C that the overrunning A range does not reach: the allocation after the arena may lie
  // within it, and C overlapping A is refused first (seen once in ~20 runs).
  const DevicePtr long_a = arena_.offset(5 * kSlot - 16);
  const std::uint64_t a_end = long_a.address() + kM * kK * 2;
  DevicePtr c = c_;
  while (c.address() < a_end && c.address() + kM * kN * 2 > long_a.address()) {
    c = poisoned(kM * kN * 2);
  }
  expect_rejected(long_a, kM, w_, c, none, {"A 0x", "overruns"});
  const DevicePtr freed = b().alloc(kM * kN * 2);
  b().free(freed);
  expect_rejected(a_, kM, w_, freed, none, {"C 0x", "is not inside any allocation"});
  std::vector<std::byte> host(kM * kN * 2 + 16);
  const DevicePtr foreign{(reinterpret_cast<std::uintptr_t>(host.data()) + 15) / 16 * 16};
  expect_rejected(a_, kM, w_, foreign, none, {"C 0x", "is not inside any allocation"});
  expect_untouched();
}

TEST_P(GemmArgs, MisalignedPointers) {
  const ops::GemmOptions none{};
  for (const std::uint64_t off : {2u, 8u}) {
    expect_rejected(a_.offset(off), kM, w_, c_, none,
                    {"A = " + hex(a_.offset(off)), "16-byte aligned"});
    expect_rejected(a_, kM, w_, c_.offset(off), none,
                    {"C = " + hex(c_.offset(off)), "16-byte aligned"});
    ops::QuantWeights w = w_;
    w.codes = w_.codes.offset(off);
    expect_rejected(a_, kM, w, c_, none, {"weight codes = " + hex(w.codes), "16-byte aligned"});
    w = w_;
    w.scales = w_.scales.offset(off);
    expect_rejected(a_, kM, w, c_, none, {"weight scales = " + hex(w.scales), "16-byte aligned"});
    expect_rejected(a_, kM, w_, c_, {Activations::kExactBf16, GemmRoute::kAuto, bias_.offset(off)},
                    {"bias = " + hex(bias_.offset(off)), "16-byte aligned"});
  }
  expect_untouched();
}

TEST_P(GemmArgs, COverlappingAnInput) {
  const ops::GemmOptions with_bias{Activations::kExactBf16, GemmRoute::kAuto, bias_};
  struct Input {
    const char* name;
    DevicePtr at;
  };
  for (const Input in : {Input{"A", a_}, Input{"weight codes", w_.codes},
                         Input{"weight scales", w_.scales}, Input{"bias", bias_}}) {
    // C starting on the input, inside it, and ending inside it from before.
    for (const DevicePtr c : {in.at, in.at.offset(16), DevicePtr{in.at.address() - 64}}) {
      if (c.address() < arena_.address()) continue;  // A is at the arena's start
      expect_rejected(a_, kM, w_, c, with_bias,
                      {"C [" + hex(c), std::string("overlaps ") + in.name});
    }
  }
  expect_untouched();
  // C starting exactly where A ends (M·K·2 = 288 bytes, 16-byte aligned) is adjacent, not
  // overlapping: that call must work. It is made last because it writes into the arena.
  const DevicePtr adjacent = a_.offset(kM * kK * 2);
  ops::w4a16_gemm(b(), stream(), a_, kM, w_, adjacent, with_bias);
  const auto out = read<std::uint16_t>(adjacent, kM * kN);
  EXPECT_EQ(std::count(out.begin(), out.end(), kPoisonBf16), 0);
}

TEST_P(GemmArgs, WrongCodeAndScaleSizes) {
  const ops::GemmOptions none{};
  ops::QuantWeights w = w_;
  w.codes_bytes = w_.codes_bytes - 1;
  expect_rejected(a_, kM, w, c_, none,
                  {fmt::format("weight codes are {} bytes", w.codes_bytes),
                   fmt::format("needs {}", w_.codes_bytes)});
  w.codes_bytes = w_.codes_bytes * 2;  // as if K were 96
  expect_rejected(a_, kM, w, c_, none, {fmt::format("weight codes are {} bytes", w.codes_bytes)});
  w = w_;
  // Scales shaped [N, K/16 - 1] (a group short), and [K/16, N + 1].
  w.scales_bytes = kN * (kK / 16 - 1);
  expect_rejected(a_, kM, w, c_, none,
                  {fmt::format("weight scales are {} bytes", w.scales_bytes),
                   fmt::format("needs {}", w_.scales_bytes)});
  w.scales_bytes = (kK / 16) * (kN + 1);
  expect_rejected(a_, kM, w, c_, none, {fmt::format("weight scales are {} bytes", w.scales_bytes)});
  // NVFP4-sized scales for MXFP4 weights of the same shape (K = 96 keeps K valid for both).
  w = w_;
  w.format = WeightFormat::kMxfp4;
  w.k = 96;
  w.codes_bytes = kN * 48;
  w.scales_bytes = kN * 6;
  expect_rejected(
      a_, kM, w, c_, none,
      {fmt::format("weight scales are {} bytes", kN * 6), fmt::format("needs {}", kN * 3)});
  expect_untouched();
}

TEST_P(GemmArgs, NonPositiveOrNonFiniteTensorScale) {
  ops::QuantWeights w = w_;
  for (const float ts : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::infinity()}) {
    w.tensor_scale = ts;
    expect_rejected(a_, kM, w, c_, {}, {fmt::format("tensor scale {}", ts), "positive finite"});
  }
  expect_untouched();
}

}  // namespace
}  // namespace metrale::testing::gemm
