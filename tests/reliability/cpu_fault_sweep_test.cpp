// Systematic fault injection on the CPU backend: one clean lifecycle counts the backend's
// fallible calls (CpuFaults::record_calls), then one lifecycle per position with that call
// failing (CpuFaults::fail_call_at). Every run must end in an Error naming the call, or in a
// recovery listed below with its reason; nothing may crash, and teardown must leave zero live
// bytes, zero streams, events and graphs, and nothing for the ledger sweep to find.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "metrale/cpu_backend.h"
#include "reliability/lifecycle.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale::testing::reliability {
namespace {

// Counts and call names of the run, read at teardown while the backend still exists.
struct CpuRun {
  std::uint64_t calls = 0;
  std::vector<std::string> names;
};

// Faults that only count (and name) the calls, or that fail call n.
CpuFaults counting() {
  CpuFaults f;
  f.record_calls = true;
  return f;
}
CpuFaults failing(std::uint64_t n) {
  CpuFaults f;
  f.fail_call_at = n;
  return f;
}

Hooks cpu_hooks(const CpuFaults& faults, CpuRun* run) {
  Hooks h;
  h.make_backend = [faults] {
    auto b = std::make_unique<CpuBackend>(CpuBackendOptions{.threads = 2});
    b->set_guard_bands(GuardBandConfig{});
    b->set_debug_sync(false);
    b->set_faults(faults);
    return std::unique_ptr<Backend>(std::move(b));
  };
  h.at_teardown = [run](Backend& b) {
    auto& cpu = dynamic_cast<CpuBackend&>(b);
    run->calls = cpu.fault_call_count();
    run->names = cpu.fault_calls();
    const CpuBackend::HandleCounts c = cpu.handle_counts();
    return c.streams + c.events + c.graphs;
  };
  return h;
}

// What teardown left behind, one line per problem; empty when it left nothing.
std::vector<std::string> teardown_problems(const Outcome& o) {
  std::vector<std::string> p;
  if (!o.scope_built) p.push_back("the backend was never built");
  for (const auto& f : o.teardown.failures) {
    p.push_back(fmt::format("teardown failure: {}: {}", f.label, f.message));
  }
  if (o.teardown.swept != 0) p.push_back(fmt::format("the sweep freed {}", o.teardown.swept));
  if (o.live_bytes_after != 0 || o.live_allocs_after != 0) {
    p.push_back(fmt::format("{} live bytes in {} allocation(s) after teardown", o.live_bytes_after,
                            o.live_allocs_after));
  }
  if (o.handles_at_teardown != 0) {
    p.push_back(fmt::format("{} stream(s), event(s) or graph(s) left", o.handles_at_teardown));
  }
  return p;
}

TEST(CpuFaultSweep, TheLifecycleRunsAndVerifiesWithoutFaults) {
  CpuRun run;
  const Outcome o = run_lifecycle(cpu_hooks(counting(), &run), Shapes{}, rng());
  ASSERT_TRUE(o.verified) << o.message();
  for (const std::string& p : teardown_problems(o)) ADD_FAILURE() << p;
  EXPECT_EQ(run.names.size(), run.calls);
  // The lifecycle reaches every kind of fallible call but synchronize_device (no model needs
  // it), alloc_managed (only the managed-memory fallback makes one), create_timing_event (only
  // timing, the benchmarks', makes one) and the lazy-buffer calls (the scratch pool makes the
  // first reservation and commit; tests/cpu/lazy_buffer_test.cpp fails each).
  std::map<std::string, int> kinds;
  for (const std::string& n : run.names) ++kinds[n];
  for (std::string_view name : CpuBackend::fault_call_names()) {
    if (name != "synchronize_device" && name != "alloc_managed" && name != "create_timing_event" &&
        !name.starts_with("lazy_")) {
      EXPECT_GT(kinds[std::string(name)], 0) << name;
    }
  }
}

TEST(CpuFaultSweep, EveryFallibleCallFailsCleanlyAtEveryPosition) {
  CpuRun count;
  const Outcome clean = run_lifecycle(cpu_hooks(counting(), &count), Shapes{}, rng());
  ASSERT_TRUE(clean.verified) << clean.message();
  ASSERT_GT(count.calls, 50u);

  std::size_t named = 0, recovered = 0, failed = 0;
  for (std::uint64_t n = 1; n <= count.calls; ++n) {
    const std::string call = count.names[n - 1];
    const std::string where = fmt::format("call #{} ({})", n, call);
    LogCapture logs(log::Level::kWarn);
    CpuRun run;
    const Outcome o = run_lifecycle(cpu_hooks(failing(n), &run), Shapes{}, rng());
    enum { kNamed, kRecovered, kFailed } verdict = kFailed;
    if (!o.other_exception.empty()) {
      ADD_FAILURE() << where << ": not a metrale::Error: " << o.other_exception;
    } else if (o.error) {
      const std::string want = fmt::format("[cpu] {}: injected failure (call #{})", call, n);
      if (o.message().find(want) != std::string::npos) {
        verdict = kNamed;
      } else {
        ADD_FAILURE() << where << ": the error does not name the call: " << o.message();
      }
    } else if (call == "alloc" &&
               logs.count(log::Level::kWarn, "weights go to managed memory") == 1) {
      // Documented recovery: a weight allocation that finds the device full falls back to
      // managed memory (weights.h), warns once, and the model runs (verified) a little slower.
      verdict = kRecovered;
    } else if (call == "lazy_reserve" && logs.count(log::Level::kWarn, "op scratch pool") == 1) {
      // Documented recovery: the OpCache's scratch pool could not reserve its address space,
      // so scratch comes from plain allocations (op_cache.h), with one warning.
      verdict = kRecovered;
    } else {
      ADD_FAILURE() << where << ": the injected failure went unnoticed (the run completed)";
    }
    for (const std::string& p : teardown_problems(o)) {
      ADD_FAILURE() << where << ": " << p;
      verdict = kFailed;
    }
    ++(verdict == kNamed ? named : verdict == kRecovered ? recovered : failed);
  }
  const std::string summary = fmt::format(
      "fault sweep cpu: {} positions tried, {} errors naming the call, {} documented "
      "recoveries, {} failures",
      count.calls, named, recovered, failed);
  std::cout << summary << "\n";
  RecordProperty("summary", summary);
  EXPECT_EQ(failed, 0u) << summary;
  EXPECT_EQ(named + recovered + failed, count.calls);
  EXPECT_GT(recovered, 0u) << "the managed-memory fallback was never exercised";
}

}  // namespace
}  // namespace metrale::testing::reliability
