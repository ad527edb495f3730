#include "toolkit/moe_routing.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace metrale::toolkit {
namespace {

// The offsets and the touched count from the counts.
MoeRoutingCounts finish(std::vector<std::int32_t> counts) {
  MoeRoutingCounts r;
  r.counts = std::move(counts);
  std::int32_t at = 0;
  for (const std::int32_t c : r.counts) {
    r.offsets.push_back(at);
    at += c;
    r.touched += c > 0 ? 1 : 0;
  }
  r.offsets.push_back(at);
  return r;
}

}  // namespace

std::vector<double> skewed_expert_weights(int experts, double skew) {
  std::vector<double> weight(static_cast<std::size_t>(experts));
  for (int e = 0; e < experts; ++e) weight[static_cast<std::size_t>(e)] = std::pow(e + 1.0, -skew);
  return weight;
}

std::vector<std::int32_t> draw_expert_ids(std::mt19937_64& rng, std::int64_t tokens, int top_k,
                                          std::span<const double> weight) {
  std::vector<std::int32_t> ids;
  ids.reserve(static_cast<std::size_t>(tokens * top_k));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::vector<double> w(weight.begin(), weight.end());
    for (int j = 0; j < top_k; ++j) {
      std::discrete_distribution<int> pick(w.begin(), w.end());
      const int e = pick(rng);
      ids.push_back(e);
      w[static_cast<std::size_t>(e)] = 0.0;
    }
  }
  return ids;
}

std::vector<MoeRoutingCounts> moe_routings(std::mt19937_64& rng, std::int64_t tokens, int experts,
                                           int top_k, double skew, int routings) {
  const auto e_count = static_cast<std::size_t>(experts);
  std::vector<MoeRoutingCounts> out;
  if (tokens == 1) {
    std::vector<int> order(e_count);
    for (int e = 0; e < experts; ++e) order[static_cast<std::size_t>(e)] = e;
    std::shuffle(order.begin(), order.end(), rng);
    for (int first = 0; first + top_k <= experts; first += top_k) {
      std::vector<std::int32_t> counts(e_count, 0);
      for (int j = first; j < first + top_k; ++j) counts[static_cast<std::size_t>(order[j])] = 1;
      out.push_back(finish(std::move(counts)));
    }
    return out;
  }
  std::vector<double> weight = skewed_expert_weights(experts, skew);
  std::shuffle(weight.begin(), weight.end(), rng);  // the popular experts anywhere
  for (int i = 0; i < routings; ++i) {
    std::vector<std::int32_t> counts(e_count, 0);
    for (const std::int32_t e : draw_expert_ids(rng, tokens, top_k, weight)) {
      ++counts[static_cast<std::size_t>(e)];
    }
    out.push_back(finish(std::move(counts)));
  }
  return out;
}

}  // namespace metrale::toolkit
