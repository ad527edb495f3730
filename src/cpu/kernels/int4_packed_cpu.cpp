#include "cpu/kernels/int4_packed_cpu.h"

#include <vector>

#include "cpu/kernels/w4a16_shared.h"
#include "kernels/decode_layout.h"
#include "kernels/dequant_int4.h"
#include "kernels/int4_decode_layout.h"

namespace metrale::cpu::w4a16 {

void gemm_int4_decode(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  using detail::at;
  namespace i4 = int4_decode;
  const auto* codes = at<const std::uint8_t>(p.codes);
  const auto* side = at<const std::uint8_t>(p.scales);
  const std::int64_t kbs = decode_layout::k_blocks(p.k);
  const bool fp16 = (p.flags & kGemmFp16Scales) != 0;
  // A in FP32 once per call (under act order it arrives in the stored order: permute_a_int4).
  thread_local std::vector<float> a;
  a.assign(static_cast<std::size_t>(p.m * p.k), 0.0f);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t j = 0; j < p.k; ++j) {
      a[static_cast<std::size_t>(m * p.k + j)] = detail::a_at(p, m, j);
    }
  }
  thread_local std::vector<float> w;
  w.resize(static_cast<std::size_t>(p.k));
  for (std::int64_t n = n0; n < n1; ++n) {
    for (std::int64_t j = 0; j < p.k; ++j) {
      w[static_cast<std::size_t>(j)] = i4::weight(codes, side, n, j, kbs, p.group, fp16);
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      const float* row = a.data() + m * p.k;
      float sum = 0.0f;
      for (std::int64_t j = 0; j < p.k; ++j) sum += row[j] * w[static_cast<std::size_t>(j)];
      detail::store(p, m, n, sum);
    }
  }
}

void dequant_int4_bf16(const GemmParams& p, std::int64_t u0, std::int64_t u1) {
  for (std::int64_t u = u0; u < u1; ++u) dequant_int4::unit(p, u);
}

}  // namespace metrale::cpu::w4a16
