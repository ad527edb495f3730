// Every expert's first slot of 128 rows in shared memory, for the grouped kernels that walk a
// layer's tiles themselves (gemm_grouped_fused, gemm_grouped_e4m3_block128_tiled): entry e is
// expert e's first slot and entry `experts` the slots' count (fused_tile.h's slot rules).
#pragma once

#include <cstdint>

#include "kernels/fused_tile.h"
#include "ptx.cuh"

namespace metrale::kernels {

// Fills `first` (kEntries 4-byte entries; the scan's second buffer follows it) from the device's
// counts and offsets of `experts` experts over A's `capacity` rows: every thread counts the
// slots of its experts (grouped_slots), then a scan, ceil(log2(experts + 1)) rounds of adding the
// entry d before (Hillis and Steele), each round from one buffer into the other; an odd count of
// rounds is copied back. The sums saturate at grouped_max_slots, which only experts of
// overlapping rows reach: a walk then stops there (its tiles counted in 32 bits) and the entries
// stay in order. Every thread makes the same accesses, over the padded entries, and consecutive
// threads take consecutive entries: no bank conflicts. Every thread of the block calls it; it
// ends with __syncthreads.
template <int kThreads, int kEntries>
__device__ __forceinline__ void grouped_first_slots(const std::int32_t* counts,
                                                    const std::int32_t* offsets,
                                                    std::int64_t experts, std::int64_t capacity,
                                                    std::uint32_t first) {
  namespace fu = metrale::fused;
  static_assert(kEntries % kThreads == 0 && kEntries > fu::kGroupedMaxExperts,
                "whole rounds of the block's threads over every expert's entry");
  constexpr int kPerThread = kEntries / kThreads;
  const int n = fu::grouped_experts(experts) + 1;  // entries: 0 then each expert's slots
  const std::int64_t most = fu::grouped_max_slots(capacity, experts);
  const auto cap = static_cast<std::uint32_t>(most < 0x7FFFFFFF ? most : 0x7FFFFFFF);
  std::uint32_t from = first, to = first + 4u * kEntries;
#pragma unroll
  for (int r = 0; r < kPerThread; ++r) {
    const int i = static_cast<int>(threadIdx.x) + r * kThreads;
    const int v = i == 0 || i >= n
                      ? 0
                      : fu::grouped_slots(__ldg(counts + i - 1), __ldg(offsets + i - 1), capacity);
    ptx::st_shared4(from + 4u * i, static_cast<std::uint32_t>(v) < cap ? v : cap);
  }
  __syncthreads();
  for (int d = 1; d < n; d *= 2) {
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int i = static_cast<int>(threadIdx.x) + r * kThreads;
      const std::uint32_t v = ptx::ld_shared4(from + 4u * i);
      const std::uint32_t before = ptx::ld_shared4(from + 4u * (i >= d ? i - d : 0));
      const std::uint32_t sum = v + before;  // both at most cap < 2^31: no wrap
      ptx::st_shared4(to + 4u * i, i < d ? v : sum < cap ? sum : cap);
    }
    __syncthreads();
    const std::uint32_t t = from;
    from = to;
    to = t;
  }
  if (from != first) {  // the sums are in the second buffer
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int i = static_cast<int>(threadIdx.x) + r * kThreads;
      ptx::st_shared4(to + 4u * i, ptx::ld_shared4(from + 4u * i));
    }
    __syncthreads();
  }
}

}  // namespace metrale::kernels
