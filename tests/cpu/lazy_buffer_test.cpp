// Lazy buffers on the CPU backend (mmap): growth in steps with a stable base and kept data, ops
// on lazy memory, every refusal with its message and nothing left behind, a failing granule
// undoing itself at every position, release rules and the ledger.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/lazy_buffer.h"
#include "metrale/model_scope.h"
#include "metrale/ops/elementwise.h"
#include "support/log_capture.h"
#include "support/scoped_env.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGranule = 2 * kMiB;

using testing::ScopedEnv;

// The protection of the mapping holding address, as /proc/self/maps prints it ("rw-p",
// "---p"), so a test sees what the kernel committed rather than what the buffer believes.
std::string protection_at(std::uint64_t address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::uint64_t lo = 0, hi = 0;
    char perms[5] = {};
    if (std::sscanf(line.c_str(), "%" SCNx64 "-%" SCNx64 " %4s", &lo, &hi, perms) != 3) continue;
    if (address >= lo && address < hi) return perms;
  }
  return "unmapped";
}

std::vector<std::uint32_t> read_u32(Backend& b, DevicePtr p, std::size_t n) {
  std::vector<std::uint32_t> out(n);
  b.copy_d2h(out.data(), p, n * 4);
  return out;
}

// Faults that fail the nth call whose name begins with call.
CpuFaults failing(const char* call, std::uint64_t n) {
  CpuFaults f;
  f.fail_call_at = n;
  f.fail_call_of = call;
  return f;
}

struct LazyCpu : ::testing::Test {
  CpuBackend b{CpuBackendOptions{.threads = 2}};
  std::size_t live0 = b.live_bytes();
  std::size_t count0 = b.live_alloc_count();
  void expect_ledger_back() {
    EXPECT_EQ(b.live_bytes(), live0);
    EXPECT_EQ(b.live_alloc_count(), count0);
  }
};

TEST_F(LazyCpu, GrowsInStepsWithAStableBaseAndKeepsData) {
  LazyBuffer buf = b.reserve_lazy(10 * kMiB, "kv");
  EXPECT_EQ(buf.granularity(), kGranule);
  EXPECT_EQ(buf.budget_bytes(), 10 * kMiB);
  EXPECT_EQ(buf.mapped_bytes(), 0u);
  EXPECT_EQ(buf.base().address() % kGranule, 0u);
  const DevicePtr base = buf.base();
  EXPECT_EQ(buf.grow(1), kGranule);  // rounded up to a granule
  const std::uint32_t first[4] = {1, 2, 3, 4};
  b.copy_h2d(base, first, sizeof first);
  EXPECT_EQ(b.live_bytes(), live0 + kGranule);
  EXPECT_EQ(buf.grow(kGranule), kGranule);  // nothing more to map
  EXPECT_EQ(buf.grow(5 * kMiB), 6 * kMiB);
  EXPECT_EQ(buf.grow(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(buf.base(), base);
  EXPECT_EQ(read_u32(b, base, 4), (std::vector<std::uint32_t>{1, 2, 3, 4}));
  EXPECT_EQ(b.live_bytes(), live0 + 10 * kMiB);
  const auto entry = b.ledger_probe().find(base);
  ASSERT_TRUE(entry.has_value());
  EXPECT_EQ(entry->kind, MemoryKind::kLazy);
  EXPECT_EQ(entry->bytes, 10 * kMiB);
  EXPECT_THAT(entry->site.str(), HasSubstr("lazy_buffer_test.cpp"));
  EXPECT_EQ(protection_at(base.address() + 10 * kMiB - 1), "rw-p");
  buf.release();
  EXPECT_FALSE(buf.live());
  EXPECT_EQ(buf.mapped_bytes(), 0u);
  expect_ledger_back();
}

TEST_F(LazyCpu, OpsRunOnLazyMemoryAndBeyondMappedIsRefused) {
  LazyBuffer buf = b.reserve_lazy(8 * kMiB, "scratch");
  buf.grow(4 * kMiB);
  const StreamHandle s = b.default_stream();
  // A range across the granule boundary: one allocation to the ops, as on the GPU.
  const std::size_t n = 1024;
  const DevicePtr y = buf.base().offset(kGranule - 2048);
  const DevicePtr x = buf.base().offset(3 * kMiB);
  ops::fill_u32(b, s, y, n, 0x3f800000u);  // 1.0f
  ops::fill_u32(b, s, x, n, 0x40000000u);  // 2.0f
  ops::axpy_f32(b, s, y, x, 3.0f, n);
  std::vector<float> out(n);
  b.copy_d2h(out.data(), y, n * 4);
  for (float v : out) ASSERT_EQ(v, 7.0f);
  // The end of the mapping is the end of the memory.
  const DevicePtr edge = buf.base().offset(4 * kMiB - 8);
  const Error e = expect_error([&] { ops::fill_u32(b, s, edge, 4, 0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("+ 16 bytes lies beyond the {} mapped bytes of lazy "
                                              "buffer 'scratch'",
                                              4 * kMiB)));
  EXPECT_THAT(e.what(), HasSubstr("(grow it first)"));
  buf.release();
  expect_ledger_back();
}

TEST_F(LazyCpu, ABudgetBelowOneGranuleIsRefused) {
  const Error e = expect_error([&] { (void)b.reserve_lazy(kGranule - 1, "tiny"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(),
              HasSubstr(fmt::format("[reserve_lazy] budget_bytes = {} for 'tiny'", kGranule - 1)));
  EXPECT_THAT(e.what(), HasSubstr("is below one granule of the cpu backend (2097152 bytes)"));
  expect_ledger_back();
  // A budget between granules is rounded down: the budget is a ceiling.
  LazyBuffer buf = b.reserve_lazy(3 * kMiB, "odd");
  EXPECT_EQ(buf.budget_bytes(), kGranule);
}

TEST_F(LazyCpu, GrowthPastTheBudgetIsRefusedAndChangesNothing) {
  LazyBuffer buf = b.reserve_lazy(4 * kMiB, "kv");
  buf.grow(kGranule);
  const Error e = expect_error([&] { buf.grow(4 * kMiB + 1); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("[LazyBuffer::grow] bytes = {} is past the budget "
                                              "of lazy buffer 'kv'",
                                              4 * kMiB + 1)));
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("({} bytes; {} mapped)", 4 * kMiB, kGranule)));
  EXPECT_EQ(buf.mapped_bytes(), kGranule);
  EXPECT_EQ(b.live_bytes(), live0 + kGranule);
  buf.release();
  expect_ledger_back();
}

TEST_F(LazyCpu, MappingWhileAnyStreamCapturesIsRefused) {
  LazyBuffer buf = b.reserve_lazy(4 * kMiB, "graph scratch");
  buf.grow(kGranule);
  const StreamHandle side = b.create_stream();  // not the default stream: any stream counts
  b.begin_capture(side);
  const Error e = expect_error([&] { buf.grow(4 * kMiB); });
  EXPECT_EQ(e.code(), ErrorCode::kCapture);
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("[LazyBuffer::grow] bytes = {}: a stream of the cpu "
                                              "backend is capturing; mapping lazy buffer 'graph "
                                              "scratch'",
                                              4 * kMiB)));
  EXPECT_EQ(buf.mapped_bytes(), kGranule);
  EXPECT_EQ(buf.grow(kGranule), kGranule);  // nothing to map: allowed inside the capture
  b.abort_capture(side);
  EXPECT_EQ(buf.grow(4 * kMiB), 4 * kMiB);
  b.destroy_stream(side);
  buf.release();
  expect_ledger_back();
}

TEST_F(LazyCpu, MappingBelowTheFreeFloorIsRefused) {
  LazyBuffer buf = b.reserve_lazy(4 * kMiB, "kv");
  {
    // 1 TiB: above this machine's free memory.
    ScopedEnv floor("METRALE_LAZY_FREE_FLOOR_MB", "1048576");
    const Error e = expect_error([&] { buf.grow(kGranule); });
    EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
    EXPECT_THAT(e.what(), HasSubstr("[LazyBuffer::grow] bytes = 2097152: mapping 2.0 MiB more for "
                                    "lazy buffer 'kv'"));
    EXPECT_THAT(e.what(), HasSubstr("below the floor of 1024.00 GiB set by "
                                    "METRALE_LAZY_FREE_FLOOR_MB"));
    EXPECT_EQ(buf.mapped_bytes(), 0u);
    EXPECT_EQ(b.live_bytes(), live0);
  }
  {
    ScopedEnv floor("METRALE_LAZY_FREE_FLOOR_MB", "1");  // far below what is free
    EXPECT_EQ(buf.grow(kGranule), kGranule);
  }
  {
    testing::LogCapture logs(log::Level::kWarn);
    ScopedEnv floor("METRALE_LAZY_FREE_FLOOR_MB", "lots");
    EXPECT_EQ(buf.grow(4 * kMiB), 4 * kMiB);
    EXPECT_EQ(logs.count(log::Level::kWarn,
                         "METRALE_LAZY_FREE_FLOOR_MB=lots is not a whole number of MiB; ignored"),
              1u);
  }
  buf.release();
  expect_ledger_back();
}

TEST_F(LazyCpu, ASecondReleaseIsAClearErrorAndFreesNothing) {
  LazyBuffer buf = b.reserve_lazy(4 * kMiB, "kv");
  buf.grow(kGranule);
  buf.release();
  const Error e = expect_error([&] { buf.release(); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[LazyBuffer::release] lazy buffer 'kv' (reserved at "));
  EXPECT_THAT(e.what(), HasSubstr("was already released; a second release frees nothing"));
  const Error g = expect_error([&] { buf.grow(kGranule); });
  EXPECT_EQ(g.code(), ErrorCode::kState);
  EXPECT_THAT(g.what(), HasSubstr("[LazyBuffer::grow] lazy buffer 'kv'"));
  LazyBuffer moved_from;
  const Error m = expect_error([&] { moved_from.release(); });
  EXPECT_THAT(m.what(), HasSubstr("[LazyBuffer::release] this handle holds no lazy buffer"));
  expect_ledger_back();
}

TEST_F(LazyCpu, FreeOfTheBaseIsRefusedAndTheBufferStays) {
  LazyBuffer buf = b.reserve_lazy(4 * kMiB, "kv");
  buf.grow(kGranule);
  const Error e = expect_error([&] { b.free(buf.base()); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("is the base of a lazy buffer reserved at "));
  EXPECT_THAT(e.what(), HasSubstr("release it with LazyBuffer::release"));
  EXPECT_EQ(b.live_bytes(), live0 + kGranule);
  buf.release();
  expect_ledger_back();
}

// Every granule of a three-granule growth fails in turn: the buffer keeps its size, the ledger
// its bytes, the granules before the failing one are decommitted, and the same growth then works.
TEST_F(LazyCpu, AFailingGranuleUndoesItselfAtEveryPosition) {
  LazyBuffer buf = b.reserve_lazy(8 * kMiB, "kv");
  buf.grow(kGranule);
  for (std::uint64_t n = 1; n <= 3; ++n) {
    b.set_faults(failing("lazy_commit", n));
    const Error e = expect_error([&] { buf.grow(8 * kMiB); });
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("lazy_commit: injected failure (lazy_commit call "
                                                "#{}",
                                                n)))
        << n;
    EXPECT_EQ(buf.mapped_bytes(), kGranule) << n;
    EXPECT_EQ(b.live_bytes(), live0 + kGranule) << n;
    const Error beyond = expect_error([&] { b.check_range("t", "p", buf.base(), kGranule + 1); });
    EXPECT_THAT(beyond.what(), HasSubstr("lies beyond the 2097152 mapped bytes")) << n;
    for (std::size_t g = 1; g < 4; ++g) {  // the granules this growth committed are taken back
      EXPECT_EQ(protection_at(buf.base().address() + g * kGranule), "---p") << n << " " << g;
    }
    EXPECT_EQ(protection_at(buf.base().address()), "rw-p") << n;
  }
  b.set_faults(CpuFaults{});
  EXPECT_EQ(buf.grow(8 * kMiB), 8 * kMiB);
  buf.release();
  expect_ledger_back();
  EXPECT_EQ(b.alloc_stats().failed_allocations, 3u);
}

TEST_F(LazyCpu, AFailedReservationLeavesNothing) {
  b.set_faults(failing("lazy_reserve", 1));
  const Error e = expect_error([&] { (void)b.reserve_lazy(4 * kMiB, "kv"); });
  EXPECT_THAT(e.what(), HasSubstr("lazy_reserve: injected failure"));
  expect_ledger_back();
}

TEST_F(LazyCpu, TheDestructorAndAModelScopeRelease) {
  {
    LazyBuffer buf = b.reserve_lazy(4 * kMiB, "dies");
    buf.grow(kGranule);
    LazyBuffer other = std::move(buf);
    EXPECT_FALSE(buf.live());
    EXPECT_TRUE(other.live());
    EXPECT_EQ(b.live_bytes(), live0 + kGranule);
  }
  expect_ledger_back();

  auto owned = std::make_unique<CpuBackend>(CpuBackendOptions{.threads = 1});
  const LedgerProbe probe = owned->ledger_probe();
  ModelScope model(std::move(owned));
  auto& res = model.add(
      std::make_unique<LazyBufferResource>(model.backend().reserve_lazy(4 * kMiB, "activations")));
  res.buffer().grow(3 * kMiB);
  EXPECT_EQ(probe.live_bytes(), 4 * kMiB);
  const TeardownReport r = model.teardown();
  EXPECT_TRUE(r.clean()) << r.leak_summary();
  EXPECT_EQ(probe.live_bytes(), 0u);
}

// A buffer never released is released by the backend's sweep; its handle, outliving the
// backend, then knows and does nothing.
TEST(LazyCpuSweep, TheSweepReleasesABufferItsOwnerNeverDid) {
  LazyBuffer buf;
  {
    CpuBackend b(CpuBackendOptions{.threads = 1});
    buf = b.reserve_lazy(4 * kMiB, "orphan");
    buf.grow(kGranule);
    testing::LogCapture logs(log::Level::kWarn);
    EXPECT_EQ(b.sweep_unreleased(), 1u);
    EXPECT_EQ(b.live_bytes(), 0u);
    if (buf.live()) {
      ADD_FAILURE() << "the sweep left the buffer live";
      // Its backend is about to go: never destroyed, so the failure stays a failure, not a hang.
      [[maybe_unused]] static auto* kept = new LazyBuffer(std::move(buf));
    }
  }
  EXPECT_EQ(buf.mapped_bytes(), 0u);
}

}  // namespace
}  // namespace metrale
