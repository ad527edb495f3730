// Module "moe"'s GPU source (cuda/kernels/moe.cu) run on the host: every block of the grid the op
// sizes from the published tiles, 256 threads as fibers, the warps' shuffles and ballots emulated
// (warp_host.h), on the inputs the CPU backend's ops (tests/ops/moe_test.cpp: held to float64)
// take. What this reaches that the CPU test cannot: the warp-per-token search of the top k in
// rounds, the group choice, the block scan of the counts, the ballot ranks of the scatter over
// chunks of 256 entries, the warps past the last token or entry. The choice values are computed
// by the same expf here, so the experts must be the CPU's exactly; the weights' sums run in
// another order (a warp's tree), so they are held to the summation bound.
#include "cuda_host.h"  // first: the CUDA language on the host

#define __launch_bounds__(...)
#include "warp_host.h"

#include "cuda/kernels/moe.cu"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/ops/moe.h"

namespace metrale {
namespace {

namespace emu = metrale::emulation;

std::mt19937_64& gen() {
  static std::mt19937_64 g{std::random_device{}()};
  return g;
}

template <class T>
std::uint64_t addr(const std::vector<T>& v) {
  return reinterpret_cast<std::uintptr_t>(v.data());
}

DevicePtr upload_to(CpuBackend& b, const void* p, std::size_t bytes) {
  const DevicePtr d = b.alloc(std::max<std::size_t>(bytes, 16));
  b.copy_h2d(d, p, bytes);
  return d;
}

unsigned blocks(std::int64_t items, std::uint32_t tile) {
  return static_cast<unsigned>((items + tile - 1) / tile);
}

struct Case {
  std::uint32_t scoring;
  int experts, top_k, groups, topk_groups;
  bool renormalize;
};

TEST(MoeHost, RouteChoosesTheCpusExpertsWithinTheSumBound) {
  const Case cases[] = {{kMoeSoftmax, 128, 8, 1, 1, true},     {kMoeSoftmax, 8, 2, 1, 1, false},
                        {kMoeTopkSoftmax, 32, 4, 1, 1, false}, {kMoeSigmoid, 256, 8, 8, 4, true},
                        {kMoeSigmoid, 128, 3, 64, 2, true},    {kMoeSoftmax, 1, 1, 1, 1, false},
                        {kMoeSoftmax, 1000, 32, 1, 1, true}};
  std::uniform_real_distribution<float> u(-4.0f, 4.0f), ub(-0.1f, 0.1f);
  for (const Case& c : cases) {
    for (std::int64_t tokens : {1, 9, 20}) {
      SCOPED_TRACE(fmt::format("scoring {} E={} k={} groups {}/{} T={}", c.scoring, c.experts,
                               c.top_k, c.topk_groups, c.groups, tokens));
      std::vector<float> logits(static_cast<std::size_t>(tokens * c.experts)), bias;
      for (auto& x : logits) x = u(gen());
      if (c.scoring == kMoeSigmoid) {
        bias.resize(static_cast<std::size_t>(c.experts));
        for (auto& x : bias) x = ub(gen());
      }
      const auto n = static_cast<std::size_t>(tokens * c.top_k);
      std::vector<std::int32_t> ids(n, -7);
      std::vector<float> w(n, NAN);
      MoeRouteParams p;
      p.logits = addr(logits);
      p.bias = bias.empty() ? 0 : addr(bias);
      p.ids = addr(ids);
      p.weights = addr(w);
      p.tokens = tokens;
      p.experts = c.experts;
      p.top_k = c.top_k;
      p.groups = c.groups;
      p.topk_groups = c.topk_groups;
      p.scoring = c.scoring;
      p.renormalize = c.renormalize ? 1 : 0;
      p.scale = 1.5f;
      ASSERT_EQ(
          emu::run_grid(dim3(blocks(tokens, moe_route_n_tile)),
                        static_cast<int>(moe_route_block_threads), {}, [&p] { moe_route(p); }),
          "");
      // The CPU backend's op on the same logits.
      CpuBackend b;
      const StreamHandle s = b.create_stream();
      const DevicePtr dl = upload_to(b, logits.data(), logits.size() * 4);
      const DevicePtr db = bias.empty() ? DevicePtr{} : upload_to(b, bias.data(), bias.size() * 4);
      const DevicePtr di = b.alloc(n * 4), dw = b.alloc(n * 4);
      ops::MoeRouting r;
      r.scoring = c.scoring == kMoeSigmoid       ? ops::MoeScoring::kSigmoid
                  : c.scoring == kMoeTopkSoftmax ? ops::MoeScoring::kTopkSoftmax
                                                 : ops::MoeScoring::kSoftmax;
      r.top_k = c.top_k;
      r.renormalize = c.renormalize;
      r.scale = 1.5f;
      r.groups = c.groups;
      r.topk_groups = c.topk_groups;
      r.bias = db;
      ops::moe_route(b, s, dl, {tokens, c.experts, c.top_k, 0}, r, di, dw);
      b.synchronize(s);
      std::vector<std::int32_t> cpu_ids(n);
      std::vector<float> cpu_w(n);
      b.copy_d2h(cpu_ids.data(), di, n * 4);
      b.copy_d2h(cpu_w.data(), dw, n * 4);
      for (DevicePtr d : {dl, db, di, dw}) {
        if (d) b.free(d);
      }
      EXPECT_EQ(ids, cpu_ids);
      const bool over_all = c.scoring == kMoeSoftmax && !c.renormalize;
      const double bound = 2.0 * ((over_all ? c.experts : c.top_k) + 8) * std::ldexp(1.0, -24);
      for (std::size_t i = 0; i < n; ++i) {
        EXPECT_LE(std::abs(w[i] - cpu_w[i]), bound * std::abs(cpu_w[i])) << "entry " << i;
      }
    }
  }
}

TEST(MoeHost, AlignGatherCombineAndGluAreTheCpusBytes) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), uw(0.0f, 1.0f);
  // Widths of 16s, so that every case runs the gated activation too (its inter = width / 2 is
  // a multiple of 8). The last two: a rank holding 2 experts, top_k 4 above them (expert
  // parallelism: the ids of experts held elsewhere get no row).
  for (const auto& [tokens, top_k, experts, capacity, width] : {std::tuple{1, 1, 1, 0, 16},
                                                                {37, 4, 16, 0, 48},
                                                                {300, 8, 64, 0, 16},
                                                                {40, 2, 8, 40, 64},
                                                                {129, 8, 1000, 0, 16},
                                                                {6, 2, 4, 6, 16},
                                                                {20, 4, 2, 0, 16},
                                                                {20, 4, 2, 20, 32}}) {
    SCOPED_TRACE(fmt::format("T={} k={} E={} capacity {} width {}", tokens, top_k, experts,
                             capacity, width));
    const auto n = static_cast<std::size_t>(tokens * top_k);
    std::vector<std::int32_t> ids(n);
    std::uniform_int_distribution<int> pick(-1, experts);  // -1 and E: no row
    // The last case: every token names expert 2 twice, which overflows its masked capacity
    // (12 entries for 6 rows): the counts are clamped and the entries past it get no row.
    const bool overflow = tokens == 6 && capacity == 6;
    for (std::int64_t t = 0; t < tokens && overflow; ++t) {
      ids[static_cast<std::size_t>(t * top_k)] = ids[static_cast<std::size_t>(t * top_k + 1)] = 2;
    }
    for (std::int64_t t = 0; t < tokens && !overflow; ++t) {
      std::vector<int> seen;
      for (int j = 0; j < top_k; ++j) {
        int e;
        do e = pick(gen());
        while (e >= 0 && e < experts && std::find(seen.begin(), seen.end(), e) != seen.end());
        seen.push_back(e);
        ids[static_cast<std::size_t>(t * top_k + j)] = e;
      }
    }
    const auto e_n = static_cast<std::size_t>(experts);
    std::vector<std::int32_t> counts(e_n, -7), offsets(e_n + 1, -7), rows(n, -7);
    MoeAlignParams a;
    a.ids = addr(ids);
    a.counts = addr(counts);
    a.offsets = addr(offsets);
    a.rows = addr(rows);
    a.entries = static_cast<std::int64_t>(n);
    a.experts = experts;
    a.capacity = capacity;
    ASSERT_EQ(emu::run_grid(dim3(1), static_cast<int>(moe_count_block_threads), {},
                            [&a] { moe_count(a); }),
              "");
    ASSERT_EQ(
        emu::run_grid(dim3(blocks(experts, moe_scatter_n_tile)),
                      static_cast<int>(moe_scatter_block_threads), {}, [&a] { moe_scatter(a); }),
        "");
    const ops::MoeShape shape{tokens, experts, top_k, capacity};
    CpuBackend b;
    const StreamHandle s = b.create_stream();
    const DevicePtr di = upload_to(b, ids.data(), n * 4);
    const ops::MoeRows dr{b.alloc(e_n * 4), b.alloc(e_n * 4 + 4), b.alloc(n * 4)};
    ops::moe_align(b, s, di, shape, dr);
    b.synchronize(s);
    std::vector<std::int32_t> c_counts(e_n), c_offsets(e_n + 1), c_rows(n);
    b.copy_d2h(c_counts.data(), dr.counts, e_n * 4);
    b.copy_d2h(c_offsets.data(), dr.offsets, e_n * 4 + 4);
    b.copy_d2h(c_rows.data(), dr.rows, n * 4);
    EXPECT_EQ(counts, c_counts);
    EXPECT_EQ(offsets, c_offsets);
    ASSERT_EQ(rows, c_rows);

    // Gather into poisoned rows, then combine random y with random weights.
    const auto rows_n = static_cast<std::size_t>(shape.row_capacity());
    const auto wn = static_cast<std::size_t>(width);
    std::vector<std::uint16_t> x(static_cast<std::size_t>(tokens) * wn), perm(rows_n * wn, 0xABAB);
    for (auto& v : x) v = num::f32_to_bf16(u(gen()));
    MoePermuteParams g;
    g.in = addr(x);
    g.out = addr(perm);
    g.rows = addr(rows);
    g.tokens = tokens;
    g.width = width;
    g.top_k = top_k;
    g.row_capacity = shape.row_capacity();
    ASSERT_EQ(
        emu::run_grid(dim3(blocks(static_cast<std::int64_t>(n), moe_gather_n_tile)),
                      static_cast<int>(moe_gather_block_threads), {}, [&g] { moe_gather(g); }),
        "");
    const DevicePtr dx = upload_to(b, x.data(), x.size() * 2);
    const DevicePtr dp = b.alloc(rows_n * wn * 2);
    b.memset(dp, 0xAB, rows_n * wn * 2);
    ops::moe_gather(b, s, dx, shape, width, dr.rows, dp);
    b.synchronize(s);
    std::vector<std::uint16_t> c_perm(rows_n * wn);
    b.copy_d2h(c_perm.data(), dp, c_perm.size() * 2);
    EXPECT_EQ(perm, c_perm);

    // The same with each expert's column order (act-ordered experts), one column outside.
    std::vector<std::int32_t> columns(e_n * wn);
    for (std::size_t e = 0; e < e_n; ++e) {
      std::iota(columns.begin() + e * wn, columns.begin() + (e + 1) * wn, 0);
      std::shuffle(columns.begin() + e * wn, columns.begin() + (e + 1) * wn, gen());
    }
    columns[wn - 1] = -3;
    std::vector<std::uint16_t> ordered(rows_n * wn, 0xABAB);
    MoePermuteParams o = g;
    o.out = addr(ordered);
    o.ids = addr(ids);
    o.columns = addr(columns);
    o.experts = experts;
    ASSERT_EQ(
        emu::run_grid(dim3(blocks(static_cast<std::int64_t>(n), moe_gather_n_tile)),
                      static_cast<int>(moe_gather_block_threads), {}, [&o] { moe_gather(o); }),
        "");
    const DevicePtr dc = upload_to(b, columns.data(), columns.size() * 4);
    b.memset(dp, 0xAB, rows_n * wn * 2);
    ops::moe_gather(b, s, dx, shape, width, dr.rows, dp, {}, ops::MoeColumnOrder{di, dc});
    b.synchronize(s);
    b.copy_d2h(c_perm.data(), dp, c_perm.size() * 2);
    EXPECT_EQ(ordered, c_perm);
    if (std::any_of(rows.begin(), rows.end(), [](std::int32_t r) { return r >= 0; })) {
      EXPECT_NE(ordered, perm);  // the order was applied
    }

    std::vector<std::uint16_t> y(rows_n * wn), out(static_cast<std::size_t>(tokens) * wn, 0xABAB);
    for (auto& v : y) v = num::f32_to_bf16(u(gen()));
    std::vector<float> w(n);
    for (auto& v : w) v = uw(gen());
    g.in = addr(y);
    g.out = addr(out);
    g.weights = addr(w);
    ASSERT_EQ(
        emu::run_grid(dim3(blocks(tokens, moe_combine_n_tile)),
                      static_cast<int>(moe_combine_block_threads), {}, [&g] { moe_combine(g); }),
        "");
    const DevicePtr dy = upload_to(b, y.data(), y.size() * 2);
    const DevicePtr dw = upload_to(b, w.data(), w.size() * 4);
    const DevicePtr dout = b.alloc(out.size() * 2);
    ops::moe_combine(b, s, dy, shape, width, dr.rows, dw, dout);
    b.synchronize(s);
    std::vector<std::uint16_t> c_out(out.size());
    b.copy_d2h(c_out.data(), dout, c_out.size() * 2);
    EXPECT_EQ(out, c_out);

    // The gated activation of y (as gate_up's C, inter = width / 2), both kinds, values past
    // gpt-oss's clamps included; rows of no entry stay poisoned on both.
    const std::int64_t inter = width / 2;
    std::uniform_real_distribution<float> wide(-10.0f, 10.0f);
    for (auto& v : y) v = num::f32_to_bf16(wide(gen()));
    b.copy_h2d(dy, y.data(), y.size() * 2);
    ASSERT_EQ(inter % 8, 0) << "the case's width leaves the activation unchecked";
    for (const ops::MoeGlu glu : {ops::MoeGlu::kSilu, ops::MoeGlu::kClampedSwiglu}) {
      std::vector<std::uint16_t> act(rows_n * static_cast<std::size_t>(inter), 0xABAB);
      MoeGluParams q;
      q.y = addr(y);
      q.act = addr(act);
      q.counts = addr(counts);
      q.offsets = addr(offsets);
      q.row_capacity = shape.row_capacity();
      q.inter = inter;
      q.capacity = capacity;
      q.experts = experts;
      q.kind = glu == ops::MoeGlu::kSilu ? kMoeGluSilu : kMoeGluClampedSwiglu;
      q.alpha = 1.702f;
      q.limit = 7.0f;
      ASSERT_EQ(emu::run_grid(dim3(blocks(shape.row_capacity(), moe_glu_n_tile)),
                              static_cast<int>(moe_glu_block_threads), {}, [&q] { moe_glu(q); }),
                "");
      const DevicePtr da = b.alloc(act.size() * 2);
      b.memset(da, 0xAB, act.size() * 2);
      ops::MoeActivation activation;
      activation.glu = glu;
      ops::moe_glu(b, s, dy, shape, inter, activation, dr, da);
      b.synchronize(s);
      std::vector<std::uint16_t> c_act(act.size());
      b.copy_d2h(c_act.data(), da, c_act.size() * 2);
      EXPECT_EQ(act, c_act) << "glu " << static_cast<int>(glu);
      b.free(da);
    }
    for (DevicePtr d : {di, dr.counts, dr.offsets, dr.rows, dx, dp, dc, dy, dw, dout}) b.free(d);
  }
}

}  // namespace
}  // namespace metrale
