// The decode kernels' own sources run on the host: gemm_decode_packed (cuda/kernels/
// decode_packed.cuh) on weights packed by ops::pack_for_decode, and gemm_decode (decode.cuh) on
// the source layouts, every block of the grid with its 256 threads as fibers and the warp MMA
// emulated from the PTX ISA's fragment rules (cuda_host.h), arguments filled as ops/gemm.cpp
// fills them, with and without split-K (then split_reduce.cuh's own code sums the slices). The
// output is checked against a float64 product of the source weights, with C poisoned (an element
// the kernel does not write fails) and a poisoned tail past C and past the workspace that must
// stay as it was. What this reaches that the layout's tests cannot: the kernels' pointer math per
// warp and lane, their register-set rotation, K slices, the partial last K block, M beyond 16,
// the shared-memory sum and the fold.
#include "cuda_host.h"  // first: the CUDA language on the host

// nvcc's warnings are not ours: decode.cuh's warp loop reuses a name (-Wshadow).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#include "cuda/kernels/decode.cuh"
#include "cuda/kernels/decode_packed.cuh"
#include "cuda/kernels/split_reduce.cuh"
#pragma GCC diagnostic pop

#include <gtest/gtest.h>

#include "host_data.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/decode_pack.h"

namespace metrale {
namespace {

namespace emu = metrale::emulation;
using emu::address;
using emu::kPoisonC;
using emu::kPoisonTail;
using emu::kTail;
using emu::random_bf16;
using emu::seeded_rng;

const float kPoisonC32 = std::nanf("0x7FC003");  // FP32 C: an unwritten element fails
constexpr float kPoisonTail32 = -4321.0f;        // past FP32 C: must stay

// Random weights with codes of every value and scale codes of a few binades (NVFP4: E4M3
// 0x28..0x50, about 2^-2..2^3; MXFP4: E8M0 2^-8..2^8, all exact in the decode layout), NaN
// codes left out, and tensor scale 0.375.
HostQuantWeights random_weights(WeightFormat format, std::int64_t n, std::int64_t k,
                                std::mt19937_64& rng) {
  const bool mx = format == WeightFormat::kMxfp4;
  HostQuantWeights w;
  w.format = format;
  w.n = n;
  w.k = k;
  w.codes.resize(static_cast<std::size_t>(n * k / 2));
  w.scales.resize(static_cast<std::size_t>(n * k / (mx ? num::kMxfp4Group : num::kNvfp4Group)));
  std::uniform_int_distribution<int> byte(0, 255), nv(0x28, 0x50), e8(119, 135);
  for (auto& c : w.codes) c = static_cast<std::uint8_t>(byte(rng));
  for (auto& s : w.scales) s = static_cast<std::uint8_t>(mx ? e8(rng) : nv(rng));
  w.tensor_scale = 0.375f;
  return w;
}

// C = A · W^T (+ bias) in float64 from the source weights, and each element's sum of |terms|
// (what FP32 rounding errors scale with).
struct Reference {
  std::vector<double> c, magnitude;
};

Reference reference(const HostQuantWeights& w, const std::vector<std::uint16_t>& a,
                    const std::vector<std::uint16_t>& bias, std::int64_t m) {
  std::vector<double> wd(static_cast<std::size_t>(w.n * w.k));
  for (std::int64_t n = 0; n < w.n; ++n) {
    for (std::int64_t k = 0; k < w.k; ++k) {
      wd[n * w.k + k] = double{num::e2m1_to_f32(w.code(n, k))} * double{w.scale(n, k)};
    }
  }
  Reference r;
  r.c.resize(static_cast<std::size_t>(m * w.n));
  r.magnitude.resize(r.c.size());
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t n = 0; n < w.n; ++n) {
      double sum = bias.empty() ? 0.0 : double{num::bf16_to_f32(bias[n])};
      double mag = std::fabs(sum);
      for (std::int64_t k = 0; k < w.k; ++k) {
        const double t = double{num::bf16_to_f32(a[i * w.k + k])} * wd[n * w.k + k];
        sum += t;
        mag += std::fabs(t);
      }
      r.c[i * w.n + n] = sum;
      r.magnitude[i * w.n + n] = mag;
    }
  }
  return r;
}

struct KernelRun {
  std::string error;             // a fault or deadlock of the emulation
  std::vector<std::uint16_t> c;  // M * N, then kTail poison (BF16 C)
  std::vector<float> c32;        // M * N, then kTail poison (FP32 C: kGemmOutF32)
  std::vector<float> workspace;  // splits * M * N, then kTail poison (split-K only)
  std::int64_t splits = 1;
};

// Weights as a kernel reads them, and the kernel.
struct KernelWeights {
  const std::vector<std::uint8_t>* codes = nullptr;
  const std::vector<std::uint8_t>* scales = nullptr;
  std::int64_t n = 0, k = 0;
  std::uint32_t flags = 0;  // format, layout, packing
  std::int32_t fold = 0;
  float tensor_scale = 1.0f;
  void (*block)(const GemmParams&) = nullptr;  // the kernel's body
};

// gemm_decode_packed on the decode layout.
KernelWeights packed_kernel(const ops::PackedDecodeWeights& pk) {
  const bool mx = pk.format == WeightFormat::kMxfp4;
  return {&pk.codes,
          &pk.scales,
          pk.n,
          pk.k,
          kGemmDecodePacked | (mx ? kGemmMxfp4 : 0u),
          pk.fold,
          pk.tensor_scale,
          [](const GemmParams& p) { kernels::decode_packed_block(p); }};
}

// gemm_decode on the source layout (row-major or transposed).
KernelWeights source_kernel(const HostQuantWeights& w) {
  const std::uint32_t flags = (w.format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u) |
                              (w.layout == WeightLayout::kTransposed ? kGemmTransposed : 0u);
  return {&w.codes, &w.scales, w.n, w.k, flags, 0, w.tensor_scale, [](const GemmParams& p) {
            kernels::decode_block(p);
          }};
}

// What ops/gemm.cpp's plan and launch_planned give the kernel (and gemm_split_reduce) for a
// device of `sm_count` SMs (0: no split), run on the host.
KernelRun run_kernel(const KernelWeights& kw, const std::vector<std::uint16_t>& a,
                     const std::vector<std::uint16_t>& bias, std::int64_t m, int sm_count,
                     bool out_f32 = false) {
  KernelRun run;
  GemmParams p;
  if (out_f32) {
    run.c32.assign(static_cast<std::size_t>(m * kw.n), kPoisonC32);
    run.c32.resize(run.c32.size() + kTail, kPoisonTail32);
    p.out = address(run.c32.data());
  } else {
    run.c.assign(static_cast<std::size_t>(m * kw.n), kPoisonC);
    run.c.resize(run.c.size() + kTail, kPoisonTail);
    p.out = address(run.c.data());
  }
  p.a = address(a.data());
  p.codes = address(kw.codes->data());
  p.scales = address(kw.scales->data());
  p.bias = bias.empty() ? 0 : address(bias.data());
  p.m = m;
  p.n = kw.n;
  p.k = kw.k;
  p.tensor_scale = kw.tensor_scale;
  p.flags = kw.flags | (bias.empty() ? 0u : kGemmBias) | (out_f32 ? kGemmOutF32 : 0u);
  p.weight_fold = kw.fold;
  // The grid from what both entries publish: x over N by <entry>_n_tile (32), z over K slices
  // of <entry>_split_k units (kDecodeSplitUnit) when the N tiles alone leave SMs idle (the
  // plan's 2 blocks an SM, at most 16 slices).
  static_assert(decode_layout::kTileN == tiles::kDecodeNTile);
  dim3 grid(static_cast<unsigned>((kw.n + tiles::kDecodeNTile - 1) / tiles::kDecodeNTile));
  tiles::SplitK split{1, kw.k};
  if (sm_count > 0) {
    split = tiles::plan_split_k(kw.k, tiles::kDecodeSplitUnit, grid.x, 2 * sm_count, 16);
  }
  grid.z = static_cast<unsigned>(split.splits);
  p.splits = split.splits;
  p.k_per_split = split.k_per_split;
  run.splits = split.splits;
  if (split.splits > 1) {
    run.workspace.assign(static_cast<std::size_t>(split.splits * m * kw.n),
                         std::nanf("0x7FC00001"));
    run.workspace.resize(run.workspace.size() + kTail, 12345.0f);
    p.workspace = address(run.workspace.data());
  }
  std::vector<emu::Region> readable = {{a.data(), a.size() * 2},
                                       {kw.codes->data(), kw.codes->size()},
                                       {kw.scales->data(), kw.scales->size()}};
  if (!bias.empty()) readable.push_back({bias.data(), bias.size() * 2});
  run.error = emu::run_grid(grid, tiles::kDecodeThreads, readable, [&p, &kw] { kw.block(p); });
  if (run.error.empty() && split.splits > 1) {
    // gemm_split_reduce's threads, a whole last block of them (those past M x N return).
    const std::int64_t outputs = m * kw.n, threads = 256;
    for (std::int64_t i = 0; i < (outputs + threads - 1) / threads * threads; ++i) {
      kernels::split_reduce(p, i);
    }
  }
  return run;
}

// Every element of C within rounding of the reference (one BF16 rounding, FP32 sums), the
// tails untouched; prints the normalized error.
void expect_matches(const KernelRun& run, const Reference& ref, std::int64_t m, std::int64_t n,
                    const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(run.error, "");
  int bad = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (std::int64_t i = 0; i < m * n; ++i) {
    const double got = num::bf16_to_f32(run.c[i]), want = ref.c[i];
    const double tol = std::ldexp(std::fabs(want), -8) + 1e-4 * ref.magnitude[i] + 1e-30;
    err2 += (got - want) * (got - want);
    ref2 += want * want;
    if (!(std::fabs(got - want) <= tol) && ++bad <= 5) {
      ADD_FAILURE() << "C[" << i / n << ", " << i % n << "] = " << got << ", want " << want
                    << " (tolerance " << tol << ")";
    }
  }
  EXPECT_EQ(bad, 0) << "elements out of tolerance";
  const double normalized = std::sqrt(err2 / ref2);
  std::printf("%s: splits %lld, normalized error %.3g\n", what.c_str(),
              static_cast<long long>(run.splits), normalized);
  EXPECT_LT(normalized, 1.0 / 256);
  for (std::size_t i = static_cast<std::size_t>(m * n); i < run.c.size(); ++i) {
    ASSERT_EQ(run.c[i], kPoisonTail) << "C's tail, element " << i - m * n << ", was written";
  }
  for (std::size_t i = run.workspace.size() - (run.workspace.empty() ? 0 : kTail);
       i < run.workspace.size(); ++i) {
    ASSERT_EQ(run.workspace[i], 12345.0f) << "the workspace's tail was written at " << i;
  }
}

struct Shape {
  WeightFormat format;
  std::int64_t m;
  WeightLayout layout = WeightLayout::kRowMajor;  // gemm_decode's source layout
  std::int64_t k = 0;                             // 0: k_of(format)
};

std::string shape_name(const testing::TestParamInfo<Shape>& info) {
  return std::string(info.param.format == WeightFormat::kMxfp4 ? "Mxfp4" : "Nvfp4") +
         (info.param.layout == WeightLayout::kTransposed ? "Transposed" : "") + "M" +
         std::to_string(info.param.m) +
         (info.param.k != 0 ? "K" + std::to_string(info.param.k) : "");
}

// N = 72: two whole tiles and one of 8 rows. NVFP4 K = 5200 (128 x 40.625; lane 2's last 32 K
// half inside): every warp takes 5 whole K blocks, so the register sets wrap, and warp 0 also
// the partial last one. MXFP4 K = 4160 (128 x 32.5): 4 whole K blocks a warp, the packed
// kernel's loop leaving at its condition.
constexpr std::int64_t kN = 72;
std::int64_t k_of(WeightFormat format) {
  return format == WeightFormat::kMxfp4 ? 4160 : 5200;
}

// One kernel on weights w (kw: as the kernel reads them) for M random rows of A, without and
// with bias, and without split-K and split as planned for an H200 (132 SMs: 6 or 5 slices of
// one K block a warp, the last only the partial block) and for a device of 2 SMs (2 slices: 3 K
// blocks a warp, then the rest from K block 24, ending on the partial one).
void check_kernel(const HostQuantWeights& w, const KernelWeights& kw, std::int64_t m,
                  std::mt19937_64& rng) {
  const std::vector<std::uint16_t> a = random_bf16(static_cast<std::size_t>(m * w.k), rng);
  for (const bool with_bias : {false, true}) {
    const std::vector<std::uint16_t> bias =
        with_bias ? random_bf16(static_cast<std::size_t>(w.n), rng) : std::vector<std::uint16_t>{};
    const Reference ref = reference(w, a, bias, m);
    for (const int sms : {0, 132, 2}) {
      const std::string what =
          "M " + std::to_string(m) + (with_bias ? " bias" : "") +
          (sms == 0 ? ", no split" : ", split for " + std::to_string(sms) + " SMs");
      const KernelRun run = run_kernel(kw, a, bias, m, sms);
      if (sms != 0) {
        EXPECT_GT(run.splits, 1) << what;
      }
      expect_matches(run, ref, m, w.n, what);
    }
  }
}

class DecodePackedOnHost : public testing::TestWithParam<Shape> {};

TEST_P(DecodePackedOnHost, MatchesTheSourceWeightsWithAndWithoutSplitK) {
  const Shape s = GetParam();
  std::mt19937_64 rng = seeded_rng();
  const HostQuantWeights w = random_weights(s.format, kN, k_of(s.format), rng);
  const ops::PackedDecodeWeights pk = ops::pack_for_decode(w);
  check_kernel(w, packed_kernel(pk), s.m, rng);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodePackedOnHost,
    testing::Values(Shape{WeightFormat::kNvfp4, 1}, Shape{WeightFormat::kNvfp4, 5},
                    Shape{WeightFormat::kNvfp4, 8}, Shape{WeightFormat::kNvfp4, 9},
                    Shape{WeightFormat::kNvfp4, 16}, Shape{WeightFormat::kNvfp4, 17},
                    Shape{WeightFormat::kNvfp4, 40}, Shape{WeightFormat::kMxfp4, 1},
                    Shape{WeightFormat::kMxfp4, 5}, Shape{WeightFormat::kMxfp4, 8},
                    Shape{WeightFormat::kMxfp4, 9}, Shape{WeightFormat::kMxfp4, 16},
                    Shape{WeightFormat::kMxfp4, 17}, Shape{WeightFormat::kMxfp4, 40}),
    shape_name);

// gemm_decode, the kernel for weights in their source layout, through the same emulation. Its
// unchecked loads need K a multiple of 32: NVFP4 K = 5184 takes them (5200 does not).
class DecodeOnHost : public testing::TestWithParam<Shape> {};

TEST_P(DecodeOnHost, MatchesTheSourceWeightsWithAndWithoutSplitK) {
  const Shape s = GetParam();
  std::mt19937_64 rng = seeded_rng();
  HostQuantWeights w = random_weights(s.format, kN, s.k != 0 ? s.k : k_of(s.format), rng);
  if (s.layout == WeightLayout::kTransposed) w = with_layout(w, WeightLayout::kTransposed);
  check_kernel(w, source_kernel(w), s.m, rng);
}

constexpr WeightLayout kT = WeightLayout::kTransposed;
INSTANTIATE_TEST_SUITE_P(
    Shapes, DecodeOnHost,
    testing::Values(Shape{WeightFormat::kNvfp4, 1}, Shape{WeightFormat::kNvfp4, 9},
                    Shape{WeightFormat::kNvfp4, 17}, Shape{WeightFormat::kNvfp4, 1, kT},
                    Shape{WeightFormat::kNvfp4, 9, kT},
                    Shape{WeightFormat::kNvfp4, 1, WeightLayout::kRowMajor, 5184},
                    Shape{WeightFormat::kNvfp4, 17, WeightLayout::kRowMajor, 5184},
                    Shape{WeightFormat::kMxfp4, 1}, Shape{WeightFormat::kMxfp4, 9},
                    Shape{WeightFormat::kMxfp4, 17}, Shape{WeightFormat::kMxfp4, 1, kT},
                    Shape{WeightFormat::kMxfp4, 9, kT}),
    shape_name);

// FP32 C (kGemmOutF32, the row-parallel partials): both decode kernels and the split-K sum write
// every element as the FP32 value whose one rounding is the BF16 run's element, bit for bit (the
// same sums, the rounding left out), within FP32 summation error of the float64 product, and
// nothing past C.
void check_out_f32(const HostQuantWeights& w, const KernelWeights& kw, std::int64_t m,
                   std::mt19937_64& rng) {
  const std::vector<std::uint16_t> a = random_bf16(static_cast<std::size_t>(m * w.k), rng);
  const std::vector<std::uint16_t> bias = random_bf16(static_cast<std::size_t>(w.n), rng);
  const Reference ref = reference(w, a, bias, m);
  for (const int sms : {0, 132}) {
    SCOPED_TRACE(sms == 0 ? "no split" : "split for 132 SMs");
    const KernelRun bf16 = run_kernel(kw, a, bias, m, sms);
    const KernelRun f32 = run_kernel(kw, a, bias, m, sms, /*out_f32=*/true);
    ASSERT_EQ(bf16.error, "");
    ASSERT_EQ(f32.error, "");
    EXPECT_EQ(f32.splits, bf16.splits);
    int bad = 0;
    double err2 = 0.0, ref2 = 0.0;
    for (std::int64_t i = 0; i < m * w.n; ++i) {
      const float got = f32.c32[static_cast<std::size_t>(i)];
      const double want = ref.c[static_cast<std::size_t>(i)];
      err2 += (got - want) * (got - want);
      ref2 += want * want;
      const bool same_rounding = num::f32_to_bf16(got) == bf16.c[static_cast<std::size_t>(i)];
      const bool near = std::fabs(got - want) <= 1e-4 * ref.magnitude[i] + 1e-30;
      if (!(same_rounding && near) && ++bad <= 5) {
        ADD_FAILURE() << "C[" << i / w.n << ", " << i % w.n << "] = " << got << " (BF16 run "
                      << num::bf16_to_f32(bf16.c[static_cast<std::size_t>(i)]) << "), want "
                      << want;
      }
    }
    EXPECT_EQ(bad, 0);
    std::printf("FP32 C, M %lld, splits %lld: normalized error %.3g\n", static_cast<long long>(m),
                static_cast<long long>(f32.splits), std::sqrt(err2 / ref2));
    for (std::size_t i = static_cast<std::size_t>(m * w.n); i < f32.c32.size(); ++i) {
      ASSERT_EQ(f32.c32[i], kPoisonTail32) << "FP32 C's tail, element " << i << ", was written";
    }
  }
}

TEST(DecodeOnHostOutF32, BothKernelsWriteTheUnroundedSums) {
  std::mt19937_64 rng = seeded_rng();
  for (const WeightFormat format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
    SCOPED_TRACE(format == WeightFormat::kMxfp4 ? "MXFP4" : "NVFP4");
    const HostQuantWeights w = random_weights(format, kN, k_of(format), rng);
    const ops::PackedDecodeWeights pk = ops::pack_for_decode(w);
    check_out_f32(w, packed_kernel(pk), 9, rng);
  }
  const HostQuantWeights w = random_weights(WeightFormat::kNvfp4, kN, 5184, rng);
  check_out_f32(w, source_kernel(w), 9, rng);
}

// store_pair, the wgmma kernels' epilogue (tiled, E4M3), into FP32 C: the 8-byte pair store where
// a pair is aligned and inside C, one element at a time elsewhere (an odd N, the last column).
TEST(EpilogueOutF32, PairsLandAtTheirColumns) {
  for (const std::int64_t n : {8, 7}) {
    const std::int64_t m = 3;
    std::vector<float> c(static_cast<std::size_t>(m * n) + kTail, kPoisonTail32);
    std::fill_n(c.begin(), m * n, kPoisonC32);
    const std::vector<std::uint16_t> bias = {num::f32_to_bf16(0.5f), num::f32_to_bf16(-1.0f),
                                             num::f32_to_bf16(2.0f), num::f32_to_bf16(0.25f),
                                             num::f32_to_bf16(3.0f), num::f32_to_bf16(-0.5f),
                                             num::f32_to_bf16(1.5f), num::f32_to_bf16(-2.0f)};
    GemmParams p;
    p.out = address(c.data());
    p.bias = address(bias.data());
    p.m = m;
    p.n = n;
    p.tensor_scale = 0.75f;
    p.flags = kGemmOutF32 | kGemmBias;
    // A value per (row, column) that a misplaced or rounded store cannot reproduce.
    const auto value = [](std::int64_t r, std::int64_t col) {
      return 1.0f + static_cast<float>(r) / 3.0f + static_cast<float>(col) / 7.0f;
    };
    for (std::int64_t r = 0; r < m + 1; ++r) {  // row m: outside C, must not be stored
      for (std::int64_t col = 0; col < n + 1; col += 2) {
        kernels::store_pair(p, r, col, value(r, col), value(r, col + 1));
      }
    }
    for (std::int64_t r = 0; r < m; ++r) {
      for (std::int64_t col = 0; col < n; ++col) {
        const float want = value(r, col) * 0.75f + num::bf16_to_f32(bias[col]);
        EXPECT_EQ(c[static_cast<std::size_t>(r * n + col)], want)
            << "N " << n << ", C[" << r << ", " << col << "]";
      }
    }
    for (std::size_t i = static_cast<std::size_t>(m * n); i < c.size(); ++i) {
      ASSERT_EQ(c[i], kPoisonTail32) << "N " << n << ": past C, element " << i;
    }
  }
}

}  // namespace
}  // namespace metrale
