// Module "w4a16" on the CPU: every entry of kernels/w4a16.def with the same published metadata
// fields as the GPU module, so the op code (src/ops/gemm.cpp) runs unchanged on both backends.
// One grid block covers one tile of output columns (or elements, for the casts).
#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>

#include "cpu/kernels/decode_packed_cpu.h"
#include "cpu/kernels/dequant_bf16_cpu.h"
#include "cpu/kernels/int4_packed_cpu.h"
#include "cpu/kernels/w4a16_cpu.h"
#include "cpu/modules/modules.h"
#include "kernels/decode_layout.h"
#include "kernels/dequant_bf16.h"
#include "kernels/dequant_int4.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/int4_permute.h"
#include "kernels/verified_devices.h"
#include "metrale/error.h"
#include "metrale/kernel_args.h"

namespace metrale::cpu {
namespace {

// Columns per block. Decode blocks are wide so converting A (once per block) stays cheap next
// to streaming the block's weights; tiled blocks match the dequantized panel width.
constexpr std::uint32_t kDecodeTile = 256;
constexpr std::uint32_t kTiledTile = 64;
// Rows per tiled block: each block dequantizes its columns' weights once, so a taller block
// dequantizes less often; 256 rows leave that at ~3% of the dot products, and M x N blocks keep
// every thread busy on few columns.
constexpr std::uint32_t kTiledMTile = 256;
constexpr std::uint32_t kE4m3Tile = 64;
constexpr std::uint32_t kCastTile = 1 << 16;       // elements
constexpr std::uint32_t kDequantTile = 16;         // rows
constexpr std::uint32_t kDequantBf16Tile = 4096;   // units of 32 weights (kernels/dequant_bf16.h)
constexpr std::uint32_t kReduceTile = 1 << 14;     // outputs of M x N
constexpr std::uint32_t kGroupedReduceTile = 256;  // columns of an expert's rows, as CUDA's
constexpr std::uint32_t kDequantInt4Tile = 4096;   // units of 8 weights (kernels/dequant_int4.h)
// The block size every entry publishes: the CPU runs a block as one host call, so this is only
// the shape the launch checks see, kept equal to the GPU module's.
constexpr std::uint32_t kBlockThreads = 256;
// The largest M for the decode route. From 5 rows on the tiled route's panels beat the decode
// kernel (whose register tiles take 8 rows at M = 5..8 and 16 at 9..16): on 8B's layers, in
// runs of --compare-routes, tiled took 1.24-1.48x decode's time at M = 4, 0.83-0.88x at 5 and
// 6, 0.71-0.90x at 8 and 0.61-0.68x at 16 (docs/PERF.md). On the panel layout the same holds
// (one thread, 8B gate_up, panels_tiled's time over panels_small's): 1.09-1.10x at 4, 0.90x at
// 5, 0.94-0.96x at 6 and 0.97-0.99x at 8.
constexpr std::uint32_t kDecodeMaxM = 4;
// On AVX2 (decode_avx2.cpp, slices of up to 4 rows) the tiled route's 6-row FP32 tiles pay a
// whole pack for few rows: on 8B's layers, in runs of --compare-routes on an AVX2-only VM, decode
// took 0.69-0.75x tiled's time at M = 5 and 6, 1.03-1.18x at 7 and 0.90-1.06x at 8 (docs/PERF.md).
constexpr std::uint32_t kAvx2DecodeMaxM = 6;

std::uint32_t decode_max_m() {
  return w4a16::best_isa() == w4a16::Isa::kAvx2 ? kAvx2DecodeMaxM : kDecodeMaxM;
}

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

void gemm_decode_packed(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kDecodeTile>(b, p.n);
  if (n0 < n1) w4a16::gemm_decode_packed(p, n0, n1);
}

// gemm_fused's twin until the lead wires its own reference: the decode-layout kernel (the same
// weights, any M).
void gemm_fused(const HostBlock& b) {
  gemm_decode_packed(b);
}

void gemm_tiled(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kTiledTile>(b, p.n);
  const std::int64_t m0 = std::int64_t{b.block_idx.y} * kTiledMTile;
  const std::int64_t m1 = std::min<std::int64_t>(p.m, m0 + kTiledMTile);
  if (n0 < n1 && m0 < m1) w4a16::gemm_tiled(p, n0, n1, m0, m1, w4a16::best_isa());
}

void gemm_e4m3(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kE4m3Tile>(b, p.n);
  if (n0 < n1) w4a16::gemm_e4m3(p, n0, n1);
}

void gemm_split_reduce(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [i0, i1] = span_of<kReduceTile>(b, p.m * p.n);
  if (i0 < i1) w4a16::split_reduce(p, i0, i1);
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

void dequant_bf16(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [u0, u1] = span_of<kDequantBf16Tile>(b, dequant::unit_count(p.n, p.k));
  if (u0 < u1) w4a16::dequant_bf16(p, u0, u1);
}

void gemm_int4_decode(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [n0, n1] = span_of<kDecodeTile>(b, p.n);
  if (n0 < n1) w4a16::gemm_int4_decode(p, n0, n1);
}

void dequant_int4_bf16(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [u0, u1] = span_of<kDequantInt4Tile>(b, dequant_int4::unit_count(p.n, p.k));
  if (u0 < u1) w4a16::dequant_int4_bf16(p, u0, u1);
}

void permute_a_int4(const HostBlock& b) {
  const auto p = read_param<GemmParams>(b.params, 0);
  const auto [u0, u1] = span_of<kDequantInt4Tile>(b, int4_permute::unit_count(p.m, p.k));
  for (std::int64_t u = u0; u < u1; ++u) int4_permute::unit(p, u);
}

// The grouped GEMMs: block (x, y) the columns of tile x of expert y. gemm_grouped takes the decode
// route's kernel up to its largest M and the tiled one above, per expert (both read the source
// and the panel layout); the packed twins the reference kernel of their layout at every M. The
// decode route's wide tile: most blocks of a decode step belong to experts without rows and
// return at once, and fewer of them paid (bench_moe at one token, 2 vCPUs, two runs of each
// binary in turn, the share of the read roof over the 64-column tile's: 0.97-1.05x with 32
// experts, 0.99-1.30x with 128 (1.13-1.30x on gpt-oss-120b), 0.98-1.07x with 256).
void gemm_grouped(const HostBlock& b) {
  const auto g = read_param<GroupedGemmParams>(b.params, 0);
  GemmParams p;
  if (!grouped::expert_params(g, b.block_idx.y, &p)) return;
  const auto [n0, n1] = span_of<kDecodeTile>(b, p.n);
  if (n0 >= n1) return;
  if (p.m <= decode_max_m()) {
    w4a16::gemm_decode(p, n0, n1, w4a16::best_isa());
    return;
  }
  // The tiled route in the dense launch's tiles (its panels' width, its rows a block): on
  // Qwen3-30B-A3B's gate_up at 16 rows an expert, one call over the 256 columns took 1.15x the
  // time of the dense GEMMs per expert.
  for (std::int64_t c0 = n0; c0 < n1; c0 += kTiledTile) {
    for (std::int64_t m0 = 0; m0 < p.m; m0 += kTiledMTile) {
      w4a16::gemm_tiled(p, c0, std::min<std::int64_t>(n1, c0 + kTiledTile), m0,
                        std::min<std::int64_t>(p.m, m0 + kTiledMTile), w4a16::best_isa());
    }
  }
}

void gemm_grouped_packed(const HostBlock& b) {
  const auto g = read_param<GroupedGemmParams>(b.params, 0);
  GemmParams p;
  if (!grouped::expert_params(g, b.block_idx.y, &p)) return;
  const auto [n0, n1] = span_of<kDecodeTile>(b, p.n);
  if (n0 < n1) w4a16::gemm_decode_packed(p, n0, n1);
}

// gemm_grouped_fused's twin: the decode-layout reference per expert, as gemm_grouped_packed (the
// same weights, any M; no persistent grid here).
void gemm_grouped_fused(const HostBlock& b) {
  gemm_grouped_packed(b);
}

void gemm_grouped_int4_decode(const HostBlock& b) {
  const auto g = read_param<GroupedGemmParams>(b.params, 0);
  GemmParams p;
  if (!grouped::expert_params(g, b.block_idx.y, &p)) return;
  const auto [n0, n1] = span_of<kDecodeTile>(b, p.n);
  if (n0 < n1) w4a16::gemm_int4_decode(p, n0, n1);
}

// gemm_grouped_int4_fused's twin: the INT4 decode layout's reference per expert, as
// gemm_grouped_int4_decode (the CUDA kernel rounds each weight to BF16 once, as the dequant route
// does; this twin rounds none, as the decode route does).
void gemm_grouped_int4_fused(const HostBlock& b) {
  gemm_grouped_int4_decode(b);
}

// gemm_grouped_split_reduce's twin: columns of tile x of expert y's rows, its slices summed in
// order. Never launched here (no CPU entry publishes _split_k); the manifest's twin all the same.
void gemm_grouped_split_reduce(const HostBlock& b) {
  const auto g = read_param<GroupedGemmParams>(b.params, 0);
  GemmParams p;
  if (!grouped::expert_params(g, b.block_idx.y, &p)) return;
  const auto [n0, n1] = span_of<kGroupedReduceTile>(b, p.n);
  for (std::int64_t m = 0; n0 < n1 && m < p.m; ++m)
    w4a16::split_reduce(p, m * p.n + n0, m * p.n + n1);
}

// The layout an entry reads (and publishes as <entry>_layout), where it is not the source one.
enum class Reads : std::uint8_t {
  kSource,  // the source layout (nothing published)
  // The source and panel layouts, INT4 among them (_int4; _panels where AVX-512 BF16 reads the
  // panels fast, so that uploads following the backend's preference take them there): the
  // decode and tiled kernels (cpu/kernels/int4_cpu.h).
  kSourceAndPanels,
  // The decode layout: its reference, with no largest M (it is not the CPU's best decode, so
  // uploads that follow the backend's preference keep the source layout).
  kDecodeLayout,
  // The INT4 decode layout (_int4): its reference, with no largest M (uploads that follow the
  // backend's preference keep INT4 in the source or the panel layout, which the fast kernels
  // read).
  kInt4DecodeLayout,
};

// What each entry publishes besides its block size. A manifest entry missing here is a bug of
// this file, caught when the module is made (every CPU test makes it).
struct EntryMeta {
  std::string_view entry;
  std::uint32_t n_tile;
  Reads reads = Reads::kSource;
  // Writes C through detail::store, which honours kGemmOutF32.
  bool out_f32 = false;
};
constexpr EntryMeta kEntries[] = {
    {"bf16_to_fp8", kCastTile},
    {"dequant_e4m3", kDequantTile},
    {"dequant_bf16", kDequantBf16Tile},
    {"gemm_decode", kDecodeTile, Reads::kSourceAndPanels, true},
    {"gemm_decode_packed", kDecodeTile, Reads::kDecodeLayout, true},
    {"gemm_split_reduce", kReduceTile, Reads::kSource, true},
    {"gemm_tiled", kTiledTile, Reads::kSourceAndPanels, true},
    {"gemm_e4m3", kE4m3Tile, Reads::kSource, true},
    {"gemm_fused", kDecodeTile, Reads::kDecodeLayout, true},
    {"gemm_int4_decode", kDecodeTile, Reads::kInt4DecodeLayout, true},
    {"dequant_int4_bf16", kDequantInt4Tile, Reads::kInt4DecodeLayout},
    {"permute_a_int4", kDequantInt4Tile, Reads::kInt4DecodeLayout},
    {"gemm_grouped", kDecodeTile, Reads::kSourceAndPanels, true},
    {"gemm_grouped_packed", kDecodeTile, Reads::kDecodeLayout, true},
    {"gemm_grouped_int4_decode", kDecodeTile, Reads::kInt4DecodeLayout, true},
    {"gemm_grouped_fused", kDecodeTile, Reads::kDecodeLayout, true},
    {"gemm_grouped_int4_fused", kDecodeTile, Reads::kInt4DecodeLayout, true},
    {"gemm_grouped_split_reduce", kGroupedReduceTile, Reads::kSource, true},
};

// Publishes the entry's N tile and block size, what it reads (kEntries), the decode route's
// largest M and the tiled route's M tile. No entry publishes _split_k: the CPU GEMM kernels write
// C themselves and ignore GemmParams::splits, so a split would leave gemm_split_reduce summing
// partials nobody wrote.
void publish_meta(HostModule& m, std::string_view entry) {
  const auto* t = std::find_if(std::begin(kEntries), std::end(kEntries),
                               [&](const EntryMeta& x) { return x.entry == entry; });
  if (t == std::end(kEntries)) {
    throw Error(ErrorCode::kInternal, "w4a16 module",
                fmt::format("the CPU module has no N tile for manifest entry {}", entry));
  }
  const std::string e(entry);
  m.publish_u32(e + "_n_tile", t->n_tile).publish_u32(e + "_block_threads", kBlockThreads);
  if (entry == "gemm_decode") m.publish_u32(e + "_max_m", decode_max_m());
  if (entry == "gemm_tiled") m.publish_u32(e + "_m_tile", kTiledMTile);
  // No gemm_e4m3_min_m: kAuto never takes the e4m3 route here. Side by side on this VM it ran
  // 30x slower than the exact tiled route at M = 64 and 256 (docs/PERF.md, routes side by side),
  // so allowing E4M3 activations must not choose it.
  switch (t->reads) {
    case Reads::kSource:
      break;
    case Reads::kSourceAndPanels:
      if (w4a16::best_isa() == w4a16::Isa::kAvx512Bf16) m.publish(e + "_panels", {std::byte{1}});
      m.publish(e + "_int4", {std::byte{1}});
      break;
    case Reads::kDecodeLayout:
      m.publish_u32(e + "_layout", decode_layout::kLayoutId);
      break;
    case Reads::kInt4DecodeLayout:
      m.publish_u32(e + "_layout", int4_decode::kLayoutId);
      m.publish(e + "_int4", {std::byte{1}});
      break;
  }
  // The host modules are the reference every device result is compared with, run by every test
  // run: verified as such (kernels/verified_devices.h), so the automatic choices that gate CUDA
  // on device runs leave the CPU's unchanged.
  m.publish_u32(e + "_verified_on", verified::kHostReference);
  if (t->out_f32) m.publish(e + "_out_f32", {std::byte{1}});
}

}  // namespace

HostModule make_w4a16_module() {
  HostModule m("w4a16");
  // A manifest entry without its CPU twin above does not compile; the launch checks hold each
  // call to the size of the manifest's argument block.
#define METRALE_W4A16_ENTRY(entry, Params, route)                            \
  m.add_kernel(#entry, entry, {static_cast<std::uint16_t>(sizeof(Params))}); \
  publish_meta(m, #entry);
#include "kernels/w4a16.def"
#undef METRALE_W4A16_ENTRY
  return m;
}

}  // namespace metrale::cpu
