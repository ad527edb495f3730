// ModelScope teardown (docs/CONTRACT.md, teardown): newest-first release, every resource tried,
// failures reported by label, then the ledger sweep; the OpCache's scratch goes last as "op
// scratch".
#include "metrale/model_scope.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/model_resources.h"
#include "metrale/op_cache.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using testing::expect_error;
using ::testing::HasSubstr;
using testing::random_size;
using testing::rng;

std::unique_ptr<Backend> make_backend() {
  return std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
}

// How a Recorder's release fails.
enum class Fail { kNo, kMetraleError, kStdError, kNonStd };

// What the recorders saw, in release order; it outlives the scope (teardown destroys them).
struct Journal {
  std::vector<std::string> order;
  std::vector<std::size_t> scratch_seen;  // the OpCache's scratch count at each release
};

// Writes its label to a journal when released, with what the backend's OpCache held then.
class Recorder final : public ModelResource {
 public:
  Recorder(std::string label, Journal& journal, Fail fail = Fail::kNo)
      : label_(std::move(label)), journal_(journal), fail_(fail) {}
  std::string label() const override { return label_; }
  void release(Backend& backend) override {
    journal_.order.push_back(label_);
    journal_.scratch_seen.push_back(backend.op_cache().scratch_count());
    switch (fail_) {
      case Fail::kNo:
        return;
      case Fail::kMetraleError:
        throw Error(ErrorCode::kDriver, "release", label_ + " could not be given back");
      case Fail::kStdError:
        throw std::runtime_error(label_ + " broke");
      case Fail::kNonStd:
        throw 42;
    }
  }

 private:
  std::string label_;
  Journal& journal_;
  Fail fail_;
};

TEST(ModelScope, TeardownReleasesNewestFirst) {
  Journal journal;
  ModelScope scope(make_backend());
  const std::size_t n = random_size(2, 9);
  for (std::size_t i = 0; i < n; ++i) {
    scope.add(std::make_unique<Recorder>(fmt::format("r{}", i), journal));
  }
  EXPECT_FALSE(scope.torn_down());
  const TeardownReport report = scope.teardown();
  std::vector<std::string> want;
  for (std::size_t i = n; i-- > 0;) want.push_back(fmt::format("r{}", i));
  EXPECT_THAT(journal.order, ElementsAreArray(want));
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(report.released, n + 1);  // every recorder and the op scratch
  EXPECT_EQ(report.swept, 0u);
  EXPECT_EQ(report.live_bytes_after, 0u);
  EXPECT_TRUE(report.clean());
  EXPECT_TRUE(scope.torn_down());
}

// The handle resources of model_resources.h give each handle back once: the CPU backend's
// streams, events and graphs go to zero, a second release is a no-op (a second destroy would
// throw), and teardown releases what is left (the pinned buffer) cleanly, to zero bytes.
TEST(ModelResources, HandlesAreGivenBackOnce) {
  auto owned = std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
  CpuBackend& cpu = *owned;
  ModelScope scope(std::move(owned));
  Backend& b = scope.backend();
  auto& pinned = scope.add(
      std::make_unique<PinnedBufferResource>("staging", b.alloc_pinned(random_size(1, 4096))));
  auto& stream = scope.add(std::make_unique<StreamResource>("stream", b.create_stream()));
  auto& event = scope.add(std::make_unique<EventResource>("event", b.create_event()));
  b.begin_capture(stream.get());
  auto& graph = scope.add(std::make_unique<GraphResource>("graph", b.end_capture(stream.get())));
  EXPECT_EQ(stream.label(), "stream");
  EXPECT_NE(pinned.get(), nullptr);
  EXPECT_EQ(cpu.handle_counts().streams, 1u);
  EXPECT_EQ(cpu.handle_counts().events, 1u);
  EXPECT_EQ(cpu.handle_counts().graphs, 1u);
  for (ModelResource* r : {static_cast<ModelResource*>(&graph), static_cast<ModelResource*>(&event),
                           static_cast<ModelResource*>(&stream)}) {
    r->release(b);
    r->release(b);
  }
  EXPECT_FALSE(graph.get());
  EXPECT_FALSE(event.get());
  EXPECT_FALSE(stream.get());
  EXPECT_EQ(cpu.handle_counts().streams, 0u);
  EXPECT_EQ(cpu.handle_counts().events, 0u);
  EXPECT_EQ(cpu.handle_counts().graphs, 0u);
  EXPECT_GT(b.live_bytes(), 0u);  // the pinned buffer
  const LedgerProbe probe = b.ledger_probe();
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.clean()) << (report.failures.empty() ? "" : report.failures[0].message);
  EXPECT_EQ(report.released, 5u);  // the four resources and the op scratch
  EXPECT_EQ(probe.live_bytes(), 0u);
}

TEST(ModelScope, TeardownTriesEveryResourceAndReportsEachFailure) {
  Journal journal;
  ModelScope scope(make_backend());
  scope.add(std::make_unique<Recorder>("weights", journal, Fail::kMetraleError));
  scope.add(std::make_unique<Recorder>("kv cache", journal));
  scope.add(std::make_unique<Recorder>("graphs", journal, Fail::kStdError));
  scope.add(std::make_unique<Recorder>("streams", journal, Fail::kNonStd));
  scope.add(std::make_unique<Recorder>("events", journal));
  const TeardownReport report = scope.teardown();
  EXPECT_THAT(journal.order, ElementsAre("events", "streams", "graphs", "kv cache", "weights"));
  EXPECT_EQ(report.released, 3u);  // events, kv cache, op scratch
  ASSERT_EQ(report.failures.size(), 3u);
  EXPECT_EQ(report.failures[0].label, "streams");
  EXPECT_EQ(report.failures[0].message, "unknown exception");
  EXPECT_EQ(report.failures[1].label, "graphs");
  EXPECT_EQ(report.failures[1].message, "graphs broke");
  EXPECT_EQ(report.failures[2].label, "weights");
  EXPECT_EQ(report.failures[2].message, "[release] weights could not be given back");
  EXPECT_FALSE(report.clean());
  EXPECT_EQ(report.swept, 0u);
  EXPECT_EQ(report.live_bytes_after, 0u);
}

TEST(ModelScope, TeardownSweepsWhatNoResourceReleased) {
  ModelScope scope(make_backend());
  const std::size_t n = random_size(1, 4096);
  const DevicePtr owned = scope.alloc_buffer("weights", n);
  ASSERT_TRUE(owned);
  const std::size_t k = random_size(1, 4);
  for (std::size_t i = 0; i < k; ++i) scope.backend().alloc(random_size(1, 4096));
  EXPECT_EQ(scope.backend().live_alloc_count(), k + 1);
  testing::LogCapture logs;
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(report.released, 2u);  // the buffer and the op scratch
  EXPECT_EQ(report.swept, k);
  EXPECT_EQ(report.live_bytes_after, 0u);
  EXPECT_FALSE(report.clean());
  EXPECT_EQ(logs.count(log::Level::kWarn,
                       fmt::format("the ledger sweep freed {} allocation(s) that no resource "
                                   "released",
                                   k)),
            1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, fmt::format("{} allocation(s) never freed", k)), 1u);
}

// The report names what the sweep found, so a leak check can fail with the call site.
TEST(ModelScope, TheReportNamesEachSweptAllocationAndItsCallSite) {
  ModelScope scope(make_backend());
  const std::size_t n = random_size(1, 4096);
  const int line = __LINE__ + 1;
  (void)scope.backend().alloc(n);
  const testing::LogCapture quiet(log::Level::kError);
  const TeardownReport report = scope.teardown();
  ASSERT_EQ(report.leaks.size(), 1u);
  EXPECT_EQ(report.swept_bytes, n);
  EXPECT_EQ(report.leaks[0].bytes, n);
  const std::string site = fmt::format("model_scope_test.cpp:{}", line);
  EXPECT_EQ(report.leaks[0].site.str(), site);
  EXPECT_EQ(report.leak_summary(),
            fmt::format("1 allocation(s), {}: {} from {}", format_bytes(n), format_bytes(n), site));
}

TEST(ModelScope, ACleanTeardownLogsNothing) {
  ModelScope scope(make_backend());
  scope.alloc_buffer("weights", random_size(1, 4096));
  scope.backend().op_cache().scratch(scope.backend(), "act", random_size(1, 4096));
  testing::LogCapture logs(log::Level::kWarn);
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.clean());
  EXPECT_EQ(report.swept, 0u);
  EXPECT_TRUE(logs.lines().empty());
}

TEST(ModelScope, SecondTeardownReturnsAnEmptyReport) {
  Journal journal;
  ModelScope scope(make_backend());
  scope.add(std::make_unique<Recorder>("weights", journal, Fail::kMetraleError));
  scope.backend().alloc(64);  // left for the sweep
  const TeardownReport first = scope.teardown();
  EXPECT_EQ(first.failures.size(), 1u);
  EXPECT_EQ(first.swept, 1u);
  const TeardownReport second = scope.teardown();
  EXPECT_TRUE(second.failures.empty());
  EXPECT_EQ(second.released, 0u);
  EXPECT_EQ(second.swept, 0u);
  EXPECT_EQ(second.live_bytes_after, 0u);
  EXPECT_TRUE(second.clean());
  EXPECT_THAT(journal.order, ElementsAre("weights"));  // not released again
}

TEST(ModelScope, BackendAfterTeardownIsAStateError) {
  ModelScope scope(make_backend());
  EXPECT_EQ(scope.backend().name(), "cpu");
  scope.teardown();
  const Error e = expect_error([&] { scope.backend(); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[ModelScope]"));
  EXPECT_THAT(e.what(), HasSubstr("torn down"));

  Journal journal;
  const Error add = expect_error([&] { scope.add(std::make_unique<Recorder>("late", journal)); });
  EXPECT_EQ(add.code(), ErrorCode::kState);
  const Error buf = expect_error([&] { scope.alloc_buffer("late", 16); });
  EXPECT_EQ(buf.code(), ErrorCode::kState);
  EXPECT_TRUE(journal.order.empty());
}

TEST(ModelScope, BadConstructionAndNullResourcesThrow) {
  const Error e = expect_error([] { ModelScope scope(nullptr); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[ModelScope] backend is null"));

  ModelScope scope(make_backend());
  const Error r = expect_error([&] { scope.add(std::unique_ptr<Recorder>()); });
  EXPECT_EQ(r.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(r.what(), HasSubstr("resource is null"));
}

TEST(ModelScope, DestructorTearsDownWhenTeardownWasNotCalled) {
  Journal journal;
  std::unique_ptr<LedgerProbe> probe;
  testing::LogCapture logs;
  {
    ModelScope scope(make_backend());
    probe = std::make_unique<LedgerProbe>(scope.backend().ledger_probe());
    scope.alloc_buffer("weights", random_size(1, 4096));
    scope.backend().op_cache().scratch(scope.backend(), "act", random_size(1, 4096));
    scope.add(std::make_unique<Recorder>("first", journal));
    scope.add(std::make_unique<Recorder>("second", journal, Fail::kStdError));
    scope.backend().alloc(32);  // left for the sweep
    EXPECT_EQ(probe->live_count(), 3u);
    EXPECT_GT(probe->live_bytes(), 0u);
  }
  EXPECT_THAT(journal.order, ElementsAre("second", "first"));
  EXPECT_EQ(probe->live_bytes(), 0u);
  EXPECT_EQ(probe->live_count(), 0u);
  EXPECT_EQ(probe->stats().free_count, 3u);
  // The destructor cannot return a report, so it logs each failure with its label.
  EXPECT_EQ(logs.count(log::Level::kError, "teardown: second: second broke"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "the ledger sweep freed 1 allocation(s)"), 1u);
}

TEST(ModelScope, OpScratchIsReleasedAfterEveryOtherResource) {
  Journal journal;
  ModelScope scope(make_backend());
  Backend& backend = scope.backend();
  backend.op_cache().scratch(backend, "fp8_activation", random_size(1, 4096));
  backend.op_cache().scratch(backend, "fp8_weights", random_size(1, 4096));
  scope.add(std::make_unique<Recorder>("a", journal));
  scope.add(std::make_unique<Recorder>("b", journal));
  const TeardownReport report = scope.teardown();
  EXPECT_THAT(journal.order, ElementsAre("b", "a"));
  // Both recorders ran while the cache still held its scratch.
  EXPECT_THAT(journal.scratch_seen, ElementsAre(2u, 2u));
  // Then the op scratch freed it: nothing for the sweep.
  EXPECT_EQ(report.released, 3u);
  EXPECT_EQ(report.swept, 0u);
  EXPECT_TRUE(report.clean());
  EXPECT_EQ(report.live_bytes_after, 0u);
}

TEST(ModelScope, AFailingOpScratchIsReportedLastUnderItsLabel) {
  Journal journal;
  ModelScope scope(make_backend());
  Backend& backend = scope.backend();
  const DevicePtr s = backend.op_cache().scratch(backend, "act", random_size(1, 4096));
  backend.op_cache().scratch(backend, "other", random_size(1, 4096));
  scope.add(std::make_unique<Recorder>("weights", journal, Fail::kMetraleError));
  scope.add(std::make_unique<Recorder>("kv", journal));
  backend.free(s);  // behind the cache's back: its release will fail to free it
  testing::LogCapture logs;
  const TeardownReport report = scope.teardown();
  ASSERT_EQ(report.failures.size(), 2u);
  EXPECT_EQ(report.failures[0].label, "weights");
  EXPECT_EQ(report.failures[1].label, "op scratch");
  EXPECT_THAT(report.failures[1].message, HasSubstr("[free]"));
  EXPECT_THAT(report.failures[1].message, HasSubstr(fmt::format("0x{:x}", s.address())));
  EXPECT_EQ(report.released, 1u);
  EXPECT_EQ(report.swept, 0u);  // the other scratch buffer was still freed
  EXPECT_EQ(report.live_bytes_after, 0u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "op scratch: freeing 'act' failed"), 1u);
}

// The smaller buffer a grown scratch tag retired is freed by the cache's release, so the
// sweep finds nothing (it is the net for leaks, not a part of the plan).
TEST(ModelScope, GrownScratchRetiresTheSmallerBufferUntilRelease) {
  ModelScope scope(make_backend());
  Backend& backend = scope.backend();
  const std::size_t small = random_size(1, 512);
  backend.op_cache().scratch(backend, "act", small);
  backend.op_cache().scratch(backend, "act", small + random_size(1, 4096));
  EXPECT_EQ(backend.live_alloc_count(), 2u);
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.failures.empty());
  EXPECT_EQ(report.swept, 0u);
  EXPECT_EQ(report.live_bytes_after, 0u);
}

TEST(ModelScope, AllocBufferRecordsTheCallersLine) {
  ModelScope scope(make_backend());
  const std::size_t n = random_size(1, 4096);
  const auto [p, line] = std::pair(scope.alloc_buffer("weights", n), __LINE__);
  EXPECT_TRUE(p);
  EXPECT_EQ(scope.backend().live_bytes(), n);
  const std::string report = scope.backend().alloc_report();
  EXPECT_THAT(report, HasSubstr(fmt::format("model_scope_test.cpp:{}", line)));
  EXPECT_THAT(report, ::testing::Not(HasSubstr("model_scope.cpp")));
  const TeardownReport r = scope.teardown();
  EXPECT_TRUE(r.clean());
  EXPECT_EQ(r.released, 2u);
}

TEST(ModelScope, AFailedAllocBufferAddsNoResource) {
  ModelScope scope(make_backend());
  CpuFaults faults;
  faults.fail_call_at = 1;
  faults.fail_call_of = "alloc";
  dynamic_cast<CpuBackend&>(scope.backend()).set_faults(faults);
  const Error e = expect_error([&] { scope.alloc_buffer("weights", 128); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_THAT(e.what(), HasSubstr("[alloc]"));
  EXPECT_EQ(scope.backend().live_bytes(), 0u);
  const TeardownReport r = scope.teardown();
  EXPECT_TRUE(r.clean());
  EXPECT_EQ(r.released, 1u);  // only the op scratch
}

// ---- uses: work that may race teardown ----

// Calls use() until it is refused (teardown began on another thread) and returns that error;
// fails the test if it is still accepted after ten seconds.
Error wait_until_refused(ModelScope& scope) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    try {
      ModelScope::Use probe = scope.use();
    } catch (const Error& e) {
      return e;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ADD_FAILURE() << "use() was still accepted ten seconds after teardown began";
  return Error(ErrorCode::kInternal, "test", "never refused");
}

TEST(ModelScopeUse, AUseGivesTheBackendAndCountsUntilItEnds) {
  ModelScope scope(make_backend());
  EXPECT_EQ(scope.live_uses(), 0u);
  ModelScope::Use a = scope.use();
  EXPECT_TRUE(a);
  EXPECT_EQ(&a.backend(), &scope.backend());
  ModelScope::Use b = scope.use();
  EXPECT_EQ(scope.live_uses(), 2u);
  ModelScope::Use moved = std::move(b);  // a move hands the claim over, it does not add one
  EXPECT_FALSE(b);                       // NOLINT(bugprone-use-after-move): the point
  EXPECT_EQ(scope.live_uses(), 2u);
  moved = std::move(a);  // ends moved's own claim, takes a's
  EXPECT_EQ(scope.live_uses(), 1u);
  moved.reset();
  moved.reset();  // a second reset does nothing
  EXPECT_EQ(scope.live_uses(), 0u);
  const Error e = expect_error([&] { moved.backend(); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[ModelScope::Use] this use has ended"));
  EXPECT_TRUE(scope.teardown().clean());
}

TEST(ModelScopeUse, UseAfterTeardownIsAStateErrorNamingTheCall) {
  ModelScope scope(make_backend());
  scope.teardown();
  const Error e = expect_error([&] { scope.use(); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[ModelScope::use] the model was torn down"));
  EXPECT_EQ(scope.live_uses(), 0u);
}

TEST(ModelScopeUse, TeardownWaitsForLiveUsesAndRefusesNewWork) {
  Journal journal;
  ModelScope scope(make_backend());
  scope.add(std::make_unique<Recorder>("weights", journal));
  const LedgerProbe probe = scope.backend().ledger_probe();
  ModelScope::Use use = scope.use();
  Backend& b = use.backend();
  const DevicePtr act = b.op_cache().scratch(b, "act", random_size(1, 4096));

  std::atomic<bool> returned{false};
  TeardownReport report;
  std::thread closer([&] {
    report = scope.teardown();
    returned = true;
  });
  const Error refused = wait_until_refused(scope);
  EXPECT_EQ(refused.code(), ErrorCode::kState);
  EXPECT_THAT(refused.what(), HasSubstr("[ModelScope::use] the model is being torn down"));
  const Error late = expect_error([&] { scope.add(std::make_unique<Recorder>("late", journal)); });
  EXPECT_EQ(late.code(), ErrorCode::kState);
  EXPECT_EQ(expect_error([&] { scope.alloc_buffer("late", 16); }).code(), ErrorCode::kState);
  EXPECT_EQ(expect_error([&] { scope.backend(); }).code(), ErrorCode::kState);

  // Teardown has begun but waits for this use: nothing is released, the backend still works.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(returned);
  EXPECT_FALSE(scope.torn_down());
  EXPECT_TRUE(journal.order.empty());
  EXPECT_EQ(b.op_cache().scratch(b, "act", 1), act);
  const DevicePtr p = b.alloc(64);
  b.memset(p, 0x5A, 64);
  b.free(p);
  EXPECT_TRUE(probe.find(act));

  use.reset();
  closer.join();
  EXPECT_TRUE(returned);
  EXPECT_TRUE(scope.torn_down());
  EXPECT_THAT(journal.order, ElementsAre("weights"));
  EXPECT_TRUE(report.clean());
  EXPECT_EQ(report.released, 2u);
  EXPECT_FALSE(probe.find(act));
  EXPECT_EQ(probe.live_bytes(), 0u);
}

TEST(ModelScopeUse, TeardownOnAThreadHoldingAUseIsRefusedAndChangesNothing) {
  Journal journal;
  ModelScope scope(make_backend());
  scope.add(std::make_unique<Recorder>("weights", journal));
  ModelScope::Use use = scope.use();
  const Error e = expect_error([&] { scope.teardown(); });
  EXPECT_EQ(e.code(), ErrorCode::kState);
  EXPECT_THAT(e.what(), HasSubstr("[teardown] this thread holds 1 use(s) of the model"));
  EXPECT_FALSE(scope.torn_down());
  EXPECT_TRUE(journal.order.empty());
  // The model is still open: new uses are accepted.
  EXPECT_EQ(&scope.use().backend(), &use.backend());
  use.reset();
  EXPECT_TRUE(scope.teardown().clean());
  EXPECT_THAT(journal.order, ElementsAre("weights"));
}

TEST(ModelScopeUse, ConcurrentTeardownsReleaseOnceAndBothReturnWhenItIsDone) {
  Journal journal;
  ModelScope scope(make_backend());
  scope.add(std::make_unique<Recorder>("weights", journal));
  ModelScope::Use use = scope.use();  // holds the first teardown while the second arrives
  TeardownReport reports[2];
  std::atomic<int> returned{0};
  std::vector<std::thread> closers;
  for (TeardownReport& r : reports) {
    closers.emplace_back([&] {
      r = scope.teardown();
      ++returned;
    });
  }
  wait_until_refused(scope);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(returned, 0);
  use.reset();
  for (std::thread& t : closers) t.join();
  EXPECT_EQ(returned, 2);
  EXPECT_EQ(reports[0].released + reports[1].released, 2u);  // the recorder and the op scratch
  EXPECT_TRUE(reports[0].released == 0 || reports[1].released == 0);
  EXPECT_THAT(journal.order, ElementsAre("weights"));
}

TEST(ModelScopeUse, AResourceCannotTakeAUseWhileItIsReleased) {
  // A release that tried to start work on its own model would wait for itself; it is refused.
  struct SelfUser final : ModelResource {
    ModelScope* scope = nullptr;
    std::string label() const override { return "self user"; }
    void release(Backend&) override { scope->use(); }
  };
  ModelScope scope(make_backend());
  scope.add(std::make_unique<SelfUser>()).scope = &scope;
  const TeardownReport r = scope.teardown();
  ASSERT_EQ(r.failures.size(), 1u);
  EXPECT_EQ(r.failures[0].label, "self user");
  EXPECT_THAT(r.failures[0].message, HasSubstr("[ModelScope::use] the model is being torn down"));
}

TEST(DeviceBufferResource, ReleaseFreesOnce) {
  auto backend = make_backend();
  const std::size_t n = random_size(1, 4096);
  const DevicePtr p = backend->alloc(n);
  DeviceBufferResource res("kv", p);
  EXPECT_EQ(res.label(), "kv");
  EXPECT_EQ(res.ptr(), p);
  res.release(*backend);
  EXPECT_FALSE(res.ptr());
  EXPECT_EQ(backend->live_bytes(), 0u);
  res.release(*backend);  // nothing left to free: no double free
  EXPECT_EQ(backend->alloc_stats().free_count, 1u);
}

TEST(DeviceBufferResource, AFailedFreeIsNotRetried) {
  auto backend = make_backend();
  const DevicePtr p = backend->alloc(64);
  DeviceBufferResource res("kv", p);
  backend->free(p);
  const Error e = expect_error([&] { res.release(*backend); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[free]"));
  EXPECT_FALSE(res.ptr());
  res.release(*backend);  // cleared before the free: the second call does nothing
}

}  // namespace
}  // namespace metrale
