// Realistic MoE routings for the benchmarks (bench/moe_bench.cpp, `metrale bench --moe`): per
// routing, the rows each expert holds in the contiguous layout.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace metrale::toolkit {

// One routing: expert e's rows are [offsets[e], offsets[e] + counts[e]).
struct MoeRoutingCounts {
  std::vector<std::int32_t> counts, offsets;  // [experts], [experts + 1]
  int touched = 0;                            // experts with rows
};

// The weights (e + 1)^-skew of experts e = 0 .. experts - 1 (skew 0: all 1).
std::vector<double> skewed_expert_weights(int experts, double skew);

// Each of `tokens` tokens' top_k distinct experts, token after token, each drawn by `weight`
// among the experts the token has not taken yet: the ids [tokens · top_k].
std::vector<std::int32_t> draw_expert_ids(std::mt19937_64& rng, std::int64_t tokens, int top_k,
                                          std::span<const double> weight);

// Routings of `tokens` tokens, each to top_k distinct experts. One token: E / top_k disjoint
// routings (the experts in a random order, top_k at a time), so a cycle over them reads every
// expert once. More: `routings` drawn with expert e weighted (e + 1)^-skew, the weights shuffled
// over the experts (skew 0 uniform; 1.2 a popular few).
std::vector<MoeRoutingCounts> moe_routings(std::mt19937_64& rng, std::int64_t tokens, int experts,
                                           int top_k, double skew, int routings);

}  // namespace metrale::toolkit
