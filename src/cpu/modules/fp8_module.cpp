// Module "fp8" on the CPU: the W8A8 op's activation cast (cast_e4m3_block128; one grid block
// covers n_tile (row, 128-K block) pairs) and the grouped W8A8 GEMM over experts
// (gemm_grouped_e4m3_block128; block (x, y) the columns of tile x of expert y, by the dense
// W8A8 kernel on the expert's rows, or its panel-layout twin), with the same published metadata
// fields as the GPU module (src/cuda/kernels/fp8.cu) and one of its own, `panels`.
#include <algorithm>
#include <string>

#include "cpu/kernels/dense_e4m3.h"
#include "cpu/kernels/fp8_cpu.h"
#include "cpu/modules/modules.h"
#include "kernels/dense_params.h"
#include "kernels/fp8_cast.h"
#include "kernels/fp8_panel_layout.h"
#include "kernels/grouped_fp8_params.h"
#include "kernels/verified_devices.h"
#include "metrale/kernel_args.h"

namespace metrale::cpu {
namespace {

// Pairs per block: a pair is at most 128 elements, so a block is a few thousand of them, enough
// to pay for one host call (the GPU module publishes its own tile: a warp per pair).
constexpr std::uint32_t kCastTile = 64;
constexpr std::uint32_t kBlockThreads = 256;  // the shape the launch checks see, as on the GPU
// Columns of C per block, module "blas"'s tile: whole panels of the panel layout (32 columns).
constexpr std::uint32_t kGroupedTile = 64;
static_assert(kGroupedTile % fp8_panels::kCols == 0, "a block's columns start a panel");

void cast_e4m3_block128(const HostBlock& b) {
  const auto p = read_param<Fp8CastParams>(b.params, 0);
  const std::int64_t pairs =
      p.m * ((p.k + metrale::fp8::kCastBlock - 1) / metrale::fp8::kCastBlock);
  const std::int64_t i0 = std::int64_t{b.block_idx.x} * kCastTile;
  const std::int64_t i1 = std::min<std::int64_t>(pairs, i0 + kCastTile);
  if (i0 < i1) fp8::cast_e4m3_block128(p, i0, i1);
}

void gemm_grouped_e4m3_block128(const HostBlock& b) {
  const auto g = read_param<GroupedFp8Params>(b.params, 0);
  const std::int64_t e = b.block_idx.y;
  std::int64_t first = 0, m = 0;
  if (!grouped_fp8::expert_rows(g, e, &first, &m)) return;
  const std::int64_t n0 = std::int64_t{b.block_idx.x} * kGroupedTile;
  const std::int64_t n1 = std::min<std::int64_t>(g.n, n0 + kGroupedTile);
  if (n0 >= n1) return;
  const auto ue = static_cast<std::uint64_t>(e), uf = static_cast<std::uint64_t>(first);
  const auto un = static_cast<std::uint64_t>(g.n), uk = static_cast<std::uint64_t>(g.k);
  DenseParams p;
  p.a = g.a + uf * uk;
  p.a_scales = g.a_scales + uf * 4;  // column `first` of every K block's row
  p.a_scales_ld = metrale::fp8::scales_ld(g.rows);
  p.b = g.b + ue * g.b_stride;
  p.b_scales = g.b_scales + ue * g.b_scales_stride;
  p.c = g.c + uf * un * (g.out_f32 != 0 ? 4 : 2);
  p.bias = g.bias != 0 ? g.bias + ue * un * 2 : 0;
  p.m = m;
  p.n = g.n;
  p.k = g.k;
  p.out_f32 = g.out_f32;
  if (g.b_panels != 0) {
    blas::gemm_e4m3_block128_panels_best(p, n0, n1);
  } else {
    blas::gemm_e4m3_block128_best(p, n0, n1);
  }
}

}  // namespace

HostModule make_fp8_module() {
  HostModule m("fp8");
  const std::string e = "cast_e4m3_block128";
  m.add_kernel(e, cast_e4m3_block128, {static_cast<std::uint16_t>(sizeof(Fp8CastParams))});
  m.publish_u32(e + "_n_tile", kCastTile).publish_u32(e + "_block_threads", kBlockThreads);
  m.publish_u32(e + "_verified_on", verified::kHostReference);  // the reference itself
  const std::string g = "gemm_grouped_e4m3_block128";
  m.add_kernel(g, gemm_grouped_e4m3_block128,
               {static_cast<std::uint16_t>(sizeof(GroupedFp8Params))});
  m.publish_u32(g + "_n_tile", kGroupedTile).publish_u32(g + "_block_threads", kBlockThreads);
  m.publish(g + "_out_f32", {std::byte{1}});
  // Experts in the panel layout (kernels/fp8_panel_layout.h), on every processor: the reference
  // reads them as it reads row-major codes, the vector kernels a pair of 32 columns a load.
  m.publish(g + "_panels", {std::byte{1}});
  m.publish_u32(g + "_verified_on", verified::kHostReference);
  return m;
}

}  // namespace metrale::cpu
