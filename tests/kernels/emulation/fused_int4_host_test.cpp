// gemm_grouped_int4_fused on the host as the GPU runs it (cuda/kernels/fused_sm90.cuh with its
// FusedInt4 consumers, compiled unchanged), under fused_host_test.cpp's emulation: the block's
// three warpgroups as fibers, mbarriers, bulk copies landing late and in any order, wgmma RS from
// the PTX ISA's fragment rules, every shared access checked for bank conflicts. INT4 experts made
// by the library's own quantizer (quantize_int4) and packed by ops::pack_int4_for_decode, for each
// side shape (groups of 32 and 64: an entry per 32-K span; 128 and more: one a K block) and scale
// format (BF16, FP16), with and without zero points. C, poisoned first, is compared with a float64
// product of A and the weights the dequant route makes, bf16((q - z) x scale)
// (kernels/dequant_int4.h): the kernel rounds each weight once, to that value, so the bound holds
// only the sums' FP32 error and C's rounding, and a weight off by its scale's low bits fails.
#include "cuda_host.h"  // first: the CUDA language on the host

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
// decode_packed.cuh defines decode_packed_block out of line, and decode_host_test.cpp's copy is
// the one this program links: this translation unit's copy takes another name.
#define decode_packed_block fused_int4_host_test_decode_packed_block
#include "cuda/kernels/fused_sm90.cuh"
#undef decode_packed_block
#pragma GCC diagnostic pop

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "fused_host_run.h"
#include "host_data.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "kernels/int4_decode_layout.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/int4_pack.h"

namespace metrale {
namespace {

namespace fu = metrale::fused;
namespace emu = metrale::emulation;
using fused_host::expect_caught;
using fused_host::expect_good;
using fused_host::Outcome;
using fused_host::run_blocks;
using fused_host::stride_of;

// Expert e has counts[e] rows, experts one after another from row 0; `rows` is A's and C's
// capacity (rows of no expert left as they were).
struct Case {
  std::int64_t group = 128;
  bool zero_points = true, fp16 = false;
  std::int64_t n = 0, k = 0, rows = 0;
  std::vector<int> counts;
  bool bias = false, f32 = false;
  unsigned grid = 1;
  std::uint64_t seed = 1;  // the schedule's (the data are drawn fresh, their seed printed)
  // Every scale drawn from edge values instead (subnormal, zero and negative ones; FP16 or BF16)
  // and every zero point from 0..15, written into the packed side bytes.
  bool edge_scales = false;
};

std::string name(const Case& c) {
  std::string counts;
  for (const int x : c.counts) counts += " " + std::to_string(x);
  return "group " + std::to_string(c.group) + (c.fp16 ? " FP16" : " BF16") +
         (c.zero_points ? " zero points" : " symmetric") + " N=" + std::to_string(c.n) +
         " K=" + std::to_string(c.k) + " rows=" + std::to_string(c.rows) + " counts" + counts +
         (c.bias ? " bias" : "") + (c.f32 ? " FP32 C" : "") + " grid=" + std::to_string(c.grid) +
         " seed=" + std::to_string(c.seed);
}

// Random INT4 weights: uniform floats with rows of growing size (scales differ by row and group),
// quantized by the library's quantizer, so every code and zero point occurs.
HostQuantWeights random_int4(const Case& c, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(c.n * c.k));
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = u(rng) * (1.0f + static_cast<float>(i / 64) / 64.0f);
  return quantize_int4(w, c.n, c.k, c.group, c.zero_points, c.fp16);
}

Outcome run(const Case& c, emu::Plant plant = emu::Plant::kNone) {
  std::mt19937_64 rng = emu::seeded_rng();
  const auto experts = static_cast<int>(c.counts.size());
  std::vector<ops::PackedInt4Weights> pk;
  for (int e = 0; e < experts; ++e) pk.push_back(ops::pack_int4_for_decode(random_int4(c, rng)));
  if (c.edge_scales) {
    constexpr std::uint16_t kF16[] = {0x0001, 0x03FF, 0x8201, 0x0000, 0x8000, 0x0401,
                                      0xB3FF, 0x2BFF, 0x07FF, 0x8155, 0x3C01};
    constexpr std::uint16_t kBf16[] = {0x0001, 0x807F, 0x0000, 0x8000,
                                       0x3F81, 0xBFFF, 0x0080, 0x3E2B};
    std::uniform_int_distribution<std::size_t> f16(0, std::size(kF16) - 1),
        bf16(0, std::size(kBf16) - 1);
    std::uniform_int_distribution<int> zero(0, 15);
    for (auto& p : pk) {
      for (std::int64_t j = 0; j < c.n; ++j) {
        for (std::int64_t kk = 0; kk < c.k; kk += 32) {
          const auto at = int4_decode::side_slot(j, kk, (c.k + 127) / 128, c.group);
          const std::uint16_t v = c.fp16 ? kF16[f16(rng)] : kBf16[bf16(rng)];
          std::memcpy(p.side.data() + at.scale, &v, 2);
          if (c.zero_points)
            p.side[static_cast<std::size_t>(at.zero)] = static_cast<std::uint8_t>(zero(rng));
        }
      }
    }
  }
  const std::size_t cs = stride_of(pk[0].codes.size()), ss = stride_of(pk[0].side.size());
  std::vector<std::uint8_t> codes(cs * experts), side(ss * experts);
  fused_host::GroupedCall call(c.rows, c.n, c.k, c.counts, {}, c.bias, c.f32, rng);
  for (int e = 0; e < experts; ++e) {
    std::copy(pk[e].codes.begin(), pk[e].codes.end(), codes.begin() + static_cast<long>(cs * e));
    std::copy(pk[e].side.begin(), pk[e].side.end(), side.begin() + static_cast<long>(ss * e));
    call.set_expert(static_cast<std::size_t>(e), 1.0f, 0);  // INT4: no tensor scale, no fold
  }
  call.g.gemm.group = c.group;
  call.g.gemm.flags |=
      kGemmInt4 | (c.fp16 ? kGemmFp16Scales : 0u) | (c.zero_points ? kGemmZeroPoints : 0u);
  Outcome o = call.run(c.grid, c.seed, plant, codes, cs, side, ss, [](const GroupedGemmParams& g) {
    kernels::fused_block_on<true>(g, emu::shared_memory());
  });

  // Each expert's weights as the dequant route makes them.
  std::vector<std::vector<double>> w(static_cast<std::size_t>(experts));
  for (int e = 0; e < experts; ++e) {
    auto& we = w[static_cast<std::size_t>(e)];
    we.resize(static_cast<std::size_t>(c.n * c.k));
    for (std::int64_t j = 0; j < c.n; ++j) {
      for (std::int64_t kk = 0; kk < c.k; ++kk) {
        const float exact = ops::packed_int4_weight(pk[static_cast<std::size_t>(e)], j, kk);
        we[static_cast<std::size_t>(j * c.k + kk)] = num::bf16_to_f32(num::f32_to_bf16(exact));
      }
    }
  }
  const std::vector<int> owner = call.owners();
  double err2 = 0.0, ref2 = 0.0;
  for (std::int64_t i = 0; i < c.rows; ++i) {
    const int e = owner[static_cast<std::size_t>(i)];
    for (std::int64_t j = 0; j < c.n; ++j) {
      if (e < 0) {  // rows of no expert: left as they were
        fused_host::expect_kept(call, i, j, o);
        continue;
      }
      const auto& we = w[static_cast<std::size_t>(e)];
      double sum = 0.0, mag = 0.0;
      for (std::int64_t kk = 0; kk < c.k; ++kk) {
        const double t = double{num::bf16_to_f32(call.a[static_cast<std::size_t>(i * c.k + kk)])} *
                         we[static_cast<std::size_t>(j * c.k + kk)];
        sum += t;
        mag += std::fabs(t);
      }
      if (c.bias) sum += double{num::bf16_to_f32(call.bias[static_cast<std::size_t>(e * c.n + j)])};
      const double got = call.c(i, j);
      // C's one rounding (BF16: 2^-8 relative; FP32: 2^-24, and the bias's addition), and FP32
      // sums of K products, each under K 2^-24 of the magnitudes.
      const double tol = std::ldexp(std::fabs(sum), c.f32 ? -23 : -8) +
                         std::ldexp(mag, -24) * static_cast<double>(c.k + 2) + 1e-30;
      err2 += (got - sum) * (got - sum);
      ref2 += sum * sum;
      if (!(std::fabs(got - sum) <= tol) && ++o.bad <= 3) {
        o.first_bad += " C[" + std::to_string(i) + ", " + std::to_string(j) +
                       "] = " + std::to_string(got) + " (want " + std::to_string(sum) + ")";
      }
    }
  }
  o.rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  return o;
}

void expect_right(const Case& c) {
  SCOPED_TRACE(name(c));
  expect_good(run(c));
}

// Both side shapes by both scale formats, with and without zero points; experts of 0, 1, 128
// (a whole slot), 130 (a whole and a partial) and 40 rows and spare rows past them; N partial
// (200: a last tile of 3 decode tiles; 100: C rows not 16-byte aligned) and K with a partial last
// K block (320 = 2 x 128 + 64: the activations' loads past K read zero).
TEST(GroupedFusedInt4Pipeline, EverySideShapeAndScaleFormatMatchesFloat64) {
  expect_right({32, true, false, 256, 256, 330, {0, 1, 128, 130, 40}, true, false, 2, 1});
  expect_right({64, false, true, 200, 320, 300, {37, 0, 130, 0, 120}, false, true, 3, 2});
  expect_right({128, true, true, 100, 384, 200, {60, 17, 33, 50}, true, true, 2, 3});
  expect_right({256, false, false, 128, 256, 180, {70, 9, 60}, false, false, 1, 4});
}

// One expert taking every row among empty ones, on one block walking many one-stage tiles
// (K = 128: the producer runs ahead of the ring of tiles), and a schedule of its own.
TEST(GroupedFusedInt4Pipeline, OneExpertTakingAllRowsAndLongWalksMatchFloat64) {
  std::vector<int> counts(9, 0);
  counts[6] = 300;
  expect_right({32, true, true, 256, 128, 300, counts, false, false, 1, 5});
  expect_right({128, true, false, 256, 128, 1100, {300, 0, 500, 1, 128, 150}, true, false, 1, 7});
}

// Scales at the edges of their formats: FP16 subnormal, zero, negative and with all 11 bits set,
// BF16 subnormal, zero and negative; zero points anywhere in 0..15. Each weight is still the
// dequant route's one rounding.
TEST(GroupedFusedInt4Pipeline, EdgeScalesMatchFloat64) {
  for (const bool fp16 : {true, false}) {
    Case c{32, true, fp16, 256, 256, 330, {0, 1, 128, 130, 40}, true, true, 2, 1};
    c.edge_scales = true;
    expect_right(c);
    c = Case{128, true, fp16, 100, 384, 200, {60, 17, 33, 50}, false, true, 2, 3};
    c.edge_scales = true;
    expect_right(c);
  }
}

TEST(GroupedFusedInt4Pipeline, ResultsHoldUnderOtherSchedules) {
  for (std::uint64_t seed = 11; seed < 13; ++seed) {
    expect_right({64, true, true, 128, 256, 200, {70, 0, 130}, false, true, 2, seed});
  }
}

// Each planted fault must fail: the INT4 consumers' own (every 32-K span given entry 0's scale
// and zero point; an FP16 scale rounded to BF16 before its product, two roundings) and the grouped
// pipeline's (expert 0's side bytes for every expert; activations stored unswizzled).
TEST(GroupedFusedInt4Pipeline, PlantedFaultsFail) {
  const struct {
    emu::Plant plant;
    const char* what;
    std::int64_t group;
  } plants[] = {{emu::Plant::kInt4FirstEntry, "entry 0's scale for every 32-K span", 32},
                {emu::Plant::kInt4ScaleRounded, "an FP16 scale rounded to BF16 first", 128},
                {emu::Plant::kExpertZeroTable, "expert 0's scales for every expert", 64},
                {emu::Plant::kWrongSwizzle, "activations stored unswizzled", 128}};
  for (const auto& p : plants) {
    expect_caught(
        [&p](std::uint64_t seed) {
          return run({p.group, true, true, 128, 256, 300, {70, 0, 130, 60}, false, true, 1, seed},
                     p.plant);
        },
        p.what);
  }
}

}  // namespace
}  // namespace metrale
