// The CPU backend's streams, events and graphs: an emulator of the driver's rules. Work runs in
// order at the time it is queued, so an event is done once recorded and a synchronize has
// nothing to wait for (a record stamps its event with the host clock when it runs, which is
// what event timing reads); a capturing stream records the work instead, and a graph replays it. A
// blocking call on a capturing stream invalidates the capture, as on a GPU.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "metrale/cpu_backend.h"
#include "metrale/handles.h"

namespace metrale::cpu {

using Work = std::function<void()>;

class Streams {
 public:
  // The default stream: always live, never destroyed.
  static constexpr std::uint64_t kDefault = 1;

  // Runs work now, or records it when stream s is capturing; Error(kCapture) when that capture
  // was invalidated, Error(kInvalidArgument) for a stream that is not live.
  void submit(std::string_view api, StreamHandle s, Work work);
  // A blocking call on stream s: Error(kCapture) while s captures, which also spoils the capture.
  void forbid_capture(std::string_view api, StreamHandle s);
  // forbid_capture on every live stream (a stream destroyed meanwhile is skipped).
  void forbid_capture_anywhere(std::string_view api);
  // The id of a stream that is capturing, or 0 when none is.
  std::uint64_t capturing_stream() const;

  StreamHandle create_stream();
  // Error(kInvalidArgument) for the default stream or one that is not live.
  void destroy_stream(StreamHandle s);
  // timing: whether event_elapsed_ms may read the event (create_timing_event).
  EventHandle create_event(bool timing = false);
  void destroy_event(EventHandle e);
  // Error(kInvalidArgument) naming api unless e is a live event.
  void check_event(std::string_view api, EventHandle e) const;
  // Stamps e with the host clock now: called by the queued record when the stream reaches it.
  // An event destroyed meanwhile is skipped.
  void stamp(EventHandle e);
  // Milliseconds between the stamps of two timing events; Error(kInvalidArgument) naming
  // event_elapsed_ms for an event that is not live, has no timing, or was never reached.
  double elapsed_ms(EventHandle start, EventHandle end) const;

  // Error(kCapture) when s already captures.
  void begin_capture(StreamHandle s);
  // Ends the capture either way; Error(kCapture) when it was invalidated or s was not capturing.
  GraphHandle end_capture(StreamHandle s);
  // The graph's recorded work; Error(kInvalidArgument) when g is not live.
  std::shared_ptr<const std::vector<Work>> graph(GraphHandle g) const;
  void destroy_graph(GraphHandle g);
  // Drops whatever s was capturing; nothing for a stream that is not live.
  void abort_capture(StreamHandle s) noexcept;
  bool is_capturing(StreamHandle s) const;
  // Live streams (the default stream not counted), events and graphs.
  CpuBackend::HandleCounts counts() const;

 private:
  struct StreamState {
    bool capturing = false;
    bool invalidated = false;
    std::string invalidated_by;
    std::vector<Work> recorded;
  };
  StreamState& stream_locked(std::string_view api, StreamHandle s);

  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, StreamState> streams_{{kDefault, StreamState{}}};
  struct EventState {
    bool timing = false;
    bool stamped = false;
    std::chrono::steady_clock::time_point at;
  };
  std::unordered_map<std::uint64_t, EventState> events_;
  std::unordered_map<std::uint64_t, std::shared_ptr<const std::vector<Work>>> graphs_;
  std::uint64_t next_id_ = kDefault + 1;  // streams, events and graphs share the numbering
};

}  // namespace metrale::cpu
