// gemm_fused's fragments on the host: one block tile of C computed the way the kernel computes
// it, stage by stage, with the kernel's own per-thread code (cuda/kernels/fused_sm90.cuh:
// the producer's word transpose, the consumers' scale pairs and A fragments from the
// decode-layout words, the epilogue's final_bf16) and the index math it uses
// (kernels/fused_tile.h), and each wgmma m64n128k16 RS step computed from the 128 threads'
// A registers and the shared-memory B tile by the PTX ISA's rules, written out here
// independently: the A fragment (9.7.15.5.1.1.1: warp w's rows 16w.., mma.m16n8k16's A
// layout), the B tile read through its descriptor's fields with the 128-byte swizzle on the
// address, and the D fragment. C (poisoned first) is compared against a float64 product of the
// source weights. What this does not run: the kernel's pipeline (mbarriers, the bulk copies,
// the loops and their pointer math), which the stage assembly below mirrors; that needs a GPU.
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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/decode_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/decode_pack.h"

namespace metrale {
namespace {

namespace dl = metrale::decode_layout;
namespace fu = metrale::fused;

constexpr std::uint16_t kPoisonC = 0x7FC1;  // a BF16 NaN: an element nobody writes fails

// The address wgmma reads B element (kk, n) of a K-major BF16 tile at, from the descriptor's
// fields: start, stride between 8-row groups, 128-byte rows, the 128-byte swizzle (address
// bits 4-6 XOR bits 7-9; the tile's atoms are 1024-aligned).
std::uint32_t b_address(std::uint64_t desc, int n, int kk) {
  const auto start = static_cast<std::uint32_t>(desc & 0x3FFFu) << 4;
  const auto sbo = static_cast<std::uint32_t>((desc >> 32) & 0x3FFFu) << 4;
  const std::uint32_t linear = start + static_cast<std::uint32_t>(n / 8) * sbo +
                               static_cast<std::uint32_t>(n % 8) * 128u +
                               2u * static_cast<std::uint32_t>(kk);
  return linear ^ (((linear >> 7) & 7u) << 4);
}

float bf16_half(std::uint32_t reg, int half) {
  return num::bf16_to_f32(static_cast<std::uint16_t>(reg >> (16 * half)));
}

// One wgmma.mma_async.m64n128k16.f32.bf16.bf16 with A from registers: d[thread][i] += A · B.
// A element (r, kk) is in thread 32 (r / 16) + 4 ((r % 16) % 8) + (kk % 8) / 2, register
// (r % 16 >= 8) + 2 (kk >= 8), half kk % 2. D element (r, n) is register
// 4 (n / 8) + 2 ((r % 16) / 8) + n % 2 of thread 32 (r / 16) + 4 ((r % 16) % 8) + (n % 8) / 2.
// FP32 sums in k order (products of BF16 are exact).
void wgmma_rs(float (&d)[128][64], const std::uint32_t (&a)[128][4], const std::uint8_t* smem,
              std::uint32_t smem_base, std::uint64_t desc) {
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < 128; ++n) {
      const int dt = 32 * (r / 16) + 4 * ((r % 16) % 8) + (n % 8) / 2;
      const int di = 4 * (n / 8) + 2 * ((r % 16) / 8) + n % 2;
      float sum = d[dt][di];
      for (int kk = 0; kk < 16; ++kk) {
        const int at = 32 * (r / 16) + 4 * ((r % 16) % 8) + (kk % 8) / 2;
        const int reg = ((r % 16) >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0);
        std::uint16_t b = 0;
        std::memcpy(&b, smem + (b_address(desc, n, kk) - smem_base), 2);
        sum += bf16_half(a[at][reg], kk % 2) * num::bf16_to_f32(b);
      }
      d[dt][di] = sum;
    }
  }
}

HostQuantWeights random_weights(bool mx, std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  HostQuantWeights w;
  w.format = mx ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
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

// C[m, n] of one block tile (M tile 0, N tile 0) the kernel's way; C is M x N, poisoned.
std::vector<std::uint16_t> fused_tile_c(const ops::PackedDecodeWeights& pk, bool mx,
                                        const std::vector<std::uint16_t>& a,
                                        const std::vector<std::uint16_t>& bias, std::int64_t m) {
  const std::int64_t n = pk.n, k = pk.k, kb_count = dl::k_blocks(k);
  const int per = dl::scale_bytes_per_lane(mx);
  const int dtiles = static_cast<int>(dl::padded_n(n) / dl::kTileN);
  std::vector<std::uint16_t> c(static_cast<std::size_t>(m * n), kPoisonC);
  GemmParams p;
  p.m = m;
  p.n = n;
  p.k = k;
  p.tensor_scale = pk.tensor_scale;
  p.flags = kGemmDecodePacked | (mx ? kGemmMxfp4 : 0u) | (bias.empty() ? 0u : kGemmBias);
  p.bias =
      bias.empty() ? 0 : static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(bias.data()));
  p.out = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(c.data()));
  const float fold = std::ldexp(1.0f, pk.fold);
  std::uint32_t table[dl::kTableEntries];
  std::memcpy(table, pk.scales.data(), sizeof table);

  static float acc[fu::kConsumers][128][64];
  std::memset(acc, 0, sizeof acc);
  const std::uint32_t base = 1024u * 5;  // the stage's shared address: 1024-aligned
  std::vector<std::uint8_t> stage(fu::kStageBytes);
  for (std::int64_t kb = 0; kb < kb_count; ++kb) {
    // The stage as the producer fills it: bulk copies of each existing decode tile's codes and
    // scale codes (a missing tile's bytes stay poison: rows nobody stores), and the activations
    // in 16-byte chunks, zero past M and K, transposed by the kernel's fused_transpose.
    std::memset(stage.data(), 0xFF, stage.size());
    for (int q = 0; q < fu::kTilesPerBlock && q < dtiles; ++q) {
      const std::int64_t block = q * kb_count + kb;
      std::memcpy(stage.data() + fu::kCodeOffset + q * dl::kTileBlockBytes,
                  pk.codes.data() + block * dl::kTileBlockBytes, dl::kTileBlockBytes);
      std::memcpy(stage.data() + fu::kScaleOffset + q * fu::kScaleSlotBytes,
                  pk.scales.data() + dl::kTableBytes + block * dl::kLanes * per, dl::kLanes * per);
    }
    for (int token = 0; token < fu::kTokens; ++token) {
      for (int u = 0; u < 4; ++u) {
        uint4 src[4], dst[4];
        for (int t = 0; t < 4; ++t) {
          const std::int64_t kk = kb * fu::kKBlock + 32 * t + 8 * u;
          src[t] = make_uint4(0, 0, 0, 0);
          if (token < m && kk < k) std::memcpy(&src[t], a.data() + token * k + kk, 16);
        }
        kernels::fused_transpose(src, dst);
        for (int d = 0; d < 4; ++d) {
          std::memcpy(stage.data() + fu::fused_act_chunk_offset(token, u, d), &dst[d], 16);
        }
      }
    }
    // Each consumer warpgroup: its threads' fragments by the kernel's code, then 8 wgmmas.
    for (int wg = 0; wg < fu::kConsumers; ++wg) {
      static std::uint32_t frag[fu::kSteps][128][4];
      for (int wtid = 0; wtid < 128; ++wtid) {
        const int lane = wtid % 32, rt = (wtid / 32) % 2, tile = 2 * wg + wtid / 64;
        uint2 sc{0, 0};
        std::memcpy(&sc, stage.data() + fu::kScaleOffset + tile * fu::kScaleSlotBytes + lane * per,
                    static_cast<std::size_t>(per));
        std::uint32_t sp[2][2];
        if (mx) {
          kernels::fused_scale_pairs<true>(sc, rt, table, sp);
        } else {
          kernels::fused_scale_pairs<false>(sc, rt, table, sp);
        }
        for (int s = 0; s < fu::kSteps; ++s) {
          std::uint32_t w = 0;
          std::memcpy(&w, stage.data() + fu::kCodeOffset + fu::fused_word_byte(wg, wtid, s), 4);
          kernels::fused_a_fragment(w, sp, s, frag[s][wtid]);
        }
      }
      for (int s = 0; s < fu::kSteps; ++s) {
        wgmma_rs(acc[wg], frag[s], stage.data(), base, fu::fused_b_desc(base, s));
      }
    }
  }
  // The epilogue: fold, tensor scale, bias, BF16, transposed and masked.
  for (int wg = 0; wg < fu::kConsumers; ++wg) {
    for (int wtid = 0; wtid < 128; ++wtid) {
      for (int i = 0; i < 64; ++i) {
        const std::int64_t mm = fu::fused_out_row(wtid, i), nn = fu::fused_out_col(wg, wtid, i);
        if (mm < m && nn < n) {
          c[mm * n + nn] =
              static_cast<std::uint16_t>(kernels::final_bf16(p, nn, acc[wg][wtid][i] * fold));
        }
      }
    }
  }
  return c;
}

void check(bool mx, std::int64_t m, std::int64_t n, std::int64_t k, bool with_bias) {
  const std::string what = std::string(mx ? "MXFP4" : "NVFP4") + " M=" + std::to_string(m) +
                           " N=" + std::to_string(n) + " K=" + std::to_string(k);
  SCOPED_TRACE(what);
  std::mt19937_64 rng(1234 + m + n + k + (mx ? 7 : 0));
  const HostQuantWeights w = random_weights(mx, n, k, rng);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k)), bias;
  for (auto& x : a) x = num::f32_to_bf16(u(rng));
  if (with_bias) {
    bias.resize(static_cast<std::size_t>(n));
    for (auto& x : bias) x = num::f32_to_bf16(u(rng));
  }
  const ops::PackedDecodeWeights pk = ops::pack_for_decode(w);
  const std::vector<std::uint16_t> c = fused_tile_c(pk, mx, a, bias, m);
  int bad = 0;
  double err2 = 0.0, ref2 = 0.0;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0.0, mag = 0.0;
      for (std::int64_t kk = 0; kk < k; ++kk) {
        const double t = double{num::bf16_to_f32(a[i * k + kk])} *
                         double{num::e2m1_to_f32(w.code(j, kk))} *
                         double{w.scale(j, kk)};  // the block scale times the tensor scale
        sum += t;
        mag += std::fabs(t);
      }
      if (with_bias) sum += double{num::bf16_to_f32(bias[j])};
      const double got = num::bf16_to_f32(c[i * n + j]);
      const double tol = std::ldexp(std::fabs(sum), -8) + 1e-4 * mag + 1e-30;
      err2 += (got - sum) * (got - sum);
      ref2 += sum * sum;
      if (!(std::fabs(got - sum) <= tol) && ++bad <= 5) {
        ADD_FAILURE() << "C[" << i << ", " << j << "] = " << got << ", want " << sum;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "elements out of tolerance";
  EXPECT_LT(std::sqrt(err2 / ref2), 1.0 / 256);
}

// A whole block tile (128 tokens x 128 weight rows, two K blocks).
TEST(FusedFragments, FullTileMatchesFloat64) {
  check(false, 128, 128, 256, false);
  check(true, 128, 128, 256, true);
}

// M, N and K short of the tile: masked rows and columns, missing decode tiles (N = 64 leaves the
// second warpgroup's tiles poison) and a partial last K block.
TEST(FusedFragments, PartialTileMatchesFloat64) {
  check(false, 37, 64, 208, true);
  check(true, 100, 96, 160, false);
}

}  // namespace
}  // namespace metrale
