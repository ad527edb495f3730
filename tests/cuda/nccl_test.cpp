// The NCCL transport's host rules on the fake driver and a fake NCCL (tests/cuda/fake_nccl.h):
// a nonblocking communicator made and given back, each collective mapped onto its NCCL call on
// the right stream, and every way it can go wrong (init refused, init never finishing, a
// collective refused or never finishing, finalize refused) ending in a clear error, an aborted
// communicator and nothing left behind.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "cuda/fake_nccl.h"
#include "cuda/nccl_api.h"
#include "cuda/nccl_communicator.h"
#include "cuda/rig.h"
#include "metrale/communicator.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "support/random.h"

namespace metrale::cuda::testing {
namespace {

using metrale::testing::expect_error;
using std::chrono::milliseconds;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

class NcclTransport : public ::testing::Test {
 protected:
  std::unique_ptr<Communicator> make(milliseconds timeout = milliseconds(2000)) {
    CommunicatorOptions o;
    o.timeout = timeout;
    NcclJoin join{0, 1, [this](std::span<std::byte> id) { id_.assign(id.begin(), id.end()); }};
    return make_nccl_communicator(rig_.b(), nccl_.api(), join, o);
  }
  DevicePtr upload(const std::vector<float>& v) {
    const DevicePtr p = rig_.b().alloc(v.size() * 4);
    rig_.b().copy_h2d(p, v.data(), v.size() * 4);
    return p;
  }

  Rig rig_;
  FakeNccl nccl_;
  std::vector<std::byte> id_;
};

TEST_F(NcclTransport, ACollectiveRunsOnItsNcclCallAndStream) {
  auto comm = make();
  EXPECT_EQ(comm->transport(), "nccl");
  EXPECT_EQ(nccl_.last_blocking(), 0) << "metrale's communicators are nonblocking";
  EXPECT_EQ(nccl_.last_rank(), 0);
  EXPECT_EQ(nccl_.last_size(), 1);
  ASSERT_EQ(id_.size(), std::size_t{NCCL_UNIQUE_ID_BYTES});
  EXPECT_EQ(id_[1], std::byte{8}) << "the exchange is handed rank 0's id";

  const std::size_t n = metrale::testing::random_size(1, 4096);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(metrale::testing::random_size(0, 1000)) - 500.0f;
  const DevicePtr in = upload(x);
  const DevicePtr out = upload(std::vector<float>(n, std::nanf("")));
  comm->all_reduce_sum(in, out, n, ReduceType::kF32);
  EXPECT_EQ(std::memcmp(host_view<float>(out), x.data(), n * 4), 0);
  EXPECT_EQ(nccl_.calls("ncclAllReduce"), 1u);
  EXPECT_EQ(nccl_.last_stream(), rig_.b().driver_stream("test", {}));

  const StreamHandle s = rig_.b().create_stream();
  rig_.b().memset(out, 0xFF, n * 4);
  comm->all_gather(in, out, n * 4, s);
  EXPECT_EQ(std::memcmp(host_view<float>(out), x.data(), n * 4), 0);
  EXPECT_EQ(nccl_.last_stream(), rig_.b().driver_stream("test", s));
  comm->broadcast(out, n * 4, 0, s);
  EXPECT_EQ(nccl_.calls("ncclBroadcast"), 1u);
  comm->barrier();
  EXPECT_EQ(nccl_.calls("ncclAllReduce"), 2u) << "the barrier is an all-reduce of one float";

  comm->release();
  EXPECT_EQ(nccl_.calls("ncclCommFinalize"), 1u);
  EXPECT_EQ(nccl_.calls("ncclCommDestroy"), 1u);
  EXPECT_EQ(nccl_.calls("ncclCommAbort"), 0u);
  EXPECT_EQ(nccl_.live_comms(), 0);
  rig_.b().destroy_stream(s);
  rig_.b().free(in);
  rig_.b().free(out);
  EXPECT_EQ(rig_.b().ledger_probe().live_bytes(), 0u) << "the barrier's float was given back";
}

TEST_F(NcclTransport, AModelsTeardownReleasesItsCommunicator) {
  ModelScope scope(std::move(rig_.backend));
  auto comm = make_nccl_communicator(static_cast<CudaBackend&>(scope.backend()), nccl_.api(),
                                     NcclJoin{0, 1, {}}, CommunicatorOptions{});
  Communicator& c = scope.add(std::make_unique<CommunicatorResource>(std::move(comm))).get();
  c.barrier();
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.clean()) << report.leak_summary();
  EXPECT_EQ(report.live_bytes_after, 0u);
  EXPECT_EQ(nccl_.live_comms(), 0);
  EXPECT_EQ(nccl_.calls("ncclCommDestroy"), 1u);
}

TEST_F(NcclTransport, ARefusedInitNamesTheCallAndLeavesNothing) {
  nccl_.fail_init(ncclSystemError);
  const Error e = expect_error([&] { make(); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_TRUE(contains(e.what(),
                       "[Communicator::create] ncclCommInitRankConfig: unhandled "
                       "system error"))
      << e.what();
  EXPECT_TRUE(contains(e.what(), "fake: init refused")) << e.what();
  EXPECT_EQ(nccl_.live_comms(), 0);
}

TEST_F(NcclTransport, AnInitThatNeverFinishesTimesOutAndIsAborted) {
  nccl_.hang_init(true);
  const auto start = std::chrono::steady_clock::now();
  const Error e = expect_error([&] { make(milliseconds(150)); });
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(150));
  EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  EXPECT_TRUE(contains(e.what(), "did not all join within 150 ms")) << e.what();
  EXPECT_EQ(nccl_.calls("ncclCommAbort"), 1u);
  EXPECT_EQ(nccl_.live_comms(), 0);
}

TEST_F(NcclTransport, ARefusedCollectiveFailsTheCommunicatorAndAbortsIt) {
  auto comm = make();
  const DevicePtr p = upload(std::vector<float>(64, 1.0f));
  nccl_.fail_collectives(ncclUnhandledCudaError);
  const Error e = expect_error([&] { comm->all_reduce_sum(p, p, 64, ReduceType::kBf16); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_TRUE(contains(e.what(),
                       "[Communicator::all_reduce_sum] ncclAllReduce: unhandled cuda "
                       "error"))
      << e.what();
  EXPECT_TRUE(comm->failed());
  EXPECT_EQ(nccl_.calls("ncclCommAbort"), 1u);
  EXPECT_EQ(nccl_.live_comms(), 0);
  const Error later = expect_error([&] { comm->barrier(); });
  EXPECT_EQ(later.code(), ErrorCode::kState);
  EXPECT_TRUE(contains(later.what(), "failed earlier: [Communicator::all_reduce_sum]"))
      << later.what();
  comm->release();  // nothing left to give back
  EXPECT_EQ(nccl_.calls("ncclCommFinalize"), 0u);
  rig_.b().free(p);
}

TEST_F(NcclTransport, ACollectiveThatNeverFinishesTimesOutAndIsAborted) {
  auto comm = make(milliseconds(150));
  const DevicePtr p = upload(std::vector<float>(64, 1.0f));
  const DevicePtr out = rig_.b().alloc(256);
  nccl_.hang_collectives(true);
  const auto start = std::chrono::steady_clock::now();
  const Error e = expect_error([&] { comm->all_gather(p, out, 256); });
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(150));
  EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  EXPECT_TRUE(contains(e.what(),
                       "ncclAllGather of 256 bytes per rank did not complete within "
                       "150 ms on rank 0 of 1"))
      << e.what();
  EXPECT_EQ(nccl_.calls("ncclCommAbort"), 1u);
  EXPECT_EQ(nccl_.live_comms(), 0);
  comm->release();
  rig_.b().free(p);
  rig_.b().free(out);
}

TEST_F(NcclTransport, ARefusedFinalizeIsReportedAndTheCommunicatorAborted) {
  auto comm = make();
  nccl_.fail_finalize(ncclInternalError);
  const Error e = expect_error([&] { comm->release(); });
  EXPECT_EQ(e.code(), ErrorCode::kDriver);
  EXPECT_TRUE(contains(e.what(), "ncclCommFinalize: internal error")) << e.what();
  EXPECT_EQ(nccl_.calls("ncclCommAbort"), 1u);
  EXPECT_EQ(nccl_.live_comms(), 0);
  comm->release();  // a second release does nothing
}

// abort() is noexcept and may run on any thread, so it binds the context without throwing: a
// cuCtxSetCurrent that fails there (CUDA_ERROR_CONTEXT_IS_DESTROYED after a teardown elsewhere,
// cuda.h) must not end the process. NCCL is still asked to abort, and the failure is latched.
TEST_F(NcclTransport, AnAbortWhoseContextBindFailsStillAbortsAndReturns) {
  auto comm = make();
  const std::uint64_t binds = rig_.fd.calls("cuCtxSetCurrent");
  rig_.fd.fail_from("cuCtxSetCurrent", binds + 1, CUDA_ERROR_CONTEXT_IS_DESTROYED);
  comm->abort("a peer was lost");
  rig_.fd.clear_failures();
  EXPECT_GT(rig_.fd.calls("cuCtxSetCurrent"), binds) << "abort binds the context first";
  EXPECT_EQ(nccl_.calls("ncclCommAbort"), 1u);
  EXPECT_EQ(nccl_.live_comms(), 0);
  EXPECT_TRUE(comm->failed());
  EXPECT_TRUE(contains(comm->failure(), "a peer was lost")) << comm->failure();
  comm->release();  // the aborted communicator has nothing left to give back
  EXPECT_EQ(nccl_.calls("ncclCommFinalize"), 0u);
}

TEST_F(NcclTransport, ABadPlaceIsRefusedBeforeNcclIsAsked) {
  CommunicatorOptions o;
  const Error e = expect_error([&] {
    make_nccl_communicator(rig_.b(), nccl_.api(), NcclJoin{2, 2, {}}, o);
  });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "rank 2 of 2")) << e.what();
  EXPECT_EQ(nccl_.calls("ncclCommInitRankConfig"), 0u);
}

}  // namespace
}  // namespace metrale::cuda::testing
