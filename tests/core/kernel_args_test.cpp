// PackedArgs: the 64-bit slot layout every untyped launch takes
// (docs/CONTRACT.md, kernel arguments).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "metrale/kernel_args.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::rng;
template <std::size_t N>
std::array<std::uint8_t, N> random_bytes() {
  std::array<std::uint8_t, N> out{};
  std::uniform_int_distribution<int> byte(1, 255);  // non-zero, so padding is told apart
  for (auto& b : out) b = static_cast<std::uint8_t>(byte(rng()));
  return out;
}

// The bytes of `count` slots starting at `first`.
std::vector<std::uint8_t> slot_bytes(const PackedArgs& packed, std::size_t first,
                                     std::size_t count) {
  std::vector<std::uint8_t> out(count * 8);
  std::memcpy(out.data(), packed.slots().data() + first, out.size());
  return out;
}

std::size_t slot_index(PackedArgs& packed, std::size_t param) {
  const auto* p = static_cast<const std::uint64_t*>(packed.params()[param]);
  return static_cast<std::size_t>(p - packed.slots().data());
}

TEST(KernelArgs, BufferTakesOneSlotHoldingTheAddress) {
  const DevicePtr ptr{rng()() | 1};
  const std::vector<KernelArg> args{KernelArg::buffer(ptr)};
  EXPECT_TRUE(args[0].is_buffer());
  EXPECT_EQ(args[0].ptr(), ptr);
  EXPECT_TRUE(args[0].bytes().empty());

  PackedArgs packed(args);
  ASSERT_EQ(packed.count(), 1u);
  ASSERT_EQ(packed.slots().size(), 1u);
  EXPECT_EQ(packed.slots()[0], ptr.address());
  EXPECT_EQ(slot_index(packed, 0), 0u);
  EXPECT_EQ(read_param<std::uint64_t>(packed.params(), 0), ptr.address());
}

TEST(KernelArgs, BlobsTakeCeilLenOver8ZeroPaddedSlots) {
  const auto b1 = random_bytes<1>();
  const auto b4 = random_bytes<4>();
  const auto b8 = random_bytes<8>();
  const auto b9 = random_bytes<9>();
  const auto b16 = random_bytes<16>();
  const DevicePtr buf{(rng()() | 1)};
  const std::vector<KernelArg> args{KernelArg::value(b1),   KernelArg::value(b4),
                                    KernelArg::buffer(buf), KernelArg::value(b8),
                                    KernelArg::value(b9),   KernelArg::value(b16)};
  EXPECT_FALSE(args[0].is_buffer());
  EXPECT_EQ(args[0].ptr(), DevicePtr{});
  EXPECT_EQ(args[4].bytes().size(), 9u);

  PackedArgs packed(args);
  ASSERT_EQ(packed.count(), args.size());
  // 1 + 1 + 1 + 1 + 2 + 2 slots.
  ASSERT_EQ(packed.slots().size(), 8u);
  const std::vector<std::size_t> first{0, 1, 2, 3, 4, 6};
  for (std::size_t i = 0; i < first.size(); ++i) {
    EXPECT_EQ(slot_index(packed, i), first[i]) << "parameter " << i;
  }

  auto expect_blob = [&](std::size_t param, const auto& blob, std::size_t slots) {
    SCOPED_TRACE(::testing::Message() << "blob of " << blob.size() << " bytes");
    const std::vector<std::uint8_t> got = slot_bytes(packed, first[param], slots);
    std::vector<std::uint8_t> want(slots * 8, 0);
    std::memcpy(want.data(), blob.data(), blob.size());
    EXPECT_EQ(got, want);
  };
  expect_blob(0, b1, 1);
  expect_blob(1, b4, 1);
  expect_blob(3, b8, 1);
  expect_blob(4, b9, 2);
  expect_blob(5, b16, 2);
  EXPECT_EQ(packed.slots()[2], buf.address());
}

TEST(KernelArgs, ReadParamRoundTrips) {
  const auto blob = random_bytes<9>();
  const auto i = static_cast<std::uint32_t>(rng()());
  std::uniform_real_distribution<float> real(-1e6f, 1e6f);
  const float f = real(rng());
  const DevicePtr buf{rng()() | 1};
  struct Pair {
    std::int16_t a;
    double b;
  };
  const Pair pair{static_cast<std::int16_t>(rng()()), static_cast<double>(real(rng()))};
  const std::vector<KernelArg> args{KernelArg::buffer(buf), KernelArg::value(i),
                                    KernelArg::value(f), KernelArg::value(blob),
                                    KernelArg::value(pair)};
  PackedArgs packed(args);
  void* const* params = packed.params();
  EXPECT_EQ(read_param<std::uint64_t>(params, 0), buf.address());
  EXPECT_EQ(read_param<std::uint32_t>(params, 1), i);
  EXPECT_EQ(read_param<float>(params, 2), f);
  EXPECT_EQ((read_param<std::array<std::uint8_t, 9>>(params, 3)), blob);
  const Pair back = read_param<Pair>(params, 4);
  EXPECT_EQ(back.a, pair.a);
  EXPECT_EQ(back.b, pair.b);
}

TEST(KernelArgs, NoArgumentsPackToNothing) {
  PackedArgs packed(std::span<const KernelArg>{});
  EXPECT_EQ(packed.count(), 0u);
  EXPECT_TRUE(packed.slots().empty());
}

}  // namespace
}  // namespace metrale
