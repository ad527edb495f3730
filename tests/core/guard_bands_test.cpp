// Guard bands (docs/CONTRACT.md, guard bands): the bookkeeping, the pad check, the environment
// policy, and scans and poisoning on a real CPU backend.
#include "metrale/guard_bands.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "metrale/cpu_backend.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;
using testing::random_size;
using testing::rng;

unsigned char* host(DevicePtr p) {
  return reinterpret_cast<unsigned char*>(static_cast<std::uintptr_t>(p.address()));
}

// ---- GuardBands bookkeeping ----

TEST(GuardBands, PadIsRoundedUpTo16) {
  const std::vector<std::pair<std::size_t, std::size_t>> cases{
      {0, 0}, {1, 16}, {15, 16}, {16, 16}, {17, 32}, {20, 32}, {32, 32}, {33, 48}};
  for (const auto& [asked, want] : cases) {
    GuardBands g;
    g.configure(GuardBandConfig{asked, 0, 0x5A});
    const GuardBands::Plan p = g.plan_next();
    EXPECT_EQ(p.pad_bytes, want) << "pad " << asked;
    EXPECT_EQ(p.fill, 0x5A);
  }
}

TEST(GuardBands, OnlyAllocationsFromMinIndexGetAPad) {
  GuardBands g;
  g.configure(GuardBandConfig{16, 3, kGuardFill});
  for (std::uint64_t i = 0; i < 6; ++i) {
    const GuardBands::Plan p = g.plan_next();
    EXPECT_EQ(p.index, i);
    EXPECT_EQ(p.pad_bytes, i < 3 ? 0u : 16u) << "index " << i;
  }
}

TEST(GuardBands, AddRemoveSetFillAndBandsByIndex) {
  GuardBands g;
  g.configure(GuardBandConfig{16, 0, kGuardFill});
  const GuardBands::Plan p0 = g.plan_next();
  const GuardBands::Plan p1 = g.plan_next();
  const GuardBands::Plan off{};  // pad 0: not registered
  // Added out of order; bands() comes back by creation index.
  g.add(DevicePtr{0x2000}, 40, p1);
  g.add(DevicePtr{0x1000}, 8, p0);
  g.add(DevicePtr{0x3000}, 8, off);
  std::vector<GuardBand> bands = g.bands();
  ASSERT_EQ(bands.size(), 2u);
  EXPECT_EQ(bands[0].ptr, DevicePtr{0x1000});
  EXPECT_EQ(bands[0].index, 0u);
  EXPECT_EQ(bands[0].pad(), DevicePtr{0x1008});
  EXPECT_EQ(bands[1].ptr, DevicePtr{0x2000});
  EXPECT_EQ(bands[1].user_bytes, 40u);
  EXPECT_EQ(bands[1].pad(), DevicePtr{0x2028});

  g.set_fill(DevicePtr{0x2000}, 0x00);
  EXPECT_EQ(g.bands()[1].fill, 0x00);
  EXPECT_EQ(g.bands()[0].fill, kGuardFill);

  EXPECT_TRUE(g.remove(DevicePtr{0x1000}));
  EXPECT_FALSE(g.remove(DevicePtr{0x1000}));
  EXPECT_FALSE(g.remove(DevicePtr{0x3000}));
  bands = g.bands();
  ASSERT_EQ(bands.size(), 1u);
  EXPECT_EQ(bands[0].ptr, DevicePtr{0x2000});
}

// ---- check_guard_band ----

TEST(CheckGuardBand, IntactPadIsNullopt) {
  const GuardBand band{DevicePtr{0x100}, 4, 10, 32, 0xA7};
  const std::vector<std::uint8_t> pad(32, 0xA7);
  EXPECT_FALSE(check_guard_band(band, pad).has_value());
}

TEST(CheckGuardBand, FindsFirstAndLastOffsetCountAndFirstValue) {
  const std::size_t pad_bytes = 16 * random_size(2, 8);
  const GuardBand band{DevicePtr{0x4000}, 7, 100, pad_bytes, kGuardFill};
  std::vector<std::uint8_t> pad(pad_bytes, kGuardFill);
  const std::size_t first = random_size(0, pad_bytes / 2 - 1);
  const std::size_t last = random_size(pad_bytes / 2, pad_bytes - 1);
  const auto first_value = static_cast<std::uint8_t>(random_size(0, 0xED));
  pad[first] = first_value;
  pad[last] = 0x01;
  // One more change strictly between them, when there is room.
  std::size_t changed = 2;
  if (last - first > 1) {
    pad[first + 1] = 0x02;
    ++changed;
  }
  const auto v = check_guard_band(band, pad);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->first_offset, first);
  EXPECT_EQ(v->last_offset, last);
  EXPECT_EQ(v->changed, changed);
  EXPECT_EQ(v->first_value, first_value);
  EXPECT_EQ(v->band.index, 7u);

  const std::string text = v->describe();
  EXPECT_THAT(text, HasSubstr("allocation #7"));
  EXPECT_THAT(text, HasSubstr("0x4000"));
  EXPECT_THAT(text, HasSubstr(fmt::format("{} byte(s) changed", changed)));
  EXPECT_THAT(text, HasSubstr(fmt::format("pad offsets {}..{}", first, last)));
  EXPECT_THAT(text, HasSubstr(fmt::format("first value 0x{:02x}", first_value)));
  EXPECT_THAT(text, HasSubstr("expected 0xee"));
}

TEST(CheckGuardBand, ComparesWithTheBandsOwnFill) {
  const GuardBand band{DevicePtr{0x100}, 0, 8, 16, 0x00};
  std::vector<std::uint8_t> pad(16, 0x00);
  EXPECT_FALSE(check_guard_band(band, pad).has_value());
  pad[15] = kGuardFill;  // the default fill is a violation of a poisoned-to-zero pad
  const auto v = check_guard_band(band, pad);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->first_offset, 15u);
  EXPECT_EQ(v->last_offset, 15u);
  EXPECT_EQ(v->changed, 1u);
  EXPECT_EQ(v->first_value, kGuardFill);
}

// ---- GuardBandConfig::from_env ----

// Sets the three variables for one test and restores "unset" afterwards.
class RedzoneEnv : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    unsetenv("METRALE_REDZONE");
    unsetenv("METRALE_REDZONE_MIN_IDX");
    unsetenv("METRALE_REDZONE_FILL");
  }
};

TEST_F(RedzoneEnv, UnsetKeepsTheDefaults) {
  testing::LogCapture logs;
  const GuardBandConfig c = GuardBandConfig::from_env();
  EXPECT_EQ(c.pad_bytes, 0u);
  EXPECT_EQ(c.min_index, 0u);
  EXPECT_EQ(c.fill, kGuardFill);
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_REDZONE"), 0u);
}

TEST_F(RedzoneEnv, ReadsDecimalAndHex) {
  const std::size_t pad = random_size(1, 4096);
  const std::size_t min_idx = random_size(0, 1u << 20);
  const std::size_t fill = random_size(0, 255);
  setenv("METRALE_REDZONE", std::to_string(pad).c_str(), 1);
  setenv("METRALE_REDZONE_MIN_IDX", std::to_string(min_idx).c_str(), 1);
  setenv("METRALE_REDZONE_FILL", fmt::format("0x{:x}", fill).c_str(), 1);
  testing::LogCapture logs;
  GuardBandConfig c = GuardBandConfig::from_env();
  EXPECT_EQ(c.pad_bytes, pad);
  EXPECT_EQ(c.min_index, min_idx);
  EXPECT_EQ(c.fill, fill);

  setenv("METRALE_REDZONE_FILL", std::to_string(fill).c_str(), 1);
  setenv("METRALE_REDZONE", "0X40", 1);
  c = GuardBandConfig::from_env();
  EXPECT_EQ(c.fill, fill);
  EXPECT_EQ(c.pad_bytes, 64u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_REDZONE"), 0u);
}

TEST_F(RedzoneEnv, LeadingZerosAreDecimalNotOctal) {
  setenv("METRALE_REDZONE", "010", 1);
  setenv("METRALE_REDZONE_FILL", "0255", 1);
  const GuardBandConfig c = GuardBandConfig::from_env();
  EXPECT_EQ(c.pad_bytes, 10u);
  EXPECT_EQ(c.fill, 255);
}

TEST_F(RedzoneEnv, BadValuesAreIgnoredWithAWarning) {
  struct Case {
    const char* name;
    const char* value;
  };
  const std::vector<Case> cases{
      {"METRALE_REDZONE", "abc"},
      {"METRALE_REDZONE", "12kb"},
      {"METRALE_REDZONE", "-16"},
      {"METRALE_REDZONE", ""},
      {"METRALE_REDZONE", "0x"},
      {"METRALE_REDZONE", "99999999999"},  // above the 1 GiB cap
      {"METRALE_REDZONE_MIN_IDX", "-1"},
      {"METRALE_REDZONE_MIN_IDX", " -1"},
      {"METRALE_REDZONE_MIN_IDX", "99999999999999999999999"},  // does not fit 64 bits
      {"METRALE_REDZONE_FILL", "256"},
      {"METRALE_REDZONE_FILL", "0x100"},
      {"METRALE_REDZONE_FILL", "ee"},
  };
  for (const Case& bad : cases) {
    SCOPED_TRACE(::testing::Message() << bad.name << "=" << bad.value);
    clear();
    setenv(bad.name, bad.value, 1);
    testing::LogCapture logs;
    const GuardBandConfig c = GuardBandConfig::from_env();
    EXPECT_EQ(c.pad_bytes, 0u);
    EXPECT_EQ(c.min_index, 0u);
    EXPECT_EQ(c.fill, kGuardFill);
    EXPECT_EQ(logs.count(log::Level::kWarn, fmt::format("{}={}", bad.name, bad.value)), 1u);
    EXPECT_EQ(logs.count(log::Level::kWarn, "ignored"), 1u);
  }
}

TEST_F(RedzoneEnv, ABadValueLeavesTheOthersRead) {
  setenv("METRALE_REDZONE", "48", 1);
  setenv("METRALE_REDZONE_MIN_IDX", "lots", 1);
  setenv("METRALE_REDZONE_FILL", "0xab", 1);
  testing::LogCapture logs;
  const GuardBandConfig c = GuardBandConfig::from_env();
  EXPECT_EQ(c.pad_bytes, 48u);
  EXPECT_EQ(c.min_index, 0u);
  EXPECT_EQ(c.fill, 0xab);
  EXPECT_EQ(logs.count(log::Level::kWarn, "METRALE_REDZONE_MIN_IDX=lots"), 1u);
}

TEST_F(RedzoneEnv, ABackendTakesItsPolicyFromTheEnvironment) {
  setenv("METRALE_REDZONE", "20", 1);
  setenv("METRALE_REDZONE_FILL", "0x5c", 1);
  CpuBackend backend(CpuBackendOptions{builtin_host_modules(), 1});
  const std::size_t n = random_size(1, 300);
  const DevicePtr p = backend.alloc(n);
  for (std::size_t i = 0; i < 32; ++i) ASSERT_EQ(host(p)[n + i], 0x5c) << "pad byte " << i;
  host(p)[n + 31] = 0x00;
  testing::LogCapture logs;
  EXPECT_EQ(backend.scan_redzones(), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "expected 0x5c"), 1u);
  backend.free(p);
}

// ---- on a CPU backend ----

class CpuGuardBands : public ::testing::Test {
 protected:
  CpuGuardBands() : backend(CpuBackendOptions{builtin_host_modules(), 1}) {
    backend.set_guard_bands(GuardBandConfig{20, 0, kGuardFill});
  }
  CpuBackend backend;
};

TEST_F(CpuGuardBands, NewAllocationsGetAFilledPadOfTheRoundedSize) {
  const std::size_t n = random_size(1, 1000);
  const DevicePtr p = backend.alloc(n);
  for (std::size_t i = 0; i < 32; ++i) EXPECT_EQ(host(p)[n + i], kGuardFill) << "pad byte " << i;
  // The ledger holds what the caller asked for, not the pad.
  EXPECT_EQ(backend.live_bytes(), n);
  EXPECT_EQ(backend.scan_redzones(), 0u);
  backend.free(p);
}

TEST_F(CpuGuardBands, AWritePastTheEndIsFoundOnceAndRefilled) {
  const DevicePtr before = backend.alloc(random_size(1, 100));  // index 0
  const std::size_t n = random_size(1, 1000);
  const DevicePtr p = backend.alloc(n);                        // index 1
  const DevicePtr after = backend.alloc(random_size(1, 100));  // index 2
  host(p)[n + 3] = 0x11;
  {
    testing::LogCapture logs;
    EXPECT_EQ(backend.scan_redzones(), 1u);
    ASSERT_EQ(logs.lines().size(), 1u);
    const std::string line = logs.lines()[0].text;
    EXPECT_EQ(logs.lines()[0].level, log::Level::kWarn);
    EXPECT_THAT(line, HasSubstr("scan_redzones"));
    EXPECT_THAT(line, HasSubstr("allocation #1 "));
    EXPECT_THAT(line, HasSubstr(fmt::format("0x{:x}", p.address())));
    EXPECT_THAT(line, HasSubstr(fmt::format("{} bytes, pad 32", n)));
    EXPECT_THAT(line, HasSubstr("1 byte(s) changed at pad offsets 3..3"));
    EXPECT_THAT(line, HasSubstr("first value 0x11"));
  }
  EXPECT_EQ(host(p)[n + 3], kGuardFill);
  {
    testing::LogCapture logs;
    EXPECT_EQ(backend.scan_redzones(), 0u);
    EXPECT_TRUE(logs.lines().empty());
  }
  backend.free(before);
  backend.free(p);
  backend.free(after);
}

TEST_F(CpuGuardBands, WritesInsideTheAllocationAreNotViolations) {
  const std::size_t n = random_size(1, 1000);
  const DevicePtr p = backend.alloc(n);
  for (std::size_t i = 0; i < n; ++i) host(p)[i] = static_cast<unsigned char>(rng()());
  EXPECT_EQ(backend.scan_redzones(), 0u);
  backend.free(p);
}

TEST_F(CpuGuardBands, EveryViolatedPadCounts) {
  std::vector<DevicePtr> ptrs;
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 5; ++i) {
    sizes.push_back(random_size(1, 500));
    ptrs.push_back(backend.alloc(sizes.back()));
  }
  host(ptrs[1])[sizes[1]] = 0x00;
  host(ptrs[3])[sizes[3] + 31] = 0x00;
  host(ptrs[4])[sizes[4] + 16] = 0x00;
  testing::LogCapture logs;
  EXPECT_EQ(backend.scan_redzones(), 3u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #1 "), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #3 "), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #4 "), 1u);
  EXPECT_EQ(backend.scan_redzones(), 0u);
  for (DevicePtr p : ptrs) backend.free(p);
}

TEST_F(CpuGuardBands, MinIndexSkipsEarlierAllocations) {
  backend.set_guard_bands(GuardBandConfig{16, 2, kGuardFill});
  const std::size_t n = 64;
  const DevicePtr a = backend.alloc(n);  // index 0: no pad
  const DevicePtr b = backend.alloc(n);  // index 1: no pad
  const DevicePtr c = backend.alloc(n);  // index 2: pad
  for (std::size_t i = 0; i < 16; ++i) EXPECT_EQ(host(c)[n + i], kGuardFill);
  host(c)[n] = 0x00;
  testing::LogCapture logs;
  EXPECT_EQ(backend.scan_redzones(), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #2 "), 1u);
  backend.free(a);
  backend.free(b);
  backend.free(c);
}

TEST_F(CpuGuardBands, PoisonFillsPadsInsideTheRangeWithEEAndOthersWithZero) {
  std::vector<DevicePtr> ptrs;
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 6; ++i) {
    sizes.push_back(random_size(1, 300));
    ptrs.push_back(backend.alloc(sizes.back()));
  }
  const std::size_t lo = random_size(0, 3);
  const std::size_t hi = random_size(lo + 1, 6);
  backend.poison_redzones(lo, hi);
  for (std::size_t a = 0; a < ptrs.size(); ++a) {
    const std::uint8_t want = (a >= lo && a < hi) ? kGuardFill : 0x00;
    for (std::size_t i = 0; i < 32; ++i) {
      ASSERT_EQ(host(ptrs[a])[sizes[a] + i], want) << "allocation " << a << " pad byte " << i
                                                   << " after poison [" << lo << ", " << hi << ")";
    }
  }
  {
    testing::LogCapture logs;
    EXPECT_EQ(backend.scan_redzones(), 0u);
    EXPECT_TRUE(logs.lines().empty());
  }
  // The expected fill follows the poison: the old default byte in a zeroed pad is a violation.
  const std::size_t zeroed = lo > 0 ? 0 : hi;
  if (zeroed < ptrs.size()) {
    host(ptrs[zeroed])[sizes[zeroed] + 5] = kGuardFill;
    testing::LogCapture logs;
    EXPECT_EQ(backend.scan_redzones(), 1u);
    EXPECT_EQ(logs.count(log::Level::kWarn, fmt::format("allocation #{} ", zeroed)), 1u);
    EXPECT_EQ(logs.count(log::Level::kWarn, "expected 0x00"), 1u);
    EXPECT_EQ(host(ptrs[zeroed])[sizes[zeroed] + 5], 0x00);  // refilled with its own fill
  }
  for (DevicePtr p : ptrs) backend.free(p);
}

TEST_F(CpuGuardBands, FreeingRemovesTheBand) {
  const std::size_t n = random_size(1, 300);
  const DevicePtr p = backend.alloc(n);
  const DevicePtr keep = backend.alloc(n);
  host(p)[n + 1] = 0x00;  // violated, but freed before any scan
  backend.free(p);
  // A band left behind would be read from freed memory (ASan) and counted.
  EXPECT_EQ(backend.scan_redzones(), 0u);
  host(keep)[n + 1] = 0x00;
  EXPECT_EQ(backend.scan_redzones(), 1u);
  backend.free(keep);
  EXPECT_EQ(backend.scan_redzones(), 0u);
}

TEST_F(CpuGuardBands, PinnedMemoryGetsNoPad) {
  const std::size_t n = random_size(1, 300);
  void* pinned = backend.alloc_pinned(n);
  const DevicePtr d = backend.alloc(n);
  backend.poison_redzones(0, 100);
  // Only the device allocation has a band: a scan that read a pad after the pinned block would
  // find its bytes unset, and the pinned block's index would not shift the device one.
  EXPECT_EQ(backend.scan_redzones(), 0u);
  host(d)[n] = 0x00;
  testing::LogCapture logs;
  EXPECT_EQ(backend.scan_redzones(), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "allocation #0 "), 1u);
  backend.free(d);
  backend.free_pinned(pinned);
}

}  // namespace
}  // namespace metrale
