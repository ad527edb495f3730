// The INT4 decode kernel's own source (cuda/kernels/decode_int4.cuh) run on the host on weights
// packed by ops::pack_int4_for_decode, every block of the grid with its 256 threads as fibers and
// the warp MMA emulated from the PTX ISA's fragment rules (cuda_host.h), arguments filled as
// ops/gemm.cpp fills them, with and without split-K (split_reduce.cuh's own code sums the slices).
// Act order runs the way the op runs it: permute_a_int4's code (kernels/int4_permute.h) gathers A
// into the stored order, then the kernel. C, poisoned first, is compared with a float64 product
// of the source weights (W[n, k] = (q - z) x scale in K's own order); a poisoned tail past C must
// stay. What this reaches that the layout's tests cannot: the kernel's pointer math per warp and
// lane, the exponent-bias fields, the zero pairs made by PRMT, the span sums scaled per row, the
// register-set rotation, the partial last K block and M beyond 16.
#include "cuda_host.h"  // first: the CUDA language on the host

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wshadow"
#include "cuda/kernels/decode_int4.cuh"
// split_reduce.cuh defines split_reduce out of line, and decode_host_test.cpp's copy is the one
// this program links: this translation unit's copy takes another name.
#define split_reduce int4_host_test_split_reduce
#include "cuda/kernels/split_reduce.cuh"
#undef split_reduce
#pragma GCC diagnostic pop

#include <gtest/gtest.h>

#include "host_data.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/quant_int4.h"
#include "kernels/gemm_params.h"
#include "kernels/int4_permute.h"
#include "kernels/tile_math.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "ops/int4_pack.h"

namespace metrale {
namespace {

namespace emu = metrale::emulation;
using emu::address;
using emu::kPoisonC;
using emu::kPoisonTail;
using emu::kTail;
using emu::random_bf16;
using emu::seeded_rng;

struct Case {
  std::int64_t k, group;
  bool zero_points, fp16, act_order;
};

// Random INT4 weights of the case: quantized from uniform floats (every code and zero point
// occurs), with a random g_idx of whole groups under act order.
HostQuantWeights random_int4(const Case& c, std::int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(n * c.k));
  // Rows of growing size, so that scales differ by row and group.
  for (std::size_t i = 0; i < w.size(); ++i)
    w[i] = u(rng) * (1.0f + static_cast<float>(i / 64) / 64.0f);
  HostQuantWeights q = quantize_int4(w, n, c.k, c.group, c.zero_points, c.fp16);
  if (!c.act_order) return q;
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(c.k));
  for (std::int64_t k = 0; k < c.k; ++k) g_idx[k] = static_cast<std::int32_t>(k / c.group);
  std::shuffle(g_idx.begin(), g_idx.end(), rng);
  return with_act_order(q, g_idx);
}

// C = A · W^T in float64 over K's own order, and each element's sum of |terms|.
struct Reference {
  std::vector<double> c, magnitude;
};
Reference reference(const HostQuantWeights& w, const std::vector<std::uint16_t>& a,
                    std::int64_t m) {
  const std::vector<std::int64_t> where = int4::stored_columns(w);
  Reference r;
  r.c.assign(static_cast<std::size_t>(m * w.n), 0.0);
  r.magnitude.assign(r.c.size(), 0.0);
  for (std::int64_t n = 0; n < w.n; ++n) {
    for (std::int64_t k = 0; k < w.k; ++k) {
      const double wk = int4::stored_weight(w, n, where[k]);
      for (std::int64_t i = 0; i < m; ++i) {
        const double t = double{num::bf16_to_f32(a[i * w.k + k])} * wk;
        r.c[i * w.n + n] += t;
        r.magnitude[i * w.n + n] += std::fabs(t);
      }
    }
  }
  return r;
}

struct KernelRun {
  std::string error;
  std::vector<std::uint16_t> c;
  std::int64_t splits = 1;
};

// permute_a_int4 (act order only), then gemm_int4_decode and, when split, gemm_split_reduce, as
// ops/gemm.cpp launches them for a device of `sm_count` SMs (0: no split).
KernelRun run_kernel(const ops::PackedInt4Weights& pk, const std::vector<std::uint16_t>& a,
                     std::int64_t m, int sm_count) {
  KernelRun run;
  run.c.assign(static_cast<std::size_t>(m * pk.n), kPoisonC);
  run.c.resize(run.c.size() + kTail, kPoisonTail);
  GemmParams p;
  p.a = address(a.data());
  p.codes = address(pk.codes.data());
  p.scales = address(pk.side.data());
  p.out = address(run.c.data());
  p.m = m;
  p.n = pk.n;
  p.k = pk.k;
  p.group = pk.group;
  p.flags = kGemmInt4 | kGemmDecodePacked | (pk.fp16_scales ? kGemmFp16Scales : 0u) |
            (pk.zero_points ? kGemmZeroPoints : 0u) | (pk.act_order ? kGemmActOrder : 0u);
  std::vector<std::uint16_t> permuted;
  if (pk.act_order) {
    permuted.assign(a.size(), 0xFFFF);
    GemmParams pp = p;
    pp.out = address(permuted.data());
    for (std::int64_t u = 0; u < int4_permute::unit_count(m, pk.k); ++u) int4_permute::unit(pp, u);
    p.a = address(permuted.data());
  }
  dim3 grid(static_cast<unsigned>((pk.n + tiles::kDecodeNTile - 1) / tiles::kDecodeNTile));
  tiles::SplitK split{1, pk.k};
  if (sm_count > 0) {
    split = tiles::plan_split_k(pk.k, tiles::kDecodeSplitUnit, grid.x, 2 * sm_count, 16);
  }
  grid.z = static_cast<unsigned>(split.splits);
  p.splits = split.splits;
  p.k_per_split = split.k_per_split;
  run.splits = split.splits;
  std::vector<float> workspace;
  if (split.splits > 1) {
    workspace.assign(static_cast<std::size_t>(split.splits * m * pk.n), std::nanf("0x7FC00001"));
    p.workspace = address(workspace.data());
  }
  const std::vector<std::uint16_t>& a_read = pk.act_order ? permuted : a;
  const std::vector<emu::Region> readable = {{a_read.data(), a_read.size() * 2},
                                             {pk.codes.data(), pk.codes.size()},
                                             {pk.side.data(), pk.side.size()}};
  run.error =
      emu::run_grid(grid, tiles::kDecodeThreads, readable, [&p] { kernels::decode_int4_block(p); });
  if (run.error.empty() && split.splits > 1) {
    const std::int64_t outputs = m * pk.n, threads = 256;
    for (std::int64_t i = 0; i < (outputs + threads - 1) / threads * threads; ++i) {
      kernels::int4_host_test_split_reduce(p, i);
    }
  }
  return run;
}

// gtest's name for a case in its messages (the default prints the struct's bytes, padding
// included).
void PrintTo(const Case& c, std::ostream* os) {
  *os << "K " << c.k << " group " << c.group << (c.zero_points ? " zero points" : " symmetric")
      << (c.fp16 ? " fp16" : " bf16") << (c.act_order ? " act order" : "");
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "K" + std::to_string(c.k) + "G" + std::to_string(c.group) +
         (c.zero_points ? "Zero" : "Sym") + (c.fp16 ? "Fp16" : "Bf16") +
         (c.act_order ? "ActOrder" : "");
}

constexpr std::int64_t kN = 72;  // two whole tiles and one of 8 rows

class DecodeInt4OnHost : public testing::TestWithParam<Case> {};

// M = 1, 9 and 17 (one n8 tile, two, and a second round of 16), without split-K and split as
// planned for an H200 (132 SMs) and for 2 SMs: every element within one BF16 rounding of the
// float64 product plus FP32 summation error, the normalized error printed, nothing past C.
TEST_P(DecodeInt4OnHost, MatchesTheSourceWeights) {
  const Case c = GetParam();
  std::mt19937_64 rng = seeded_rng();
  const HostQuantWeights w = random_int4(c, kN, rng);
  const ops::PackedInt4Weights pk = ops::pack_int4_for_decode(w);
  for (const std::int64_t m : {1, 9, 17}) {
    const std::vector<std::uint16_t> a = random_bf16(static_cast<std::size_t>(m * c.k), rng);
    const Reference ref = reference(w, a, m);
    for (const int sms : {0, 132, 2}) {
      SCOPED_TRACE("M " + std::to_string(m) + ", SMs " + std::to_string(sms));
      const KernelRun run = run_kernel(pk, a, m, sms);
      ASSERT_EQ(run.error, "");
      int bad = 0;
      double err2 = 0.0, ref2 = 0.0;
      for (std::int64_t i = 0; i < m * kN; ++i) {
        const double got = num::bf16_to_f32(run.c[i]), want = ref.c[i];
        const double tol = std::ldexp(std::fabs(want), -8) + 1e-4 * ref.magnitude[i] + 1e-30;
        err2 += (got - want) * (got - want);
        ref2 += want * want;
        if (!(std::fabs(got - want) <= tol) && ++bad <= 5) {
          ADD_FAILURE() << "C[" << i / kN << ", " << i % kN << "] = " << got << ", want " << want
                        << " (tolerance " << tol << ")";
        }
      }
      EXPECT_EQ(bad, 0);
      const double normalized = std::sqrt(err2 / ref2);
      std::printf("%s M %lld, splits %lld: normalized error %.3g\n", case_name({c, 0}).c_str(),
                  static_cast<long long>(m), static_cast<long long>(run.splits), normalized);
      EXPECT_LT(normalized, 1.0 / 256);
      for (std::size_t i = static_cast<std::size_t>(m * kN); i < run.c.size(); ++i) {
        ASSERT_EQ(run.c[i], kPoisonTail) << "C's tail, element " << i - m * kN << ", was written";
      }
    }
  }
}

// Groups 32 and 64 (a scale per 32-K span) and 128 and per channel (a scale per K block), each
// scale format, symmetric and with zero points; K = 5216 and 5184 end on a partial K block.
INSTANTIATE_TEST_SUITE_P(
    Cases, DecodeInt4OnHost,
    testing::Values(Case{5216, 32, true, true, false}, Case{5184, 64, false, false, false},
                    Case{5120, 128, true, true, false}, Case{4224, 4224, true, false, false},
                    Case{5248, 128, false, true, true}, Case{5184, 32, true, false, true}),
    case_name);

}  // namespace
}  // namespace metrale
