// dequant_bf16: NVFP4/MXFP4 weights in their source layout to BF16 W [N, K], row-major, for the
// dequant route's dense GEMM (values and rounding: kernels/dequant_bf16.h). Bandwidth-bound:
// each weight reads half a byte of code and 1/16 (NVFP4) or 1/32 (MXFP4) byte of scale and writes
// 2 bytes, 2.5625 or 2.53125 bytes moved per weight.
//
// One thread per unit of 32 weights (dequant::kUnitWeights), the grid over every unit, so a
// layer's millions of units cover the device many times over:
//  - row-major codes [N, K/2] are one flat stream (a row's scales follow the previous row's, so
//    scale index = flat weight / group): unit u reads its 16 code bytes with one 16-byte load and
//    its scale bytes with one 2- or 1-byte load, and writes 64 bytes with four 16-byte stores
//    (a warp reads 512 contiguous bytes per load; a 16-weight tail, when N·K is odd in 16s, loads
//    8 bytes and stores 32);
//  - transposed codes [K/2, N]: unit u is column n = u mod N, K chunk u / N, so the 32 lanes of a
//    warp read 32 consecutive bytes of each code row and scale row (every sector fully used) and
//    each writes its 64 bytes of row n with four 16-byte stores.
// The rounding runs twice per block of 16 or 32 weights (dequant::table_of); a weight costs a
// quarter of each of four byte permutes. No shared memory, no local arrays.
#pragma once

#include <cstdint>

#include "kernels/dequant_bf16.h"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "ptx.cuh"

namespace metrale::kernels {

namespace dq = metrale::dequant;

__device__ __forceinline__ float block_scale(std::uint8_t v, bool mx) {
  return mx ? metrale::num::e8m0_to_f32(v) : metrale::num::e4m3_to_f32(v);
}

// 8 code words (32 weights) with the tables of their first and last 16, stored as 64 bytes.
__device__ __forceinline__ void store_units(std::uint8_t* out, const std::uint32_t (&w)[4],
                                            const dq::Table& t0, const dq::Table& t1, int words) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (i < words) {
      std::uint32_t o[4];
      dq::scaled_x8(i < 2 ? t0 : t1, w[i], o);
      *reinterpret_cast<uint4*>(out + 16 * i) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

__device__ __forceinline__ void dequant_bf16_unit(const GemmParams& p, std::int64_t u) {
  const bool mx = p.flags & metrale::kGemmMxfp4;
  const int group = mx ? metrale::num::kMxfp4Group : metrale::num::kNvfp4Group;
  const auto* codes = reinterpret_cast<const std::uint8_t*>(p.codes);
  const auto* scales = reinterpret_cast<const std::uint8_t*>(p.scales);
  auto* out = reinterpret_cast<std::uint8_t*>(p.out);
  std::uint32_t w[4] = {0, 0, 0, 0};
  if (!(p.flags & metrale::kGemmTransposed)) {
    const std::int64_t e0 = u * dq::kUnitWeights, total = p.n * p.k;
    if (e0 >= total) return;
    const bool whole = e0 + dq::kUnitWeights <= total;
    if (whole) {
      const uint4 c = metrale::ptx::ldg16(codes + e0 / 2);
      w[0] = c.x, w[1] = c.y, w[2] = c.z, w[3] = c.w;
    } else {
      const uint2 c = metrale::ptx::ldg8(codes + e0 / 2);
      w[0] = c.x, w[1] = c.y;
    }
    // An MXFP4 unit is one block; an NVFP4 unit two (one for a tail).
    const dq::Table t0 = dq::table_of(block_scale(scales[e0 / group], mx), p.tensor_scale);
    const dq::Table t1 =
        (mx || !whole) ? t0 : dq::table_of(block_scale(scales[e0 / 16 + 1], false), p.tensor_scale);
    store_units(out + e0 * 2, w, t0, t1, whole ? 4 : 2);
    return;
  }
  const std::int64_t n = u % p.n, k0 = (u / p.n) * dq::kUnitWeights;
  if (k0 >= p.k) return;
  const bool whole = k0 + dq::kUnitWeights <= p.k;
  // Code byte kk of column n sits at kk·N + n; the lanes' n are consecutive.
  const std::uint8_t* col = codes + (k0 / 2) * p.n + n;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    if (j < 8 || whole) w[j / 4] |= std::uint32_t{col[j * p.n]} << (8 * (j % 4));
  }
  const std::int64_t g0 = k0 / group;
  const dq::Table t0 = dq::table_of(block_scale(scales[g0 * p.n + n], mx), p.tensor_scale);
  const dq::Table t1 =
      (mx || !whole) ? t0
                     : dq::table_of(block_scale(scales[(g0 + 1) * p.n + n], false), p.tensor_scale);
  store_units(out + (n * p.k + k0) * 2, w, t0, t1, whole ? 4 : 2);
}

}  // namespace metrale::kernels
