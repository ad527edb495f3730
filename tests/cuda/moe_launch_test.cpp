// The MoE glue (ops/moe.h) on the CUDA backend over the fake driver: a fake "moe" module that
// publishes the real module's tiles (cuda/kernels/moe.cu: 8 tokens or entries a block for route
// and gather, one block for count, a block per expert for scatter, per token for combine) and
// whose bodies run the shared host rules block by block over exactly the grid they are launched
// with, so a grid sized from anything but the published tile leaves outputs unwritten. Checked:
// no device run has verified the module, so every op refuses it unless the caller opts in; opted
// in, a whole route → align → gather → combine matches the CPU backend's bytes.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "kernels/moe_glu.h"
#include "kernels/moe_permute.h"
#include "kernels/moe_route.h"
#include "metrale/cpu_backend.h"
#include "metrale/ops/moe.h"
#include "support/read_back.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::read;
using metrale::testing::upload;

constexpr std::uint32_t kThreads = 256;
constexpr std::uint32_t kWarpTile = 8;  // tokens (route) or entries (gather) a block

template <class P>
P params(const FakeLaunch& l) {
  return read_param<P>(l.params, 0);
}

ModuleSpec moe_module(std::vector<FakeLaunch>* launches) {
  ModuleSpec m;
  m.name = "moe";
  const auto record = [launches](const FakeLaunch& l) {
    FakeLaunch copy = l;
    copy.params = nullptr;
    launches->push_back(copy);
  };
  FakeFunction route;
  route.param_sizes = {sizeof(MoeRouteParams)};
  route.body = [record](const FakeLaunch& l) {
    record(l);
    const auto p = params<MoeRouteParams>(l);
    for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
      for (std::int64_t t = bx * kWarpTile;
           t < std::min<std::int64_t>(p.tokens, (bx + 1) * kWarpTile); ++t) {
        moe::route_token(p, t);
      }
    }
  };
  FakeFunction count;
  count.param_sizes = {sizeof(MoeAlignParams)};
  count.body = [record](const FakeLaunch& l) {
    record(l);
    const auto p = params<MoeAlignParams>(l);
    const auto* ids = reinterpret_cast<const std::int32_t*>(p.ids);
    auto* counts = reinterpret_cast<std::int32_t*>(p.counts);
    auto* rows = reinterpret_cast<std::int32_t*>(p.rows);
    std::fill(counts, counts + p.experts, 0);
    for (std::int64_t i = 0; i < p.entries; ++i) {
      if (moe::valid_id(ids[i], p.experts)) {
        ++counts[ids[i]];
      } else {
        rows[i] = -1;
      }
    }
    for (std::int32_t e = 0; e < p.experts; ++e) {
      if (p.capacity > 0)
        counts[e] = static_cast<std::int32_t>(std::min<std::int64_t>(counts[e], p.capacity));
    }
    moe::write_offsets(p);
  };
  FakeFunction scatter;
  scatter.param_sizes = {sizeof(MoeAlignParams)};
  scatter.body = [record](const FakeLaunch& l) {
    record(l);
    const auto p = params<MoeAlignParams>(l);
    const auto* ids = reinterpret_cast<const std::int32_t*>(p.ids);
    auto* rows = reinterpret_cast<std::int32_t*>(p.rows);
    for (std::int32_t e = 0; e < std::min<std::int64_t>(p.experts, l.grid[0]); ++e) {
      std::int64_t rank = 0;
      for (std::int64_t i = 0; i < p.entries; ++i) {
        if (ids[i] == e) rows[i] = moe::row_of(p, e, rank++);
      }
    }
  };
  FakeFunction gather;
  gather.param_sizes = {sizeof(MoePermuteParams)};
  gather.body = [record](const FakeLaunch& l) {
    record(l);
    const auto p = params<MoePermuteParams>(l);
    const auto* rows = reinterpret_cast<const std::int32_t*>(p.rows);
    const auto* in = reinterpret_cast<const std::uint16_t*>(p.in);
    auto* out = reinterpret_cast<std::uint16_t*>(p.out);
    const std::int64_t n = std::min<std::int64_t>(p.tokens * p.top_k, l.grid[0] * kWarpTile);
    for (std::int64_t i = 0; i < n; ++i) {
      if (!moe::has_row(p, rows[i])) continue;
      std::copy_n(in + i / p.top_k * p.width, p.width, out + rows[i] * p.width);
    }
  };
  FakeFunction combine;
  combine.param_sizes = {sizeof(MoePermuteParams)};
  combine.body = [record](const FakeLaunch& l) {
    record(l);
    const auto p = params<MoePermuteParams>(l);
    auto* out = reinterpret_cast<std::uint16_t*>(p.out);
    for (std::int64_t t = 0; t < std::min<std::int64_t>(p.tokens, l.grid[0]); ++t) {
      for (std::int64_t c = 0; c < p.width; ++c)
        out[t * p.width + c] = moe::combine_element(p, t, c);
    }
  };
  FakeFunction glu;
  glu.param_sizes = {sizeof(MoeGluParams)};
  glu.body = [record](const FakeLaunch& l) {
    record(l);
    const auto p = params<MoeGluParams>(l);
    auto* act = reinterpret_cast<std::uint16_t*>(p.act);
    for (std::int64_t r = 0; r < std::min<std::int64_t>(p.row_capacity, l.grid[0]); ++r) {
      if (!moe::glu_row_used(p, r)) continue;
      for (std::int64_t i = 0; i < p.inter; ++i) act[r * p.inter + i] = moe::glu_element(p, r, i);
    }
  };
  m.fake.functions["moe_route"] = route;
  m.fake.functions["moe_count"] = count;
  m.fake.functions["moe_scatter"] = scatter;
  m.fake.functions["moe_gather"] = gather;
  m.fake.functions["moe_combine"] = combine;
  m.fake.functions["moe_glu"] = glu;
  const std::pair<const char*, std::uint32_t> tiles[] = {
      {"moe_route", kWarpTile}, {"moe_count", moe::kMaxExperts},
      {"moe_scatter", 1},       {"moe_gather", kWarpTile},
      {"moe_combine", 1},       {"moe_glu", 1}};
  for (const auto& [e, tile] : tiles) {
    m.fake.publish_u32(std::string(e) + "_n_tile", tile);
    m.fake.publish_u32(std::string(e) + "_block_threads", kThreads);
    m.entries.emplace_back(e);
  }
  return m;
}

struct MoeRig {
  MoeRig() : rig(options(&launches)) {}
  static RigOptions options(std::vector<FakeLaunch>* launches) {
    RigOptions o;
    o.modules = {core_module(), moe_module(launches)};
    return o;
  }
  std::vector<FakeLaunch> launches;
  Rig rig;
};

TEST(MoeLaunch, UnverifiedKernelsAreRefusedUnlessTheCallerOptsIn) {
  MoeRig r;
  CudaBackend& b = r.rig.b();
  const DevicePtr logits = b.alloc(4 * 8 * 4), ids = b.alloc(4 * 2 * 4), w = b.alloc(4 * 2 * 4);
  ops::MoeRouting routing;
  routing.top_k = 2;
  const ops::MoeShape shape{4, 8, 2, 0};
  EXPECT_ERROR(ops::moe_route(b, b.default_stream(), logits, shape, routing, ids, w),
               ErrorCode::kUnavailable, "not yet run on a GPU; set MoeOptions::allow_unverified");
  const ops::MoeRows rows{b.alloc(32), b.alloc(36), b.alloc(32)};
  EXPECT_ERROR(ops::moe_align(b, b.default_stream(), ids, shape, rows), ErrorCode::kUnavailable,
               "moe::moe_count");
  EXPECT_TRUE(r.launches.empty());
  for (DevicePtr p : {logits, ids, w, rows.counts, rows.offsets, rows.rows}) b.free(p);
}

TEST(MoeLaunch, OptedInTheWholeGlueMatchesTheCpuBackend) {
  std::mt19937_64 gen{std::random_device{}()};
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  for (const auto& [tokens, experts, top_k, masked] :
       {std::tuple{1, 8, 2, false}, {19, 64, 6, false}, {33, 16, 4, true}}) {
    SCOPED_TRACE(fmt::format("T={} E={} k={} masked {}", tokens, experts, top_k, masked));
    const ops::MoeShape shape{tokens, experts, top_k, masked ? tokens : 0};
    const std::int64_t width = 32;  // the glu's y: gate and up of inter = 16
    std::vector<float> logits(static_cast<std::size_t>(tokens * experts));
    for (auto& x : logits) x = u(gen);
    std::vector<std::uint16_t> x(static_cast<std::size_t>(tokens * width));
    for (auto& v : x) v = num::f32_to_bf16(u(gen));
    ops::MoeRouting routing;
    routing.top_k = top_k;
    routing.renormalize = true;
    const auto n = static_cast<std::size_t>(tokens * top_k);
    const auto rows_n = static_cast<std::size_t>(shape.row_capacity());
    const auto e_n = static_cast<std::size_t>(experts);
    // The glue on one backend: the rows, the permuted x (poisoned first) and the combine of it.
    struct Out {
      std::vector<std::int32_t> ids, counts, offsets, rows;
      std::vector<float> w;
      std::vector<std::uint16_t> perm, out, act;
    };
    const auto glue = [&](Backend& b, const ops::MoeOptions& o) {
      const StreamHandle s = b.default_stream();
      const DevicePtr dl = upload(b, logits), dx = upload(b, x);
      const DevicePtr ids = b.alloc(n * 4), w = b.alloc(n * 4);
      const ops::MoeRows rows{b.alloc(e_n * 4), b.alloc(e_n * 4 + 4), b.alloc(n * 4)};
      const DevicePtr perm = b.alloc(rows_n * width * 2), out = b.alloc(n * width * 2);
      b.memset(perm, 0xAB, rows_n * width * 2);
      const DevicePtr act = b.alloc(rows_n * width);
      b.memset(out, 0xAB, static_cast<std::size_t>(tokens * width * 2));
      b.memset(act, 0xAB, rows_n * width);
      ops::moe_route(b, s, dl, shape, routing, ids, w, o);
      ops::moe_align(b, s, ids, shape, rows, o);
      ops::moe_gather(b, s, dx, shape, width, rows.rows, perm, o);
      ops::moe_combine(b, s, perm, shape, width, rows.rows, w, out, o);
      ops::moe_glu(b, s, perm, shape, width / 2, {}, rows, act, o);
      b.synchronize(s);
      Out r{read<std::int32_t>(b, ids, n),
            read<std::int32_t>(b, rows.counts, e_n),
            read<std::int32_t>(b, rows.offsets, e_n + 1),
            read<std::int32_t>(b, rows.rows, n),
            read<float>(b, w, n),
            read<std::uint16_t>(b, perm, rows_n * width),
            read<std::uint16_t>(b, out, static_cast<std::size_t>(tokens * width)),
            read<std::uint16_t>(b, act, rows_n * width / 2)};
      for (DevicePtr p : {dl, dx, ids, w, rows.counts, rows.offsets, rows.rows, perm, out, act}) {
        b.free(p);
      }
      return r;
    };
    MoeRig r;
    const Out gpu = glue(r.rig.b(), ops::MoeOptions{true});
    CpuBackend cpu;
    const Out want = glue(cpu, {});
    EXPECT_EQ(gpu.ids, want.ids);
    EXPECT_EQ(gpu.w, want.w);
    EXPECT_EQ(gpu.counts, want.counts);
    EXPECT_EQ(gpu.offsets, want.offsets);
    EXPECT_EQ(gpu.rows, want.rows);
    EXPECT_EQ(gpu.perm, want.perm);
    EXPECT_EQ(gpu.out, want.out);
    EXPECT_EQ(gpu.act, want.act);
    // The grids: the published tiles, one block for the count.
    ASSERT_EQ(r.launches.size(), 6u);
    const unsigned want_grid[] = {
        static_cast<unsigned>((tokens + 7) / 8), 1,
        static_cast<unsigned>(experts),          static_cast<unsigned>((n + 7) / 8),
        static_cast<unsigned>(tokens),           static_cast<unsigned>(rows_n)};
    for (std::size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(r.launches[i].grid[0], want_grid[i]) << r.launches[i].function;
      EXPECT_EQ(r.launches[i].block[0], kThreads) << r.launches[i].function;
    }
  }
}

}  // namespace
}  // namespace metrale::cuda::testing
