// Element-wise ops on the CPU backend: fill_u32 and axpy_f32 on random data over sizes around
// the published tiles, argument checks that launch nothing, and the grid-size rule (the grid
// comes from the kernel's published N tile, never from an assumed width).
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/host_module.h"
#include "metrale/kernel_args.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/read_back.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using testing::read;

constexpr std::uint32_t kPoison = 0xABABABABu;  // what memset(0xAB) leaves in a uint32
constexpr std::size_t kTail = 37;               // elements past n that no op may touch

// n uint32 elements (plus the tail) filled with 0xAB bytes.
DevicePtr poisoned(Backend& b, std::size_t n) {
  const DevicePtr p = b.alloc((n + kTail) * 4);
  b.memset(p, 0xAB, (n + kTail) * 4);
  return p;
}

std::size_t count_poisoned(const std::vector<std::uint32_t>& v) {
  return static_cast<std::size_t>(std::count(v.begin(), v.end(), kPoison));
}

std::uint64_t fresh_seed() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) | rd();
}

// Sizes around a tile, non-powers of two, and one above a million.
std::vector<std::size_t> sizes_around(std::size_t tile) {
  return {1,    2,    3,     tile - 1, tile,   tile + 1, 2 * tile - 1, 2 * tile + 3,
          1000, 4099, 65537, 99991,    1000003};
}

TEST(FillU32, WritesEveryElementAndNothingPastN) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  const std::uint32_t tile = b.kernel_n_tile(b.op_cache().kernel(b, "core", "fill_u32"));
  ASSERT_GT(tile, 1u);
  for (std::size_t n : sizes_around(tile)) {
    std::uint32_t value = static_cast<std::uint32_t>(gen());
    if (value == kPoison) value ^= 1u;
    const DevicePtr out = poisoned(b, n);
    ops::fill_u32(b, s, out, n, value);
    const std::vector<std::uint32_t> got = read<std::uint32_t>(b, out, n + kTail);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i) wrong += got[i] != value;
    EXPECT_EQ(wrong, 0u) << "n = " << n << ": elements not set to " << value;
    EXPECT_EQ(std::vector<std::uint32_t>(got.begin() + static_cast<std::ptrdiff_t>(n), got.end()),
              std::vector<std::uint32_t>(kTail, kPoison))
        << "n = " << n << ": wrote past the end";
    b.free(out);
  }
  b.destroy_stream(s);
}

// y in [2, 3], |x| in [0.25, 1], |a| in [0.5, 1.5]: no cancellation, so every element's float
// error is below 3e-7 relative, and an element left unwritten is off by at least 0.125.
struct AxpyData {
  float a;
  std::vector<float> x, y;
};

AxpyData random_axpy(std::mt19937_64& gen, std::size_t n) {
  std::uniform_real_distribution<float> mag(0.25f, 1.0f), ys(2.0f, 3.0f), as(0.5f, 1.5f);
  std::bernoulli_distribution neg(0.5);
  AxpyData d;
  d.a = neg(gen) ? -as(gen) : as(gen);
  d.x.resize(n);
  d.y.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    d.x[i] = neg(gen) ? -mag(gen) : mag(gen);
    d.y[i] = ys(gen);
  }
  return d;
}

TEST(AxpyF32, MatchesAFloat64ReferenceAndWritesNothingPastN) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  const std::uint32_t tile = b.kernel_n_tile(b.op_cache().kernel(b, "core", "axpy_f32"));
  ASSERT_GT(tile, 1u);
  for (std::size_t n : sizes_around(tile)) {
    const AxpyData d = random_axpy(gen, n);
    const DevicePtr y = poisoned(b, n);  // the tail stays poisoned
    const DevicePtr x = poisoned(b, n);
    b.copy_h2d(y, d.y.data(), n * 4);
    b.copy_h2d(x, d.x.data(), n * 4);
    ops::axpy_f32(b, s, y, x, d.a, n);
    const std::vector<float> out = read<float>(b, y, n);
    double err2 = 0.0, ref2 = 0.0, worst = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      const double ref = double{d.a} * double{d.x[i]} + double{d.y[i]};
      const double diff = double{out[i]} - ref;
      err2 += diff * diff;
      ref2 += ref * ref;
      worst = std::max(worst, std::abs(diff) / std::abs(ref));
    }
    EXPECT_LE(std::sqrt(err2) / std::sqrt(ref2), 1e-6) << "n = " << n;
    EXPECT_LE(worst, 1e-6) << "n = " << n << ": some element is wrong or unwritten";
    const std::vector<std::uint32_t> tail = read<std::uint32_t>(b, y.offset(n * 4), kTail);
    EXPECT_EQ(tail, std::vector<std::uint32_t>(kTail, kPoison)) << "n = " << n;
    // x is read only.
    EXPECT_EQ(read<float>(b, x, n), d.x) << "n = " << n;
    b.free(y);
    b.free(x);
  }
  b.destroy_stream(s);
}

// The cast's BF16 is the nearest-even rounding of each float, within 2^-8 of it (against
// float64), with NaN staying NaN and infinities kept; nothing past n is written, in is read only.
TEST(CastF32ToBf16, RoundsEachElementOnceAndWritesNothingPastN) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  CpuBackend b;
  const StreamHandle s = b.create_stream();
  const std::uint32_t tile = b.kernel_n_tile(b.op_cache().kernel(b, "core", "cast_f32_bf16"));
  ASSERT_GT(tile, 1u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> octave(-60, 60);
  for (std::size_t n : sizes_around(tile)) {
    std::vector<float> x(n);
    for (float& v : x) v = std::ldexp(normal(gen), octave(gen));
    if (n > 3) {
      x[0] = std::nanf("");
      x[1] = std::numeric_limits<float>::infinity();
      x[2] = -0.0f;
    }
    const DevicePtr in = poisoned(b, n);
    const DevicePtr out = poisoned(b, n);  // 4n bytes: its back half and the tail stay poisoned
    b.copy_h2d(in, x.data(), n * 4);
    ops::cast_f32_to_bf16(b, s, in, out, n);
    const std::vector<std::uint16_t> got = read<std::uint16_t>(b, out, n);
    for (std::size_t i = 0; i < n; ++i) {
      const float y = num::bf16_to_f32(got[i]);
      if (std::isnan(x[i])) {
        EXPECT_TRUE(std::isnan(y)) << "element " << i;
        continue;
      }
      if (std::isinf(x[i])) {
        EXPECT_EQ(y, x[i]) << "element " << i;
        continue;
      }
      ASSERT_LE(std::abs(double{y} - double{x[i]}), std::ldexp(std::abs(double{x[i]}), -8))
          << "element " << i << " of n = " << n << ": " << x[i] << " became " << y;
      ASSERT_EQ(got[i], num::f32_to_bf16(x[i])) << "element " << i;
    }
    EXPECT_EQ(read<std::uint16_t>(b, out.offset(n * 2), n), std::vector<std::uint16_t>(n, 0xABAB))
        << "n = " << n << ": written past n";
    const std::vector<float> in_after = read<float>(b, in, n);  // in is read only
    EXPECT_EQ(std::memcmp(in_after.data(), x.data(), n * 4), 0) << "n = " << n;
    b.free(in);
    b.free(out);
  }
  b.destroy_stream(s);
}

TEST(CastF32ToBf16, BadArgumentsThrowAndWriteNothing) {
  CpuBackend b;
  const DevicePtr in = poisoned(b, 64), out = poisoned(b, 64);
  const StreamHandle s = b.default_stream();
  EXPECT_THAT(expect_error([&] { ops::cast_f32_to_bf16(b, s, DevicePtr{}, out, 8); }).what(),
              HasSubstr("in is null"));
  EXPECT_THAT(expect_error([&] { ops::cast_f32_to_bf16(b, s, in, out.offset(1), 8); }).what(),
              HasSubstr("not 2-byte aligned"));
  EXPECT_THAT(expect_error([&] { ops::cast_f32_to_bf16(b, s, in, out, 0); }).what(),
              HasSubstr("n = 0"));
  EXPECT_THAT(expect_error([&] { ops::cast_f32_to_bf16(b, s, in, in.offset(8), 8); }).what(),
              HasSubstr("overlap"));
  EXPECT_EQ(read<std::uint32_t>(b, out, 64 + kTail),
            std::vector<std::uint32_t>(64 + kTail, kPoison));
  b.free(in);
  b.free(out);
}

TEST(AxpyF32, AdjacentBuffersAreNotAnOverlap) {
  CpuBackend b;
  constexpr std::size_t n = 500;
  const DevicePtr both = b.alloc(2 * n * 4);
  std::vector<float> host(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    host[i] = 1.0f;                           // y
    host[n + i] = static_cast<float>(i % 5);  // x
  }
  b.copy_h2d(both, host.data(), host.size() * 4);
  ops::axpy_f32(b, b.default_stream(), both, both.offset(n * 4), 2.0f, n);
  const std::vector<float> got = read<float>(b, both, 2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(got[i], 1.0f + 2.0f * static_cast<float>(i % 5)) << i;
    ASSERT_EQ(got[n + i], static_cast<float>(i % 5)) << i;
  }
  b.free(both);
}

// An op whose arguments are bad throws before it looks up or launches anything.
void expect_rejected_before_launch(CpuBackend& b, const Error& e, const std::string& api,
                                   const std::string& words) {
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << words;
  EXPECT_THAT(e.what(), HasSubstr("[" + api + "] " + words));
  EXPECT_TRUE(b.lookup_audit().empty()) << words;
  EXPECT_EQ(b.op_cache().kernel_count(), 0u) << words;
}

TEST(FillU32, BadArgumentsThrowAndWriteNothing) {
  CpuBackend b;
  constexpr std::size_t n = 300;
  const DevicePtr out = poisoned(b, n);
  const StreamHandle s = b.default_stream();
  expect_rejected_before_launch(b, expect_error([&] { ops::fill_u32(b, s, DevicePtr{}, n, 1u); }),
                                "fill_u32", "out is null");
  expect_rejected_before_launch(
      b, expect_error([&] { ops::fill_u32(b, s, out.offset(2), n, 1u); }), "fill_u32",
      fmt::format("out = 0x{:x} is not 4-byte aligned", out.offset(2).address()));
  expect_rejected_before_launch(b, expect_error([&] { ops::fill_u32(b, s, out, 0, 1u); }),
                                "fill_u32", "n = 0 is outside [1, 2^32 - 1]");
  expect_rejected_before_launch(
      b, expect_error([&] { ops::fill_u32(b, s, out, std::size_t{1} << 32, 1u); }), "fill_u32",
      "n = 4294967296 is outside [1, 2^32 - 1]");
  EXPECT_EQ(count_poisoned(read<std::uint32_t>(b, out, n + kTail)), n + kTail);
  b.free(out);
}

TEST(AxpyF32, BadArgumentsThrowAndWriteNothing) {
  CpuBackend b;
  constexpr std::size_t n = 300;
  // y has room for 2n elements so that every overlapping (x, y) pair below lies inside it.
  const DevicePtr y = poisoned(b, 2 * n);
  const DevicePtr x = poisoned(b, n);
  const StreamHandle s = b.default_stream();
  auto axpy = [&](DevicePtr yy, DevicePtr xx, std::size_t nn) {
    return expect_error([&] { ops::axpy_f32(b, s, yy, xx, 1.5f, nn); });
  };
  expect_rejected_before_launch(b, axpy(DevicePtr{}, x, n), "axpy_f32", "y is null");
  expect_rejected_before_launch(b, axpy(y, DevicePtr{}, n), "axpy_f32", "x is null");
  expect_rejected_before_launch(
      b, axpy(y.offset(2), x, n), "axpy_f32",
      fmt::format("y = 0x{:x} is not 4-byte aligned", y.offset(2).address()));
  expect_rejected_before_launch(
      b, axpy(y, x.offset(2), n), "axpy_f32",
      fmt::format("x = 0x{:x} is not 4-byte aligned", x.offset(2).address()));
  expect_rejected_before_launch(b, axpy(y, x, 0), "axpy_f32", "n = 0 is outside [1, 2^32 - 1]");
  expect_rejected_before_launch(b, axpy(y, y, n), "axpy_f32",
                                fmt::format("x = 0x{:x} and y = 0x{:x} overlap over {} bytes",
                                            y.address(), y.address(), n * 4));
  // Partial overlaps either way round.
  expect_rejected_before_launch(b, axpy(y, y.offset(4), n), "axpy_f32", "x = ");
  expect_rejected_before_launch(b, axpy(y.offset(n * 4 - 4), y, n), "axpy_f32", "x = ");
  EXPECT_EQ(count_poisoned(read<std::uint32_t>(b, y, 2 * n + kTail)), 2 * n + kTail);
  EXPECT_EQ(count_poisoned(read<std::uint32_t>(b, x, n + kTail)), n + kTail);
  b.free(y);
  b.free(x);
}

// A fill_u32 kernel whose blocks each write 64 elements, as a narrower GPU build would.
constexpr std::uint32_t kNarrowTile = 64;

void fill_u32_narrow(const HostBlock& b) {
  auto* out = reinterpret_cast<std::uint32_t*>(
      static_cast<std::uintptr_t>(read_param<std::uint64_t>(b.params, 0)));
  const auto value = read_param<std::uint32_t>(b.params, 1);
  const auto n = read_param<std::uint32_t>(b.params, 2);
  const std::uint64_t begin = std::uint64_t{b.block_idx.x} * kNarrowTile;
  const std::uint64_t end = std::min<std::uint64_t>(n, begin + kNarrowTile);
  for (std::uint64_t i = begin; i < end; ++i) out[i] = value;
}

// A backend whose module "core" has that kernel, publishing `tile` (or nothing when absent)
// and its block size (the launcher reads it as it reads the tile).
CpuBackendOptions narrow_core(std::optional<std::uint32_t> tile) {
  HostModule core("core");
  core.add_kernel("fill_u32", fill_u32_narrow, {8, 4, 4})
      .publish_u32("fill_u32_block_threads", kNarrowTile);
  if (tile) core.publish_u32("fill_u32_n_tile", *tile);
  CpuBackendOptions o;
  o.modules.clear();
  o.modules.push_back(std::move(core));
  return o;
}

TEST(GridSizing, TheOpSizesItsGridFromThePublishedTile) {
  CpuBackend b(narrow_core(kNarrowTile));
  const ResolvedKernel& k = b.op_cache().kernel(b, "core", "fill_u32");
  ASSERT_EQ(b.kernel_n_tile(k), kNarrowTile);
  for (std::size_t n : {std::size_t{1}, std::size_t{63}, std::size_t{64}, std::size_t{65},
                        std::size_t{1000}, std::size_t{100003}}) {
    const DevicePtr out = poisoned(b, n);
    ops::fill_u32(b, b.default_stream(), out, n, 5u);
    const std::vector<std::uint32_t> got = read<std::uint32_t>(b, out, n + kTail);
    EXPECT_EQ(std::count(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(n), 5u),
              static_cast<std::ptrdiff_t>(n))
        << "n = " << n;
    EXPECT_EQ(count_poisoned(got), kTail) << "n = " << n;
    b.free(out);
  }
}

TEST(GridSizing, AGridFromAnAssumedTileLeavesElementsUnwritten) {
  // The bug the rule prevents: a launcher that assumes 128 elements per block.
  CpuBackend b(narrow_core(kNarrowTile));
  const ResolvedKernel& k = b.op_cache().kernel(b, "core", "fill_u32");
  constexpr std::uint32_t n = 1000;
  constexpr std::uint32_t kAssumedTile = 128;
  const DevicePtr out = poisoned(b, n);
  const std::array args{KernelArg::buffer(out), KernelArg::value(std::uint32_t{5}),
                        KernelArg::value(n)};
  b.launch_typed(k, Dim3{(n + kAssumedTile - 1) / kAssumedTile}, Dim3{256}, 0, b.default_stream(),
                 args);
  const std::vector<std::uint32_t> got = read<std::uint32_t>(b, out, n);
  // 8 blocks of 64 cover 512 elements; the other 488 are still poison.
  EXPECT_GT(count_poisoned(got), 0u);
  EXPECT_EQ(count_poisoned(got), n - 8 * kNarrowTile);
  EXPECT_EQ(std::count(got.begin(), got.begin() + 8 * kNarrowTile, 5u), 8 * kNarrowTile);
  b.free(out);
}

TEST(GridSizing, AKernelPublishingNoTileMakesTheOpThrowWithNothingWritten) {
  for (const std::optional<std::uint32_t> tile :
       {std::optional<std::uint32_t>{}, std::optional<std::uint32_t>{0u}}) {
    SCOPED_TRACE(tile ? "tile 0" : "no tile symbol");
    CpuBackend b(narrow_core(tile));
    constexpr std::size_t n = 200;
    const DevicePtr out = poisoned(b, n);
    const Error e = expect_error([&] { ops::fill_u32(b, b.default_stream(), out, n, 5u); });
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_THAT(e.what(), HasSubstr("[kernel_n_tile] core::fill_u32 publishes no N tile"));
    EXPECT_THAT(e.what(), HasSubstr("cannot size its grid from an assumed width"));
    EXPECT_EQ(count_poisoned(read<std::uint32_t>(b, out, n + kTail)), n + kTail);
    b.free(out);
  }
}

TEST(GridSizing, AMissingKernelMakesTheOpThrowNotFound) {
  CpuBackend b(narrow_core(kNarrowTile));
  const DevicePtr y = poisoned(b, 10);
  const DevicePtr x = poisoned(b, 10);
  const Error e = expect_error([&] { ops::axpy_f32(b, b.default_stream(), y, x, 1.0f, 10); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[kernel] module 'core' has no kernel 'axpy_f32'"));
  EXPECT_THAT(e.what(), HasSubstr("elementwise.cpp"));
  EXPECT_EQ(count_poisoned(read<std::uint32_t>(b, y, 10 + kTail)), 10 + kTail);
  b.free(y);
  b.free(x);
}

}  // namespace
}  // namespace metrale
