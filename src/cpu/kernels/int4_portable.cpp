// INT4 weights on any processor, and the dispatch of the INT4 kernels by instruction set.
#include <algorithm>
#include <vector>

#include "cpu/kernels/int4_cpu.h"
#include "cpu/kernels/int4_shared.h"
#include "cpu/kernels/w4a16_shared.h"

namespace metrale::cpu::w4a16 {
namespace detail {

void int4_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Int4Weights w(p);
  // A as float in the weights' stored K order, once per block of columns.
  thread_local std::vector<float> a;
  a.resize(static_cast<std::size_t>(p.m * p.k));
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t j = 0; j < p.k; ++j) a[m * p.k + j] = a_at(p, m, j);
  }
  for (std::int64_t n = n0; n < n1; ++n) {
    for (std::int64_t m = 0; m < p.m; ++m) {
      const float* am = a.data() + m * p.k;
      float sum = 0.0f;
      for (std::int64_t g = 0; g < w.groups; ++g) {
        const auto zero = static_cast<float>(w.zero(n, g));
        float part = 0.0f;
        for (std::int64_t j = g * w.group; j < (g + 1) * w.group; ++j) {
          part += am[j] * (static_cast<float>(w.code(n, j)) - zero);
        }
        sum += part * w.scale(n, g);
      }
      store(p, m, n, sum);
    }
  }
}

}  // namespace detail

namespace {

// p's rows in slices of up to kRows, each a call of rows(q, n0, n1, slice rows) on the slice.
template <std::int64_t kRows, class Rows>
void in_slices(const GemmParams& p, std::int64_t n0, std::int64_t n1, Rows rows) {
  for (std::int64_t m0 = 0; m0 < p.m; m0 += kRows) {
    GemmParams q = p;
    q.a += static_cast<std::uint64_t>(m0 * p.k * 2);
    q.out += static_cast<std::uint64_t>(m0 * p.n * ((p.flags & kGemmOutF32) ? 4 : 2));
    q.m = std::min(kRows, p.m - m0);
    rows(q, n0, n1);
  }
}

// AVX2: slices of up to 4 rows, each streaming the block's weights again.
void int4_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  in_slices<4>(p, n0, n1, [](const GemmParams& q, std::int64_t a, std::int64_t b) {
    if (q.m <= 1) {
      detail::int4_rows_avx2<1>(q, a, b);
    } else if (q.m <= 2) {
      detail::int4_rows_avx2<2>(q, a, b);
    } else {
      detail::int4_rows_avx2<4>(q, a, b);
    }
  });
}

}  // namespace

// Rows of a tiled block up to which the panel layout's tiled route runs int4_panels.cpp (6-row
// tiles that decode the lines themselves); past it int4_tiled.cpp's panels, decoded once per
// block for 8-row tiles. On 8B gate_up (one run, twice each), the decoded panels' time over the
// tiles' was 1.11 at M = 5, 1.00 at 8, 1.03-1.07 at 12, 1.00-1.01 at 16, 0.94-0.99 at 24, 0.91 at
// 32 and 0.93-0.95 at 48 (docs/PERF.md, "INT4 in the panel layout").
constexpr std::int64_t kInt4PanelsTiledMaxM = 16;

void int4_gemm(const GemmParams& p, std::int64_t n0, std::int64_t n1, Isa isa) {
  if (p.flags & kGemmPanels) {
    return isa == Isa::kAvx512Bf16 ? detail::int4_panels_bf16(p, n0, n1)
                                   : detail::int4_portable(p, n0, n1);
  }
  if (isa == Isa::kAvx2 || isa == Isa::kAvx512) return int4_avx2(p, n0, n1);
  if (isa != Isa::kAvx512Bf16) return detail::int4_portable(p, n0, n1);
  // Slices of up to 16 rows, each streaming the block's weights again (from cache: a tiled block
  // is 64 columns).
  in_slices<16>(p, n0, n1, [](const GemmParams& q, std::int64_t a, std::int64_t b) {
    if (q.m <= 1) {
      detail::int4_rows_bf16<1>(q, a, b);
    } else if (q.m <= 2) {
      detail::int4_rows_bf16<2>(q, a, b);
    } else if (q.m <= 4) {
      detail::int4_rows_bf16<4>(q, a, b);
    } else if (q.m <= 8) {
      detail::int4_rows_bf16<8>(q, a, b);
    } else {
      detail::int4_rows_bf16<16>(q, a, b);
    }
  });
}

void int4_tiled(const GemmParams& p, std::int64_t n0, std::int64_t n1, Isa isa) {
  if (p.flags & kGemmPanels) {
    if (isa != Isa::kAvx512Bf16) return detail::int4_portable(p, n0, n1);
    return p.m <= kInt4PanelsTiledMaxM ? detail::int4_panels_bf16(p, n0, n1)
                                       : detail::int4_tiled_bf16(p, n0, n1);
  }
  if (isa == Isa::kAvx2 || isa == Isa::kAvx512) return int4_avx2(p, n0, n1);
  if (isa != Isa::kAvx512Bf16) return detail::int4_portable(p, n0, n1);
  detail::int4_tiled_bf16(p, n0, n1);
}

}  // namespace metrale::cpu::w4a16
