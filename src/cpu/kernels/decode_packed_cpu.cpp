#include "cpu/kernels/decode_packed_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/kernels/w4a16_shared.h"
#include "kernels/decode_layout.h"
#include "metrale/numerics.h"

namespace metrale::cpu::w4a16 {

namespace dl = decode_layout;

void gemm_decode_packed(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  using detail::at;
  const bool mx = (p.flags & kGemmMxfp4) != 0;
  const auto* codes = at<const std::uint8_t>(p.codes);
  const auto* scales = at<const std::uint8_t>(p.scales);
  const std::int64_t kbs = dl::k_blocks(p.k);
  const int per_lane = dl::scale_bytes_per_lane(mx);
  std::uint32_t table[dl::kTableEntries];
  std::memcpy(table, scales, dl::kTableBytes);
  // A in FP32 once per call, padded with zeros to whole K blocks so that every word's k exists.
  thread_local std::vector<float> a;
  const std::int64_t kp = dl::padded_k(p.k);
  a.assign(static_cast<std::size_t>(p.m * kp), 0.0f);
  const auto* a16 = at<const std::uint16_t>(p.a);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t k = 0; k < p.k; ++k) a[m * kp + k] = num::bf16_to_f32(a16[m * p.k + k]);
  }
  // FP32 sums of one tile's 32 rows for every row of A.
  thread_local std::vector<float> acc;
  for (std::int64_t tile = n0 / dl::kTileN; tile * dl::kTileN < n1; ++tile) {
    acc.assign(static_cast<std::size_t>(p.m * dl::kTileN), 0.0f);
    for (std::int64_t kb = 0; kb < kbs; ++kb) {
      const std::int64_t block = tile * kbs + kb;
      const std::uint8_t* words = codes + block * dl::kTileBlockBytes;
      const std::uint8_t* lane_scales = scales + dl::kTableBytes + block * dl::kLanes * per_lane;
      for (int chunk = 0; chunk < dl::kChunks; ++chunk) {
        for (int lane = 0; lane < dl::kLanes; ++lane) {
          const int g = lane / 4, t = lane % 4;
          const std::uint8_t* sc = lane_scales + lane * per_lane;
          for (int q = 0; q < dl::kChunkBytes / 4; ++q) {
            const int s = 2 * chunk + q / 2, rt = q % 2;
            std::uint32_t word;
            std::memcpy(
                &word,
                words + chunk * (dl::kLanes * dl::kChunkBytes) + lane * dl::kChunkBytes + 4 * q, 4);
            std::uint32_t fields[4];
            dl::dequant_word_fields(word, fields);
            // Register j: row g + 8 (2 rt + j % 2), k pair j / 2 of k = 32 t + 4 s.
            for (int j = 0; j < 4; ++j) {
              const int r = 2 * rt + (j & 1), nl = g + 8 * r;
              const std::uint8_t code = mx ? sc[r] : sc[2 * r + s / 4];
              const std::uint32_t w = num::bf16x2_mul(fields[j], table[code]);
              const float w0 = num::bf16_to_f32(static_cast<std::uint16_t>(w));
              const float w1 = num::bf16_to_f32(static_cast<std::uint16_t>(w >> 16));
              const std::int64_t k = kb * dl::kBlockK + 32 * t + 4 * s + 2 * (j / 2);
              for (std::int64_t m = 0; m < p.m; ++m) {
                const float* am = a.data() + m * kp + k;
                acc[m * dl::kTileN + nl] += am[0] * w0 + am[1] * w1;
              }
            }
          }
        }
      }
    }
    const std::int64_t lo = std::max(n0, tile * dl::kTileN);
    const std::int64_t hi = std::min({n1, p.n, (tile + 1) * dl::kTileN});
    for (std::int64_t n = lo; n < hi; ++n) {
      for (std::int64_t m = 0; m < p.m; ++m) {
        detail::store(p, m, n,
                      std::ldexp(acc[m * dl::kTileN + n - tile * dl::kTileN], p.weight_fold));
      }
    }
  }
}

}  // namespace metrale::cpu::w4a16
