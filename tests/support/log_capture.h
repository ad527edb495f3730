// Collects what metrale logs while it is alive, so tests can assert on warnings.
#pragma once

#include <mutex>
#include <string>
#include <vector>

#include "core/log.h"

namespace metrale::testing {

class LogCapture {
 public:
  // Installs the capturing sink and lowers the level to `level` (debug by default).
  explicit LogCapture(log::Level level = log::Level::kDebug) : saved_level_(log::level()) {
    log::set_level(level);
    saved_sink_ = log::set_sink([this](log::Level lvl, std::string_view line) {
      std::lock_guard lock(mu_);
      lines_.push_back(Line{lvl, std::string(line)});
    });
  }
  ~LogCapture() {
    log::set_sink(std::move(saved_sink_));
    log::set_level(saved_level_);
  }

  struct Line {
    log::Level level;
    std::string text;
  };
  // Every line so far.
  std::vector<Line> lines() const {
    std::lock_guard lock(mu_);
    return lines_;
  }
  // Lines at `level` containing `needle`.
  std::size_t count(log::Level level, const std::string& needle) const {
    std::lock_guard lock(mu_);
    std::size_t n = 0;
    for (const Line& l : lines_)
      n += (l.level == level && l.text.find(needle) != std::string::npos);
    return n;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Line> lines_;
  log::Level saved_level_;
  log::Sink saved_sink_;
};

}  // namespace metrale::testing
