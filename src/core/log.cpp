#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace metrale::log {
namespace {

Level parse_level(const char* text) {
  if (text == nullptr) return Level::kWarn;
  const std::string v(text);
  if (v == "error") return Level::kError;
  if (v == "warn" || v == "warning") return Level::kWarn;
  if (v == "info") return Level::kInfo;
  if (v == "debug" || v == "trace") return Level::kDebug;
  std::fprintf(stderr, "metrale warn: METRALE_LOG=%s is not one of error, warn, info, debug\n",
               text);
  return Level::kWarn;
}

std::atomic<int>& level_slot() {
  static std::atomic<int> slot{static_cast<int>(parse_level(std::getenv("METRALE_LOG")))};
  return slot;
}

std::mutex& sink_mu() {
  static std::mutex mu;
  return mu;
}

Sink& sink_slot() {
  static Sink sink;
  return sink;
}

const char* tag(Level lvl) {
  switch (lvl) {
    case Level::kError:
      return "error";
    case Level::kWarn:
      return "warn";
    case Level::kInfo:
      return "info";
    case Level::kDebug:
      return "debug";
  }
  return "?";
}

}  // namespace

Level level() noexcept {
  return static_cast<Level>(level_slot().load(std::memory_order_relaxed));
}

void set_level(Level lvl) noexcept {
  level_slot().store(static_cast<int>(lvl), std::memory_order_relaxed);
}

Sink set_sink(Sink sink) {
  std::lock_guard lock(sink_mu());
  Sink old = std::move(sink_slot());
  sink_slot() = std::move(sink);
  return old;
}

void write(Level lvl, std::string_view line) {
  // The lock keeps lines whole when threads log at once.
  std::lock_guard lock(sink_mu());
  if (sink_slot()) {
    sink_slot()(lvl, line);
    return;
  }
  std::fprintf(stderr, "metrale %s: %.*s\n", tag(lvl), static_cast<int>(line.size()), line.data());
}

}  // namespace metrale::log
