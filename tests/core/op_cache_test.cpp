// OpCache: the kernel-handle memo, grow-only scratch, the diagnostic gates and the published
// kernel metadata of one backend (docs/CONTRACT.md, OpCache). The first three tests re-make the
// original runtime's own.
#include "metrale/op_cache.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <latch>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/host_module.h"
#include "support/log_capture.h"
#include "support/random.h"

namespace metrale {
namespace {

using testing::expect_error;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::random_size;
using testing::rng;

CpuBackendOptions one_thread(std::vector<HostModule> modules = builtin_host_modules()) {
  return CpuBackendOptions{std::move(modules), 1};
}

void noop(const HostBlock&) {}

// ---- the original's three tests ----

TEST(OpCache, AKernelIsResolvedOnceAndReused) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const ResolvedKernel a = cache.kernel(backend, "core", "fill_u32");
  const ResolvedKernel b = cache.kernel(backend, "core", "fill_u32");
  EXPECT_TRUE(a);
  EXPECT_EQ(a, b);
  EXPECT_EQ(cache.kernel_count(), 1u);
  // The backend was asked once; the second request was a memo hit.
  const std::vector<KernelLookup> audit = backend.lookup_audit();
  ASSERT_EQ(audit.size(), 1u);
  EXPECT_EQ(audit[0].module, "core");
  EXPECT_EQ(audit[0].function, "fill_u32");
  EXPECT_TRUE(audit[0].resolved);
  EXPECT_EQ(backend.kernel_name(a), "core::fill_u32");
}

TEST(OpCache, TwoCachesShareNeitherHandlesNorScratch) {
  CpuBackend backend_a(one_thread());
  CpuBackend backend_b(one_thread());
  OpCache a;
  OpCache b;
  const std::size_t bytes = random_size(1, 1 << 16);
  const DevicePtr scratch_a = a.scratch(backend_a, "fp8_activation", bytes);
  const ResolvedKernel kernel_a = a.kernel(backend_a, "core", "fill_u32");
  EXPECT_EQ(a.summary(), "OpCache{kernels: 1, scratch: 1}");
  EXPECT_EQ(b.summary(), "OpCache{kernels: 0, scratch: 0}");  // the second starts empty
  EXPECT_EQ(backend_b.live_bytes(), 0u);

  const DevicePtr scratch_b = b.scratch(backend_b, "fp8_activation", bytes);
  const ResolvedKernel kernel_b = b.kernel(backend_b, "core", "fill_u32");
  EXPECT_NE(scratch_a, scratch_b);
  EXPECT_NE(kernel_a, kernel_b);
  // Each cache asked its own backend: one lookup and one allocation on each.
  EXPECT_EQ(backend_a.lookup_audit().size(), 1u);
  EXPECT_EQ(backend_b.lookup_audit().size(), 1u);
  EXPECT_EQ(backend_a.live_bytes(), bytes);
  EXPECT_EQ(backend_b.live_bytes(), bytes);
  EXPECT_EQ(backend_b.kernel_name(kernel_b), "core::fill_u32");

  // Releasing one leaves the other's scratch where it was.
  a.release(backend_a);
  EXPECT_EQ(backend_a.live_bytes(), 0u);
  EXPECT_EQ(backend_b.live_bytes(), bytes);
  EXPECT_EQ(b.scratch(backend_b, "fp8_activation", bytes), scratch_b);
  b.release(backend_b);
  EXPECT_EQ(backend_b.live_bytes(), 0u);
}

TEST(OpCache, ScratchGrowsButNeverShrinks) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const std::size_t small_bytes = random_size(2, 1024);
  const auto [small, line] = std::pair(cache.scratch(backend, "act", small_bytes), __LINE__);
  const DevicePtr same = cache.scratch(backend, "act", random_size(1, small_bytes));
  EXPECT_EQ(small, same);  // a request that fits reuses the buffer
  EXPECT_EQ(cache.scratch(backend, "act", small_bytes), small);
  EXPECT_EQ(backend.live_alloc_count(), 1u);
  // The ledger names the caller of scratch().
  EXPECT_THAT(backend.alloc_report(), HasSubstr(fmt::format("op_cache_test.cpp:{}", line)));

  const std::size_t big_bytes = small_bytes + random_size(1, 1 << 16);
  const DevicePtr bigger = cache.scratch(backend, "act", big_bytes);
  EXPECT_NE(small, bigger);  // a larger request gets a new buffer
  EXPECT_EQ(cache.scratch(backend, "act", small_bytes), bigger);  // and it never shrinks back
  EXPECT_EQ(cache.scratch_count(), 1u);

  // The smaller buffer was retired, not freed (queued work may still read it): it stays on the
  // ledger under the caller's line until release() frees it with the rest.
  EXPECT_EQ(cache.retired_scratch_count(), 1u);
  EXPECT_EQ(backend.live_alloc_count(), 2u);
  EXPECT_EQ(backend.live_bytes(), small_bytes + big_bytes);
  EXPECT_THAT(backend.alloc_report(), HasSubstr(fmt::format("op_cache_test.cpp:{}", line)));
  cache.release(backend);
  EXPECT_EQ(cache.retired_scratch_count(), 0u);
  EXPECT_EQ(backend.live_bytes(), 0u);
  EXPECT_EQ(backend.sweep_unreleased(), 0u);
  // Really freed: freeing either again is an error, not a double free.
  EXPECT_EQ(expect_error([&] { backend.free(small); }).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { backend.free(bigger); }).code(), ErrorCode::kInvalidArgument);
}

// ---- lookups ----

// A module with a shared kernel and one per thread, for the concurrency test.
HostModule threads_module(std::size_t per_thread) {
  HostModule m("mt");
  m.add_kernel("shared", noop, {});
  for (std::size_t i = 0; i < per_thread; ++i) m.add_kernel(fmt::format("k{}", i), noop, {});
  return m;
}

TEST(OpCache, ManyKernelsAllHitAfterOneLookupEach) {
  // Enough keys that the lock-free snapshot grows several times and its probes wrap around.
  constexpr std::size_t kKernels = 300;
  std::vector<HostModule> modules;
  modules.push_back(threads_module(kKernels));
  CpuBackend backend(one_thread(std::move(modules)));
  OpCache& cache = backend.op_cache();
  std::vector<std::uint64_t> first;
  for (std::size_t i = 0; i < kKernels; ++i) {
    first.push_back(cache.kernel(backend, "mt", fmt::format("k{}", i)).handle.value());
  }
  for (int round = 0; round < 3; ++round) {
    for (std::size_t i = 0; i < kKernels; ++i) {
      ASSERT_EQ(cache.kernel(backend, "mt", fmt::format("k{}", i)).handle.value(), first[i]) << i;
    }
  }
  EXPECT_EQ(std::set<std::uint64_t>(first.begin(), first.end()).size(), kKernels);
  EXPECT_EQ(cache.kernel_count(), kKernels);
  EXPECT_EQ(backend.lookup_audit().size(), kKernels);  // hits never reach the backend
  // Names that share a hash-relevant prefix or differ only in where the split falls.
  EXPECT_THROW(cache.kernel(backend, "m", "tk1"), Error);
  EXPECT_THROW(cache.kernel(backend, "mt", "k1 "), Error);
}

TEST(OpCache, ConcurrentLookupsGetOneHandlePerKey) {
  constexpr std::size_t kThreads = 8;
  constexpr int kRounds = 200;
  std::vector<HostModule> modules;
  modules.push_back(threads_module(kThreads));
  CpuBackend backend(one_thread(std::move(modules)));
  OpCache& cache = backend.op_cache();

  // Each thread looks up the shared kernel, its own, and its neighbour's, many times over.
  std::vector<std::map<std::string, std::set<std::uint64_t>>> seen(kThreads);
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const std::vector<std::string> names{"shared", fmt::format("k{}", t),
                                           fmt::format("k{}", (t + 1) % kThreads)};
      start.arrive_and_wait();
      for (int r = 0; r < kRounds; ++r) {
        for (const std::string& name : names) {
          seen[t][name].insert(cache.kernel(backend, "mt", name).handle.value());
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();

  EXPECT_EQ(cache.kernel_count(), kThreads + 1);
  // One resolution per key reached the backend.
  const std::vector<KernelLookup> audit = backend.lookup_audit();
  std::map<std::string, int> lookups;
  for (const KernelLookup& l : audit) {
    EXPECT_TRUE(l.resolved) << l.function << ": " << l.error;
    EXPECT_EQ(l.module, "mt");
    ++lookups[l.function];
  }
  EXPECT_EQ(audit.size(), kThreads + 1);
  for (const auto& [name, count] : lookups) EXPECT_EQ(count, 1) << name;

  // Every thread saw one handle per key, the same one as every other thread; keys differ.
  std::map<std::string, std::uint64_t> handle;
  for (std::size_t t = 0; t < kThreads; ++t) {
    for (const auto& [name, values] : seen[t]) {
      ASSERT_EQ(values.size(), 1u) << "thread " << t << " key " << name;
      const auto it = handle.emplace(name, *values.begin()).first;
      EXPECT_EQ(it->second, *values.begin()) << "thread " << t << " key " << name;
    }
  }
  EXPECT_EQ(handle.size(), kThreads + 1);
  std::set<std::uint64_t> distinct;
  for (const auto& [name, h] : handle) {
    distinct.insert(h);
    EXPECT_EQ(backend.kernel_name(KernelHandle{h}), "mt::" + name);
  }
  EXPECT_EQ(distinct.size(), handle.size());
}

TEST(OpCache, AFailingLookupIsNotMemoizedAndLeavesTheCacheUsable) {
  CpuBackend backend(one_thread());
  OpCache cache;
  CpuFaults faults;
  faults.deny_lookups = {"core::fill_u32"};
  backend.set_faults(faults);

  const auto [e, line] =
      std::pair(expect_error([&] { cache.kernel(backend, "core", "fill_u32"); }), __LINE__);
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_THAT(e.what(), HasSubstr("[kernel]"));
  EXPECT_THAT(e.what(), HasSubstr("core::fill_u32"));
  EXPECT_THAT(e.what(), HasSubstr("denied by fault injection"));
  EXPECT_EQ(cache.kernel_count(), 0u);

  // Other keys still resolve, and scratch still works.
  const ResolvedKernel axpy = cache.kernel(backend, "core", "axpy_f32");
  EXPECT_TRUE(axpy);
  EXPECT_TRUE(cache.scratch(backend, "tmp", 64));
  EXPECT_EQ(cache.kernel_count(), 1u);

  // Asked again it fails again (nothing remembered), then succeeds once the fault is gone.
  EXPECT_EQ(expect_error([&] { cache.kernel(backend, "core", "fill_u32"); }).code(),
            ErrorCode::kNotFound);
  backend.set_faults(CpuFaults{});
  const ResolvedKernel fill = cache.kernel(backend, "core", "fill_u32");
  EXPECT_TRUE(fill);
  EXPECT_NE(fill, axpy);
  EXPECT_EQ(cache.kernel(backend, "core", "fill_u32"), fill);
  EXPECT_EQ(cache.kernel_count(), 2u);

  const std::vector<KernelLookup> audit = backend.lookup_audit();
  ASSERT_EQ(audit.size(), 4u);
  EXPECT_FALSE(audit[0].resolved);
  EXPECT_THAT(audit[0].error, HasSubstr("denied by fault injection"));
  EXPECT_EQ(audit[0].site.file_name(), "op_cache_test.cpp");  // the caller, not the cache
  EXPECT_EQ(audit[0].site.line, static_cast<std::uint32_t>(line));
  EXPECT_TRUE(audit[1].resolved);
  EXPECT_EQ(audit[1].function, "axpy_f32");
  EXPECT_FALSE(audit[2].resolved);
  EXPECT_TRUE(audit[3].resolved);
  EXPECT_TRUE(audit[3].error.empty());
  cache.release(backend);
}

TEST(OpCache, UnknownModulesAndKernelsAreNotFound) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const Error m = expect_error([&] { cache.kernel(backend, "w8a8", "bf16_to_fp8"); });
  EXPECT_EQ(m.code(), ErrorCode::kNotFound);
  EXPECT_THAT(m.what(), HasSubstr("module 'w8a8' is not loaded"));
  const Error k = expect_error([&] { cache.kernel(backend, "core", "nope"); });
  EXPECT_EQ(k.code(), ErrorCode::kNotFound);
  EXPECT_THAT(k.what(), HasSubstr("has no kernel 'nope'"));
  EXPECT_EQ(cache.kernel_count(), 0u);
}

// ---- release ----

TEST(OpCache, ReleaseAfterAFailingFreeFreesTheRestAndRethrowsTheFirstError) {
  CpuBackend backend(one_thread());
  OpCache cache;
  std::vector<DevicePtr> ptrs;
  const std::size_t tags = random_size(4, 8);
  for (std::size_t i = 0; i < tags; ++i) {
    ptrs.push_back(cache.scratch(backend, fmt::format("tag{}", i), random_size(1, 4096)));
  }
  // Free two behind the cache's back, so release's own frees of them throw.
  const std::size_t bad1 = random_size(0, tags - 1);
  const std::size_t bad2 = (bad1 + random_size(1, tags - 1)) % tags;
  backend.free(ptrs[bad1]);
  backend.free(ptrs[bad2]);

  testing::LogCapture logs;
  const Error e = expect_error([&] { cache.release(backend); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[free]"));
  // Every pointer was tried: the others are freed and the cache is empty.
  EXPECT_EQ(backend.live_bytes(), 0u);
  EXPECT_EQ(backend.live_alloc_count(), 0u);
  EXPECT_EQ(cache.scratch_count(), 0u);
  // Both failures were logged in the order release met them; the error is the first one.
  const auto lines = logs.lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0].text, HasSubstr("op scratch: freeing 'tag"));
  EXPECT_THAT(lines[0].text, HasSubstr(e.what()));
  EXPECT_THAT(lines[1].text, Not(HasSubstr(e.what())));
  const std::string a = fmt::format("0x{:x}", ptrs[bad1].address());
  const std::string b = fmt::format("0x{:x}", ptrs[bad2].address());
  const std::string what = e.what();
  EXPECT_TRUE((what.find(a) != std::string::npos) != (what.find(b) != std::string::npos)) << what;

  // A second release is a no-op: nothing thrown, nothing logged, nothing freed.
  const AllocStats before = backend.alloc_stats();
  cache.release(backend);
  EXPECT_EQ(logs.lines().size(), 2u);
  EXPECT_EQ(backend.alloc_stats().free_count, before.free_count);

  // The cache is closed afterwards: it never hands back a freed pointer, nor allocates anew.
  const Error late = expect_error([&] { cache.scratch(backend, "tag0", 16); });
  EXPECT_EQ(late.code(), ErrorCode::kState);
  EXPECT_EQ(backend.live_alloc_count(), 0u);
  EXPECT_EQ(cache.scratch_count(), 0u);
}

TEST(OpCache, AfterReleaseKernelAndScratchAreStateErrorsAndReachNothing) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const ResolvedKernel fill = cache.kernel(backend, "core", "fill_u32");
  ASSERT_TRUE(fill);
  const std::size_t bytes = random_size(1, 4096);
  cache.scratch(backend, "act", bytes);
  EXPECT_FALSE(cache.released());
  cache.release(backend);
  EXPECT_TRUE(cache.released());
  const AllocStats before = backend.alloc_stats();

  // A memoized key (the lock-free hit path) and a new one (the miss path) both refuse.
  for (const char* fn : {"fill_u32", "axpy_f32"}) {
    const Error e = expect_error([&] { cache.kernel(backend, "core", fn); });
    EXPECT_EQ(e.code(), ErrorCode::kState) << fn;
    EXPECT_THAT(e.what(),
                HasSubstr(fmt::format("[kernel] core::{}: the op cache was released", fn)));
  }
  EXPECT_EQ(backend.lookup_audit().size(), 1u);  // the backend was not asked again
  // A request the freed buffer would have fitted, and one that would have grown it.
  for (const std::size_t want : {std::size_t{1}, bytes + 1}) {
    const Error e = expect_error([&] { cache.scratch(backend, "act", want); });
    EXPECT_EQ(e.code(), ErrorCode::kState) << want;
    EXPECT_THAT(e.what(), HasSubstr("[scratch] tag 'act': the op cache was released"));
  }
  EXPECT_EQ(backend.alloc_stats().allocation_count, before.allocation_count);
  EXPECT_EQ(backend.live_alloc_count(), 0u);
  cache.release(backend);  // still a no-op
  EXPECT_EQ(backend.alloc_stats().free_count, before.free_count);
}

TEST(OpCache, ReleaseWithOneFailureRethrowsItsError) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const DevicePtr bad = cache.scratch(backend, "bad", random_size(1, 4096));
  cache.scratch(backend, "good", random_size(1, 4096));
  backend.free(bad);
  const Error e = expect_error([&] { cache.release(backend); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[free]"));
  EXPECT_THAT(e.what(), HasSubstr(fmt::format("0x{:x}", bad.address())));
  EXPECT_EQ(backend.live_bytes(), 0u);
  EXPECT_EQ(cache.label(), "op scratch");
}

TEST(OpCache, ReleaseOfAnEmptyCacheDoesNothing) {
  CpuBackend backend(one_thread());
  OpCache cache;
  cache.release(backend);
  cache.release(backend);
  EXPECT_EQ(backend.alloc_stats().free_count, 0u);
}

// ---- scratch ----

TEST(OpCache, ScratchOfZeroBytesThrows) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const Error e = expect_error([&] { cache.scratch(backend, "act", 0); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[scratch]"));
  EXPECT_THAT(e.what(), HasSubstr("'act'"));
  EXPECT_EQ(cache.scratch_count(), 0u);
  EXPECT_EQ(backend.alloc_stats().allocation_count, 0u);
}

TEST(OpCache, ScratchTagsAreIndependent) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const std::size_t n = random_size(1, 4096);
  const DevicePtr act = cache.scratch(backend, "act", n);
  const DevicePtr w = cache.scratch(backend, "w", n);
  EXPECT_NE(act, w);
  EXPECT_EQ(cache.scratch(backend, "act", n), act);
  EXPECT_EQ(cache.scratch(backend, "w", n), w);
  EXPECT_EQ(cache.scratch_count(), 2u);
  EXPECT_EQ(backend.live_bytes(), 2 * n);
  cache.release(backend);
}

TEST(OpCache, AFailedScratchAllocationLeavesTheOldBuffer) {
  CpuBackend backend(one_thread());
  OpCache cache;
  const DevicePtr old = cache.scratch(backend, "act", 64);
  CpuFaults faults;
  faults.max_device_alloc = 1024;
  backend.set_faults(faults);
  EXPECT_EQ(expect_error([&] { cache.scratch(backend, "act", 4096); }).code(),
            ErrorCode::kOutOfMemory);
  EXPECT_EQ(cache.scratch(backend, "act", 64), old);
  EXPECT_EQ(cache.scratch_count(), 1u);
  cache.release(backend);
  EXPECT_EQ(backend.live_bytes(), 0u);
}

TEST(OpCache, ConcurrentScratchRequestsShareOneBuffer) {
  constexpr std::size_t kThreads = 8;
  CpuBackend backend(one_thread());
  OpCache cache;
  const std::size_t n = random_size(1, 4096);
  std::vector<DevicePtr> got(kThreads);
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      got[t] = cache.scratch(backend, "act", n);
    });
  }
  for (std::thread& th : threads) th.join();
  for (const DevicePtr p : got) EXPECT_EQ(p, got[0]);
  // Losers of a race freed their own allocation: only the winner is live.
  EXPECT_EQ(backend.live_alloc_count(), 1u);
  EXPECT_EQ(backend.live_bytes(), n);
  cache.release(backend);
  EXPECT_EQ(backend.live_bytes(), 0u);
}

// ---- gates ----

TEST(OpCache, FirstNCountsPerKey) {
  OpCache cache;
  const auto n = static_cast<std::uint32_t>(random_size(1, 20));
  for (std::uint32_t i = 0; i < n; ++i) EXPECT_TRUE(cache.first_n("route", n)) << "call " << i;
  EXPECT_FALSE(cache.first_n("route", n));
  EXPECT_FALSE(cache.first_n("route", n));
  // Another key has its own count.
  EXPECT_TRUE(cache.first_n("shape", 2));
  EXPECT_TRUE(cache.first_n("shape", 2));
  EXPECT_FALSE(cache.first_n("shape", 2));
  EXPECT_FALSE(cache.first_n("route", n));
  // n == 0 is never true.
  EXPECT_FALSE(cache.first_n("never", 0));
  // Counts are per cache.
  OpCache other;
  EXPECT_TRUE(other.first_n("route", 1));
  EXPECT_FALSE(other.first_n("route", 1));
}

TEST(OpCache, OnceAndFirstShapeShareState) {
  OpCache cache;
  EXPECT_TRUE(cache.once("fp8 path"));
  EXPECT_FALSE(cache.once("fp8 path"));
  EXPECT_FALSE(cache.first_shape("fp8 path", 0, 0, 0));  // once's key, seen
  EXPECT_TRUE(cache.first_shape("route", 0, 0, 0));
  EXPECT_FALSE(cache.once("route"));  // first_shape's key, seen
  // Separate from first_n.
  EXPECT_TRUE(cache.first_n("fresh", 1));
  EXPECT_TRUE(cache.once("fresh"));
  // Per cache.
  OpCache other;
  EXPECT_TRUE(other.once("fp8 path"));
}

TEST(OpCache, FirstShapeDistinguishesMNK) {
  OpCache cache;
  std::uniform_int_distribution<std::uint32_t> dim(1, 1 << 20);
  const std::uint32_t m = dim(rng()), n = dim(rng()), k = dim(rng());
  EXPECT_TRUE(cache.first_shape("w4a16", m, n, k));
  EXPECT_FALSE(cache.first_shape("w4a16", m, n, k));
  EXPECT_TRUE(cache.first_shape("w4a16", m + 1, n, k));
  EXPECT_TRUE(cache.first_shape("w4a16", m, n + 1, k));
  EXPECT_TRUE(cache.first_shape("w4a16", m, n, k + 1));
  EXPECT_TRUE(cache.first_shape("w8a8", m, n, k));
  EXPECT_FALSE(cache.first_shape("w4a16", m + 1, n, k));
  // Dimensions are positional, not a set.
  EXPECT_TRUE(cache.first_shape("perm", 1, 2, 3));
  EXPECT_TRUE(cache.first_shape("perm", 3, 2, 1));
  EXPECT_TRUE(cache.first_shape("perm", 2, 1, 3));
  EXPECT_FALSE(cache.first_shape("perm", 1, 2, 3));
}

TEST(OpCache, AllocFallbackLatchIsPerCache) {
  OpCache cache;
  OpCache other;
  EXPECT_FALSE(cache.alloc_fell_back());
  cache.note_alloc_fallback();
  EXPECT_TRUE(cache.alloc_fell_back());
  cache.note_alloc_fallback();
  EXPECT_TRUE(cache.alloc_fell_back());
  EXPECT_FALSE(other.alloc_fell_back());
}

// ---- published metadata ----

// A module whose kernels publish every kind of metadata the backend reads.
HostModule meta_module(std::uint32_t tile) {
  HostModule m("meta");
  m.add_kernel("untiled", noop, {});
  m.add_kernel("zero_tile", noop, {}).publish_u32("zero_tile_n_tile", 0);
  m.add_kernel("tiled", noop, {}).publish_u32("tiled_n_tile", tile);
  m.add_kernel("bad_tile", noop, {}).publish("bad_tile_n_tile", {std::byte{1}, std::byte{2}});
  m.add_kernel("casts", noop, {}).publish_u32("casts_a_e4m3", 1);
  m.add_kernel("casts_byte", noop, {})
      .publish("casts_byte_a_e4m3", {std::byte{0}, std::byte{0}, std::byte{0x80}});
  m.add_kernel("no_cast", noop, {}).publish_u32("no_cast_a_e4m3", 0);
  return m;
}

class OpCacheMetadata : public ::testing::Test {
 protected:
  OpCacheMetadata()
      : tile(static_cast<std::uint32_t>(random_size(1, 4096))), backend(make_options(tile)) {}
  static CpuBackendOptions make_options(std::uint32_t t) {
    std::vector<HostModule> modules = builtin_host_modules();
    modules.push_back(meta_module(t));
    return one_thread(std::move(modules));
  }
  const ResolvedKernel& get(std::string_view function) {
    return backend.op_cache().kernel(backend, "meta", function);
  }
  std::uint32_t tile;
  CpuBackend backend;
};

TEST_F(OpCacheMetadata, KernelNTileReturnsThePublishedTile) {
  const ResolvedKernel& h = get("tiled");
  EXPECT_EQ(backend.kernel_n_tile(h), tile);
  EXPECT_EQ(h.meta.n_tile, tile);
  EXPECT_EQ(backend.kernel_n_tile(backend.op_cache().kernel(backend, "core", "fill_u32")), 256u);
}

TEST_F(OpCacheMetadata, KernelNTileWithoutATileIsAClearError) {
  for (const char* name : {"untiled", "zero_tile"}) {
    SCOPED_TRACE(name);
    const ResolvedKernel& h = get(name);
    EXPECT_EQ(h.meta.n_tile, 0u);
    const Error e = expect_error([&] { backend.kernel_n_tile(h); });
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_THAT(e.what(), HasSubstr("[kernel_n_tile]"));
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("meta::{} publishes no N tile", name)));
    EXPECT_THAT(e.what(), HasSubstr("_n_tile symbol is missing or 0"));
  }
}

TEST_F(OpCacheMetadata, AnUnreadableTileFailsTheLookup) {
  const Error e = expect_error([&] { get("bad_tile"); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_THAT(e.what(), HasSubstr("[kernel]"));
  EXPECT_THAT(e.what(), HasSubstr("bad_tile_n_tile as 2 byte(s)"));
  EXPECT_EQ(backend.op_cache().kernel_count(), 0u);
}

TEST_F(OpCacheMetadata, AE4m3IsRecordedOnlyWhenNonZero) {
  EXPECT_TRUE(backend.kernel_casts_a_to_e4m3(get("casts")));
  EXPECT_TRUE(backend.kernel_casts_a_to_e4m3(get("casts_byte")));
  EXPECT_FALSE(backend.kernel_casts_a_to_e4m3(get("no_cast")));
  EXPECT_FALSE(backend.kernel_casts_a_to_e4m3(get("untiled")));
  EXPECT_TRUE(get("casts").meta.a_e4m3);
  EXPECT_FALSE(get("no_cast").meta.a_e4m3);
}

TEST_F(OpCacheMetadata, EveryHitReturnsTheMetadataTheLookupRead) {
  // The miss stores the handle and its metadata together; hits return that same entry (one
  // probe, no second map), and another backend's cache has entries of its own.
  const ResolvedKernel& first = get("tiled");
  const ResolvedKernel& again = get("tiled");
  EXPECT_EQ(&first, &again);
  EXPECT_EQ(again.meta.n_tile, tile);
  EXPECT_EQ(backend.op_cache().kernel_count(), 1u);
  CpuBackend other;
  const ResolvedKernel& theirs = other.op_cache().kernel(other, "core", "fill_u32");
  EXPECT_NE(&theirs, &first);
  EXPECT_EQ(theirs.meta.n_tile, 256u);
}

// ---- summary and hashing ----

TEST(OpCache, Summary) {
  CpuBackend backend(one_thread());
  OpCache cache;
  EXPECT_EQ(cache.summary(), "OpCache{kernels: 0, scratch: 0}");
  cache.kernel(backend, "core", "fill_u32");
  cache.kernel(backend, "core", "axpy_f32");
  cache.kernel(backend, "core", "fill_u32");
  cache.scratch(backend, "a", 16);
  cache.scratch(backend, "b", 16);
  cache.scratch(backend, "c", 16);
  EXPECT_EQ(cache.summary(), "OpCache{kernels: 2, scratch: 3}");
  cache.release(backend);
  EXPECT_EQ(cache.summary(), "OpCache{kernels: 2, scratch: 0}");  // handles live on
}

TEST(Fnv1a64, KnownVectors) {
  static_assert(fnv1a64("") == 0xcbf29ce484222325ull);
  static_assert(fnv1a64("a") == 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ull);
  // Bytes above 0x7f hash as unsigned.
  EXPECT_EQ(fnv1a64("\xff"), (0xcbf29ce484222325ull ^ 0xffull) * 1099511628211ull);
  EXPECT_NE(fnv1a64("ab"), fnv1a64("ba"));
}

}  // namespace
}  // namespace metrale
