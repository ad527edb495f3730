// CUDA backend event timing on the fake driver: timing events (no CU_EVENT_DISABLE_TIMING),
// cuEventElapsedTime read from the fake's clock, and each way the call can fail.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/expect_error.h"
#include "cuda/rig.h"
#include "metrale/error.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using ::testing::HasSubstr;

TEST(CudaEventTiming, APairReadsTheDeviceClockBetweenItsRecords) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.create_stream();
  const EventHandle e0 = b.create_timing_event(), e1 = b.create_timing_event();
  EXPECT_EQ(rig.fd.outstanding().events, 2u);
  b.record_event(e0, s);
  rig.fd.advance_clock(2.5);
  b.record_event(e1, s);
  b.event_synchronize(e1);
  EXPECT_FLOAT_EQ(static_cast<float>(b.event_elapsed_ms(e0, e1)), 2.5f);
  EXPECT_FLOAT_EQ(static_cast<float>(b.event_elapsed_ms(e1, e0)), -2.5f);
  EXPECT_EQ(rig.fd.calls("cuEventElapsedTime"), 2u);
  b.destroy_event(e0);
  b.destroy_event(e1);
  EXPECT_EQ(rig.fd.outstanding().events, 0u);
  b.destroy_stream(s);
}

TEST(CudaEventTiming, BadEventsAreErrorsNamingTheCall) {
  Rig rig;
  CudaBackend& b = rig.b();
  const StreamHandle s = b.default_stream();
  const EventHandle timed = b.create_timing_event();
  const EventHandle plain = b.create_event();
  const EventHandle unrecorded = b.create_timing_event();
  b.record_event(timed, s);
  b.record_event(plain, s);

  // Refused before the driver is asked: made without timing, or not an event of this backend.
  const std::uint64_t asked = rig.fd.calls("cuEventElapsedTime");
  const Error no_timing = expect_error([&] { b.event_elapsed_ms(timed, plain); });
  EXPECT_EQ(no_timing.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(no_timing.what(), HasSubstr("[event_elapsed_ms] end event"));
  EXPECT_THAT(no_timing.what(), HasSubstr("CU_EVENT_DISABLE_TIMING"));
  const Error foreign = expect_error([&] { b.event_elapsed_ms(EventHandle{0xdead}, timed); });
  EXPECT_EQ(foreign.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(foreign.what(), HasSubstr("[event_elapsed_ms] event 0xdead is not a live event"));
  EXPECT_EQ(rig.fd.calls("cuEventElapsedTime"), asked);

  // The driver's answers: never recorded, still running, and a failure of the call itself.
  const Error not_recorded = expect_error([&] { b.event_elapsed_ms(unrecorded, timed); });
  EXPECT_EQ(not_recorded.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(not_recorded.what(), HasSubstr("[event_elapsed_ms] cuEventElapsedTime"));
  EXPECT_THAT(not_recorded.what(), HasSubstr("has not been recorded"));
  rig.fd.set_events_ready(false);
  const Error running = expect_error([&] { b.event_elapsed_ms(timed, timed); });
  EXPECT_EQ(running.code(), ErrorCode::kState);
  EXPECT_THAT(running.what(), HasSubstr("is still running: synchronize"));
  rig.fd.set_events_ready(true);
  rig.fd.fail_at("cuEventElapsedTime", rig.fd.calls("cuEventElapsedTime") + 1, CUDA_ERROR_UNKNOWN);
  const Error failed = expect_error([&] { b.event_elapsed_ms(timed, timed); });
  EXPECT_EQ(failed.code(), ErrorCode::kDriver);
  EXPECT_THAT(failed.what(), HasSubstr("[event_elapsed_ms] cuEventElapsedTime failed"));
  EXPECT_EQ(b.event_elapsed_ms(timed, timed), 0.0);  // only that call failed

  b.destroy_event(timed);
  const Error destroyed = expect_error([&] { b.event_elapsed_ms(timed, unrecorded); });
  EXPECT_EQ(destroyed.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(destroyed.what(), HasSubstr("is not a live event of this cuda backend"));
  b.destroy_event(plain);
  b.destroy_event(unrecorded);
}

TEST(CudaEventTiming, AFailedCreationLeavesNoEvent) {
  Rig rig;
  CudaBackend& b = rig.b();
  rig.fd.fail_at("cuEventCreate", rig.fd.calls("cuEventCreate") + 1, CUDA_ERROR_OUT_OF_MEMORY);
  const Error e = expect_error([&] { b.create_timing_event(); });
  EXPECT_THAT(e.what(), HasSubstr("[create_timing_event] cuEventCreate failed"));
  EXPECT_EQ(rig.fd.outstanding().events, 0u);
}

}  // namespace
}  // namespace metrale::cuda::testing
