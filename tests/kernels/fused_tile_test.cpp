// The index math of gemm_fused (src/kernels/fused_tile.h), checked element by element against
// the PTX ISA's rules written out here independently: the wgmma A register fragment of
// m64nNk16 (9.7.15.5.1.1.1, which for each warp's 16 rows is mma.m16n8k16's A fragment), the
// K-major 128-byte-swizzled B tile read through a matrix descriptor (9.7.15.5.1.2), the D
// fragment, and the decode layout's own map (decode_layout::code_slot, scale_byte).
#include "kernels/fused_tile.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "kernels/decode_layout.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/tile_math.h"

namespace metrale::fused {
namespace {

// Element i (0..7, two a register, low half first) of the A fragment of wgmma m64nNk16 .bf16
// held by thread wtid of its warpgroup: row 16 warp + groupID (+ 8 for i = 2, 3, 6, 7), k =
// 2 threadID_in_group + (i & 1) (+ 8 for i >= 4).
int ptx_a_row(int wtid, int i) {
  const int warp = wtid / 32, g = (wtid % 32) / 4;
  return 16 * warp + g + ((i % 4) >= 2 ? 8 : 0);
}
int ptx_a_k(int wtid, int i) {
  const int t = wtid % 4;
  return 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
}

// The shared-memory address wgmma reads element (kk, n) of a K-major BF16 B tile at, from the
// descriptor's own fields: start address, stride byte offset between 8-row groups, 128-byte
// rows, then the 128-byte swizzle on the address (bits 4-6 XOR bits 7-9).
std::uint32_t ptx_b_address(std::uint64_t desc, int n, int kk) {
  const auto start = static_cast<std::uint32_t>(desc & 0x3FFFu) << 4;
  const auto sbo = static_cast<std::uint32_t>((desc >> 32) & 0x3FFFu) << 4;
  EXPECT_EQ(desc >> 62, 1u) << "128-byte swizzle";
  const std::uint32_t linear = start + static_cast<std::uint32_t>(n / 8) * sbo +
                               static_cast<std::uint32_t>(n % 8) * 128u +
                               2u * static_cast<std::uint32_t>(kk);
  return linear ^ (((linear >> 7) & 7u) << 4);
}

TEST(FusedTile, PhysicalKIsAPermutationMatchingTheDecodeLanes) {
  std::set<int> seen;
  for (int s = 0; s < kSteps; ++s) {
    for (int kk = 0; kk < 16; ++kk) {
      const int k = fused_physical_k(s, kk);
      EXPECT_TRUE(seen.insert(k).second) << s << " " << kk;
    }
    for (int t = 0; t < 4; ++t) {
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(fused_physical_k(s, tiles::decode_logical_k(t, j)),
                  tiles::decode_physical_k(t, s, j));
      }
    }
  }
  EXPECT_EQ(seen.size(), 128u);
  EXPECT_EQ(*seen.rbegin(), 127);
}

// Every A register half a consumer thread feeds wgmma is the decode-layout weight the PTX
// fragment rule says belongs there: same word, register and half as code_slot gives for that
// weight row and physical K, in a buffer of one K block of the block's four tiles (the stage's
// codes are exactly that).
TEST(FusedTile, ConsumerWordsAreTheWgmmaAFragment) {
  for (bool mx : {false, true}) {
    for (int wg = 0; wg < kConsumers; ++wg) {
      for (int wtid = 0; wtid < 128; ++wtid) {
        for (int s = 0; s < kSteps; ++s) {
          for (int i = 0; i < 8; ++i) {
            const int row = kRowsPerConsumer * wg + ptx_a_row(wtid, i);
            const int k = fused_physical_k(s, ptx_a_k(wtid, i));
            const dl::CodeSlot slot = dl::code_slot(row, k, 1);
            ASSERT_EQ(slot.byte, fused_word_byte(wg, wtid, s)) << wg << " " << wtid << " " << s;
            ASSERT_EQ(slot.reg, i / 2);
            ASSERT_EQ(slot.half, i % 2);
            const std::int64_t sb = dl::scale_byte(row, k, 1, mx) - dl::kTableBytes;
            const int per_tile = dl::kLanes * dl::scale_bytes_per_lane(mx);
            ASSERT_EQ(fused_scale_byte(wg, wtid, s, i / 2, mx),
                      (sb / per_tile) * kScaleSlotBytes + sb % per_tile)
                << mx << " " << wg << " " << wtid << " " << s << " " << i;
          }
        }
      }
    }
  }
}

// Element (kk, token) that wgmma step s reads through fused_b_desc is the activation of that
// token at the physical K the A side put at kk; the tile's bytes are each used once.
TEST(FusedTile, ActivationTileIsWhatTheDescriptorReads) {
  const std::uint32_t act = 1024u * 37;  // a stage's base: 1024-aligned
  std::set<std::uint32_t> seen;
  for (int s = 0; s < kSteps; ++s) {
    for (int n = 0; n < kTokens; ++n) {
      for (int kk = 0; kk < 16; ++kk) {
        const std::uint32_t at = act + fused_act_offset(n, fused_physical_k(s, kk));
        ASSERT_EQ(at, ptx_b_address(fused_b_desc(act, s), n, kk)) << s << " " << n << " " << kk;
        ASSERT_TRUE(seen.insert(at).second);
      }
    }
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(kActBytes / 2));
  EXPECT_EQ(*seen.rbegin() - act, static_cast<std::uint32_t>(kActBytes - 2));
}

// The producer's transpose: destination chunk d of unit (token, u), word t, half e holds
// physical K 32 t + 8 u + 2 d + e, word d of source chunk t; the chunks tile the stage.
TEST(FusedTile, ProducerChunksTransposeIntoTheTile) {
  std::set<std::uint32_t> chunks;
  for (int n = 0; n < kTokens; ++n) {
    for (int u = 0; u < 4; ++u) {
      for (int d = 0; d < 4; ++d) {
        const std::uint32_t c = fused_act_chunk_offset(n, u, d);
        ASSERT_EQ(c % 16, 0u);
        ASSERT_TRUE(chunks.insert(c).second);
        for (int t = 0; t < 4; ++t) {
          for (int e = 0; e < 2; ++e) {
            const int k = 32 * t + 8 * u + 2 * d + e;
            ASSERT_EQ(fused_act_offset(n, k), c + 4u * static_cast<std::uint32_t>(t) + 2u * e)
                << n << " " << u << " " << d << " " << t << " " << e;
          }
        }
      }
    }
  }
  EXPECT_EQ(chunks.size(), static_cast<std::size_t>(kActBytes / 16));
}

// The INT4 layout (int4_decode::code_slot): every A register half a consumer thread feeds wgmma
// is the weight the PTX fragment rule puts there, at fused_int4_physical_k; and the scale and
// zero point the kernel picks for it (fused_int4_scale_at / _zero_at, then fused_int4_pairs'
// word, half and byte: upper u, entry e) are side_slot's for that row and K, for both shapes.
TEST(FusedTile, Int4ConsumerWordsAndSidesAreTheWgmmaAFragment) {
  std::set<int> seen;
  for (int s = 0; s < kSteps; ++s) {
    for (int kk = 0; kk < 16; ++kk) EXPECT_TRUE(seen.insert(fused_int4_physical_k(s, kk)).second);
  }
  EXPECT_EQ(seen.size(), 128u);
  EXPECT_EQ(*seen.rbegin(), 127);
  for (const std::int64_t group : {32, 64, 128, 256}) {
    const int e = int4_decode::entries(group);
    for (int wg = 0; wg < kConsumers; ++wg) {
      for (int wtid = 0; wtid < 128; ++wtid) {
        const int rt = (wtid / 32) % 2;
        for (int s = 0; s < kSteps; ++s) {
          for (int i = 0; i < 8; ++i) {
            const int row = kRowsPerConsumer * wg + ptx_a_row(wtid, i);
            const int k = fused_int4_physical_k(s, ptx_a_k(wtid, i));
            const int4_decode::CodeSlot slot = int4_decode::code_slot(row, k, 1);
            ASSERT_EQ(slot.byte, fused_word_byte(wg, wtid, s)) << wg << " " << wtid << " " << s;
            ASSERT_EQ(slot.reg, i / 2);
            ASSERT_EQ(slot.half, i % 2);
            const int upper = slot.reg % 2, entry = e == 1 ? 0 : s / 2;
            const int4_decode::SideSlot side = int4_decode::side_slot(row, k, 1, group);
            const std::int64_t tile = row / dl::kTileN,
                               base = tile * int4_decode::side_block_bytes(e);
            const int scale =
                fused_int4_scale_at(wtid, e) + (e == 1 ? 2 * upper : 8 * upper + 2 * entry);
            const int zero =
                fused_int4_zero_at(wtid, e) + (e == 1 ? 2 * rt + upper : 4 * upper + entry);
            ASSERT_EQ(side.scale - base, scale) << group << " " << wtid << " " << s << " " << i;
            ASSERT_EQ(side.zero - base, zero) << group << " " << wtid << " " << s << " " << i;
          }
        }
      }
    }
  }
}

// The INT4 producer: source chunk t of unit (token, u) is K fused_source_k(u, t, true) on; its
// word d, half e lands (fused_act_chunk_offset, the FP4 unit's stores) where wgmma step s reads
// MMA k kk through fused_b_desc, for the (s, kk) whose INT4 physical K that is.
TEST(FusedTile, Int4ProducerChunksLandWhereTheDescriptorReadsTheirK) {
  const std::uint32_t act = 1024u * 37;
  std::vector<std::pair<int, int>> step_of(128);
  for (int s = 0; s < kSteps; ++s) {
    for (int kk = 0; kk < 16; ++kk) step_of[fused_int4_physical_k(s, kk)] = {s, kk};
  }
  std::set<int> loaded;
  for (int n = 0; n < kTokens; ++n) {
    for (int u = 0; u < 4; ++u) {
      for (int d = 0; d < 4; ++d) {
        for (int t = 0; t < 4; ++t) {
          for (int e = 0; e < 2; ++e) {
            const int k = fused_source_k(u, t, true) + 2 * d + e;
            if (n == 0) loaded.insert(k);
            const auto [s, kk] = step_of[k];
            ASSERT_EQ(act + fused_act_chunk_offset(n, u, d) + 4u * t + 2u * e,
                      ptx_b_address(fused_b_desc(act, s), n, kk))
                << n << " " << u << " " << d << " " << t << " " << e;
          }
        }
      }
    }
  }
  EXPECT_EQ(loaded.size(), 128u);
}

// D of m64nNk16 (FP32): register i of thread wtid is row 16 warp + groupID + 8 ((i / 2) % 2),
// column 8 (i / 4) + 2 threadID_in_group + i % 2; rows are weight rows (C columns), columns
// tokens (C rows).
TEST(FusedTile, AccumulatorsLandTransposed) {
  for (int wg = 0; wg < kConsumers; ++wg) {
    std::set<int> seen;
    for (int wtid = 0; wtid < 128; ++wtid) {
      const int warp = wtid / 32, g = (wtid % 32) / 4, t = wtid % 4;
      for (int i = 0; i < kTokens / 2; ++i) {
        const int row = 16 * warp + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * t + i % 2;
        ASSERT_EQ(fused_out_col(wg, wtid, i), kRowsPerConsumer * wg + row);
        ASSERT_EQ(fused_out_row(wtid, i), col);
        ASSERT_TRUE(seen.insert(row * kTokens + col).second);
      }
    }
    EXPECT_EQ(seen.size(), static_cast<std::size_t>(kRowsPerConsumer * kTokens));
  }
}

TEST(FusedTile, SharedMemoryFitsAndTilesCount) {
  EXPECT_LE(kSmemBytes, 227 * 1024);
  EXPECT_EQ(kStageBytes % 1024, 0);
  EXPECT_EQ(kEpilogueOffset % 1024, 0);
  EXPECT_EQ(kFullBarrier % 8, 0);
  EXPECT_EQ(fused_tiles(1, 1), 1);
  EXPECT_EQ(fused_tiles(129, 4096), 2 * 32);
}

// The grouped kernel's slots: each valid expert ceil(rows / kTokens) of them, none for an expert
// kernels/grouped_params.h skips; every slot found in its expert by the binary search, against a
// linear scan over random routings with runs of empty experts. Its layout fits beside the ring.
TEST(FusedTile, GroupedSlotsFindTheirExperts) {
  EXPECT_EQ(grouped_slots(0, 0, 100), 0);
  EXPECT_EQ(grouped_slots(1, 99, 100), 1);
  EXPECT_EQ(grouped_slots(2, 99, 100), 0);  // past the capacity
  EXPECT_EQ(grouped_slots(5, -1, 100), 0);
  EXPECT_EQ(grouped_slots(128, 0, 128), 1);
  EXPECT_EQ(grouped_slots(129, 0, 300), 2);
  // The bound on slots holds for any split of the capacity among experts without overlap.
  EXPECT_EQ(grouped_max_slots(300, 8), 2 + 8);
  EXPECT_EQ(grouped_max_slots(5, 8), 0 + 5);
  EXPECT_EQ(grouped_experts(4096), kGroupedMaxExperts);
  EXPECT_EQ(grouped_experts(7), 7);
  EXPECT_LE(kGroupedSmemBytes, 227 * 1024);
  EXPECT_EQ(kGroupedEpilogueOffset % 1024, 0);
  EXPECT_EQ(kGroupedBarrierOffset % 8, 0);
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 200; ++trial) {
    const int experts = 1 + static_cast<int>(rng() % 70);
    std::vector<int> first(static_cast<std::size_t>(experts) + 1, 0);
    std::int64_t capacity = 0;  // the experts' rows end to end, with no overlap
    for (int e = 0; e < experts; ++e) {
      const int rows = rng() % 3 == 0 ? 0 : static_cast<int>(rng() % 400);
      first[e + 1] = first[e] + grouped_slots(rows, capacity, 1 << 20);
      capacity += rows;
    }
    EXPECT_LE(first[experts], grouped_max_slots(capacity, experts));
    for (int slot = 0; slot < first[experts]; ++slot) {
      int want = 0;
      while (!(first[want] <= slot && slot < first[want + 1])) ++want;
      ASSERT_EQ(grouped_expert_of([&](int i) { return first[i]; }, experts, slot), want)
          << "slot " << slot << " of " << experts << " experts";
    }
  }
}

// A consumer's 16-byte chunk q holds its own row tile's words of steps 2q and 2q + 1 at words rt
// and 2 + rt (the words fused_word_byte names).
TEST(FusedTile, ConsumerChunksHoldTheWarpsWords) {
  for (int wg = 0; wg < kConsumers; ++wg) {
    for (int wtid = 0; wtid < 128; ++wtid) {
      const int rt = (wtid / 32) % 2;
      for (int q = 0; q < kSteps / 2; ++q) {
        const int chunk = fused_chunk_byte(wg, wtid, q);
        EXPECT_EQ(chunk % 16, 0);
        EXPECT_EQ(fused_word_byte(wg, wtid, 2 * q), chunk + 4 * rt);
        EXPECT_EQ(fused_word_byte(wg, wtid, 2 * q + 1), chunk + 4 * (2 + rt));
      }
    }
  }
}

// The epilogue's staging: every (token, column) of a warpgroup's tile at its own bytes, inside
// the warpgroup's 16 KiB, for BF16 rows (128 bytes) and FP32 half-tiles (256); and register i's
// byte is register i % 4's plus 8 (i / 4) token rows, the shortcut the kernel takes.
TEST(FusedTile, EpilogueStagingIsABijectionAndRegistersStepByEightRows) {
  for (const int elem : {2, 4}) {
    const int row_bytes = kRowsPerConsumer * elem, tokens = kEpilogueBytes / row_bytes;
    std::set<std::uint32_t> seen;
    for (int token = 0; token < tokens; ++token) {
      for (int col = 0; col < kRowsPerConsumer; ++col) {
        const std::uint32_t at = fused_stage_offset(token, col * elem, row_bytes);
        EXPECT_LT(at + elem, static_cast<std::uint32_t>(kEpilogueBytes) + 1);
        EXPECT_EQ(at % elem, 0u);
        EXPECT_TRUE(seen.insert(at / elem).second) << token << " " << col;
      }
    }
    for (int wtid = 0; wtid < 128; ++wtid) {
      for (int i = 0; i < kTokens / 2; ++i) {
        const int token = fused_out_row(wtid, i) % tokens, col = tiles::wgmma_acc_row(wtid, i);
        const std::uint32_t first = fused_stage_offset(
            fused_out_row(wtid, i % 4), tiles::wgmma_acc_row(wtid, i % 4) * elem, row_bytes);
        const auto rows = static_cast<std::uint32_t>(((i / 4) % (tokens / 8)) * 8 * row_bytes);
        EXPECT_EQ(fused_stage_offset(token, col * elem, row_bytes), first + rows)
            << wtid << " " << i;
      }
    }
  }
}

// The band order visits every tile once; within a band, consecutive tiles walk M first, so a
// wave of blocks shares a few weight slabs and the band's activations.
TEST(FusedTile, TheBandOrderIsAPermutationOfTheTiles) {
  for (const int m_tiles : {1, 3, 7, 32}) {
    for (const int n_tiles : {1, 5, 224}) {
      for (const int band : {1, 2, 3, 24, 32}) {
        if (band > m_tiles) continue;
        std::set<std::pair<int, int>> seen;
        for (int t = 0; t < m_tiles * n_tiles; ++t) {
          const TileCoords c = fused_tile_coords(t, m_tiles, n_tiles, band);
          ASSERT_GE(c.m_tile, 0);
          ASSERT_LT(c.m_tile, m_tiles);
          ASSERT_GE(c.n_tile, 0);
          ASSERT_LT(c.n_tile, n_tiles);
          ASSERT_TRUE(seen.insert({c.m_tile, c.n_tile}).second)
              << t << " of " << m_tiles << "x" << n_tiles << " band " << band;
          if (t + 1 < m_tiles * n_tiles && (t + 1) % (band * n_tiles) != 0) {
            const TileCoords d = fused_tile_coords(t + 1, m_tiles, n_tiles, band);
            EXPECT_TRUE(d.n_tile == c.n_tile || d.n_tile == c.n_tile + 1);
          }
        }
      }
    }
  }
  // The band: kBandBytes of activations, clamped to [1, m_tiles]. K = 4096: 1 MiB a tile, 24.
  EXPECT_EQ(fused_band(32, 4096), 24);
  EXPECT_EQ(fused_band(8, 4096), 8);
  EXPECT_EQ(fused_band(32, 1 << 20), 1);
}

}  // namespace
}  // namespace metrale::fused
