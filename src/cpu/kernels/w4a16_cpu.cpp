// CPU kernels of the w4a16 module. The vector code is written with intrinsics inside functions
// carrying a target attribute (never -march), so one binary runs on any x86-64 and uses AVX-512
// or AVX2 where the processor has them; portable code covers the rest.
#include "cpu/kernels/w4a16_cpu.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#include "core/log.h"
#include "cpu/kernels/decode_avx2.h"
#include "cpu/kernels/decode_bf16.h"
#include "cpu/kernels/int4_cpu.h"
#include "cpu/kernels/panels_small.h"
#include "cpu/kernels/panels_tiled.h"
#include "cpu/kernels/tiled_panels.h"
#include "cpu/kernels/w4a16_shared.h"
#include "metrale/numerics.h"

// The vector helpers below take and return vectors wider than the baseline ABI. They are always
// inlined into (or are themselves) functions compiled for the matching instruction set, and
// are only called from those, so GCC's note about the ABI of such calls does not apply.
#pragma GCC diagnostic ignored "-Wpsabi"
// GCC 12 reports the deliberately undefined pass-through operand of the AVX-512 intrinsics
// (_mm512_undefined_epi32 inside the headers) as maybe-uninitialized; it is never read.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace metrale::cpu::w4a16 {
namespace {

using namespace detail;

// ---- portable decode: any layout, any format ----

void decode_portable(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  const Weights w(p);
  const float* e2m1 = tables().e2m1;
  for (std::int64_t n = n0; n < n1; ++n) {
    for (std::int64_t m = 0; m < p.m; ++m) {
      float sum = 0.0f;
      for (std::int64_t g = 0; g < p.k / w.group; ++g) {
        float part = 0.0f;
        for (std::int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
          part += e2m1[w.code(n, k)] * a_at(p, m, k);
        }
        sum += part * w.scale(n, g);
      }
      store(p, m, n, sum);
    }
  }
}

// ---- vector code ----

// A converted once per block, chunk-major: chunk c of row m (2W elements: W even-k values,
// then W odd-k values, matching the low and high nibbles of W code bytes) sits at
// (c * mb + m) * 2W, so one chunk of every row is contiguous. (Row-major staging put rows 16 KiB
// apart, all in one L1 set.) Rows from M up to mb are zero.
template <int W>
[[gnu::always_inline]] inline const float* stage_a(const GemmParams& p, int mb, std::int64_t kv) {
  thread_local std::vector<float> buf;
  buf.assign(static_cast<std::size_t>(mb) * kv, 0.0f);
  for (std::int64_t m = 0; m < p.m; ++m) {
    for (std::int64_t c = 0; c < kv / (2 * W); ++c) {
      float* chunk = buf.data() + (c * mb + m) * 2 * W;
      for (int j = 0; j < W; ++j) {
        chunk[j] = a_at(p, m, c * 2 * W + 2 * j);
        chunk[W + j] = a_at(p, m, c * 2 * W + 2 * j + 1);
      }
    }
  }
  return buf.data();
}

// Decode over row-major weights with MB rows of A (M <= MB) kept in registers, written with
// intrinsics per instruction set (GCC's generic vectors turn the byte widening into scalar
// inserts). The main loop covers kv = K rounded down to 2W; the rest of each row is scalar.
// Two accumulator sets alternate between chunks while MB is small, so the FMA latency chain
// does not bound a one-row GEMV.

#define METRALE_TARGET_AVX512 gnu::target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define METRALE_TARGET_AVX2 gnu::target("avx2,fma")

// One chunk of 32 weights (16 code bytes), decoded: even-k values, odd-k values, and the block
// scale of each lane. Returned by value so the caller's accumulators stay in registers (an
// accumulator array passed by reference was kept in memory, a store-to-load chain per chunk).
struct Chunk512 {
  __m512 lo, hi, scale;
};

[[METRALE_TARGET_AVX512, gnu::always_inline]] inline Chunk512 decode_chunk_avx512(
    const std::uint8_t* codes, const std::uint8_t* scales, std::int64_t c, bool mxfp4,
    const float* e4m3, const float* e8m0, __m512 lut, __m512i low4) {
  const __m512i b =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c * 16)));
  Chunk512 out;
  out.lo = _mm512_permutexvar_ps(_mm512_and_si512(b, low4), lut);
  out.hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
  // 32 elements per chunk: one MX block, or two NVFP4 blocks (lanes 0-7 and 8-15).
  out.scale = mxfp4 ? _mm512_set1_ps(e8m0[scales[c]])
                    : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(e4m3[scales[2 * c]]),
                                           _mm512_set1_ps(e4m3[scales[2 * c + 1]]));
  return out;
}

template <int MB>
[[METRALE_TARGET_AVX512]] void decode_rows_avx512(const GemmParams& p, std::int64_t n0,
                                                  std::int64_t n1) {
  constexpr int W = 16;
  const Weights w(p);
  const Tables& t = tables();
  const std::int64_t kv = p.k / (2 * W) * (2 * W);
  const float* a = stage_a<W>(p, MB, kv);
  const __m512 lut = _mm512_loadu_ps(t.e2m1);
  const __m512i low4 = _mm512_set1_epi32(15);
  const std::int64_t kb = p.k / 2, groups = p.k / w.group, chunks = kv / (2 * W);
  for (std::int64_t n = n0; n < n1; ++n) {
    const std::uint8_t* codes = w.codes + n * kb;
    const std::uint8_t* scales = w.scales + n * groups;
    // Two accumulator sets, even and odd chunks, so one row's FMA chain is not latency-bound.
    __m512 even[MB], odd[MB];
    for (int m = 0; m < MB; ++m) even[m] = odd[m] = _mm512_setzero_ps();
    std::int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      // Two chunks are 32 bytes: a new cache line every other step. The hardware prefetcher
      // alone left the stream latency-bound (10.7 GB/s of 29 on the dev VM; 17 with this).
      if ((c & 3) == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + c * 16 + 2048), _MM_HINT_T0);
      }
      const Chunk512 x = decode_chunk_avx512(codes, scales, c, w.mxfp4, t.e4m3, t.e8m0, lut, low4);
      const Chunk512 y =
          decode_chunk_avx512(codes, scales, c + 1, w.mxfp4, t.e4m3, t.e8m0, lut, low4);
      const float* ax = a + c * MB * 2 * W;
      const float* ay = ax + MB * 2 * W;
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const __m512 px = _mm512_fmadd_ps(x.hi, _mm512_loadu_ps(ax + m * 2 * W + W),
                                          _mm512_mul_ps(x.lo, _mm512_loadu_ps(ax + m * 2 * W)));
        const __m512 py = _mm512_fmadd_ps(y.hi, _mm512_loadu_ps(ay + m * 2 * W + W),
                                          _mm512_mul_ps(y.lo, _mm512_loadu_ps(ay + m * 2 * W)));
        even[m] = _mm512_fmadd_ps(px, x.scale, even[m]);
        odd[m] = _mm512_fmadd_ps(py, y.scale, odd[m]);
      }
    }
    for (; c < chunks; ++c) {
      const Chunk512 x = decode_chunk_avx512(codes, scales, c, w.mxfp4, t.e4m3, t.e8m0, lut, low4);
      const float* ax = a + c * MB * 2 * W;
#pragma GCC unroll 16
      for (int m = 0; m < MB; ++m) {
        const __m512 px = _mm512_fmadd_ps(x.hi, _mm512_loadu_ps(ax + m * 2 * W + W),
                                          _mm512_mul_ps(x.lo, _mm512_loadu_ps(ax + m * 2 * W)));
        even[m] = _mm512_fmadd_ps(px, x.scale, even[m]);
      }
    }
    for (std::int64_t m = 0; m < p.m; ++m) {
      float lanes[W];
      _mm512_storeu_ps(lanes, _mm512_add_ps(even[m], odd[m]));
      float sum = 0.0f;
      for (float v : lanes) sum += v;
      finish_row(p, w, m, n, kv, sum);
    }
  }
}

// Rows of A in register blocks of 1, 2, 4, 8 or 16 (1, 2 or 4 on AVX2) for the decode kernel
// family K (its instantiation per block size); more rows (the decode route forced on a large M)
// run in slices of 16 (4), each streaming the weights again.
enum class DecodeKind { kAvx512, kAvx512Bf16, kAvx2 };

template <DecodeKind K, int MB>
[[gnu::always_inline]] inline void decode_block(const GemmParams& p, std::int64_t n0,
                                                std::int64_t n1);

template <DecodeKind K>
[[gnu::always_inline]] inline void decode_sliced(const GemmParams& p, std::int64_t n0,
                                                 std::int64_t n1) {
  constexpr std::int64_t kRows = K == DecodeKind::kAvx2 ? kAvx2DecodeMaxRows : 16;
  for (std::int64_t m0 = 0; m0 < p.m; m0 += kRows) {
    GemmParams q = p;
    q.a += static_cast<std::uint64_t>(m0 * p.k * 2);
    q.out += static_cast<std::uint64_t>(m0 * p.n * ((p.flags & kGemmOutF32) ? 4 : 2));
    q.m = std::min(kRows, p.m - m0);
    if (q.m <= 1) {
      decode_block<K, 1>(q, n0, n1);
    } else if (q.m <= 2) {
      decode_block<K, 2>(q, n0, n1);
    } else if (q.m <= 4) {
      decode_block<K, 4>(q, n0, n1);
    } else if constexpr (kRows > 4) {
      if (q.m <= 8) {
        decode_block<K, 8>(q, n0, n1);
      } else {
        decode_block<K, 16>(q, n0, n1);
      }
    }
  }
}

template <DecodeKind K, int MB>
[[gnu::always_inline]] inline void decode_block(const GemmParams& p, std::int64_t n0,
                                                std::int64_t n1) {
  if constexpr (K == DecodeKind::kAvx512) {
    decode_rows_avx512<MB>(p, n0, n1);
  } else if constexpr (K == DecodeKind::kAvx512Bf16) {
    decode_rows_bf16<MB>(p, n0, n1);
  } else {
    static_assert(MB <= kAvx2DecodeMaxRows);
    decode_rows_avx2<MB>(p, n0, n1);
  }
}

[[METRALE_TARGET_AVX512]] void decode_avx512(const GemmParams& p, std::int64_t n0,
                                             std::int64_t n1) {
  decode_sliced<DecodeKind::kAvx512>(p, n0, n1);
}
[[METRALE_TARGET_AVX512BF16]] void decode_avx512bf16(const GemmParams& p, std::int64_t n0,
                                                     std::int64_t n1) {
  decode_sliced<DecodeKind::kAvx512Bf16>(p, n0, n1);
}
[[METRALE_TARGET_AVX2]] void decode_avx2(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  decode_sliced<DecodeKind::kAvx2>(p, n0, n1);
}
// Whether the processor converts FP16 (CPUID leaf 1, ECX bit 29), which the AVX2 decode kernel
// uses for E4M3 scales. Clang's __builtin_cpu_supports does not know "f16c".
bool has_f16c() noexcept {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

}  // namespace

Isa best_isa() noexcept {
  static const Isa isa = [] {
    Isa best = Isa::kPortable;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c()) {
      best = Isa::kAvx2;
    }
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
      best = Isa::kAvx512;
      if (__builtin_cpu_supports("avx512bf16")) {
        best = Isa::kAvx512Bf16;
      }
    }
    return capped_isa(best, std::getenv("METRALE_CPU_ISA"));
  }();
  return isa;
}

Isa capped_isa(Isa best, const char* cap) {
  if (cap == nullptr || *cap == '\0') return best;
  const std::string_view c(cap);
  if (c == "portable") return Isa::kPortable;
  if (c == "avx2") return best < Isa::kAvx2 ? Isa::kAvx2 : best;
  if (c == "avx512") return best < Isa::kAvx512 ? Isa::kAvx512 : best;
  // A typo would otherwise run the best set silently while the user thinks it is capped.
  log::warn("METRALE_CPU_ISA={} is not one of avx512, avx2, portable; ignored ({} is used)", c,
            to_string(best));
  return best;
}

const char* to_string(Isa isa) noexcept {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return "avx512_bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kPortable:
      return "portable";
  }
  return "?";
}

void gemm_decode(const GemmParams& p, std::int64_t n0, std::int64_t n1, Isa isa) {
  if (p.flags & kGemmInt4) return int4_gemm(p, n0, n1, isa);
  if (p.flags & kGemmPanels) {
    return isa == Isa::kAvx512Bf16 ? panels_small_avx512bf16(p, n0, n1)
                                   : panels_portable(p, n0, n1);
  }
  // The vector path walks row-major codes; the transposed layout takes the portable path.
  if (p.flags & kGemmTransposed) return decode_portable(p, n0, n1);
  switch (isa) {
    case Isa::kAvx512Bf16:
      return decode_avx512bf16(p, n0, n1);
    case Isa::kAvx512:
      return decode_avx512(p, n0, n1);
    case Isa::kAvx2:
      return decode_avx2(p, n0, n1);
    case Isa::kPortable:
      return decode_portable(p, n0, n1);
  }
}

// Rows of one tiled block (up to 256, the grid's M tile) up to which the panel layout's tiled
// route runs panels_tiled.cpp for every column; above, the scaled panels of tiled_avx512.cpp.
// Side by side on 8B's layers (docs/PERF.md), panels_tiled's time was 1/1.24 of theirs at
// M = 16, 1/1.05 at 64, level at 96 and 128, and 1/0.93 at 192.
constexpr std::int64_t kPanelsTiledMaxM = 96;

void gemm_tiled(const GemmParams& p, std::int64_t n0, std::int64_t n1, std::int64_t m0,
                std::int64_t m1, Isa isa) {
  // Rows [m0, m1) as a GEMM of their own: A and C start at row m0.
  GemmParams q = p;
  q.a += static_cast<std::uint64_t>(m0 * p.k * 2);
  q.out += static_cast<std::uint64_t>(m0 * p.n * ((p.flags & kGemmOutF32) ? 4 : 2));
  q.m = m1 - m0;
  if (p.flags & kGemmInt4) return int4_tiled(q, n0, n1, isa);
  if (p.flags & kGemmPanels) {
    if (isa != Isa::kAvx512Bf16) return panels_portable(q, n0, n1);
    // Up to kPanelsTiledMaxM rows the register tiles decode the lines themselves; past it a panel
    // decoded once with its scales multiplied in pays, where the E8M0 codes allow it.
    if (q.m <= kPanelsTiledMaxM || !panel_scales_fit(Weights(p), n0, n1 - n0)) {
      return panels_tiled_avx512bf16(q, n0, n1);
    }
    return tiled_avx512bf16_panels(q, n0, n1);
  }
  // Columns whose E8M0 scales a panel cannot carry exactly take the decode kernels, which scale
  // each block's sum (tiled_panels.h).
  if (!scales_fit_panels(Weights(p), n0, n1 - n0)) return gemm_decode(q, n0, n1, isa);
  switch (isa) {
    case Isa::kAvx512Bf16:
      return tiled_avx512bf16(q, n0, n1);
    case Isa::kAvx512:
      return tiled_avx512(q, n0, n1);
    case Isa::kAvx2:
      return tiled_avx2(q, n0, n1);
    case Isa::kPortable:
      return tiled_portable(q, n0, n1);
  }
}

void gemm_e4m3(const GemmParams& p, std::int64_t n0, std::int64_t n1) {
  // What an FP8 tensor core computes: E4M3 × E4M3 products (exact in FP32), summed in FP32
  // within each K-group, then scaled by the group's FP32 scale and accumulated in FP32.
  const Tables& t = tables();
  const auto* a_e4m3 = at<const std::uint8_t>(p.a);
  const auto* w_e4m3 = at<const std::uint8_t>(p.codes);
  GemmParams scales_only = p;
  const Weights w(scales_only);
  for (std::int64_t n = n0; n < n1; ++n) {
    for (std::int64_t m = 0; m < p.m; ++m) {
      float sum = 0.0f;
      for (std::int64_t g = 0; g < p.k / w.group; ++g) {
        float part = 0.0f;
        for (std::int64_t k = g * w.group; k < (g + 1) * w.group; ++k) {
          part += t.e4m3[a_e4m3[m * p.k + k]] * t.e4m3[w_e4m3[n * p.k + k]];
        }
        sum += part * w.scale(n, g);
      }
      store(p, m, n, sum);
    }
  }
}

void split_reduce(const GemmParams& p, std::int64_t i0, std::int64_t i1) {
  const auto* ws = at<const float>(p.workspace);
  const std::int64_t plane = p.m * p.n;
  for (std::int64_t i = i0; i < i1; ++i) {
    float sum = 0.0f;
    for (std::int64_t z = 0; z < p.splits; ++z) sum += ws[z * plane + i];
    detail::store(p, i / p.n, i % p.n, sum);
  }
}

void cast_bf16_to_e4m3(const CastParams& p, std::int64_t i0, std::int64_t i1) {
  const auto* in = at<const std::uint16_t>(p.in);
  auto* out = at<std::uint8_t>(p.out);
  for (std::int64_t i = i0; i < i1; ++i) out[i] = num::bf16_to_e4m3(in[i]);
}

void dequant_e4m3(const CastParams& p, std::int64_t r0, std::int64_t r1) {
  GemmParams g;
  g.codes = p.in;
  g.n = p.count;
  g.k = p.k;
  g.flags = p.flags;
  const Weights w(g);
  const Tables& t = tables();
  auto* out = at<std::uint8_t>(p.out);
  for (std::int64_t r = r0; r < r1; ++r) {
    for (std::int64_t k = 0; k < p.k; ++k) out[r * p.k + k] = t.e2m1_as_e4m3[w.code(r, k)];
  }
}

}  // namespace metrale::cpu::w4a16
