// gemm_fused on the host as the GPU runs it (cuda/kernels/fused_sm90.cuh, compiled unchanged): a
// grid of blocks, each block's producer and two consumer warpgroups as 384 fibers under a seeded
// random schedule, the mbarriers with their phases and transaction counts, the bulk copies
// landing later and in random order, wgmma RS m64n128k16 from the PTX ISA's fragment rules
// reading its registers and shared memory only when waited for, named barriers, and every
// shared-memory access of the kernel (but the scale-table lookups, whose addresses are data)
// checked for bank conflicts (sm90_host.h). C, poisoned first, is compared with a float64
// product of the source weights; each consumer warpgroup's wgmma groups must be committed in
// turns. Faults planted in the kernel (METRALE_FUSED_PLANTED) must each fail one of these checks.
#include "cuda_host.h"  // first: the CUDA language on the host

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
// decode_packed.cuh defines decode_packed_block out of line, and decode_host_test.cpp's copy is
// the one this program links: this translation unit's copy takes another name.
#define decode_packed_block fused_host_test_decode_packed_block
#include "cuda/kernels/fused_sm90.cuh"
#undef decode_packed_block
#pragma GCC diagnostic pop

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fused_host_run.h"
#include "host_data.h"
#include "kernels/decode_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/decode_pack.h"

namespace metrale {
namespace {

namespace dl = metrale::decode_layout;
namespace fu = metrale::fused;
namespace emu = metrale::emulation;
using fused_host::expect_caught;
using fused_host::expect_good;
using fused_host::Outcome;
using fused_host::run_blocks;
using fused_host::stride_of;

using fused_host::kPoisonBf16;
using fused_host::kPoisonF32;

struct Case {
  bool mx = false;
  std::int64_t m = 0, n = 0, k = 0;
  bool bias = false, f32 = false;
  unsigned grid = 1;       // blocks: fewer than the tiles makes a block run several
  std::uint64_t seed = 1;  // the schedule's and the data's
};

std::string name(const Case& c) {
  return std::string(c.mx ? "MXFP4" : "NVFP4") + " M=" + std::to_string(c.m) +
         " N=" + std::to_string(c.n) + " K=" + std::to_string(c.k) + (c.bias ? " bias" : "") +
         (c.f32 ? " FP32 C" : "") + " grid=" + std::to_string(c.grid) +
         " seed=" + std::to_string(c.seed);
}

// Random weights; MXFP4's scale codes `shift` above the usual range (experts of other folds).
HostQuantWeights random_weights(bool mx, std::int64_t n, std::int64_t k, std::mt19937_64& rng,
                                int shift = 0) {
  HostQuantWeights w;
  w.format = mx ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
  w.n = n;
  w.k = k;
  w.codes.resize(static_cast<std::size_t>(n * k / 2));
  w.scales.resize(static_cast<std::size_t>(n * k / (mx ? num::kMxfp4Group : num::kNvfp4Group)));
  std::uniform_int_distribution<int> byte(0, 255), nv(0x28, 0x50), e8(119 + shift, 135 + shift);
  for (auto& c : w.codes) c = static_cast<std::uint8_t>(byte(rng));
  for (auto& s : w.scales) s = static_cast<std::uint8_t>(mx ? e8(rng) : nv(rng));
  w.tensor_scale = 0.375f;
  return w;
}

// C[i, j] (`got`) against the float64 product of A's row `a_row` and W's row j, plus bias[j]
// where there is a bias, into o: out of the bound counts as bad; err2 and ref2 sum the squares.
void compare(double got, const std::uint16_t* a_row, const HostQuantWeights& w, std::int64_t j,
             const std::uint16_t* bias, bool f32, std::int64_t i, Outcome& o, double& err2,
             double& ref2) {
  double sum = 0.0, mag = 0.0;
  for (std::int64_t kk = 0; kk < w.k; ++kk) {
    const double t = double{num::bf16_to_f32(a_row[kk])} * double{num::e2m1_to_f32(w.code(j, kk))} *
                     double{w.scale(j, kk)};  // the block scale times the tensor scale
    sum += t;
    mag += std::fabs(t);
  }
  if (bias != nullptr) sum += double{num::bf16_to_f32(bias[j])};
  // C's one rounding (BF16: 2^-9 relative; FP32: 2^-24) and FP32 sums of K products, each
  // term's error under K 2^-24 of the magnitudes (K <= 1024 here: under 1e-4).
  const double tol = std::ldexp(std::fabs(sum), f32 ? -23 : -8) + 1e-4 * mag + 1e-30;
  err2 += (got - sum) * (got - sum);
  ref2 += sum * sum;
  if (!(std::fabs(got - sum) <= tol) && ++o.bad <= 3) {
    o.first_bad += " C[" + std::to_string(i) + ", " + std::to_string(j) +
                   "] = " + std::to_string(got) + " (want " + std::to_string(sum) + ")";
  }
}

Outcome run(const Case& c, emu::Plant plant = emu::Plant::kNone) {
  std::mt19937_64 rng(c.seed * 7919 + static_cast<std::uint64_t>(c.m + c.n + c.k));
  const HostQuantWeights w = random_weights(c.mx, c.n, c.k, rng);
  const ops::PackedDecodeWeights pk = ops::pack_for_decode(w);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(c.m * c.k)), bias;
  for (auto& x : a) x = num::f32_to_bf16(u(rng));
  if (c.bias) {
    bias.resize(static_cast<std::size_t>(c.n));
    for (auto& x : bias) x = num::f32_to_bf16(u(rng));
  }
  std::vector<std::uint32_t> out32;
  std::vector<std::uint16_t> out16;
  if (c.f32) {
    out32.assign(static_cast<std::size_t>(c.m * c.n), kPoisonF32);
  } else {
    out16.assign(static_cast<std::size_t>(c.m * c.n), kPoisonBf16);
  }
  const auto address = [](const void* p) {
    return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
  };
  GemmParams p;
  p.m = c.m;
  p.n = c.n;
  p.k = c.k;
  p.a = address(a.data());
  p.codes = address(pk.codes.data());
  p.scales = address(pk.scales.data());
  p.tensor_scale = pk.tensor_scale;
  p.weight_fold = pk.fold;
  p.flags = kGemmDecodePacked | (c.mx ? kGemmMxfp4 : 0u) | (c.bias ? kGemmBias : 0u) |
            (c.f32 ? kGemmOutF32 : 0u);
  p.bias = c.bias ? address(bias.data()) : 0;
  p.out = c.f32 ? address(out32.data()) : address(out16.data());

  Outcome o;
  run_blocks(
      c.grid, c.seed, plant,
      {{a.data(), a.size() * 2},
       {pk.codes.data(), pk.codes.size()},
       {pk.scales.data(), pk.scales.size()},
       {bias.data(), bias.size() * 2}},
      [&p] { kernels::fused_block_on(p, emu::shared_memory()); }, o);

  double err2 = 0.0, ref2 = 0.0;
  for (std::int64_t i = 0; i < c.m; ++i) {
    for (std::int64_t j = 0; j < c.n; ++j) {
      const auto at = static_cast<std::size_t>(i * c.n + j);
      const double got = c.f32 ? double{num::bits_f32(out32[at])} : num::bf16_to_f32(out16[at]);
      compare(got, &a[static_cast<std::size_t>(i * c.k)], w, j, c.bias ? &bias[0] : nullptr, c.f32,
              i, o, err2, ref2);
    }
  }
  o.rel = std::sqrt(err2 / ref2);
  return o;
}

void expect_right(const Case& c) {
  SCOPED_TRACE(name(c));
  expect_good(run(c));
}

// Whole tiles, one per block; the ring of 4 stages wraps (6 K blocks).
TEST(FusedPipeline, WholeTilesMatchFloat64) {
  expect_right({false, 256, 256, 768, true, false, 4, 1});
  expect_right({true, 128, 128, 768, false, false, 1, 2});
}

// Partial M, N and K tiles (N = 200: a tile of 3 decode tiles; K = 416: a last K block of 32),
// 6 tiles on 2 persistent blocks, FP32 C in two passes of the staging.
TEST(FusedPipeline, PartialTilesOnPersistentBlocksMatchFloat64) {
  expect_right({true, 300, 200, 416, true, true, 2, 3});
  expect_right({false, 300, 200, 416, false, false, 2, 4});
}

// N = 100: C rows not 16-byte aligned, the epilogue's element stores; a grid with more blocks
// than tiles (the extra ones run nothing).
TEST(FusedPipeline, UnalignedRowsAndIdleBlocksMatchFloat64) {
  expect_right({false, 37, 100, 256, true, false, 3, 5});
  expect_right({true, 37, 100, 256, false, true, 1, 6});
}

// Other schedules of the same grid: what the threads and copies interleave must not matter.
TEST(FusedPipeline, ResultsHoldUnderOtherSchedules) {
  for (std::uint64_t seed = 11; seed < 14; ++seed) {
    expect_right({false, 200, 128, 640, true, false, 1, seed});
  }
}

// The bank check itself, on the placements gemm_fused had before issue 35 and on today's: the
// producer's 16-byte stores with both halves' steps at the same columns (2-way in every phase),
// the consumers' 4-byte loads of their own decode-layout words (lanes 16 bytes apart: 4-way);
// today's stores and 16-byte chunk loads: none.
emu::BankReport banks_of(const std::function<void(int)>& access) {
  emu::reset_bank_report();
  const std::string error = emu::run_grid(dim3(1), 128, {}, [&access] { access(threadIdx.x); });
  EXPECT_EQ(error, "");
  return emu::bank_report();
}

TEST(FusedBanks, TheCheckFindsTheOldPlacementsConflictsAndNoneToday) {
  const std::uint32_t base = emu::kSharedBase;
  const auto old_store = [base](int wtid) {
    const int token = wtid / 4, u = wtid % 4;
    for (int d = 0; d < 4; ++d) {
      const int step = 2 * u + d / 2, pair = d % 2;
      const std::uint32_t off =
          static_cast<std::uint32_t>((step / 4) * fu::kActHalfBytes) +
          tiles::swizzle128(static_cast<std::uint32_t>(token),
                            static_cast<std::uint32_t>(2 * (16 * (step % 4) + 8 * pair)));
      ptx::st_shared16(base + off, uint4{});
    }
  };
  const auto new_store = [base](int wtid) {
    for (int d = 0; d < 4; ++d) {
      ptx::st_shared16(base + fu::fused_act_chunk_offset(wtid / 4, wtid % 4, d), uint4{});
    }
  };
  const auto old_load = [base](int wtid) {
    for (int step = 0; step < fu::kSteps; ++step) {
      (void)ptx::ld_shared4(base + fu::kCodeOffset + fu::fused_word_byte(0, wtid, step));
    }
  };
  const auto new_load = [base](int wtid) {
    for (int q = 0; q < fu::kSteps / 2; ++q) {
      (void)ptx::ld_shared16(base + fu::kCodeOffset + fu::fused_chunk_byte(0, wtid, q));
    }
  };
  const emu::BankReport os = banks_of(old_store), ns = banks_of(new_store), ol = banks_of(old_load),
                        nl = banks_of(new_load);
  EXPECT_EQ(os.conflicted, os.instructions) << "the old producer stores";
  EXPECT_NE(os.first.find("2-way"), std::string::npos) << os.first;
  EXPECT_EQ(ns.conflicted, 0) << ns.first;
  EXPECT_EQ(ol.conflicted, ol.instructions) << "the old consumer word loads";
  EXPECT_NE(ol.first.find("4-way"), std::string::npos) << ol.first;
  EXPECT_EQ(nl.conflicted, 0) << nl.first;
  EXPECT_EQ(ns.instructions, 16);  // 4 warps x 4 stores
  EXPECT_EQ(nl.instructions, 16);  // 4 warps x 4 loads
}

void expect_caught(emu::Plant plant, const char* what) {
  expect_caught(
      [plant](std::uint64_t seed) {
        return run(Case{false, 160, 256, 768, true, false, 2, seed}, plant);
      },
      what);
}

TEST(FusedPipeline, PlantedFaultsFail) {
  expect_caught(emu::Plant::kWrongParity, "a wrong full-barrier parity");
  expect_caught(emu::Plant::kEarlyRelease, "a stage released before its wgmmas retired");
  expect_caught(emu::Plant::kSkipExpectTx, "a skipped expect_tx");
  expect_caught(emu::Plant::kWrongSwizzle, "activations stored unswizzled");
  expect_caught(emu::Plant::kDropPartialTile, "the partial M tile dropped");
  expect_caught(emu::Plant::kNoTurns, "consumers issuing without turns");
}

// ---- gemm_grouped_fused: the same pipeline over the experts of a layer ----

// A grouped case: expert e has counts[e] rows from offsets[e] (an offset of -1: right after the
// previous expert's rows); `rows` is A's and C's capacity, rows of no expert left as they were.
struct GroupedCase {
  bool mx = false;
  std::int64_t n = 0, k = 0, rows = 0;
  std::vector<int> counts, offsets;
  bool bias = false, f32 = false;
  unsigned grid = 1;
  std::uint64_t seed = 1;  // the schedule's (the data are drawn fresh, seed printed)
};

std::string name(const GroupedCase& c) {
  std::string counts;
  for (const int x : c.counts) counts += " " + std::to_string(x);
  return std::string(c.mx ? "MXFP4" : "NVFP4") + " N=" + std::to_string(c.n) +
         " K=" + std::to_string(c.k) + " rows=" + std::to_string(c.rows) + " counts" + counts +
         (c.bias ? " bias" : "") + (c.f32 ? " FP32 C" : "") + " grid=" + std::to_string(c.grid) +
         " seed=" + std::to_string(c.seed);
}

Outcome run_grouped(const GroupedCase& c, emu::Plant plant = emu::Plant::kNone) {
  std::mt19937_64 rng = emu::seeded_rng();
  const auto experts = static_cast<int>(c.counts.size());
  std::vector<HostQuantWeights> w;
  std::vector<ops::PackedDecodeWeights> pk;
  for (int e = 0; e < experts; ++e) {
    // MXFP4 experts of different largest scales, so of different folds and tables.
    w.push_back(random_weights(c.mx, c.n, c.k, rng, c.mx ? 3 * (e % 4) : 0));
    w.back().tensor_scale = 0.25f + 0.125f * static_cast<float>(e % 5);
    pk.push_back(ops::pack_for_decode(w.back()));
  }
  const std::size_t cs = stride_of(pk[0].codes.size()), ss = stride_of(pk[0].scales.size());
  std::vector<std::uint8_t> codes(cs * experts), scales(ss * experts);
  fused_host::GroupedCall call(c.rows, c.n, c.k, c.counts, c.offsets, c.bias, c.f32, rng);
  for (int e = 0; e < experts; ++e) {
    std::copy(pk[e].codes.begin(), pk[e].codes.end(), codes.begin() + static_cast<long>(cs * e));
    std::copy(pk[e].scales.begin(), pk[e].scales.end(), scales.begin() + static_cast<long>(ss * e));
    call.set_expert(static_cast<std::size_t>(e), pk[e].tensor_scale, pk[e].fold);
  }
  if (c.mx) call.g.gemm.flags |= kGemmMxfp4;
  Outcome o = call.run(
      c.grid, c.seed, plant, codes, cs, scales, ss,
      [](const GroupedGemmParams& g) { kernels::fused_block_on(g, emu::shared_memory()); });
  const std::vector<int> owner = call.owners();
  double err2 = 0.0, ref2 = 0.0;
  for (std::int64_t i = 0; i < c.rows; ++i) {
    const int e = owner[static_cast<std::size_t>(i)];
    for (std::int64_t j = 0; j < c.n; ++j) {
      if (e < 0) {  // left as it was
        fused_host::expect_kept(call, i, j, o);
        continue;
      }
      compare(call.c(i, j), &call.a[static_cast<std::size_t>(i * c.k)],
              w[static_cast<std::size_t>(e)], j,
              c.bias ? &call.bias[static_cast<std::size_t>(e * c.n)] : nullptr, c.f32, i, o, err2,
              ref2);
    }
  }
  o.rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  return o;
}

void expect_right(const GroupedCase& c) {
  SCOPED_TRACE(name(c));
  expect_good(run_grouped(c));
}

// Experts of 0, 1, 128 (one whole slot), 130 (a whole and a partial slot) and 40 rows, spare
// rows at the end of the capacity; two persistent blocks over 2 N tiles x 5 slots.
TEST(GroupedFusedPipeline, ExpertsOfEveryRowCountMatchFloat64) {
  expect_right({false, 256, 256, 330, {0, 1, 128, 130, 40}, {}, true, false, 2, 1});
  expect_right({true, 200, 416, 320, {37, 0, 130, 0, 120}, {}, false, true, 3, 2});
}

// MXFP4 experts of different folds (each stage carries its own expert's table), FP32 C, N and
// K partial; and an expert whose rows lie outside the capacity (skipped, as expert_params does),
// its neighbours' rows and the spare rows left alone.
TEST(GroupedFusedPipeline, PerExpertTablesAndSkippedExpertsMatchFloat64) {
  expect_right({true, 100, 256, 200, {60, 17, 33, 50}, {}, true, true, 2, 3});
  expect_right({false, 128, 256, 180, {70, 9, 60}, {0, 175, 100}, true, false, 1, 4});
}

// One expert taking every row, among many empty ones (the slot search skips runs of empties).
TEST(GroupedFusedPipeline, OneExpertTakingAllRowsMatchesFloat64) {
  std::vector<int> counts(37, 0);
  counts[29] = 300;
  expect_right({true, 128, 256, 300, counts, {}, false, false, 2, 5});
}

// One block walking 32 tiles of one stage each (K = 128): the producer runs up to 6 tiles ahead
// and reuses the ring of tiles four times. And 1000 experts (the scan's three entries a thread,
// ten rounds), 40 of them with rows, the last expert's among them.
TEST(GroupedFusedPipeline, ARingOfTilesReusedAndAThousandExpertsMatchFloat64) {
  expect_right({false, 256, 128, 1600, {300, 0, 500, 1, 128, 400, 50, 221}, {}, true, false, 1, 7});
  std::vector<int> counts(1000, 0);
  for (int e = 0; e < 1000; e += 25) counts[static_cast<std::size_t>(e)] = 1 + e % 9;
  counts[999] = 130;
  expect_right({true, 128, 128, 400, counts, {}, false, false, 3, 8});
}

// Other schedules of the same grid.
TEST(GroupedFusedPipeline, ResultsHoldUnderOtherSchedules) {
  for (std::uint64_t seed = 11; seed < 13; ++seed) {
    expect_right({true, 128, 256, 200, {70, 0, 130}, {}, true, false, 2, seed});
  }
}

// Each planted fault must fail: the shared pipeline's (a wrong parity, a skipped expect_tx) and
// the grouped kernel's own (every expert given expert 0's scale table).
TEST(GroupedFusedPipeline, PlantedFaultsFail) {
  const struct {
    emu::Plant plant;
    const char* what;
  } plants[] = {{emu::Plant::kWrongParity, "a wrong full-barrier parity"},
                {emu::Plant::kSkipExpectTx, "a skipped expect_tx"},
                {emu::Plant::kExpertZeroTable, "expert 0's scale table for every expert"},
                {emu::Plant::kNoExpertRowBound, "the epilogue's expert row bound dropped"},
                {emu::Plant::kSmallTileRing, "a ring of 2 tiles"}};
  // One block over 14 tiles of one stage each (K = 128): the producer runs ahead of the ring.
  // 130 spare rows: C holds what the dropped row bound writes past the last expert's rows.
  for (const auto& p : plants) {
    expect_caught(
        [&p](std::uint64_t seed) {
          return run_grouped(
              {true, 256, 128, 700, {70, 0, 130, 200, 110, 60}, {}, false, false, 1, seed},
              p.plant);
        },
        p.what);
  }
}

}  // namespace
}  // namespace metrale
