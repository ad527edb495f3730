// The router of a mixture-of-experts layer (module "moe", entry moe_route), shared by the CPU and
// GPU kernels: one token's FP32 logits over E experts → its top-k experts and their weights, as
// each model family defines them (Note [MoE routing] in docs/NOTES.md). Plain data and
// __host__ __device__ rules only.
#pragma once

#include <cmath>
#include <cstdint>

#include "metrale/numerics.h"  // METRALE_HD

namespace metrale {

// How a token's scores come from its logits, and its weights from the scores of its choice.
enum MoeScoring : std::uint32_t {
  // Qwen3-MoE, Mixtral: softmax over all E logits, the top k probabilities (renormalized to sum
  // to 1 when asked).
  kMoeSoftmax = 0,
  // gpt-oss: the top k logits, then a softmax over those k alone.
  kMoeTopkSoftmax = 1,
  // DeepSeek-V3: sigmoid scores; the choice by score + bias (e_score_correction_bias), within the
  // topk_groups groups whose two best choice values sum highest; the weights the chosen experts'
  // scores without the bias (divided by their sum + 1e-20 when renormalized).
  kMoeSigmoid = 2,
};

// Arguments of moe_route, by value.
struct MoeRouteParams {
  std::uint64_t logits = 0;   // FP32 [tokens, experts]
  std::uint64_t bias = 0;     // FP32 [experts], kMoeSigmoid only; 0: none
  std::uint64_t ids = 0;      // int32 [tokens, top_k], out
  std::uint64_t weights = 0;  // FP32 [tokens, top_k], out
  std::int64_t tokens = 0;
  std::int32_t experts = 0, top_k = 0;
  std::int32_t groups = 1, topk_groups = 1;  // kMoeSigmoid: n_group, topk_group
  std::uint32_t scoring = kMoeSoftmax;
  std::uint32_t renormalize = 0;  // kMoeSoftmax, kMoeSigmoid
  float scale = 1.0f;             // every weight times this (DeepSeek's routed_scaling_factor)
};

namespace moe {

inline constexpr std::int32_t kMaxExperts = 1024;
inline constexpr std::int32_t kMaxTopK = 32;
inline constexpr std::int32_t kMaxGroups = 64;

// Whether candidate (value v, index i) ranks before (w, j): the larger value, and on a tie the
// lower index. NaN ranks after every number (among NaNs, the lower index first), so the order is
// total and every backend, whichever way it searches, chooses the same experts from the same
// values (the sigmoid's values come from each backend's expf: Note [MoE routing]).
METRALE_HD bool ranks_before(float v, std::int32_t i, float w, std::int32_t j) {
  const bool v_nan = v != v, w_nan = w != w;
  if (v_nan || w_nan) return v_nan && w_nan ? i < j : w_nan;
  return v > w || (v == w && i < j);
}

// Inserts (v, i) into the best-first list (vals, idx) of size n < cap or, when full, in place of
// its last entry if it ranks before it; returns the new size.
METRALE_HD std::int32_t insert_ranked(float* vals, std::int32_t* idx, std::int32_t n,
                                      std::int32_t cap, float v, std::int32_t i) {
  std::int32_t at = n < cap ? n : cap - 1;
  if (n == cap && !ranks_before(v, i, vals[at], idx[at])) return n;
  while (at > 0 && ranks_before(v, i, vals[at - 1], idx[at - 1])) {
    vals[at] = vals[at - 1];
    idx[at] = idx[at - 1];
    --at;
  }
  vals[at] = v;
  idx[at] = i;
  return n < cap ? n + 1 : n;
}

METRALE_HD float sigmoid(float x) {
  return 1.0f / (1.0f + expf(-x));
}

// The value experts are chosen by: the logit (a softmax is monotone in it, so choosing by the
// logit chooses what choosing by the probability would, without its rounding) or score + bias.
METRALE_HD float choice_value(const MoeRouteParams& p, const float* logits, const float* bias,
                              std::int32_t e) {
  if (p.scoring != kMoeSigmoid) return logits[e];
  return sigmoid(logits[e]) + (bias != nullptr ? bias[e] : 0.0f);
}

// Token t's top_k experts (best first) and weights, written to ids and weights.
METRALE_HD void route_token(const MoeRouteParams& p, std::int64_t t) {
  const float* logits = reinterpret_cast<const float*>(p.logits) + t * p.experts;
  const float* bias = reinterpret_cast<const float*>(p.bias);
  auto* ids = reinterpret_cast<std::int32_t*>(p.ids) + t * p.top_k;
  auto* weights = reinterpret_cast<float*>(p.weights) + t * p.top_k;
  // The groups allowed: all, or (kMoeSigmoid) the topk_groups best by their two best values.
  bool allowed[kMaxGroups];
  const std::int32_t per_group = p.experts / p.groups;
  for (std::int32_t g = 0; g < p.groups; ++g) allowed[g] = p.groups == 1;
  if (p.groups > 1) {
    float gv[kMaxGroups];
    std::int32_t gi[kMaxGroups], ng = 0;
    for (std::int32_t g = 0; g < p.groups; ++g) {
      float two[2];
      std::int32_t ti[2], n2 = 0;
      for (std::int32_t e = g * per_group; e < (g + 1) * per_group; ++e) {
        n2 = insert_ranked(two, ti, n2, 2, choice_value(p, logits, bias, e), e);
      }
      ng = insert_ranked(gv, gi, ng, p.topk_groups, n2 == 2 ? two[0] + two[1] : two[0], g);
    }
    for (std::int32_t g = 0; g < ng; ++g) allowed[gi[g]] = true;
  }
  float best[kMaxTopK];
  std::int32_t n = 0;
  for (std::int32_t e = 0; e < p.experts; ++e) {
    if (allowed[e / per_group]) {
      n = insert_ranked(best, ids, n, p.top_k, choice_value(p, logits, bias, e), e);
    }
  }
  // The weights. Softmax: exp(l - max) over the sum of all E (or of the chosen k: renormalized,
  // or gpt-oss's softmax of the top k) in expert order; the max is the best logit either way.
  if (p.scoring == kMoeSigmoid) {
    float sum = 0.0f;
    for (std::int32_t j = 0; j < p.top_k; ++j) {
      weights[j] = sigmoid(logits[ids[j]]);
      sum += weights[j];
    }
    const float denom = p.renormalize != 0 ? sum + 1e-20f : 1.0f;
    for (std::int32_t j = 0; j < p.top_k; ++j) weights[j] = weights[j] / denom * p.scale;
    return;
  }
  const float max = logits[ids[0]];
  float sum = 0.0f;
  if (p.scoring == kMoeTopkSoftmax || p.renormalize != 0) {
    for (std::int32_t j = 0; j < p.top_k; ++j) sum += expf(logits[ids[j]] - max);
  } else {
    for (std::int32_t e = 0; e < p.experts; ++e) sum += expf(logits[e] - max);
  }
  for (std::int32_t j = 0; j < p.top_k; ++j) {
    weights[j] = expf(logits[ids[j]] - max) / sum * p.scale;
  }
}

}  // namespace moe
}  // namespace metrale
