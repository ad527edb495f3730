#include "cpu/kernels/fp8_cpu.h"

#include <algorithm>
#include <cstddef>

#include "cpu/kernels/w4a16_cpu.h"

namespace metrale::cpu::fp8 {

void cast_e4m3_block128_scalar(const Fp8CastParams& p, std::int64_t i0, std::int64_t i1) {
  namespace f = metrale::fp8;
  const auto* in = reinterpret_cast<const std::uint16_t*>(p.in);
  auto* codes = reinterpret_cast<std::uint8_t*>(p.codes);
  auto* scales = reinterpret_cast<float*>(p.scales);
  const std::int64_t kblocks = (p.k + f::kCastBlock - 1) / f::kCastBlock;
  for (std::int64_t i = i0; i < i1; ++i) {
    const std::int64_t m = i / kblocks, kb = i % kblocks;
    const std::int64_t k0 = kb * f::kCastBlock, k1 = std::min(p.k, k0 + f::kCastBlock);
    const auto row = static_cast<std::size_t>(m) * static_cast<std::size_t>(p.k);
    float amax = 0.0f;
    for (std::int64_t q = k0; q < k1; ++q) {
      amax = f::amax_step(amax, num::bf16_to_f32(in[row + static_cast<std::size_t>(q)]));
    }
    const float s = f::block_scale(amax);
    for (std::int64_t q = k0; q < k1; ++q) {
      const auto at = row + static_cast<std::size_t>(q);
      codes[at] = f::encode(num::bf16_to_f32(in[at]), s);
    }
    scales[kb * f::scales_ld(p.m) + m] = s;
  }
}

void cast_e4m3_block128(const Fp8CastParams& p, std::int64_t i0, std::int64_t i1) {
  const w4a16::Isa isa = w4a16::best_isa();
  if (isa == w4a16::Isa::kAvx512Bf16 || isa == w4a16::Isa::kAvx512) {
    cast_e4m3_block128_avx512(p, i0, i1);
  } else {
    cast_e4m3_block128_scalar(p, i0, i1);
  }
}

}  // namespace metrale::cpu::fp8
