// Shared pieces of the concurrency stress tests (ctest -L concurrency): how many iterations a
// scenario runs, a thread-safe collector of what workers saw go wrong (the main thread asserts
// on it after joining, so no gtest assertion runs on a worker), and the check that an error a
// worker met is a refusal the scenario allows.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/error.h"

namespace metrale::testing {

// Iterations of a scenario: METRALE_STRESS_ITERATIONS when set to a positive number (the tsan
// test preset lowers it, since TSan runs each iteration several times slower), else fallback.
inline int stress_iterations(int fallback) {
  const char* v = std::getenv("METRALE_STRESS_ITERATIONS");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n > 0 ? n : fallback;
}

// What workers saw go wrong, in arrival order; the first few are kept word for word.
class Failures {
 public:
  // Records one failure.
  void add(std::string what) {
    std::lock_guard lock(mu_);
    ++count_;
    if (kept_.size() < kKept) kept_.push_back(std::move(what));
  }
  // How many failures were recorded.
  std::size_t count() const {
    std::lock_guard lock(mu_);
    return count_;
  }
  // The kept failures, one a line, and how many more there were.
  std::string summary() const {
    std::lock_guard lock(mu_);
    std::string out;
    for (const std::string& k : kept_) out += k + "\n";
    if (count_ > kept_.size()) out += fmt::format("... and {} more\n", count_ - kept_.size());
    return out;
  }

 private:
  static constexpr std::size_t kKept = 10;
  mutable std::mutex mu_;
  std::size_t count_ = 0;
  std::vector<std::string> kept_;
};

// Whether e is a kState refusal whose message starts with one of the "[api]" prefixes.
inline bool is_refusal(const Error& e, std::initializer_list<std::string_view> apis) {
  if (e.code() != ErrorCode::kState) return false;
  const std::string_view what = e.what();
  for (std::string_view api : apis) {
    if (what.substr(0, api.size()) == api) return true;
  }
  return false;
}

}  // namespace metrale::testing
