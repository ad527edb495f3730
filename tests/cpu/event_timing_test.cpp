// CPU backend event timing: a record stamps its event with the host clock when the stream
// reaches it (at replay, for a captured record), and every bad input is an error naming the call.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/host_module.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;

// A host module whose one kernel sleeps 2 ms: a workload of known length.
HostModule sleeper() {
  HostModule m("sleep");
  m.add_kernel("sleep_2ms",
               [](const HostBlock&) { std::this_thread::sleep_for(std::chrono::milliseconds(2)); },
               {});
  return m;
}

TEST(CpuEventTiming, APairAroundWorkReadsTheTimeTheStreamTookForIt) {
  CpuBackend b(CpuBackendOptions{.modules = {sleeper()}, .threads = 1});
  const StreamHandle s = b.create_stream();
  const EventHandle e0 = b.create_timing_event(), e1 = b.create_timing_event();
  const KernelHandle k = b.kernel("sleep", "sleep_2ms").handle;
  b.record_event(e0, s);
  b.launch(k, {1, 1, 1}, {1, 1, 1}, 0, s, {});
  b.record_event(e1, s);
  b.synchronize(s);
  // Ordering and sign only: a loaded machine can stretch the sleep, never shorten it.
  const double ms = b.event_elapsed_ms(e0, e1);
  EXPECT_GE(ms, 2.0);
  EXPECT_LT(b.event_elapsed_ms(e1, e0), 0.0);
  EXPECT_EQ(b.event_elapsed_ms(e0, e0), 0.0);
  b.destroy_event(e0);
  b.destroy_event(e1);
  b.destroy_stream(s);
}

TEST(CpuEventTiming, ACapturedRecordStampsAtReplayNotAtCapture) {
  CpuBackend b(CpuBackendOptions{.modules = {sleeper()}, .threads = 1});
  const StreamHandle s = b.create_stream();
  const EventHandle e0 = b.create_timing_event(), e1 = b.create_timing_event();
  const KernelHandle k = b.kernel("sleep", "sleep_2ms").handle;
  b.begin_capture(s);
  b.record_event(e0, s);
  b.launch(k, {1, 1, 1}, {1, 1, 1}, 0, s, {});
  b.record_event(e1, s);
  const GraphHandle g = b.end_capture(s);
  const Error before = expect_error([&] { b.event_elapsed_ms(e0, e1); });
  EXPECT_EQ(before.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(before.what(), HasSubstr("[event_elapsed_ms] start event"));
  EXPECT_THAT(before.what(), HasSubstr("has not been recorded"));
  b.launch_graph(g, s);
  b.synchronize(s);
  EXPECT_GE(b.event_elapsed_ms(e0, e1), 2.0);
  b.destroy_graph(g);
  b.destroy_event(e0);
  b.destroy_event(e1);
  b.destroy_stream(s);
}

TEST(CpuEventTiming, BadEventsAreErrorsNamingTheCallAndTheEvent) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  const StreamHandle s = b.default_stream();
  const EventHandle timed = b.create_timing_event();
  const EventHandle plain = b.create_event();
  const EventHandle unrecorded = b.create_timing_event();
  b.record_event(timed, s);
  b.record_event(plain, s);

  const Error no_timing = expect_error([&] { b.event_elapsed_ms(timed, plain); });
  EXPECT_EQ(no_timing.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(no_timing.what(), HasSubstr("[event_elapsed_ms] end event"));
  EXPECT_THAT(no_timing.what(), HasSubstr("was made by create_event, which keeps no time"));

  const Error not_recorded = expect_error([&] { b.event_elapsed_ms(unrecorded, timed); });
  EXPECT_EQ(not_recorded.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(not_recorded.what(), HasSubstr("start event"));
  EXPECT_THAT(not_recorded.what(), HasSubstr("has not been recorded"));

  const Error foreign = expect_error([&] { b.event_elapsed_ms(EventHandle{0xdead}, timed); });
  EXPECT_EQ(foreign.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(foreign.what(),
              HasSubstr("[event_elapsed_ms] event 0xdead is not a live event of the cpu backend"));

  b.destroy_event(timed);
  const Error destroyed = expect_error([&] { b.event_elapsed_ms(timed, unrecorded); });
  EXPECT_EQ(destroyed.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(destroyed.what(), HasSubstr("is not a live event of the cpu backend"));
  b.destroy_event(plain);
  b.destroy_event(unrecorded);
  EXPECT_EQ(b.handle_counts().events, 0u);
}

TEST(CpuEventTiming, ATimingEventCreationCanFailAtItsPosition) {
  CpuBackend b(CpuBackendOptions{.threads = 1});
  CpuFaults f;
  f.fail_call_at = 1;
  f.fail_call_of = "create_timing_event";
  b.set_faults(f);
  const Error e = expect_error([&] { b.create_timing_event(); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[cpu] create_timing_event: injected failure"));
  EXPECT_EQ(b.handle_counts().events, 0u);
}

}  // namespace
}  // namespace metrale
