// cast_bf16_to_e4m3 on every backend: all 65,536 BF16 bit patterns against numerics.h's
// bf16_to_e4m3 and against the independent float64 nearest-even reference of
// core/numerics_reference.h; counts around the published tile with nothing written past the end;
// bad arguments rejected with nothing looked up or written.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "core/numerics_reference.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kCastTail = 40;  // bytes after out that no cast may touch

class CastBf16ToE4m3 : public GemmBackendTest {
 protected:
  // Casts in (already on the device) into a buffer pre-filled with poison; returns count + tail
  // bytes.
  std::vector<std::uint8_t> cast(DevicePtr in, std::size_t count, std::uint8_t poison) {
    const DevicePtr out = alloc(count + kCastTail);
    b().memset(out, poison, count + kCastTail);
    ops::cast_bf16_to_e4m3(b(), stream(), in, out, static_cast<std::int64_t>(count));
    return read<std::uint8_t>(out, count + kCastTail);
  }
};
INSTANTIATE_TEST_SUITE_P(, CastBf16ToE4m3, ::testing::Values("cpu", "cuda"), backend_name);

TEST_P(CastBf16ToE4m3, EveryBf16BitPatternMatchesBothReferences) {
  constexpr std::size_t kAll = 65536;
  std::vector<std::uint16_t> in(kAll);
  std::iota(in.begin(), in.end(), std::uint16_t{0});
  std::vector<std::uint8_t> expected(kAll);
  std::size_t disagree = 0;
  for (std::size_t i = 0; i < kAll; ++i) {
    expected[i] = num::bf16_to_e4m3(in[i]);
    const std::uint8_t independent = ref::nearest_e4m3(ref::bf16_value(in[i]));
    if (independent != expected[i] && disagree++ < 5) {
      ADD_FAILURE() << fmt::format(
          "references disagree on bf16 0x{:04x}: numerics.h 0x{:02x}, "
          "float64 nearest-even 0x{:02x}",
          in[i], expected[i], independent);
    }
  }
  EXPECT_EQ(disagree, 0u);
  const DevicePtr din = upload(in);
  // Every byte value is some input's right answer, so run twice with different poisons: an
  // element left unwritten in both runs would have to equal both.
  for (const std::uint8_t poison : {std::uint8_t{0xFF}, std::uint8_t{0x00}}) {
    SCOPED_TRACE(fmt::format("poison 0x{:02x}", poison));
    const std::vector<std::uint8_t> got = cast(din, kAll, poison);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < kAll; ++i) {
      if (got[i] != expected[i] && wrong++ < 8) {
        ADD_FAILURE() << fmt::format("bf16 0x{:04x} ({}) cast to 0x{:02x}, expected 0x{:02x}",
                                     in[i], num::bf16_to_f32(in[i]), got[i], expected[i]);
      }
    }
    EXPECT_EQ(wrong, 0u) << "of " << kAll << " bit patterns";
    EXPECT_EQ(std::count(got.begin() + kAll, got.end(), poison),
              static_cast<std::ptrdiff_t>(kCastTail))
        << "wrote past the end";
  }
  EXPECT_EQ(read<std::uint16_t>(din, kAll), in) << "the input was written";
}

TEST_P(CastBf16ToE4m3, CountsAroundThePublishedTile) {
  SCOPED_TRACE(fmt::format("seed {}", seed()));
  const std::uint32_t tile = b().kernel_n_tile(b().op_cache().kernel(b(), "w4a16", "bf16_to_fp8"));
  ASSERT_GT(tile, 1u);
  std::uniform_int_distribution<unsigned> bits(0, 0xFFFF);
  for (const std::size_t count : {std::size_t{1}, std::size_t{2}, std::size_t{15}, std::size_t{17},
                                  std::size_t{1000}, std::size_t{tile} - 1, std::size_t{tile},
                                  std::size_t{tile} + 1, 2 * std::size_t{tile} + 3}) {
    std::vector<std::uint16_t> in(count);
    for (std::uint16_t& x : in) x = static_cast<std::uint16_t>(bits(gen()));
    const std::vector<std::uint8_t> got = cast(upload(in), count, 0xA5);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < count; ++i) wrong += got[i] != num::bf16_to_e4m3(in[i]);
    EXPECT_EQ(wrong, 0u) << "count " << count;
    EXPECT_EQ(std::count(got.begin() + static_cast<std::ptrdiff_t>(count), got.end(), 0xA5),
              static_cast<std::ptrdiff_t>(kCastTail))
        << "count " << count << ": wrote past the end";
    free_all();
  }
}

TEST_P(CastBf16ToE4m3, BadArgumentsThrowWithNothingLookedUpOrWritten) {
  const std::size_t audit0 = b().lookup_audit().size();
  const std::size_t kernels0 = b().op_cache().kernel_count();
  constexpr std::int64_t n = 256;
  // in and out inside one arena, so an overlapping pair stays inside it even if the op ran.
  const DevicePtr arena = alloc(4 * n * 2);
  b().memset(arena, 0x5A, 4 * n * 2);
  const DevicePtr in = arena, out = arena.offset(2 * n * 2);
  auto rejected = [&](DevicePtr i, DevicePtr o, std::int64_t count,
                      std::initializer_list<std::string> words) {
    const Error e = expect_error([&] { ops::cast_bf16_to_e4m3(b(), stream(), i, o, count); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_THAT(e.what(), ::testing::StartsWith("[cast_bf16_to_e4m3] "));
    for (const std::string& w : words) EXPECT_THAT(e.what(), HasSubstr(w));
  };
  const auto hex = [](DevicePtr p) { return fmt::format("0x{:x}", p.address()); };
  rejected(in, out, 0, {"count = 0"});
  rejected(in, out, -7, {"count = -7"});
  rejected(DevicePtr{}, out, n, {"in is null"});
  rejected(in, DevicePtr{}, n, {"out is null"});
  rejected(in.offset(2), out, n, {"in = " + hex(in.offset(2)), "16-byte aligned"});
  rejected(in, out.offset(2), n, {"out = " + hex(out.offset(2)), "16-byte aligned"});
  rejected(in, out.offset(8), n, {"out = " + hex(out.offset(8)), "16-byte aligned"});
  // out on in, inside in, and ending inside in from before it.
  rejected(in, in, n, {"out [" + hex(in), "overlaps in"});
  rejected(in, in.offset(n), n, {"out [" + hex(in.offset(n)), "overlaps in"});
  rejected(in.offset(64), in, n, {"out [" + hex(in), "overlaps in"});
  EXPECT_EQ(b().lookup_audit().size(), audit0) << "a kernel was looked up";
  EXPECT_EQ(b().op_cache().kernel_count(), kernels0);
  const std::vector<std::uint8_t> bytes = read<std::uint8_t>(arena, 4 * n * 2);
  EXPECT_EQ(std::count(bytes.begin(), bytes.end(), 0x5A), 4 * n * 2) << "something was written";
  // out starting right where in ends is adjacent, not overlapping: it works.
  ops::cast_bf16_to_e4m3(b(), stream(), in, in.offset(n * 2), n);
  const std::vector<std::uint8_t> cast = read<std::uint8_t>(in.offset(n * 2), n);
  EXPECT_EQ(std::count(cast.begin(), cast.end(), num::bf16_to_e4m3(0x5A5A)), n);
}

}  // namespace
}  // namespace metrale::testing::gemm
