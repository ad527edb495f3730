// What the CPU kernels of the w4a16 module share: the decode tables, typed access to the
// arguments, row-major or transposed weights, the scalar tail of a row and the final store.
// Internal to src/cpu/kernels.
#pragma once

#include <cstdint>

#include "kernels/gemm_params.h"
#include "metrale/numerics.h"

// The instruction sets of the AVX-512 BF16 kernels: lambdas take it through __attribute__,
// functions through [[gnu::target]].
#define METRALE_AVX512BF16_FEATURES "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma"
#define METRALE_TARGET_AVX512BF16 gnu::target(METRALE_AVX512BF16_FEATURES)

namespace metrale::cpu::w4a16::detail {

struct Tables {
  float e4m3[256];
  float e8m0[256];
  float e2m1[16];
  std::uint8_t e2m1_as_e4m3[16];  // every E2M1 value is exact in E4M3
  // BF16 bits of E2M1 value i & 15 for i < 32: vpermw reads 5 index bits, and the bit above a
  // nibble is its neighbour's.
  alignas(64) std::uint16_t e2m1_bf16[32];
};

inline const Tables& tables() {
  static const Tables t = [] {
    Tables x{};
    for (int i = 0; i < 256; ++i) {
      x.e4m3[i] = num::e4m3_to_f32(static_cast<std::uint8_t>(i));
      x.e8m0[i] = num::e8m0_to_f32(static_cast<std::uint8_t>(i));
    }
    for (int i = 0; i < 16; ++i) {
      x.e2m1[i] = num::e2m1_to_f32(static_cast<std::uint8_t>(i));
      x.e2m1_as_e4m3[i] = num::f32_to_e4m3(x.e2m1[i]);
    }
    for (int i = 0; i < 32; ++i) x.e2m1_bf16[i] = num::f32_to_bf16(x.e2m1[i & 15]);
    return x;
  }();
  return t;
}

template <class T>
inline T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address));
}

// Layout-aware access to the weights of one GEMM.
struct Weights {
  const std::uint8_t* codes;
  const std::uint8_t* scales;
  std::int64_t n, k, group;
  bool transposed, mxfp4;

  explicit Weights(const GemmParams& p)
      : codes(at<const std::uint8_t>(p.codes)),
        scales(at<const std::uint8_t>(p.scales)),
        n(p.n),
        k(p.k),
        group((p.flags & kGemmMxfp4) ? num::kMxfp4Group : num::kNvfp4Group),
        transposed(p.flags & kGemmTransposed),
        mxfp4(p.flags & kGemmMxfp4) {}

  std::uint8_t code(std::int64_t row, std::int64_t col) const {
    const std::uint8_t byte =
        transposed ? codes[(col >> 1) * n + row] : codes[row * (k / 2) + (col >> 1)];
    return (col & 1) ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
  }
  // The decoded block scale of group g of row (tensor scale not included).
  float scale(std::int64_t row, std::int64_t g) const {
    const std::uint8_t s = transposed ? scales[g * n + row] : scales[row * (k / group) + g];
    return mxfp4 ? tables().e8m0[s] : tables().e4m3[s];
  }
};

// Writes C[m, n] from an FP32 sum: tensor scale, bias, then one rounding to BF16, or none for
// FP32 output (kGemmOutF32: a row-parallel rank's partial sum, rounded after the ranks' sum).
inline void store(const GemmParams& p, std::int64_t m, std::int64_t n, float sum) {
  float v = sum * p.tensor_scale;
  if (p.flags & kGemmBias) v += num::bf16_to_f32(at<const std::uint16_t>(p.bias)[n]);
  if (p.flags & kGemmOutF32) {
    at<float>(p.out)[m * p.n + n] = v;
  } else {
    at<std::uint16_t>(p.out)[m * p.n + n] = num::f32_to_bf16(v);
  }
}

inline float a_at(const GemmParams& p, std::int64_t m, std::int64_t k) {
  return num::bf16_to_f32(at<const std::uint16_t>(p.a)[m * p.k + k]);
}

// The scalar tail of one row beyond kv, group by group, added to sum; then the store.
inline void finish_row(const GemmParams& p, const Weights& w, std::int64_t m, std::int64_t n,
                       std::int64_t kv, float sum) {
  const Tables& t = tables();
  for (std::int64_t k = kv; k < p.k; k += w.group) {
    float part = 0.0f;
    for (std::int64_t kk = k; kk < k + w.group; ++kk)
      part += t.e2m1[w.code(n, kk)] * a_at(p, m, kk);
    sum += part * w.scale(n, k / w.group);
  }
  store(p, m, n, sum);
}

}  // namespace metrale::cpu::w4a16::detail
