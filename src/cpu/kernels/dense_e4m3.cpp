#include "cpu/kernels/dense_e4m3.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <vector>

#include "cpu/kernels/dense_store.h"
#include "cpu/kernels/w4a16_cpu.h"
#include "kernels/fp8_panel_layout.h"
#include "metrale/dense_gemm.h"
#include "metrale/numerics.h"

namespace metrale::cpu::blas {
namespace {

constexpr std::int64_t kLanes = 8;  // fixed-order partial sums, as in dense_bf16.cpp

// Every E4M3 code as a float (exact), looked up instead of decoded per product.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int i = 0; i < 256; ++i)
      v[static_cast<std::size_t>(i)] = num::e4m3_to_f32(static_cast<std::uint8_t>(i));
    return v;
  }();
  return t;
}

// Σ x·y over len elements in FP32. Each product of two E4M3 values is exact in FP32 (4 × 4
// significant bits, exponents within FP32's range), so the additions are the only roundings.
float dot(const float* x, const float* y, std::int64_t len) {
  float acc[kLanes] = {};
  std::int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (std::int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j] * y[i + j];
  }
  for (; i < len; ++i) acc[i % kLanes] += x[i] * y[i];
  float s = 0.0f;
  for (const float v : acc) s += v;
  return s;
}

// gemm_e4m3_block128 with B's code of (n, k) at b[offset(n, k)].
template <typename Offset>
void reference_gemm(const DenseParams& p, std::int64_t n0, std::int64_t n1, Offset offset) {
  const auto* a = reinterpret_cast<const std::uint8_t*>(p.a);
  const auto* b = reinterpret_cast<const std::uint8_t*>(p.b);
  const auto* sa = reinterpret_cast<const float*>(p.a_scales);
  const auto* sb = reinterpret_cast<const float*>(p.b_scales);
  const auto* bias = reinterpret_cast<const std::uint16_t*>(p.bias);
  const auto& lut = e4m3_table();
  const auto k = static_cast<std::size_t>(p.k), cols = static_cast<std::size_t>(n1 - n0);
  const std::int64_t kblocks = dense_scale_blocks(p.k);
  // The scales' padded leading dimensions (dense_gemm.h), as cuBLASLt reads them.
  const std::int64_t lda = a_scales_ld(p), ldb = dense_b_scales_ld(p.k);
  // The block's rows of B widened once, then each row of A.
  std::vector<float> bw(cols * k), aw(k);
  for (std::size_t j = 0; j < cols; ++j) {
    for (std::size_t i = 0; i < k; ++i) {
      bw[j * k + i] =
          lut[b[offset(n0 + static_cast<std::int64_t>(j), static_cast<std::int64_t>(i))]];
    }
  }
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::size_t i = 0; i < k; ++i) aw[i] = lut[a[static_cast<std::size_t>(m) * k + i]];
    for (std::size_t j = 0; j < cols; ++j) {
      const std::int64_t n = n0 + static_cast<std::int64_t>(j);
      const float* sbrow = sb + (n / kDenseScaleBlock) * ldb;
      float v = 0.0f;
      for (std::int64_t kb = 0; kb < kblocks; ++kb) {
        const std::int64_t k0 = kb * kDenseScaleBlock;
        const std::int64_t len = std::min<std::int64_t>(kDenseScaleBlock, p.k - k0);
        const float block =
            dot(aw.data() + k0, bw.data() + j * k + static_cast<std::size_t>(k0), len);
        // The two scales' product first, as the vector kernels and the GPU's grouped kernels
        // (and DeepGEMM) take it: the same FP32 roundings on every path.
        v += block * (sa[kb * lda + m] * sbrow[kb]);
      }
      if (bias != nullptr) v += num::bf16_to_f32(bias[n]);
      store_c(
          p,
          static_cast<std::size_t>(m) * static_cast<std::size_t>(p.n) + static_cast<std::size_t>(n),
          v);
    }
  }
}

using Kernel = void (*)(const DenseParams&, std::int64_t, std::int64_t);

// Of one kernel's three builds, the best this processor runs (METRALE_CPU_ISA caps it).
Kernel best_of(Kernel reference, Kernel avx512bf16, Kernel avx512vbmi) {
  if (w4a16::best_isa() != w4a16::Isa::kAvx512Bf16) return reference;
  return has_avx512vbmi() ? avx512vbmi : avx512bf16;
}

}  // namespace

void gemm_e4m3_block128(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  reference_gemm(p, n0, n1, [k = p.k](std::int64_t n, std::int64_t q) { return n * k + q; });
}

void gemm_e4m3_block128_panels(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  reference_gemm(p, n0, n1,
                 [k = p.k](std::int64_t n, std::int64_t q) { return fp8_panels::offset(n, q, k); });
}

void gemm_e4m3_block128_panels_best(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  best_of(gemm_e4m3_block128_panels, gemm_e4m3_block128_panels_avx512bf16,
          gemm_e4m3_block128_panels_avx512vbmi)(p, n0, n1);
}

void gemm_e4m3_block128_best(const DenseParams& p, std::int64_t n0, std::int64_t n1) {
  best_of(gemm_e4m3_block128, gemm_e4m3_block128_avx512bf16, gemm_e4m3_block128_avx512vbmi)(p, n0,
                                                                                            n1);
}

}  // namespace metrale::cpu::blas
