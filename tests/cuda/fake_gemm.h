// Fake w4a16 GEMM kernels for the fake driver's launch tests: a decode kernel that computes only
// what the launched grid covers (block x: its N tile, block z: its K slice, into the split-K
// workspace when the launch splits, else C), from whatever weights function the test gives it,
// and the split-K reduction. Fake device memory is host memory.
#pragma once

#include <cstdint>
#include <functional>

#include "cuda/fake_driver.h"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/kernel_args.h"
#include "metrale/numerics.h"

namespace metrale::cuda::testing {

// The host object at a fake device address.
template <class T>
T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address));
}

// C[m, n] from its FP32 sum: tensor scale, bias, then (the kernels' epilogue) one rounding to
// BF16, or, with kGemmOutF32, the FP32 value itself (a row-parallel rank's partial sum).
inline void store_c(const GemmParams& p, std::int64_t m, std::int64_t n, float sum) {
  float v = sum * p.tensor_scale;
  if (p.flags & kGemmBias) v += num::bf16_to_f32(at<const std::uint16_t>(p.bias)[n]);
  if (p.flags & kGemmOutF32) {
    at<float>(p.out)[m * p.n + n] = v;
  } else {
    at<std::uint16_t>(p.out)[m * p.n + n] = num::f32_to_bf16(v);
  }
}

// W[n, k] as a fake kernel reads it from the buffers GemmParams points at.
using FakeWeight = std::function<float(const GemmParams&, std::int64_t n, std::int64_t k)>;

// A split-K decode block: columns [n0, n1) of every row of p over K slice z (tile_math.h's
// split_k_range), into C, or with K split into the FP32 partials at (z · M + m) · N + n of
// p.workspace, as epilogue.cuh's store_output writes them.
inline void fake_split_decode_block(const GemmParams& p, std::int64_t z, std::int64_t n0,
                                    std::int64_t n1, const FakeWeight& weight) {
  const auto* a = at<const std::uint16_t>(p.a);
  std::int64_t k0 = 0, k1 = p.k;
  if (p.splits > 1) tiles::split_k_range(p.k, p.k_per_split, z, &k0, &k1);
  for (std::int64_t n = n0; n < n1 && n < p.n; ++n) {
    for (std::int64_t m = 0; m < p.m; ++m) {
      float sum = 0.0f;
      for (std::int64_t k = k0; k < k1; ++k) {
        sum += num::bf16_to_f32(a[m * p.k + k]) * weight(p, n, k);
      }
      if (p.splits > 1) {
        at<float>(p.workspace)[(z * p.m + m) * p.n + n] = sum;
      } else {
        store_c(p, m, n, sum);
      }
    }
  }
}

// A split-K decode kernel over `tile` columns per block; it writes nothing for a launch whose
// parameters `accepts` refuses (a layout it does not read).
inline FakeFunction fake_split_decode(std::uint32_t tile, FakeWeight weight,
                                      std::function<bool(const GemmParams&)> accepts = {}) {
  FakeFunction f;
  f.param_sizes = {sizeof(GemmParams)};
  f.body = [tile, weight = std::move(weight), accepts = std::move(accepts)](const FakeLaunch& l) {
    const auto p = read_param<GemmParams>(l.params, 0);
    if (accepts && !accepts(p)) return;
    for (std::int64_t z = 0; z < l.grid[2]; ++z) {
      for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
        fake_split_decode_block(p, z, bx * tile, (bx + 1) * tile, weight);
      }
    }
  };
  return f;
}

// gemm_split_reduce: block x sums `tile` outputs over the slices, in slice order.
inline FakeFunction fake_split_reduce(std::uint32_t tile) {
  FakeFunction f;
  f.param_sizes = {sizeof(GemmParams)};
  f.body = [tile](const FakeLaunch& l) {
    const auto p = read_param<GemmParams>(l.params, 0);
    const auto* ws = at<const float>(p.workspace);
    for (std::int64_t i = 0; i < std::int64_t{l.grid[0]} * tile && i < p.m * p.n; ++i) {
      float sum = 0.0f;
      for (std::int64_t z = 0; z < p.splits; ++z) sum += ws[z * p.m * p.n + i];
      store_c(p, i / p.n, i % p.n, sum);
    }
  };
  return f;
}

}  // namespace metrale::cuda::testing
