// Borrowed memory on the CPU backend (Backend::borrow, Note [borrowed memory]): memory another
// owner keeps is reachable by copies only while lent, never freed by metrale, counted apart on
// the ledger, and refused clearly when the range is bad. (CPU streams run work when it is
// queued, so the wait before a release is proven on the fake CUDA driver, backend_memory_test;
// a GEMM on borrowed A and C is in tests/ops/borrowed_gemm_test.cpp.)
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "support/log_capture.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using testing::LogCapture;

DevicePtr at(const void* p) {
  return DevicePtr{reinterpret_cast<std::uintptr_t>(p)};
}

TEST(CpuBorrow, ALentRangeTakesCopiesAndFillsAndIsCountedApart) {
  CpuBackend b;
  std::vector<std::uint8_t> host(4096, 0);
  const DevicePtr p = at(host.data());
  // Not lent yet: the CPU backend refuses memory it does not know, and writes nothing.
  const std::vector<std::uint8_t> src(4096, 0x5A);
  EXPECT_THAT(expect_error([&] { b.copy_h2d(p, src.data(), src.size()); }).what(),
              HasSubstr("not inside any allocation"));
  EXPECT_EQ(host[0], 0);

  int released = 0;
  b.borrow(p, host.size(), [&] { ++released; });
  const AllocStats s = b.alloc_stats();
  EXPECT_EQ(s.borrowed_bytes, host.size());
  EXPECT_EQ(s.borrowed_count, 1u);
  EXPECT_EQ(b.live_bytes(), 0u);  // owned bytes only
  EXPECT_EQ(b.live_alloc_count(), 0u);

  b.copy_h2d(p, src.data(), src.size());
  EXPECT_EQ(host[4095], 0x5A);  // the caller's own memory, no copy in between
  b.memset(p.offset(100), 0x11, 8);
  EXPECT_EQ(host[100], 0x11);
  EXPECT_EQ(host[108], 0x5A);
  const DevicePtr owned = b.alloc(64);
  b.copy_d2d(owned, p.offset(96), 64);
  std::vector<std::uint8_t> back(64);
  b.copy_d2h(back.data(), owned, back.size());
  EXPECT_EQ(back[4], 0x11);
  // Ranges are checked against the lent bounds.
  EXPECT_THAT(expect_error([&] { b.memset(p.offset(4000), 0, 97); }).what(),
              HasSubstr("overruns the allocation"));
  EXPECT_EQ(released, 0);

  b.unborrow(p);
  EXPECT_EQ(released, 1);
  EXPECT_EQ(b.alloc_stats().borrowed_bytes, 0u);
  EXPECT_THAT(expect_error([&] { b.memset(p, 0, 1); }).what(),
              HasSubstr("not inside any allocation"));
  EXPECT_EQ(host[0], 0x5A);
  b.free(owned);
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(CpuBorrow, BadBorrowsAreRefusedNamingTheCallAndTheRangeAndRecordNothing) {
  CpuBackend b;
  std::vector<std::uint8_t> host(256);
  const DevicePtr p = at(host.data());
  const DevicePtr owned = b.alloc(1024);
  auto refused = [&](DevicePtr ptr, std::size_t bytes) {
    const Error e = expect_error([&] { b.borrow(ptr, bytes); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("[borrow]"));
    EXPECT_THAT(e.what(), HasSubstr("borrow_test.cpp"));  // the caller's line
    return std::string(e.what());
  };
  EXPECT_THAT(refused(DevicePtr{}, 16), HasSubstr("ptr is null"));
  EXPECT_THAT(refused(p, 0), HasSubstr("bytes = 0"));
  EXPECT_THAT(refused(DevicePtr{~std::uint64_t{0} - 7}, 16), HasSubstr("wraps around"));
  EXPECT_THAT(refused(owned.offset(512), 16),
              HasSubstr(fmt::format("overlaps device memory at 0x{:x}", owned.address())));
  EXPECT_THAT(refused(owned.offset(-8), 16), HasSubstr("overlaps device memory"));
  b.borrow(p, host.size());
  EXPECT_THAT(refused(p.offset(255), 1), HasSubstr("overlaps borrowed memory"));
  EXPECT_EQ(b.alloc_stats().borrow_count, 1u);
  b.unborrow(p);
  b.free(owned);
}

TEST(CpuBorrow, FreeAndUnborrowRefuseTheOtherKindAndChangeNothing) {
  CpuBackend b;
  std::vector<std::uint8_t> host(128, 7);
  const DevicePtr p = at(host.data());
  int released = 0;
  b.borrow(p, host.size(), [&] { ++released; });
  for (const Error& e :
       {expect_error([&] { b.free(p); }), expect_error([&] { b.free_pinned(host.data()); })}) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("is borrowed memory"));
    EXPECT_THAT(e.what(), HasSubstr("give it back with unborrow"));
  }
  b.memset(p, 9, host.size());  // still lent
  EXPECT_EQ(host[127], 9);

  const DevicePtr owned = b.alloc(64);
  EXPECT_THAT(expect_error([&] { b.unborrow(owned); }).what(),
              HasSubstr("device memory from borrow_test.cpp"));
  EXPECT_THAT(expect_error([&] { b.unborrow(p.offset(1)); }).what(),
              HasSubstr("starts no live borrow"));
  b.unborrow(p);
  EXPECT_THAT(expect_error([&] { b.unborrow(p); }).what(), HasSubstr("[unborrow]"));
  EXPECT_EQ(released, 1);
  b.free(owned);
}

TEST(CpuBorrow, TheSweepGivesBackBorrowsItFindsAndFreesNone) {
  std::vector<std::uint8_t> host(512, 3);
  int released = 0;
  {
    CpuBackend b;
    b.borrow(at(host.data()), host.size(), [&] { ++released; });
    const DevicePtr leaked = b.alloc(32);
    (void)leaked;
    LogCapture logs(log::Level::kWarn);
    const std::vector<LedgerEntry> left = b.sweep_unreleased_entries();
    ASSERT_EQ(left.size(), 2u);
    EXPECT_EQ(left[0].kind, MemoryKind::kDevice);
    EXPECT_EQ(left[1].kind, MemoryKind::kBorrowed);
    EXPECT_EQ(released, 1);
    EXPECT_EQ(logs.count(log::Level::kWarn, "was never given back; giving it back"), 1u);
    EXPECT_EQ(logs.count(log::Level::kWarn, "1 allocation(s) never freed"), 1u);
    EXPECT_EQ(b.alloc_stats().borrowed_count, 0u);
  }
  // The backend is gone and freed nothing of the caller's.
  EXPECT_EQ(released, 1);
  EXPECT_EQ(host[511], 3);
}

}  // namespace
}  // namespace metrale
