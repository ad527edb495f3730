// The index math of the Hopper w4a16 kernels (src/kernels/tile_math.h), checked on the host: which
// K element each lane's registers hold, the split-K ranges, the 128-byte swizzle, the wgmma
// descriptor fields and the accumulator fragments. No GPU runs here; these are the parts of the
// kernels' correctness that do not need one.
#include "kernels/tile_math.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "metrale/numerics.h"

namespace metrale::tiles {
namespace {

TEST(DecodeFragments, EveryLaneStepAndElementIsOnePhysicalKOfTheBlock) {
  std::set<int> seen;
  for (int t = 0; t < 4; ++t) {
    for (int s = 0; s < 8; ++s) {
      for (int j = 0; j < 4; ++j) {
        const int k = decode_physical_k(t, s, j);
        EXPECT_GE(k, 32 * t);  // inside the lane's own 16-byte load
        EXPECT_LT(k, 32 * t + 32);
        EXPECT_TRUE(seen.insert(k).second) << t << " " << s << " " << j;
      }
    }
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(kDecodeKBlock));
}

TEST(DecodeFragments, EachStepFeedsTheMmaSixteenDistinctKAndTheSameToBothOperands) {
  for (int s = 0; s < 8; ++s) {
    std::set<int> logical, physical;
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < 4; ++j) {
        EXPECT_TRUE(logical.insert(decode_logical_k(t, j)).second);
        physical.insert(decode_physical_k(t, s, j));
      }
    }
    EXPECT_EQ(logical, (std::set<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
    EXPECT_EQ(physical.size(), 16u);
  }
  // The m16n8k16 fragments: A's first register pair holds k = 2t, 2t + 1, its second 2t + 8,
  // 2t + 9; B's registers the same k, so the permutation is the same on both sides.
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(decode_logical_k(t, 0), 2 * t);
    EXPECT_EQ(decode_logical_k(t, 1), 2 * t + 1);
    EXPECT_EQ(decode_logical_k(t, 2), 2 * t + 8);
    EXPECT_EQ(decode_logical_k(t, 3), 2 * t + 9);
  }
}

TEST(DecodeFragments, BytesWordsAndGroupsPointAtTheElement) {
  for (int s = 0; s < 8; ++s) {
    for (int j = 0; j < 4; ++j) {
      const int k = decode_physical_k(0, s, j);  // relative to the lane's first K
      EXPECT_EQ(decode_code_byte(s, j), k / 2);  // two codes a byte, even k in the low nibble
      EXPECT_EQ(decode_act_word(s, j), k / 2);   // two BF16 a 32-bit word, even k low
      EXPECT_EQ(decode_group(s), k / num::kNvfp4Group);
      EXPECT_LT(decode_code_byte(s, j), 16);
      EXPECT_LT(decode_act_word(s, j), 16);
    }
    // j = 0, 1 share a byte and a word; so do j = 2, 3; and the next pair is the next one.
    EXPECT_EQ(decode_code_byte(s, 1), decode_code_byte(s, 0));
    // The kernel reads j = 0..3 as one aligned half-word.
    EXPECT_EQ(decode_code_byte(s, 0) % 2, 0);
    EXPECT_EQ(decode_code_byte(s, 2), decode_code_byte(s, 0) + 1);
    EXPECT_EQ(decode_code_byte(s, 3), decode_code_byte(s, 2));
    EXPECT_EQ(decode_act_word(s, 3), decode_act_word(s, 2));
  }
}

TEST(SplitK, SlicesCoverKOnceWithNoEmptySliceAndWholeUnits) {
  std::mt19937_64 gen(std::random_device{}());
  std::uniform_int_distribution<std::int64_t> kd(1, 4096), ud(1, 8), bd(1, 600), md(1, 32);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::int64_t k = 16 * kd(gen), unit = 128 * ud(gen), blocks = bd(gen), max = md(gen);
    const std::int64_t target = 264;
    const SplitK s = plan_split_k(k, unit, blocks, target, max);
    ASSERT_GE(s.splits, 1);
    ASSERT_LE(s.splits, max);
    // Several slices start on whole units; one slice is all of K, as the ops' plans check.
    ASSERT_EQ(s.splits > 1 ? s.k_per_split % unit : s.k_per_split - k, 0);
    std::int64_t covered = 0;
    for (std::int64_t z = 0; z < s.splits; ++z) {
      std::int64_t b = 0, e = 0;
      split_k_range(k, s.k_per_split, z, &b, &e);
      ASSERT_EQ(b, covered) << "slice " << z;
      ASSERT_GT(e, b) << "slice " << z << " is empty (K " << k << ", unit " << unit << ")";
      covered = e;
    }
    ASSERT_EQ(covered, k);
    const std::int64_t units = (k + unit - 1) / unit;
    if (blocks >= target) {
      EXPECT_EQ(s.splits, 1);
    } else if (units >= max && (target + blocks - 1) / blocks >= max) {
      // When K has the units, the split reaches what was asked, up to the cap.
      EXPECT_GE(s.splits, (max + 1) / 2);
    }
  }
}

TEST(SplitK, KnownShapes) {
  // Llama-3 8B o-proj at M = 1 on 132 SMs: 4096 / 32 = 128 blocks want 3 slices of 4096 K
  // (4 units of 1024): 2 units a slice, so 2 slices.
  SplitK s = plan_split_k(4096, kDecodeSplitUnit, 128, 264, 16);
  EXPECT_EQ(s.splits, 2);
  EXPECT_EQ(s.k_per_split, 2048);
  // 8B down-proj (K = 14336 = 14 units), N = 4096: 3 slices of 5 units (the last has 4).
  s = plan_split_k(14336, kDecodeSplitUnit, 128, 264, 16);
  EXPECT_EQ(s.splits, 3);
  EXPECT_EQ(s.k_per_split, 5120);
  // gate_up (N = 28672): 896 blocks, no split.
  s = plan_split_k(4096, kDecodeSplitUnit, 896, 264, 16);
  EXPECT_EQ(s.splits, 1);
  EXPECT_EQ(s.k_per_split, 4096);
  // A K of less than one unit cannot split, and its one slice is K itself (not the unit's
  // round-up, which the ops' run-time checks of a plan refused: gpt-oss's K = 2880 unsplit).
  s = plan_split_k(48, kDecodeSplitUnit, 1, 264, 16);
  EXPECT_EQ(s.splits, 1);
  EXPECT_EQ(s.k_per_split, 48);
  s = plan_split_k_waves(2880, kDecodeSplitUnit, 2880, 132, 16);
  EXPECT_EQ(s.splits, 1);
  EXPECT_EQ(s.k_per_split, 2880);
}

TEST(Swizzle128, IsABijectionOfEachAtomThatKeepsSixteenByteChunksWhole) {
  for (std::uint32_t atom = 0; atom < 4; ++atom) {
    std::set<std::uint32_t> seen;
    for (std::uint32_t r = 8 * atom; r < 8 * atom + 8; ++r) {
      for (std::uint32_t b = 0; b < 128; ++b) {
        const std::uint32_t o = swizzle128(r, b);
        EXPECT_EQ(o / 1024, atom);  // stays in its 1024-byte atom
        EXPECT_EQ(o % 16, b % 16);  // a chunk is moved whole
        EXPECT_EQ(o / 128, r);      // a row stays in its 128 bytes
        EXPECT_TRUE(seen.insert(o).second);
      }
    }
    EXPECT_EQ(seen.size(), 1024u);
  }
}

TEST(Swizzle128, MatchesTheHardwarePatternOfAddressBits) {
  // SWIZZLE_128B XORs address bits [4, 7) with bits [7, 10) (CUTLASS's Swizzle<3, 4, 3>).
  for (std::uint32_t r = 0; r < 64; ++r) {
    for (std::uint32_t b = 0; b < 128; ++b) {
      const std::uint32_t linear = r * 128 + b;
      EXPECT_EQ(swizzle128(r, b), linear ^ (((linear >> 7) & 7u) << 4)) << r << " " << b;
    }
  }
  // Row 0 is not moved; row 1 swaps neighbouring chunks; row 7 reverses them.
  EXPECT_EQ(swizzle128(0, 32), 32u);
  EXPECT_EQ(swizzle128(1, 0), 128u + 16u);
  EXPECT_EQ(swizzle128(7, 0), 7u * 128u + 112u);
}

TEST(WgmmaDescriptor, FieldsAreWhereThePtxIsaPutsThem) {
  for (std::uint32_t addr : {0u, 1024u, 0x8400u, 0x3FFF0u, 0x12340u}) {
    const std::uint64_t d = wgmma_desc_sw128(addr);
    EXPECT_EQ(d & 0x3FFFu, (addr >> 4) & 0x3FFFu) << addr;  // start address, 16-byte units
    EXPECT_EQ((d >> 16) & 0x3FFFu, 1u);                     // leading offset (unused swizzled)
    EXPECT_EQ((d >> 32) & 0x3FFFu, 1024u / 16u);            // 8 rows of 128 bytes
    EXPECT_EQ((d >> 49) & 0x7u, 0u);                        // base offset: atoms 1024-aligned
    EXPECT_EQ(d >> 62, 1u);                                 // SWIZZLE_128B
    EXPECT_EQ(d & (std::uint64_t{0x3} << 14), 0u);          // nothing in the reserved bits
  }
  // A K step is an offset of the start address only: 16 BF16 (32 bytes) is 2 units.
  EXPECT_EQ(wgmma_desc_sw128(0x400 + 32) - wgmma_desc_sw128(0x400), 2u);
}

// Every (thread, register) of a warpgroup's m64nN accumulator is one element, each once.
void expect_wgmma_cover(int n) {
  std::set<std::pair<int, int>> seen;
  for (int tid = 0; tid < 128; ++tid) {
    for (int i = 0; i < n / 2; ++i) {
      const int r = wgmma_acc_row(tid, i), c = wgmma_acc_col(tid, i);
      ASSERT_GE(r, 0);
      ASSERT_LT(r, 64);
      ASSERT_GE(c, 0);
      ASSERT_LT(c, n);
      ASSERT_TRUE(seen.insert({r, c}).second) << tid << " " << i;
    }
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(64 * n));
}

TEST(WgmmaFragments, CoverTheTileOnceForBothKernelShapes) {
  expect_wgmma_cover(kTiledNTile);  // m64n256 (BF16)
  expect_wgmma_cover(kE4m3NTile);   // m64n64 (E4M3)
  // Warp 1, lane 5 (g = 1, t = 1): rows 17 and 25, columns 2, 3, then 10, 11, ...
  EXPECT_EQ(wgmma_acc_row(37, 0), 17);
  EXPECT_EQ(wgmma_acc_row(37, 2), 25);
  EXPECT_EQ(wgmma_acc_col(37, 1), 3);
  EXPECT_EQ(wgmma_acc_col(37, 4), 10);
}

TEST(MmaFragments, CoverTheSixteenByEightTileOnce) {
  std::set<std::pair<int, int>> seen;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      const int r = mma_acc_row(lane, i), c = mma_acc_col(lane, i);
      ASSERT_LT(r, 16);
      ASSERT_LT(c, 8);
      ASSERT_TRUE(seen.insert({r, c}).second);
    }
  }
  EXPECT_EQ(seen.size(), 128u);
}

TEST(TileSizes, FitTheHardwareAndEachOther) {
  constexpr int kHopperSmemOptin = 227 * 1024;  // per block, sm_90
  EXPECT_LE(kTiledSmemBytes, kHopperSmemOptin);
  EXPECT_LE(kE4m3SmemBytes, kHopperSmemOptin);
  EXPECT_EQ(kTiledKStage * 2, 128);  // a BF16 stage row is one swizzle row
  EXPECT_EQ(kE4m3GroupsPerStage * 2 * kE4m3Group, kE4m3RowBytes);  // slots of 32 bytes
  EXPECT_EQ(kTiledMTile, 2 * 64);                                  // two warpgroups of m64
  EXPECT_EQ(kE4m3MTile, 2 * 64);
  EXPECT_EQ(kTiledThreads, 256);
  EXPECT_EQ(kDecodeNTile, 2 * 16);   // two m16 row tiles per warp
  EXPECT_EQ(kDecodeKBlock, 4 * 32);  // 4 lanes of 32 codes
  EXPECT_EQ(kDecodeMaxM, 2 * 8);     // two n8 activation tiles
  // Stages start on 1024-byte boundaries (the swizzle atom), so descriptors need no base offset.
  EXPECT_EQ(kTiledStageBytes % 1024, 0);
  EXPECT_EQ(kE4m3StageBytes % 1024, 0);
  EXPECT_EQ((kTiledMTile * 128) % 1024, 0);  // B follows A within a stage, aligned too
  EXPECT_EQ((kE4m3MTile * kE4m3RowBytes + kE4m3NTile * kE4m3RowBytes) % 16, 0);
}

// The kernels fold the block scale into the BF16 weight; that is exact only if every E2M1 value
// times every scale is a BF16 number.
TEST(ScaledWeights, EveryE2m1TimesEveryScaleIsExactInBf16) {
  for (int code = 0; code < 16; ++code) {
    const float v = num::e2m1_to_f32(static_cast<std::uint8_t>(code));
    for (int s = 0; s < 256; ++s) {
      const float e4 = num::e4m3_to_f32(static_cast<std::uint8_t>(s));
      if (e4 == e4) {
        const float p = v * e4;
        EXPECT_EQ(num::bf16_to_f32(num::f32_to_bf16(p)), p) << code << " x e4m3 " << s;
      }
      const float e8 = num::e8m0_to_f32(static_cast<std::uint8_t>(s));
      if (e8 == e8) {
        const float p = v * e8;
        EXPECT_EQ(num::bf16_to_f32(num::f32_to_bf16(p)), p) << code << " x e8m0 " << s;
      }
    }
  }
}

// ---- the kernels' data paths, emulated with the PTX ISA's own fragment and address rules ----

// Random NVFP4 codes and scales for `rows` x `k` weights, and BF16 activations.
struct Operands {
  int rows, k, m;
  std::vector<std::uint8_t> codes;   // [rows, k/2]
  std::vector<std::uint8_t> scales;  // [rows, k/16], E4M3
  std::vector<std::uint16_t> acts;   // [m, k]
  double w(int r, int kk) const {
    const std::uint8_t b = codes[static_cast<std::size_t>(r * k / 2 + kk / 2)];
    return num::e2m1_to_f32(static_cast<std::uint8_t>(kk % 2 ? b >> 4 : b & 0xF)) *
           num::e4m3_to_f32(scales[static_cast<std::size_t>(r * k / 16 + kk / 16)]);
  }
  double a(int mm, int kk) const {
    return num::bf16_to_f32(acts[static_cast<std::size_t>(mm * k + kk)]);
  }
};

Operands random_operands(int rows, int k, int m, std::mt19937_64& gen) {
  Operands o{rows, k, m, {}, {}, {}};
  o.codes.resize(static_cast<std::size_t>(rows * k / 2));
  for (auto& c : o.codes) c = static_cast<std::uint8_t>(gen());
  o.scales.resize(static_cast<std::size_t>(rows * k / 16));
  for (auto& s : o.scales) s = static_cast<std::uint8_t>(0x20 + gen() % 0x30);  // 2^-3 .. 2^3
  o.acts.resize(static_cast<std::size_t>(m * k));
  std::normal_distribution<float> nd;
  for (auto& x : o.acts) x = num::f32_to_bf16(nd(gen));
  return o;
}

double bf16_at(std::uint32_t pair, int half) {
  return num::bf16_to_f32(static_cast<std::uint16_t>(pair >> (16 * half)));
}

// One warp's K block of gemm_decode (32 weight rows x 128 K, 16 activation rows), built register
// by register the way decode.cuh builds them, then multiplied by the m16n8k16 fragment rules
// written out from the PTX ISA (independently of tile_math.h), and read back through the
// accumulator map the kernel uses.
TEST(DecodeEmulation, OneWarpsKBlockGivesTheDotProducts) {
  std::mt19937_64 gen(std::random_device{}());
  const Operands o = random_operands(32, kDecodeKBlock, 16, gen);
  double d[2][2][16][8] = {};  // [row tile][activation tile][n row][m col]
  for (int s = 0; s < 8; ++s) {
    double amat[2][16][16] = {}, bmat[2][16][8] = {};  // per row tile / activation tile
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int rt = 0; rt < 2; ++rt) {
        std::uint32_t regs[4];
        for (int hi = 0; hi < 2; ++hi) {  // rows g and g + 8 of the row tile
          const int row = 16 * rt + g + 8 * hi;
          const std::uint8_t* mine = &o.codes[static_cast<std::size_t>(row * o.k / 2 + 16 * t)];
          const std::uint32_t codes16 =
              mine[decode_code_byte(s, 0)] | std::uint32_t{mine[decode_code_byte(s, 2)]} << 8;
          const std::uint8_t sc =
              o.scales[static_cast<std::size_t>(row * o.k / 16 + 2 * t + decode_group(s))];
          std::uint32_t p01 = 0, p23 = 0;
          num::e2m1x4_to_bf16(codes16, &p01, &p23);
          const std::uint32_t pair = num::bf16_pair_of(num::e4m3_to_f32(sc));
          regs[hi] = num::bf16x2_mul(p01, pair);      // a0a1 (row g), a2a3 (row g + 8)
          regs[2 + hi] = num::bf16x2_mul(p23, pair);  // a4a5 (row g), a6a7 (row g + 8)
        }
        // PTX: a_i of the 16x16 A fragment is row g (+8 for i = 2,3,6,7), column 2t + i % 2
        // (+8 for i >= 4); register r holds a_2r, a_2r+1 (low half first).
        for (int i = 0; i < 8; ++i) {
          const int row = g + ((i % 4) >= 2 ? 8 : 0), col = 2 * t + i % 2 + (i >= 4 ? 8 : 0);
          amat[rt][row][col] = bf16_at(regs[i / 2], i % 2);
        }
      }
      for (int mt = 0; mt < 2; ++mt) {
        const int mm = 8 * mt + g;
        const std::uint16_t* act = &o.acts[static_cast<std::size_t>(mm * o.k + 32 * t)];
        const auto word = [&](int w) { return act[2 * w] | std::uint32_t{act[2 * w + 1]} << 16; };
        const std::uint32_t b[2] = {word(decode_act_word(s, 0)), word(decode_act_word(s, 2))};
        // PTX: b_i of the 16x8 B fragment is row (k) 2t + i % 2 (+8 for i >= 2), column g.
        for (int i = 0; i < 4; ++i)
          bmat[mt][2 * t + i % 2 + (i >= 2 ? 8 : 0)][g] = bf16_at(b[i / 2], i % 2);
      }
    }
    for (int rt = 0; rt < 2; ++rt) {
      for (int mt = 0; mt < 2; ++mt) {
        for (int r = 0; r < 16; ++r) {
          for (int c = 0; c < 8; ++c) {
            for (int kk = 0; kk < 16; ++kk) d[rt][mt][r][c] += amat[rt][r][kk] * bmat[mt][kk][c];
          }
        }
      }
    }
  }
  // The kernel reads D through mma_acc_row / mma_acc_col: output (n, m) = (16 rt + row, 8 mt +
  // col).
  for (int lane = 0; lane < 32; ++lane) {
    for (int rt = 0; rt < 2; ++rt) {
      for (int mt = 0; mt < 2; ++mt) {
        for (int i = 0; i < 4; ++i) {
          const int n = 16 * rt + mma_acc_row(lane, i), mm = 8 * mt + mma_acc_col(lane, i);
          double want = 0, mag = 0;
          for (int kk = 0; kk < o.k; ++kk) {
            want += o.w(n, kk) * o.a(mm, kk);
            mag += std::fabs(o.w(n, kk) * o.a(mm, kk));
          }
          ASSERT_NEAR(d[rt][mt][mma_acc_row(lane, i)][mma_acc_col(lane, i)], want, 1e-12 * mag)
              << "n " << n << " m " << mm;
        }
      }
    }
  }
}

// The byte wgmma reads for element (row, byte) of a K-major SWIZZLE_128B operand whose
// descriptor starts at `start` (1024-aligned tile plus a K offset below 128): rows at
// (row / 8) · SBO + (row % 8) · 128 from the start, then address bits [4, 7) XOR bits [7, 10)
// (CUTLASS's canonical GMMA layout, SBO = 1024).
std::uint32_t wgmma_reads(std::uint32_t start, std::uint32_t row, std::uint32_t byte) {
  const std::uint32_t linear = start + (row / 8) * 1024 + (row % 8) * 128 + byte;
  return linear ^ (((linear >> 7) & 7u) << 4);
}

// gemm_tiled's weight tile: each thread stores its 32 dequantized weights where
// tiled_store_codes puts them (swizzle128 of chunk 4·half + q), and every wgmma of the stage must
// then read W[n, k] for its (n, k).
TEST(TiledEmulation, TheWeightTileWgmmaReadsIsTheDequantizedWeights) {
  std::mt19937_64 gen(std::random_device{}());
  const Operands o = random_operands(kTiledNTile, kTiledKStage, 1, gen);
  std::vector<std::uint8_t> smem(kTiledNTile * 128, 0xEE);
  // Run c = tid + kTiledThreads·i (i < kTiledBRunsPerThread) is half c % 2 of row c / 2.
  ASSERT_EQ(kTiledThreads * kTiledBRunsPerThread, 2 * kTiledNTile);
  for (int c = 0; c < kTiledThreads * kTiledBRunsPerThread; ++c) {
    const int row = c / 2, half = c % 2;
    const std::uint8_t* mine = &o.codes[static_cast<std::size_t>(row * o.k / 2 + 16 * half)];
    for (int q = 0; q < 4; ++q) {
      const std::uint32_t pair = num::bf16_pair_of(
          num::e4m3_to_f32(o.scales[static_cast<std::size_t>(row * o.k / 16 + 2 * half + q / 2)]));
      std::uint32_t v[4];
      const std::uint32_t w = mine[4 * q] | std::uint32_t{mine[4 * q + 1]} << 8 |
                              std::uint32_t{mine[4 * q + 2]} << 16 |
                              std::uint32_t{mine[4 * q + 3]} << 24;
      std::uint32_t p01, p23;
      num::e2m1x4_to_bf16(w & 0xFFFF, &p01, &p23);
      v[0] = num::bf16x2_mul(p01, pair);
      v[1] = num::bf16x2_mul(p23, pair);
      num::e2m1x4_to_bf16(w >> 16, &p01, &p23);
      v[2] = num::bf16x2_mul(p01, pair);
      v[3] = num::bf16x2_mul(p23, pair);
      std::memcpy(&smem[swizzle128(static_cast<std::uint32_t>(row),
                                   static_cast<std::uint32_t>((4 * half + q) * 16))],
                  v, 16);
    }
  }
  for (int kk = 0; kk < kTiledKStage / 16; ++kk) {  // the descriptor starts 32 bytes further
    for (int n = 0; n < kTiledNTile; ++n) {
      for (int j = 0; j < 16; ++j) {
        const std::uint32_t at = wgmma_reads(32u * kk, static_cast<std::uint32_t>(n), 2u * j);
        std::uint16_t bits;
        std::memcpy(&bits, &smem[at], 2);
        ASSERT_EQ(num::bf16_to_f32(bits), o.w(n, 16 * kk + j)) << "n " << n << " k " << 16 * kk + j;
      }
    }
  }
}

// gemm_e4m3's A tile: group q's 16 bytes at swizzle128(row, 32 q), the upper 16 bytes zero.
// The k32 MMA of group q (descriptor 32 q bytes on) must read the group's bytes then zeros.
TEST(E4m3Emulation, EachGroupsMmaReadsItsSixteenBytesThenZeros) {
  std::vector<std::uint8_t> smem(kE4m3MTile * kE4m3RowBytes, 0xEE);
  for (std::uint32_t row = 0; row < kE4m3MTile; ++row) {
    for (std::uint32_t q = 0; q < kE4m3GroupsPerStage; ++q) {
      for (std::uint32_t b = 0; b < 16; ++b) {
        smem[swizzle128(row, 32 * q + b)] = static_cast<std::uint8_t>(row * 4 + q);  // data
        smem[swizzle128(row, 32 * q + 16 + b)] = 0;                                  // pad
      }
    }
  }
  for (std::uint32_t q = 0; q < kE4m3GroupsPerStage; ++q) {
    for (std::uint32_t row = 0; row < kE4m3MTile; ++row) {
      for (std::uint32_t b = 0; b < 32; ++b) {
        const std::uint8_t want = b < 16 ? static_cast<std::uint8_t>(row * 4 + q) : 0;
        ASSERT_EQ(smem[wgmma_reads(32 * q, row, b)], want) << "group " << q << " row " << row;
      }
    }
  }
}

}  // namespace
}  // namespace metrale::tiles
