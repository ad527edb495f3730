// The W8A8 op (ops/fp8_gemm.h) on the CUDA backend over the fake driver and the fake cuBLASLt:
// the activation cast as a fake "fp8" module whose body is the CPU twin (cpu/kernels/fp8_cpu.h,
// the same rules as fp8.cu), covering exactly the pairs of the grid it is launched with, then
// the dense GEMM on the fake library, which reads the scales with cuBLASLt's padded leading
// dimensions. M and ceil(K/128) off multiples of 4 (decode's M = 1 among them) must run and
// match the float64 reference, C poisoned first. The bound is tests/ops/fp8_gemm_test.cpp's
// against the cast-aware reference: the fake accumulates in FP32 as the CPU reference does.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "cpu/kernels/fp8_cpu.h"
#include "cuda/fake_blas.h"
#include "cuda/rig.h"
#include "kernels/fp8_cast.h"
#include "metrale/numerics.h"
#include "metrale/ops/fp8_gemm.h"
#include "support/fp8_reference.h"

namespace metrale::cuda::testing {
namespace {

namespace f8 = metrale::testing::fp8;

constexpr std::uint32_t kCastTile = 8;  // pairs per block, as fp8.cu's 8 warps
constexpr std::uint32_t kCastThreads = 256;
constexpr std::uint16_t kPoison = 0x7FC1;  // a BF16 NaN no GEMM writes

// Module "fp8": cast_e4m3_block128 with the CPU twin's body, block bx casting the pairs
// [bx·tile, bx·tile + tile) below M·ceil(K/128). A grid sized from a wrong tile leaves pairs
// uncast (their scales unwritten, their outputs wrong).
ModuleSpec fp8_module() {
  ModuleSpec m;
  m.name = "fp8";
  FakeFunction cast;
  cast.param_sizes = {sizeof(Fp8CastParams)};
  cast.body = [](const FakeLaunch& l) {
    const auto p = read_param<Fp8CastParams>(l.params, 0);
    const std::int64_t pairs = p.m * ((p.k + fp8::kCastBlock - 1) / fp8::kCastBlock);
    for (std::int64_t bx = 0; bx < l.grid[0]; ++bx) {
      const std::int64_t i0 = bx * kCastTile, i1 = std::min<std::int64_t>(pairs, i0 + kCastTile);
      if (i0 < i1) cpu::fp8::cast_e4m3_block128(p, i0, i1);
    }
  };
  m.fake.functions["cast_e4m3_block128"] = cast;
  m.fake.publish_u32("cast_e4m3_block128_n_tile", kCastTile)
      .publish_u32("cast_e4m3_block128_block_threads", kCastThreads);
  m.entries = {"cast_e4m3_block128"};
  return m;
}

// A fake cuBLASLt, then a fake sm_90 driver whose modules are "core" and "fp8".
struct W8a8Rig {
  W8a8Rig() : rig(options(fb)) {}
  static RigOptions options(const FakeBlas& fb) {
    RigOptions o;
    o.modules = {core_module(), fp8_module()};
    for (ModuleSpec& m : o.modules) m.targets = {"sm_90"};
    o.blas = fb.source();
    return o;
  }
  CudaBackend& b() { return rig.b(); }

  FakeBlas fb;
  Rig rig;
};

struct Problem {
  std::int64_t m, n, k;
  bool bias;
};

// One w8a8_gemm of s on the rig, every element against the cast-aware float64 reference.
void check_problem(W8a8Rig& r, const Problem& s, std::mt19937_64& gen) {
  SCOPED_TRACE(fmt::format("M={} N={} K={} bias={}", s.m, s.n, s.k, s.bias));
  CudaBackend& b = r.b();
  const f8::HostFp8Weights hw = f8::random_weights(s.n, s.k, gen);
  ops::Fp8Weights w = ops::upload_fp8_weights(b, hw.codes, hw.scale_bytes(), s.n, s.k);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> e(-8, 2);
  std::vector<std::uint16_t> ha(static_cast<std::size_t>(s.m * s.k)),
      hbias(static_cast<std::size_t>(s.n));
  for (auto& x : ha) x = num::f32_to_bf16(std::ldexp(u(gen), e(gen)));
  for (auto& x : hbias) x = num::f32_to_bf16(u(gen));
  const DevicePtr a = b.alloc(ha.size() * 2), c = b.alloc(static_cast<std::size_t>(s.m * s.n) * 2),
                  bias = s.bias ? b.alloc(hbias.size() * 2) : DevicePtr{};
  b.copy_h2d(a, ha.data(), ha.size() * 2);
  if (s.bias) b.copy_h2d(bias, hbias.data(), hbias.size() * 2);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(s.m * s.n), kPoison);
  b.copy_h2d(c, out.data(), out.size() * 2);

  ops::w8a8_gemm(b, b.default_stream(), a, s.m, w, c, bias);
  b.synchronize(b.default_stream());
  b.copy_d2h(out.data(), c, out.size() * 2);

  const f8::CastA a8 = f8::cast_a(ha, s.m, s.k);
  const double gamma = static_cast<double>(s.k + 2 * f8::blocks(s.k) + 8) * std::ldexp(1.0, -23);
  const double u8 = std::ldexp(1.0, -8);
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < s.n; ++j) {
      const double bv = s.bias ? num::bf16_to_f32(hbias[static_cast<std::size_t>(j)]) : 0.0;
      double ref8 = bv, s8 = std::fabs(bv);
      for (std::int64_t q = 0; q < s.k; ++q) {
        const double p = a8.value[static_cast<std::size_t>(i * s.k + q)] * hw.at(j, q);
        ref8 += p;
        s8 += std::fabs(p);
      }
      const std::uint16_t bits = out[static_cast<std::size_t>(i * s.n + j)];
      ASSERT_NE(bits, kPoison) << "C[" << i << ", " << j << "] was not written";
      const double got = num::bf16_to_f32(bits);
      ASSERT_TRUE(std::isfinite(got)) << "C[" << i << ", " << j << "] = " << got;
      ASSERT_LE(std::fabs(got - ref8), u8 * std::fabs(ref8) + (1 + u8) * gamma * s8)
          << "C[" << i << ", " << j << "] = " << got << ", aware reference " << ref8;
    }
  }
  for (DevicePtr p : {a, c, bias}) {
    if (p) b.free(p);
  }
  ops::free_fp8_weights(b, w);
}

TEST(W8a8OnFakeCuda, PaddedScaleShapesRunAndMatchTheFloat64Reference) {
  W8a8Rig r;
  ASSERT_EQ(r.b().dense_gemm_unavailable(DenseKind::kE4m3Block128), "");
  std::mt19937_64 gen(20261201);
  // M % 4 != 0 pads the cast's scales (and the library's rows), ceil(K/128) % 4 != 0 the
  // weights'; {4, 64, 512} neither. N and K meet cuBLAS's FP8 rules (N % 8, K % 16), partial
  // 128-blocks among them.
  for (const Problem& s :
       {Problem{1, 296, 208, false}, Problem{1, 64, 128, true}, Problem{5, 136, 304, true},
        Problem{3, 40, 704, false}, Problem{4, 64, 512, true}, Problem{9, 136, 144, false}}) {
    check_problem(r, s, gen);
  }
  EXPECT_EQ(r.fb.calls("cublasLtMatmul"), 6u);
}

}  // namespace
}  // namespace metrale::cuda::testing
