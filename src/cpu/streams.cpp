#include "cpu/streams.h"

#include <fmt/format.h>

#include "metrale/error.h"

namespace metrale::cpu {
namespace {

Error unknown_stream(std::string_view api, std::uint64_t s) {
  return Error(ErrorCode::kInvalidArgument, api,
               fmt::format("stream 0x{:x} is not a live stream of the cpu backend", s));
}

Error unknown_event(std::string_view api, EventHandle e) {
  return Error(ErrorCode::kInvalidArgument, api,
               fmt::format("event 0x{:x} is not a live event of the cpu backend", e.value()));
}

}  // namespace

Streams::StreamState& Streams::stream_locked(std::string_view api, StreamHandle s) {
  const auto it = streams_.find(s.value());
  if (it == streams_.end()) throw unknown_stream(api, s.value());
  return it->second;
}

void Streams::submit(std::string_view api, StreamHandle s, Work work) {
  {
    std::lock_guard lock(mu_);
    StreamState& st = stream_locked(api, s);
    if (st.capturing) {
      if (st.invalidated) {
        throw Error(ErrorCode::kCapture, api,
                    fmt::format("the capture on stream 0x{:x} was invalidated by {}", s.value(),
                                st.invalidated_by));
      }
      st.recorded.push_back(std::move(work));
      return;
    }
  }
  work();  // outside the lock: the work may queue more
}

void Streams::forbid_capture(std::string_view api, StreamHandle s) {
  std::lock_guard lock(mu_);
  StreamState& st = stream_locked(api, s);
  if (!st.capturing) return;
  st.invalidated = true;
  if (st.invalidated_by.empty()) st.invalidated_by = std::string(api);
  throw Error(ErrorCode::kCapture, api,
              fmt::format("stream 0x{:x} is capturing: a synchronizing call inside a capture "
                          "invalidates it",
                          s.value()));
}

void Streams::forbid_capture_anywhere(std::string_view api) {
  std::vector<std::uint64_t> ids;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, _] : streams_) ids.push_back(id);
  }
  for (std::uint64_t id : ids) {
    try {
      forbid_capture(api, StreamHandle{id});
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kCapture) throw;
      // A stream destroyed meanwhile has nothing left to wait for.
    }
  }
}

std::uint64_t Streams::capturing_stream() const {
  std::lock_guard lock(mu_);
  for (const auto& [id, st] : streams_) {
    if (st.capturing) return id;
  }
  return 0;
}

StreamHandle Streams::create_stream() {
  std::lock_guard lock(mu_);
  const std::uint64_t id = next_id_++;
  streams_.emplace(id, StreamState{});
  return StreamHandle{id};
}

void Streams::destroy_stream(StreamHandle s) {
  std::lock_guard lock(mu_);
  if (s.value() == kDefault) {
    throw Error(ErrorCode::kInvalidArgument, "destroy_stream",
                "the backend's default stream belongs to the backend");
  }
  if (streams_.erase(s.value()) == 0) throw unknown_stream("destroy_stream", s.value());
}

EventHandle Streams::create_event(bool timing) {
  std::lock_guard lock(mu_);
  const std::uint64_t id = next_id_++;
  EventState st;
  st.timing = timing;
  events_.emplace(id, st);
  return EventHandle{id};
}

void Streams::destroy_event(EventHandle e) {
  std::lock_guard lock(mu_);
  if (events_.erase(e.value()) == 0) throw unknown_event("destroy_event", e);
}

void Streams::check_event(std::string_view api, EventHandle e) const {
  std::lock_guard lock(mu_);
  if (!events_.contains(e.value())) throw unknown_event(api, e);
}

void Streams::stamp(EventHandle e) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(mu_);
  const auto it = events_.find(e.value());
  if (it == events_.end()) return;
  it->second.stamped = true;
  it->second.at = now;
}

double Streams::elapsed_ms(EventHandle start, EventHandle end) const {
  constexpr std::string_view kApi = "event_elapsed_ms";
  std::lock_guard lock(mu_);
  const auto read = [&](EventHandle e, std::string_view which) {
    const auto it = events_.find(e.value());
    if (it == events_.end()) throw unknown_event(kApi, e);
    if (!it->second.timing) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("{} event 0x{:x} was made by create_event, which keeps no time: "
                              "make it with create_timing_event",
                              which, e.value()));
    }
    if (!it->second.stamped) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("{} event 0x{:x} has not been recorded (or only inside a capture "
                              "not replayed yet)",
                              which, e.value()));
    }
    return it->second.at;
  };
  const auto t0 = read(start, "start");
  const auto t1 = read(end, "end");
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

void Streams::begin_capture(StreamHandle s) {
  std::lock_guard lock(mu_);
  StreamState& st = stream_locked("begin_capture", s);
  if (st.capturing) {
    throw Error(ErrorCode::kCapture, "begin_capture",
                fmt::format("stream 0x{:x} is already capturing", s.value()));
  }
  st = StreamState{};
  st.capturing = true;
}

GraphHandle Streams::end_capture(StreamHandle s) {
  std::lock_guard lock(mu_);
  StreamState& st = stream_locked("end_capture", s);
  if (!st.capturing) {
    throw Error(ErrorCode::kCapture, "end_capture",
                fmt::format("stream 0x{:x} is not capturing", s.value()));
  }
  StreamState done = std::move(st);
  st = StreamState{};
  if (done.invalidated) {
    throw Error(ErrorCode::kCapture, "end_capture",
                fmt::format("the capture on stream 0x{:x} was invalidated by {}; nothing was "
                            "instantiated",
                            s.value(), done.invalidated_by));
  }
  const std::uint64_t id = next_id_++;
  graphs_.emplace(id, std::make_shared<const std::vector<Work>>(std::move(done.recorded)));
  return GraphHandle{id};
}

std::shared_ptr<const std::vector<Work>> Streams::graph(GraphHandle g) const {
  std::lock_guard lock(mu_);
  const auto it = graphs_.find(g.value());
  if (it == graphs_.end()) {
    throw Error(ErrorCode::kInvalidArgument, "launch_graph",
                fmt::format("graph 0x{:x} is not a live graph of the cpu backend", g.value()));
  }
  return it->second;
}

void Streams::destroy_graph(GraphHandle g) {
  std::lock_guard lock(mu_);
  if (graphs_.erase(g.value()) == 0) {
    throw Error(ErrorCode::kInvalidArgument, "destroy_graph",
                fmt::format("graph 0x{:x} is not a live graph of the cpu backend", g.value()));
  }
}

void Streams::abort_capture(StreamHandle s) noexcept {
  std::lock_guard lock(mu_);
  const auto it = streams_.find(s.value());
  if (it != streams_.end()) it->second = StreamState{};
}

bool Streams::is_capturing(StreamHandle s) const {
  std::lock_guard lock(mu_);
  const auto it = streams_.find(s.value());
  if (it == streams_.end()) throw unknown_stream("is_capturing", s.value());
  return it->second.capturing;
}

CpuBackend::HandleCounts Streams::counts() const {
  std::lock_guard lock(mu_);
  return CpuBackend::HandleCounts{streams_.size() - 1, events_.size(), graphs_.size()};
}

}  // namespace metrale::cpu
