// The lifecycle's backend on the fake CUDA driver: fake "core" and "w4a16" modules whose kernel
// bodies really compute (the w4a16 ones through the CPU backend's host kernels, which take the
// same GemmParams and CastParams; fake device memory is host memory at the same address), and a
// factory that discovers the driver, builds host and registry, and gives the backend sole
// ownership of them, so dropping the backend drops everything the model had in the driver.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cpu/kernels/decode_packed_cpu.h"
#include "cpu/kernels/dequant_bf16_cpu.h"
#include "cpu/kernels/int4_packed_cpu.h"
#include "cpu/kernels/w4a16_cpu.h"
#include "cuda/backend.h"
#include "cuda/fake_driver.h"
#include "cuda/host.h"
#include "cuda/module_registry.h"
#include "cuda/rig.h"
#include "kernels/decode_layout.h"
#include "kernels/dequant_bf16.h"
#include "kernels/dequant_int4.h"
#include "kernels/gemm_params.h"
#include "kernels/grouped_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/int4_permute.h"
#include "kernels/manifest.h"
#include "metrale/kernel_args.h"

namespace metrale::testing::reliability {

namespace fake = metrale::cuda::testing;

// Output columns (or elements, or weight rows) per block of each w4a16 entry. Deliberately
// unlike the CPU module's: a grid sized from anything but the published tile leaves a tail
// unwritten, which the lifecycle's poisoned outputs catch.
inline constexpr std::uint32_t kDecodeTile = 8, kTiledTile = 16, kE4m3Tile = 32;
inline constexpr std::uint32_t kCastTile = 512, kDequantTile = 4, kReduceTile = 64;
inline constexpr std::uint32_t kDequantBf16Tile = 8;  // units of 32 weights
// gemm_fused's rows of M per tile (its N tile is kDecodeTile's).
inline constexpr std::uint32_t kFusedMTile = 24;
// The block size each entry publishes, and the decode route's largest M (as the real modules').
inline constexpr std::uint32_t kBlockThreads = 256, kDecodeMaxM = 16;

// A fake entry taking one P by value whose body runs f(p, begin, end) per block of `tile`
// over total(p) items: exactly the items the launched grid covers.
template <class P, class F, class Total>
fake::FakeFunction tiled_entry(std::uint32_t tile, F f, Total total) {
  fake::FakeFunction fn;
  fn.param_sizes = {sizeof(P)};
  fn.body = [tile, f, total](const fake::FakeLaunch& l) {
    const auto p = read_param<P>(l.params, 0);
    for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
      const std::int64_t begin = bx * tile, end = std::min<std::int64_t>(total(p), begin + tile);
      if (begin < end) f(p, begin, end);
    }
  };
  return fn;
}

// gemm_fused, persistent like the real module's on sm_90a (with this fake's small tiles): block b
// of a grid of G blocks (x times y, as the kernel counts them) takes tiles b, b + G, ... of
// ceil(M / kFusedMTile) x ceil(N / kDecodeTile), M tile fastest, each computed by the CPU twin of
// the decode-layout kernel on the tile's rows (A and C offset to its first row).
inline fake::FakeFunction persistent_fused_entry() {
  fake::FakeFunction fn;
  fn.param_sizes = {sizeof(GemmParams)};
  fn.body = [](const fake::FakeLaunch& l) {
    const auto p = read_param<GemmParams>(l.params, 0);
    const std::int64_t m_tiles = (p.m + kFusedMTile - 1) / kFusedMTile;
    const std::int64_t tiles = m_tiles * ((p.n + kDecodeTile - 1) / kDecodeTile);
    const std::int64_t grid = std::int64_t{l.grid[0]} * l.grid[1];
    const std::uint64_t c_bytes = (p.flags & kGemmOutF32) != 0 ? 4 : 2;
    for (std::int64_t b = 0; b < grid; ++b) {
      for (std::int64_t t = b; t < tiles; t += grid) {
        const std::int64_t m0 = t % m_tiles * kFusedMTile, n0 = t / m_tiles * kDecodeTile;
        GemmParams rows = p;
        rows.m = std::min<std::int64_t>(kFusedMTile, p.m - m0);
        rows.a = p.a + static_cast<std::uint64_t>(m0 * p.k) * 2;
        rows.out = p.out + static_cast<std::uint64_t>(m0 * p.n) * c_bytes;
        metrale::cpu::w4a16::gemm_decode_packed(rows, n0,
                                                std::min<std::int64_t>(p.n, n0 + kDecodeTile));
      }
    }
  };
  return fn;
}

// A grouped GEMM (kernels/grouped_params.h): block (x, y) runs f on expert y's GEMM over columns
// [x·tile, x·tile + tile), where the expert has rows.
template <class F>
fake::FakeFunction grouped_entry(std::uint32_t tile, F f) {
  fake::FakeFunction fn;
  fn.param_sizes = {sizeof(GroupedGemmParams)};
  fn.body = [tile, f](const fake::FakeLaunch& l) {
    const auto g = read_param<GroupedGemmParams>(l.params, 0);
    for (std::int64_t by = 0; by < l.grid[1]; ++by) {
      GemmParams p;
      if (!grouped::expert_params(g, by, &p)) continue;
      for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
        const std::int64_t begin = bx * tile, end = std::min<std::int64_t>(p.n, begin + tile);
        if (begin < end) f(p, begin, end);
      }
    }
  };
  return fn;
}

// gemm_grouped_fused, persistent like the real module's (kernels/fused_tile.h's slots, with this
// fake's tiles): expert e's rows take ceil(rows / kFusedMTile) slots, none where expert_params
// skips it; block b of a grid of G blocks takes tiles b, b + G, ... of slots x ceil(N /
// kDecodeTile), slot fastest, each computed by the decode-layout twin on the slot's rows (int4:
// gemm_grouped_int4_fused, the INT4 decode layout's twin).
inline fake::FakeFunction persistent_grouped_fused_entry(bool int4 = false) {
  fake::FakeFunction fn;
  fn.param_sizes = {sizeof(GroupedGemmParams)};
  fn.body = [int4](const fake::FakeLaunch& l) {
    const auto g = read_param<GroupedGemmParams>(l.params, 0);
    const std::uint64_t c_bytes = (g.gemm.flags & kGemmOutF32) != 0 ? 4 : 2;
    std::vector<GemmParams> slots;  // each slot's rows as a GEMM of their own
    for (std::int64_t e = 0; e < g.experts; ++e) {
      GemmParams p;
      if (!grouped::expert_params(g, e, &p)) continue;
      for (std::int64_t m0 = 0; m0 < p.m; m0 += kFusedMTile) {
        GemmParams rows = p;
        rows.m = std::min<std::int64_t>(kFusedMTile, p.m - m0);
        rows.a = p.a + static_cast<std::uint64_t>(m0 * p.k) * 2;
        rows.out = p.out + static_cast<std::uint64_t>(m0 * p.n) * c_bytes;
        slots.push_back(rows);
      }
    }
    const auto count = static_cast<std::int64_t>(slots.size());
    const std::int64_t tiles = count * ((g.gemm.n + kDecodeTile - 1) / kDecodeTile);
    const std::int64_t grid = std::int64_t{l.grid[0]} * l.grid[1];
    for (std::int64_t b = 0; b < grid; ++b) {
      for (std::int64_t t = b; t < tiles; t += grid) {
        const std::int64_t n0 = t / count * kDecodeTile;
        const GemmParams& slot = slots[static_cast<std::size_t>(t % count)];
        const std::int64_t n1 = std::min<std::int64_t>(g.gemm.n, n0 + kDecodeTile);
        if (int4) {
          metrale::cpu::w4a16::gemm_int4_decode(slot, n0, n1);
        } else {
          metrale::cpu::w4a16::gemm_decode_packed(slot, n0, n1);
        }
      }
    }
  };
  return fn;
}

// "w4a16" with the entries, tiles and _a_e4m3 flags the ops expect.
inline fake::ModuleSpec w4a16_module() {
  namespace k = metrale::cpu::w4a16;
  const auto cols = [](const GemmParams& p) { return p.n; };
  const auto count = [](const CastParams& p) { return p.count; };
  fake::ModuleSpec m;
  m.name = "w4a16";
  auto& f = m.fake.functions;
  f["gemm_decode"] = tiled_entry<GemmParams>(
      kDecodeTile,
      [](const GemmParams& p, std::int64_t a, std::int64_t b) {
        k::gemm_decode(p, a, b, k::best_isa());
      },
      cols);
  f["gemm_decode_packed"] = tiled_entry<GemmParams>(kDecodeTile, k::gemm_decode_packed, cols);
  // The fused route's entry, persistent, computed as the CPU module's twin computes it.
  f["gemm_fused"] = persistent_fused_entry();
  f["gemm_tiled"] = tiled_entry<GemmParams>(
      kTiledTile,
      [](const GemmParams& p, std::int64_t a, std::int64_t b) {
        k::gemm_tiled(p, a, b, 0, p.m, k::best_isa());  // no m_tile: all rows
      },
      cols);
  f["gemm_e4m3"] = tiled_entry<GemmParams>(kE4m3Tile, k::gemm_e4m3, cols);
  f["bf16_to_fp8"] = tiled_entry<CastParams>(kCastTile, k::cast_bf16_to_e4m3, count);
  f["dequant_e4m3"] = tiled_entry<CastParams>(kDequantTile, k::dequant_e4m3, count);
  f["dequant_bf16"] = tiled_entry<GemmParams>(
      kDequantBf16Tile, k::dequant_bf16,
      [](const GemmParams& p) { return metrale::dequant::unit_count(p.n, p.k); });
  // INT4 in the INT4 decode layout, computed as the CPU module's twins compute it.
  f["gemm_int4_decode"] = tiled_entry<GemmParams>(kDecodeTile, k::gemm_int4_decode, cols);
  // The grouped GEMMs: the decode kernels per expert, unverified as the real module's.
  f["gemm_grouped"] =
      grouped_entry(kDecodeTile, [](const GemmParams& p, std::int64_t a, std::int64_t b) {
        k::gemm_decode(p, a, b, k::best_isa());
      });
  f["gemm_grouped_packed"] = grouped_entry(kDecodeTile, k::gemm_decode_packed);
  f["gemm_grouped_int4_decode"] = grouped_entry(kDecodeTile, k::gemm_int4_decode);
  f["gemm_grouped_fused"] = persistent_grouped_fused_entry();
  f["gemm_grouped_int4_fused"] = persistent_grouped_fused_entry(true);
  // Never launched here (no grouped entry publishes _split_k, as no CPU twin splits K).
  f["gemm_grouped_split_reduce"] =
      grouped_entry(kDecodeTile, [](const GemmParams& p, std::int64_t a, std::int64_t b) {
        for (std::int64_t row = 0; row < p.m; ++row) {
          k::split_reduce(p, row * p.n + a, row * p.n + b);
        }
      });
  f["dequant_int4_bf16"] = tiled_entry<GemmParams>(
      kDequantBf16Tile, k::dequant_int4_bf16,
      [](const GemmParams& p) { return metrale::dequant_int4::unit_count(p.n, p.k); });
  f["permute_a_int4"] = tiled_entry<GemmParams>(
      kDequantBf16Tile,
      [](const GemmParams& p, std::int64_t a, std::int64_t b) {
        for (std::int64_t u = a; u < b; ++u) metrale::int4_permute::unit(p, u);
      },
      [](const GemmParams& p) { return metrale::int4_permute::unit_count(p.m, p.k); });
  f["gemm_split_reduce"] = tiled_entry<GemmParams>(kReduceTile, k::split_reduce,
                                                   [](const GemmParams& p) { return p.m * p.n; });
  m.fake.publish_u32("gemm_decode_n_tile", kDecodeTile)
      .publish_u32("gemm_split_reduce_n_tile", kReduceTile)
      .publish_u32("gemm_decode_max_m", kDecodeMaxM)
      .publish_u32("gemm_decode_packed_n_tile", kDecodeTile)
      // The decode layout with no largest M, as the CPU module: uploads that follow the
      // backend's preference keep the source layout, so the lifecycle is what it was.
      .publish_u32("gemm_decode_packed_layout", metrale::decode_layout::kLayoutId)
      .publish_u32("gemm_fused_n_tile", kDecodeTile)
      .publish_u32("gemm_fused_m_tile", kFusedMTile)
      .publish_u32("gemm_fused_persistent", 1)
      .publish_u32("gemm_fused_blocks_per_sm", 1)
      .publish_u32("gemm_fused_layout", metrale::decode_layout::kLayoutId)
      .publish_u32("gemm_tiled_n_tile", kTiledTile)
      .publish_u32("gemm_e4m3_n_tile", kE4m3Tile)
      .publish_u32("gemm_e4m3_min_m", 64)  // as the CPU module: auto takes e4m3 where allowed
      .publish_u32("bf16_to_fp8_n_tile", kCastTile)
      .publish_u32("dequant_e4m3_n_tile", kDequantTile)
      .publish_u32("dequant_bf16_n_tile", kDequantBf16Tile)
      // Exact-BF16 routes say so; the e4m3 route says it casts A.
      .publish_u32("gemm_decode_a_e4m3", 0)
      .publish_u32("gemm_decode_packed_a_e4m3", 0)
      .publish_u32("gemm_tiled_a_e4m3", 0)
      .publish_u32("gemm_e4m3_a_e4m3", 1)
      // The INT4 decode layout's entries as the real module publishes them: a largest M, no
      // verification, so uploads follow the backend's preference into the source layout.
      .publish_u32("gemm_int4_decode_n_tile", kDecodeTile)
      .publish_u32("gemm_int4_decode_max_m", kDecodeMaxM)
      .publish_u32("gemm_int4_decode_layout", metrale::int4_decode::kLayoutId)
      .publish_u32("gemm_int4_decode_int4", 1)
      .publish_u32("gemm_int4_decode_out_f32", 1)
      .publish_u32("dequant_int4_bf16_n_tile", kDequantBf16Tile)
      .publish_u32("dequant_int4_bf16_layout", metrale::int4_decode::kLayoutId)
      .publish_u32("dequant_int4_bf16_int4", 1)
      .publish_u32("permute_a_int4_n_tile", kDequantBf16Tile)
      .publish_u32("permute_a_int4_layout", metrale::int4_decode::kLayoutId)
      .publish_u32("permute_a_int4_int4", 1)
      .publish_u32("gemm_grouped_n_tile", kDecodeTile)
      .publish_u32("gemm_grouped_packed_n_tile", kDecodeTile)
      .publish_u32("gemm_grouped_packed_layout", metrale::decode_layout::kLayoutId)
      .publish_u32("gemm_grouped_int4_decode_n_tile", kDecodeTile)
      .publish_u32("gemm_grouped_int4_decode_layout", metrale::int4_decode::kLayoutId)
      .publish_u32("gemm_grouped_int4_decode_int4", 1)
      .publish_u32("gemm_grouped_fused_n_tile", kDecodeTile)
      .publish_u32("gemm_grouped_fused_m_tile", kFusedMTile)
      .publish_u32("gemm_grouped_fused_persistent", 1)
      .publish_u32("gemm_grouped_fused_blocks_per_sm", 1)
      .publish_u32("gemm_grouped_fused_layout", metrale::decode_layout::kLayoutId)
      .publish_u32("gemm_grouped_int4_fused_n_tile", kDecodeTile)
      .publish_u32("gemm_grouped_int4_fused_m_tile", kFusedMTile)
      .publish_u32("gemm_grouped_int4_fused_persistent", 1)
      .publish_u32("gemm_grouped_int4_fused_blocks_per_sm", 1)
      .publish_u32("gemm_grouped_int4_fused_layout", metrale::int4_decode::kLayoutId)
      .publish_u32("gemm_grouped_int4_fused_int4", 1)
      .publish_u32("gemm_grouped_split_reduce_n_tile", kDecodeTile);
  // Every entry of the manifest, each with the block size it publishes.
  m.entries.assign(metrale::manifest::kW4a16Entries.begin(),
                   metrale::manifest::kW4a16Entries.end());
  for (const std::string& e : m.entries) {
    if (!f.contains(e)) throw std::logic_error("fake w4a16 module: no fake for entry " + e);
    m.fake.publish_u32(e + "_block_threads", kBlockThreads);
  }
  return m;
}

// A fake driver with the model's modules registered (one per process, like a real driver).
struct FakeProcess {
  fake::FakeDriver fd;
  fake::ModuleSet modules;

  FakeProcess() {
    for (const fake::ModuleSpec& m : {fake::core_module(), w4a16_module()}) {
      fd.add_module(m.name, m.fake);
      modules.add(m);
    }
  }

  // Discovery (cuInit, cuDriverGetVersion) → host → registry → backend → require_kernels.
  std::unique_ptr<Backend> make_backend() {
    const cuda::DriverApi& api = fd.api();
    if (const CUresult s = api.cuInit(0); s != CUDA_SUCCESS) {
      cuda::throw_status(&api, "cuda", "cuInit", s);
    }
    int version = 0;
    if (const CUresult s = api.cuDriverGetVersion(&version); s != CUDA_SUCCESS) {
      cuda::throw_status(&api, "cuda", "cuDriverGetVersion", s);
    }
    auto host = cuda::CudaHost::create(api, 0, version);
    auto registry = cuda::ModuleRegistry::load(host, modules.span());
    auto backend = std::make_unique<CudaBackend>(std::move(host), std::move(registry));
    backend->set_guard_bands(GuardBandConfig{});
    backend->set_debug_sync(false);
    backend->require_kernels();
    return backend;
  }
};

}  // namespace metrale::testing::reliability
