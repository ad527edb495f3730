// The MoE glue (ops/moe.h) on the CPU backend, against float64 references written from the model
// code (moe_reference.h): routing by each family's rule on fresh random logits, the alignment of
// random routings (invalid ids, empty experts, one expert taking every token, the masked
// layout), the gather and the weighted combine. Outputs are poisoned first, so an element no
// kernel writes fails; bad arguments are refused with an error naming them.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/numerics.h"
#include "metrale/ops/moe.h"
#include "ops/gemm_reference.h"
#include "ops/moe_reference.h"
#include "support/random.h"
#include "support/read_back.h"
#include "toolkit/moe_routing.h"

namespace metrale {
namespace {

using ops::MoeScoring;
using testing::rng;
namespace ref = testing::moe_ref;
using testing::gemm::backend_name;

// Every case on "cpu" and on "cuda" (which skips, saying why, without a GPU; on one it runs the
// module no device run has verified yet, opted in: the device check's verification of it).
class MoeOps : public testing::gemm::GemmBackendTest {
 protected:
  ops::MoeOptions opt() const { return ops::MoeOptions{GetParam() == "cuda"}; }
};
INSTANTIATE_TEST_SUITE_P(, MoeOps, ::testing::Values("cpu", "cuda"), backend_name);

DevicePtr poison_buffer(Backend& b, std::size_t bytes) {
  const DevicePtr p = b.alloc(std::max<std::size_t>(bytes, 16));
  b.memset(p, 0xAB, bytes);
  return p;
}

std::vector<float> random_logits(std::size_t n, float spread) {
  std::uniform_real_distribution<float> u(-spread, spread);
  std::vector<float> v(n);
  for (auto& x : v) x = u(rng());
  return v;
}

ops::MoeRouting to_op(const ref::Routing& r, DevicePtr bias) {
  ops::MoeRouting o;
  o.scoring = r.scoring;
  o.top_k = r.top_k;
  o.renormalize = r.renormalize;
  o.scale = static_cast<float>(r.scale);
  o.groups = r.groups;
  o.topk_groups = r.topk_groups;
  o.bias = bias;
  return o;
}

// Checks one token's ids and weights against the float64 reference: the ids a best-first top k
// of the allowed experts (an expert may stand in for another only where their float64 values are
// within what FP32 rounding of the value can move, `tie`), each weight within the summation bound
// of the float64 weight of the expert chosen.
void check_token(const float* logits, int experts, const ref::Routing& r, const std::int32_t* ids,
                 const float* w, std::int64_t t) {
  const ref::Choice c = ref::choose(logits, experts, r);
  const double tie = 4e-7;  // a few FP32 ulps of values in (0, 8]
  std::vector<int> got(ids, ids + r.top_k);
  // A group may stand in for a chosen one where their scores are within FP32's rounding (the
  // kernel sums in FP32); then the experts are another group's and the order is not checked.
  bool group_swapped = false;
  for (int j = 0; j < r.top_k; ++j) {
    ASSERT_TRUE(got[j] >= 0 && got[j] < experts)
        << "token " << t << " slot " << j << ": id " << got[j];
    if (!c.allowed[got[j]]) {
      const int g = got[j] / (experts / r.groups);
      // Two FP32 sums of a sigmoid and a bias: within 1e-6 relative, as test_torch_moe allows.
      const double group_tie = 1e-6 * std::max(1.0, std::abs(c.group_cut));
      ASSERT_TRUE(r.groups > 1 && c.group_score[g] >= c.group_cut - group_tie)
          << "token " << t << ": expert " << got[j] << " of a group not chosen";
      group_swapped = true;
    }
  }
  for (int j = 0; j < r.top_k && !group_swapped; ++j) {
    const int want = c.order[j];
    if (got[j] != want) {
      EXPECT_NEAR(c.value[got[j]], c.value[want], tie)
          << "token " << t << " slot " << j << ": expert " << got[j] << " for " << want;
    }
  }
  std::vector<int> sorted = got;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::adjacent_find(sorted.begin(), sorted.end()), sorted.end())
      << "token " << t << ": an expert chosen twice";
  const std::vector<double> want_w = ref::weights(logits, experts, r, got);
  // Sequential FP32 sums of n terms are within n·u of the exact sum (u = 2^-24), exp and the
  // division a few ulps more: (terms + 8)·u relative, terms E for a softmax over all experts.
  const bool over_all = r.scoring == MoeScoring::kSoftmax && !r.renormalize;
  const double bound = ((over_all ? experts : r.top_k) + 8) * std::ldexp(1.0, -24);
  for (int j = 0; j < r.top_k; ++j) {
    EXPECT_LE(std::abs(w[j] - want_w[j]), bound * std::abs(want_w[j]) + 1e-30)
        << "token " << t << " slot " << j << ": weight " << w[j] << " for " << want_w[j];
  }
}

struct RouteCase {
  const char* name;
  ref::Routing r;
  int experts;
};

std::vector<RouteCase> route_cases() {
  std::vector<RouteCase> cs;
  cs.push_back(
      {"qwen3 softmax, renormalized", {MoeScoring::kSoftmax, 8, true, 1.0, 1, 1, {}}, 128});
  cs.push_back(
      {"mixtral softmax, renormalized", {MoeScoring::kSoftmax, 2, true, 1.0, 1, 1, {}}, 8});
  cs.push_back({"qwen2-moe softmax, not renormalized (norm_topk_prob false)",
                {MoeScoring::kSoftmax, 4, false, 1.0, 1, 1, {}},
                60});
  cs.push_back({"gpt-oss top-k softmax", {MoeScoring::kTopkSoftmax, 4, false, 1.0, 1, 1, {}}, 32});
  cs.push_back({"one expert", {MoeScoring::kSoftmax, 1, false, 1.0, 1, 1, {}}, 1});
  ref::Routing ds{MoeScoring::kSigmoid, 8, true, 2.5, 8, 4, {}};
  std::uniform_real_distribution<float> b(-0.1f, 0.1f);
  ds.bias.resize(256);
  for (auto& x : ds.bias) x = b(rng());
  cs.push_back({"deepseek-v3 sigmoid, groups, bias", ds, 256});
  cs.push_back(
      {"sigmoid without groups or bias", {MoeScoring::kSigmoid, 6, false, 1.0, 1, 1, {}}, 64});
  cs.push_back({"sigmoid, 64 groups of 2", {MoeScoring::kSigmoid, 3, true, 1.0, 64, 2, {}}, 128});
  return cs;
}

TEST_P(MoeOps, MoeRouteEachFamilysRuleAgainstFloat64) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  for (const RouteCase& c : route_cases()) {
    for (std::int64_t tokens : {1, 3, 70, 257}) {
      SCOPED_TRACE(fmt::format("{}: {} tokens", c.name, tokens));
      const auto logits = random_logits(static_cast<std::size_t>(tokens * c.experts), 4.0f);
      const DevicePtr d_logits = testing::upload(b, logits);
      const DevicePtr d_bias = c.r.bias.empty() ? DevicePtr{} : testing::upload(b, c.r.bias);
      const std::size_t n = static_cast<std::size_t>(tokens * c.r.top_k);
      const DevicePtr ids = poison_buffer(b, n * 4), w = poison_buffer(b, n * 4);
      const ops::MoeShape shape{tokens, c.experts, c.r.top_k, 0};
      ops::moe_route(b, s, d_logits, shape, to_op(c.r, d_bias), ids, w, opt());
      b.synchronize(s);
      const auto got_ids = testing::read<std::int32_t>(b, ids, n);
      const auto got_w = testing::read<float>(b, w, n);
      for (std::int64_t t = 0; t < tokens; ++t) {
        check_token(&logits[t * c.experts], c.experts, c.r, &got_ids[t * c.r.top_k],
                    &got_w[t * c.r.top_k], t);
      }
      for (DevicePtr p : {d_logits, d_bias, ids, w}) {
        if (p) b.free(p);
      }
    }
  }
}

TEST_P(MoeOps, MoeRouteTiesGoToTheLowerExpert) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  // Every logit equal: the first k experts, in order, each weight 1/E (1/k renormalized).
  const std::vector<float> logits(16, 0.5f);
  const DevicePtr d = testing::upload(b, logits);
  const DevicePtr ids = poison_buffer(b, 16), w = poison_buffer(b, 16);
  ops::MoeRouting r;
  r.top_k = 4;
  ops::moe_route(b, s, d, {1, 16, 4, 0}, r, ids, w, opt());
  b.synchronize(s);
  EXPECT_EQ(testing::read<std::int32_t>(b, ids, 4), (std::vector<std::int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(testing::read<float>(b, w, 4), std::vector<float>(4, 1.0f / 16));
  for (DevicePtr p : {d, ids, w}) b.free(p);
}

TEST_P(MoeOps, MoeRouteNanLogitsRankLast) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  // Token 0: expert 1 NaN, chosen by kTopkSoftmax after every number; token 1: every logit NaN,
  // the lowest experts in order.
  std::vector<float> logits = {0.5f, std::nanf(""), 2.0f, -1.0f};
  logits.insert(logits.end(), 4, std::nanf(""));
  const DevicePtr d = testing::upload(b, logits);
  const DevicePtr ids = poison_buffer(b, 24), w = poison_buffer(b, 24);
  ops::MoeRouting r;
  r.scoring = MoeScoring::kTopkSoftmax;
  r.top_k = 3;
  ops::moe_route(b, s, d, {2, 4, 3, 0}, r, ids, w, opt());
  b.synchronize(s);
  EXPECT_EQ(testing::read<std::int32_t>(b, ids, 6), (std::vector<std::int32_t>{2, 0, 3, 0, 1, 2}));
  const auto got = testing::read<float>(b, w, 6);
  const double z = std::exp(0.0) + std::exp(-1.5) + std::exp(-3.0);
  EXPECT_NEAR(got[0], 1.0 / z, 1e-6);
  EXPECT_NEAR(got[1], std::exp(-1.5) / z, 1e-6);
  EXPECT_NEAR(got[2], std::exp(-3.0) / z, 1e-6);
  for (int j = 3; j < 6; ++j) EXPECT_TRUE(std::isnan(got[j])) << "slot " << j;
  for (DevicePtr p : {d, ids, w}) b.free(p);
}

// The float64 alignment: counts, offsets and each entry's row, expert by expert in entry order.
struct Aligned {
  std::vector<std::int32_t> counts, offsets, rows;
};

Aligned align_reference(const std::vector<std::int32_t>& ids, int experts, std::int64_t capacity) {
  Aligned a;
  a.counts.assign(static_cast<std::size_t>(experts), 0);
  a.rows.assign(ids.size(), -1);
  std::vector<std::vector<std::size_t>> of(static_cast<std::size_t>(experts));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= 0 && ids[i] < experts) of[ids[i]].push_back(i);
  }
  std::int32_t at = 0;
  for (int e = 0; e < experts; ++e) {
    const auto start = static_cast<std::int32_t>(capacity > 0 ? e * capacity : at);
    a.offsets.push_back(start);
    for (std::size_t r = 0; r < of[e].size(); ++r) {
      if (capacity > 0 && static_cast<std::int64_t>(r) >= capacity) break;
      a.rows[of[e][r]] = start + static_cast<std::int32_t>(r);
      ++a.counts[e];
    }
    at += a.counts[e];
  }
  a.offsets.push_back(static_cast<std::int32_t>(capacity > 0 ? experts * capacity : at));
  return a;
}

// Each token's top_k distinct experts drawn with skew: expert e weighted (e + 1)^-skew.
std::vector<std::int32_t> random_ids(std::int64_t tokens, int top_k, int experts, double skew) {
  return toolkit::draw_expert_ids(rng(), tokens, top_k,
                                  toolkit::skewed_expert_weights(experts, skew));
}

void check_align(Backend& b, StreamHandle s, const std::vector<std::int32_t>& ids,
                 const ops::MoeShape& shape, const ops::MoeOptions& opt) {
  const Aligned want = align_reference(ids, shape.experts, shape.capacity);
  const auto e = static_cast<std::size_t>(shape.experts);
  const ops::MoeRows rows{poison_buffer(b, e * 4), poison_buffer(b, (e + 1) * 4),
                          poison_buffer(b, ids.size() * 4)};
  const DevicePtr d_ids = testing::upload(b, ids);
  ops::moe_align(b, s, d_ids, shape, rows, opt);
  b.synchronize(s);
  EXPECT_EQ(testing::read<std::int32_t>(b, rows.counts, e), want.counts);
  EXPECT_EQ(testing::read<std::int32_t>(b, rows.offsets, e + 1), want.offsets);
  EXPECT_EQ(testing::read<std::int32_t>(b, rows.rows, ids.size()), want.rows);
  for (DevicePtr p : {d_ids, rows.counts, rows.offsets, rows.rows}) b.free(p);
}

TEST_P(MoeOps, MoeAlignRandomRoutingsEmptyExpertsAndOneExpertTakingAll) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  for (const auto& [tokens, top_k, experts] :
       {std::tuple{1, 1, 1}, {5, 2, 8}, {300, 8, 128}, {64, 4, 32}, {1000, 8, 256}}) {
    for (double skew : {0.0, 1.5, 6.0}) {
      SCOPED_TRACE(fmt::format("T={} k={} E={} skew {}", tokens, top_k, experts, skew));
      const auto ids = random_ids(tokens, top_k, experts, skew);
      check_align(b, s, ids, {tokens, experts, top_k, 0}, opt());
      check_align(b, s, ids, {tokens, experts, top_k, tokens}, opt());
      check_align(b, s, ids, {tokens, experts, top_k, tokens + 5}, opt());
    }
  }
  // One expert takes every token; the others are empty.
  check_align(b, s, std::vector<std::int32_t>(77, 5), {77, 9, 1, 0}, opt());
  check_align(b, s, std::vector<std::int32_t>(77, 5), {77, 9, 1, 77}, opt());
}

TEST_P(MoeOps, MoeAlignIdsOutsideTheExpertsGetNoRow) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  auto ids = random_ids(50, 4, 16, 1.0);
  for (std::size_t i = 0; i < ids.size(); i += 3) ids[i] = i % 2 == 0 ? -1 : 16 + int(i);
  check_align(b, s, ids, {50, 16, 4, 0}, opt());
  check_align(b, s, ids, {50, 16, 4, 50}, opt());
  // A token naming one expert twice can overflow a masked expert: its rows past the capacity
  // are dropped, the count clamped.
  check_align(b, s, std::vector<std::int32_t>(12, 2), {6, 4, 2, 6}, opt());
}

// x_perm after a gather: entry i's row (rows[i] >= 0) holds want(i, token, column) in every
// column; rows of no entry are untouched (poison_buffer's 0xABAB).
template <class Want>
void expect_gathered(const std::vector<std::uint16_t>& got, const std::vector<std::int32_t>& rows,
                     int top_k, std::int64_t width, Want want) {
  std::vector<bool> used(got.size() / static_cast<std::size_t>(width), false);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || static_cast<std::size_t>(rows[i]) >= used.size()) continue;
    used[rows[i]] = true;
    const auto t = static_cast<std::int64_t>(i) / top_k;
    for (std::int64_t c = 0; c < width; ++c) {
      ASSERT_EQ(got[rows[i] * width + c], want(i, t, c)) << "entry " << i << " col " << c;
    }
  }
  for (std::size_t r = 0; r < used.size(); ++r) {
    if (used[r]) continue;
    for (std::int64_t c = 0; c < width; ++c) {
      ASSERT_EQ(got[r * width + c], 0xABAB) << "row " << r << " without an entry was written";
    }
  }
}

TEST_P(MoeOps, MoeGatherCombinePermuteThenCombineAgainstFloat64) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  // held > 0: a rank holding experts [0, held) of the layer's (expert parallelism): top_k may
  // exceed them, and the ids of experts held elsewhere are -1.
  for (const auto& [tokens, top_k, experts, width, masked, held] :
       {std::tuple{1, 1, 4, 8, false, 0},
        {7, 2, 8, 64, false, 0},
        {33, 8, 64, 264, true, 0},
        {130, 4, 16, 128, false, 0},
        {12, 8, 16, 16, false, 2},
        {12, 8, 16, 16, true, 2}}) {
    SCOPED_TRACE(fmt::format("T={} k={} E={} width {} masked {} held {}", tokens, top_k, experts,
                             width, masked, held));
    auto ids = random_ids(tokens, top_k, experts, 1.0);
    ids[0] = -1;  // one entry without a row
    if (held > 0) {
      for (auto& id : ids) id = id < held ? id : -1;
    }
    const ops::MoeShape shape{tokens, held > 0 ? held : experts, top_k, masked ? tokens : 0};
    Aligned al = align_reference(ids, shape.experts, shape.capacity);
    if (held > 0) check_align(b, s, ids, shape, opt());
    const auto rows_n = static_cast<std::size_t>(shape.row_capacity());
    // A caller's rows need not be moe_align's: one at the row capacity is no row (gathered
    // nowhere, added to nothing), and the row it had stays untouched.
    const auto with_row =
        std::find_if(al.rows.begin(), al.rows.end(), [](auto r) { return r >= 0; });
    if (with_row != al.rows.end() && tokens > 1) *with_row = static_cast<std::int32_t>(rows_n);
    const auto x = testing::random_bf16(static_cast<std::size_t>(tokens * width));
    const DevicePtr d_x = testing::upload(b, x), d_rows = testing::upload(b, al.rows);
    const DevicePtr x_perm = poison_buffer(b, rows_n * width * 2);
    ops::moe_gather(b, s, d_x, shape, width, d_rows, x_perm, opt());
    b.synchronize(s);
    const auto got = testing::read<std::uint16_t>(b, x_perm, rows_n * width);
    expect_gathered(got, al.rows, top_k, width,
                    [&](std::size_t, std::int64_t t, std::int64_t c) { return x[t * width + c]; });
    // Combine: y random over every row, weights random.
    const auto y = testing::random_bf16(rows_n * width);
    std::vector<float> w(ids.size());
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (auto& v : w) v = u(rng());
    const DevicePtr d_y = testing::upload(b, y), d_w = testing::upload(b, w);
    const DevicePtr out = poison_buffer(b, static_cast<std::size_t>(tokens * width * 2));
    ops::moe_combine(b, s, d_y, shape, width, d_rows, d_w, out, opt());
    b.synchronize(s);
    const auto got_out =
        testing::read<std::uint16_t>(b, out, static_cast<std::size_t>(tokens * width));
    for (std::int64_t t = 0; t < tokens; ++t) {
      for (std::int64_t c = 0; c < width; ++c) {
        double sum = 0.0, mag = 0.0;
        for (int j = 0; j < top_k; ++j) {
          const std::int32_t row = al.rows[t * top_k + j];
          if (row < 0 || static_cast<std::size_t>(row) >= rows_n) continue;
          const double term = double{w[t * top_k + j]} * num::bf16_to_f32(y[row * width + c]);
          sum += term;
          mag += std::abs(term);
        }
        // An FP32 sum of k terms (k·2^-24 of their magnitudes), then one BF16 rounding (half an
        // ulp: at most 2^-8 of the value).
        const double bound = std::ldexp(std::abs(sum), -8) + 2 * top_k * std::ldexp(mag, -24);
        const double g = num::bf16_to_f32(got_out[t * width + c]);
        ASSERT_LE(std::abs(g - sum), bound) << "token " << t << " col " << c;
      }
    }
    for (DevicePtr p : {d_x, d_rows, x_perm, d_y, d_w, out}) b.free(p);
  }
}

// moe_gather with a column order (act-ordered experts, Note [Experts' act order]): each entry's
// row holds x's row in its expert's order, a column index outside [0, width) reads 0, rows
// without an entry are untouched.
TEST_P(MoeOps, MoeGatherInEachExpertsColumnOrder) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  for (const auto& [tokens, top_k, experts, width, masked] :
       {std::tuple{1, 1, 4, 8, false}, {9, 2, 8, 64, true}, {40, 4, 16, 136, false}}) {
    SCOPED_TRACE(
        fmt::format("T={} k={} E={} width {} masked {}", tokens, top_k, experts, width, masked));
    auto ids = random_ids(tokens, top_k, experts, 1.0);
    ids[0] = -1;  // one entry without a row
    const ops::MoeShape shape{tokens, experts, top_k, masked ? tokens : 0};
    const Aligned al = align_reference(ids, experts, shape.capacity);
    std::vector<std::int32_t> columns(static_cast<std::size_t>(experts * width));
    for (int e = 0; e < experts; ++e) {
      auto* order = columns.data() + e * width;
      std::iota(order, order + width, 0);
      std::shuffle(order, order + width, rng());
    }
    columns[static_cast<std::size_t>(width) - 1] = width;  // outside: reads 0
    // A caller's ids need not be those the rows came from: an entry with a row whose id names no
    // expert has no column order, and its row reads zeros.
    const auto last = static_cast<std::size_t>(
        std::find_if(al.rows.rbegin(), al.rows.rend(), [](auto r) { return r >= 0; }).base() -
        al.rows.begin() - 1);
    if (tokens > 1) ids[last] = experts + 3;
    const auto rows_n = static_cast<std::size_t>(shape.row_capacity());
    const auto x = testing::random_bf16(static_cast<std::size_t>(tokens * width));
    const DevicePtr d_x = testing::upload(b, x), d_rows = testing::upload(b, al.rows);
    const DevicePtr d_ids = testing::upload(b, ids), d_cols = testing::upload(b, columns);
    const DevicePtr x_perm = poison_buffer(b, rows_n * width * 2);
    ops::moe_gather(b, s, d_x, shape, width, d_rows, x_perm, opt(),
                    ops::MoeColumnOrder{d_ids, d_cols});
    b.synchronize(s);
    const auto got = testing::read<std::uint16_t>(b, x_perm, rows_n * width);
    expect_gathered(got, al.rows, top_k, width, [&](std::size_t i, std::int64_t t, std::int64_t c) {
      if (ids[i] < 0 || ids[i] >= experts) return std::uint16_t{0};
      const std::int32_t from = columns[ids[i] * width + c];
      return from < width ? x[t * width + from] : std::uint16_t{0};
    });
    for (DevicePtr p : {d_x, d_rows, d_ids, d_cols, x_perm}) b.free(p);
  }
}

// The gated activation, float64 as transformers' experts write it: Qwen3's SiLU(gate) · up on
// [gate | up] rows, gpt-oss's clamped gate · σ(1.702 gate) · (up + 1) on interleaved ones.
double glu_reference(ops::MoeGlu glu, double g, double u) {
  if (glu == ops::MoeGlu::kSilu) return g / (1.0 + std::exp(-g)) * u;
  g = std::min(g, 7.0);
  u = std::clamp(u, -7.0, 7.0);
  return g / (1.0 + std::exp(-1.702 * g)) * (u + 1.0);
}

TEST_P(MoeOps, MoeGluAgainstFloat64) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  for (const auto& [tokens, top_k, experts, inter, masked] :
       {std::tuple{1, 1, 4, 8, false}, {9, 2, 8, 64, true}, {40, 4, 16, 200, false}}) {
    for (const ops::MoeGlu glu : {ops::MoeGlu::kSilu, ops::MoeGlu::kClampedSwiglu}) {
      SCOPED_TRACE(fmt::format("T={} k={} E={} inter {} masked {} glu {}", tokens, top_k, experts,
                               inter, masked, static_cast<int>(glu)));
      auto ids = random_ids(tokens, top_k, experts, 1.0);
      ids[0] = -1;  // one entry without a row: contiguous, the last row holds nothing
      const ops::MoeShape shape{tokens, experts, top_k, masked ? tokens : 0};
      const Aligned al = align_reference(ids, experts, shape.capacity);
      const auto rows_n = static_cast<std::size_t>(shape.row_capacity());
      const auto in = static_cast<std::size_t>(inter);
      // Values to ±10, past the clamps at ±7.
      std::vector<std::uint16_t> y(rows_n * 2 * in);
      std::uniform_real_distribution<float> u(-10.0f, 10.0f);
      for (auto& v : y) v = num::f32_to_bf16(u(rng()));
      const DevicePtr d_y = testing::upload(b, y);
      const ops::MoeRows rows{testing::upload(b, al.counts), testing::upload(b, al.offsets),
                              DevicePtr{}};
      const DevicePtr act = poison_buffer(b, rows_n * in * 2);
      ops::MoeActivation activation;
      activation.glu = glu;
      ops::moe_glu(b, s, d_y, shape, inter, activation, rows, act, opt());
      b.synchronize(s);
      const auto got = testing::read<std::uint16_t>(b, act, rows_n * in);
      std::vector<bool> used(rows_n, false);
      for (const std::int32_t r : al.rows) {
        if (r >= 0) used[static_cast<std::size_t>(r)] = true;
      }
      for (std::size_t r = 0; r < rows_n; ++r) {
        for (std::size_t i = 0; i < in; ++i) {
          const std::uint16_t bits = got[r * in + i];
          if (!used[r]) {
            ASSERT_EQ(bits, 0xABAB) << "row " << r << " without an entry was written";
            continue;
          }
          const bool chunked = glu == ops::MoeGlu::kSilu;
          const double g = num::bf16_to_f32(y[r * 2 * in + (chunked ? i : 2 * i)]);
          const double v = num::bf16_to_f32(y[r * 2 * in + (chunked ? in + i : 2 * i + 1)]);
          const double want = glu_reference(glu, g, v);
          // FP32 arithmetic (expf, a sum, a division, a product: a few 2^-24 of the value), then
          // one BF16 rounding (2^-8 of it).
          const double bound = std::abs(want) * (std::ldexp(1.0, -8) + std::ldexp(16.0, -24));
          ASSERT_LE(std::abs(num::bf16_to_f32(bits) - want), bound + 1e-37)
              << "row " << r << " col " << i << " g " << g << " u " << v;
        }
      }
      for (DevicePtr p : {d_y, rows.counts, rows.offsets, act}) b.free(p);
    }
  }
}

TEST_P(MoeOps, BadArgumentsAreRefusedBeforeAnyLaunch) {
  Backend& b = this->b();
  const StreamHandle s = stream();
  const DevicePtr buf = b.alloc(1 << 16), other = b.alloc(1 << 16);
  // Every buffer below lies in these two: poisoned now, they must be so after every refusal.
  b.memset(buf, 0xCD, 1 << 16);
  b.memset(other, 0xCD, 1 << 16);
  ops::MoeRouting r;
  r.top_k = 2;
  const ops::MoeShape ok{4, 8, 2, 0};
  EXPECT_ERROR(ops::moe_route(b, s, buf, {0, 8, 2, 0}, r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "tokens = 0");
  EXPECT_ERROR(ops::moe_route(b, s, buf, {4, 2000, 2, 0}, r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "experts = 2000");
  ops::MoeRouting bad_r = r;
  bad_r.top_k = 9;
  EXPECT_ERROR(ops::moe_route(b, s, buf, {4, 8, 9, 0}, bad_r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "top_k = 9 exceeds experts = 8");
  EXPECT_ERROR(ops::moe_align(b, s, buf, {4, 8, 33, 0}, {other, other, other}),
               ErrorCode::kInvalidArgument, "top_k = 33 is outside [1, 32]");
  bad_r = r;
  bad_r.scoring = static_cast<MoeScoring>(7);
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, bad_r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "scoring = 7 is not a MoeScoring");
  for (const float scale :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    bad_r = r;
    bad_r.scale = scale;
    EXPECT_ERROR(ops::moe_route(b, s, buf, ok, bad_r, other, other.offset(64)),
                 ErrorCode::kInvalidArgument, "is not finite");
  }
  // A capacity whose rows (experts x capacity) would overflow before they are counted.
  EXPECT_ERROR(ops::moe_align(b, s, buf, {1, 3, 2, 0x5555555555555556}, {other, other, other}),
               ErrorCode::kInvalidArgument, "do not fit int32 row indices");
  EXPECT_ERROR(ops::moe_align(b, s, buf, {1 << 26, 32, 32, 1 << 26}, {other, other, other}),
               ErrorCode::kInvalidArgument, "do not fit int32 row indices");
  EXPECT_ERROR(ops::moe_route(b, s, buf, {4, 8, 2, 3}, r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "capacity = 3");
  ops::MoeRouting g = r;
  g.groups = 4;
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, g, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "kSigmoid");
  g.scoring = MoeScoring::kSigmoid;
  g.groups = 3;
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, g, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "groups = 3");
  g.groups = 4;
  g.topk_groups = 5;
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, g, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "topk_groups = 5");
  g.topk_groups = 1;
  g.top_k = 3;
  EXPECT_ERROR(ops::moe_route(b, s, buf, {4, 8, 3, 0}, g, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "exceeds the 2 experts");
  ops::MoeRouting t = r;
  t.scoring = MoeScoring::kTopkSoftmax;
  t.renormalize = true;
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, t, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "renormalize");
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, r, other, other.offset(4)),
               ErrorCode::kInvalidArgument, "overlaps");
  EXPECT_ERROR(ops::moe_route(b, s, buf.offset(2), ok, r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "logits");
  EXPECT_ERROR(ops::moe_route(b, s, buf, ok, r, DevicePtr{}, other.offset(64)),
               ErrorCode::kInvalidArgument, "ids is null");
  EXPECT_ERROR(ops::moe_route(b, s, buf.offset((1 << 16) - 8), ok, r, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "logits");
  EXPECT_ERROR(ops::moe_gather(b, s, buf, ok, 12, other, other.offset(64)),
               ErrorCode::kInvalidArgument, "width = 12");
  EXPECT_ERROR(ops::moe_gather(b, s, buf, ok, 16, other, other.offset(16)),
               ErrorCode::kInvalidArgument, "overlaps");
  EXPECT_ERROR(ops::moe_gather(b, s, buf, ok, 16, other, other.offset(64), {},
                               ops::MoeColumnOrder{buf.offset(8192), DevicePtr{}}),
               ErrorCode::kInvalidArgument, "ids and columns go together");
  EXPECT_ERROR(ops::moe_gather(b, s, buf, ok, 16, other, other.offset(64), {},
                               ops::MoeColumnOrder{buf.offset(8192), other.offset(128)}),
               ErrorCode::kInvalidArgument, "overlaps");
  EXPECT_ERROR(ops::moe_gather(b, s, buf, ok, 16, other, other.offset(64), {},
                               ops::MoeColumnOrder{buf.offset(8192), buf.offset((1 << 16) - 64)}),
               ErrorCode::kInvalidArgument, "order.columns");
  EXPECT_ERROR(ops::moe_combine(b, s, buf, ok, 16, other, other.offset(64), buf.offset(64)),
               ErrorCode::kInvalidArgument, "overlaps");
  EXPECT_ERROR(ops::moe_align(b, s, buf, ok, {other, other, other.offset(256)}),
               ErrorCode::kInvalidArgument, "overlaps");
  const ops::MoeRows rows{other, other.offset(64), other.offset(128)};
  EXPECT_ERROR(ops::moe_glu(b, s, buf, ok, 12, {}, rows, buf.offset(4096)),
               ErrorCode::kInvalidArgument, "inter = 12");
  ops::MoeActivation clamp;
  clamp.glu = ops::MoeGlu::kClampedSwiglu;
  clamp.limit = 0.0f;
  EXPECT_ERROR(ops::moe_glu(b, s, buf, ok, 16, clamp, rows, buf.offset(4096)),
               ErrorCode::kInvalidArgument, "limit = 0");
  EXPECT_ERROR(ops::moe_glu(b, s, buf, ok, 16, {}, rows, buf.offset(256)),
               ErrorCode::kInvalidArgument, "overlaps");
  EXPECT_ERROR(ops::moe_glu(b, s, buf, ok, 16, {}, {DevicePtr{}, other, other}, buf.offset(4096)),
               ErrorCode::kInvalidArgument, "counts is null");
  b.synchronize(s);
  for (const DevicePtr p : {buf, other}) {
    const auto bytes = testing::read<std::uint8_t>(b, p, 1 << 16);
    EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](std::uint8_t v) { return v == 0xCD; }))
        << "a refused call wrote";
  }
  b.free(buf);
  b.free(other);
}

}  // namespace
}  // namespace metrale
