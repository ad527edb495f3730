// CPU backend memory: alignment, bounds-checked copies that write nothing on error, foreign and
// freed pointers, pinned memory, fault injection and the memory queries.
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
#include "support/read_back.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using testing::read;

// Runs f and returns the metrale::Error it throws; records a failure when it throws none.
std::string hex(std::uint64_t address) {
  return fmt::format("0x{:x}", address);
}
std::string hex(DevicePtr p) {
  return hex(p.address());
}

std::vector<std::uint8_t> read_bytes(Backend& b, DevicePtr p, std::size_t n) {
  std::vector<std::uint8_t> out(n);
  b.copy_d2h(out.data(), p, n);
  return out;
}

// A buffer of n bytes filled with value through the API.
DevicePtr filled(Backend& b, std::size_t n, std::uint8_t value) {
  const DevicePtr p = b.alloc(n);
  b.memset(p, value, n);
  return p;
}

// Every byte of the allocation still holds value.
void expect_all(Backend& b, DevicePtr p, std::size_t n, std::uint8_t value) {
  const std::vector<std::uint8_t> got = read_bytes(b, p, n);
  for (std::size_t i = 0; i < n; ++i) {
    if (got[i] != value) {
      ADD_FAILURE() << "byte " << i << " is " << int{got[i]} << ", expected " << int{value};
      return;
    }
  }
}

TEST(CpuMemory, AllocationsOfEveryKindAre256ByteAligned) {
  CpuBackend b;
  std::vector<DevicePtr> device;
  std::vector<void*> pinned;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{3}, std::size_t{255}, std::size_t{256},
                            std::size_t{257}, std::size_t{4097}, std::size_t{100003}}) {
    const DevicePtr d = b.alloc(bytes);
    const DevicePtr m = b.alloc_managed(bytes);
    void* h = b.alloc_pinned(bytes);
    EXPECT_EQ(d.address() % 256, 0u) << bytes;
    EXPECT_EQ(m.address() % 256, 0u) << bytes;
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(h) % 256, 0u) << bytes;
    device.push_back(d);
    device.push_back(m);
    pinned.push_back(h);
  }
  EXPECT_EQ(b.live_alloc_count(), 21u);
  for (DevicePtr p : device) b.free(p);
  for (void* h : pinned) b.free_pinned(h);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(b.live_alloc_count(), 0u);
}

TEST(CpuMemory, ZeroByteAllocationIsRejectedNamingTheCaller) {
  CpuBackend b;
  const Error e = expect_error([&] { b.alloc(0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[alloc] bytes = 0"));
  EXPECT_THAT(e.what(), HasSubstr("memory_test.cpp:"));
  const Error p = expect_error([&] { b.alloc_pinned(0); });
  EXPECT_EQ(p.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(p.what(), HasSubstr("[alloc_pinned]"));
  EXPECT_EQ(b.live_alloc_count(), 0u);
}

TEST(CpuMemory, RoundTripAndZeroByteCopiesAreNoOps) {
  CpuBackend b;
  const DevicePtr a = b.alloc(100);
  const DevicePtr c = b.alloc_managed(100);
  std::vector<std::uint8_t> src(100);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 1);
  b.copy_h2d(a, src.data(), src.size());
  b.copy_d2d(c, a, 100);
  EXPECT_EQ(read_bytes(b, c, 100), src);
  // bytes == 0 is a no-op even with pointers that would otherwise be rejected.
  EXPECT_NO_THROW(b.copy_h2d(DevicePtr{}, nullptr, 0));
  EXPECT_NO_THROW(b.copy_d2h(nullptr, DevicePtr{}, 0));
  EXPECT_NO_THROW(b.memset(DevicePtr{}, 1, 0));
  EXPECT_EQ(read_bytes(b, c, 100), src);
  b.free(a);
  b.free(c);
}

TEST(CpuMemory, HostToDeviceOverrunThrowsAndWritesNothing) {
  CpuBackend b;
  const DevicePtr a = filled(b, 64, 0x11);
  const std::vector<std::uint8_t> src(64, 0x99);
  const Error e = expect_error([&] { b.copy_h2d(a.offset(32), src.data(), 64); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[copy_h2d]"));
  EXPECT_THAT(e.what(), HasSubstr(hex(a.offset(32))));
  EXPECT_THAT(e.what(), HasSubstr("overruns the allocation at " + hex(a) + " (64 bytes) by 32"));
  expect_all(b, a, 64, 0x11);

  const StreamHandle s = b.create_stream();
  const Error async = expect_error([&] { b.copy_h2d_async(a, src.data(), 65, s); });
  EXPECT_EQ(async.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(async.what(), HasSubstr("[copy_h2d]"));
  expect_all(b, a, 64, 0x11);
  b.destroy_stream(s);
  b.free(a);
}

TEST(CpuMemory, DeviceToHostOverrunThrowsAndWritesNothing) {
  CpuBackend b;
  const DevicePtr a = filled(b, 64, 0x22);
  std::vector<std::uint8_t> dst(64, 0x77);
  const Error e = expect_error([&] { b.copy_d2h(dst.data(), a.offset(8), 64); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[copy_d2h]"));
  EXPECT_THAT(e.what(), HasSubstr("source " + hex(a.offset(8))));
  EXPECT_EQ(dst, std::vector<std::uint8_t>(64, 0x77));

  const Error null_dst = expect_error([&] { b.copy_d2h(nullptr, a, 4); });
  EXPECT_EQ(null_dst.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(null_dst.what(), HasSubstr("[copy_d2h] destination is null"));
  b.free(a);
}

TEST(CpuMemory, DeviceToDeviceOverrunOfEitherSideThrowsAndWritesNothing) {
  CpuBackend b;
  const DevicePtr small = filled(b, 64, 0x33);
  const DevicePtr big = filled(b, 128, 0x44);
  const Error dst_over = expect_error([&] { b.copy_d2d(small, big, 128); });
  EXPECT_EQ(dst_over.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(dst_over.what(), HasSubstr("[copy_d2d] destination " + hex(small)));
  expect_all(b, small, 64, 0x33);

  const Error src_over = expect_error([&] { b.copy_d2d(big, small.offset(1), 64); });
  EXPECT_EQ(src_over.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(src_over.what(), HasSubstr("[copy_d2d] source " + hex(small.offset(1))));
  expect_all(b, big, 128, 0x44);

  const StreamHandle s = b.create_stream();
  const Error async = expect_error([&] { b.copy_d2d_async(small, big, 65, s); });
  EXPECT_EQ(async.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(async.what(), HasSubstr("[copy_d2d]"));
  expect_all(b, small, 64, 0x33);
  b.destroy_stream(s);
  b.free(small);
  b.free(big);
}

TEST(CpuMemory, MemsetOverrunThrowsAndWritesNothing) {
  CpuBackend b;
  const DevicePtr a = filled(b, 64, 0x55);
  const Error e = expect_error([&] { b.memset(a, 0xFF, 65); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[memset] destination " + hex(a)));
  EXPECT_THAT(e.what(), HasSubstr("by 1 bytes"));
  expect_all(b, a, 64, 0x55);

  const Error async =
      expect_error([&] { b.memset_async(a.offset(60), 0xFF, 8, b.default_stream()); });
  EXPECT_EQ(async.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(async.what(), HasSubstr("[memset] destination " + hex(a.offset(60))));
  expect_all(b, a, 64, 0x55);
  b.free(a);
}

TEST(CpuMemory, Copy2dCopiesRowsAndRejectsOverrunsWithoutWriting) {
  CpuBackend b;
  // Source: 4 rows of pitch 16; copy 8 bytes per row into rows of pitch 12.
  std::vector<std::uint8_t> src(64);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i);
  const DevicePtr s = b.alloc(64);
  b.copy_h2d(s, src.data(), 64);
  const DevicePtr d = filled(b, 48, 0xCC);
  b.copy_2d_async(d, 12, s, 16, 8, 4, b.default_stream());
  const std::vector<std::uint8_t> got = read_bytes(b, d, 48);
  for (std::size_t r = 0; r < 4; ++r) {
    for (std::size_t c = 0; c < 12; ++c) {
      const std::uint8_t want = c < 8 ? src[r * 16 + c] : std::uint8_t{0xCC};
      EXPECT_EQ(got[r * 12 + c], want) << "row " << r << " col " << c;
    }
  }

  b.memset(d, 0xCC, 48);
  // Height 5 at pitch 12 needs 4 * 12 + 8 = 56 bytes of the 48-byte destination.
  const Error dst_over =
      expect_error([&] { b.copy_2d_async(d, 12, s, 8, 8, 5, b.default_stream()); });
  EXPECT_EQ(dst_over.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(dst_over.what(), HasSubstr("[copy_2d] destination " + hex(d)));
  expect_all(b, d, 48, 0xCC);
  // Source rows of pitch 16 over 4 rows starting at byte 8 reach 8 + 48 + 12 > 64.
  const Error src_over =
      expect_error([&] { b.copy_2d_async(d, 12, s.offset(8), 16, 12, 4, b.default_stream()); });
  EXPECT_EQ(src_over.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(src_over.what(), HasSubstr("[copy_2d] source " + hex(s.offset(8))));
  expect_all(b, d, 48, 0xCC);
  const Error wide = expect_error([&] { b.copy_2d_async(d, 4, s, 16, 8, 2, b.default_stream()); });
  EXPECT_EQ(wide.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(wide.what(), HasSubstr("[copy_2d] width 8 bytes exceeds a pitch"));
  expect_all(b, d, 48, 0xCC);
  b.free(s);
  b.free(d);
}

TEST(CpuMemory, PointersThatAreNoAllocationOfThisBackendAreRejected) {
  CpuBackend b;
  CpuBackend other;
  std::uint32_t on_stack = 0;
  const DevicePtr stack{reinterpret_cast<std::uintptr_t>(&on_stack)};
  const std::uint32_t one = 1;
  const Error e = expect_error([&] { b.copy_h2d(stack, &one, sizeof one); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[copy_h2d] destination " + hex(stack)));
  EXPECT_THAT(e.what(), HasSubstr("is not inside any allocation of the cpu backend"));
  EXPECT_EQ(on_stack, 0u);

  // Memory of another backend is not this backend's.
  const DevicePtr foreign = other.alloc(64);
  other.memset(foreign, 0x5A, 64);
  const Error f = expect_error([&] { b.memset(foreign, 0, 64); });
  EXPECT_EQ(f.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(f.what(), HasSubstr("[memset] destination " + hex(foreign)));
  expect_all(other, foreign, 64, 0x5A);
  const Error ff = expect_error([&] { b.free(foreign); });
  EXPECT_EQ(ff.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(ff.what(), HasSubstr("[free] " + hex(foreign) + " is not a live allocation"));
  EXPECT_EQ(other.live_alloc_count(), 1u);
  other.free(foreign);

  // A freed pointer is no allocation either, for copies and for a second free.
  const DevicePtr gone = b.alloc(32);
  b.free(gone);
  const Error after = expect_error([&] { b.memset(gone, 0, 4); });
  EXPECT_EQ(after.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(after.what(), HasSubstr("not inside any allocation"));
  const Error twice = expect_error([&] { b.free(gone); });
  EXPECT_EQ(twice.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(twice.what(), HasSubstr("never allocated here, or already freed"));
  EXPECT_NO_THROW(b.free(DevicePtr{}));
  EXPECT_NO_THROW(b.free_pinned(nullptr));
}

TEST(CpuMemory, InteriorAndMismatchedFreesAreRejectedAndLeaveTheAllocationLive) {
  CpuBackend b;
  const DevicePtr a = b.alloc(64);
  const Error interior = expect_error([&] { b.free(a.offset(16)); });
  EXPECT_EQ(interior.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(interior.what(),
              HasSubstr("an interior pointer, 16 bytes into the allocation at " + hex(a)));
  void* h = b.alloc_pinned(64);
  const Error wrong_pinned =
      expect_error([&] { b.free(DevicePtr{reinterpret_cast<std::uintptr_t>(h)}); });
  EXPECT_EQ(wrong_pinned.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(wrong_pinned.what(), HasSubstr("free it with free_pinned"));
  const Error wrong_device = expect_error(
      [&] { b.free_pinned(reinterpret_cast<void*>(static_cast<std::uintptr_t>(a.address()))); });
  EXPECT_EQ(wrong_device.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(wrong_device.what(), HasSubstr("[free_pinned]"));
  EXPECT_THAT(wrong_device.what(), HasSubstr("free it with free"));
  EXPECT_EQ(b.live_alloc_count(), 2u);
  b.free(a);
  b.free_pinned(h);
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(CpuMemory, PinnedDeviceAddressCoversThePinnedBlockOnly) {
  CpuBackend b;
  auto* h = static_cast<std::uint8_t*>(b.alloc_pinned(100));
  const auto base = reinterpret_cast<std::uintptr_t>(h);
  EXPECT_EQ(b.pinned_device_address(h), DevicePtr{base});
  EXPECT_EQ(b.pinned_device_address(h + 50), DevicePtr{base + 50});
  EXPECT_EQ(b.pinned_device_address(h + 99), DevicePtr{base + 99});

  // The device address is usable by device-side copies.
  for (std::size_t i = 0; i < 100; ++i) h[i] = static_cast<std::uint8_t>(200 - i);
  const DevicePtr d = b.alloc(40);
  b.copy_d2d(d, b.pinned_device_address(h + 10), 40);
  const std::vector<std::uint8_t> got = read_bytes(b, d, 40);
  for (std::size_t i = 0; i < 40; ++i) EXPECT_EQ(got[i], 190 - i) << i;

  const Error past_end = expect_error([&] { (void)b.pinned_device_address(h + 100); });
  EXPECT_EQ(past_end.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(past_end.what(), HasSubstr("[pinned_device_address] " + hex(base + 100)));
  const void* device_as_host =
      reinterpret_cast<const void*>(static_cast<std::uintptr_t>(d.address()));
  const Error not_pinned = expect_error([&] { (void)b.pinned_device_address(device_as_host); });
  EXPECT_EQ(not_pinned.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(not_pinned.what(), HasSubstr("is not inside a pinned host allocation"));
  int local = 0;
  const Error stack = expect_error([&] { (void)b.pinned_device_address(&local); });
  EXPECT_EQ(stack.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(stack.what(), HasSubstr("[pinned_device_address]"));

  b.free_pinned(h);
  const Error freed = expect_error([&] { (void)b.pinned_device_address(h); });
  EXPECT_EQ(freed.code(), ErrorCode::kInvalidArgument);
  b.free(d);
}

TEST(CpuMemory, DeviceAllocationCapGivesOutOfMemoryNamingTheSize) {
  CpuBackend b;
  CpuFaults faults;
  faults.max_device_alloc = 4096;
  b.set_faults(faults);
  const Error e = expect_error([&] { b.alloc(8192); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[alloc] 8.0 KiB of device memory from memory_test.cpp:"));
  EXPECT_THAT(e.what(), HasSubstr("cap of 4.0 KiB"));
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(b.alloc_stats().failed_allocations, 1u);

  // At the cap it still works, and the cap is for device memory only.
  const DevicePtr at_cap = b.alloc(4096);
  const DevicePtr managed = b.alloc_managed(8192);
  void* pinned = b.alloc_pinned(8192);
  EXPECT_EQ(b.live_bytes(), 4096u + 8192u + 8192u);
  b.free(at_cap);
  b.free(managed);
  b.free_pinned(pinned);
  EXPECT_EQ(b.live_bytes(), 0u);

  // Clearing the faults lifts the cap.
  b.set_faults(CpuFaults{});
  const DevicePtr big = b.alloc(8192);
  b.free(big);
}

TEST(CpuMemory, FailAllocAtFailsExactlyTheNthAllocationOfAnyKind) {
  CpuBackend b;
  CpuFaults faults;
  faults.fail_call_at = 3;
  faults.fail_call_of = "alloc";
  b.set_faults(faults);
  const DevicePtr first = b.alloc(16);
  const DevicePtr second = b.alloc_managed(16);
  const Error e = expect_error([&] { b.alloc_pinned(16); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[alloc_pinned] 16 B of pinned memory"));
  EXPECT_THAT(e.what(), HasSubstr("injected failure (alloc call #3, call #3 of all)"));
  EXPECT_EQ(b.live_alloc_count(), 2u);
  const DevicePtr fourth = b.alloc(16);
  EXPECT_EQ(b.live_alloc_count(), 3u);
  b.free(first);
  b.free(second);
  b.free(fourth);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(b.alloc_stats().failed_allocations, 1u);

  // set_faults restarts the count.
  faults.fail_call_at = 1;
  b.set_faults(faults);
  const Error again = expect_error([&] { b.alloc(16); });
  EXPECT_EQ(again.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(again.what(), HasSubstr("alloc call #1,"));
  const DevicePtr ok = b.alloc(16);
  b.free(ok);
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(CpuMemory, AnImpossibleSizeIsOutOfMemoryWithNothingLeaked) {
  CpuBackend b;
  const Error e = expect_error([&] { b.alloc(SIZE_MAX); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[alloc]"));
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(b.live_alloc_count(), 0u);
}

TEST(CpuMemory, ManagedMemoryIsUsableAndOnTheLedger) {
  CpuBackend b;
  const DevicePtr m = b.alloc_managed(1000);
  EXPECT_EQ(b.live_bytes(), 1000u);
  b.memset(m, 0x3C, 1000);
  expect_all(b, m, 1000, 0x3C);
  EXPECT_THAT(b.alloc_report(), HasSubstr("memory_test.cpp"));
  b.free(m);
  EXPECT_EQ(b.live_bytes(), 0u);
}

TEST(CpuMemory, DestructionSweepsWhatWasNeverFreed) {
  testing::LogCapture logs(log::Level::kWarn);
  LedgerProbe probe = [] {
    CpuBackend b;
    (void)b.alloc(1000);
    (void)b.alloc_pinned(24);
    return b.ledger_probe();
  }();
  EXPECT_EQ(probe.live_bytes(), 0u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "2 allocation(s) never freed"), 1u);
}

TEST(CpuMemory, MemoryQueriesDescribeTheHost) {
  CpuBackendOptions options;
  options.threads = 3;
  CpuBackend b(options);
  EXPECT_EQ(b.name(), "cpu");
  const std::size_t total = b.total_memory();
  const std::size_t free = b.free_memory();
  EXPECT_GT(free, 0u);
  EXPECT_GT(total, free);
  EXPECT_GT(b.driver_free_memory(), 0u);
  EXPECT_LT(b.driver_free_memory(), total);
  EXPECT_EQ(b.sm_count(), 3u);
  EXPECT_THAT(b.device_name(), HasSubstr("(3 threads, "));
  CpuBackend all;
  EXPECT_GE(all.sm_count(), 1u);
}

}  // namespace
}  // namespace metrale
