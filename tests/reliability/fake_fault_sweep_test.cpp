// Systematic fault injection on the fake CUDA driver: one clean lifecycle counts the calls of
// every driver entry point, then one lifecycle per (entry point, nth call) with that call
// failing with the status a real driver would return. Every run must end in an Error naming the
// entry point, or in a recovery listed below with its reason; nothing may crash; after teardown
// and the drop of backend, registry and host the ledger holds zero bytes and the driver holds
// nothing, except the one resource whose release the driver itself refused (see kReleases).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "reliability/fake_model.h"
#include "reliability/lifecycle.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale::testing::reliability {
namespace {

using fake::FakeOutstanding;

// What a real driver returns when the call fails for a reason of its own: out of memory where
// the call allocates (memory, a module image, a stream, an event, an instantiated graph, a
// context), out of resources for a launch, no device for cuInit; an unknown error otherwise.
CUresult failure_status(const std::string& entry) {
  static const std::map<std::string, CUresult> kStatus = {
      {"cuInit", CUDA_ERROR_NO_DEVICE},
      {"cuMemAlloc", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuMemAllocManaged", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuMemHostAlloc", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuModuleLoadData", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuStreamCreate", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuEventCreate", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuGraphInstantiateWithFlags", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuDevicePrimaryCtxRetain", CUDA_ERROR_OUT_OF_MEMORY},
      {"cuLaunchKernel", CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES},
  };
  const auto it = kStatus.find(entry);
  return it == kStatus.end() ? CUDA_ERROR_UNKNOWN : it->second;
}

// Releases: when the driver refuses one, the fake (like a driver) keeps the resource. The
// runtime reports the refusal by name (an Error, a teardown failure or a warning) and does not
// retry: the resource is gone from every runtime table, so nothing frees it twice. That one
// resource is all a run may leave in the driver.
std::size_t FakeOutstanding::*released_kind(const std::string& entry) {
  static const std::map<std::string, std::size_t FakeOutstanding::*> kReleases = {
      {"cuMemFree", &FakeOutstanding::allocations},
      {"cuMemFreeHost", &FakeOutstanding::host_allocs},
      {"cuStreamDestroy", &FakeOutstanding::streams},
      {"cuEventDestroy", &FakeOutstanding::events},
      {"cuGraphDestroy", &FakeOutstanding::graphs},
      {"cuGraphExecDestroy", &FakeOutstanding::graph_execs},
      {"cuModuleUnload", &FakeOutstanding::modules},
      {"cuDevicePrimaryCtxRelease", &FakeOutstanding::contexts},
  };
  const auto it = kReleases.find(entry);
  return it == kReleases.end() ? nullptr : it->second;
}

std::vector<std::string> entry_points() {
#define METRALE_ENTRY_NAME(name, version) #name,
  return {METRALE_DRIVER_FUNCTIONS(METRALE_ENTRY_NAME)};
#undef METRALE_ENTRY_NAME
}

Hooks fake_hooks(FakeProcess& p) {
  return Hooks{[&p] { return p.make_backend(); }, nullptr};
}

std::string str(const FakeOutstanding& o) {
  return fmt::format(
      "allocations {}, host allocations {}, modules {}, streams {}, events {}, graphs {}, graph "
      "execs {}, contexts {}",
      o.allocations, o.host_allocs, o.modules, o.streams, o.events, o.graphs, o.graph_execs,
      o.contexts);
}

TEST(FakeFaultSweep, TheLifecycleRunsAndVerifiesWithoutFaults) {
  FakeProcess p;
  const Outcome o = run_lifecycle(fake_hooks(p), Shapes{}, rng());
  ASSERT_TRUE(o.verified) << o.message();
  EXPECT_TRUE(o.teardown.clean());
  EXPECT_EQ(o.live_bytes_after, 0u);
  EXPECT_TRUE(p.fd.outstanding().none()) << str(p.fd.outstanding());
  EXPECT_EQ(p.fd.graph_replays(), 2u);
  // Every w4a16 route ran on the fake: the grid of each launch came from its published tile.
  std::map<std::string, int> launched;
  for (const fake::FakeLaunch& l : p.fd.launches()) ++launched[l.function];
  for (const char* k :
       {"fill_u32", "axpy_f32", "dequant_e4m3", "gemm_decode", "gemm_tiled", "gemm_e4m3"}) {
    EXPECT_EQ(launched[k], 3) << k;  // eagerly, then two replays
  }
  EXPECT_EQ(launched["bf16_to_fp8"], 6);  // the cast op and the e4m3 route's own cast
}

struct Tally {
  std::size_t positions = 0, named = 0, recovered = 0, refused = 0, failed = 0;
};

TEST(FakeFaultSweep, EveryDriverCallFailsCleanlyAtEveryPosition) {
  std::map<std::string, std::uint64_t> counts;
  {
    FakeProcess p;
    const Outcome clean = run_lifecycle(fake_hooks(p), Shapes{}, rng());
    ASSERT_TRUE(clean.verified) << clean.message();
    for (const std::string& e : entry_points()) {
      if (const std::uint64_t n = p.fd.calls(e)) counts[e] = n;
    }
  }
  ASSERT_GT(counts.size(), 30u);

  Tally all;
  std::map<std::string, Tally> per_entry;
  for (const auto& [entry, count] : counts) {
    for (std::uint64_t nth = 1; nth <= count; ++nth) {
      const std::string where = fmt::format("{} #{} of {}", entry, nth, count);
      FakeProcess p;
      p.fd.fail_at(entry, nth, failure_status(entry));
      LogCapture logs(log::Level::kWarn);
      const Outcome o = run_lifecycle(fake_hooks(p), Shapes{}, rng());
      const auto kind = released_kind(entry);
      // Every place a failure may be reported: the error, teardown failures, warnings.
      std::string reports = o.message();
      for (const auto& f : o.teardown.failures) reports += "\n" + f.label + ": " + f.message;
      for (const LogCapture::Line& l : logs.lines()) reports += "\n" + l.text;

      enum { kNamed, kRecovered, kRefused, kFailed } verdict = kFailed;
      if (!o.other_exception.empty()) {
        ADD_FAILURE() << where << ": not a metrale::Error: " << o.other_exception;
      } else if (o.error) {
        if (o.message().find(entry) != std::string::npos) {
          verdict = kind ? kRefused : kNamed;
        } else {
          ADD_FAILURE() << where << ": the error does not name " << entry << ": " << o.message();
        }
      } else if (kind != nullptr) {
        if (reports.find(entry) != std::string::npos) {
          verdict = kRefused;
        } else {
          ADD_FAILURE() << where << ": the refused release was reported nowhere";
        }
      } else if (entry == "cuMemAlloc" &&
                 logs.count(log::Level::kWarn, "weights go to managed memory") == 1) {
        // Documented recovery: a weight allocation that finds the device full falls back to
        // managed memory (weights.h), warns once, and the model runs (verified) slower.
        verdict = kRecovered;
      } else if ((entry == "cuMemAddressReserve" || entry == "cuMemGetAllocationGranularity") &&
                 logs.count(log::Level::kWarn, "op scratch pool") == 1) {
        // Documented recovery: the OpCache's scratch pool could not reserve its address space,
        // so scratch comes from plain allocations (op_cache.h), with one warning.
        verdict = kRecovered;
      } else if ((entry == "cuMemUnmap" || entry == "cuMemRelease" || entry == "cuMemAddressFree" ||
                  entry == "cuCtxSynchronize" || entry == "cuCtxSetCurrent") &&
                 !o.teardown.failures.empty() &&
                 o.teardown.failures.front().message.find(entry) != std::string::npos) {
        // Documented: the scratch pool's lazy buffer is released at teardown, which reports a
        // refused step (or the bind of its synchronize) as the teardown's failure and still
        // tries every other step (lazy_buffer.h); the check below holds that nothing is left.
        verdict = kRefused;
      } else if (entry == "cuThreadExchangeStreamCaptureMode" &&
                 logs.count(log::Level::kWarn, "failed restoring the thread's capture mode") == 1) {
        // Documented recovery: an allocation relaxes the thread's capture mode for its call and
        // warns when restoring it fails (Note [allocations during capture]); a failed swap
        // before the allocation is an Error naming the call (the branch above).
        verdict = kRecovered;
      } else if (entry == "cuCtxSetCurrent") {
        // Documented recovery: cleanup paths (frees, destroys, teardown) bind the context
        // quietly and let the call that follows report what it finds (cuda/host.h); here the
        // context was still current, so the call that followed succeeded. A failed bind on any
        // other path is an Error naming cuCtxSetCurrent.
        verdict = kRecovered;
      } else {
        ADD_FAILURE() << where << ": the injected failure went unnoticed (the run completed)";
      }

      // What is left: nothing, or only the one resource the driver refused to release.
      std::vector<std::string> left;
      if (o.scope_built && (o.live_bytes_after != 0 || o.live_allocs_after != 0)) {
        left.push_back(fmt::format("{} live bytes on the ledger", o.live_bytes_after));
      }
      if (o.teardown.swept != 0) left.push_back("the ledger sweep had to free memory");
      if (verdict != kRefused && !o.teardown.failures.empty()) {
        left.push_back("teardown failed: " + o.teardown.failures.front().message);
      }
      FakeOutstanding expect;
      if (verdict == kRefused && kind != nullptr) expect.*kind = 1;
      const FakeOutstanding got = p.fd.outstanding();
      if (str(got) != str(expect)) {
        left.push_back(fmt::format("the driver holds {} (expected {})", str(got), str(expect)));
      }
      for (const std::string& l : left) ADD_FAILURE() << where << ": " << l;
      if (!left.empty()) verdict = kFailed;

      for (Tally* t : {&all, &per_entry[entry]}) {
        ++t->positions;
        ++(verdict == kNamed       ? t->named
           : verdict == kRecovered ? t->recovered
           : verdict == kRefused   ? t->refused
                                   : t->failed);
      }
    }
  }
  std::cout << fmt::format("{:<30} {:>9} {:>6} {:>9} {:>7} {:>6}\n", "entry point", "positions",
                           "named", "recovered", "refused", "failed");
  for (const auto& [entry, t] : per_entry) {
    std::cout << fmt::format("{:<30} {:>9} {:>6} {:>9} {:>7} {:>6}\n", entry, t.positions, t.named,
                             t.recovered, t.refused, t.failed);
  }
  const std::string summary = fmt::format(
      "fault sweep fake driver: {} positions tried over {} entry points, {} errors naming the "
      "call, {} documented recoveries, {} refused releases reported by name, {} failures",
      all.positions, counts.size(), all.named, all.recovered, all.refused, all.failed);
  std::cout << summary << "\n";
  RecordProperty("summary", summary);
  EXPECT_EQ(all.failed, 0u) << summary;
  EXPECT_GT(per_entry["cuMemAlloc"].recovered, 0u) << "the managed fallback was never exercised";
}

}  // namespace
}  // namespace metrale::testing::reliability
