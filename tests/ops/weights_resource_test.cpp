// The one upload of quantized weights (ops::WeightsResource, and upload_weights/free_weights over
// it) on the CPU backend, whose fault injection caps device allocations but not managed ones: the
// managed-memory fallback warns once and latches per backend, the next backend tries device
// memory again, release frees once, and a failed upload leaves nothing allocated.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/ledger.h"
#include "metrale/model_scope.h"
#include "metrale/op_cache.h"
#include "metrale/ops/quant_weights.h"
#include "support/log_capture.h"

namespace metrale {
namespace {

using ::testing::HasSubstr;

constexpr std::size_t kCap = 4096;
constexpr const char* kFallbackWarning = "managed memory from now on";

std::unique_ptr<CpuBackend> capped_backend() {
  auto b = std::make_unique<CpuBackend>(CpuBackendOptions{builtin_host_modules(), 1});
  CpuFaults f;
  f.max_device_alloc = kCap;
  b->set_faults(f);
  return b;
}

// NVFP4 weights of n x k with recognisable bytes (codes n·k/2, scales n·k/16).
HostQuantWeights host_weights(std::int64_t n, std::int64_t k) {
  HostQuantWeights w;
  w.n = n;
  w.k = k;
  w.codes.resize(static_cast<std::size_t>(n * k / 2));
  w.scales.resize(static_cast<std::size_t>(n * k / 16));
  for (std::size_t i = 0; i < w.codes.size(); ++i) w.codes[i] = static_cast<std::uint8_t>(i * 7);
  for (std::size_t i = 0; i < w.scales.size(); ++i) w.scales[i] = static_cast<std::uint8_t>(i);
  w.tensor_scale = 0.25f;
  return w;
}

MemoryKind kind_of(const Backend& b, DevicePtr p) {
  const auto e = b.ledger_probe().find(p);
  EXPECT_TRUE(e.has_value());
  return e ? e->kind : MemoryKind::kPinnedHost;
}

// The device bytes of p.
std::vector<std::uint8_t> read(Backend& b, DevicePtr p, std::size_t bytes) {
  std::vector<std::uint8_t> out(bytes);
  b.copy_d2h(out.data(), p, bytes);
  return out;
}

TEST(WeightsResource, UploadsToDeviceMemoryWhenItFits) {
  auto b = capped_backend();
  const testing::LogCapture logs;
  const HostQuantWeights h = host_weights(16, 64);  // 512 + 64 bytes
  ops::WeightsResource r(*b, h, "small");
  const ops::QuantWeights& w = r.weights();
  EXPECT_EQ(r.label(), "small");
  EXPECT_EQ(kind_of(*b, w.codes), MemoryKind::kDevice);
  EXPECT_EQ(kind_of(*b, w.scales), MemoryKind::kDevice);
  EXPECT_EQ(read(*b, w.codes, w.codes_bytes), h.codes);
  EXPECT_EQ(read(*b, w.scales, w.scales_bytes), h.scales);
  EXPECT_EQ(w.tensor_scale, 0.25f);
  EXPECT_FALSE(b->op_cache().alloc_fell_back());
  EXPECT_EQ(logs.count(log::Level::kWarn, kFallbackWarning), 0u);
  r.release(*b);
  EXPECT_EQ(b->live_bytes(), 0u);
}

TEST(WeightsResource, OutOfDeviceMemoryWarnsOnceLatchesAndUsesManagedMemory) {
  auto b = capped_backend();
  const testing::LogCapture logs;
  const HostQuantWeights big = host_weights(64, 256);  // codes 8 KiB: over the 4 KiB cap
  ops::WeightsResource first(*b, big, "big");
  EXPECT_TRUE(b->op_cache().alloc_fell_back());
  EXPECT_EQ(logs.count(log::Level::kWarn, kFallbackWarning), 1u);
  EXPECT_EQ(kind_of(*b, first.weights().codes), MemoryKind::kManaged);
  // Latched: the scales (1 KiB, under the cap) and every later upload go to managed memory,
  // with no second warning.
  EXPECT_EQ(kind_of(*b, first.weights().scales), MemoryKind::kManaged);
  EXPECT_EQ(read(*b, first.weights().codes, big.codes.size()), big.codes);
  ops::WeightsResource second(*b, host_weights(16, 64), "small");
  EXPECT_EQ(kind_of(*b, second.weights().codes), MemoryKind::kManaged);
  EXPECT_EQ(kind_of(*b, second.weights().scales), MemoryKind::kManaged);
  EXPECT_EQ(logs.count(log::Level::kWarn, kFallbackWarning), 1u);
  // The ledger names this file, the caller, not the upload's own.
  EXPECT_THAT(b->alloc_report(), HasSubstr("weights_resource_test.cpp"));
  first.release(*b);
  second.release(*b);
  EXPECT_EQ(b->live_bytes(), 0u);
}

TEST(WeightsResource, TheNextBackendTriesDeviceMemoryAgain) {
  {
    auto first = capped_backend();
    ops::QuantWeights w = ops::upload_weights(*first, host_weights(64, 256));
    EXPECT_TRUE(first->op_cache().alloc_fell_back());
    ops::free_weights(*first, w);
  }
  auto second = capped_backend();
  ops::QuantWeights w = ops::upload_weights(*second, host_weights(16, 64));
  EXPECT_FALSE(second->op_cache().alloc_fell_back());
  EXPECT_EQ(kind_of(*second, w.codes), MemoryKind::kDevice);
  ops::free_weights(*second, w);
}

TEST(WeightsResource, ReleaseFreesOnceAndASecondReleaseDoesNothing) {
  auto b = capped_backend();
  ops::WeightsResource r(*b, host_weights(16, 64));
  EXPECT_EQ(b->live_alloc_count(), 2u);
  r.release(*b);
  EXPECT_EQ(b->live_alloc_count(), 0u);
  EXPECT_FALSE(r.weights().codes);
  EXPECT_FALSE(r.weights().scales);
  const std::size_t freed = b->alloc_stats().freed_bytes;
  r.release(*b);  // nothing left: no free reaches the backend
  EXPECT_EQ(b->alloc_stats().freed_bytes, freed);
  EXPECT_EQ(b->live_bytes(), 0u);
}

TEST(WeightsResource, AModelScopeReleasesItOnceAtTeardown) {
  auto owned = capped_backend();
  CpuBackend& b = *owned;
  const LedgerProbe probe = b.ledger_probe();
  ModelScope scope(std::move(owned));
  const auto& r = scope.add(ops::make_weights_resource(b, host_weights(64, 256), "weights big"));
  EXPECT_TRUE(r.weights().codes);
  // The ledger names this file (std::make_unique would have named <memory>).
  EXPECT_THAT(b.alloc_report(), HasSubstr("weights_resource_test.cpp"));
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.clean()) << report.swept << " swept";
  EXPECT_EQ(report.released, 2u);  // the weights and the op scratch
  EXPECT_EQ(probe.live_bytes(), 0u);
}

TEST(WeightsResource, TakeHandsTheBuffersOverAndLeavesNothingToRelease) {
  auto b = capped_backend();
  ops::WeightsResource r(*b, host_weights(16, 64));
  ops::QuantWeights w = r.take();
  r.release(*b);
  EXPECT_EQ(b->live_alloc_count(), 2u);
  ops::free_weights(*b, w);
  EXPECT_EQ(b->live_alloc_count(), 0u);
}

TEST(WeightsResource, AFailedUploadLeavesNothingAllocated) {
  auto b = capped_backend();
  CpuFaults f;
  f.max_device_alloc = kCap;
  // Allocation #2 is the managed fallback of the oversized codes: no memory is left to fall to.
  f.fail_call_at = 2;
  f.fail_call_of = "alloc";
  b->set_faults(f);
  const testing::LogCapture logs;
  const Error e = testing::expect_error([&] { ops::WeightsResource(*b, host_weights(64, 256)); });
  EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory);
  EXPECT_EQ(b->live_alloc_count(), 0u);
  // The scales' allocation fails after the codes were made: they are freed.
  f.fail_call_at = 2;
  f.fail_call_of = "alloc";
  f.max_device_alloc = SIZE_MAX;
  b->set_faults(f);
  const Error e2 = testing::expect_error([&] { ops::upload_weights(*b, host_weights(16, 64)); });
  EXPECT_EQ(e2.code(), ErrorCode::kOutOfMemory);
  EXPECT_EQ(b->live_alloc_count(), 0u);
  // Empty arrays are bad input, not an out-of-memory to fall back from.
  HostQuantWeights empty = host_weights(16, 64);
  empty.scales.clear();
  const Error e3 = testing::expect_error([&] { ops::upload_weights(*b, empty); });
  EXPECT_EQ(e3.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(b->live_alloc_count(), 0u);
}

}  // namespace
}  // namespace metrale
