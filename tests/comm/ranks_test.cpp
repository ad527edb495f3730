// The MPI transport with real processes: ctest runs this program under `mpirun -np 2` and
// `-np 4` (comm.ranks_2, comm.ranks_4). Every rank runs every case in the same order, as a
// tensor-parallel program would; each case makes its own model (CPU backend) and communicator,
// and its teardown must leave 0 bytes on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "metrale/backend.h"
#include "metrale/communicator.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/numerics.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/fp8_slices.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/parallel_linear.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"
#include "metrale/sharded_checkpoint.h"
#include "support/fp8_reference.h"
#include "toolkit/gemm_tolerance.h"

namespace metrale {
namespace {

using Clock = std::chrono::steady_clock;

// One rank's model and communicator for one case.
class RanksTest : public ::testing::Test {
 protected:
  void SetUp() override { comm_ = &create_communicator(scope_, options()); }
  void TearDown() override {
    const TeardownReport report = scope_.teardown();
    EXPECT_TRUE(report.clean()) << report.leak_summary();
    EXPECT_EQ(report.live_bytes_after, 0u);
  }
  virtual CommunicatorOptions options() const { return {}; }

  Communicator& comm() { return *comm_; }
  int rank() const { return comm_->rank(); }
  int size() const { return comm_->size(); }
  Backend& backend() { return scope_.backend(); }
  DevicePtr buffer(std::size_t bytes) { return scope_.alloc_buffer("case buffer", bytes); }

  template <class T>
  DevicePtr upload(const std::vector<T>& v) {
    const DevicePtr p = buffer(v.size() * sizeof(T));
    backend().copy_h2d(p, v.data(), v.size() * sizeof(T));
    return p;
  }
  template <class T>
  std::vector<T> download(DevicePtr p, std::size_t n) {
    std::vector<T> v(n);
    backend().copy_d2h(v.data(), p, n * sizeof(T));
    return v;
  }

  // A seed drawn fresh on rank 0 and broadcast, so every rank can make every rank's data.
  std::uint64_t shared_seed() {
    std::uint64_t seed =
        rank() == 0 ? (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}() : 0;
    const DevicePtr p = upload(std::vector<std::uint64_t>{seed});
    comm().broadcast(p, sizeof seed, 0);
    seed = download<std::uint64_t>(p, 1)[0];
    if (rank() == 0) std::printf("[ seed     ] %llu\n", static_cast<unsigned long long>(seed));
    return seed;
  }

  // Rank r's n values of N(0, 1) for the seed.
  static std::vector<float> values(std::uint64_t seed, int r, std::size_t n) {
    std::mt19937_64 gen(seed + 0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(r + 1));
    std::normal_distribution<float> dist;
    std::vector<float> v(n);
    for (float& x : v) x = dist(gen);
    return v;
  }

  // values() rounded to BF16.
  static std::vector<std::uint16_t> bf16_values(std::uint64_t seed, int r, std::size_t n) {
    const std::vector<float> f = values(seed, r, n);
    std::vector<std::uint16_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = num::f32_to_bf16(f[i]);
    return v;
  }

  // Columns [cols.begin, cols.end) of each of the m rows of A [m, k]: a row-parallel rank's A.
  static std::vector<std::uint16_t> columns_of(const std::vector<std::uint16_t>& a, std::int64_t m,
                                               std::int64_t k, const TensorSlice& cols) {
    std::vector<std::uint16_t> out;
    for (std::int64_t r = 0; r < m; ++r) {
      out.insert(out.end(), a.begin() + r * k + cols.begin, a.begin() + r * k + cols.end);
    }
    return out;
  }

  // A layer's `count` BF16 outputs in c, checked to be c_again's bits (the same run twice) and
  // rank 0's bits on every rank.
  std::vector<std::uint16_t> agreed_output(DevicePtr c, DevicePtr c_again, std::size_t count,
                                           std::int64_t m) {
    const auto got = download<std::uint16_t>(c, count);
    EXPECT_EQ(download<std::uint16_t>(c_again, count), got) << "not the same bits twice";
    const DevicePtr zeros = upload(got);
    comm().broadcast(zeros, got.size() * 2, 0);
    EXPECT_EQ(download<std::uint16_t>(zeros, got.size()), got) << "ranks disagree, M=" << m;
    return got;
  }

  ModelScope scope_{std::make_unique<CpuBackend>()};
  Communicator* comm_ = nullptr;
};

TEST_F(RanksTest, AllReduceF32SumsInRankOrderOnEveryRank) {
  const std::uint64_t seed = shared_seed();
  const std::size_t n = 1 + seed % 5000;
  const DevicePtr in = upload(values(seed, rank(), n));
  const DevicePtr out = upload(std::vector<float>(n, std::nanf("")));  // poison
  comm().all_reduce_sum(in, out, n, ReduceType::kF32);
  const std::vector<float> got = download<float>(out, n);
  comm().all_reduce_sum(in, out, n, ReduceType::kF32);
  const std::vector<float> again = download<float>(out, n);
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float ordered = 0;
    double exact = 0, magnitude = 0;
    for (int r = 0; r < size(); ++r) {
      const float x = values(seed, r, n)[i];
      ordered += x;
      exact += x;
      magnitude += std::fabs(x);
    }
    ASSERT_EQ(std::memcmp(&got[i], &ordered, 4), 0) << "element " << i << " of " << n;
    ASSERT_EQ(std::memcmp(&again[i], &got[i], 4), 0) << "not the same bits run to run";
    worst = std::max(worst, std::fabs(got[i] - exact));
    scale = std::max(scale, magnitude);
  }
  // FP32 sums of `size` terms: at most (size - 1) roundings of 2^-24 of the magnitude.
  EXPECT_LE(worst / scale, (size() - 1) * std::ldexp(1.0, -24) + 1e-12);
}

TEST_F(RanksTest, AllReduceBf16InPlaceRoundsOnce) {
  const std::uint64_t seed = shared_seed();
  const std::size_t n = 1 + seed % 3000;
  auto bf16_of = [&](int r) { return bf16_values(seed, r, n); };
  const DevicePtr io = upload(bf16_of(rank()));
  comm().all_reduce_sum(io, io, n, ReduceType::kBf16);
  const std::vector<std::uint16_t> got = download<std::uint16_t>(io, n);
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float ordered = 0;
    double exact = 0, magnitude = 0;
    for (int r = 0; r < size(); ++r) {
      const float x = num::bf16_to_f32(bf16_of(r)[i]);
      ordered += x;
      exact += x;
      magnitude += std::fabs(x);
    }
    ASSERT_EQ(got[i], num::f32_to_bf16(ordered)) << "element " << i << " of " << n;
    // One rounding to BF16 (2^-8 relative) after FP32 sums.
    const double bound =
        std::ldexp(std::fabs(exact), -8) + (size() - 1) * std::ldexp(magnitude, -24) + 1e-30;
    worst = std::max(worst, std::fabs(num::bf16_to_f32(got[i]) - exact) / bound);
  }
  EXPECT_LE(worst, 1.0);
}

TEST_F(RanksTest, AllGatherPlacesEveryRanksBytesAtItsSlot) {
  const std::uint64_t seed = shared_seed();
  const std::size_t bytes = 1 + seed % 4096;
  auto piece = [&](int r) {
    std::vector<std::uint8_t> v(bytes);
    std::mt19937_64 gen(seed ^ static_cast<std::uint64_t>(r * 7919 + 1));
    for (auto& b : v) b = static_cast<std::uint8_t>(gen());
    return v;
  };
  const DevicePtr in = upload(piece(rank()));
  const DevicePtr out = upload(std::vector<std::uint8_t>(bytes * size(), 0xA5));
  comm().all_gather(in, out, bytes);
  std::vector<std::uint8_t> got = download<std::uint8_t>(out, bytes * size());
  for (int r = 0; r < size(); ++r) {
    ASSERT_EQ(std::vector<std::uint8_t>(got.begin() + r * bytes, got.begin() + (r + 1) * bytes),
              piece(r))
        << "rank " << r << "'s slot";
  }
  // In place: this rank's piece already at its slot of out.
  const DevicePtr place = upload(std::vector<std::uint8_t>(bytes * size(), 0x5A));
  backend().copy_h2d(place.offset(rank() * bytes), piece(rank()).data(), bytes);
  comm().all_gather(place.offset(rank() * bytes), place, bytes);
  EXPECT_EQ(download<std::uint8_t>(place, bytes * size()), got);
}

TEST_F(RanksTest, BroadcastFromEveryRoot) {
  const std::uint64_t seed = shared_seed();
  for (int root = 0; root < size(); ++root) {
    const std::size_t n = 1 + (seed >> root) % 2000;
    const DevicePtr p =
        upload(rank() == root ? values(seed, root, n) : std::vector<float>(n, std::nanf("")));
    comm().broadcast(p, n * sizeof(float), root);
    const std::vector<float> got = download<float>(p, n);
    const std::vector<float> want = values(seed, root, n);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), n * sizeof(float)), 0) << "root " << root;
  }
}

TEST_F(RanksTest, BarrierAndEmptyCollectivesKeepTheRanksInStep) {
  comm().barrier();
  const DevicePtr p = buffer(64);
  comm().all_gather(p, p, 0);  // nothing to move: returns on every rank without a message
  comm().all_reduce_sum(p, p, 0, ReduceType::kF32);
  comm().barrier();
  EXPECT_FALSE(comm().failed());
}

TEST_F(RanksTest, RanksThatCallDifferentCollectivesAreToldWhich) {
  const DevicePtr in = buffer(64);
  const DevicePtr out = buffer(64 * size());
  try {
    if (rank() == 0) {
      comm().all_gather(in, out, 64);
    } else {
      comm().all_reduce_sum(in, out, 16, ReduceType::kF32);
    }
    ADD_FAILURE() << "the mismatch was not noticed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kState) << e.what();
    EXPECT_NE(std::string(e.what()).find("different collectives"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(comm().failed());
  try {
    comm().barrier();
    ADD_FAILURE() << "a failed communicator went on";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kState);
    EXPECT_NE(std::string(e.what()).find("failed earlier"), std::string::npos) << e.what();
  }
}

// Column-parallel: each rank multiplies by its rows of W and the shards are gathered; on every
// rank the result is the single-rank GEMM's, bit for bit (the CPU kernels never split K, so a
// column's sum does not depend on how many columns a rank holds), for decode and tiled M.
TEST_F(RanksTest, ColumnParallelEqualsOneRankBitForBit) {
  const std::uint64_t seed = shared_seed();
  const std::int64_t n = size() * 16 * static_cast<std::int64_t>(1 + seed % 8);
  const std::int64_t k = 64 * static_cast<std::int64_t>(1 + (seed >> 8) % 4);
  const HostQuantWeights full =
      quantize_nvfp4(values(seed, 100, static_cast<std::size_t>(n * k)), n, k);
  const TensorSlice rows = shard_slice(0, n, 8, rank(), size());
  const HostQuantWeights mine = slice_rows(full, rows.begin, rows.end);
  const ops::QuantWeights& w_full =
      scope_.add(ops::make_weights_resource(backend(), full, "full W")).weights();
  const ops::QuantWeights& w_mine =
      scope_.add(ops::make_weights_resource(backend(), mine, "shard of W")).weights();
  for (const std::int64_t m : {1, 3, 17, 64}) {
    const DevicePtr a_dev =
        upload(bf16_values(seed, 200 + static_cast<int>(m), static_cast<std::size_t>(m * k)));
    const std::vector<std::uint16_t> poison(static_cast<std::size_t>(m * n), 0x7FC1);
    const DevicePtr c = upload(poison);
    const DevicePtr c_local = upload(
        std::vector<std::uint16_t>(static_cast<std::size_t>(m * (rows.end - rows.begin)), 0x7FC1));
    const DevicePtr c_one = upload(poison);
    ops::column_parallel_gemm(comm(), ops::plan(backend(), m, w_mine), {}, a_dev, w_mine, c_local,
                              c);
    const ops::GemmPlan one = ops::plan(backend(), m, w_full);
    const StreamHandle s = backend().default_stream();
    ops::run(one, s, a_dev, w_full, c_one, ops::scratch_workspace(one, s));
    const auto got = download<std::uint16_t>(c, poison.size());
    const auto want = download<std::uint16_t>(c_one, poison.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], want[i]) << "M=" << m << " N=" << n << " K=" << k << " row "
                                 << i / static_cast<std::size_t>(n) << " column "
                                 << i % static_cast<std::size_t>(n) << " (" << to_string(one.route)
                                 << " route)";
    }
  }
}

// Row-parallel: each rank multiplies its columns of A by its columns of W into FP32 partials,
// which are summed across ranks in rank order and rounded once. Every rank gets the same bits,
// run after run; against the single-rank GEMM (one FP32 sum over all of K, rounded once) the
// difference is bounded by the two roundings and the two sums' FP32 errors.
TEST_F(RanksTest, RowParallelIsOneRanksResultWithinTheBound) {
  const std::uint64_t seed = shared_seed();
  const std::int64_t n = 8 * static_cast<std::int64_t>(1 + seed % 16);
  const std::int64_t k = size() * 32 * static_cast<std::int64_t>(1 + (seed >> 8) % 6);
  const HostQuantWeights full =
      quantize_nvfp4(values(seed, 300, static_cast<std::size_t>(n * k)), n, k);
  const TensorSlice cols = shard_slice(1, k, 16, rank(), size());
  const HostQuantWeights mine = slice_columns(full, cols.begin, cols.end);
  const ops::QuantWeights& w_full =
      scope_.add(ops::make_weights_resource(backend(), full, "full W")).weights();
  const ops::QuantWeights& w_mine =
      scope_.add(ops::make_weights_resource(backend(), mine, "shard of W")).weights();
  const std::vector<std::uint16_t> bias = bf16_values(seed, 301, static_cast<std::size_t>(n));
  const DevicePtr bias_dev = upload(bias);
  const StreamHandle s = backend().default_stream();
  for (const std::int64_t m : {1, 3, 17, 64}) {
    const std::vector<std::uint16_t> a =
        bf16_values(seed, 400 + static_cast<int>(m), static_cast<std::size_t>(m * k));
    const DevicePtr a_dev = upload(a), a_mine_dev = upload(columns_of(a, m, k, cols));
    const std::vector<std::uint16_t> poison(static_cast<std::size_t>(m * n), 0x7FC1);
    const DevicePtr c = upload(poison), c_again = upload(poison), c_one = upload(poison);
    ops::GemmOptions o;
    o.out_f32 = true;
    o.bias = rank() == 0 ? bias_dev : DevicePtr{};
    const ops::GemmPlan p = ops::plan(backend(), m, w_mine, o);
    ops::row_parallel_gemm(comm(), p, s, a_mine_dev, w_mine, c, o.bias);
    ops::row_parallel_gemm(comm(), p, s, a_mine_dev, w_mine, c_again, o.bias);
    ops::GemmOptions one_o;
    one_o.bias = bias_dev;
    const ops::GemmPlan one = ops::plan(backend(), m, w_full, one_o);
    ops::run(one, s, a_dev, w_full, c_one, ops::scratch_workspace(one, s), bias_dev);
    const auto got = agreed_output(c, c_again, poison.size(), m);
    const auto want = download<std::uint16_t>(c_one, poison.size());
    double worst = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double exact = num::bf16_to_f32(bias[static_cast<std::size_t>(j)]);
        double magnitude = std::fabs(exact);
        for (std::int64_t kk = 0; kk < k; ++kk) {
          const double t =
              static_cast<double>(num::bf16_to_f32(a[i * k + kk])) * full.exact_weight(j, kk);
          exact += t;
          magnitude += std::fabs(t);
        }
        const float tp = num::bf16_to_f32(got[i * n + j]);
        const float single = num::bf16_to_f32(want[i * n + j]);
        ASSERT_FALSE(std::isnan(tp)) << "M=" << m << " element " << i * n + j << " unwritten";
        // Each side: FP32 sums of K (+ ranks, + bias, + tensor scale) terms, then one rounding.
        const double roundings = 2.0 * static_cast<double>(k) + size() + 4;
        worst = std::max(worst, toolkit::row_parallel_ratio(tp, single, magnitude, roundings));
        ASSERT_LE(toolkit::row_parallel_exact_ratio(tp, exact, magnitude, roundings), 1.0)
            << "M=" << m << " N=" << n << " K=" << k << " element " << i * n + j;
      }
    }
    EXPECT_LE(worst, 1.0) << "M=" << m << " N=" << n << " K=" << k << " (" << to_string(p.route)
                          << " route)";
  }
}

// Row-parallel INT4 under act order (Note [Act order across ranks]): each rank holds W's columns
// of its slice of A, in its stored order with each group's run padded to 32-K blocks, and gets
// A's slice as every other format's rank does. The ranks' result, every rank's the same bits,
// against the single-rank GEMM and the float64 product as above, S taken as INT4's
// (toolkit/gemm_tolerance.h, "INT4": Σ|a|·(|code − 8| + |8 − zero|)·s), K and the group order
// drawn from the shared seed.
TEST_F(RanksTest, RowParallelActOrderedInt4IsOneRanksResultWithinTheBound) {
  const std::uint64_t seed = shared_seed();
  constexpr std::int64_t kGroup = 128;
  const std::int64_t n = 8 * static_cast<std::int64_t>(1 + seed % 8);
  const std::int64_t k = size() * 2 * kGroup * static_cast<std::int64_t>(1 + (seed >> 8) % 3);
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < k; ++i)
    g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i / kGroup);
  std::mt19937_64 order(seed ^ 0x1234);
  std::shuffle(g_idx.begin(), g_idx.end(), order);
  const HostQuantWeights full = with_act_order(
      quantize_int4(values(seed, 310, static_cast<std::size_t>(n * k)), n, k, kGroup, true, true),
      g_idx);
  const TensorSlice cols = shard_slice(1, k, kGroup, rank(), size());
  const HostQuantWeights mine = slice_columns(full, cols.begin, cols.end);
  ASSERT_EQ(a_columns(mine), cols.end - cols.begin);
  const ops::QuantWeights& w_full =
      scope_.add(ops::make_weights_resource(backend(), full, "full W")).weights();
  const ops::QuantWeights& w_mine =
      scope_.add(ops::make_weights_resource(backend(), mine, "shard of W")).weights();
  // W in float64 and each weight's share of S, (|q − 8| + |8 − zero|)·s, read from the stored
  // columns once (the element accessors check the weights on every call).
  std::vector<double> w_exact(static_cast<std::size_t>(n * k)), w_magnitude(w_exact.size());
  full.exact_rows(0, n, w_exact);
  for (std::int64_t j = 0; j < n; ++j) {
    for (std::int64_t stored = 0; stored < k; ++stored) {
      const auto g = static_cast<std::size_t>(j * (k / kGroup) + stored / kGroup);
      const std::uint8_t byte = full.codes[static_cast<std::size_t>(j * (k / 2) + stored / 2)];
      const int q = (stored & 1) ? byte >> 4 : byte & 0xF, zero = full.zeros[g];
      const double sc = num::f16_to_f32(
          static_cast<std::uint16_t>(full.scales[2 * g] | (full.scales[2 * g + 1] << 8)));
      const std::int32_t kk = full.k_perm[static_cast<std::size_t>(stored)];
      w_magnitude[static_cast<std::size_t>(j * k + kk)] =
          (std::abs(q - 8) + std::abs(8 - zero)) * sc;
    }
  }
  const StreamHandle s = backend().default_stream();
  for (const std::int64_t m : {1, 5, 24}) {
    const std::vector<std::uint16_t> a =
        bf16_values(seed, 410 + static_cast<int>(m), static_cast<std::size_t>(m * k));
    const DevicePtr a_dev = upload(a), a_mine_dev = upload(columns_of(a, m, k, cols));
    const std::vector<std::uint16_t> poison(static_cast<std::size_t>(m * n), 0x7FC1);
    const DevicePtr c = upload(poison), c_again = upload(poison), c_one = upload(poison);
    ops::GemmOptions o;
    o.out_f32 = true;
    const ops::GemmPlan p = ops::plan(backend(), m, w_mine, o);
    ops::row_parallel_gemm(comm(), p, s, a_mine_dev, w_mine, c);
    ops::row_parallel_gemm(comm(), p, s, a_mine_dev, w_mine, c_again);
    const ops::GemmPlan one = ops::plan(backend(), m, w_full);
    ops::run(one, s, a_dev, w_full, c_one, ops::scratch_workspace(one, s));
    const auto got = agreed_output(c, c_again, poison.size(), m);
    const auto want = download<std::uint16_t>(c_one, poison.size());
    double worst = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double exact = 0, magnitude = 0;
        for (std::int64_t kk = 0; kk < k; ++kk) {
          const auto at = static_cast<std::size_t>(j * k + kk);
          const double x = num::bf16_to_f32(a[static_cast<std::size_t>(i * k + kk)]);
          exact += x * w_exact[at];
          magnitude += std::fabs(x) * w_magnitude[at];
        }
        const float tp = num::bf16_to_f32(got[static_cast<std::size_t>(i * n + j)]);
        const float single = num::bf16_to_f32(want[static_cast<std::size_t>(i * n + j)]);
        ASSERT_FALSE(std::isnan(tp)) << "M=" << m << " element " << i * n + j << " unwritten";
        const double roundings = 2.0 * static_cast<double>(k) + size() + 4;
        worst = std::max(worst, toolkit::row_parallel_ratio(tp, single, magnitude, roundings));
        ASSERT_LE(toolkit::row_parallel_exact_ratio(tp, exact, magnitude, roundings), 1.0)
            << "M=" << m << " N=" << n << " K=" << k << " element " << i * n + j;
      }
    }
    EXPECT_LE(worst, 1.0) << "M=" << m << " N=" << n << " K=" << k << " (" << to_string(p.route)
                          << " route)";
  }
}

// The W8A8 layers: W cut at 128-blocks (N for column-parallel, K for row-parallel), so each
// rank casts whole 128-blocks of A exactly as one rank does.
class W8a8RanksTest : public RanksTest {
 protected:
  // E4M3 weights [n, k] from the seed, the same on every rank, and their upload's resource.
  testing::fp8::HostFp8Weights weights(std::uint64_t seed, std::int64_t n, std::int64_t k) {
    std::mt19937_64 gen(seed);
    return testing::fp8::random_weights(n, k, gen);
  }
  const ops::Fp8Weights& upload_weights(std::span<const std::uint8_t> codes,
                                        std::span<const std::uint8_t> scales, std::int64_t n,
                                        std::int64_t k) {
    return scope_.add(std::make_unique<ops::Fp8WeightsResource>(backend(), codes, scales, n, k))
        .weights();
  }
  static std::vector<std::uint16_t> activations(std::uint64_t seed, int m_tag, std::size_t count) {
    return bf16_values(seed, 500 + m_tag, count);
  }
};

TEST_F(W8a8RanksTest, ColumnParallelEqualsOneRankBitForBit) {
  const std::uint64_t seed = shared_seed();
  const std::int64_t n = size() * 128 * static_cast<std::int64_t>(1 + seed % 2);
  const std::int64_t k = 100 + static_cast<std::int64_t>((seed >> 8) % 300);
  const testing::fp8::HostFp8Weights full = weights(seed, n, k);
  const std::vector<std::uint8_t> full_scales = full.scale_bytes();
  const TensorSlice rows = shard_slice(0, n, 128, rank(), size());
  const ops::HostFp8Weights mine =
      ops::slice_fp8_rows(full.codes, full_scales, n, k, rows.begin, rows.end);
  const ops::Fp8Weights& w_full = upload_weights(full.codes, full_scales, n, k);
  const ops::Fp8Weights& w_mine = upload_weights(mine.codes, mine.scales, mine.n, mine.k);
  const StreamHandle s = backend().default_stream();
  for (const std::int64_t m : {1, 5, 64}) {
    const std::vector<std::uint16_t> a =
        activations(seed, static_cast<int>(m), static_cast<std::size_t>(m * k));
    const DevicePtr a_dev = upload(a);
    const std::vector<std::uint16_t> poison(static_cast<std::size_t>(m * n), 0x7FC1);
    const DevicePtr c = upload(poison), c_one = upload(poison);
    const DevicePtr c_local =
        upload(std::vector<std::uint16_t>(static_cast<std::size_t>(m * mine.n), 0x7FC1));
    ops::column_parallel_gemm(comm(), ops::plan(backend(), m, w_mine, {}), s, a_dev, w_mine,
                              c_local, c);
    const ops::Fp8GemmPlan one = ops::plan(backend(), m, w_full, {});
    ops::run(one, s, a_dev, w_full, c_one, ops::scratch_workspace(one, s));
    EXPECT_EQ(download<std::uint16_t>(c, poison.size()),
              download<std::uint16_t>(c_one, poison.size()))
        << "M=" << m << " N=" << n << " K=" << k;
  }
}

// Row-parallel W8A8: the ranks' FP32 partials are sums of whole 128-blocks, each block's sum the
// one a single rank computes; the totals differ only in the order the block sums are added, and
// then each side rounds once to BF16. Every rank gets the same bits, run after run.
TEST_F(W8a8RanksTest, RowParallelIsOneRanksResultWithinTheBound) {
  const std::uint64_t seed = shared_seed();
  const std::int64_t n = 64 + static_cast<std::int64_t>(seed % 200);
  const std::int64_t k = size() * 128 * static_cast<std::int64_t>(1 + (seed >> 8) % 3);
  const testing::fp8::HostFp8Weights full = weights(seed, n, k);
  const std::vector<std::uint8_t> full_scales = full.scale_bytes();
  const TensorSlice cols = shard_slice(1, k, 128, rank(), size());
  const ops::HostFp8Weights mine =
      ops::slice_fp8_columns(full.codes, full_scales, n, k, cols.begin, cols.end);
  const ops::Fp8Weights& w_full = upload_weights(full.codes, full_scales, n, k);
  const ops::Fp8Weights& w_mine = upload_weights(mine.codes, mine.scales, mine.n, mine.k);
  const std::vector<std::uint16_t> bias = bf16_values(seed, 601, static_cast<std::size_t>(n));
  const DevicePtr bias_dev = upload(bias);
  const StreamHandle s = backend().default_stream();
  for (const std::int64_t m : {1, 3, 64}) {
    const std::vector<std::uint16_t> a =
        activations(seed, static_cast<int>(m), static_cast<std::size_t>(m * k));
    const DevicePtr a_dev = upload(a), a_mine_dev = upload(columns_of(a, m, k, cols));
    const std::vector<std::uint16_t> poison(static_cast<std::size_t>(m * n), 0x7FC1);
    const DevicePtr c = upload(poison), c_again = upload(poison), c_one = upload(poison);
    ops::Fp8GemmOptions o;
    o.out_f32 = true;
    o.bias = rank() == 0 ? bias_dev : DevicePtr{};
    const ops::Fp8GemmPlan p = ops::plan(backend(), m, w_mine, o);
    ops::row_parallel_gemm(comm(), p, s, a_mine_dev, w_mine, c, o.bias);
    ops::row_parallel_gemm(comm(), p, s, a_mine_dev, w_mine, c_again, o.bias);
    ops::Fp8GemmOptions one_o;
    one_o.bias = bias_dev;
    const ops::Fp8GemmPlan one = ops::plan(backend(), m, w_full, one_o);
    ops::run(one, s, a_dev, w_full, c_one, ops::scratch_workspace(one, s), bias_dev);
    const auto got = agreed_output(c, c_again, poison.size(), m);
    const auto want = download<std::uint16_t>(c_one, poison.size());
    const testing::fp8::CastA cast = testing::fp8::cast_a(a, m, k);
    const double blocks = static_cast<double>(testing::fp8::blocks(k));
    double worst = 0;
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double magnitude = std::fabs(num::bf16_to_f32(bias[static_cast<std::size_t>(j)]));
        for (std::int64_t kk = 0; kk < k; ++kk) {
          magnitude += std::fabs(cast.value[static_cast<std::size_t>(i * k + kk)] * full.at(j, kk));
        }
        const float tp = num::bf16_to_f32(got[static_cast<std::size_t>(i * n + j)]);
        const float single = num::bf16_to_f32(want[static_cast<std::size_t>(i * n + j)]);
        ASSERT_FALSE(std::isnan(tp)) << "M=" << m << " element " << i * n + j << " unwritten";
        // The same block sums added in two orders (blocks + ranks + bias additions, and the
        // scale products) in FP32, then one rounding each.
        worst = std::max(
            worst, toolkit::row_parallel_ratio(tp, single, magnitude, 2 * (blocks + size() + 4)));
      }
    }
    EXPECT_LE(worst, 1.0) << "M=" << m << " N=" << n << " K=" << k;
  }
}

class SlowRanksTest : public RanksTest {
 protected:
  CommunicatorOptions options() const override {
    CommunicatorOptions o;
    o.timeout = std::chrono::milliseconds(20'000);
    return o;
  }
};

// A rank that fails mid-layer says so, and every other rank's collective fails at once with its
// reason, long before the 20 s timeout.
TEST_F(SlowRanksTest, AnAbortReachesEveryOtherRankAtOnce) {
  const int last = size() - 1;
  const DevicePtr p = buffer(4096);
  if (rank() == last) {
    comm().abort("planted failure in layer 3");
    EXPECT_TRUE(comm().failed());
    return;
  }
  const auto start = Clock::now();
  try {
    comm().all_reduce_sum(p, p, 1024, ReduceType::kF32);
    ADD_FAILURE() << "the collective completed without rank " << last;
  } catch (const Error& e) {
    const auto waited = Clock::now() - start;
    EXPECT_EQ(e.code(), ErrorCode::kState) << e.what();
    const std::string want = "rank " + std::to_string(last) + " of " + std::to_string(size()) +
                             " failed: planted failure in layer 3";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    EXPECT_LT(waited, std::chrono::seconds(5));
  }
}

class ShortTimeoutTest : public RanksTest {
 protected:
  // The ranks leave the previous case at different moments (four ranks share two cores here),
  // so they meet on a communicator with the default timeout before the short one is made.
  void SetUp() override {
    std::unique_ptr<Communicator> sync = make_communicator(backend());
    sync->barrier();
    sync->release();
    RanksTest::SetUp();
  }
  CommunicatorOptions options() const override {
    CommunicatorOptions o;
    o.timeout = std::chrono::milliseconds(700);
    return o;
  }
};

// A rank that never makes the call (stuck, or gone without a word) costs the others their
// timeout, not a hang; the first to time out tells the rest, the silent one included.
TEST_F(ShortTimeoutTest, ARankThatNeverCallsCostsTheOthersTheirTimeout) {
  const int last = size() - 1;
  const DevicePtr p = buffer(4096);
  if (rank() == last) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2000));
    try {
      comm().barrier();
      ADD_FAILURE() << "the barrier completed after the others gave up";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kState) << e.what();
      EXPECT_NE(std::string(e.what()).find("did not complete within 700 ms"), std::string::npos)
          << e.what();
    }
    return;
  }
  const auto start = Clock::now();
  try {
    comm().all_reduce_sum(p, p, 1024, ReduceType::kBf16);
    ADD_FAILURE() << "the collective completed without rank " << last;
  } catch (const Error& e) {
    const auto waited = Clock::now() - start;
    // This rank timed out itself, or heard first from a rank that did.
    EXPECT_TRUE(e.code() == ErrorCode::kTimeout || e.code() == ErrorCode::kState) << e.what();
    EXPECT_NE(std::string(e.what()).find("did not complete within 700 ms"), std::string::npos)
        << e.what();
    EXPECT_LT(waited, std::chrono::seconds(5));
  }
}

// Arguments are checked before anything is sent, so a bad one fails on this rank alone and
// leaves the communicator usable (the ranks are still in step).
TEST_F(RanksTest, ABadArgumentFailsBeforeAnythingIsSent) {
  const DevicePtr p = buffer(256);
  EXPECT_THROW(comm().broadcast(p, 256, size()), Error);
  EXPECT_THROW(comm().all_reduce_sum(p, p, 65, ReduceType::kF32), Error);  // 260 > 256 bytes
  EXPECT_THROW(comm().all_gather(p, DevicePtr{}, 8), Error);
  EXPECT_FALSE(comm().failed());
  comm().barrier();
}

}  // namespace
}  // namespace metrale

namespace metrale {
namespace {

// Run alone by comm.rank_dies (METRALE_COMM_RANK_DIES=exit) and comm.rank_hangs (=hang): the
// last rank ends its process in the middle of a layer, as a crash would, or stops answering
// without ending, as a deadlocked one would. The others must not hang: their collective fails
// within the timeout, and at exit their MPI_Finalize, which waits for every rank, is bounded.
TEST_F(ShortTimeoutTest, ARankThatDiesMidLayer) {
  const char* how = std::getenv("METRALE_COMM_RANK_DIES");
  if (how == nullptr) GTEST_SKIP() << "run by comm.rank_dies and comm.rank_hangs";
  const DevicePtr p = buffer(4096);
  comm().barrier();
  if (rank() == size() - 1) {
    // Longer than comm.rank_hangs lets mpirun run (30 s), short enough not to outlive it long.
    if (std::string(how) == "hang") std::this_thread::sleep_for(std::chrono::seconds(45));
    std::_Exit(3);
  }
  const auto start = Clock::now();
  try {
    comm().all_reduce_sum(p, p, 1024, ReduceType::kF32);
    ADD_FAILURE() << "the collective completed without the dead rank";
  } catch (const Error& e) {
    std::printf("rank %d: %s\n", rank(), e.what());
    std::fflush(stdout);
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  }
}

}  // namespace
}  // namespace metrale
