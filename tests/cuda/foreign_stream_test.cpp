// Work on a stream another library owns (Backend::adopt_stream), as metrale.torch queues its
// GEMMs on torch's current stream, on the fake driver: the stream is adopted, used and left to
// its owner; a GEMM queued on it with the caller's buffers borrowed and given back in stream
// order waits for nothing; and the same GEMM is captured on it in the driver's strictest capture
// mode (CU_STREAM_CAPTURE_MODE_GLOBAL, torch.cuda.graph's default), its scratch allocated inside
// the capture, and replayed. The fake refuses what the CUDA documentation says a capture refuses
// (fake_streams.cpp), so a synchronize, a waiting unborrow or an unrelaxed allocation inside the
// capture fails these tests. Note [foreign streams] in docs/NOTES.md.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "cuda/packed_module.h"
#include "cuda/rig.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/foreign_stream.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "ops/gemm_reference.h"
#include "support/scoped_env.h"

namespace metrale::cuda::testing {
namespace {

namespace ref = metrale::testing::gemm;
using metrale::testing::expect_error;
using ::testing::HasSubstr;

// Synchronizing calls so far: none may happen while a GEMM is queued on a foreign stream.
std::uint64_t waits(const Rig& rig) {
  return rig.fd.calls("cuStreamSynchronize") + rig.fd.calls("cuCtxSynchronize") +
         rig.fd.calls("cuEventSynchronize");
}

// A stream made the way another library makes one: straight from the driver, not the backend.
CUstream owners_stream(Rig& rig) {
  rig.b().bind_to_thread();
  CUstream s = nullptr;
  EXPECT_EQ(rig.fd.api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  return s;
}

std::uint64_t raw(CUstream s) {
  return reinterpret_cast<std::uintptr_t>(s);
}

// Device memory the owner allocated (as torch's allocator does), lent to the backend.
struct OwnersBuffer {
  OwnersBuffer(Rig& rig, std::size_t bytes) : rig_(rig), bytes_(bytes) {
    EXPECT_EQ(rig.fd.api().cuMemAlloc(&ptr_, bytes), CUDA_SUCCESS);
  }
  OwnersBuffer(const OwnersBuffer&) = delete;
  OwnersBuffer& operator=(const OwnersBuffer&) = delete;
  ~OwnersBuffer() { EXPECT_EQ(rig_.fd.api().cuMemFree(ptr_), CUDA_SUCCESS); }
  DevicePtr ptr() const { return DevicePtr{ptr_}; }
  std::uint16_t* host() const { return host_view<std::uint16_t>(ptr()); }
  std::size_t bytes() const { return bytes_; }

 private:
  Rig& rig_;
  std::size_t bytes_;
  CUdeviceptr ptr_ = 0;
};

// One packed decode GEMM's operands: NVFP4 weights on the backend, A and C (poisoned, with a
// poisoned tail) in the owner's memory. M = 1, N = 45, K = 1024 splits K 11 ways on the fake's
// published tile, so the GEMM needs split-K scratch.
struct Problem {
  static constexpr std::int64_t m = 1, n = 45, k = 1024;
  Problem(Rig& rig, std::mt19937_64& gen)
      : row(ref::quantize(WeightFormat::kNvfp4, ref::random_weight_values(gen, n, k), n, k)),
        w(ops::upload_weights(rig.b(), row, ops::UploadLayout::kBackendPreferred)),
        a(rig, m * k * 2),
        c(rig, (m * n + ref::kTailElems) * 2),
        rig_(rig) {}
  ~Problem() { ops::free_weights(rig_.b(), w); }

  // Fresh activations into A (host writes: the fake's device memory is host memory), C poisoned.
  void refill(std::mt19937_64& gen) {
    acts = ref::random_activations(gen, static_cast<std::size_t>(m * k));
    std::memcpy(a.host(), acts.data(), a.bytes());
    std::memset(c.host(), ref::kPoisonByte, c.bytes());
  }
  // C against the float64 reference of the current A; the tail stays poisoned.
  void expect_result(const std::string& what) const {
    const auto* out = c.host();
    for (std::size_t i = m * n; i < m * n + ref::kTailElems; ++i) {
      EXPECT_EQ(out[i], ref::kPoisonBf16) << what << ": tail element " << i;
    }
    const std::vector<std::uint16_t> got(out, out + m * n);
    const ref::Reference r = ref::reference(acts, m, row, {}, ref::AMode::kBf16);
    ref::expect_close(ref::compare(got, r), ref::kNormTol, what);
  }
  bool untouched() const {
    const auto* out = c.host();
    for (std::size_t i = 0; i < m * n; ++i) {
      if (out[i] != ref::kPoisonBf16) return false;
    }
    return true;
  }
  // Borrows A and C, queues the GEMM on stream, gives them back in stream order: what
  // metrale.torch does per call.
  void queue(Backend& b, StreamHandle stream) const {
    b.borrow(a.ptr(), a.bytes());
    b.borrow(c.ptr(), c.bytes());
    ops::w4a16_gemm(b, stream, a.ptr(), m, w, c.ptr(), ops::GemmOptions{});
    b.unborrow_ordered(c.ptr());
    b.unborrow_ordered(a.ptr());
  }

  HostQuantWeights row;
  ops::QuantWeights w;
  OwnersBuffer a, c;
  std::vector<std::uint16_t> acts;

 private:
  Rig& rig_;
};

// Runs work while s captures in CU_STREAM_CAPTURE_MODE_GLOBAL; the capture must survive, and
// its graph is dropped.
template <class F>
void capture_global(Rig& rig, CUstream s, F&& work) {
  const DriverApi& api = rig.fd.api();
  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  work();
  CUgraph graph = nullptr;
  ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS) << "the capture was invalidated";
  EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);
}

RigOptions packed_rig() {
  return RigOptions{.modules = {core_module(), packed_module()}};
}

TEST(ForeignStream, AStreamOfTheContextIsAdoptedUsedAndLeftToItsOwner) {
  Rig rig(packed_rig());
  CudaBackend& b = rig.b();
  const CUstream s = owners_stream(rig);
  const DevicePtr d = b.alloc(256);
  {
    const ForeignStream outer(b, raw(s));
    EXPECT_EQ(outer.handle().value(), raw(s));
    {
      const ForeignStream inner(b, raw(s));  // adoptions nest
      b.memset_async(d, 7, 256, inner.handle());
    }
    b.memset_async(d, 9, 256, outer.handle());  // still adopted by outer
    EXPECT_EQ(host_view<std::uint8_t>(d)[255], 9);
    const Error e = expect_error([&] { b.destroy_stream(outer.handle()); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("adopted"));
  }
  const Error gone = expect_error([&] { b.memset_async(d, 1, 256, StreamHandle{raw(s)}); });
  EXPECT_THAT(gone.what(), HasSubstr("is not a live stream of this cuda backend"));
  EXPECT_EQ(rig.fd.api().cuStreamDestroy(s), CUDA_SUCCESS);  // the owner's, still alive

  // 0, torch's default stream, is the legacy stream: CU_STREAM_LEGACY, not the backend's own.
  const ForeignStream legacy(b, 0);
  EXPECT_EQ(legacy.handle().value(), 0x1u);
  b.memset_async(d, 3, 256, legacy.handle());
  EXPECT_EQ(host_view<std::uint8_t>(d)[0], 3);
  b.free(d);
}

// (A handle that is no live stream is undefined behaviour in cuStreamGetCtx, so nothing is
// promised for one; the fake answers CUDA_ERROR_INVALID_HANDLE, which adopt_stream names.)
TEST(ForeignStream, AStreamOfAnotherContextOrABackendWithoutStreamsIsRefusedByName) {
  Rig rig(RigOptions{.devices = {FakeDevice{}, FakeDevice{}}});
  CudaBackend& b = rig.b();
  // A stream made in device 1's primary context.
  const DriverApi& api = rig.fd.api();
  CUdevice dev1 = 0;
  CUcontext ctx1 = nullptr;
  ASSERT_EQ(api.cuDeviceGet(&dev1, 1), CUDA_SUCCESS);
  ASSERT_EQ(api.cuDevicePrimaryCtxRetain(&ctx1, dev1), CUDA_SUCCESS);
  ASSERT_EQ(api.cuCtxSetCurrent(ctx1), CUDA_SUCCESS);
  CUstream other = nullptr;
  ASSERT_EQ(api.cuStreamCreate(&other, CU_STREAM_NON_BLOCKING), CUDA_SUCCESS);
  const Error foreign = expect_error([&] { ForeignStream(b, raw(other)); });
  EXPECT_EQ(foreign.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(foreign.what(), HasSubstr("belongs to another context than device 0"));
  ASSERT_EQ(api.cuCtxSetCurrent(ctx1), CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamDestroy(other), CUDA_SUCCESS);
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease(dev1), CUDA_SUCCESS);

  CpuBackend cpu;
  const Error none = expect_error([&] { ForeignStream(cpu, 0x10); });
  EXPECT_EQ(none.code(), ErrorCode::kUnavailable);
  EXPECT_THAT(none.what(), HasSubstr("[adopt_stream] the cpu backend runs no work"));
}

TEST(ForeignStream, AGemmQueuedOnAnAdoptedStreamWaitsForNothing) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(packed_rig());
  CudaBackend& b = rig.b();
  const CUstream s = owners_stream(rig);
  {
    Problem p(rig, gen);
    // The first call resolves the kernels, reading their published values on the backend's own
    // stream (a wait, once per backend); the calls after it wait for nothing.
    p.refill(gen);
    p.queue(b, b.default_stream());
    b.synchronize(b.default_stream());
    p.refill(gen);
    const ForeignStream fs(b, raw(s));
    const std::uint64_t before = waits(rig);
    p.queue(b, fs.handle());
    EXPECT_EQ(waits(rig), before) << "a GEMM on a foreign stream synchronized";
    EXPECT_EQ(b.alloc_stats().borrowed_bytes, 0u);
    ASSERT_EQ(rig.fd.api().cuStreamSynchronize(s), CUDA_SUCCESS);  // the owner waits
    p.expect_result("on the adopted stream");
  }
  b.op_cache().release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(rig.fd.api().cuStreamDestroy(s), CUDA_SUCCESS);
}

// Scratch from the OpCache's pool (carved from what the warm-up mapped) or, with the pool off,
// from a plain allocation made inside the capture: Note [allocations during capture].
class ForeignStreamCapture : public ::testing::TestWithParam<bool> {};

INSTANTIATE_TEST_SUITE_P(Scratch, ForeignStreamCapture, ::testing::Values(true, false),
                         [](const auto& p) { return p.param ? "Pooled" : "Allocated"; });

TEST_P(ForeignStreamCapture, AGemmIsCapturedOnAnAdoptedStreamInGlobalModeAndReplays) {
  const bool pooled = GetParam();
  const metrale::testing::ScopedEnv pool("METRALE_SCRATCH_POOL_MB", pooled ? "64" : "0");
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(packed_rig());
  CudaBackend& b = rig.b();
  const DriverApi& api = rig.fd.api();
  const CUstream s = owners_stream(rig);
  {
    Problem p(rig, gen);
    // The warm-up torch.cuda.graph asks for, on another stream: kernels are resolved (which a
    // capture refuses); the capture stream's split-K scratch does not exist yet.
    p.refill(gen);
    p.queue(b, b.default_stream());
    b.synchronize(b.default_stream());
    p.expect_result("warm-up");

    p.refill(gen);
    const ForeignStream fs(b, raw(s));
    ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
    const std::uint64_t allocs = rig.fd.calls("cuMemAlloc");
    p.queue(b, fs.handle());
    if (pooled) {
      EXPECT_EQ(rig.fd.calls("cuMemAlloc"), allocs) << "the pool's scratch was allocated anew";
    } else {
      EXPECT_EQ(rig.fd.calls("cuMemAlloc"), allocs + 1) << "the scratch was not allocated";
    }
    CUgraph graph = nullptr;
    ASSERT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS) << "the capture was invalidated";
    EXPECT_TRUE(p.untouched()) << "captured work ran at capture";
    CUgraphExec exec = nullptr;
    ASSERT_EQ(api.cuGraphInstantiateWithFlags(&exec, graph, 0), CUDA_SUCCESS);
    for (int replay = 0; replay < 2; ++replay) {
      if (replay > 0) p.refill(gen);  // new activations in the same buffer
      ASSERT_EQ(api.cuGraphLaunch(exec, s), CUDA_SUCCESS);
      ASSERT_EQ(api.cuStreamSynchronize(s), CUDA_SUCCESS);
      p.expect_result(fmt::format("replay {}", replay));
    }
    EXPECT_EQ(api.cuGraphExecDestroy(exec), CUDA_SUCCESS);
    EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);
  }
  b.op_cache().release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
}

// Scratch a capture was handed may be used by every replay of its graph: when the tag grows
// afterwards the old block is retired, never handed back to the pool, where the next request of
// the same stream would take it at once (as it does when no capture held it).
TEST(ForeignStream, ScratchACaptureHeldIsNeverHandedOutAgain) {
  Rig rig(packed_rig());
  CudaBackend& b = rig.b();
  const DriverApi& api = rig.fd.api();
  const CUstream s = owners_stream(rig);
  OpCache& cache = b.op_cache();
  {
    const ForeignStream fs(b, raw(s));
    const DevicePtr plain = cache.scratch(b, "plain", 4096, fs.handle());
    cache.scratch(b, "plain", std::size_t{1} << 20, fs.handle());  // grows: plain goes back
    EXPECT_EQ(cache.scratch(b, "next", 4096, fs.handle()), plain) << "the pool did not reuse";

    DevicePtr held;
    capture_global(rig, s, [&] { held = cache.scratch(b, "held", 4096, fs.handle()); });
    cache.scratch(b, "held", std::size_t{1} << 20, fs.handle());  // grows after the capture
    EXPECT_NE(cache.scratch(b, "after", 4096, fs.handle()), held)
        << "a block a graph holds was handed out again";
  }
  cache.release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
}

// Taking scratch from the pool inside a capture queries no event: reaping the pool's pending
// frees would, and the driver's default capture mode refuses event queries (PyTorch's caching
// allocator skips its event processing during capture for that reason).
TEST(ForeignStream, PoolScratchInsideACaptureQueriesNoEvent) {
  Rig rig(packed_rig());
  CudaBackend& b = rig.b();
  const DriverApi& api = rig.fd.api();
  const CUstream s = owners_stream(rig);
  OpCache& cache = b.op_cache();
  {
    cache.scratch(b, "warm", 4096, b.default_stream());
    cache.scratch(b, "warm", std::size_t{1} << 20, b.default_stream());  // a free now pending
    const ForeignStream fs(b, raw(s));
    capture_global(rig, s, [&] {
      const std::uint64_t queries = rig.fd.calls("cuEventQuery");
      cache.scratch(b, "captured", 4096, fs.handle());
      EXPECT_EQ(rig.fd.calls("cuEventQuery"), queries) << "an event was queried in the capture";
    });
  }
  cache.release(b);
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
}

// What the capture test rests on: giving a borrow back by waiting (unborrow) synchronizes the
// device, which a capture refuses; giving it back in stream order does not touch the driver.
TEST(ForeignStream, AWaitingUnborrowBreaksACaptureAndAnOrderedOneDoesNot) {
  Rig rig(packed_rig());
  CudaBackend& b = rig.b();
  const DriverApi& api = rig.fd.api();
  const CUstream s = owners_stream(rig);
  OwnersBuffer x(rig, 512);
  CUgraph graph = nullptr;

  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  b.borrow(x.ptr(), x.bytes());
  b.unborrow_ordered(x.ptr());
  EXPECT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_SUCCESS);
  EXPECT_EQ(api.cuGraphDestroy(graph), CUDA_SUCCESS);

  ASSERT_EQ(api.cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), CUDA_SUCCESS);
  b.borrow(x.ptr(), x.bytes());
  const Error e = expect_error([&] { b.unborrow(x.ptr()); });
  EXPECT_THAT(e.what(), HasSubstr("cuCtxSynchronize"));
  EXPECT_EQ(api.cuStreamEndCapture(s, &graph), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  b.unborrow(x.ptr());  // after the capture, the wait is allowed
  EXPECT_EQ(b.live_bytes(), 0u);
  EXPECT_EQ(api.cuStreamDestroy(s), CUDA_SUCCESS);
}

}  // namespace
}  // namespace metrale::cuda::testing
