// dequant_bf16's own CUDA source (cuda/kernels/dequant_bf16.cuh) run on the host, every thread of
// the grid the op launches, on both formats and source layouts with tails (K and N·K not
// multiples of 32): each weight bit for bit against its exact value rounded once to BF16 in
// double (the host's arithmetic, not kernels/dequant_bf16.h's), nothing written past W, and every
// 16- and 8-byte code load inside the codes and aligned. This is what checks the GPU kernel's
// pointer math per unit without a GPU (the CPU twin has its own).
#include "cuda_host.h"  // first: the CUDA language on the host

#include "cuda/kernels/dequant_bf16.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/dequant_bf16.h"
#include "kernels/gemm_params.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"

namespace metrale {
namespace {

namespace emu = metrale::emulation;

constexpr unsigned kThreads = 256;  // w4a16.cu's dequant_bf16 block
constexpr std::uint16_t kPoison = 0x7FC1;

std::uint16_t exact_bf16(double x) {
  if (x == 0.0) return std::signbit(x) ? 0x8000 : 0x0000;
  int e = 0;
  const double frac = std::frexp(x, &e);
  const double r = std::ldexp(std::nearbyint(std::ldexp(frac, 8)), e - 8);
  return static_cast<std::uint16_t>(num::f32_bits(static_cast<float>(r)) >> 16);
}

TEST(DequantBf16Host, EveryUnitOfTheGridIsBitExact) {
  std::mt19937_64 rng(20261201);
  for (const bool mx : {false, true}) {
    for (const bool transposed : {false, true}) {
      for (const auto& [n, k] :
           {std::pair<std::int64_t, std::int64_t>{1, 32}, {5, 96}, {33, 48}, {300, 160}}) {
        if (mx && k % 32 != 0) continue;
        SCOPED_TRACE(std::string(mx ? "mxfp4" : "nvfp4") + (transposed ? " transposed " : " ") +
                     std::to_string(n) + "x" + std::to_string(k));
        const int group = mx ? num::kMxfp4Group : num::kNvfp4Group;
        std::vector<std::uint8_t> codes(static_cast<std::size_t>(n * k / 2)),
            scales(static_cast<std::size_t>(n * k / group));
        std::uniform_int_distribution<int> byte(0, 255), nv(0x18, 0x60), e8(110, 140);
        for (auto& c : codes) c = static_cast<std::uint8_t>(byte(rng));
        for (auto& s : scales) s = static_cast<std::uint8_t>(mx ? e8(rng) : nv(rng));
        const float ts = 0.0123f;
        std::vector<std::uint16_t> out(static_cast<std::size_t>(n * k) + 64, kPoison);
        GemmParams p;
        p.codes = reinterpret_cast<std::uintptr_t>(codes.data());
        p.scales = reinterpret_cast<std::uintptr_t>(scales.data());
        p.out = reinterpret_cast<std::uintptr_t>(out.data());
        p.n = n;
        p.k = k;
        p.tensor_scale = ts;
        p.flags = (mx ? kGemmMxfp4 : 0u) | (transposed ? kGemmTransposed : 0u);
        const auto units = static_cast<unsigned>(dequant::unit_count(n, k));
        const dim3 grid((units + kThreads - 1) / kThreads);
        const std::string error =
            emu::run_grid(grid, kThreads, {{codes.data(), codes.size()}}, [&p] {
              kernels::dequant_bf16_unit(p, std::int64_t{blockIdx.x} * kThreads + threadIdx.x);
            });
        ASSERT_EQ(error, "");
        std::int64_t wrong = 0;
        for (std::int64_t r = 0; r < n; ++r) {
          for (std::int64_t c = 0; c < k; ++c) {
            const std::uint8_t byte_ = transposed ? codes[std::size_t((c / 2) * n + r)]
                                                  : codes[std::size_t(r * (k / 2) + c / 2)];
            const auto code = static_cast<std::uint8_t>((c & 1) ? byte_ >> 4 : byte_ & 0xF);
            const std::int64_t g = c / group;
            const std::uint8_t s = transposed ? scales[std::size_t(g * n + r)]
                                              : scales[std::size_t(r * (k / group) + g)];
            const double scale = mx ? num::e8m0_to_f32(s) : num::e4m3_to_f32(s);
            const std::uint16_t want =
                exact_bf16(double{num::e2m1_to_f32(code)} * scale * double{ts});
            const std::uint16_t got = out[std::size_t(r * k + c)];
            if (got != want && wrong++ < 5) {
              ADD_FAILURE() << "W[" << r << ", " << c << "] = 0x" << std::hex << got << ", want 0x"
                            << want;
            }
          }
        }
        EXPECT_EQ(wrong, 0);
        for (std::size_t i = static_cast<std::size_t>(n * k); i < out.size(); ++i) {
          EXPECT_EQ(out[i], kPoison) << "written past W at " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace metrale
