#include "cuda/launch_timer.h"

#include <utility>

#include "core/log.h"
#include "cuda/status.h"

namespace metrale::cuda {
namespace {

// Pending pairs before end() looks for finished ones: few enough that the events stay cheap,
// enough that a query per launch is not paid.
constexpr std::size_t kResolveAt = 256;

}  // namespace

void LaunchTimer::warn_once(const char* call, CUresult status) {
  if (warned_) return;
  warned_ = true;
  log::warn("METRALE_TRACE: {} failed ({}); launches it would have timed are not traced", call,
            describe_status(&api_, status));
}

CUevent LaunchTimer::take() {
  if (!free_.empty()) {
    CUevent e = free_.back();
    free_.pop_back();
    return e;
  }
  CUevent e = nullptr;
  if (const CUresult r = api_.cuEventCreate(&e, CU_EVENT_DEFAULT); r != CUDA_SUCCESS) {
    warn_once("cuEventCreate", r);
    return nullptr;
  }
  return e;
}

CUevent LaunchTimer::begin(CUstream stream, trace::LaunchTracer& tracer) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult q = api_.cuStreamIsCapturing(stream, &status);
  if (q != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE) {
    tracer.note_untraced();  // an event recorded into a graph times its replays, not this call
    return nullptr;
  }
  std::lock_guard lock(mu_);
  if (ref_ == nullptr) {
    CUevent ref = take();
    if (ref == nullptr) {
      tracer.note_untraced();
      return nullptr;
    }
    if (const CUresult r = api_.cuEventRecord(ref, stream); r != CUDA_SUCCESS) {
      warn_once("cuEventRecord", r);
      free_.push_back(ref);
      tracer.note_untraced();
      return nullptr;
    }
    ref_ = ref;
    ref_us_ = tracer.now_us();
  }
  CUevent start = take();
  if (start == nullptr) {
    tracer.note_untraced();
    return nullptr;
  }
  if (const CUresult r = api_.cuEventRecord(start, stream); r != CUDA_SUCCESS) {
    warn_once("cuEventRecord", r);
    free_.push_back(start);
    tracer.note_untraced();
    return nullptr;
  }
  return start;
}

void LaunchTimer::abandon(CUevent start) {
  std::lock_guard lock(mu_);
  free_.push_back(start);
}

void LaunchTimer::end(CUevent start, CUstream stream, trace::TracedLaunch launch,
                      trace::LaunchTracer& tracer) {
  std::lock_guard lock(mu_);
  CUevent end = take();
  CUresult r = CUDA_ERROR_UNKNOWN;
  if (end != nullptr) {
    r = api_.cuEventRecord(end, stream);
    if (r != CUDA_SUCCESS) warn_once("cuEventRecord", r);
  }
  if (r != CUDA_SUCCESS) {
    free_.push_back(start);
    if (end != nullptr) free_.push_back(end);
    tracer.note_untraced();
    return;
  }
  pending_.push_back(Pending{start, end, std::move(launch)});
  if (pending_.size() < kResolveAt) return;
  // In launch order: the first pair not finished stops the walk (later ones rarely are).
  while (!pending_.empty() && api_.cuEventQuery(pending_.front().end) == CUDA_SUCCESS) {
    resolve(pending_.front(), tracer);
    pending_.pop_front();
  }
}

void LaunchTimer::resolve(const Pending& p, trace::LaunchTracer& tracer) {
  float from_ref = 0, dur = 0;
  const CUresult a = api_.cuEventElapsedTime(&from_ref, ref_, p.start);
  const CUresult b = a == CUDA_SUCCESS ? api_.cuEventElapsedTime(&dur, p.start, p.end) : a;
  free_.push_back(p.start);
  free_.push_back(p.end);
  if (b != CUDA_SUCCESS) {
    warn_once("cuEventElapsedTime", b);
    tracer.note_untraced();
    return;
  }
  trace::TracedLaunch l = p.launch;
  l.start_us = ref_us_ + 1e3 * static_cast<double>(from_ref);
  l.dur_us = 1e3 * static_cast<double>(dur);
  tracer.add("cuda", std::move(l));
}

void LaunchTimer::drain(trace::LaunchTracer& tracer) {
  std::lock_guard lock(mu_);
  while (!pending_.empty()) {
    const Pending p = std::move(pending_.front());
    pending_.pop_front();
    if (const CUresult r = api_.cuEventSynchronize(p.end); r != CUDA_SUCCESS) {
      warn_once("cuEventSynchronize", r);
      free_.push_back(p.start);
      free_.push_back(p.end);
      tracer.note_untraced();
      continue;
    }
    resolve(p, tracer);
  }
}

void LaunchTimer::release() noexcept {
  std::lock_guard lock(mu_);
  for (const Pending& p : pending_) {
    free_.push_back(p.start);
    free_.push_back(p.end);
  }
  pending_.clear();
  if (ref_ != nullptr) free_.push_back(std::exchange(ref_, nullptr));
  for (CUevent e : free_) api_.cuEventDestroy(e);
  free_.clear();
}

}  // namespace metrale::cuda
