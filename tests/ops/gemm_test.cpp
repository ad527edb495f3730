// w4a16_gemm numerics on every backend (docs/CONTRACT.md, GEMM routes): fresh random data over many
// shapes (M from 1 to 4096, N and K that are no multiple of any tile), both formats, both layouts,
// with and without bias, on every route (auto, forced decode, tiled, e4m3 and, where the backend
// has a dense BF16 GEMM, dequant), checked against the
// float64 reference with the tolerances derived in gemm_reference.h. Outputs are poisoned first and
// the elements past C must stay poisoned. On the CPU backend the kernels use the best instruction
// set of the processor; ctest runs this program again with METRALE_CPU_ISA=avx2 and =portable
// (tests/CMakeLists.txt), GemmIsa says which one ran.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <span>
#include <string>
#include <vector>

#include "core/published.h"
#include "cpu/kernels/w4a16_cpu.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {
namespace {

using ops::Activations;
using ops::GemmRoute;

constexpr std::array<std::int64_t, 11> kMs = {1, 2, 3, 5, 8, 16, 17, 33, 64, 100, 257};
constexpr std::array<std::int64_t, 8> kNs = {1, 7, 63, 65, 255, 257, 300, 1000};
// Ascending. The CPU decode kernels step through K in chunks of up to 128 and decode scales in
// batches of 16, so the list has K below one chunk, whole batches, a chunk that does not fill a
// batch (400: three chunks; 672: five MX chunks) and a scalar tail past the last chunk.
constexpr std::array<std::int64_t, 6> kNvfp4Ks = {16, 48, 80, 272, 400, 1040};
constexpr std::array<std::int64_t, 5> kMxfp4Ks = {32, 96, 288, 544, 672};

// Multiply-adds per case at most: the largest K that keeps M·N·K under it is used, so the whole
// suite stays well under a minute in a Debug build.
constexpr std::int64_t kMacCap = 300'000;

struct GemmCase {
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  std::int64_t m = 1, n = 1, k = 16;
  bool bias = false;
  GemmRoute route = GemmRoute::kAuto;
  Activations activations = Activations::kExactBf16;
  bool packed = false;  // uploaded in the decode layout (the decode and fused routes read it)

  std::string str() const {
    return fmt::format("{} {} M={} N={} K={} {} route {} {}{}", to_string(format),
                       layout == WeightLayout::kRowMajor ? "row-major" : "transposed", m, n, k,
                       bias ? "with bias" : "no bias", ops::to_string(route),
                       activations == Activations::kExactBf16 ? "exact-bf16" : "allow-e4m3",
                       packed ? " decode layout" : "");
  }
};

std::span<const std::int64_t> ks_of(WeightFormat f) {
  return f == WeightFormat::kNvfp4 ? std::span<const std::int64_t>(kNvfp4Ks)
                                   : std::span<const std::int64_t>(kMxfp4Ks);
}

// Every M of ms with every N of kNs; K, layout and bias rotate so that each K meets many M and
// N, both layouts and both bias settings; K steps down while M·N·K is above kMacCap.
std::vector<GemmCase> sweep(WeightFormat format, std::span<const std::int64_t> ms, GemmRoute route,
                            Activations activations) {
  const std::span<const std::int64_t> ks = ks_of(format);
  std::vector<GemmCase> out;
  for (std::size_t i = 0; i < ms.size(); ++i) {
    for (std::size_t j = 0; j < kNs.size(); ++j) {
      GemmCase c;
      c.format = format;
      c.m = ms[i];
      c.n = kNs[j];
      std::size_t ki = (i + 2 * j) % ks.size();
      while (ki > 0 && c.m * c.n * ks[ki] > kMacCap) --ki;
      c.k = ks[ki];
      c.layout = (i + j) % 2 ? WeightLayout::kTransposed : WeightLayout::kRowMajor;
      c.bias = (i + j / 2) % 2 == 0;
      c.route = route;
      c.activations = activations;
      out.push_back(c);
    }
  }
  return out;
}

class GemmNumerics : public GemmBackendTest {
 protected:
  // Runs one case on fresh data and checks it; returns the route the op took.
  GemmRoute run(const GemmCase& c) {
    SCOPED_TRACE(c.str());
    const std::vector<float> values = random_weight_values(gen(), c.n, c.k);
    const HostQuantWeights row = quantize(c.format, values, c.n, c.k);
    const ops::QuantWeights w =
        upload_weights(c.layout == WeightLayout::kRowMajor ? row : with_layout(row, c.layout),
                       c.packed ? ops::UploadLayout::kDecode : ops::UploadLayout::kSource);
    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(c.m * c.k));
    const std::vector<std::uint16_t> bias =
        c.bias ? random_bias(gen(), c.n) : std::vector<std::uint16_t>{};
    const auto mn = static_cast<std::size_t>(c.m * c.n);
    const DevicePtr da = upload(a);
    const DevicePtr dc = poisoned((mn + kTailElems) * 2);
    const ops::GemmOptions options{c.activations, c.route, c.bias ? upload(bias) : DevicePtr{}};

    const GemmRoute taken = ops::choose_route(b(), c.m, w, options);
    ops::w4a16_gemm(b(), stream(), da, c.m, w, dc, options);
    std::vector<std::uint16_t> out = read<std::uint16_t>(dc, mn + kTailElems);
    EXPECT_EQ(std::count(out.begin() + static_cast<std::ptrdiff_t>(mn), out.end(), kPoisonBf16),
              static_cast<std::ptrdiff_t>(kTailElems))
        << "wrote past C";
    out.resize(mn);

    // The reference comes from the row-major host weights, whatever layout was uploaded.
    const Reference exact = reference(a, c.m, row, bias, AMode::kBf16);
    if (taken == GemmRoute::kDequant) {
      // BF16 weights rounded once with the tensor scale: the route's own table entry.
      const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(taken, c.format);
      const Comparison cmp = compare(out, reference(a, c.m, row, bias, tol));
      EXPECT_TRUE(toolkit::within(cmp, tol)) << "against the float64 reference: " << cmp.str();
    } else if (taken != GemmRoute::kE4m3) {
      expect_close(compare(out, exact), kNormTol, "against the float64 reference");
    } else {
      const Reference aware = reference(a, c.m, row, bias, AMode::kE4m3);
      expect_close(compare(out, aware), kNormTol, "against the e4m3-aware reference");
      Reference mixed = aware;  // the exact values, with the e4m3 bound and the cast gap
      mixed.value = exact.value;
      const Comparison vs_exact = compare(out, mixed, /*add_cast_gap=*/true);
      EXPECT_LE(vs_exact.worst, 1.0) << "against the exact-BF16 reference: " << vs_exact.str();
      if (c.m * c.n >= kE4m3StatMinOutputs && c.m * c.k >= kE4m3StatMinActs) {
        ++statistical_checks_;
        EXPECT_LE(vs_exact.normalized, kE4m3VsExactTol)
            << "against the exact-BF16 reference: " << vs_exact.str();
      }
    }
    free_all();
    return taken;
  }

  // Runs every case (each must take the route it forces).
  void run_all(const std::vector<GemmCase>& cases) {
    for (const GemmCase& c : cases) {
      EXPECT_EQ(run(c), c.route) << c.str();
      if (HasFatalFailure()) return;
    }
  }

  // The route kAuto must take (docs/CONTRACT.md, GEMM routes; ops/gemm.h).
  GemmRoute expected_auto(std::int64_t m, Activations activations) {
    // The smallest M the entry publishes, where the automatic route may take it: a kernel no
    // device run has verified runs only when asked for (core/published.h), so it counts as 0.
    const auto min_m = [&](const char* entry) -> std::uint32_t {
      if (!module_provides(b(), entry)) return 0;
      const KernelMeta& meta = b().op_cache().kernel(b(), "w4a16", entry).meta;
      return automatic_choice_allowed(meta) ? meta.min_m : 0;
    };
    const std::uint32_t e4m3 = min_m("gemm_e4m3"), dequant = min_m("dequant_bf16");
    if (activations == Activations::kAllowE4m3 && e4m3 != 0 && m >= e4m3) return GemmRoute::kE4m3;
    if (m <= ops::decode_max_m(b())) return GemmRoute::kDecode;
    if (dequant != 0 && m >= dequant && b().dense_gemm_unavailable(DenseKind::kBf16).empty())
      return GemmRoute::kDequant;
    return GemmRoute::kTiled;
  }

  // One pass of the block-scale tests: M rows of A on a forced exact route, one weight layout.
  struct ScaleRun {
    std::int64_t m;
    GemmRoute route;
    WeightLayout layout;
    // kPanels runs where the backend's kernels read the panel layout (the CPU's, with AVX-512
    // BF16), and are left out elsewhere.
    ops::UploadLayout upload;
    std::string str() const {
      return fmt::format("M={} route {} {}{}", m, ops::to_string(route),
                         layout == WeightLayout::kRowMajor ? "row-major" : "transposed",
                         upload == ops::UploadLayout::kPanels ? ", panel layout" : "");
    }
  };
  static constexpr std::array<ScaleRun, 8> kScaleRuns = {
      {{1, GemmRoute::kDecode, WeightLayout::kRowMajor, ops::UploadLayout::kSource},
       {5, GemmRoute::kDecode, WeightLayout::kRowMajor, ops::UploadLayout::kSource},
       {1, GemmRoute::kDecode, WeightLayout::kTransposed, ops::UploadLayout::kSource},
       {3, GemmRoute::kTiled, WeightLayout::kRowMajor, ops::UploadLayout::kSource},
       {5, GemmRoute::kDecode, WeightLayout::kRowMajor, ops::UploadLayout::kPanels},
       {3, GemmRoute::kTiled, WeightLayout::kTransposed, ops::UploadLayout::kPanels},
       {20, GemmRoute::kTiled, WeightLayout::kRowMajor, ops::UploadLayout::kPanels},
       {100, GemmRoute::kTiled, WeightLayout::kRowMajor, ops::UploadLayout::kPanels}}};

  // Whether this backend runs `run` (panel-layout runs need kernels that read it).
  bool runs(const ScaleRun& run) {
    return run.upload != ops::UploadLayout::kPanels || ops::reads_panel_layout(b());
  }

  // C [run.m, row.n] for the row-major host weights `row` uploaded in run's layout, on run's
  // route, poisoned first.
  std::vector<std::uint16_t> run_exact(const HostQuantWeights& row, const ScaleRun& run,
                                       const std::vector<std::uint16_t>& a) {
    const ops::QuantWeights w = upload_weights(
        run.layout == WeightLayout::kRowMajor ? row : with_layout(row, run.layout), run.upload);
    const auto mn = static_cast<std::size_t>(run.m * row.n);
    const DevicePtr dc = poisoned(mn * 2);
    ops::w4a16_gemm(b(), stream(), upload(a), run.m, w, dc,
                    {Activations::kExactBf16, run.route, DevicePtr{}});
    return read<std::uint16_t>(dc, mn);
  }

  int statistical_checks_ = 0;  // cases large enough for the e4m3-vs-exact normalized check

  void skip_without(std::string_view entry) {
    if (!module_provides(b(), entry)) {
      GTEST_SKIP() << b().name() << "'s w4a16 module has no " << entry;
    }
  }
  // Whether the backend runs the dequant route (it needs a dense BF16 GEMM).
  bool has_dequant() { return b().dense_gemm_unavailable(DenseKind::kBf16).empty(); }
};

INSTANTIATE_TEST_SUITE_P(, GemmNumerics, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(GemmNumerics, Nvfp4AutoRouteOverEveryShape) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  const auto cases = sweep(WeightFormat::kNvfp4, kMs, GemmRoute::kAuto, Activations::kExactBf16);
  for (const GemmCase& c : cases) {
    EXPECT_EQ(run(c), expected_auto(c.m, c.activations)) << c.str();
    if (HasFatalFailure()) return;
  }
}

TEST_P(GemmNumerics, Mxfp4AutoRouteOverEveryShape) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  const auto cases = sweep(WeightFormat::kMxfp4, kMs, GemmRoute::kAuto, Activations::kExactBf16);
  for (const GemmCase& c : cases) {
    EXPECT_EQ(run(c), expected_auto(c.m, c.activations)) << c.str();
    if (HasFatalFailure()) return;
  }
}

// The caller allows E4M3: from kE4m3MinM rows on, auto takes the e4m3 route (when the module
// has it), below it the exact routes.
TEST_P(GemmNumerics, AutoRouteWithE4m3AllowedOverEveryShape) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::array<std::int64_t, 7> ms = {1, 16, 17, 63, 64, 100, 257};
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const GemmCase& c : sweep(f, ms, GemmRoute::kAuto, Activations::kAllowE4m3)) {
      EXPECT_EQ(run(c), expected_auto(c.m, c.activations)) << c.str();
      if (HasFatalFailure()) return;
    }
  }
}

// A forced route is taken whatever M is: decode above kDecodeMaxM, tiled for a single row.
TEST_P(GemmNumerics, ForcedDecodeOverEveryShape) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::array<std::int64_t, 8> ms = {1, 2, 3, 5, 8, 16, 17, 33};
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    run_all(sweep(f, ms, GemmRoute::kDecode, Activations::kExactBf16));
    if (HasFatalFailure()) return;
  }
}

TEST_P(GemmNumerics, ForcedTiledOverEveryShape) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::array<std::int64_t, 7> ms = {1, 2, 3, 5, 17, 33, 100};
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    run_all(sweep(f, ms, GemmRoute::kTiled, Activations::kExactBf16));
    if (HasFatalFailure()) return;
  }
}

TEST_P(GemmNumerics, ForcedE4m3OverEveryShape) {
  skip_without("gemm_e4m3");
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::array<std::int64_t, 7> ms = {1, 3, 8, 17, 64, 100, 257};
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    run_all(sweep(f, ms, GemmRoute::kE4m3, Activations::kAllowE4m3));
    if (HasFatalFailure()) return;
  }
}

// The dequant route (explicit only) where the backend has a dense BF16 GEMM.
TEST_P(GemmNumerics, ForcedDequantOverEveryShape) {
  if (!has_dequant()) GTEST_SKIP() << b().dense_gemm_unavailable(DenseKind::kBf16);
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::array<std::int64_t, 7> ms = {1, 3, 16, 17, 64, 100, 257};
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    run_all(sweep(f, ms, GemmRoute::kDequant, Activations::kExactBf16));
    if (HasFatalFailure()) return;
  }
}

// The fused route on weights in the decode layout, above the decode sizes, where the backend's
// module has gemm_fused.
TEST_P(GemmNumerics, ForcedFusedOverEveryShape) {
  skip_without("gemm_fused");
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::array<std::int64_t, 5> ms = {17, 64, 100, 128, 257};
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    std::vector<GemmCase> cases = sweep(f, ms, GemmRoute::kFused, Activations::kExactBf16);
    for (GemmCase& c : cases) c.packed = true;
    run_all(cases);
    if (HasFatalFailure()) return;
  }
}

// The e4m3 route against the exact-BF16 result, on shapes large enough for the statistical
// tolerance kE4m3VsExactTol (gemm_reference.h) to apply.
TEST_P(GemmNumerics, E4m3RouteStaysWithinTheCastErrorOfTheExactResult) {
  skip_without("gemm_e4m3");
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  struct Mnk {
    std::int64_t m, n, k;
  };
  int i = 0;
  for (const Mnk s : {Mnk{64, 65, 96}, Mnk{257, 7, 32}, Mnk{100, 63, 48}, Mnk{17, 300, 272},
                      Mnk{64, 255, 64}, Mnk{4096, 1, 16}}) {
    for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
      GemmCase c;
      c.format = f;
      c.m = s.m;
      c.n = s.n;
      c.k = f == WeightFormat::kMxfp4 && s.k % 32 != 0 ? s.k + 16 : s.k;
      c.layout = i % 2 ? WeightLayout::kTransposed : WeightLayout::kRowMajor;
      c.bias = i % 3 == 0;
      c.route = GemmRoute::kE4m3;
      c.activations = Activations::kAllowE4m3;
      ++i;
      run(c);
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_EQ(statistical_checks_, i) << "every case here is large enough for the normalized check";
}

// M = 4096 with small N and K, on every route.
TEST_P(GemmNumerics, LargeMWithSmallNAndK) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  struct Nk {
    std::int64_t n, k;
  };
  constexpr std::array<Nk, 3> nvfp4 = {{{1, 16}, {7, 48}, {65, 16}}};
  constexpr std::array<Nk, 3> mxfp4 = {{{1, 32}, {7, 32}, {63, 32}}};
  const bool has_e4m3 = module_provides(b(), "gemm_e4m3");
  int i = 0;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const Nk nk : f == WeightFormat::kNvfp4 ? nvfp4 : mxfp4) {
      for (const GemmRoute r : {GemmRoute::kAuto, GemmRoute::kDecode, GemmRoute::kTiled,
                                GemmRoute::kE4m3, GemmRoute::kDequant}) {
        if (r == GemmRoute::kE4m3 && !has_e4m3) continue;
        if (r == GemmRoute::kDequant && !has_dequant()) continue;
        GemmCase c;
        c.format = f;
        c.m = 4096;
        c.n = nk.n;
        c.k = nk.k;
        c.layout = i % 2 ? WeightLayout::kTransposed : WeightLayout::kRowMajor;
        c.bias = i % 3 != 0;
        c.route = r;
        c.activations =
            r == GemmRoute::kE4m3 || i % 2 ? Activations::kAllowE4m3 : Activations::kExactBf16;
        ++i;
        const GemmRoute taken = run(c);
        EXPECT_EQ(taken, r == GemmRoute::kAuto ? expected_auto(c.m, c.activations) : r) << c.str();
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Long K at decode sizes, as in the largest Llama-3 layers (K = 14336, 28672), where a row of A
// no longer fits in L1 (kernels that stage or tile A by K may break there): 104 steps of 128,
// an odd count for MX's batches of four, then a scalar tail.
TEST_P(GemmNumerics, LongKAtDecodeSizes) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  int i = 0;
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    for (const std::int64_t m : {1, 2, 3}) {
      GemmCase c;
      c.format = f;
      c.m = m;
      c.n = 33;
      c.k = f == WeightFormat::kNvfp4 ? 13328 : 13344;  // 104 steps of 128, then 16 or 32
      c.layout = i % 3 == 2 ? WeightLayout::kTransposed : WeightLayout::kRowMajor;
      c.bias = i % 2 == 0;
      c.route = GemmRoute::kDecode;
      ++i;
      EXPECT_EQ(run(c), GemmRoute::kDecode) << c.str();
      if (HasFatalFailure()) return;
    }
  }
}

// Activations at and beyond E4M3's ±448 on the e4m3 route: the cast saturates (448, 464 is the
// midpoint to the would-be 480, BF16 values in the thousands), and the result still matches
// the e4m3-aware reference tightly.
TEST_P(GemmNumerics, E4m3RouteSaturatesLargeActivations) {
  skip_without("gemm_e4m3");
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  for (const WeightFormat f : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    const std::int64_t m = 64, n = 65, k = 96;
    const HostQuantWeights row = quantize(f, random_weight_values(gen(), n, k), n, k);
    std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(m * k), -10.0, 11.0);
    for (std::size_t i = 0; i < a.size(); i += 7) {
      constexpr std::array<float, 6> edge = {448.0f, -448.0f, 456.0f, 464.0f, -472.0f, 1.0e4f};
      a[i] = num::f32_to_bf16(edge[(i / 7) % edge.size()]);
    }
    const ops::QuantWeights w = upload_weights(row);
    const DevicePtr dc = poisoned(static_cast<std::size_t>(m * n) * 2);
    ops::w4a16_gemm(b(), stream(), upload(a), m, w, dc,
                    {Activations::kAllowE4m3, GemmRoute::kE4m3, DevicePtr{}});
    const auto out = read<std::uint16_t>(dc, static_cast<std::size_t>(m * n));
    expect_close(compare(out, reference(a, m, row, {}, AMode::kE4m3)), kNormTol,
                 fmt::format("{} saturating e4m3 route", to_string(f)));
    free_all();
  }
}

// Every one of the 256 E4M3 block-scale codes (zero, subnormals, normals, both NaNs, both
// signs) reaches the output as its value: row n of W uses code n for one block, in a different
// position of K per row, and only that block has non-zero codes, so C[:, n] is that scale times
// one block's dot product and each element is checked on its own. Kernels that decode scales in
// vector batches (the CPU decode route, 16 at a time) are covered at every batch position.
TEST_P(GemmNumerics, EveryE4m3BlockScaleCodeOnTheExactRoutes) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::int64_t n = 256, k = 512, groups = k / 16;
  std::uniform_int_distribution<int> nonzero_code(1, 15), any_finite_scale(0, 0x7E);
  HostQuantWeights row;
  row.n = n;
  row.k = k;
  row.tensor_scale = std::uniform_real_distribution<float>(0.5f, 2.0f)(gen());
  row.codes.assign(static_cast<std::size_t>(n * k / 2), 0);  // +0 everywhere but one block
  row.scales.resize(static_cast<std::size_t>(n * groups));
  for (auto& s : row.scales) s = static_cast<std::uint8_t>(any_finite_scale(gen()));
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t g = (r * 7) % groups;
    row.scales[static_cast<std::size_t>(r * groups + g)] = static_cast<std::uint8_t>(r);
    for (std::int64_t c = g * 16; c < g * 16 + 16; c += 2) {
      row.codes[static_cast<std::size_t>((r * k + c) / 2)] =
          static_cast<std::uint8_t>(nonzero_code(gen()) | nonzero_code(gen()) << 4);
    }
  }
  for (const ScaleRun& run : kScaleRuns) {
    if (!runs(run)) continue;
    SCOPED_TRACE(run.str());
    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(run.m * k));
    const auto mn = static_cast<std::size_t>(run.m * n);
    const std::vector<std::uint16_t> out = run_exact(row, run, a);
    const Reference ref = reference(a, run.m, row, {}, AMode::kBf16);
    int nans = 0, zeros = 0;
    for (std::size_t i = 0; i < mn; ++i) {
      const double o = num::bf16_to_f32(out[i]);
      const std::uint8_t code = row.scales[(i % n) * groups + ((i % n) * 7) % groups];
      if (std::isnan(ref.value[i])) {
        ++nans;
        EXPECT_TRUE(std::isnan(o)) << "scale code " << int{code} << ": got " << o;
        continue;
      }
      zeros += ref.value[i] == 0.0;
      EXPECT_LE(std::fabs(o - ref.value[i]), element_bound(ref, i))
          << "scale code " << int{code} << ": got " << o << ", want " << ref.value[i];
    }
    EXPECT_EQ(nans, 2 * run.m) << "0x7F and 0xFF are the E4M3 NaNs";
    EXPECT_GE(zeros, 2 * run.m) << "the ±0 scales give exact zeros";
    free_all();
    if (HasFailure()) return;
  }
}

// The MXFP4 counterpart: every E8M0 scale code reaches the output as 2^(code - 127), 0 as
// 2^-127 and 255 as NaN, at every position of a 16-scale batch. Tensor scale 1, so a kernel's
// FP32 sum is its output before rounding. Where the exact result leaves FP32's normal range the
// check is what FP32 arithmetic can give: below 2^-126 anything within 2^-126 of it (subnormals
// may flush, as vdpbf16ps and the GPU's BF16 arithmetic do), above BF16's largest finite value an
// infinity of the same sign. Codes 250..254 are left out: the float reference's weights
// (up to 6 · 2^127) overflow there.
TEST_P(GemmNumerics, EveryE8m0BlockScaleCodeOnTheExactRoutes) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  constexpr std::int64_t n = 256, k = 1024, groups = k / 32;
  std::uniform_int_distribution<int> nonzero_code(1, 15), moderate_scale(100, 154);
  HostQuantWeights row;
  row.format = WeightFormat::kMxfp4;
  row.n = n;
  row.k = k;
  row.codes.assign(static_cast<std::size_t>(n * k / 2), 0);  // +0 everywhere but one block
  row.scales.resize(static_cast<std::size_t>(n * groups));
  for (auto& s : row.scales) s = static_cast<std::uint8_t>(moderate_scale(gen()));
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t g = (r * 7) % groups;
    row.scales[static_cast<std::size_t>(r * groups + g)] = static_cast<std::uint8_t>(r);
    for (std::int64_t c = g * 32; c < g * 32 + 32; c += 2) {
      row.codes[static_cast<std::size_t>((r * k + c) / 2)] =
          static_cast<std::uint8_t>(nonzero_code(gen()) | nonzero_code(gen()) << 4);
    }
  }
  // Both ends are reached on purpose: code 0's block (g = 0) meets activations below 2^-10, so
  // its result is below 2^-126; code 249's block (g = 15) holds +6 everywhere and meets positive
  // activations of at least 1, so its result is at least 192 · 2^122 > 2^129.
  constexpr std::int64_t kLargest = 249, kLargestGroup = (kLargest * 7) % groups;
  for (std::int64_t c = kLargestGroup * 32; c < kLargestGroup * 32 + 32; c += 2) {
    row.codes[static_cast<std::size_t>((kLargest * k + c) / 2)] = 0x77;
  }
  auto activations = [&](std::int64_t m) {
    std::vector<std::uint16_t> a = random_activations(gen(), static_cast<std::size_t>(m * k));
    for (std::int64_t r = 0; r < m; ++r) {
      const auto small = random_activations(gen(), 32, -16.0, -10.0);
      const auto large = random_activations(gen(), 32, 0.0, 3.0);
      for (std::int64_t c = 0; c < 32; ++c) {
        a[static_cast<std::size_t>(r * k + c)] = small[static_cast<std::size_t>(c)];
        a[static_cast<std::size_t>(r * k + kLargestGroup * 32 + c)] =
            large[static_cast<std::size_t>(c)] & 0x7FFF;  // positive
      }
    }
    return a;
  };
  const double tiny = std::ldexp(1.0, -126), bf16_max = 3.3895313892515355e38;
  for (const ScaleRun& run : kScaleRuns) {
    if (!runs(run)) continue;
    SCOPED_TRACE(run.str());
    const std::vector<std::uint16_t> a = activations(run.m);
    const auto mn = static_cast<std::size_t>(run.m * n);
    const std::vector<std::uint16_t> out = run_exact(row, run, a);
    const Reference ref = reference(a, run.m, row, {}, AMode::kBf16);
    int nans = 0, normal = 0, flushable = 0, overflowed = 0;
    for (std::size_t i = 0; i < mn; ++i) {
      const double o = num::bf16_to_f32(out[i]), want = ref.value[i];
      const auto code = static_cast<int>(i % n);
      if (code == 255) {
        ++nans;
        EXPECT_TRUE(std::isnan(o)) << "scale code 255: got " << o;
      } else if (code >= 250) {
        continue;
      } else if (std::fabs(want) < tiny) {
        ++flushable;
        EXPECT_LE(std::fabs(o - want), tiny) << "scale code " << code << ": got " << o;
      } else if (std::fabs(want) > 1.004 * bf16_max) {
        ++overflowed;
        EXPECT_TRUE(std::isinf(o) && (o > 0) == (want > 0))
            << "scale code " << code << ": got " << o << ", want " << want;
      } else if (std::fabs(want) <= bf16_max) {
        ++normal;
        EXPECT_LE(std::fabs(o - want), element_bound(ref, i))
            << "scale code " << code << ": got " << o << ", want " << want;
      }
    }
    EXPECT_EQ(nans, run.m);
    EXPECT_GE(normal, 200 * run.m) << "most codes give results in FP32's normal range";
    EXPECT_GE(flushable, run.m) << "code 0 (2^-127) gives a result below it";
    EXPECT_GE(overflowed, run.m) << "the largest codes checked overflow BF16";
    free_all();
    if (HasFailure()) return;
  }
}

// Which instruction set the CPU kernels use in this process (METRALE_CPU_ISA lowers it).
TEST(GemmIsa, TheEnvironmentLowersTheInstructionSet) {
  const cpu::w4a16::Isa isa = cpu::w4a16::best_isa();
  const char* env = std::getenv("METRALE_CPU_ISA");
  std::cout << "[ INFO     ] w4a16 CPU kernels use " << cpu::w4a16::to_string(isa)
            << (env ? fmt::format(" (METRALE_CPU_ISA={})", env) : std::string()) << "\n";
  if (env != nullptr && std::string_view(env) == "portable") {
    EXPECT_EQ(isa, cpu::w4a16::Isa::kPortable);
  }
  if (env != nullptr && std::string_view(env) == "avx2") {
    EXPECT_TRUE(isa == cpu::w4a16::Isa::kAvx2 || isa == cpu::w4a16::Isa::kPortable);
  }
  if (env != nullptr && std::string_view(env) == "avx512") {
    EXPECT_NE(isa, cpu::w4a16::Isa::kAvx512Bf16);
  }
}

}  // namespace
}  // namespace metrale::testing::gemm
