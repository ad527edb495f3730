// Float64 references of the MoE glue (ops/moe.h), written from the model code's definitions
// (transformers' Qwen3MoeTopKRouter, GptOssTopKRouter, DeepseekV3TopkRouter), not from the
// kernels: the tests of the CPU ops and of the GPU source run on the host both hold to them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "metrale/ops/moe.h"

namespace metrale::testing::moe_ref {

struct Routing {
  ops::MoeScoring scoring = ops::MoeScoring::kSoftmax;
  int top_k = 1;
  bool renormalize = false;
  double scale = 1.0;
  int groups = 1, topk_groups = 1;
  std::vector<float> bias;  // empty: none
};

// One token's choice: every expert's value (the logit for a softmax, sigmoid + bias for
// kSigmoid), whether its group is allowed, and the experts ordered best first among the allowed.
struct Choice {
  std::vector<double> value;
  std::vector<bool> allowed;
  std::vector<int> order;
  // Grouped routing: each group's score (the sum of its two best values) and the score of the
  // last group chosen; a group within FP32's rounding of that cut may stand in for a chosen one.
  std::vector<double> group_score;
  double group_cut = 0.0;
};

inline double sigmoid(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

inline Choice choose(const float* logits, int experts, const Routing& r) {
  Choice c;
  c.value.resize(static_cast<std::size_t>(experts));
  for (int e = 0; e < experts; ++e) {
    const double l = logits[e];
    c.value[e] = r.scoring == ops::MoeScoring::kSigmoid
                     ? sigmoid(l) + (r.bias.empty() ? 0.0 : double{r.bias[e]})
                     : l;
  }
  const auto better = [&](int a, int b) {
    return c.value[a] > c.value[b] || (c.value[a] == c.value[b] && a < b);
  };
  const int per_group = experts / r.groups;
  c.allowed.assign(static_cast<std::size_t>(experts), r.groups == 1);
  if (r.groups > 1) {
    std::vector<double> gscore(static_cast<std::size_t>(r.groups));
    for (int g = 0; g < r.groups; ++g) {
      std::vector<int> in(static_cast<std::size_t>(per_group));
      std::iota(in.begin(), in.end(), g * per_group);
      std::sort(in.begin(), in.end(), better);
      gscore[g] = c.value[in[0]] + (per_group > 1 ? c.value[in[1]] : 0.0);
    }
    std::vector<int> gs(static_cast<std::size_t>(r.groups));
    std::iota(gs.begin(), gs.end(), 0);
    std::sort(gs.begin(), gs.end(), [&](int a, int b) {
      return gscore[a] > gscore[b] || (gscore[a] == gscore[b] && a < b);
    });
    for (int j = 0; j < r.topk_groups; ++j) {
      for (int e = gs[j] * per_group; e < (gs[j] + 1) * per_group; ++e) c.allowed[e] = true;
    }
    c.group_score = gscore;
    c.group_cut = gscore[gs[r.topk_groups - 1]];
  }
  for (int e = 0; e < experts; ++e) {
    if (c.allowed[e]) c.order.push_back(e);
  }
  std::sort(c.order.begin(), c.order.end(), better);
  return c;
}

// The weights of experts `ids` (one token's choice, in its order) in float64.
inline std::vector<double> weights(const float* logits, int experts, const Routing& r,
                                   const std::vector<int>& ids) {
  std::vector<double> w(ids.size());
  if (r.scoring == ops::MoeScoring::kSigmoid) {
    double sum = 0.0;
    for (std::size_t j = 0; j < ids.size(); ++j) sum += w[j] = sigmoid(logits[ids[j]]);
    for (auto& x : w) x = x / (r.renormalize ? sum + 1e-20 : 1.0) * r.scale;
    return w;
  }
  double max = -INFINITY;
  for (int e = 0; e < experts; ++e) max = std::max(max, double{logits[e]});
  double all = 0.0, chosen = 0.0;
  for (int e = 0; e < experts; ++e) all += std::exp(logits[e] - max);
  for (int id : ids) chosen += std::exp(logits[id] - max);
  const bool over_chosen = r.scoring == ops::MoeScoring::kTopkSoftmax || r.renormalize;
  for (std::size_t j = 0; j < ids.size(); ++j) {
    w[j] = std::exp(logits[ids[j]] - max) / (over_chosen ? chosen : all) * r.scale;
  }
  return w;
}

}  // namespace metrale::testing::moe_ref
