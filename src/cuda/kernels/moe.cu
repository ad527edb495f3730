// Module "moe" on the GPU: a mixture-of-experts layer's routing and its permutation of tokens into
// expert order and back (the rules in src/kernels/moe_route.h and moe_permute.h; the host twins
// in src/cpu/modules/moe_module.cpp). Not yet run on a GPU: no entry publishes _verified_on, so
// the ops run these kernels only when the caller opts in (ops/moe.h, MoeOptions).
//
// moe_route: a warp per token. The top k are found in k rounds, each the warp's best among the
// candidates that rank after the previous round's winner (the order of moe::ranks_before is
// total, so no chosen set is kept): no per-thread arrays, so no local memory.
// moe_count: one block; a shared histogram, then the offsets by a block scan.
// moe_scatter: a block per expert, walking the entries in order, 256 at a time: a ballot gives
// each match its rank, so the rows follow the entries' order as on the CPU.
// moe_gather: a warp per entry, 16-byte copies (2-byte elements with a column order). moe_combine:
// a block per token. moe_glu: a block per row.
#include <cstdint>

#include "kernels/moe_glu.h"
#include "kernels/moe_permute.h"
#include "kernels/moe_route.h"
#include "metrale/numerics.h"

namespace {

namespace moe = metrale::moe;
using metrale::MoeAlignParams;
using metrale::MoeGluParams;
using metrale::MoePermuteParams;
using metrale::MoeRouteParams;

constexpr unsigned kThreads = 256;
constexpr unsigned kWarps = kThreads / 32;
constexpr unsigned kFull = 0xFFFFFFFFu;
constexpr std::int32_t kNone = 0x7FFFFFFF;  // no candidate: ranks after every expert

// The warp's best (v, i) by moe::ranks_before, in every lane.
__device__ void warp_best(float& v, std::int32_t& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float w = __shfl_xor_sync(kFull, v, off);
    const std::int32_t j = __shfl_xor_sync(kFull, i, off);
    if (moe::ranks_before(w, j, v, i)) {
      v = w;
      i = j;
    }
  }
}

__device__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFull, x, off);
  return x;
}

// The best candidate of experts [e0, e1) (allowed by the group mask) that ranks after (pv, pi);
// `first`: no previous winner.
__device__ void best_after(const MoeRouteParams& p, const float* logits, const float* bias,
                           std::int32_t e0, std::int32_t e1, std::uint64_t groups_allowed,
                           std::int32_t per_group, bool first, float pv, std::int32_t pi, float& bv,
                           std::int32_t& bi) {
  const unsigned lane = threadIdx.x % 32;
  bv = __int_as_float(0x7FC00000);  // NaN with kNone: ranks last
  bi = kNone;
  for (std::int32_t e = e0 + static_cast<std::int32_t>(lane); e < e1; e += 32) {
    if (((groups_allowed >> (e / per_group)) & 1u) == 0) continue;
    const float v = moe::choice_value(p, logits, bias, e);
    if ((first || moe::ranks_before(pv, pi, v, e)) && moe::ranks_before(v, e, bv, bi)) {
      bv = v;
      bi = e;
    }
  }
  warp_best(bv, bi);
}

}  // namespace

extern "C" {

__global__ void moe_route(MoeRouteParams p);
__global__ void moe_count(MoeAlignParams p);
__global__ void moe_scatter(MoeAlignParams p);
__global__ void moe_gather(MoePermuteParams p);
__global__ void moe_combine(MoePermuteParams p);

// Published metadata: what one block covers (tokens, -, experts, entries, tokens) and its size.
__device__ std::uint32_t moe_route_n_tile = kWarps;
__device__ std::uint32_t moe_count_n_tile = moe::kMaxExperts;
__device__ std::uint32_t moe_scatter_n_tile = 1;
__device__ std::uint32_t moe_gather_n_tile = kWarps;
__device__ std::uint32_t moe_combine_n_tile = 1;
__device__ std::uint32_t moe_glu_n_tile = 1;
__device__ std::uint32_t moe_route_block_threads = kThreads;
__device__ std::uint32_t moe_count_block_threads = kThreads;
__device__ std::uint32_t moe_scatter_block_threads = kThreads;
__device__ std::uint32_t moe_gather_block_threads = kThreads;
__device__ std::uint32_t moe_combine_block_threads = kThreads;
__device__ std::uint32_t moe_glu_block_threads = kThreads;

__global__ void __launch_bounds__(kThreads, 1) moe_route(MoeRouteParams p) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (t >= p.tokens) return;  // whole warps leave together: the shuffles stay full
  const std::int32_t lane = static_cast<std::int32_t>(threadIdx.x % 32);
  const float* logits = reinterpret_cast<const float*>(p.logits) + t * p.experts;
  const float* bias = reinterpret_cast<const float*>(p.bias);
  const std::int32_t per_group = p.experts / p.groups;
  // The groups allowed: a bit each (groups <= 64).
  std::uint64_t allowed = ~std::uint64_t{0};
  if (p.groups > 1) {
    float gv0 = 0.0f, gv1 = 0.0f;  // lane's groups: lane and lane + 32
    for (std::int32_t g = 0; g < p.groups; ++g) {
      float v1, v2;
      std::int32_t i1, i2;
      const std::int32_t e0 = g * per_group, e1 = e0 + per_group;
      best_after(p, logits, bias, e0, e1, allowed, per_group, true, 0.0f, 0, v1, i1);
      best_after(p, logits, bias, e0, e1, allowed, per_group, false, v1, i1, v2, i2);
      const float s = i2 == kNone ? v1 : v1 + v2;
      if (lane == g % 32 && g < 32) gv0 = s;
      if (lane == g % 32 && g >= 32) gv1 = s;
    }
    std::uint64_t chosen = 0;
    float pv = 0.0f;
    std::int32_t pi = 0;
    for (std::int32_t r = 0; r < p.topk_groups; ++r) {
      float bv = __int_as_float(0x7FC00000);
      std::int32_t bi = kNone;
      for (std::int32_t g = lane, h = 0; h < 2 && g < p.groups; ++h, g += 32) {
        const float v = h == 0 ? gv0 : gv1;
        if ((r == 0 || moe::ranks_before(pv, pi, v, g)) && moe::ranks_before(v, g, bv, bi)) {
          bv = v;
          bi = g;
        }
      }
      warp_best(bv, bi);
      chosen |= std::uint64_t{1} << bi;
      pv = bv;
      pi = bi;
    }
    allowed = chosen;
  }
  // The top k: lane j keeps the j-th winner.
  std::int32_t my_id = kNone;
  float pv = 0.0f;
  std::int32_t pi = 0;
  for (std::int32_t r = 0; r < p.top_k; ++r) {
    float bv;
    std::int32_t bi;
    best_after(p, logits, bias, 0, p.experts, allowed, per_group, r == 0, pv, pi, bv, bi);
    if (lane == r) my_id = bi;
    pv = bv;
    pi = bi;
  }
  auto* ids = reinterpret_cast<std::int32_t*>(p.ids) + t * p.top_k;
  auto* weights = reinterpret_cast<float*>(p.weights) + t * p.top_k;
  const bool mine = lane < p.top_k;
  if (p.scoring == metrale::kMoeSigmoid) {
    const float w = mine ? moe::sigmoid(logits[my_id]) : 0.0f;
    const float sum = warp_sum(w);
    const float denom = p.renormalize != 0 ? sum + 1e-20f : 1.0f;
    if (mine) {
      ids[lane] = my_id;
      weights[lane] = w / denom * p.scale;
    }
    return;
  }
  const float max = __shfl_sync(kFull, mine ? logits[my_id] : 0.0f, 0);
  const float e = mine ? expf(logits[my_id] - max) : 0.0f;
  float sum;
  if (p.scoring == metrale::kMoeTopkSoftmax || p.renormalize != 0) {
    sum = warp_sum(e);
  } else {
    float part = 0.0f;
    for (std::int32_t x = lane; x < p.experts; x += 32) part += expf(logits[x] - max);
    sum = warp_sum(part);
  }
  if (mine) {
    ids[lane] = my_id;
    weights[lane] = e / sum * p.scale;
  }
}

__global__ void __launch_bounds__(kThreads) moe_count(MoeAlignParams p) {
  __shared__ std::int32_t count[moe::kMaxExperts];
  __shared__ std::int32_t warp_total[kWarps];
  const auto* ids = reinterpret_cast<const std::int32_t*>(p.ids);
  auto* rows = reinterpret_cast<std::int32_t*>(p.rows);
  for (std::int32_t e = threadIdx.x; e < p.experts; e += kThreads) count[e] = 0;
  __syncthreads();
  for (std::int64_t i = threadIdx.x; i < p.entries; i += kThreads) {
    const std::int32_t id = ids[i];
    if (moe::valid_id(id, p.experts)) {
      atomicAdd(&count[id], 1);
    } else {
      rows[i] = -1;
    }
  }
  __syncthreads();
  // Clamped counts out; then the offsets: thread t sums experts [4t, 4t + 4), the warp scans
  // those sums, and the warps' totals are added in warp order.
  constexpr std::int32_t kPer = moe::kMaxExperts / kThreads;
  const std::int32_t e0 = static_cast<std::int32_t>(threadIdx.x) * kPer;
  std::int32_t mine = 0;
  for (std::int32_t e = e0; e < e0 + kPer && e < p.experts; ++e) {
    const std::int32_t c =
        p.capacity > 0 && count[e] > p.capacity ? static_cast<std::int32_t>(p.capacity) : count[e];
    reinterpret_cast<std::int32_t*>(p.counts)[e] = c;
    count[e] = c;
    mine += c;
  }
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  std::int32_t incl = mine;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const std::int32_t up = __shfl_up_sync(kFull, incl, off);
    if (static_cast<int>(lane) >= off) incl += up;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  std::int32_t at = incl - mine;
  for (unsigned w = 0; w < warp; ++w) at += warp_total[w];
  auto* offsets = reinterpret_cast<std::int32_t*>(p.offsets);
  for (std::int32_t e = e0; e < e0 + kPer && e < p.experts; ++e) {
    offsets[e] = static_cast<std::int32_t>(p.capacity > 0 ? e * p.capacity : at);
    at += count[e];
  }
  if (threadIdx.x == kThreads - 1) {
    offsets[p.experts] = static_cast<std::int32_t>(p.capacity > 0 ? p.experts * p.capacity : at);
  }
}

__global__ void __launch_bounds__(kThreads) moe_scatter(MoeAlignParams p) {
  __shared__ std::int32_t warp_count[kWarps];
  const std::int32_t e = static_cast<std::int32_t>(blockIdx.x);
  if (e >= p.experts) return;
  const auto* ids = reinterpret_cast<const std::int32_t*>(p.ids);
  auto* rows = reinterpret_cast<std::int32_t*>(p.rows);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  std::int64_t rank = 0;  // matches in earlier chunks
  for (std::int64_t c0 = 0; c0 < p.entries; c0 += kThreads) {
    const std::int64_t i = c0 + threadIdx.x;
    const bool match = i < p.entries && ids[i] == e;
    const unsigned ballot = __ballot_sync(kFull, match);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    std::int64_t at = rank + __popc(ballot & ((1u << lane) - 1u));
    std::int32_t chunk = 0;
    for (unsigned w = 0; w < kWarps; ++w) {
      if (w < warp) at += warp_count[w];
      chunk += warp_count[w];
    }
    if (match) rows[i] = moe::row_of(p, e, at);
    rank += chunk;
    __syncthreads();  // warp_count is rewritten by the next chunk
  }
}

__global__ void __launch_bounds__(kThreads) moe_gather(MoePermuteParams p) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (i >= p.tokens * p.top_k) return;
  const std::int32_t row = reinterpret_cast<const std::int32_t*>(p.rows)[i];
  if (!moe::has_row(p, row)) return;
  if (p.columns != 0) {  // act-ordered experts: each element from its expert's column
    auto* dst = reinterpret_cast<std::uint16_t*>(p.out) + row * p.width;
    for (std::int64_t c = threadIdx.x % 32; c < p.width; c += 32)
      dst[c] = moe::gather_element(p, i, c);
    return;
  }
  const auto* src = reinterpret_cast<const uint4*>(p.in) + (i / p.top_k) * (p.width / 8);
  auto* dst = reinterpret_cast<uint4*>(p.out) + row * (p.width / 8);
  for (std::int64_t v = threadIdx.x % 32; v < p.width / 8; v += 32) dst[v] = src[v];
}

__global__ void __launch_bounds__(kThreads) moe_combine(MoePermuteParams p) {
  const std::int64_t t = blockIdx.x;
  if (t >= p.tokens) return;
  auto* out = reinterpret_cast<std::uint16_t*>(p.out) + t * p.width;
  for (std::int64_t c = threadIdx.x; c < p.width; c += kThreads) {
    out[c] = moe::combine_element(p, t, c);
  }
}

__global__ void __launch_bounds__(kThreads) moe_glu(MoeGluParams p) {
  const std::int64_t r = blockIdx.x;
  if (r >= p.row_capacity || !moe::glu_row_used(p, r)) return;
  auto* act = reinterpret_cast<std::uint16_t*>(p.act) + r * p.inter;
  for (std::int64_t i = threadIdx.x; i < p.inter; i += kThreads) act[i] = moe::glu_element(p, r, i);
}

}  // extern "C"
