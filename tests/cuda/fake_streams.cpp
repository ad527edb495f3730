// The fake driver's streams, capture, events and graphs: work runs when queued, a capturing
// stream records it instead, and a graph exec replays the record.
#include "cuda/fake_state.h"

#include <utility>

namespace metrale::cuda::testing::fake {

bool is_legacy(CUstream stream) {
  return stream == nullptr || stream == reinterpret_cast<CUstream>(std::uintptr_t{1});
}

Stream* find_stream(State& s, CUstream stream) {
  if (is_legacy(stream)) return &s.legacy;
  auto it = s.streams.find(stream);
  return it == s.streams.end() ? nullptr : &it->second;
}

void invalidate(Stream& st) {
  st.capture = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  st.nodes.clear();
}

// Work on the legacy stream waits for every blocking stream, which a capturing blocking stream
// cannot allow: the driver answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and (unless only asked)
// invalidates those captures.
bool breaks_blocking_capture(State& s, CUstream stream, bool invalidates) {
  if (!is_legacy(stream)) return false;
  bool hit = false;
  for (auto& [handle, st] : s.streams) {
    if (!st.non_blocking && st.capture == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
      hit = true;
      if (invalidates) invalidate(st);
    }
  }
  return hit;
}

// An operation a capture cannot record (synchronize, device-to-host copy): it invalidates it.
CUresult refuse_in_capture(Stream& st) {
  if (st.capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  invalidate(st);
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

// The rule of cuThreadExchangeStreamCaptureMode's documentation: a thread in mode RELAXED is not
// prohibited from potentially unsafe calls (cudaMalloc is its example: an allocation no capture
// records); one in GLOBAL or THREAD_LOCAL is when it has a capture of its own not begun in
// RELAXED, and one in GLOBAL also when another thread has a capture begun in GLOBAL. Such a call
// fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the conflicting captures are invalidated.
CUresult refuse_unsafe_in_capture(State& s) {
  const CUstreamCaptureMode mine =
      t_capture_mode.owner == s.id ? t_capture_mode.mode : CU_STREAM_CAPTURE_MODE_GLOBAL;
  if (mine == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  const std::thread::id self = std::this_thread::get_id();
  bool refused = false;
  for (auto& [handle, st] : s.streams) {
    if (st.capture != CU_STREAM_CAPTURE_STATUS_ACTIVE) continue;
    const bool own = st.capture_thread == self && st.capture_mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    const bool global = mine == CU_STREAM_CAPTURE_MODE_GLOBAL && st.capture_thread != self &&
                        st.capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
    if (!own && !global) continue;
    refused = true;
    invalidate(st);
  }
  return refused ? CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED : CUDA_SUCCESS;
}

CUresult record(Stream& st, Node node) {
  if (st.capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  st.nodes.push_back(std::move(node));
  return CUDA_SUCCESS;
}

// Queues a copy or memset: run now, or recorded when the stream is capturing. A copy into host
// memory cannot be captured here (it is the host waiting for the device).
CUresult submit(State& s, CUstream stream, MemOp op, bool to_host_memory) {
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (!ranges_valid(s, op)) return CUDA_ERROR_INVALID_VALUE;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    return to_host_memory ? refuse_in_capture(*st) : record(*st, std::move(op));
  }
  op.apply();
  return CUDA_SUCCESS;
}

// Runs one recorded node at replay. Memory freed since capture is a fault, as on a GPU.
CUresult replay(Gate& g, const Node& node, CUstream stream) {
  if (const auto* mem = std::get_if<MemOp>(&node)) {
    if (!ranges_valid(*g.s, *mem)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    mem->apply();
    return CUDA_SUCCESS;
  }
  const auto& op = std::get<LaunchOp>(node);
  FakeLaunch launch = op.launch;
  launch.stream = stream;
  std::vector<ArgChunk> args = op.args;  // a fresh copy per replay
  std::vector<void*> params;
  for (std::size_t chunk : op.arg_chunk) params.push_back(args.data() + chunk);
  run_launch(g, launch, op.body, op.arg_chunk.empty() ? op.caller_params : params.data());
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamCreate(CUstream* stream, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  if (stream == nullptr || (flags & ~unsigned{CU_STREAM_NON_BLOCKING}) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *stream = new_handle<CUstream>(s);
  s.streams[*stream].non_blocking = (flags & CU_STREAM_NON_BLOCKING) != 0;
  s.streams[*stream].ctx = t_current.ctx;
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamDestroy(CUstream stream) {
  FAKE_ENTER(Need::kContext);
  return s.streams.erase(stream) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fake_cuStreamSynchronize(CUstream stream) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) return refuse_in_capture(*st);
  return CUDA_SUCCESS;  // work runs when queued, so it is already done
}

// Work runs when queued, so a wait has nothing to wait for; a capture records nothing for it.
CUresult fake_cuStreamWaitEvent(CUstream stream, CUevent event, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  Stream* st = find_stream(s, stream);
  if (st == nullptr || s.events.count(event) == 0) return CUDA_ERROR_INVALID_HANDLE;
  if ((flags & ~unsigned{CU_EVENT_WAIT_EXTERNAL}) != 0) return CUDA_ERROR_INVALID_VALUE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamBeginCapture(CUstream stream, CUstreamCaptureMode mode) {
  FAKE_ENTER(Need::kContext);
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (is_legacy(stream)) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  if (mode != CU_STREAM_CAPTURE_MODE_GLOBAL && mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_ILLEGAL_STATE;
  st->capture = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  st->capture_mode = mode;
  st->capture_thread = std::this_thread::get_id();
  return CUDA_SUCCESS;
}

// Swaps the calling thread's capture interaction mode (the documented push-pop use).
CUresult fake_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  FAKE_ENTER(Need::kNothing);
  if (mode == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (*mode != CU_STREAM_CAPTURE_MODE_GLOBAL && *mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL &&
      *mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  const CUstreamCaptureMode previous =
      t_capture_mode.owner == s.id ? t_capture_mode.mode : CU_STREAM_CAPTURE_MODE_GLOBAL;
  t_capture_mode = CaptureModeOfThread{s.id, *mode};
  *mode = previous;
  return CUDA_SUCCESS;
}

// The context a stream was made in; the NULL and legacy streams answer the calling thread's
// current context, as cuStreamGetCtx's documentation says of the special handles.
CUresult fake_cuStreamGetCtx(CUstream stream, CUcontext* ctx) {
  FAKE_ENTER(Need::kContext);
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (is_legacy(stream)) {
    *ctx = t_current.ctx;
    return CUDA_SUCCESS;
  }
  const Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  *ctx = st->ctx;
  return CUDA_SUCCESS;
}

// Ends the capture either way; an invalidated one yields no graph.
CUresult fake_cuStreamEndCapture(CUstream stream, CUgraph* graph) {
  FAKE_ENTER(Need::kContext);
  if (graph == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (st->capture == CU_STREAM_CAPTURE_STATUS_NONE) return CUDA_ERROR_ILLEGAL_STATE;
  const bool invalidated = st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED;
  st->capture = CU_STREAM_CAPTURE_STATUS_NONE;
  std::vector<Node> nodes = std::exchange(st->nodes, {});
  if (invalidated) {
    *graph = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *graph = new_handle<CUgraph>(s);
  s.graphs[*graph] = std::move(nodes);
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus* status) {
  FAKE_ENTER(Need::kContext);
  if (status == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Stream* st = find_stream(s, stream);
  if (st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  // Asked about the legacy stream, the driver reports the conflict without invalidating.
  if (breaks_blocking_capture(s, stream, false)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  *status = st->capture;
  return CUDA_SUCCESS;
}

CUresult fake_cuEventCreate(CUevent* event, unsigned int flags) {
  FAKE_ENTER(Need::kContext);
  const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
  if (event == nullptr || (flags & ~known) != 0) return CUDA_ERROR_INVALID_VALUE;
  if ((flags & CU_EVENT_INTERPROCESS) != 0 && (flags & CU_EVENT_DISABLE_TIMING) == 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *event = new_handle<CUevent>(s);
  s.events[*event].timing = (flags & CU_EVENT_DISABLE_TIMING) == 0;
  return CUDA_SUCCESS;
}

CUresult fake_cuEventDestroy(CUevent event) {
  FAKE_ENTER(Need::kContext);
  return s.events.erase(event) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fake_cuEventRecord(CUevent event, CUstream stream) {
  FAKE_ENTER(Need::kContext);
  auto ev = s.events.find(event);
  Stream* st = find_stream(s, stream);
  if (ev == s.events.end() || st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  ev->second.captured = st->capture == CU_STREAM_CAPTURE_STATUS_ACTIVE;
  if (!ev->second.captured) {
    ev->second.recorded = true;
    ev->second.at_ms = s.clock_ms;  // work runs when queued: the stream is here now
  }
  ev->second.held = s.hold_events;
  return CUDA_SUCCESS;
}

CUresult fake_cuEventQuery(CUevent event) {
  FAKE_ENTER(Need::kContext);
  auto ev = s.events.find(event);
  if (ev == s.events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (ev->second.captured) return CUDA_ERROR_CAPTURED_EVENT;
  if (ev->second.held) return CUDA_ERROR_NOT_READY;
  return s.events_ready ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

// Waiting always succeeds: the work behind the event completes while the host waits, so a held
// event is done from then on (cuEventSynchronize: "Waits until the completion of all work
// currently captured in hEvent").
CUresult fake_cuEventSynchronize(CUevent event) {
  FAKE_ENTER(Need::kContext);
  auto ev = s.events.find(event);
  if (ev == s.events.end()) return CUDA_ERROR_INVALID_HANDLE;
  if (ev->second.captured) return CUDA_ERROR_CAPTURED_EVENT;
  ev->second.held = false;
  return CUDA_SUCCESS;
}

// The driver's rules: both events live, made with timing and recorded (else INVALID_HANDLE),
// not last recorded in a capture, and done (else NOT_READY); the time is the fake's clock.
CUresult fake_cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
  FAKE_ENTER(Need::kContext);
  if (ms == nullptr) return CUDA_ERROR_INVALID_VALUE;
  auto a = s.events.find(start);
  auto b = s.events.find(end);
  if (a == s.events.end() || b == s.events.end()) return CUDA_ERROR_INVALID_HANDLE;
  for (const Event* ev : {&a->second, &b->second}) {
    if (!ev->timing || !ev->recorded) return CUDA_ERROR_INVALID_HANDLE;
    if (ev->captured) return CUDA_ERROR_CAPTURED_EVENT;
  }
  if (!s.events_ready) return CUDA_ERROR_NOT_READY;
  *ms = static_cast<float>(b->second.at_ms - a->second.at_ms);
  return CUDA_SUCCESS;
}

// The exec is a copy of the graph's nodes: destroying the graph afterwards is fine.
CUresult fake_cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph graph,
                                          unsigned long long flags) {
  FAKE_ENTER(Need::kContext);
  if (exec == nullptr || (flags & ~0xFull) != 0) return CUDA_ERROR_INVALID_VALUE;
  auto it = s.graphs.find(graph);
  if (it == s.graphs.end()) return CUDA_ERROR_INVALID_HANDLE;
  *exec = new_handle<CUgraphExec>(s);
  s.execs[*exec] = it->second;
  return CUDA_SUCCESS;
}

CUresult fake_cuGraphDestroy(CUgraph graph) {
  FAKE_ENTER(Need::kContext);
  return s.graphs.erase(graph) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUresult fake_cuGraphExecDestroy(CUgraphExec exec) {
  FAKE_ENTER(Need::kContext);
  return s.execs.erase(exec) == 1 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// Runs the exec's nodes in order (into a capturing stream: records them). A node that touches
// freed memory faults the device: CUDA_ERROR_ILLEGAL_ADDRESS, sticky.
CUresult fake_cuGraphLaunch(CUgraphExec exec, CUstream stream) {
  FAKE_ENTER(Need::kContext);
  FAKE_STICKY();
  auto it = s.execs.find(exec);
  Stream* st = find_stream(s, stream);
  if (it == s.execs.end() || st == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (breaks_blocking_capture(s, stream)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (st->capture != CU_STREAM_CAPTURE_STATUS_NONE) {
    for (const Node& node : it->second) {
      if (CUresult r = record(*st, node); r != CUDA_SUCCESS) return r;
    }
    return CUDA_SUCCESS;
  }
  ++s.replays;
  const std::vector<Node> nodes = it->second;  // a body may destroy the exec
  for (const Node& node : nodes) {
    if (CUresult r = replay(g, node, stream); r != CUDA_SUCCESS) {
      s.sticky = r;
      return r;
    }
  }
  return CUDA_SUCCESS;
}

}  // namespace metrale::cuda::testing::fake
