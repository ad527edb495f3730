// Times the CUDA backend's launches for the launch trace (METRALE_TRACE) with a pair of timing
// events around each, made only while tracing is on; pairs are handed to the tracer once the
// device has passed them. Start times are placed on the trace's host clock through a reference
// event recorded (and stamped with the host clock) at the first traced launch.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "core/launch_trace.h"
#include "cuda/driver_api.h"

namespace metrale::cuda {

class LaunchTimer {
 public:
  explicit LaunchTimer(const DriverApi& api) : api_(api) {}

  // Records the start event of a launch on stream. Null (the launch is counted as untraced)
  // while stream captures, or when an event cannot be made or recorded (one warning).
  CUevent begin(CUstream stream, trace::LaunchTracer& tracer);
  // Records the end event after the launch and keeps the pair with what was launched; when
  // many pairs are pending, hands over those the device has finished.
  void end(CUevent start, CUstream stream, trace::TracedLaunch launch, trace::LaunchTracer& tracer);
  // Gives back the start event of a launch that failed.
  void abandon(CUevent start);
  // Waits for every pending pair and hands it to the tracer (a pair the driver cannot time is
  // counted as untraced). The context must be current.
  void drain(trace::LaunchTracer& tracer);
  // Destroys every event it made; statuses are ignored (teardown). The context must be current.
  void release() noexcept;

 private:
  struct Pending {
    CUevent start = nullptr, end = nullptr;
    trace::TracedLaunch launch;
  };
  CUevent take();  // a free event, or a new one; null when cuEventCreate fails
  void resolve(const Pending& p, trace::LaunchTracer& tracer);  // under mu_
  void warn_once(const char* call, CUresult status);

  const DriverApi& api_;
  std::mutex mu_;  // everything below; held across the driver calls of tracing only
  CUevent ref_ = nullptr;
  double ref_us_ = 0;
  std::deque<Pending> pending_;
  std::vector<CUevent> free_;
  bool warned_ = false;
};

}  // namespace metrale::cuda
