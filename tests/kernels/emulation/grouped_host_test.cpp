// The grouped GEMMs' GPU source (cuda/kernels/grouped.cuh around the decode kernels) run on the
// host: the grid the op plans (N tiles x experts), 256 threads a block as fibers, the MMAs by the
// PTX ISA's fragment rules. Experts in the decode and INT4 decode layouts laid end to end as the
// upload lays them, with their own tensor scales and folds, rows of a contiguous routing with an
// empty expert, one over 16 rows (the decode kernel's second pass) and one whose rows a caller put
// past the end (skipped). Each expert's rows against the float64 reference of its own weights;
// rows of no expert untouched. What this reaches that the CPU twins cannot: the expert's arguments
// shared through shared memory and the whole block leaving together for an expert without rows.
#include "cuda_host.h"  // first: the CUDA language on the host

#include "cuda/kernels/decode_int4.cuh"
#include "cuda/kernels/grouped.cuh"

// decode.cuh's and decode_packed.cuh's blocks are external functions (not inline):
// decode_host_test.cpp's translation unit compiles them, and this one calls those definitions.
namespace metrale::kernels {
void decode_block(const GemmParams& p);
void decode_packed_block(const GemmParams& p);
}  // namespace metrale::kernels

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/decode_layout.h"
#include "kernels/grouped_params.h"
#include "kernels/tile_math.h"
#include "metrale/cpu_backend.h"
#include "metrale/quant.h"
#include "ops/weights_pack.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale {
namespace {

namespace emu = metrale::emulation;
namespace kk = metrale::kernels;

std::mt19937_64& gen() {
  static std::mt19937_64 g{std::random_device{}()};
  return g;
}

HostQuantWeights random_expert(WeightFormat f, std::int64_t n, std::int64_t k) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n * k));
  for (auto& x : v) x = normal(gen());
  if (f == WeightFormat::kInt4) return quantize_int4(v, n, k, 128, true, false);
  HostQuantWeights w =
      f == WeightFormat::kNvfp4 ? quantize_nvfp4(v, n, k) : quantize_mxfp4(v, n, k);
  w.tensor_scale = std::ldexp(1.0f, -static_cast<int>(gen()() % 4));
  return w;
}

// source: NVFP4 or MXFP4 in their source layout (gemm_grouped: decode.cuh's block); else the
// decode layouts (gemm_grouped_packed, gemm_grouped_int4_decode). split: K = 2560 in three slices
// of the kernels' split unit (1024, 1024 and a short 512; grid z), each expert's partials summed
// by gemm_grouped_split_reduce's block (grouped.cuh), 256 columns a block over N = 320; the
// partials of rows no expert runs are never written.
void run(WeightFormat format, bool source = false, bool split = false) {
  SCOPED_TRACE(fmt::format("{}{}{}", to_string(format), source ? " source layout" : "",
                           split ? ", split-K" : ""));
  constexpr std::int64_t kRows = 24;
  // Split: N past one reduction block of 256 columns.
  const std::int64_t kN = split ? 320 : 64, kK = split ? 2560 : 256, splits = split ? 3 : 1;
  const std::vector<std::int32_t> counts = {2, 0, 17, 3}, offsets = {0, 2, 2, 22, 24};
  const auto experts = static_cast<std::int64_t>(counts.size());
  CpuBackend cpu;  // only for the upload's packing rules
  std::vector<HostQuantWeights> host;
  std::vector<std::uint8_t> codes, scales;
  std::vector<float> table(static_cast<std::size_t>(2 * experts));
  std::uint64_t codes_stride = 0, scales_stride = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    host.push_back(random_expert(format, kN, kK));
    const ops::HostPacked p = ops::pack_host_weights(
        cpu, host.back(), source ? ops::UploadLayout::kSource : ops::UploadLayout::kDecode);
    ASSERT_EQ(p.packing, source ? ops::WeightPacking::kSource : ops::WeightPacking::kDecode);
    codes_stride = (p.codes.size() + 255) / 256 * 256;
    scales_stride = (p.scales.size() + 255) / 256 * 256;
    codes.resize(static_cast<std::size_t>(codes_stride * (e + 1)));
    scales.resize(static_cast<std::size_t>(scales_stride * (e + 1)));
    std::memcpy(codes.data() + e * codes_stride, p.codes.data(), p.codes.size());
    std::memcpy(scales.data() + e * scales_stride, p.scales.data(), p.scales.size());
    table[static_cast<std::size_t>(e)] = host.back().tensor_scale;
    std::memcpy(&table[static_cast<std::size_t>(experts + e)], &p.fold, 4);
  }
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(kRows * kK));
  for (auto& x : a) x = num::f32_to_bf16(u(gen()));
  std::vector<std::uint16_t> c(static_cast<std::size_t>(kRows * kN), toolkit::kPoisonBf16);
  GroupedGemmParams g;
  g.gemm.a = reinterpret_cast<std::uintptr_t>(a.data());
  g.gemm.codes = reinterpret_cast<std::uintptr_t>(codes.data());
  g.gemm.scales = reinterpret_cast<std::uintptr_t>(scales.data());
  g.gemm.out = reinterpret_cast<std::uintptr_t>(c.data());
  g.gemm.m = kRows;
  g.gemm.n = kN;
  g.gemm.k = kK;
  g.gemm.splits = splits;
  g.gemm.k_per_split = split ? metrale::tiles::kDecodeSplitUnit : kK;
  g.gemm.a_k = kK;
  // FP32 partials [splits, rows, N] and a tail, all NaN until written.
  constexpr std::size_t kTail = 64;
  std::vector<float> partials(static_cast<std::size_t>(splits * kRows * kN) + kTail,
                              std::numeric_limits<float>::quiet_NaN());
  if (split) g.gemm.workspace = reinterpret_cast<std::uintptr_t>(partials.data());
  if (format == WeightFormat::kInt4) {
    g.gemm.flags = kGemmInt4 | kGemmZeroPoints;
    g.gemm.group = 128;
  } else if (source) {
    g.gemm.flags = format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u;
  } else {
    g.gemm.flags = kGemmDecodePacked | (format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u);
  }
  g.counts = reinterpret_cast<std::uintptr_t>(counts.data());
  g.offsets = reinterpret_cast<std::uintptr_t>(offsets.data());
  g.expert_table = reinterpret_cast<std::uintptr_t>(table.data());
  g.codes_stride = codes_stride;
  g.scales_stride = scales_stride;
  g.experts = experts;
  const std::int64_t tile = source ? metrale::tiles::kDecodeNTile : decode_layout::kTileN;
  const dim3 grid(static_cast<unsigned>((kN + tile - 1) / tile), static_cast<unsigned>(experts),
                  static_cast<unsigned>(splits));
  const std::vector<emu::Region> readable = {{a.data(), a.size() * 2},
                                             {codes.data(), codes.size()},
                                             {scales.data(), scales.size()},
                                             {partials.data(), partials.size() * 4}};
  const std::string error = emu::run_grid(
      grid, static_cast<int>(metrale::tiles::kDecodeThreads), readable, [&g, format, source] {
        if (format == WeightFormat::kInt4) {
          kk::grouped_block(g, [](const GemmParams& p) { kk::decode_int4_block(p); });
        } else if (source) {
          kk::grouped_block(g, [](const GemmParams& p) { kk::decode_block(p); });
        } else {
          kk::grouped_block(g, [](const GemmParams& p) { kk::decode_packed_block(p); });
        }
      });
  ASSERT_EQ(error, "");
  if (split) {
    // Rows 19 to 23 (no expert's, and the skipped expert's) hold no partials: their slices,
    // from row 19 x splits on, and the tail stay NaN.
    for (std::size_t i = static_cast<std::size_t>(19 * splits * kN); i < partials.size(); ++i) {
      ASSERT_TRUE(std::isnan(partials[i])) << "partial " << i << " of no expert was written";
    }
    const dim3 reduce_grid(static_cast<unsigned>((kN + 255) / 256), static_cast<unsigned>(experts));
    const std::string reduced =
        emu::run_grid(reduce_grid, 256, readable, [&g] { kk::grouped_split_reduce_block<256>(g); });
    ASSERT_EQ(reduced, "");
  }
  const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(ops::GemmRoute::kDecode, format);
  for (std::int64_t e = 0; e < experts; ++e) {
    const bool runs = counts[e] > 0 && offsets[e] + counts[e] <= kRows;
    SCOPED_TRACE(fmt::format("expert {}: {} rows from {}", e, counts[e], offsets[e]));
    if (!runs) continue;
    const std::int64_t m = counts[e];
    const std::span<const std::uint16_t> a_e(a.data() + offsets[e] * kK,
                                             static_cast<std::size_t>(m * kK));
    const toolkit::Reference ref = toolkit::reference(a_e, m, host[e], {}, tol);
    const std::span<const std::uint16_t> got(c.data() + offsets[e] * kN,
                                             static_cast<std::size_t>(m * kN));
    const toolkit::Comparison cmp = toolkit::compare(got, ref);
    EXPECT_EQ(cmp.unwritten, 0) << cmp.str();
    EXPECT_LE(cmp.worst, 1.0) << cmp.str();
    EXPECT_LE(cmp.normalized, tol.normalized) << cmp.str();
  }
  // Rows 19 to 21 belong to no expert; 22 and 23 to expert 3, whose rows [22, 25) a caller put
  // past the 24: skipped.
  for (std::int64_t i = 19 * kN; i < kRows * kN; ++i) {
    ASSERT_EQ(c[static_cast<std::size_t>(i)], toolkit::kPoisonBf16) << "element " << i;
  }
}

TEST(GroupedHost, EachLayoutPerExpert) {
  run(WeightFormat::kNvfp4);
  run(WeightFormat::kMxfp4);
  run(WeightFormat::kInt4);
  run(WeightFormat::kNvfp4, true);
  run(WeightFormat::kMxfp4, true);
}

TEST(GroupedHost, SplitKPerExpertThenTheGroupedReduction) {
  run(WeightFormat::kNvfp4, false, true);
  run(WeightFormat::kInt4, false, true);
  run(WeightFormat::kMxfp4, true, true);
}

}  // namespace
}  // namespace metrale
