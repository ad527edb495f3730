// The fake driver's gate and fault scripting: every entry point is counted here, then fails
// when a rule says so (fail_at, fail_from) before the cuInit and context rules apply.
#include "cuda/fake_state.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>

namespace metrale::cuda::testing::fake {

// The device of the calling thread's current context, or -1 when there is no live one.
int current_device(const State& s) {
  if (t_current.owner != s.id || t_current.ctx == nullptr) return -1;
  for (std::size_t d = 0; d < s.contexts.size(); ++d) {
    if (s.contexts[d] == t_current.ctx && s.retains[d] > 0) return static_cast<int>(d);
  }
  return -1;
}

// Counts the call, then applies (in order) injected failures, the cuInit rule and the
// current-context rule.
Gate enter(std::string_view name, Need need) {
  Gate g;
  g.s = g_state.load();
  if (g.s == nullptr) {
    g.status = CUDA_ERROR_DEINITIALIZED;
    return g;
  }
  State& s = *g.s;
  g.lock = std::unique_lock(s.mutex);
  auto count = s.calls.find(name);
  if (count == s.calls.end()) count = s.calls.emplace(std::string(name), 0).first;
  const std::uint64_t n = ++count->second;
  if (auto rules = s.failures.find(name); rules != s.failures.end()) {
    for (const FailRule& r : rules->second) {  // the first rule added that matches wins
      if (n == r.nth || (r.onward && n > r.nth)) {
        g.status = r.status;
        return g;
      }
    }
  }
  if (need != Need::kNothing && !s.initialized) {
    g.status = CUDA_ERROR_NOT_INITIALIZED;
  } else if (need == Need::kContext && current_device(s) < 0) {
    g.status = CUDA_ERROR_INVALID_CONTEXT;
  }
  return g;
}

namespace {
// A misspelt entry point would make fail_at or calls() silently ineffective.
const std::string& entry_point(const std::string& call) {
#define METRALE_FAKE_NAME(name, version) #name,
  static constexpr std::string_view kNames[] = {METRALE_DRIVER_FUNCTIONS(METRALE_FAKE_NAME)};
#undef METRALE_FAKE_NAME
  if (std::find(std::begin(kNames), std::end(kNames), call) == std::end(kNames)) {
    throw std::invalid_argument("FakeDriver: no driver entry point named " + call);
  }
  return call;
}
}  // namespace

}  // namespace metrale::cuda::testing::fake

namespace metrale::cuda::testing {

using fake::entry_point;
using fake::FailRule;
using fake::locked;
using fake::State;

void FakeDriver::fail_at(const std::string& call, std::uint64_t nth, CUresult status) {
  locked(*state_, [&](State& s) {
    s.failures[entry_point(call)].push_back(FailRule{nth, false, status});
  });
}

void FakeDriver::fail_from(const std::string& call, std::uint64_t nth, CUresult status) {
  locked(*state_, [&](State& s) {
    s.failures[entry_point(call)].push_back(FailRule{nth, true, status});
  });
}

void FakeDriver::clear_failures() {
  locked(*state_, [](State& s) { s.failures.clear(); });
}

void FakeDriver::set_sticky_fault(CUresult status) {
  locked(*state_, [&](State& s) { s.sticky = status; });
}

std::uint64_t FakeDriver::calls(const std::string& call) const {
  return locked(*state_, [&](State& s) -> std::uint64_t {
    auto it = s.calls.find(entry_point(call));
    return it == s.calls.end() ? 0 : it->second;
  });
}

std::uint64_t FakeDriver::total_calls() const {
  return locked(*state_, [](State& s) {
    std::uint64_t total = 0;
    for (const auto& [name, n] : s.calls) total += n;
    return total;
  });
}

}  // namespace metrale::cuda::testing
