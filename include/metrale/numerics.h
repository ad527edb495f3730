// Per-element number formats of the quantized GEMMs: BF16, FP8 E4M3 (the "fn" variant: no
// infinities, 0x7F/0xFF are NaN, largest finite 448), FP4 E2M1 and E8M0 scales. One header for
// host code, host tests and CUDA kernels alike: everything is inline, constexpr-friendly, free
// of library calls, and marked __host__ __device__ under nvcc. It includes nothing else from
// metrale, so device code may include it.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#define METRALE_HD __host__ __device__ __forceinline__
#else
#define METRALE_HD inline
#endif

namespace metrale::num {

METRALE_HD std::uint32_t f32_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

METRALE_HD float bits_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- BF16 ----

// BF16 bits to float (exact).
METRALE_HD float bf16_to_f32(std::uint16_t h) {
  return bits_f32(std::uint32_t{h} << 16);
}

// Float to BF16 bits, round to nearest even; NaN stays a (quiet) NaN with its sign.
METRALE_HD std::uint16_t f32_to_bf16(float f) {
  const std::uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

// ---- FP16 (IEEE binary16: the scales of GPTQ and AWQ checkpoints) ----

// FP16 bits to float (exact; subnormals, infinities and NaN included).
METRALE_HD float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal: man x 2^-24, exact in float.
  const float mag = static_cast<float>(man) * bits_f32(0x33800000u);
  return sign != 0 ? -mag : mag;
}

// Float to FP16 bits, round to nearest even; overflow to infinity; NaN stays a quiet NaN.
METRALE_HD std::uint16_t f32_to_f16(float f) {
  const std::uint32_t u = f32_bits(f);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (mag >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (mag < 0x38800000u) {
    // Below FP16's smallest normal (2^-14): a multiple of 2^-24, rounded to nearest even by the
    // float addition of 0.5 (2^-1 has its unit in the last place at 2^-24).
    const float scaled = bits_f32(mag) + 0.5f;
    return static_cast<std::uint16_t>(sign | (f32_bits(scaled) - 0x3f000000u));
  }
  const std::uint32_t rounded = mag + 0xfffu + ((mag >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

// ---- FP8 E4M3 (fn) ----

inline constexpr float kE4m3Max = 448.0f;

// E4M3 bits to float (exact). 0x7F and 0xFF are NaN.
METRALE_HD float e4m3_to_f32(std::uint8_t v) {
  const std::uint32_t sign = std::uint32_t{v & 0x80u} << 24;
  const std::uint32_t exp = (v >> 3) & 0xFu;
  const std::uint32_t man = v & 0x7u;
  if (exp == 0xF && man == 0x7) return bits_f32(sign | 0x7fc00000u);
  if (exp == 0) {
    // Subnormal: man × 2^-9, exact in float.
    const float mag = static_cast<float>(man) * 0.001953125f;
    return sign ? -mag : mag;
  }
  return bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

// Float to E4M3 bits: round to nearest even, saturating to ±448 (also for ±inf); NaN → NaN
// (0x7F, or 0xFF with the sign). This is the cast of the w4a16 module's bf16_to_fp8: no scale.
METRALE_HD std::uint8_t f32_to_e4m3(float f) {
  const std::uint32_t u = f32_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7F);
  // 464 is halfway between 448 (0x7E) and the would-be 480; RNE past it saturates anyway.
  if (a >= 0x43E00000u) return static_cast<std::uint8_t>(sign | 0x7E);  // >= 448
  if (a < 0x3C800000u) {
    // Below 2^-6: subnormal grid of 2^-9. Round |f| / 2^-9 to nearest even integer (0..8).
    const float scaled = bits_f32(a) * 512.0f;  // exact: a power-of-two scale
    std::uint32_t q = static_cast<std::uint32_t>(scaled);
    const float frac = scaled - static_cast<float>(q);
    if (frac > 0.5f || (frac == 0.5f && (q & 1u))) ++q;
    return static_cast<std::uint8_t>(sign | q);  // q == 8 is the smallest normal, 0x08
  }
  // Normal: keep 3 mantissa bits with round to nearest even on the 20 dropped bits.
  const std::uint32_t exp = (a >> 23) - 120u;  // 1..15
  std::uint32_t man = (a >> 20) & 0x7u;
  const std::uint32_t rest = a & 0xFFFFFu;
  std::uint32_t code = (exp << 3) | man;
  if (rest > 0x80000u || (rest == 0x80000u && (man & 1u))) ++code;
  if (code > 0x7E) code = 0x7E;  // rounding up into the NaN pattern saturates instead
  return static_cast<std::uint8_t>(sign | code);
}

// The E4M3 cast (docs/CONTRACT.md, E4M3 cast): BF16 bits to E4M3 bits, RNE, saturating, no scale.
METRALE_HD std::uint8_t bf16_to_e4m3(std::uint16_t h) {
  return f32_to_e4m3(bf16_to_f32(h));
}

// ---- FP4 E2M1 ----

// E2M1 code (low 4 bits: sign, 2 exponent, 1 mantissa) to float: ±{0, .5, 1, 1.5, 2, 3, 4, 6}.
METRALE_HD float e2m1_to_f32(std::uint8_t code) {
  // Built from the bits rather than a table: a local table indexed at run time lands in GPU
  // local memory. c = (e1 e0 m): e = 0 gives 0 or 0.5; otherwise (1 + m/2) · 2^(e − 1).
  const std::uint32_t c = code & 7u;
  const std::uint32_t bits =
      c < 2 ? (c ? 0x3F000000u : 0u) : (((c >> 1) + 126u) << 23) | ((c & 1u) << 22);
  const float m = bits_f32(bits);
  return (code & 8u) ? -m : m;
}

// Float to the nearest E2M1 code, ties to the even code, saturating to ±6; NaN → +0 (FP4 has no
// NaN; quantizers never feed it one).
METRALE_HD std::uint8_t f32_to_e2m1(float f) {
  const std::uint8_t sign = (f32_bits(f) >> 28) & 8u;
  const float a = f < 0 ? -f : f;
  if (!(a == a)) return 0;
  // Midpoints between neighbours: .25 .75 1.25 1.75 2.5 3.5 5; at a tie the even code wins.
  std::uint8_t c;
  if (a <= 0.25f)
    c = 0;
  else if (a < 0.75f)
    c = 1;
  else if (a <= 1.25f)
    c = 2;
  else if (a < 1.75f)
    c = 3;
  else if (a <= 2.5f)
    c = 4;
  else if (a < 3.5f)
    c = 5;
  else if (a <= 5.0f)
    c = 6;
  else
    c = 7;
  return static_cast<std::uint8_t>(sign | c);
}

// ---- E8M0 ----

// E8M0 scale to float: 2^(e - 127); 0xFF is NaN.
METRALE_HD float e8m0_to_f32(std::uint8_t e) {
  if (e == 0xFF) return bits_f32(0x7fc00000u);
  if (e == 0) return bits_f32(0x00400000u);  // 2^-127, a float subnormal
  return bits_f32(std::uint32_t{e} << 23);
}

// ---- block layouts ----

inline constexpr int kNvfp4Group = 16;  // K elements per E4M3 block scale
inline constexpr int kMxfp4Group = 32;  // K elements per E8M0 block scale

// The E2M1 code of element k of a packed row (two per byte, low nibble = even k).
METRALE_HD std::uint8_t packed_code(const std::uint8_t* row, std::int64_t k) {
  const std::uint8_t byte = row[k >> 1];
  return (k & 1) ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
}

// ---- packed conversions of the GPU kernels (one code path, host-tested) ----

// Byte i of the result is byte ((s >> 4i) & 7) of the 8 bytes y:x (x is bytes 0-3): CUDA's
// __byte_perm (one PRMT) on the device, the same selection on the host.
METRALE_HD std::uint32_t byte_perm(std::uint32_t x, std::uint32_t y, std::uint32_t s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const std::uint64_t v = (std::uint64_t{y} << 32) | x;
  std::uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned at = 8u * ((s >> (4 * i)) & 7u);
    r |= static_cast<std::uint32_t>((v >> at) & 0xFFu) << (8 * i);
  }
  return r;
#endif
}

// Four E2M1 codes, the nibbles of w (lowest first), as four BF16 values in two words (element 0
// in the low half of *p01, element 2 in the low half of *p23). Exact. The high and low bytes of
// the 8 magnitudes' BF16 patterns are tables of 8 bytes that two byte permutes index with the
// codes' low 3 bits; two more interleave them, and the sign bits are moved up: a few
// instructions per 4 values on a GPU, against ~8 per value through e2m1_to_f32 and a conversion.
METRALE_HD void e2m1x4_to_bf16(std::uint32_t w, std::uint32_t* p01, std::uint32_t* p23) {
  // BF16 of ±{0, .5, 1, 1.5, 2, 3, 4, 6}: 0000 3F00 3F80 3FC0 4000 4040 4080 40C0.
  constexpr std::uint32_t kHigh03 = 0x3F3F3F00u, kHigh47 = 0x40404040u;
  constexpr std::uint32_t kLow03 = 0xC0800000u, kLow47 = 0xC0804000u;
  const std::uint32_t sel = w & 0x7777u;
  const std::uint32_t high = byte_perm(kHigh03, kHigh47, sel);
  const std::uint32_t low = byte_perm(kLow03, kLow47, sel);
  // The four sign bits (3, 7, 11, 15) to bits 15 and 31 of each pair by one multiply each (two
  // shifts at once): the other bits the products set lie outside 0x80008000, and the only two
  // that meet (bit 27 of the first, bit 19 of the second) carry into a bit that is masked too.
  const std::uint32_t signs = w & 0x8888u;
  *p01 = byte_perm(low, high, 0x5140u) | ((signs * 0x01001000u) & 0x80008000u);
  *p23 = byte_perm(low, high, 0x7362u) | ((signs * 0x00010010u) & 0x80008000u);
}

// Four E4M3 codes, the bytes of w (lowest first), as four FP16 values each 2^-8 times the code's
// value, in two words (codes 0 and 2 in the halves of *p02, 1 and 3 in *p13). Exact: FP16 has
// E4M3's 3 mantissa bits and 5 exponent bits to its 4, so the code's bits moved one place right
// inside a half are an FP16 of bias 15 where E4M3's is 7 (subnormals land on FP16 subnormals of
// the same ratio). Three or four integer instructions per pair; the NaN codes (0x7F, 0xFF) come
// out as ±480 · 2^-8, so callers keep NaN out of the codes or restore it themselves.
METRALE_HD void e4m3x4_to_f16_scaled(std::uint32_t w, std::uint32_t* p02, std::uint32_t* p13) {
  *p13 = (w & 0x80008000u) | ((w & 0x7F007F00u) >> 1);
  const std::uint32_t lo = w << 8;
  *p02 = (lo & 0x80008000u) | ((lo & 0x7F007F00u) >> 1);
}

// The two FP16 values of a pair (low half first) as floats, exactly (two conversions on the
// device).
METRALE_HD void f16x2_to_f32(std::uint32_t h, float* lo, float* hi) {
#if defined(__CUDA_ARCH__)
  __half2 x;
  std::memcpy(&x, &h, 4);
  const float2 f = __half22float2(x);
  *lo = f.x;
  *hi = f.y;
#else
  *lo = f16_to_f32(static_cast<std::uint16_t>(h));
  *hi = f16_to_f32(static_cast<std::uint16_t>(h >> 16));
#endif
}

// A BF16 pair times a BF16 pair, element by element, rounded to nearest even (one HMUL2 on the
// device). The kernels multiply E2M1 values by block scales, where the product is exact.
METRALE_HD std::uint32_t bf16x2_mul(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  const __nv_bfloat162 r = __hmul2(x, y);
  std::uint32_t out;
  std::memcpy(&out, &r, 4);
  return out;
#else
  const auto half = [](std::uint32_t v, int i) {
    return bf16_to_f32(static_cast<std::uint16_t>(v >> (16 * i)));
  };
  return std::uint32_t{f32_to_bf16(half(a, 0) * half(b, 0))} |
         std::uint32_t{f32_to_bf16(half(a, 1) * half(b, 1))} << 16;
#endif
}

// A BF16 pair minus a BF16 pair, element by element, rounded to nearest even (one BF16x2
// subtraction on the device). The INT4 kernels subtract 128 + z from 128 + q, where it is exact.
METRALE_HD std::uint32_t bf16x2_sub(std::uint32_t a, std::uint32_t b) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  const __nv_bfloat162 r = __hsub2(x, y);
  std::uint32_t out;
  std::memcpy(&out, &r, 4);
  return out;
#else
  const auto half = [](std::uint32_t v, int i) {
    return bf16_to_f32(static_cast<std::uint16_t>(v >> (16 * i)));
  };
  return std::uint32_t{f32_to_bf16(half(a, 0) - half(b, 0))} |
         std::uint32_t{f32_to_bf16(half(a, 1) - half(b, 1))} << 16;
#endif
}

// a x b + c on BF16 pairs, element by element, rounded once to nearest even (one BF16x2 FMA on
// the device). The host computes a x b + c in FP32 and rounds that to BF16: one rounding wherever
// the FP32 result is exact, as in its one use, (q - z) times the two parts of an FP16 scale
// (gemm_grouped_int4_fused: 5 + 11 significant bits).
METRALE_HD std::uint32_t bf16x2_fma(std::uint32_t a, std::uint32_t b, std::uint32_t c) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat162 x, y, z;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  std::memcpy(&z, &c, 4);
  const __nv_bfloat162 r = __hfma2(x, y, z);
  std::uint32_t out;
  std::memcpy(&out, &r, 4);
  return out;
#else
  const auto half = [](std::uint32_t v, int i) {
    return bf16_to_f32(static_cast<std::uint16_t>(v >> (16 * i)));
  };
  return std::uint32_t{f32_to_bf16(half(a, 0) * half(b, 0) + half(c, 0))} |
         std::uint32_t{f32_to_bf16(half(a, 1) * half(b, 1) + half(c, 1))} << 16;
#endif
}

// A block scale as the BF16 pair (s, s) the kernels multiply code pairs by; exact for every
// E4M3 scale (3 mantissa bits) and every E8M0 scale in BF16's range.
METRALE_HD std::uint32_t bf16_pair_of(float scale) {
  const std::uint32_t b = f32_to_bf16(scale);
  return b | (b << 16);
}

}  // namespace metrale::num
