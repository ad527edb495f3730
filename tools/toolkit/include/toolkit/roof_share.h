// How a benchmark reports a measured rate against a roof measured in the same run, and a time
// or rate that the timer could not resolve: a share above 100% says that the roof read low (a
// loaded machine), and no inf or nan reaches a report.
#pragma once

#include <optional>
#include <string>

namespace metrale::toolkit {

// The highest of the readings of a roof taken through a run (interleaved with the timing): a
// roof is the most the machine showed, so a dip in one reading cannot flatter every case.
class RoofReadings {
 public:
  // Takes one reading (bytes or FLOP per second; a reading ≤ 0, not measured, is ignored).
  void add(double reading) noexcept;
  // The highest reading; 0 when none was taken.
  double highest() const noexcept { return highest_; }
  // How many readings were taken.
  int count() const noexcept { return count_; }

 private:
  double highest_ = 0;
  int count_ = 0;
};

// A rate's share of a roof: pct = 100·rate / roof (0 where the roof or the rate is unknown),
// and whether it lies above the roof, which then read low.
struct RoofShare {
  double pct = 0;
  bool above = false;
};
RoofShare roof_share(double rate, double roof) noexcept;

// "87%", or "107%!" for a share above the roof (the report explains the mark).
std::string format_share(const RoofShare& s);

// A measured time in milliseconds for a table: "12.345"; below a microsecond the nanoseconds
// measured ("350 ns"); "< 1 µs" for a time the timer read as 0 (below its resolution).
std::string format_ms(double seconds);

// Tokens per second for a table: the rate, "> X" (X the rate at one microsecond) where the time
// was below the timer's resolution, or "not timed" where timed is false.
std::string format_tokens_per_s(double tokens, double seconds, bool timed);

// The same for JSON: the rate, or nothing (null) where it was not measured; never inf or nan.
std::optional<double> tokens_per_s(double tokens, double seconds) noexcept;

}  // namespace metrale::toolkit
