// Lifetimes on the CUDA backend (docs/CONTRACT.md, lifetimes; teardown): a whole model in a
// ModelScope torn down to zero, then backend, registry and host dropped until the fake driver holds
// nothing; what a model forgets (streams, events, graphs, memory) is destroyed with the backend;
// teardown on a thread other than the one that built the model.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "cuda/rig.h"
#include "metrale/error.h"
#include "metrale/model_resources.h"
#include "metrale/model_scope.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "metrale/weights.h"
#include "support/log_capture.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::LogCapture;

TEST(CudaLifecycle, AWholeModelTearsDownToZeroAndTheDriverHoldsNothing) {
  Rig rig({.make_backend = false});
  auto owned = std::make_unique<CudaBackend>(rig.host, rig.registry);
  owned->set_guard_bands(GuardBandConfig{.pad_bytes = 32});  // pads must go too
  owned->require_kernels();
  ModelScope scope(std::move(owned));
  Backend& b = scope.backend();
  const LedgerProbe probe = b.ledger_probe();

  // Weights, scratch, a staging buffer, a stream, an event and a captured graph.
  const DevicePtr weights = alloc_weights(b, 64 * 1024);
  scope.add(std::make_unique<DeviceBufferResource>("weights", weights));
  const DevicePtr kv = scope.alloc_buffer("kv cache", 16 * 1024);
  const DevicePtr scratch = b.op_cache().scratch(b, "activations", 4096);
  auto* staging = static_cast<float*>(b.alloc_pinned(4096));
  scope.add(std::make_unique<PinnedBufferResource>("staging", staging));
  const StreamHandle s =
      scope.add(std::make_unique<StreamResource>("stream", b.create_stream())).get();
  const EventHandle ev =
      scope.add(std::make_unique<EventResource>("event", b.create_event())).get();
  b.begin_capture(s);
  ops::fill_u32(b, s, scratch, 1024, 3u);
  ops::axpy_f32(b, s, kv, weights, 2.0f, 1024);
  const GraphHandle g =
      scope.add(std::make_unique<GraphResource>("decode graph", b.end_capture(s))).get();

  // Run it once.
  for (int i = 0; i < 1024; ++i) staging[i] = 1.5f;
  b.copy_h2d_async(weights, staging, 4096, s);
  b.memset_async(kv, 0, 4096, s);
  b.launch_graph(g, s);
  b.record_event(ev, s);
  b.event_synchronize(ev);
  EXPECT_EQ(b.event_query(ev), EventStatus::kDone);
  EXPECT_EQ(host_view<std::uint32_t>(scratch)[1023], 3u);
  EXPECT_FLOAT_EQ(host_view<float>(kv)[1023], 3.0f);
  EXPECT_EQ(b.scan_redzones(), 0u);
  EXPECT_GT(probe.live_bytes(), 0u);

  LogCapture logs;
  const TeardownReport report = scope.teardown();
  for (const auto& f : report.failures) ADD_FAILURE() << f.label << ": " << f.message;
  EXPECT_TRUE(report.clean());
  EXPECT_EQ(report.released, 7u);  // op scratch, weights, kv cache, staging, stream, event, graph
  EXPECT_EQ(report.swept, 0u);
  EXPECT_EQ(report.live_bytes_after, 0u);
  EXPECT_EQ(probe.live_bytes(), 0u);
  EXPECT_EQ(probe.live_count(), 0u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "sweep"), 0u);
  EXPECT_TRUE(scope.torn_down());

  // The backend is gone; the model's modules, then the host, go with the last holders.
  const FakeOutstanding mid = rig.fd.outstanding();
  EXPECT_EQ(mid.allocations, 0u);
  EXPECT_EQ(mid.host_allocs, 0u);
  EXPECT_EQ(mid.streams, 1u);  // the host's
  EXPECT_EQ(mid.events, 0u);
  EXPECT_EQ(mid.graphs, 0u);
  EXPECT_EQ(mid.graph_execs, 0u);
  EXPECT_EQ(mid.modules, 1u);
  EXPECT_NO_THROW(ModuleRegistry::release(rig.registry));
  rig.host.reset();
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaLifecycle, TheBackendDestroysWhatTheModelForgot) {
  Rig rig;
  CudaBackend& b = rig.b();
  b.require_kernels();
  const StreamHandle s = b.create_stream();
  b.create_stream();
  b.create_event();
  const DevicePtr out = b.alloc(4096);
  b.alloc_pinned(256);
  b.begin_capture(s);
  ops::fill_u32(b, s, out, 1024, 1u);
  b.end_capture(s);
  b.begin_capture(s);
  b.end_capture(s);
  const FakeOutstanding before = rig.fd.outstanding();
  EXPECT_EQ(before.streams, 3u);
  EXPECT_EQ(before.events, 1u);
  EXPECT_EQ(before.graph_execs, 2u);
  EXPECT_EQ(before.allocations, 1u);
  EXPECT_EQ(before.host_allocs, 1u);

  LogCapture logs;
  rig.backend.reset();
  const FakeOutstanding after = rig.fd.outstanding();
  EXPECT_EQ(after.streams, 1u);  // the host's
  EXPECT_EQ(after.events, 0u);
  EXPECT_EQ(after.graphs, 0u);
  EXPECT_EQ(after.graph_execs, 0u);
  EXPECT_EQ(after.allocations, 0u);
  EXPECT_EQ(after.host_allocs, 0u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "cuda sweep: 2 allocation(s) never freed"), 1u);
  EXPECT_EQ(logs.count(log::Level::kWarn, "at destruction failed"), 0u);
  rig.registry.reset();
  rig.host.reset();
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaLifecycle, TwoModelsOnOneHostKeepTheirOwnCachesAndModules) {
  Rig rig;
  auto second_registry = ModuleRegistry::load(rig.host, rig.modules.span());
  CudaBackend second(rig.host, second_registry);
  const KernelHandle a = rig.b().op_cache().kernel(rig.b(), "core", "fill_u32");
  const ResolvedKernel& b = second.op_cache().kernel(second, "core", "fill_u32");
  EXPECT_NE(a, b);  // each model's own module
  EXPECT_EQ(rig.fd.outstanding().modules, 2u);
  // A handle of one model is not a kernel of the other.
  EXPECT_THROW(second.launch(a, Dim3{}, Dim3{32}, 0, StreamHandle{}, {}), Error);
  rig.backend.reset();
  rig.registry.reset();
  EXPECT_EQ(rig.fd.outstanding().modules, 1u);
  // The second model is unaffected.
  const DevicePtr out = second.alloc(64);
  ops::fill_u32(second, StreamHandle{}, out, 16, 9u);
  EXPECT_EQ(host_view<std::uint32_t>(out)[15], 9u);
  second.free(out);
}

TEST(CudaLifecycle, AModelBuiltOnOneThreadTearsDownOnAnother) {
  Rig rig;
  CudaBackend& b = rig.b();
  b.require_kernels();
  const StreamHandle s = b.create_stream();
  const EventHandle ev = b.create_event();
  const DevicePtr kept = b.alloc(1024);
  b.alloc(2048);  // forgotten: the sweep frees it
  b.create_event();
  b.create_stream();
  b.begin_capture(s);
  ops::fill_u32(b, s, kept, 256, 1u);
  const GraphHandle g = b.end_capture(s);
  b.begin_capture(s);
  b.end_capture(s);  // forgotten
  // Each call on a fresh thread that never bound the context.
  on_new_thread([&] { EXPECT_FALSE(b.is_capturing(s)); });
  on_new_thread([&] { EXPECT_NO_THROW(b.destroy_graph(g)); });
  on_new_thread([&] { EXPECT_NO_THROW(b.destroy_event(ev)); });
  on_new_thread([&] { EXPECT_NO_THROW(b.free(kept)); });
  on_new_thread([&] { EXPECT_NO_THROW(b.destroy_stream(s)); });
  const FakeOutstanding mid = rig.fd.outstanding();
  EXPECT_EQ(mid.allocations, 1u);
  EXPECT_EQ(mid.events, 1u);
  EXPECT_EQ(mid.streams, 2u);
  EXPECT_EQ(mid.graph_execs, 1u);
  LogCapture logs;
  on_new_thread([&] { rig.backend.reset(); });
  EXPECT_EQ(logs.count(log::Level::kWarn, "cuda sweep: 1 allocation(s) never freed"), 1u);
  const FakeOutstanding after = rig.fd.outstanding();
  EXPECT_EQ(after.allocations, 0u);
  EXPECT_EQ(after.events, 0u);
  EXPECT_EQ(after.streams, 1u);  // the host's
  EXPECT_EQ(after.graph_execs, 0u);
  on_new_thread([&] { rig.registry.reset(); });
  EXPECT_EQ(rig.fd.outstanding().modules, 0u);
  on_new_thread([&] { rig.host.reset(); });
  EXPECT_TRUE(rig.fd.outstanding().none());
}

TEST(CudaLifecycle, ABackendWithOnlyForgottenHandlesIsDroppedOnAnotherThread) {
  Rig rig;
  rig.b().create_stream();
  rig.b().create_event();
  on_new_thread([&] { rig.backend.reset(); });
  EXPECT_EQ(rig.fd.outstanding().streams, 1u);  // the host's
  EXPECT_EQ(rig.fd.outstanding().events, 0u);
}

}  // namespace
}  // namespace metrale::cuda::testing
