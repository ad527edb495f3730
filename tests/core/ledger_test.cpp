// The allocation ledger (docs/CONTRACT.md, ledger) on its own, and as the CPU backend uses it: call
// sites, frees, bad frees, the sweep, stats and the probe.
#include "metrale/ledger.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::random_size;
using testing::rng;

constexpr std::size_t kMiB = 1024 * 1024;

LedgerEntry entry(std::uint64_t address, std::size_t bytes, const char* file, std::uint32_t line,
                  MemoryKind kind = MemoryKind::kDevice) {
  return LedgerEntry{DevicePtr{address}, bytes, kind, CallSite{file, line}};
}

std::unique_ptr<CpuBackend> make_backend() {
  return std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
}

// ---- AllocationLedger ----

TEST(AllocationLedger, RecordTakeFindAndLiveTotals) {
  AllocationLedger ledger;
  EXPECT_EQ(ledger.live_bytes(), 0u);
  EXPECT_EQ(ledger.live_count(), 0u);
  const std::size_t a = random_size(1, 1 << 20), b = random_size(1, 1 << 20);
  ledger.record(entry(0x1000, a, "src/x/alpha.cpp", 10, MemoryKind::kManaged));
  ledger.record(entry(0x2000, b, "beta.cpp", 20));
  EXPECT_EQ(ledger.live_bytes(), a + b);
  EXPECT_EQ(ledger.live_count(), 2u);

  const auto found = ledger.find(DevicePtr{0x1000});
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->bytes, a);
  EXPECT_EQ(found->kind, MemoryKind::kManaged);
  EXPECT_EQ(found->site.str(), "alpha.cpp:10");
  EXPECT_FALSE(ledger.find(DevicePtr{0x1001}).has_value());  // interior: not an entry
  EXPECT_FALSE(ledger.find(DevicePtr{0x3000}).has_value());

  const auto taken = ledger.take(DevicePtr{0x2000});
  ASSERT_TRUE(taken.has_value());
  EXPECT_EQ(taken->bytes, b);
  EXPECT_EQ(taken->site.line, 20u);
  EXPECT_FALSE(ledger.take(DevicePtr{0x2000}).has_value());  // gone
  EXPECT_FALSE(ledger.find(DevicePtr{0x2000}).has_value());
  EXPECT_EQ(ledger.live_bytes(), a);
  EXPECT_EQ(ledger.live_count(), 1u);
}

// containing() finds the allocation around any address inside it, and none at its end, in a
// gap, before the first or after the last one.
TEST(AllocationLedger, ContainingFindsInteriorAddresses) {
  AllocationLedger ledger;
  ledger.record(entry(0x1000, 0x100, "a.cpp", 1));
  ledger.record(entry(0x2000, 0x10, "b.cpp", 2));
  for (const std::uint64_t a : {0x1000ull, 0x1001ull, 0x10FFull}) {
    const auto e = ledger.containing(a);
    ASSERT_TRUE(e.has_value()) << a;
    EXPECT_EQ(e->ptr.address(), 0x1000u);
  }
  EXPECT_EQ(ledger.containing(0x200F)->ptr.address(), 0x2000u);
  for (const std::uint64_t a : {0x0FFFull, 0x1100ull, 0x1800ull, 0x2010ull, 0ull}) {
    EXPECT_FALSE(ledger.containing(a).has_value()) << a;
  }
  ledger.take(DevicePtr{0x1000});
  EXPECT_FALSE(ledger.containing(0x1001).has_value());
}

TEST(AllocationLedger, StatsCountCurrentPeakAllocatedFreedAndFailures) {
  AllocationLedger ledger;
  const std::size_t a = random_size(1, 1000), b = random_size(1, 1000), c = random_size(1, 1000);
  ledger.record(entry(0x100, a, "f.cpp", 1));
  ledger.record(entry(0x200, b, "f.cpp", 2));
  ASSERT_TRUE(ledger.take(DevicePtr{0x100}));
  ledger.record(entry(0x300, c, "f.cpp", 3));
  ledger.note_failure();
  ledger.note_failure();
  EXPECT_FALSE(ledger.take(DevicePtr{0x999}));  // a miss changes no counter

  const AllocStats s = ledger.stats();
  EXPECT_EQ(s.current_bytes, b + c);
  EXPECT_EQ(s.peak_bytes, std::max(a + b, b + c));
  EXPECT_EQ(s.allocated_bytes, a + b + c);
  EXPECT_EQ(s.freed_bytes, a);
  EXPECT_EQ(s.current_count, 2u);
  EXPECT_EQ(s.allocation_count, 3u);
  EXPECT_EQ(s.free_count, 1u);
  EXPECT_EQ(s.failed_allocations, 2u);
}

TEST(AllocationLedger, BorrowedRangesAreCountedApartFromOwnedBytes) {
  AllocationLedger ledger;
  const std::size_t owned = random_size(1, 1 << 20), lent = random_size(1, 1 << 20);
  ledger.record(entry(0x10000000, owned, "own.cpp", 1));
  ledger.record(entry(0x20000000, lent, "lend.cpp", 2, MemoryKind::kBorrowed));
  EXPECT_EQ(ledger.live_bytes(), owned);
  EXPECT_EQ(ledger.live_count(), 1u);
  AllocStats s = ledger.stats();
  EXPECT_EQ(s.current_bytes, owned);
  EXPECT_EQ(s.peak_bytes, owned);
  EXPECT_EQ(s.allocated_bytes, owned);
  EXPECT_EQ(s.allocation_count, 1u);
  EXPECT_EQ(s.borrowed_bytes, lent);
  EXPECT_EQ(s.borrowed_count, 1u);
  EXPECT_EQ(s.borrow_count, 1u);
  // Still found, for range checks and for free() to refuse it.
  ASSERT_TRUE(ledger.containing(0x20000000 + lent - 1).has_value());
  EXPECT_EQ(ledger.containing(0x20000000)->kind, MemoryKind::kBorrowed);
  EXPECT_THAT(ledger.report(), HasSubstr(fmt::format("and {} borrowed in 1 range(s), not owned",
                                                     format_bytes(lent))));
  EXPECT_THAT(ledger.report(), Not(HasSubstr("lend.cpp")));

  ASSERT_TRUE(ledger.take(DevicePtr{0x20000000}).has_value());
  s = ledger.stats();
  EXPECT_EQ(s.borrowed_bytes, 0u);
  EXPECT_EQ(s.borrowed_count, 0u);
  EXPECT_EQ(s.borrow_count, 1u);
  EXPECT_EQ(s.freed_bytes, 0u);  // giving a borrow back frees nothing of metrale's
  EXPECT_EQ(s.free_count, 0u);
  EXPECT_EQ(ledger.live_bytes(), owned);
}

TEST(AllocationLedger, OverlappingFindsAnyEntrySharingAByte) {
  AllocationLedger ledger;
  ledger.record(entry(0x1000, 0x100, "a.cpp", 1));
  ledger.record(entry(0x2000, 0x100, "b.cpp", 2, MemoryKind::kBorrowed));
  auto at = [&](std::uint64_t address, std::size_t bytes) {
    const auto e = ledger.overlapping(address, bytes);
    return e ? e->ptr.address() : std::uint64_t{0};
  };
  EXPECT_EQ(at(0x0f00, 0x100), 0u);       // ends where the first begins
  EXPECT_EQ(at(0x0f00, 0x101), 0x1000u);  // one byte into it
  EXPECT_EQ(at(0x10ff, 1), 0x1000u);      // its last byte
  EXPECT_EQ(at(0x1100, 0xf00), 0u);       // the gap, exactly
  EXPECT_EQ(at(0x1100, 0xf01), 0x2000u);
  EXPECT_EQ(at(0x0800, 0x4000), 0x1000u);  // covers both: the lowest
  EXPECT_EQ(at(0x2100, 0x1000), 0u);       // past the last
}

TEST(AllocationLedger, RecordingAPointerTwiceIsAnInternalError) {
  AllocationLedger ledger;
  ledger.record(entry(0xabc0, 64, "first.cpp", 11));
  const Error e = expect_error([&] { ledger.record(entry(0xabc0, 128, "second.cpp", 22)); });
  EXPECT_EQ(e.code(), ErrorCode::kInternal);
  EXPECT_THAT(e.what(), HasSubstr("[ledger]"));
  EXPECT_THAT(e.what(), HasSubstr("0xabc0"));
  EXPECT_THAT(e.what(), HasSubstr("first.cpp:11"));
  EXPECT_THAT(e.what(), HasSubstr("second.cpp:22"));
  // The first record stands, and the counters did not move.
  EXPECT_EQ(ledger.live_bytes(), 64u);
  EXPECT_EQ(ledger.find(DevicePtr{0xabc0})->site.line, 11u);
  EXPECT_EQ(ledger.stats().allocation_count, 1u);
}

TEST(AllocationLedger, DrainReturnsLargestFirstAndEmpties) {
  AllocationLedger ledger;
  std::vector<std::size_t> sizes;
  for (std::uint64_t i = 0; i < 12; ++i) {
    // Distinct sizes so the order is fully determined.
    const std::size_t bytes = random_size(1, 1 << 16) * 16 + i;
    sizes.push_back(bytes);
    ledger.record(entry(0x10000 * (i + 1), bytes, "d.cpp", static_cast<std::uint32_t>(i)));
  }
  const std::size_t total = ledger.live_bytes();
  const std::vector<LedgerEntry> peek = ledger.entries();
  EXPECT_EQ(peek.size(), sizes.size());
  EXPECT_EQ(ledger.live_count(), sizes.size());  // entries() does not take

  const std::vector<LedgerEntry> drained = ledger.drain();
  std::sort(sizes.begin(), sizes.end(), std::greater<>());
  ASSERT_EQ(drained.size(), sizes.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(drained[i].bytes, sizes[i]) << "position " << i;
    EXPECT_EQ(peek[i].bytes, sizes[i]) << "position " << i;
  }
  EXPECT_EQ(ledger.live_bytes(), 0u);
  EXPECT_EQ(ledger.live_count(), 0u);
  EXPECT_TRUE(ledger.drain().empty());
  const AllocStats s = ledger.stats();
  EXPECT_EQ(s.current_bytes, 0u);
  EXPECT_EQ(s.current_count, 0u);
  EXPECT_EQ(s.freed_bytes, total);
  EXPECT_EQ(s.free_count, sizes.size());
  EXPECT_EQ(s.peak_bytes, total);
}

TEST(AllocationLedger, ReportHeaderTopSitesLargestFirstAndByFile) {
  AllocationLedger ledger;
  // Site big.cpp:5 holds two allocations; layers.cpp has two sites.
  ledger.record(entry(0x1000, 3 * kMiB, "src/model/big.cpp", 5));
  ledger.record(entry(0x2000, 2 * kMiB, "src/model/big.cpp", 5));
  ledger.record(entry(0x3000, 4 * kMiB, "src/ops/layers.cpp", 40));
  ledger.record(entry(0x4000, 2048, "src/ops/layers.cpp", 41));
  const std::string r = ledger.report();
  EXPECT_THAT(r,
              HasSubstr("allocation ledger: 9.0 MiB live in 4 allocation(s) from 3 call site(s)"));
  const auto big = r.find("big.cpp:5");
  const auto l40 = r.find("layers.cpp:40");
  const auto l41 = r.find("layers.cpp:41");
  ASSERT_NE(big, std::string::npos);
  ASSERT_NE(l40, std::string::npos);
  ASSERT_NE(l41, std::string::npos);
  EXPECT_LT(big, l40);  // 5 MiB before 4 MiB before 2 KiB
  EXPECT_LT(l40, l41);
  EXPECT_THAT(r, HasSubstr("5.0 MiB      2 alloc(s)  big.cpp:5"));
  EXPECT_THAT(r, HasSubstr("2.0 KiB      1 alloc(s)  layers.cpp:41"));
  EXPECT_THAT(r, Not(HasSubstr("more site(s)")));
  EXPECT_THAT(r, Not(HasSubstr("src/model")));  // directories are dropped

  const auto by_file = r.find("by file:\n");
  ASSERT_NE(by_file, std::string::npos);
  const std::string rollup = r.substr(by_file);
  EXPECT_THAT(rollup, HasSubstr("5.0 MiB      2 alloc(s)  big.cpp\n"));
  EXPECT_THAT(rollup, HasSubstr("4.0 MiB      2 alloc(s)  layers.cpp\n"));
  EXPECT_LT(rollup.find("big.cpp"), rollup.find("layers.cpp"));
  EXPECT_GT(by_file, r.find("layers.cpp:41"));         // the rollup follows the sites
  EXPECT_EQ(r.find("by file:"), r.rfind("by file:"));  // once
}

TEST(AllocationLedger, ReportFoldsSitesBeyondTopN) {
  AllocationLedger ledger;
  ledger.record(entry(0x1000, 8 * kMiB, "a.cpp", 1));
  ledger.record(entry(0x2000, 4 * kMiB, "b.cpp", 2));
  ledger.record(entry(0x3000, 2 * kMiB, "c.cpp", 3));
  ledger.record(entry(0x4000, 1 * kMiB, "c.cpp", 4));
  ledger.record(entry(0x5000, 1 * kMiB, "c.cpp", 4));
  const std::string r = ledger.report(2);
  EXPECT_THAT(r, HasSubstr("from 4 call site(s)"));
  EXPECT_THAT(r, HasSubstr("a.cpp:1"));
  EXPECT_THAT(r, HasSubstr("b.cpp:2"));
  EXPECT_THAT(r, Not(HasSubstr("c.cpp:3")));
  EXPECT_THAT(r, Not(HasSubstr("c.cpp:4")));
  EXPECT_THAT(r, HasSubstr("4.0 MiB      3 alloc(s)  (2 more site(s))"));
  EXPECT_THAT(r, HasSubstr("4.0 MiB      3 alloc(s)  c.cpp\n"));  // still in the rollup

  const std::string none = ledger.report(0);
  EXPECT_THAT(none, HasSubstr("16.0 MiB      5 alloc(s)  (4 more site(s))"));
}

TEST(AllocationLedger, ReportFoldsSitesBelowMinMb) {
  AllocationLedger ledger;
  ledger.record(entry(0x1000, 3 * kMiB, "big.cpp", 1));
  ledger.record(entry(0x2000, kMiB / 2, "small.cpp", 2));
  ledger.record(entry(0x3000, 100, "tiny.cpp", 3));
  const std::string r = ledger.report(10, 1.0);
  EXPECT_THAT(r, HasSubstr("big.cpp:1"));
  EXPECT_THAT(r, Not(HasSubstr("small.cpp:2")));
  EXPECT_THAT(r, Not(HasSubstr("tiny.cpp:3")));
  EXPECT_THAT(r, HasSubstr("2 alloc(s)  (2 more site(s))"));
  EXPECT_THAT(r, HasSubstr("small.cpp\n"));
  EXPECT_THAT(r, HasSubstr("tiny.cpp\n"));
  // Exactly min_mb is kept.
  EXPECT_THAT(ledger.report(10, 3.0), HasSubstr("big.cpp:1"));
  EXPECT_THAT(ledger.report(10, 3.0), HasSubstr("(2 more site(s))"));
}

TEST(AllocationLedger, EmptyReport) {
  AllocationLedger ledger;
  const std::string r = ledger.report();
  EXPECT_THAT(r, HasSubstr("allocation ledger: 0 B live in 0 allocation(s) from 0 call site(s)"));
  EXPECT_THAT(r, Not(HasSubstr("more site(s)")));
  EXPECT_THAT(r, Not(HasSubstr("by file:")));
}

TEST(FormatBytes, Units) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.0 KiB");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(kMiB), "1.0 MiB");
  EXPECT_EQ(format_bytes(std::size_t{3} << 30), "3.00 GiB");
}

// ---- through the CPU backend ----

TEST(BackendLedger, AllocRecordsTheCallersFileAndLine) {
  auto backend = make_backend();
  const std::size_t n = random_size(1, 4096);
  const auto [p, line] = std::pair(backend->alloc(n), __LINE__);
  const auto [m, mline] = std::pair(backend->alloc_managed(n + 1), __LINE__);
  EXPECT_EQ(backend->live_bytes(), 2 * n + 1);
  EXPECT_EQ(backend->live_alloc_count(), 2u);
  const std::string r = backend->alloc_report();
  EXPECT_THAT(r, HasSubstr(fmt::format("ledger_test.cpp:{}", line)));
  EXPECT_THAT(r, HasSubstr(fmt::format("ledger_test.cpp:{}", mline)));
  EXPECT_THAT(r, Not(HasSubstr("backend.cpp")));
  EXPECT_THAT(r, HasSubstr("from 2 call site(s)"));
  backend->free(p);
  backend->free(m);
}

TEST(BackendLedger, FreeTakesTheEntryOff) {
  auto backend = make_backend();
  const std::size_t a = random_size(1, 4096), b = random_size(1, 4096);
  const DevicePtr pa = backend->alloc(a);
  const DevicePtr pb = backend->alloc(b);
  backend->free(pa);
  EXPECT_EQ(backend->live_bytes(), b);
  EXPECT_EQ(backend->live_alloc_count(), 1u);
  const AllocStats s = backend->alloc_stats();
  EXPECT_EQ(s.freed_bytes, a);
  EXPECT_EQ(s.free_count, 1u);
  EXPECT_EQ(s.allocated_bytes, a + b);
  backend->free(DevicePtr{});  // null: nothing happens
  EXPECT_EQ(backend->live_bytes(), b);
  backend->free(pb);
  EXPECT_EQ(backend->live_bytes(), 0u);
  EXPECT_EQ(backend->live_alloc_count(), 0u);
}

// A bad free throws kInvalidArgument naming [free] and the address, and changes nothing.
void expect_bad_free(CpuBackend& backend, DevicePtr bad) {
  const std::size_t bytes = backend.live_bytes();
  const std::size_t count = backend.live_alloc_count();
  const AllocStats before = backend.alloc_stats();
  const Error e = expect_error([&] { backend.free(bad); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[free]"));
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("0x{:x}", bad.address())));
  EXPECT_EQ(backend.live_bytes(), bytes);
  EXPECT_EQ(backend.live_alloc_count(), count);
  EXPECT_EQ(backend.alloc_stats().free_count, before.free_count);
}

TEST(BackendLedger, FreeingAnInteriorPointerThrows) {
  auto backend = make_backend();
  const std::size_t n = random_size(16, 4096);
  const DevicePtr p = backend->alloc(n);
  const DevicePtr inside = p.offset(random_size(1, n - 1));
  expect_bad_free(*backend, inside);
  const Error e = expect_error([&] { backend->free(inside); });
  EXPECT_THAT(e.what(), HasSubstr("interior pointer"));
  backend->free(p);  // the allocation itself is still freeable
  EXPECT_EQ(backend->live_bytes(), 0u);
}

TEST(BackendLedger, FreeingAForeignPointerThrows) {
  auto mine = make_backend();
  auto other = make_backend();
  const DevicePtr keep = mine->alloc(128);
  const DevicePtr theirs = other->alloc(random_size(1, 4096));
  expect_bad_free(*mine, theirs);
  expect_bad_free(*mine, DevicePtr{0xdead0000});
  other->free(theirs);  // still live on its own backend
  mine->free(keep);
}

TEST(BackendLedger, DoubleFreeThrows) {
  auto backend = make_backend();
  const DevicePtr keep = backend->alloc(random_size(1, 4096));
  const DevicePtr p = backend->alloc(random_size(1, 4096));
  backend->free(p);
  expect_bad_free(*backend, p);
  const Error e = expect_error([&] { backend->free(p); });
  EXPECT_THAT(e.what(), HasSubstr("not a live allocation of the cpu backend"));
  backend->free(keep);
}

TEST(BackendLedger, AllocOfZeroBytesThrows) {
  auto backend = make_backend();
  const auto [e, line] = std::pair(expect_error([&] { backend->alloc(0); }), __LINE__);
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[alloc]"));
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("ledger_test.cpp:{}", line)));
  const Error m = expect_error([&] { backend->alloc_managed(0); });
  EXPECT_THAT(m.what(), HasSubstr("[alloc_managed]"));
  const Error h = expect_error([&] { backend->alloc_pinned(0); });
  EXPECT_THAT(h.what(), HasSubstr("[alloc_pinned]"));
  EXPECT_EQ(backend->live_alloc_count(), 0u);
  EXPECT_EQ(backend->alloc_stats().allocation_count, 0u);
}

TEST(BackendLedger, SweepFreesLeftoversAndWarnsOnce) {
  auto backend = make_backend();
  const std::size_t n = random_size(1, 4096);
  const std::size_t k = random_size(2, 6);
  const DevicePtr kept = backend->alloc(7);
  backend->free(kept);
  int line = 0;
  for (std::size_t i = 0; i < k; ++i) {
    line = std::pair(backend->alloc(n + i), __LINE__).second;
  }
  testing::LogCapture logs;
  EXPECT_EQ(backend->sweep_unreleased(), k);
  EXPECT_EQ(backend->live_bytes(), 0u);
  EXPECT_EQ(backend->live_alloc_count(), 0u);
  const auto lines = logs.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].level, log::Level::kWarn);
  EXPECT_THAT(lines[0].text, HasSubstr(fmt::format("{} allocation(s) never freed", k)));
  EXPECT_THAT(lines[0].text, HasSubstr(fmt::format("ledger_test.cpp:{}", line)));
  EXPECT_THAT(lines[0].text, HasSubstr("cpu sweep"));
  EXPECT_EQ(backend->alloc_stats().free_count, k + 1);

  // Nothing left: no warning, zero found; the swept memory really was freed.
  EXPECT_EQ(backend->sweep_unreleased(), 0u);
  EXPECT_EQ(logs.lines().size(), 1u);
}

TEST(BackendLedger, SweepNamesTheFiveLargestSites) {
  auto backend = make_backend();
  std::vector<int> lines;
  for (std::size_t i = 1; i <= 7; ++i) {
    lines.push_back(std::pair(backend->alloc(i * 1000), __LINE__).second);
  }
  testing::LogCapture logs;
  EXPECT_EQ(backend->sweep_unreleased(), 7u);
  ASSERT_EQ(logs.lines().size(), 1u);
  const std::string text = logs.lines()[0].text;
  // All seven came from one line; the message lists the five largest allocations.
  const std::string site = fmt::format("ledger_test.cpp:{}", lines[0]);
  std::size_t mentions = 0;
  for (auto at = text.find(site); at != std::string::npos; at = text.find(site, at + 1)) ++mentions;
  EXPECT_EQ(mentions, 5u);
  EXPECT_THAT(text, HasSubstr("6.8 KiB at"));      // 7000 B, the largest
  EXPECT_THAT(text, Not(HasSubstr("1000 B at")));  // the smallest is not listed
}

TEST(BackendLedger, AnInjectedFailureCountsAsAFailedAllocation) {
  auto backend = make_backend();
  const DevicePtr first = backend->alloc(64);
  CpuFaults faults;
  faults.fail_call_at = 1;
  faults.fail_call_of = "alloc";
  backend->set_faults(faults);
  const Error e = expect_error([&] { backend->alloc(256); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[alloc]"));
  EXPECT_THAT(e.what(), HasSubstr("injected failure"));
  EXPECT_THAT(e.what(), HasSubstr("ledger_test.cpp"));
  AllocStats s = backend->alloc_stats();
  EXPECT_EQ(s.failed_allocations, 1u);
  EXPECT_EQ(s.allocation_count, 1u);
  EXPECT_EQ(backend->live_bytes(), 64u);

  // The cap fails device allocations above it.
  CpuFaults cap;
  cap.max_device_alloc = 1000;
  backend->set_faults(cap);
  EXPECT_EQ(expect_error([&] { backend->alloc(1001); }).code(), ErrorCode::kOutOfMemory);
  const DevicePtr fits = backend->alloc(1000);
  s = backend->alloc_stats();
  EXPECT_EQ(s.failed_allocations, 2u);
  EXPECT_EQ(s.allocation_count, 2u);
  backend->free(fits);
  backend->free(first);
}

TEST(BackendLedger, PinnedAndDeviceFreesDoNotMix) {
  auto backend = make_backend();
  const std::size_t n = random_size(1, 4096);
  const DevicePtr dev = backend->alloc(n);
  const auto [pinned, pline] = std::pair(backend->alloc_pinned(n + 1), __LINE__);
  EXPECT_EQ(backend->live_bytes(), 2 * n + 1);

  const Error a = expect_error([&] {
    backend->free_pinned(reinterpret_cast<void*>(static_cast<std::uintptr_t>(dev.address())));
  });
  EXPECT_EQ(a.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(a.what(), HasSubstr("[free_pinned]"));
  EXPECT_THAT(a.what(), HasSubstr(fmt::format("0x{:x} is device memory", dev.address())));

  const DevicePtr as_device{reinterpret_cast<std::uintptr_t>(pinned)};
  const Error b = expect_error([&] { backend->free(as_device); });
  EXPECT_EQ(b.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(b.what(), HasSubstr("[free]"));
  EXPECT_THAT(b.what(), HasSubstr(fmt::format("0x{:x} is pinned memory", as_device.address())));
  EXPECT_THAT(b.what(), HasSubstr(fmt::format("ledger_test.cpp:{}", pline)));

  EXPECT_EQ(backend->live_bytes(), 2 * n + 1);
  EXPECT_EQ(backend->live_alloc_count(), 2u);
  EXPECT_EQ(backend->alloc_stats().free_count, 0u);
  // Both are still usable and freeable the right way.
  backend->memset(dev, 0x3c, n);
  static_cast<unsigned char*>(pinned)[n] = 0x5a;
  backend->free_pinned(pinned);
  backend->free(dev);
  EXPECT_EQ(backend->live_bytes(), 0u);
  backend->free_pinned(nullptr);  // null: nothing happens
}

TEST(LedgerProbe, OutlivesTheBackend) {
  auto backend = make_backend();
  LedgerProbe probe = backend->ledger_probe();
  const std::size_t n = random_size(1, 4096);
  const DevicePtr freed = backend->alloc(n);
  backend->alloc(n + 10);  // left for the destructor's sweep
  backend->free(freed);
  EXPECT_EQ(probe.live_bytes(), n + 10);
  EXPECT_EQ(probe.live_count(), 1u);
  EXPECT_THAT(probe.report(), HasSubstr("from 1 call site(s)"));
  {
    testing::LogCapture logs;
    backend.reset();
    EXPECT_EQ(logs.count(log::Level::kWarn, "1 allocation(s) never freed"), 1u);
  }
  EXPECT_EQ(probe.live_bytes(), 0u);
  EXPECT_EQ(probe.live_count(), 0u);
  const AllocStats s = probe.stats();
  EXPECT_EQ(s.allocated_bytes, 2 * n + 10);
  EXPECT_EQ(s.freed_bytes, 2 * n + 10);
  EXPECT_EQ(s.free_count, 2u);
  EXPECT_THAT(probe.report(), HasSubstr("0 B live in 0 allocation(s)"));
}

}  // namespace
}  // namespace metrale
