// Module "w4a16" on the CPU: the same entry names and published metadata as the GPU module, so
// the op code (src/ops/gemm.cpp) runs unchanged on both backends. One grid block covers one
// tile of output columns (or elements, for the casts).
#include <algorithm>

#include "cpu/kernels/w4a16_cpu.h"
#include "cpu/modules/modules.h"
#include "kernels/gemm_params.h"
#include "metrale/kernel_args.h"

namespace metrale::cpu {
namespace {

// Columns per block. Decode blocks are wide so converting A (once per block) stays cheap next
// to streaming the block's weights; tiled blocks match the dequantized panel width.
constexpr std::uint32_t kDecodeTile = 256;
constexpr std::uint32_t kTiledTile = 64;
constexpr std::uint32_t kE4m3Tile = 64;
constexpr std::uint32_t kCastTile = 1 << 16;  // elements
constexpr std::uint32_t kDequantTile = 16;    // rows

template <std::uint32_t Tile>
std::pair<std::int64_t, std::int64_t> span_of(const HostBlock& b, std::int64_t total) {
  const std::int64_t begin = std::int64_t{b.block_idx.x} * Tile;
  return {begin, std::min<std::int64_t>(total, begin + Tile)};
}

void gemm_decode(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kDecodeTile>(b, p.n);
  if (n0 < n1) w4a16::gemm_decode(p, n0, n1, w4a16::best_isa());
}

void gemm_tiled(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kTiledTile>(b, p.n);
  if (n0 < n1) w4a16::gemm_tiled(p, n0, n1, w4a16::best_isa());
}

void gemm_e4m3(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kE4m3Tile>(b, p.n);
  if (n0 < n1) w4a16::gemm_e4m3(p, n0, n1);
}

void bf16_to_fp8(const HostBlock& b) {
  const auto p = read_param<CastParams>(b.params, 0);
  const auto [i0, i1] = span_of<kCastTile>(b, p.count);
  if (i0 < i1) w4a16::cast_bf16_to_e4m3(p, i0, i1);
}

void dequant_e4m3(const HostBlock& b) {
  const auto p = read_param<CastParams>(b.params, 0);
  const auto [r0, r1] = span_of<kDequantTile>(b, p.count);
  if (r0 < r1) w4a16::dequant_e4m3(p, r0, r1);
}

}  // namespace

HostModule make_w4a16_module() {
  constexpr auto kGemm = static_cast<std::uint16_t>(sizeof(GemmParams));
  constexpr auto kCast = static_cast<std::uint16_t>(sizeof(CastParams));
  HostModule m("w4a16");
  m.add_kernel("bf16_to_fp8", bf16_to_fp8, {kCast}).publish_u32("bf16_to_fp8_n_tile", kCastTile);
  m.add_kernel("dequant_e4m3", dequant_e4m3, {kCast})
      .publish_u32("dequant_e4m3_n_tile", kDequantTile);
  m.add_kernel("gemm_decode", gemm_decode, {kGemm}).publish_u32("gemm_decode_n_tile", kDecodeTile);
  m.add_kernel("gemm_tiled", gemm_tiled, {kGemm}).publish_u32("gemm_tiled_n_tile", kTiledTile);
  m.add_kernel("gemm_e4m3", gemm_e4m3, {kGemm}).publish_u32("gemm_e4m3_n_tile", kE4m3Tile);
  return m;
}

}  // namespace metrale::cpu
