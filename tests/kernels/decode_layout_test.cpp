// The decode layout (src/kernels/decode_layout.h), checked on the host without a GPU: its bit and
// byte maps are bijections, a warp's loads are contiguous, and one warp's data path, emulated
// lane by lane from the layout and multiplied by the PTX ISA's m16n8k16 fragment rules, gives
// the dot products exactly. The packer here is the test's own, written from the header alone, so
// that it checks the header's description rather than the production packer (ops/decode_pack).
#include "kernels/decode_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "metrale/numerics.h"

namespace metrale::decode_layout {
namespace {

std::uint64_t fresh_seed() {
  std::random_device rd;
  const std::uint64_t seed = (std::uint64_t{rd()} << 32) | rd();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

std::string seed_text(std::uint64_t seed) {
  return "seed " + std::to_string(seed);
}

std::uint32_t load_u32(const std::vector<std::uint8_t>& buf, std::int64_t at) {
  const auto i = static_cast<std::size_t>(at);
  return buf[i] | std::uint32_t{buf[i + 1]} << 8 | std::uint32_t{buf[i + 2]} << 16 |
         std::uint32_t{buf[i + 3]} << 24;
}

void store_u32(std::vector<std::uint8_t>& buf, std::int64_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) buf[static_cast<std::size_t>(at) + i] = (v >> (8 * i)) & 0xFFu;
}

double bf16_half(std::uint32_t pair, int half) {
  return num::bf16_to_f32(static_cast<std::uint16_t>(pair >> (16 * half)));
}

// ---- the test's own packer ----

// The bits of E2M1 `code` at register `reg`, half `half` of a word, by code_bit_position.
std::uint32_t place_code(int reg, int half, std::uint8_t code) {
  std::uint32_t w = 0;
  for (int bit = 0; bit < 4; ++bit) {
    if (((code >> bit) & 1u) != 0) w |= 1u << code_bit_position(reg, half, bit);
  }
  return w;
}

// A word from its 8 codes, [reg][half].
std::uint32_t pack_word(const std::uint8_t (&codes)[4][2]) {
  std::uint32_t w = 0;
  for (int reg = 0; reg < 4; ++reg) {
    for (int half = 0; half < 2; ++half) w |= place_code(reg, half, codes[reg][half]);
  }
  return w;
}

// The E2M1 code held by half `half` of a dequantized register: sign at bit 15, e1 e0 m at 8..6.
std::uint8_t field_code(std::uint32_t reg, int half) {
  const std::uint32_t h = reg >> (16 * half);
  return static_cast<std::uint8_t>(((h >> 6) & 7u) | ((h >> 12) & 8u));
}

struct Weights {
  std::int64_t n = 0, k = 0;
  bool mx = false;
  std::vector<std::uint8_t> codes;   // [n][k], one E2M1 code a byte
  std::vector<std::uint8_t> scales;  // [n][k / group], E4M3 (NVFP4) or E8M0 (MXFP4) codes
  int group() const { return mx ? num::kMxfp4Group : num::kNvfp4Group; }
  std::uint8_t code(std::int64_t r, std::int64_t c) const {
    return codes[static_cast<std::size_t>(r * k + c)];
  }
  std::uint8_t scale_code(std::int64_t r, std::int64_t c) const {
    return scales[static_cast<std::size_t>(r * (k / group()) + c / group())];
  }
  double scale(std::int64_t r, std::int64_t c) const {
    const std::uint8_t s = scale_code(r, c);
    return mx ? std::ldexp(1.0, s - 127) : num::e4m3_to_f32(s);
  }
};

struct Packed {
  std::vector<std::uint8_t> codes, scales;
  int fold = 0;
  std::int64_t kb_count = 0;
};

// Planted faults for the demonstrations in the report; all false in the tree.
constexpr bool kFaultSwapHalves = false;
constexpr bool kFaultSwapSignMantissa = false;

// The table entry of a scale code: the scale times 2^(126 - fold) as a BF16 pair.
std::uint32_t table_entry(std::uint8_t code, bool mx, int fold) {
  const double s = mx ? (code == 0xFF ? NAN : std::ldexp(1.0, code - 127)) : num::e4m3_to_f32(code);
  return num::bf16_pair_of(static_cast<float>(std::ldexp(s, 126 - fold)));
}

// W into the two device buffers by code_slot, code_bit_position and scale_byte. MXFP4 folds so
// that the largest E8M0 code present becomes the scale 1 (its table entry 2^126).
Packed pack(const Weights& w) {
  Packed p;
  p.kb_count = k_blocks(w.k);
  p.codes.assign(static_cast<std::size_t>(code_bytes(w.n, w.k)), 0);
  p.scales.assign(static_cast<std::size_t>(scale_bytes(w.n, w.k, w.mx)), 0);
  for (std::int64_t n = 0; n < w.n; ++n) {
    for (std::int64_t k = 0; k < w.k; ++k) {
      const CodeSlot slot = code_slot(n, k, p.kb_count);
      std::uint8_t c = w.code(n, k);
      if (kFaultSwapSignMantissa)
        c = static_cast<std::uint8_t>((c & 6u) | (c >> 3) | (c & 1u) << 3);
      const int half = kFaultSwapHalves ? 1 - slot.half : slot.half;
      store_u32(p.codes, slot.byte, load_u32(p.codes, slot.byte) | place_code(slot.reg, half, c));
    }
  }
  int largest = 0;
  for (std::int64_t n = 0; n < w.n; ++n) {
    for (std::int64_t k = 0; k < w.k; k += w.group()) {
      p.scales[static_cast<std::size_t>(scale_byte(n, k, p.kb_count, w.mx))] = w.scale_code(n, k);
      largest = std::max<int>(largest, w.scale_code(n, k));
    }
  }
  p.fold = w.mx ? largest - 127 : kNvfp4Fold;
  for (int c = 0; c < kTableEntries; ++c) {
    store_u32(p.scales, 4 * c, table_entry(static_cast<std::uint8_t>(c), w.mx, p.fold));
  }
  return p;
}

// ---- the PTX ISA's m16n8k16 .bf16 MMA, emulated ----

// Planted faults: rows g and g + 8 of A swapped; group s % 4 in place of s / 4.
constexpr bool kFaultSwapARows = false;
constexpr bool kFaultGroupMod = false;

// D += A B over the warp's registers, scattered by the PTX ISA's fragment layouts (groupID g =
// lane / 4, threadID_in_group t = lane % 4; a register's low half is its first element):
//   A 16x16: a0 a1 (row g, cols 2t, 2t+1), a2 a3 (row g+8, same), a4 a5 (row g, cols 2t+8, 2t+9),
//            a6 a7 (row g+8, cols 2t+8, 2t+9); register i holds a(2i), a(2i+1).
//   B 16x8:  b0 b1 (rows 2t, 2t+1; col g), b2 b3 (rows 2t+8, 2t+9; col g).
//   C/D 16x8: c0 c1 (row g, cols 2t, 2t+1), c2 c3 (row g+8, cols 2t, 2t+1).
// The products and sums are in double. Every element of A and B must be written exactly once.
void mma_m16n8k16(const std::uint32_t (&a)[kLanes][4], const std::uint32_t (&b)[kLanes][2],
                  double (&d)[kLanes][4]) {
  double am[16][16] = {}, bm[16][8] = {};
  int a_hits[16][16] = {}, b_hits[16][8] = {};
  for (int lane = 0; lane < kLanes; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 8; ++i) {
      int row = g + ((i / 2) % 2 == 1 ? 8 : 0);
      if (kFaultSwapARows) row ^= 8;
      const int col = 2 * t + i % 2 + (i >= 4 ? 8 : 0);
      am[row][col] = bf16_half(a[lane][i / 2], i % 2);
      ++a_hits[row][col];
    }
    for (int i = 0; i < 4; ++i) {
      const int row = 2 * t + i % 2 + (i >= 2 ? 8 : 0);
      bm[row][g] = bf16_half(b[lane][i / 2], i % 2);
      ++b_hits[row][g];
    }
  }
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) ASSERT_EQ(a_hits[r][c], 1) << "A " << r << " " << c;
    for (int c = 0; c < 8; ++c) ASSERT_EQ(b_hits[r][c], 1) << "B " << r << " " << c;
  }
  for (int lane = 0; lane < kLanes; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
      double sum = 0;
      for (int kk = 0; kk < 16; ++kk) sum += am[row][kk] * bm[kk][col];
      d[lane][i] += sum;
    }
  }
}

// ---- one warp over one tile, emulated ----

// The warp that multiplies tile `tile` by activations acts[m][k] (BF16, m < m_rows <= 16), the
// way the layout says a lane reads it: out[n local][m] is the dot product times 2^fold undone.
// Each word's reading is cross-checked against code_slot, each scale byte against scale_byte.
void emulate_tile(const Weights& w, const Packed& p, std::int64_t tile,
                  const std::vector<std::uint16_t>& acts, int m_rows, double (&out)[kTileN][16]) {
  double acc[2][2][kLanes][4] = {};  // [row tile][n8 activation tile][lane][c]
  const int per = scale_bytes_per_lane(w.mx);
  for (std::int64_t kb = 0; kb < p.kb_count; ++kb) {
    const std::int64_t block = tile * p.kb_count + kb;
    for (int s = 0; s < 8; ++s) {
      std::uint32_t a[2][kLanes][4], b[2][kLanes][2];
      for (int lane = 0; lane < kLanes; ++lane) {
        const int g = lane / 4, t = lane % 4;
        // The lane's 16-byte chunk s / 2 of the block (chunks of the warp's 32 lanes follow one
        // another), word 2 (s % 2) + rt of it.
        const std::int64_t chunk =
            block * kTileBlockBytes + (s / 2) * (kLanes * kChunkBytes) + lane * kChunkBytes;
        const std::int64_t lane_scales = kTableBytes + (block * kLanes + lane) * per;
        for (int rt = 0; rt < 2; ++rt) {
          const std::int64_t at = chunk + 4 * (2 * (s % 2) + rt);
          std::uint32_t regs[4];
          dequant_word_fields(load_u32(p.codes, at), regs);
          for (int j = 0; j < 4; ++j) {
            const int r = 2 * rt + j % 2;  // row slot: row g + 8 r of the tile
            const std::int64_t n = tile * kTileN + g + 8 * r;
            const std::int64_t k0 = kb * kBlockK + 32 * t + 4 * s + 2 * (j / 2);
            for (int half = 0; half < 2; ++half) {
              const CodeSlot slot = code_slot(n, k0 + half, p.kb_count);
              ASSERT_EQ(slot.byte, at) << "n " << n << " k " << k0 + half;
              ASSERT_EQ(slot.reg, j) << "n " << n << " k " << k0 + half;
              ASSERT_EQ(slot.half, half) << "n " << n << " k " << k0 + half;
            }
            const int group = kFaultGroupMod ? s % 4 : s / 4;
            const std::int64_t sb = lane_scales + (w.mx ? r : 2 * r + group);
            ASSERT_EQ(sb, scale_byte(n, k0, p.kb_count, w.mx)) << "n " << n << " k " << k0;
            const std::uint32_t pair =
                load_u32(p.scales, 4 * p.scales[static_cast<std::size_t>(sb)]);
            a[rt][lane][j] = num::bf16x2_mul(regs[j], pair);
          }
        }
        // B: column g of n8 tile mt is activation row 8 mt + g; its registers for step s are
        // the lane's BF16 words 2 s and 2 s + 1 of its 32 K of the block.
        for (int mt = 0; mt < 2; ++mt) {
          const int m = 8 * mt + g;
          for (int i = 0; i < 2; ++i) {
            const std::int64_t k = kb * kBlockK + 32 * t + 4 * s + 2 * i;
            const auto at = [&](std::int64_t kk) -> std::uint32_t {
              return m < m_rows && kk < w.k ? acts[static_cast<std::size_t>(m * w.k + kk)] : 0;
            };
            b[mt][lane][i] = at(k) | at(k + 1) << 16;
          }
        }
      }
      for (int rt = 0; rt < 2; ++rt) {
        for (int mt = 0; mt < 2; ++mt) mma_m16n8k16(a[rt], b[mt], acc[rt][mt]);
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  for (int lane = 0; lane < kLanes; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int rt = 0; rt < 2; ++rt) {
      for (int mt = 0; mt < 2; ++mt) {
        for (int i = 0; i < 4; ++i) {
          const int n = 16 * rt + g + (i >= 2 ? 8 : 0), m = 8 * mt + 2 * t + i % 2;
          out[n][m] = std::ldexp(acc[rt][mt][lane][i], p.fold);
        }
      }
    }
  }
}

// Random E2M1 codes, scale codes (E4M3 without its NaNs; E8M0 in a window of 24 codes from
// `mx_base`, or from a random base when it is negative) and BF16 activations.
Weights random_weights(std::mt19937_64& gen, std::int64_t n, std::int64_t k, bool mx, int mx_base) {
  Weights w;
  w.n = n;
  w.k = k;
  w.mx = mx;
  w.codes.resize(static_cast<std::size_t>(n * k));
  for (auto& c : w.codes) c = static_cast<std::uint8_t>(gen() & 0xFu);
  w.scales.resize(static_cast<std::size_t>(n * (k / w.group())));
  const int base = mx_base >= 0 ? mx_base : static_cast<int>(gen() % (255 - 24));
  for (auto& s : w.scales) {
    if (mx) {
      s = static_cast<std::uint8_t>(base + static_cast<int>(gen() % 24));
    } else {
      do {
        s = static_cast<std::uint8_t>(gen());
      } while ((s & 0x7Fu) == 0x7Fu);
    }
  }
  return w;
}

std::vector<std::uint16_t> random_acts(std::mt19937_64& gen, int m, std::int64_t k) {
  std::normal_distribution<float> nd;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k));
  for (auto& x : a) x = num::f32_to_bf16(nd(gen));
  return a;
}

struct Case {
  bool mx = false;
  std::int64_t n = 0, k = 0;  // N and K need not be whole tiles and K blocks
  int m_rows = 0;             // activation rows, 1..16
  int mx_base = -1;           // the E8M0 window's first code; negative: random
};

// Every warp of W, emulated, against C^T[n][m] = sum_k A[m][k] e2m1(W[n,k]) scale(n,k) in
// double; the error is normalized by the sum of the terms' magnitudes (the products are exact,
// so only the double sums' rounding remains). Padding rows and activation columns must be 0.
void check_data_path(const Case& c) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_text(seed) + (c.mx ? " MXFP4" : " NVFP4") + " N " + std::to_string(c.n) +
               " K " + std::to_string(c.k) + " M " + std::to_string(c.m_rows) + " E8M0 base " +
               std::to_string(c.mx_base));
  std::mt19937_64 gen(seed);
  const Weights w = random_weights(gen, c.n, c.k, c.mx, c.mx_base);
  const std::vector<std::uint16_t> acts = random_acts(gen, c.m_rows, c.k);
  const Packed p = pack(w);
  double worst = 0;
  for (std::int64_t tile = 0; tile < padded_n(c.n) / kTileN; ++tile) {
    double out[kTileN][16];
    emulate_tile(w, p, tile, acts, c.m_rows, out);
    if (::testing::Test::HasFatalFailure()) return;
    for (int nl = 0; nl < kTileN; ++nl) {
      const std::int64_t n = tile * kTileN + nl;
      for (int m = 0; m < 16; ++m) {
        if (m >= c.m_rows || n >= c.n) {
          ASSERT_EQ(out[nl][m], 0.0) << "padding: n " << n << " m " << m;
          continue;
        }
        double want = 0, mag = 0;
        for (std::int64_t kk = 0; kk < c.k; ++kk) {
          const double term = num::bf16_to_f32(acts[static_cast<std::size_t>(m * c.k + kk)]) *
                              num::e2m1_to_f32(w.code(n, kk)) * w.scale(n, kk);
          want += term;
          mag += std::fabs(term);
        }
        const double err = mag > 0 ? std::fabs(out[nl][m] - want) / mag : std::fabs(out[nl][m]);
        worst = std::max(worst, err);
        ASSERT_LE(err, 1e-14) << "n " << n << " m " << m << " got " << out[nl][m] << " want "
                              << want;
      }
    }
  }
  std::printf("worst normalized error %.3g\n", worst);
}

TEST(DecodeLayoutEmulation, OneWarpPerTileGivesTheNvfp4DotProducts) {
  check_data_path({false, 2 * kTileN, kBlockK, 16});
  check_data_path({false, 2 * kTileN, 2 * kBlockK, 16});
  check_data_path({false, 2 * kTileN, 2 * kBlockK, 1});
  check_data_path({false, kTileN, kBlockK, 11});
  check_data_path({false, 40, 176, 16});  // padded to 2 tiles x 2 K blocks
}

// E8M0 windows at both ends of the finite codes too: 0..23 (code 0 is 2^-127) and 231..254.
TEST(DecodeLayoutEmulation, OneWarpPerTileGivesTheMxfp4DotProducts) {
  check_data_path({true, 2 * kTileN, kBlockK, 16});
  check_data_path({true, 2 * kTileN, 2 * kBlockK, 16});
  check_data_path({true, 2 * kTileN, 2 * kBlockK, 3});
  check_data_path({true, 2 * kTileN, 2 * kBlockK, 16, 0});
  check_data_path({true, 2 * kTileN, 2 * kBlockK, 16, 254 - 23});
  check_data_path({true, 40, 160, 7});  // padded to 2 tiles x 2 K blocks
}

// ---- the bit maps ----

TEST(DecodeLayoutBits, CodeBitPositionIsABijectionOntoTheWord) {
  std::set<int> seen;
  for (int reg = 0; reg < 4; ++reg) {
    for (int half = 0; half < 2; ++half) {
      for (int bit = 0; bit < 4; ++bit) {
        const int pos = code_bit_position(reg, half, bit);
        EXPECT_GE(pos, 0);
        EXPECT_LT(pos, 32);
        EXPECT_TRUE(seen.insert(pos).second) << reg << " " << half << " " << bit;
      }
    }
  }
  EXPECT_EQ(seen.size(), 32u);
}

// Every code value in every slot, with random codes elsewhere: the dequantized register holds it
// at sign 15, e1 e0 m 8..6, nothing outside the fields, and reads as its E2M1 value x 2^-126.
TEST(DecodeLayoutBits, DequantOfAPackedWordGivesBackEveryCodeInEverySlot) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed_text(seed));
  std::mt19937_64 gen(seed);
  for (int reg = 0; reg < 4; ++reg) {
    for (int half = 0; half < 2; ++half) {
      for (int code = 0; code < 16; ++code) {
        for (int trial = 0; trial < 64; ++trial) {
          std::uint8_t codes[4][2];
          for (auto& row : codes) {
            for (auto& c : row) c = static_cast<std::uint8_t>(trial == 0 ? code : gen() & 0xFu);
          }
          codes[reg][half] = static_cast<std::uint8_t>(code);
          std::uint32_t regs[4];
          dequant_word_fields(pack_word(codes), regs);
          for (int j = 0; j < 4; ++j) {
            ASSERT_EQ(regs[j] & ~kFieldMask, 0u) << "reg " << j;
            for (int h = 0; h < 2; ++h) {
              ASSERT_EQ(field_code(regs[j], h), codes[j][h]) << "reg " << j << " half " << h;
              ASSERT_EQ(bf16_half(regs[j], h),
                        std::ldexp(num::e2m1_to_f32(codes[j][h]), kValueExponent))
                  << "reg " << j << " half " << h << " code " << int{codes[j][h]};
            }
          }
        }
      }
    }
  }
}

// ---- the byte maps ----

// Two tiles x 2 K blocks: every (n, k) has its own (word, register, half), the words are aligned
// and hold 8 codes each, and they fill the codes buffer exactly.
TEST(DecodeLayoutBytes, CodeSlotIsABijectionOntoTheCodesBuffer) {
  const std::int64_t n_rows = 2 * kTileN, k = 2 * kBlockK, kbc = k_blocks(k);
  ASSERT_EQ(kbc, 2);
  std::set<std::tuple<std::int64_t, int, int>> seen;
  std::vector<int> per_word(static_cast<std::size_t>(code_bytes(n_rows, k) / 4), 0);
  for (std::int64_t n = 0; n < n_rows; ++n) {
    for (std::int64_t kk = 0; kk < k; ++kk) {
      const CodeSlot s = code_slot(n, kk, kbc);
      ASSERT_EQ(s.byte % 4, 0) << n << " " << kk;
      ASSERT_GE(s.byte, 0);
      ASSERT_LT(s.byte, code_bytes(n_rows, k));
      ASSERT_GE(s.reg, 0);
      ASSERT_LT(s.reg, 4);
      ASSERT_GE(s.half, 0);
      ASSERT_LT(s.half, 2);
      ASSERT_TRUE(seen.insert({s.byte, s.reg, s.half}).second) << n << " " << kk;
      ++per_word[static_cast<std::size_t>(s.byte / 4)];
    }
  }
  for (std::size_t i = 0; i < per_word.size(); ++i) EXPECT_EQ(per_word[i], 8) << "word " << i;
  EXPECT_EQ(code_bytes(n_rows, k), n_rows * k / 2);
}

// Each (n, scale group) of two tiles x 2 K blocks has its own byte, after the table, and the
// bytes fill the scales buffer exactly; one byte serves a whole group.
TEST(DecodeLayoutBytes, ScaleByteIsABijectionOntoTheScaleCodes) {
  for (const bool mx : {false, true}) {
    const std::int64_t n_rows = 2 * kTileN, k = 2 * kBlockK, kbc = k_blocks(k);
    const int group = mx ? num::kMxfp4Group : num::kNvfp4Group;
    std::set<std::int64_t> seen;
    for (std::int64_t n = 0; n < n_rows; ++n) {
      for (std::int64_t kk = 0; kk < k; ++kk) {
        const std::int64_t b = scale_byte(n, kk, kbc, mx);
        ASSERT_EQ(b, scale_byte(n, kk / group * group, kbc, mx)) << mx << " " << n << " " << kk;
        if (kk % group == 0) {
          ASSERT_TRUE(seen.insert(b).second) << mx << " " << n << " " << kk;
        }
      }
    }
    EXPECT_EQ(static_cast<std::int64_t>(seen.size()), n_rows * k / group) << mx;
    EXPECT_EQ(*seen.begin(), kTableBytes) << mx;
    EXPECT_EQ(*seen.rbegin() + 1, scale_bytes(n_rows, k, mx)) << mx;
  }
}

// Chunk q of a tile's K block, loaded by the 32 lanes at once (16 bytes each, lane L at L x 16),
// is 512 contiguous bytes aligned to 512: four whole 128-byte lines. The scale codes of a block
// are likewise one contiguous run, 8 (4) bytes a lane in lane order.
TEST(DecodeLayoutBytes, AWarpsLoadOfAChunkIsContiguous) {
  const std::int64_t kbc = 3;
  for (std::int64_t tile = 0; tile < 2; ++tile) {
    for (std::int64_t kb = 0; kb < kbc; ++kb) {
      for (int q = 0; q < kChunks; ++q) {
        std::set<std::int64_t> bytes;
        std::int64_t first = -1;
        for (int lane = 0; lane < kLanes; ++lane) {
          const int g = lane / 4, t = lane % 4;
          std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = -1;
          for (int r = 0; r < 4; ++r) {
            for (int s = 2 * q; s < 2 * q + 2; ++s) {
              for (int j = 0; j < 4; ++j) {
                const CodeSlot slot =
                    code_slot(tile * kTileN + g + 8 * r, kb * kBlockK + 32 * t + 4 * s + j, kbc);
                lo = std::min(lo, slot.byte);
                hi = std::max(hi, slot.byte + 4);
                for (int i = 0; i < 4; ++i) bytes.insert(slot.byte + i);
              }
            }
          }
          ASSERT_EQ(hi - lo, kChunkBytes) << "lane " << lane << " chunk " << q;
          ASSERT_EQ(lo % kChunkBytes, 0);
          if (lane == 0) first = lo;
          ASSERT_EQ(lo, first + lane * kChunkBytes) << "lane " << lane << " chunk " << q;
        }
        ASSERT_EQ(first % (kLanes * kChunkBytes), 0);
        ASSERT_EQ(static_cast<std::int64_t>(bytes.size()), kLanes * kChunkBytes);
        ASSERT_EQ(*bytes.begin(), first);
        ASSERT_EQ(*bytes.rbegin(), first + kLanes * kChunkBytes - 1);
      }
      for (const bool mx : {false, true}) {
        const int per = scale_bytes_per_lane(mx);
        const std::int64_t base = kTableBytes + (tile * kbc + kb) * kLanes * per;
        for (int lane = 0; lane < kLanes; ++lane) {
          const int g = lane / 4, t = lane % 4;
          for (int r = 0; r < 4; ++r) {
            for (int kk = 0; kk < 32; kk += 16) {
              const std::int64_t b =
                  scale_byte(tile * kTileN + g + 8 * r, kb * kBlockK + 32 * t + kk, kbc, mx);
              ASSERT_GE(b, base + lane * per) << mx << " lane " << lane;
              ASSERT_LT(b, base + (lane + 1) * per) << mx << " lane " << lane;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace metrale::decode_layout
