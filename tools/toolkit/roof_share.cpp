#include "toolkit/roof_share.h"

#include <fmt/format.h>

#include <cmath>

namespace metrale::toolkit {

void RoofReadings::add(double reading) noexcept {
  if (!(reading > 0) || !std::isfinite(reading)) return;
  highest_ = std::max(highest_, reading);
  ++count_;
}

RoofShare roof_share(double rate, double roof) noexcept {
  RoofShare s;
  if (!(roof > 0) || !(rate > 0) || !std::isfinite(rate) || !std::isfinite(roof)) return s;
  s.pct = 100.0 * rate / roof;
  s.above = s.pct > 100.0;
  return s;
}

std::string format_share(const RoofShare& s) {
  return fmt::format("{:.0f}%{}", s.pct, s.above ? "!" : "");
}

std::string format_ms(double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds)) return "< 1 µs";
  if (seconds < 1e-6) return fmt::format("{:.0f} ns", seconds * 1e9);
  return fmt::format("{:.3f}", seconds * 1e3);
}

std::string format_tokens_per_s(double tokens, double seconds, bool timed) {
  if (!timed) return "not timed";
  if (!(seconds > 0) || !std::isfinite(seconds)) return fmt::format("> {:.1f}", tokens / 1e-6);
  return fmt::format("{:.1f}", tokens / seconds);
}

std::optional<double> tokens_per_s(double tokens, double seconds) noexcept {
  if (!(seconds > 0) || !std::isfinite(seconds) || !std::isfinite(tokens)) return std::nullopt;
  return tokens / seconds;
}

}  // namespace metrale::toolkit
