// The launch trace (METRALE_TRACE=path): every launch of every backend in the process, as Chrome
// trace-event JSON that Perfetto (https://ui.perfetto.dev) and chrome://tracing read. One file
// per path and process: each backend is a process row ("pid", labelled with its name and number)
// and each of its streams a thread row ("tid"). The file is written whole at every flush, so the
// last backend to go leaves every launch of the process in it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "metrale/handles.h"

namespace metrale::trace {

// One launch as a trace row: times in microseconds on the trace's host clock.
struct TracedLaunch {
  std::string kernel;  // "module::function"
  Dim3 grid, block;
  std::uint32_t shared_bytes = 0;
  std::uint64_t stream = 0;  // the StreamHandle's value
  double start_us = 0, dur_us = 0;
};

class TraceFile;

// One backend's side of the trace. Thread-safe.
class LaunchTracer {
 public:
  // The tracer METRALE_TRACE asks for, or null when it is unset or empty. A path that cannot be
  // written is a warning naming it, logged once per path, and null: the backend runs untraced.
  static std::unique_ptr<LaunchTracer> from_env();
  // A tracer writing to path (what from_env does with the switch's value); null as above.
  static std::unique_ptr<LaunchTracer> open(const std::string& path);
  // Flushes.
  ~LaunchTracer();
  LaunchTracer(const LaunchTracer&) = delete;
  LaunchTracer& operator=(const LaunchTracer&) = delete;

  // Microseconds since the trace file was opened, on the host's steady clock.
  double now_us() const;
  // Adds a launch of the backend named backend (its row is labelled "<backend> backend #<n>").
  void add(std::string_view backend, TracedLaunch launch);
  // Counts a launch that could not be timed (e.g. queued into a CUDA graph capture); the file's
  // "otherData" reports the count.
  void note_untraced();
  // Writes the file now with every launch so far; a failure is logged, never thrown.
  void flush() noexcept;
  // The file's path.
  const std::string& path() const;

 private:
  LaunchTracer(std::shared_ptr<TraceFile> file, int pid);
  std::shared_ptr<TraceFile> file_;
  int pid_;
};

}  // namespace metrale::trace
