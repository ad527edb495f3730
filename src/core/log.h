// Logging: one line per event through fmt, level from METRALE_LOG (error, warn, info, debug;
// default warn) read once. Tests install a sink to read what was logged.
#pragma once

#include <fmt/format.h>

#include <functional>
#include <string_view>
#include <utility>

namespace metrale::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// The current level (first call reads METRALE_LOG).
Level level() noexcept;
// Overrides the level for the rest of the process.
void set_level(Level level) noexcept;
// Whether a message at lvl would be written.
inline bool enabled(Level lvl) noexcept {
  return static_cast<int>(lvl) <= static_cast<int>(level());
}

// Receives each line (without a trailing newline). A null sink restores the stderr default.
using Sink = std::function<void(Level, std::string_view)>;
// Installs sink; returns the previous one (null when it was the default).
Sink set_sink(Sink sink);
// Writes one line at lvl, regardless of level (callers check enabled first).
void write(Level lvl, std::string_view line);

template <class... A>
void error(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kError)) write(Level::kError, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void warn(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kWarn)) write(Level::kWarn, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void info(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kInfo)) write(Level::kInfo, fmt::format(f, std::forward<A>(a)...));
}
template <class... A>
void debug(fmt::format_string<A...> f, A&&... a) {
  if (enabled(Level::kDebug)) write(Level::kDebug, fmt::format(f, std::forward<A>(a)...));
}

}  // namespace metrale::log
