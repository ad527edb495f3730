// CPU backend fault points (CpuFaults::fail_call_at): every fallible primitive counts as one
// numbered call, the chosen one fails with an Error naming it before doing anything, and the
// backend stays usable. The whole-lifecycle sweep over every position is in tests/reliability.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "support/random.h"

namespace metrale {
namespace {

using ::testing::ElementsAre;
using testing::expect_error;
using ::testing::HasSubstr;

CpuFaults fail_at(std::uint64_t n, bool record = false) {
  CpuFaults f;
  f.fail_call_at = n;
  f.record_calls = record;
  return f;
}

TEST(CpuFaultPoints, CallsAreCountedAndNamedInOrder) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  b.set_faults(fail_at(0, true));
  const DevicePtr p = b.alloc(64);
  void* pinned = b.alloc_pinned(64);
  const StreamHandle s = b.create_stream();
  b.memset_async(p, 0, 64, s);
  b.copy_h2d_async(p, pinned, 0, s);  // zero bytes: a no-op, not a call
  b.synchronize(s);
  EXPECT_EQ(b.fault_call_count(), 5u);
  EXPECT_THAT(b.fault_calls(),
              ElementsAre("alloc", "alloc_pinned", "create_stream", "memset", "synchronize"));
  for (const std::string& n : b.fault_calls()) {
    const auto names = CpuBackend::fault_call_names();
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
  // Without record_calls only the count is kept; set_faults restarts it.
  b.set_faults(CpuFaults{});
  EXPECT_EQ(b.fault_call_count(), 0u);
  b.synchronize(s);
  EXPECT_EQ(b.fault_call_count(), 1u);
  EXPECT_TRUE(b.fault_calls().empty());
  b.destroy_stream(s);
  b.free_pinned(pinned);
  b.free(p);
}

TEST(CpuFaultPoints, TheChosenCallFailsNamingItselfAndChangesNothing) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  const DevicePtr p = b.alloc(256);
  const auto value = static_cast<std::uint32_t>(testing::rng()());
  b.set_faults(fail_at(3));
  ops::fill_u32(b, b.default_stream(), p, 64, value);  // calls 1 and 2: lookup, launch
  const Error e = expect_error([&] { ops::fill_u32(b, b.default_stream(), p, 64, ~value); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[cpu] launch: injected failure (call #3)"));
  std::vector<std::uint32_t> got(64);
  b.copy_d2h(got.data(), p, 256);  // the failed launch wrote nothing
  EXPECT_EQ(std::count(got.begin(), got.end(), value), 64);

  // A failed creation leaves no handle; a failed allocation leaves no ledger entry.
  b.set_faults(fail_at(1));
  EXPECT_EQ(expect_error([&] { b.create_event(); }).code(), ErrorCode::kDriver);
  EXPECT_EQ(b.handle_counts().events, 0u);
  b.set_faults(fail_at(1));
  const Error oom = expect_error([&] { b.alloc_managed(32); });
  EXPECT_EQ(oom.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(oom.what(), HasSubstr("[cpu] alloc_managed: injected failure (call #1)"));
  EXPECT_EQ(b.live_alloc_count(), 1u);
  b.free(p);
}

TEST(CpuFaultPoints, AFailedEndCaptureLeavesTheCaptureForAbortCapture) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  const StreamHandle s = b.create_stream();
  b.set_faults(fail_at(2));
  b.begin_capture(s);  // call 1
  const Error e = expect_error([&] { b.end_capture(s); });
  EXPECT_THAT(e.what(), HasSubstr("[cpu] end_capture: injected failure (call #2)"));
  EXPECT_TRUE(b.is_capturing(s));  // as after a failed cuStreamEndCapture
  EXPECT_EQ(b.handle_counts().graphs, 0u);
  b.abort_capture(s);
  EXPECT_FALSE(b.is_capturing(s));
  b.destroy_stream(s);
}

TEST(CpuFaultPoints, FailAllocAtKeepsItsOwnCount) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  CpuFaults f;
  f.fail_call_at = 2;
  f.fail_call_of = "alloc";
  b.set_faults(f);
  const StreamHandle s = b.create_stream();  // a fallible call, not an allocation
  const DevicePtr p = b.alloc(16);
  EXPECT_THAT(expect_error([&] { b.alloc(16); }).what(),
              HasSubstr("alloc call #2, call #3 of all"));
  EXPECT_EQ(b.fault_call_count(), 3u);
  b.free(p);
  b.destroy_stream(s);
}

// A filter that begins no call's name would never fail anything: set_faults refuses it.
TEST(CpuFaultPoints, FailCallOfMustBeginACallName) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  CpuFaults f;
  f.fail_call_at = 1;
  f.fail_call_of = "allco";
  const Error e = expect_error([&] { b.set_faults(f); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[set_faults] fail_call_of 'allco' begins no fallible call's"));
  // Refused, so nothing was replaced: the next allocation does not fail.
  const DevicePtr p = b.alloc(16);
  b.free(p);
  f.fail_call_of = "launch";  // a prefix of one name is enough
  b.set_faults(f);
}

}  // namespace
}  // namespace metrale
