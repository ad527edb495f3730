// The communicator's single-process rules: options, the transports' loaders (a missing library,
// one without the entry points, the real one where present), the id file, and a one-rank MPI
// group (this program is not started by mpirun, so MPI starts as a singleton).
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "comm/id_file.h"
#include "core/expect_error.h"
#include "metrale/backend.h"
#include "metrale/communicator.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "support/random.h"
#if METRALE_HAVE_MPI
#include "comm/mpi_loader.h"
#endif
#if METRALE_HAVE_CUDA
#include "cuda/nccl_loader.h"
#endif

namespace metrale {
namespace {

using testing::expect_error;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(CommunicatorOptions, BadOptionsAreRefusedNamingTheValue) {
  CpuBackend backend;
  CommunicatorOptions o;
  o.transport = "carrier-pigeon";
  Error e = expect_error([&] { make_communicator(backend, o); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "'carrier-pigeon'")) << e.what();
  o = {};
  o.timeout = std::chrono::milliseconds(0);
  e = expect_error([&] { make_communicator(backend, o); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "timeout 0 ms")) << e.what();
}

TEST(CommunicatorOptions, NcclIsRefusedOnTheCpuBackend) {
  CpuBackend backend;
  CommunicatorOptions o;
  o.transport = "nccl";
  const Error e = expect_error([&] { make_communicator(backend, o); });
#if METRALE_HAVE_CUDA
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "this backend is cpu")) << e.what();
#else
  EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
#endif
}

TEST(CommunicatorTransports, EachIsListedWithItsLibraryOrWhyNot) {
  const std::vector<TransportInfo> all = discover_transports();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].name, "mpi");
  EXPECT_EQ(all[1].name, "nccl");
  for (const TransportInfo& t : all) {
    EXPECT_FALSE(t.detail.empty()) << t.name;
    if (!t.available) {
      EXPECT_TRUE(contains(t.detail, "unavailable:")) << t.detail;
    }
  }
}

#if METRALE_HAVE_MPI
TEST(MpiLoader, AMissingLibraryIsAReasonNotACrash) {
  const comm::MpiLoad load = comm::load_mpi_from("libmetrale-no-such-mpi.so.40");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_TRUE(contains(load.reason, "MPI unavailable: cannot load libmetrale-no-such-mpi.so.40"))
      << load.reason;
}

TEST(MpiLoader, ALibraryWithoutTheEntryPointsIsNamed) {
  const comm::MpiLoad load = comm::load_mpi_from("libm.so.6");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_TRUE(contains(load.reason, "libm.so.6 lacks MPI_Get_library_version")) << load.reason;
  EXPECT_TRUE(contains(load.reason, "ompi_mpi_comm_world")) << load.reason;
}

TEST(MpiLoader, OpenMpiLoadsAndSaysItsVersion) {
  const comm::MpiLoad& load = comm::load_mpi();
  ASSERT_NE(load.api, nullptr) << load.reason;
  EXPECT_TRUE(contains(load.version, "Open MPI")) << load.version;
}

// Started without mpirun, MPI makes this process a world of one: every collective is this
// rank's own data, and teardown leaves nothing.
TEST(MpiSingleton, OneRankCollectivesAreItsOwnData) {
  ModelScope scope(std::make_unique<CpuBackend>());
  Communicator& comm = create_communicator(scope);
  EXPECT_EQ(comm.transport(), "mpi");
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  Backend& b = scope.backend();
  const std::size_t n = testing::random_size(1, 1000);
  std::vector<float> x(n);
  for (float& v : x) v = static_cast<float>(testing::random_size(0, 1 << 20)) * 0.001f;
  const DevicePtr in = scope.alloc_buffer("in", n * 4);
  const DevicePtr out = scope.alloc_buffer("out", n * 4);
  b.copy_h2d(in, x.data(), n * 4);
  b.memset(out, 0xFF, n * 4);  // NaN: an unwritten element fails
  comm.all_reduce_sum(in, out, n, ReduceType::kF32);
  std::vector<float> got(n);
  b.copy_d2h(got.data(), out, n * 4);
  EXPECT_EQ(got, x);
  b.memset(out, 0xFF, n * 4);
  comm.all_gather(in, out, n * 4);
  b.copy_d2h(got.data(), out, n * 4);
  EXPECT_EQ(got, x);
  comm.barrier();
  // A range outside the buffer is refused before anything is sent, and the group stays usable.
  const Error e = expect_error([&] { comm.all_reduce_sum(in, out, n + 1, ReduceType::kF32); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(contains(e.what(), "[Communicator::all_reduce_sum]")) << e.what();
  EXPECT_FALSE(comm.failed());
  comm.abort("planted");
  const Error after = expect_error([&] { comm.barrier(); });
  EXPECT_EQ(after.code(), ErrorCode::kState);
  EXPECT_TRUE(contains(after.what(), "failed earlier: planted")) << after.what();
  const TeardownReport report = scope.teardown();
  EXPECT_TRUE(report.clean()) << report.leak_summary();
  EXPECT_EQ(report.live_bytes_after, 0u);
}
#endif

#if METRALE_HAVE_CUDA
TEST(NcclLoader, AMissingLibraryIsAReasonNotACrash) {
  const cuda::NcclLoad load = cuda::load_nccl_from("libmetrale-no-such-nccl.so.2");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_TRUE(contains(load.reason, "NCCL unavailable: cannot load libmetrale-no-such-nccl.so.2"))
      << load.reason;
}

TEST(NcclLoader, ALibraryWithoutTheEntryPointsIsNamed) {
  const cuda::NcclLoad load = cuda::load_nccl_from("libm.so.6");
  EXPECT_EQ(load.api, nullptr);
  EXPECT_TRUE(contains(load.reason, "libm.so.6 lacks ncclGetVersion")) << load.reason;
}

TEST(NcclLoader, TheToolkitsLibraryLoadsWhereItIsInstalled) {
  const cuda::NcclLoad& load = cuda::load_nccl();
  if (load.api == nullptr) GTEST_SKIP() << load.reason;
  EXPECT_GE(load.version, cuda::kMinNcclVersion);
}
#endif

class IdFile : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove(path_); }
  std::string path_ =
      (std::filesystem::temp_directory_path() / ("metrale-id-" + std::to_string(::getpid()) + "-" +
                                                 std::to_string(testing::random_size(0, 1u << 30))))
          .string();
};

TEST_F(IdFile, WhatRankZeroWritesTheOthersRead) {
  std::vector<std::byte> id(128);
  for (auto& b : id) b = static_cast<std::byte>(testing::random_size(0, 255));
  comm::write_id_file(path_, id);
  std::vector<std::byte> got(128, std::byte{0});
  comm::read_id_file(path_, got, std::chrono::milliseconds(1000));
  EXPECT_EQ(got, id);
}

TEST_F(IdFile, AFileThatNeverAppearsTimesOutNamingIt) {
  std::vector<std::byte> got(128);
  const auto start = std::chrono::steady_clock::now();
  const Error e =
      expect_error([&] { comm::read_id_file(path_, got, std::chrono::milliseconds(200)); });
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  EXPECT_TRUE(contains(e.what(), path_)) << e.what();
}

TEST_F(IdFile, AStrayFileIsNotTakenForAnId) {
  std::ofstream(path_) << std::string(136, 'x');
  std::vector<std::byte> got(128);
  const Error e =
      expect_error([&] { comm::read_id_file(path_, got, std::chrono::milliseconds(200)); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_TRUE(contains(e.what(), "not an id metrale wrote")) << e.what();
}

}  // namespace
}  // namespace metrale
