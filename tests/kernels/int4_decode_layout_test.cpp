// The INT4 decode layout (src/kernels/int4_decode_layout.h) and its packer (ops/int4_pack.h),
// checked on the host: the code map is a bijection onto the codes buffer, the side map puts each
// row's entries apart inside the buffer, the exponent-bias fields read 128 + q exactly, and every
// weight read back from the packed buffers (int4_decode::weight, what the kernels compute) equals
// the source's (code − zero) × scale at every stored column, for each group the layout takes, both
// zero-point conventions, both scale types and act order, with the padding reading 0. The dequant
// route's unit (kernels/dequant_int4.h) writes each weight once, rounded once, at its column of K.
#include "kernels/int4_decode_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "core/quant_int4.h"
#include "kernels/dequant_int4.h"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/int4_pack.h"

namespace metrale::int4_decode {
namespace {

std::mt19937_64 seeded() {
  std::random_device rd;
  const std::uint64_t seed = (std::uint64_t{rd()} << 32) | rd();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  return std::mt19937_64(seed);
}

TEST(Int4DecodeLayout, CodeSlotsCoverTheCodesBufferOnce) {
  const std::int64_t n = 72, k = 416;  // two whole tiles and a part; 3 K blocks and a part
  const std::int64_t kb = dl::k_blocks(k);
  std::vector<int> hits(static_cast<std::size_t>(sizes_of(n, k, 32, false).codes * 2), 0);
  for (std::int64_t r = 0; r < dl::padded_n(n); ++r) {
    for (std::int64_t j = 0; j < dl::padded_k(k); ++j) {
      const CodeSlot s = code_slot(r, j, kb);
      ASSERT_EQ(s.byte % 4, 0);
      ASSERT_EQ(s.nibble, s.reg + 4 * s.half);
      ++hits[static_cast<std::size_t>(s.byte * 2 + s.nibble)];
    }
  }
  EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
}

TEST(Int4DecodeLayout, SideSlotsKeepRowsAndEntriesApart) {
  for (const std::int64_t group : {32, 64, 128, 384}) {
    SCOPED_TRACE("group " + std::to_string(group));
    const std::int64_t n = 40, k = group == 384 ? 768 : 512, kb = dl::k_blocks(k);
    const Sizes sz = sizes_of(n, k, group, false);
    std::set<std::int64_t> scales, zeros;
    for (std::int64_t r = 0; r < dl::padded_n(n); ++r) {
      // One slot per row and 32-K span (groups under 128) or per row and K block.
      for (std::int64_t j = 0; j < dl::padded_k(k); j += entries(group) == 1 ? 128 : 32) {
        const SideSlot s = side_slot(r, j, kb, group);
        EXPECT_TRUE(scales.insert(s.scale).second) << "row " << r << " k " << j;
        EXPECT_TRUE(zeros.insert(s.zero).second);
        EXPECT_LE(s.scale + 2, sz.perm);
        EXPECT_LT(s.zero, sz.perm);
      }
    }
  }
}

TEST(Int4DecodeLayout, ExponentBiasReadsEveryNibbleExactly) {
  for (std::uint32_t q = 0; q < 16; ++q) {
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const std::uint32_t w = q << (4 * (j + 4 * half));
        std::uint32_t r[4];
        word_fields(w, r);
        const auto bits = static_cast<std::uint16_t>(r[j] >> (16 * half));
        EXPECT_EQ(num::bf16_to_f32(bits), 128.0f + static_cast<float>(q));
        for (std::uint32_t z = 0; z < 16; ++z) {
          const std::uint32_t d = num::bf16x2_sub(r[j], zero_pair(z));
          EXPECT_EQ(num::bf16_to_f32(static_cast<std::uint16_t>(d >> (16 * half))),
                    static_cast<float>(static_cast<int>(q) - static_cast<int>(z)));
        }
      }
    }
  }
}

struct Case {
  std::int64_t n, k, group;
  bool zero_points, fp16, act_order;
};

HostQuantWeights random_weights(const Case& c, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(c.n * c.k));
  for (float& x : v) x = normal(rng) + (c.zero_points ? 0.7f : 0.0f);
  HostQuantWeights w = quantize_int4(v, c.n, c.k, c.group, c.zero_points, c.fp16);
  if (!c.act_order) return w;
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(c.k));
  for (std::int64_t j = 0; j < c.k; ++j) g_idx[j] = static_cast<std::int32_t>(j / c.group);
  std::shuffle(g_idx.begin(), g_idx.end(), rng);
  return with_act_order(w, g_idx);
}

TEST(Int4DecodeLayout, PackedWeightsReadBackAsTheSource) {
  std::mt19937_64 rng = seeded();
  for (const Case c : {Case{40, 160, 32, true, true, false}, Case{33, 448, 64, false, false, true},
                       Case{72, 384, 128, true, false, true}, Case{9, 768, 256, false, true, false},
                       Case{16, 640, 640, true, true, false}}) {
    SCOPED_TRACE("N " + std::to_string(c.n) + " K " + std::to_string(c.k) + " group " +
                 std::to_string(c.group));
    const HostQuantWeights w = random_weights(c, rng);
    const ops::PackedInt4Weights p = ops::pack_int4_for_decode(w);
    const Sizes sz = sizes_of(c.n, c.k, c.group, c.act_order);
    ASSERT_EQ(static_cast<std::int64_t>(p.codes.size()), sz.codes);
    ASSERT_EQ(static_cast<std::int64_t>(p.side.size()), sz.side);
    int bad = 0;
    for (std::int64_t r = 0; r < dl::padded_n(c.n); ++r) {
      for (std::int64_t j = 0; j < dl::padded_k(c.k); ++j) {
        const double want = r < c.n && j < c.k ? int4::stored_weight(w, r, j) : 0.0;
        if (static_cast<double>(ops::packed_int4_weight(p, r, j)) != want && ++bad <= 5) {
          ADD_FAILURE() << "W[" << r << ", " << j << "] = " << ops::packed_int4_weight(p, r, j)
                        << ", want " << want;
        }
      }
    }
    EXPECT_EQ(bad, 0);
    // The permutation ends the side buffer as int32 [K].
    for (std::int64_t j = 0; c.act_order && j < c.k; ++j) {
      std::int32_t v = 0;
      std::memcpy(&v, p.side.data() + sz.perm + 4 * j, 4);
      ASSERT_EQ(v, w.k_perm[static_cast<std::size_t>(j)]);
    }
    // The dequant route's units: each weight once, bf16((q - z) x s), at its stored column (the
    // act-order flag changes nothing: the GEMM gathers A into that order).
    std::vector<std::uint16_t> out(static_cast<std::size_t>(c.n * c.k), 0x7FC1);
    GemmParams g;
    g.codes = reinterpret_cast<std::uintptr_t>(p.codes.data());
    g.scales = reinterpret_cast<std::uintptr_t>(p.side.data());
    g.out = reinterpret_cast<std::uintptr_t>(out.data());
    g.n = c.n;
    g.k = c.k;
    g.group = c.group;
    g.flags = kGemmInt4 | kGemmDecodePacked | (c.fp16 ? kGemmFp16Scales : 0u) |
              (c.act_order ? kGemmActOrder : 0u);
    for (std::int64_t u = 0; u < dequant_int4::unit_count(c.n, c.k); ++u) dequant_int4::unit(g, u);
    for (std::int64_t r = 0; r < c.n; ++r) {
      for (std::int64_t col = 0; col < c.k; ++col) {
        const auto want = num::f32_to_bf16(static_cast<float>(int4::stored_weight(w, r, col)));
        ASSERT_EQ(out[static_cast<std::size_t>(r * c.k + col)], want) << r << ", " << col;
      }
    }
  }
}

TEST(Int4DecodeLayout, GroupsTheLayoutDoesNotTakeAreRefusedByName) {
  std::mt19937_64 rng = seeded();
  const HostQuantWeights w = random_weights(Case{8, 96, 96, true, false, false}, rng);
  const Error e = metrale::testing::expect_error([&] { (void)ops::pack_int4_for_decode(w); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("groups of 96 (K = 96) have no decode layout"),
            std::string::npos)
      << e.what();
}

}  // namespace
}  // namespace metrale::int4_decode
