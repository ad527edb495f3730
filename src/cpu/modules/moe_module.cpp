// Module "moe" on the CPU: the routing, permutation and activation kernels of a mixture-of-experts
// layer (src/kernels/moe_route.h, moe_permute.h, moe_glu.h), with the same entries and published
// fields as the GPU module (src/cuda/kernels/moe.cu). The CPU's blocks cover more than the GPU's (a
// block is one host call), so the grids the op sizes from them are small; what a block computes is
// the same.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/modules/modules.h"
#include "kernels/moe_glu.h"
#include "kernels/moe_permute.h"
#include "kernels/moe_route.h"
#include "kernels/verified_devices.h"
#include "metrale/kernel_args.h"

namespace metrale::cpu {
namespace {

constexpr std::uint32_t kBlockThreads = 256;  // the shape the launch checks see, as on the GPU
constexpr std::uint32_t kRouteTile = 64;      // tokens
constexpr std::uint32_t kGatherTile = 64;     // entries
constexpr std::uint32_t kCombineTile = 16;    // tokens
constexpr std::uint32_t kGluTile = 16;        // rows

template <class T>
T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address));
}

std::pair<std::int64_t, std::int64_t> span(const HostBlock& b, std::int64_t tile,
                                           std::int64_t total) {
  const std::int64_t begin = std::int64_t{b.block_idx.x} * tile;
  return {begin, std::min(total, begin + tile)};
}

void moe_route(const HostBlock& b) {
  const auto p = read_param<MoeRouteParams>(b.params, 0);
  const auto [t0, t1] = span(b, kRouteTile, p.tokens);
  for (std::int64_t t = t0; t < t1; ++t) moe::route_token(p, t);
}

// One block: the counts (clamped to a masked layout's capacity), -1 rows for invalid ids, the
// offsets.
void moe_count(const HostBlock& b) {
  const auto p = read_param<MoeAlignParams>(b.params, 0);
  if (b.block_idx.x != 0) return;
  const auto* ids = at<const std::int32_t>(p.ids);
  auto* counts = at<std::int32_t>(p.counts);
  auto* rows = at<std::int32_t>(p.rows);
  std::vector<std::int64_t> n(static_cast<std::size_t>(p.experts), 0);
  for (std::int64_t i = 0; i < p.entries; ++i) {
    if (moe::valid_id(ids[i], p.experts)) {
      ++n[static_cast<std::size_t>(ids[i])];
    } else {
      rows[i] = -1;
    }
  }
  for (std::int32_t e = 0; e < p.experts; ++e) {
    const std::int64_t c = n[static_cast<std::size_t>(e)];
    counts[e] = static_cast<std::int32_t>(p.capacity > 0 ? std::min(c, p.capacity) : c);
  }
  moe::write_offsets(p);
}

// Experts [e0, e1) of this block: one pass over the entries, each match the next row of its
// expert.
void moe_scatter(const HostBlock& b) {
  const auto p = read_param<MoeAlignParams>(b.params, 0);
  const std::int64_t e0 = std::int64_t{b.block_idx.x} * moe::kMaxExperts;
  const std::int64_t e1 = std::min<std::int64_t>(p.experts, e0 + moe::kMaxExperts);
  if (e0 >= e1) return;
  const auto* ids = at<const std::int32_t>(p.ids);
  auto* rows = at<std::int32_t>(p.rows);
  std::vector<std::int64_t> rank(static_cast<std::size_t>(e1 - e0), 0);
  for (std::int64_t i = 0; i < p.entries; ++i) {
    const std::int32_t id = ids[i];
    if (id >= e0 && id < e1)
      rows[i] = moe::row_of(p, id, rank[static_cast<std::size_t>(id - e0)]++);
  }
}

void moe_gather(const HostBlock& b) {
  const auto p = read_param<MoePermuteParams>(b.params, 0);
  const auto [i0, i1] = span(b, kGatherTile, p.tokens * p.top_k);
  const auto* rows = at<const std::int32_t>(p.rows);
  const auto* in = at<const std::uint16_t>(p.in);
  auto* out = at<std::uint16_t>(p.out);
  const auto bytes = static_cast<std::size_t>(p.width) * 2;
  for (std::int64_t i = i0; i < i1; ++i) {
    if (!moe::has_row(p, rows[i])) continue;
    if (p.columns == 0) {
      std::memcpy(out + rows[i] * p.width, in + i / p.top_k * p.width, bytes);
      continue;
    }
    for (std::int64_t c = 0; c < p.width; ++c) {
      out[rows[i] * p.width + c] = moe::gather_element(p, i, c);
    }
  }
}

void moe_combine(const HostBlock& b) {
  const auto p = read_param<MoePermuteParams>(b.params, 0);
  const auto [t0, t1] = span(b, kCombineTile, p.tokens);
  auto* out = at<std::uint16_t>(p.out);
  for (std::int64_t t = t0; t < t1; ++t) {
    for (std::int64_t c = 0; c < p.width; ++c) out[t * p.width + c] = moe::combine_element(p, t, c);
  }
}

void moe_glu(const HostBlock& b) {
  const auto p = read_param<MoeGluParams>(b.params, 0);
  const auto [r0, r1] = span(b, kGluTile, p.row_capacity);
  auto* act = at<std::uint16_t>(p.act);
  for (std::int64_t r = r0; r < r1; ++r) {
    if (!moe::glu_row_used(p, r)) continue;
    for (std::int64_t i = 0; i < p.inter; ++i) act[r * p.inter + i] = moe::glu_element(p, r, i);
  }
}

void publish(HostModule& m, const std::string& e, std::uint32_t tile) {
  m.publish_u32(e + "_n_tile", tile).publish_u32(e + "_block_threads", kBlockThreads);
  m.publish_u32(e + "_verified_on", verified::kHostReference);  // the reference itself
}

}  // namespace

HostModule make_moe_module() {
  HostModule m("moe");
  m.add_kernel("moe_route", moe_route, {static_cast<std::uint16_t>(sizeof(MoeRouteParams))});
  m.add_kernel("moe_count", moe_count, {static_cast<std::uint16_t>(sizeof(MoeAlignParams))});
  m.add_kernel("moe_scatter", moe_scatter, {static_cast<std::uint16_t>(sizeof(MoeAlignParams))});
  m.add_kernel("moe_gather", moe_gather, {static_cast<std::uint16_t>(sizeof(MoePermuteParams))});
  m.add_kernel("moe_combine", moe_combine, {static_cast<std::uint16_t>(sizeof(MoePermuteParams))});
  m.add_kernel("moe_glu", moe_glu, {static_cast<std::uint16_t>(sizeof(MoeGluParams))});
  publish(m, "moe_route", kRouteTile);
  publish(m, "moe_count", moe::kMaxExperts);
  publish(m, "moe_scatter", moe::kMaxExperts);
  publish(m, "moe_gather", kGatherTile);
  publish(m, "moe_combine", kCombineTile);
  publish(m, "moe_glu", kGluTile);
  return m;
}

}  // namespace metrale::cpu
