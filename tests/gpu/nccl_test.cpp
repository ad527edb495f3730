// NCCL on a real GPU, one rank (the lent machine has one H200): a communicator made through an
// id file, each collective on device buffers against what one rank's collective must give
// (its own data; the sum over one rank), the core module's cast kernel on the device, and a
// teardown to zero bytes. Skips, saying why, without a GPU or without NCCL.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "metrale/backend.h"
#include "metrale/communicator.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/numerics.h"
#include "metrale/ops/elementwise.h"
#include "metrale/runtime.h"

namespace metrale {
namespace {

TEST(GpuNccl, OneRankCollectivesOnTheDevice) {
  std::unique_ptr<ModelScope> model;
  try {
    model = std::make_unique<ModelScope>(create_backend("cuda"));
  } catch (const Error& e) {
    GTEST_SKIP() << "no usable GPU: " << e.what();
  }
  bool nccl = false;
  for (const TransportInfo& t : discover_transports()) {
    if (t.name == "nccl") nccl = t.available;
  }
  if (!nccl) GTEST_SKIP() << "NCCL is not loadable here";
  CommunicatorOptions o;
  o.transport = "nccl";
  o.rank = 0;
  o.size = 1;
  o.id_file =
      (std::filesystem::temp_directory_path() / ("metrale-nccl-" + std::to_string(::getpid())))
          .string();
  Communicator& comm = create_communicator(*model, o);
  EXPECT_EQ(comm.transport(), "nccl");
  EXPECT_FALSE(std::filesystem::exists(o.id_file)) << "rank 0 removes the id file once joined";
  Backend& b = model->backend();
  std::mt19937_64 gen(std::random_device{}());
  std::normal_distribution<float> normal;
  const std::size_t n = 1 + gen() % 100000;
  std::vector<float> x(n);
  for (float& v : x) v = normal(gen);
  const DevicePtr in = model->alloc_buffer("in", n * 4), out = model->alloc_buffer("out", n * 4);
  const DevicePtr half = model->alloc_buffer("bf16", n * 2);
  b.copy_h2d(in, x.data(), n * 4);
  b.memset(out, 0xFF, n * 4);
  comm.all_reduce_sum(in, out, n, ReduceType::kF32);
  std::vector<float> got(n);
  b.copy_d2h(got.data(), out, n * 4);
  EXPECT_EQ(got, x) << "a sum over one rank is its data";
  b.memset(out, 0xFF, n * 4);
  comm.all_gather(in, out, n * 4);
  b.copy_d2h(got.data(), out, n * 4);
  EXPECT_EQ(got, x);
  comm.broadcast(out, n * 4, 0);
  comm.barrier();
  ops::cast_f32_to_bf16(b, b.default_stream(), out, half, n);
  std::vector<std::uint16_t> h(n);
  b.copy_d2h(h.data(), half, n * 2);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(h[i], num::f32_to_bf16(x[i])) << "element " << i;
  }
  const TeardownReport r = model->teardown();
  EXPECT_TRUE(r.clean()) << r.leak_summary();
  EXPECT_EQ(r.live_bytes_after, 0u);
}

}  // namespace
}  // namespace metrale
