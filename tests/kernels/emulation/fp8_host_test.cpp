// Module "fp8"'s GPU source (cuda/kernels/fp8.cu) run on the host: every block of the grid the
// op plans, its 256 threads as fibers, the warp's shuffle emulated below. Codes and scales are
// poisoned first and must all be written (the scales' padding columns never); each scale must be
// the block's amax / 448 (1 for an all-zero block), each code numerics.h's E4M3 rounding of x /
// scale: the rules of kernels/fp8_cast.h, which the CPU twin (tests/cpu/fp8_cast_test.cpp) is held
// to as well. What this reaches that the CPU test cannot: the kernel's pair and lane indexing, the
// K tail, the warps past the last pair, and the shuffle reduction.
#include "cuda_host.h"  // first: the CUDA language on the host

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

// What fp8.cu uses beyond cuda_host.h: __launch_bounds__ (a hint only) and a warp's XOR
// shuffle (warp_host.h).
#define __launch_bounds__(...)
#include "warp_host.h"

#include "cuda/kernels/fp8.cu"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "support/fp8_reference.h"

namespace metrale {
namespace {

namespace emu = metrale::emulation;

TEST(Fp8CastHost, TheGpuSourceFollowsTheRules) {
  std::mt19937_64 rng(20261201);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-12, 6);
  for (const auto& [m, k] :
       {std::pair<std::int64_t, std::int64_t>{1, 1}, {3, 100}, {2, 128}, {5, 300}, {9, 257}}) {
    SCOPED_TRACE(::testing::Message() << "M=" << m << " K=" << k);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
    for (auto& x : a) x = num::f32_to_bf16(std::ldexp(mant(rng), expo(rng)));
    if (k > 1) std::fill(a.begin(), a.begin() + std::min<std::int64_t>(k, 128), std::uint16_t{0});
    // Scales [ceil(K/128), round_up(M, 4)], the padding poisoned too.
    const std::int64_t kb = (k + 127) / 128, lda = (m + 3) / 4 * 4;
    std::vector<std::uint8_t> codes(a.size(), 0x7F);
    std::vector<float> scales(static_cast<std::size_t>(kb * lda),
                              std::numeric_limits<float>::quiet_NaN());
    const Fp8CastParams p{reinterpret_cast<std::uintptr_t>(a.data()),
                          reinterpret_cast<std::uintptr_t>(codes.data()),
                          reinterpret_cast<std::uintptr_t>(scales.data()), m, k};
    // The grid the op plans: ceil(pairs / n_tile) blocks of the published block size.
    const auto blocks =
        static_cast<unsigned>((m * kb + cast_e4m3_block128_n_tile - 1) / cast_e4m3_block128_n_tile);
    const std::string error =
        emu::run_grid(dim3(blocks), static_cast<int>(cast_e4m3_block128_block_threads),
                      {{a.data(), a.size() * 2}}, [&p] { cast_e4m3_block128(p); });
    ASSERT_EQ(error, "");
    for (std::int64_t b = 0; b < kb; ++b) {
      for (std::int64_t i = m; i < lda; ++i) {
        EXPECT_TRUE(std::isnan(scales[static_cast<std::size_t>(b * lda + i)]))
            << "padding scale [" << b << ", " << i << "] was written";
      }
    }
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t b = 0; b < kb; ++b) {
        float amax = 0.0f;
        for (std::int64_t q = b * 128; q < std::min(k, b * 128 + 128); ++q)
          amax =
              std::max(amax, std::fabs(num::bf16_to_f32(a[static_cast<std::size_t>(i * k + q)])));
        const float s = scales[static_cast<std::size_t>(b * lda + i)];
        ASSERT_EQ(s, amax == 0.0f ? 1.0f : amax / 448.0f) << "scale of row " << i << " block " << b;
        for (std::int64_t q = b * 128; q < std::min(k, b * 128 + 128); ++q) {
          const auto at = static_cast<std::size_t>(i * k + q);
          ASSERT_EQ(codes[at], num::f32_to_e4m3(num::bf16_to_f32(a[at]) / s))
              << "code of A[" << i << ", " << q << "]";
        }
      }
    }
  }
}

// The grouped W8A8 GEMMs' GPU sources run on the host, on E4M3 A cast by fp8_cast.h's rules and
// random E4M3 weights per expert, against the float64 product of those codes (exact: the aware
// reference of tests/ops/grouped_fp8_test.cpp) with its FP32 bound. C is poisoned; rows of no
// expert must stay so. Row 0's last K block holds +inf: its scale is inf and its inf code NaN (the
// cast's rule), so its row of C must be NaN ("never a silently finite number").
namespace f8 = metrale::testing::fp8;

struct GroupedCase {
  std::int64_t n, k;
  std::vector<std::int32_t> counts;
  bool bias, out_f32;
};

// One call's host data, and its argument block pointing into it.
struct GroupedData {
  GroupedCase sh;
  std::int64_t rows = 0, lda = 0;
  std::vector<std::int32_t> offsets{0};
  std::vector<std::uint8_t> a, codes, scales;
  std::vector<float> as;
  std::vector<f8::HostFp8Weights> w;
  std::vector<std::uint16_t> bias;
  std::vector<std::uint8_t> c;
  GroupedFp8Params g;

  std::size_t elem() const { return sh.out_f32 ? 4 : 2; }
  void poison_c() { std::fill(c.begin(), c.end(), std::uint8_t{0xFF}); }
};

GroupedData make_case(const GroupedCase& sh, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-12, 4);
  GroupedData d;
  d.sh = sh;
  const auto experts = static_cast<std::int64_t>(sh.counts.size());
  for (const std::int32_t c : sh.counts) d.offsets.push_back(d.offsets.back() + c);
  d.rows = d.offsets.back() + 1;  // one spare row, of no expert
  const std::int64_t kb = f8::blocks(sh.k), ldw = (kb + 3) / 4 * 4;
  d.lda = (d.rows + 3) / 4 * 4;
  // A: codes and scales by the cast's rules, from BF16-representable values.
  d.a.assign(static_cast<std::size_t>(d.rows * sh.k), 0);
  d.as.assign(static_cast<std::size_t>(kb * d.lda), 0.0f);
  for (std::int64_t i = 0; i < d.rows; ++i) {
    for (std::int64_t b = 0; b < kb; ++b) {
      std::vector<float> x;
      float amax = 0.0f;
      for (std::int64_t q = b * 128; q < std::min(sh.k, b * 128 + 128); ++q) {
        x.push_back(num::bf16_to_f32(num::f32_to_bf16(std::ldexp(mant(rng), expo(rng)))));
        amax = fp8::amax_step(amax, x.back());
      }
      const float s = fp8::block_scale(amax);
      d.as[static_cast<std::size_t>(b * d.lda + i)] = s;
      for (std::size_t j = 0; j < x.size(); ++j)
        d.a[static_cast<std::size_t>(i * sh.k + b * 128) + j] = fp8::encode(x[j], s);
    }
  }
  d.as[static_cast<std::size_t>((kb - 1) * d.lda)] = std::numeric_limits<float>::infinity();
  d.a[static_cast<std::size_t>(sh.k - 1)] = 0x7F;
  // Weights: experts end to end, codes and the device's padded scales.
  const std::size_t codes_stride = static_cast<std::size_t>(sh.n * sh.k + 256) / 256 * 256;
  const std::size_t scales_stride =
      static_cast<std::size_t>(f8::blocks(sh.n) * ldw * 4 + 256) / 256 * 256;
  d.codes.assign(codes_stride * static_cast<std::size_t>(experts), 0);
  d.scales.assign(scales_stride * static_cast<std::size_t>(experts), 0);
  for (std::int64_t e = 0; e < experts; ++e) {
    d.w.push_back(f8::random_weights(sh.n, sh.k, rng));
    std::memcpy(d.codes.data() + e * codes_stride, d.w.back().codes.data(),
                d.w.back().codes.size());
    for (std::int64_t r = 0; r < f8::blocks(sh.n); ++r) {
      std::memcpy(d.scales.data() + e * scales_stride + static_cast<std::size_t>(r * ldw * 4),
                  d.w.back().scales.data() + r * kb, static_cast<std::size_t>(kb * 4));
    }
  }
  d.bias.resize(static_cast<std::size_t>(experts * sh.n));
  for (auto& x : d.bias) x = num::f32_to_bf16(mant(rng));
  // C with a tile's rows of poisoned slack past its end, where a store past an expert's rows
  // would land rather than overrun the heap.
  d.c.assign(static_cast<std::size_t>((d.rows + 128) * sh.n) * d.elem(), 0xFF);
  GroupedFp8Params& g = d.g;
  g.a = reinterpret_cast<std::uintptr_t>(d.a.data());
  g.a_scales = reinterpret_cast<std::uintptr_t>(d.as.data());
  g.b = reinterpret_cast<std::uintptr_t>(d.codes.data());
  g.b_scales = reinterpret_cast<std::uintptr_t>(d.scales.data());
  g.c = reinterpret_cast<std::uintptr_t>(d.c.data());
  g.bias = sh.bias ? reinterpret_cast<std::uintptr_t>(d.bias.data()) : 0;
  g.counts = reinterpret_cast<std::uintptr_t>(d.sh.counts.data());
  g.offsets = reinterpret_cast<std::uintptr_t>(d.offsets.data());
  g.b_stride = codes_stride;
  g.b_scales_stride = scales_stride;
  g.rows = d.rows;
  g.n = sh.n;
  g.k = sh.k;
  g.experts = experts;
  g.out_f32 = sh.out_f32 ? 1 : 0;
  return d;
}

// The buffers a kernel may read (the scales, counts and offsets through __ldg, checked too).
std::vector<emu::Region> readable(const GroupedData& d) {
  return {{d.a.data(), d.a.size()},
          {d.codes.data(), d.codes.size()},
          {d.as.data(), d.as.size() * 4},
          {d.scales.data(), d.scales.size()},
          {d.bias.data(), d.bias.size() * 2},
          {d.sh.counts.data(), d.sh.counts.size() * 4},
          {d.offsets.data(), d.offsets.size() * 4}};
}

// "" or the first element of C that is unwritten, off the float64 reference by more than the
// bound, or written though it belongs to no expert.
std::string mismatch(const GroupedData& d) {
  const GroupedCase& sh = d.sh;
  const double u8 = sh.out_f32 ? 0.0 : std::ldexp(1.0, -8);
  // The products exact, at most K additions, and per 16 (decode kernel) or 128 (tiled) K a
  // product by two scales and one addition.
  const double gamma = static_cast<double>(sh.k + 2 * (sh.k / 16) + 8) * std::ldexp(1.0, -23);
  const auto value = [&d](std::size_t at, bool* written) {
    if (d.sh.out_f32) {
      float f;
      std::memcpy(&f, d.c.data() + at * 4, 4);
      *written = num::f32_bits(f) != 0xFFFFFFFFu;
      return static_cast<double>(f);
    }
    std::uint16_t h;
    std::memcpy(&h, d.c.data() + at * 2, 2);
    *written = h != 0xFFFF;
    return static_cast<double>(num::bf16_to_f32(h));
  };
  for (std::size_t e = 0; e < sh.counts.size(); ++e) {
    for (std::int64_t i = d.offsets[e]; i < d.offsets[e + 1]; ++i) {
      for (std::int64_t j = 0; j < sh.n; ++j) {
        const std::string where = fmt::format("C[{}, {}] of expert {}", i, j, e);
        bool written = false;
        const double got = value(static_cast<std::size_t>(i * sh.n + j), &written);
        if (!written) return where + " was not written";
        if (i == 0) {
          if (!std::isnan(got)) return fmt::format("{} = {}: row 0 holds inf in A", where, got);
          continue;
        }
        double ref =
            sh.bias ? num::bf16_to_f32(
                          d.bias[e * static_cast<std::size_t>(sh.n) + static_cast<std::size_t>(j)])
                    : 0;
        double mag = std::fabs(ref);
        for (std::int64_t q = 0; q < sh.k; ++q) {
          const double x = static_cast<double>(num::e4m3_to_f32(d.a[i * sh.k + q])) *
                           d.as[static_cast<std::size_t>((q / 128) * d.lda + i)];
          ref += x * d.w[e].at(j, q);
          mag += std::fabs(x * d.w[e].at(j, q));
        }
        if (!(std::fabs(got - ref) <= u8 * std::fabs(ref) + (1 + u8) * gamma * mag)) {
          return fmt::format("{} = {}, reference {}", where, got, ref);
        }
      }
    }
  }
  // The spare last row belongs to no expert, and the slack to no row.
  const auto* last = d.c.data() + static_cast<std::size_t>((d.rows - 1) * sh.n) * d.elem();
  if (!std::all_of(last, d.c.data() + d.c.size(), [](std::uint8_t v) { return v == 0xFF; })) {
    return "the row of no expert, or past C's last, was written";
  }
  return "";
}

// The decode kernel (gemm_grouped_e4m3_block128): the grid the op plans (N tiles x experts), 256
// threads per block as fibers. What this reaches that the CPU test cannot: the kernel's lane and
// column indexing, the 2-row passes and their tails, the 4-column warps at N's edge, the 16-code
// widening through FP16, the shuffle reduction, the per-expert strides and an A block holding inf.
TEST(GroupedFp8Host, TheGpuSourceMatchesFloat64) {
  std::mt19937_64 rng(20261206);
  for (const GroupedCase& sh :
       {GroupedCase{72, 272, {3, 0, 5, 1}, true, false}, GroupedCase{30, 1040, {2, 2}, false, true},
        GroupedCase{129, 128, {0, 7, 0}, true, true}}) {
    GroupedData d = make_case(sh, rng);
    SCOPED_TRACE(::testing::Message() << "N=" << sh.n << " K=" << sh.k << " rows=" << d.rows);
    const dim3 grid(static_cast<unsigned>((sh.n + gemm_grouped_e4m3_block128_n_tile - 1) /
                                          gemm_grouped_e4m3_block128_n_tile),
                    static_cast<unsigned>(sh.counts.size()));
    const GroupedFp8Params g = d.g;
    ASSERT_EQ(emu::run_grid(grid, static_cast<int>(gemm_grouped_e4m3_block128_block_threads),
                            readable(d), [&g] { gemm_grouped_e4m3_block128(g); }),
              "");
    EXPECT_EQ(mismatch(d), "");
  }
}

// The tiled kernel (gemm_grouped_e4m3_block128_tiled, grouped_e4m3_sm90.cuh) on a grid of
// `blocks`, under a random schedule of seed `seed` (the cp.async copies land in random order and
// early): "" or the fault, deadlock or first wrong element.
std::string run_tiled(GroupedData& d, unsigned blocks, std::uint64_t seed) {
  d.poison_c();
  emu::set_schedule(seed);
  const GroupedFp8Params g = d.g;
  const std::string error =
      emu::run_grid(dim3(blocks), static_cast<int>(gemm_grouped_e4m3_block128_tiled_block_threads),
                    readable(d), [&g] { gemm_grouped_e4m3_block128_tiled(g); });
  emu::set_schedule(0);
  return error.empty() ? mismatch(d) : error;
}

// The tiled kernel against float64: K of whole and partial 128-blocks (one and nine stages, more
// than the ring holds), N partial in its last tile (its own W scale row) and odd (no paired
// stores), experts of 130 and 300 rows (slots of 128 and their partial tails), empty experts, one
// expert taking every row, bias, FP32 C, and grids of one block walking every tile, of fewer
// blocks than tiles, and of more. Each on two random schedules.
TEST(GroupedFp8Host, TheTiledSourceMatchesFloat64) {
  std::mt19937_64 rng(20261207);
  for (const GroupedCase& sh :
       {GroupedCase{200, 272, {130, 0, 5, 1}, true, false},
        GroupedCase{129, 144, {300}, false, true}, GroupedCase{72, 1040, {2, 0, 0, 3}, true, true},
        GroupedCase{256, 128, {0, 0}, false, false}}) {
    GroupedData d = make_case(sh, rng);
    std::int64_t slots = 0;
    for (const std::int32_t c : sh.counts) slots += (c + 127) / 128;
    const auto tiles = static_cast<unsigned>(slots * ((sh.n + 127) / 128));
    for (const unsigned blocks : {1u, std::max(1u, tiles / 2), tiles + 2}) {
      for (const std::uint64_t seed : {1u, 2u}) {
        SCOPED_TRACE(::testing::Message() << "N=" << sh.n << " K=" << sh.k << " rows=" << d.rows
                                          << " blocks=" << blocks << " seed=" << seed);
        EXPECT_EQ(run_tiled(d, blocks, seed), "");
      }
    }
  }
}

// A caller's own counts and offsets that put experts' rows outside A: expert 1's run past the
// last row, expert 2's start at -1. The tiled kernel skips both (no slots, no loads outside the
// buffers) and runs expert 0.
TEST(GroupedFp8Host, TheTiledSourceSkipsExpertsOutsideTheRows) {
  std::mt19937_64 rng(20261209);
  GroupedData d = make_case(GroupedCase{64, 128, {3, 4, 2}, false, false}, rng);
  ASSERT_EQ(d.rows, 10);
  d.offsets = {0, 7, -1, 9};  // the same buffer: d.g.offsets still points at it
  d.poison_c();
  const GroupedFp8Params g = d.g;
  ASSERT_EQ(emu::run_grid(dim3(4), static_cast<int>(gemm_grouped_e4m3_block128_tiled_block_threads),
                          readable(d), [&g] { gemm_grouped_e4m3_block128_tiled(g); }),
            "");
  for (std::int64_t row = 0; row < d.rows + 128; ++row) {
    const auto* p = d.c.data() + static_cast<std::size_t>(row * 64 * 2);
    const bool untouched = std::all_of(p, p + 64 * 2, [](std::uint8_t v) { return v == 0xFF; });
    EXPECT_EQ(untouched, row >= 3) << "row " << row;
  }
}

// Each fault planted in the tiled kernel or its copies is caught by the same run and check:
// waits that land nothing, operands stored without the swizzle, a block's first MMA adding to the
// last block's sums, expert 0's W scales for every expert, stores past an expert's rows, and the
// copies read by wgmma with no fence.proxy.async after them.
TEST(GroupedFp8Host, PlantedFaultsInTheTiledSourceAreCaught) {
  std::mt19937_64 rng(20261208);
  GroupedData d = make_case(GroupedCase{200, 272, {130, 0, 5, 1}, true, false}, rng);
  for (const emu::Plant plant :
       {emu::Plant::kNoAsyncWait, emu::Plant::kWrongSwizzle, emu::Plant::kPartNotReset,
        emu::Plant::kExpertZeroTable, emu::Plant::kNoExpertRowBound, emu::Plant::kNoProxyFence}) {
    SCOPED_TRACE(static_cast<int>(plant));
    emu::set_plant(plant);
    const std::string caught = run_tiled(d, 3, 1);
    emu::set_plant(emu::Plant::kNone);
    EXPECT_NE(caught, "") << "a planted fault went unnoticed";
    std::printf("  planted fault %d: %s\n", static_cast<int>(plant), caught.c_str());
  }
  EXPECT_EQ(run_tiled(d, 3, 1), "") << "the unplanted kernel fails";
}

}  // namespace
}  // namespace metrale
