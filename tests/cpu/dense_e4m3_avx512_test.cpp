// The AVX-512 BF16 kernels of the block-scaled FP8 dense GEMM, both variants (arithmetic and
// VBMI widening), called directly (dense_e4m3.h):
// every one of the 256 E4M3 codes, in A and in B, comes out exactly (NaN codes as NaN), and
// random shapes with ragged M (the row tiles), N and K (the 32-K and 128-K tails) land within
// dense_e4m3_test.cpp's per-element bound of a float64 reference, FP32 output poisoned first.
// A variant is skipped where the processor lacks its instructions (the backend then runs the
// other variant or the reference kernel).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "cpu/kernels/dense_e4m3.h"
#include "cpu/kernels/w4a16_cpu.h"
#include "kernels/fp8_panel_layout.h"
#include "metrale/dense_gemm.h"
#include "metrale/numerics.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::rng;

constexpr float kPoison = 1e30f;

using Kernel = void (*)(const DenseParams&, std::int64_t, std::int64_t);

struct Variant {
  const char* name;
  Kernel kernel;
  bool vbmi;
  bool panels = false;    // B in the panel layout (kernels/fp8_panel_layout.h)
  bool portable = false;  // the reference: runs on every processor
};

// Why the processor cannot run v, or "".
std::string missing(const Variant& v) {
  if (v.portable) return "";
  if (cpu::w4a16::best_isa() != cpu::w4a16::Isa::kAvx512Bf16) return "AVX512-BF16";
  if (v.vbmi && !cpu::blas::has_avx512vbmi()) return "AVX512-VBMI";
  return "";
}

void PrintTo(const Variant& v, std::ostream* os) {
  *os << v.name;
}

class CpuDenseE4m3Vector : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (const std::string m = missing(GetParam()); !m.empty()) {
      GTEST_SKIP() << "the processor lacks " << m;
    }
  }
};

INSTANTIATE_TEST_SUITE_P(
    Widening, CpuDenseE4m3Vector,
    ::testing::Values(
        Variant{"Arithmetic", cpu::blas::gemm_e4m3_block128_avx512bf16, false},
        Variant{"Vbmi", cpu::blas::gemm_e4m3_block128_avx512vbmi, true},
        Variant{"PanelsReference", cpu::blas::gemm_e4m3_block128_panels, false, true, true},
        Variant{"PanelsArithmetic", cpu::blas::gemm_e4m3_block128_panels_avx512bf16, false, true},
        Variant{"PanelsVbmi", cpu::blas::gemm_e4m3_block128_panels_avx512vbmi, true, true}),
    [](const auto& p) { return std::string(p.param.name); });

// Host buffers of one GEMM, FP32 C, in dense_gemm.h's scale layouts.
struct Gemm {
  Gemm(std::int64_t m_, std::int64_t n_, std::int64_t k_)
      : m(m_),
        n(n_),
        k(k_),
        a(static_cast<std::size_t>(m * k)),
        b(static_cast<std::size_t>(n * k)),
        sa(static_cast<std::size_t>(dense_scale_blocks(k) * dense_a_scales_ld(m)), 1.0f),
        sb(static_cast<std::size_t>(dense_scale_blocks(n) * dense_b_scales_ld(k)), 1.0f),
        c(static_cast<std::size_t>(m * n), kPoison) {}
  // C in two calls, columns [0, split) and [split, N), as two threads of a launch would make
  // them (split 0: one call). panels: B rearranged first into the panel layout, each code placed
  // where fp8_panels::offset says, the columns past N poisoned with 1.0 (a kernel that reads
  // them and lets them reach C fails the checks).
  void run(Kernel kernel, std::int64_t split = 0, bool panels = false) {
    std::vector<std::uint8_t> laid;
    if (panels) {
      laid.assign(static_cast<std::size_t>(fp8_panels::bytes(n, k)), 0);
      for (std::int64_t j = 0; j < fp8_panels::panels(n) * fp8_panels::kCols; ++j) {
        for (std::int64_t q = 0; q < k; ++q) {
          laid[static_cast<std::size_t>(fp8_panels::offset(j, q, k))] =
              j < n ? b[static_cast<std::size_t>(j * k + q)] : std::uint8_t{0x38};
        }
      }
    }
    DenseParams p;
    p.a = reinterpret_cast<std::uintptr_t>(a.data());
    p.b = reinterpret_cast<std::uintptr_t>(panels ? laid.data() : b.data());
    p.c = reinterpret_cast<std::uintptr_t>(c.data());
    p.a_scales = reinterpret_cast<std::uintptr_t>(sa.data());
    p.b_scales = reinterpret_cast<std::uintptr_t>(sb.data());
    p.m = m, p.n = n, p.k = k;
    p.out_f32 = 1;
    if (split > 0) kernel(p, 0, split);
    kernel(p, split, n);
  }
  float sa_at(std::int64_t kb, std::int64_t row) const {
    return sa[static_cast<std::size_t>(kb * dense_a_scales_ld(m) + row)];
  }
  float sb_at(std::int64_t col, std::int64_t kb) const {
    return sb[static_cast<std::size_t>((col / kDenseScaleBlock) * dense_b_scales_ld(k) + kb)];
  }
  std::int64_t m, n, k;
  std::vector<std::uint8_t> a, b;
  std::vector<float> sa, sb, c;
};

void expect_code(float got, std::uint8_t code, const char* side) {
  const float want = num::e4m3_to_f32(code);
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << side << " code 0x" << std::hex << int{code} << ": " << got;
  } else {
    EXPECT_EQ(got, want) << side << " code 0x" << std::hex << int{code};
  }
}

// K of a shape for v: the panel layout takes K a multiple of 16.
std::int64_t k_for(const Variant& v, std::int64_t k) {
  return v.panels ? (k + 15) / 16 * 16 : k;
}

// Every code on one side (A's rows or B's columns, 256 of them, at k = 0 of K = 1, or of 16 for
// the panels, zero elsewhere) against 1.0 on the `others` rows or columns of the other.
void expect_every_code(const Variant& v, bool in_a, std::int64_t others) {
  constexpr std::uint8_t kOne = 0x38;  // 1.0 in E4M3
  const std::int64_t k = k_for(v, 1);
  Gemm g(in_a ? 256 : others, in_a ? others : 256, k);
  auto& ones = in_a ? g.b : g.a;
  for (std::size_t i = 0; i < ones.size(); i += static_cast<std::size_t>(k)) ones[i] = kOne;
  auto& codes = in_a ? g.a : g.b;
  for (int i = 0; i < 256; ++i)
    codes[static_cast<std::size_t>(i * k)] = static_cast<std::uint8_t>(i);
  g.run(v.kernel, 0, v.panels);
  for (int i = 0; i < 256; ++i) {
    for (std::int64_t o = 0; o < others; ++o) {
      const std::int64_t at = in_a ? i * others + o : o * 256 + i;
      expect_code(g.c[static_cast<std::size_t>(at)], static_cast<std::uint8_t>(i),
                  in_a ? "A" : "B");
    }
  }
}

// B's codes through both paths: one row (the row tile) and 9 (the panels).
TEST_P(CpuDenseE4m3Vector, EveryCodeInAAndBComesOutExactly) {
  expect_every_code(GetParam(), false, 1);
  expect_every_code(GetParam(), false, 9);
  expect_every_code(GetParam(), true, 1);
}

// Each K position meets its own A element, exactly: row r of A is 1.0 at one k only, B's column
// j holds a code of its own at each k (finite, nonzero), so C[r, j] must be that code's value. A
// pair split or a K order of B other than A's fails it, in the panels (M = K rows, row r at
// k = r; K = 128 and a ragged 300) and in the row tiles (M = 8 rows at k spread over K = 300, as
// the first 8 of a lane's 16 are where both orders agree).
void expect_each_position(const Variant& v, std::int64_t m, std::int64_t k) {
  constexpr std::uint8_t kOne = 0x38;
  constexpr std::int64_t kCols = 40;
  Gemm g(m, kCols, k);
  const auto at_k = [&](std::int64_t r) { return m == k ? r : (r * 41 + 9) % k; };
  for (std::int64_t r = 0; r < m; ++r) g.a[static_cast<std::size_t>(r * k + at_k(r))] = kOne;
  const auto code_at = [](std::int64_t j, std::int64_t q) {
    const auto c = static_cast<std::uint8_t>((j + q + 1) % 126);  // 1 .. 125: finite
    return c == 0 ? std::uint8_t{1} : c;
  };
  for (std::int64_t j = 0; j < kCols; ++j) {
    for (std::int64_t q = 0; q < k; ++q) g.b[static_cast<std::size_t>(j * k + q)] = code_at(j, q);
  }
  g.run(v.kernel, 0, v.panels);
  for (std::int64_t r = 0; r < m; ++r) {
    for (std::int64_t j = 0; j < kCols; ++j) {
      ASSERT_EQ(g.c[static_cast<std::size_t>(r * kCols + j)], num::e4m3_to_f32(code_at(j, at_k(r))))
          << "M=" << m << " K=" << k << ": C[" << r << ", " << j << "]";
    }
  }
}

TEST_P(CpuDenseE4m3Vector, EachKPositionMeetsItsOwnA) {
  const std::int64_t ragged = k_for(GetParam(), 300);
  expect_each_position(GetParam(), 128, 128);
  expect_each_position(GetParam(), ragged, ragged);
  expect_each_position(GetParam(), 8, ragged);
}

TEST_P(CpuDenseE4m3Vector, RaggedShapesAreWithinTheBoundOfTheFloat64Reference) {
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> scale(0.25f, 4.0f);
  struct Shape {
    std::int64_t m, n, k;
  };
  for (Shape s : {Shape{1, 1, 1}, Shape{1, 70, 31}, Shape{3, 64, 128}, Shape{8, 9, 129},
                  Shape{9, 130, 300}, Shape{14, 67, 200}, Shape{17, 5, 256}}) {
    s.k = k_for(GetParam(), s.k);
    SCOPED_TRACE(::testing::Message() << "M=" << s.m << " N=" << s.n << " K=" << s.k);
    Gemm g(s.m, s.n, s.k);
    for (auto* v : {&g.a, &g.b}) {
      for (auto& x : *v) {
        do x = static_cast<std::uint8_t>(code(rng()));
        while ((x & 0x7F) == 0x7F);  // no NaN
      }
    }
    for (auto* v : {&g.sa, &g.sb}) {
      for (auto& x : *v) x = scale(rng()) / 448.0f;
    }
    // Split at 3/4 of N: a call whose first column is not on a tile (130: its first 32 columns
    // span two 128-column scale blocks); on a panel's first column for the panel layout.
    g.run(GetParam().kernel, GetParam().panels ? s.n * 3 / 4 / 32 * 32 : s.n * 3 / 4,
          GetParam().panels);
    for (std::int64_t i = 0; i < s.m; ++i) {
      for (std::int64_t j = 0; j < s.n; ++j) {
        double ref = 0, abs_sum = 0;
        for (std::int64_t q = 0; q < s.k; ++q) {
          const double prod =
              static_cast<double>(num::e4m3_to_f32(g.a[static_cast<std::size_t>(i * s.k + q)])) *
              num::e4m3_to_f32(g.b[static_cast<std::size_t>(j * s.k + q)]) *
              g.sa_at(q / kDenseScaleBlock, i) * g.sb_at(j, q / kDenseScaleBlock);
          ref += prod;
          abs_sum += std::fabs(prod);
        }
        // dense_e4m3_test.cpp's bound without the BF16 rounding (C is FP32 here).
        const double n = static_cast<double>(s.k + 2 * dense_scale_blocks(s.k) + 8);
        const double got = g.c[static_cast<std::size_t>(i * s.n + j)];
        ASSERT_NE(got, kPoison) << "C[" << i << ", " << j << "] was not written";
        ASSERT_LE(std::fabs(got - ref), n * std::ldexp(abs_sum, -23))
            << "C[" << i << ", " << j << "] = " << got << ", reference " << ref;
      }
    }
  }
}

// The panel layout places every (column, k) of ragged shapes at its own byte inside the
// layout's size, a pair of a panel in its 64 bytes (a clash or a byte outside fails it).
TEST(Fp8PanelLayout, EveryCodeHasAByteOfItsOwn) {
  for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{1, 16}, {32, 32}, {70, 144}}) {
    std::vector<int> hits(static_cast<std::size_t>(fp8_panels::bytes(n, k)), 0);
    for (std::int64_t j = 0; j < fp8_panels::panels(n) * fp8_panels::kCols; ++j) {
      for (std::int64_t q = 0; q < k; ++q) {
        const std::int64_t at = fp8_panels::offset(j, q, k);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, static_cast<std::int64_t>(hits.size())) << "column " << j << ", k " << q;
        ASSERT_EQ(at / fp8_panels::kPairBytes,
                  (j / fp8_panels::kCols) * (k / 2) + q / 2);  // its panel's pair
        ++hits[static_cast<std::size_t>(at)];
      }
    }
    EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }))
        << "N=" << n << " K=" << k;
  }
}

// Both widenings on Llama-3-8B's gate_proj (14336 x 4096), one thread, in turns (run by hand:
// cpu_tests --gtest_also_run_disabled_tests --gtest_filter=*DISABLED_Times*). docs/PERF.md.
TEST(CpuDenseE4m3Vector, DISABLED_TimesBothWideningsOnGateProj) {
  const Variant arithmetic{"arithmetic", cpu::blas::gemm_e4m3_block128_avx512bf16, false};
  const Variant vbmi{"vbmi", cpu::blas::gemm_e4m3_block128_avx512vbmi, true};
  if (!missing(vbmi).empty()) GTEST_SKIP() << "the processor lacks " << missing(vbmi);
  std::uniform_int_distribution<int> code(0, 126);
  for (const std::int64_t m : {1, 128}) {
    Gemm g(m, 14336, 4096);
    for (auto* v : {&g.a, &g.b}) {
      for (auto& x : *v) x = static_cast<std::uint8_t>(code(rng()));
    }
    for (int rep = 0; rep < 3; ++rep) {
      for (const Variant& v : {arithmetic, vbmi}) {
        const auto t0 = std::chrono::steady_clock::now();
        g.run(v.kernel);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        std::cout << "M=" << m << " " << v.name << ": " << ms << " ms, "
                  << static_cast<double>(g.b.size()) / ms / 1e6 << " GB/s of weights\n";
      }
    }
  }
}

}  // namespace
}  // namespace metrale
