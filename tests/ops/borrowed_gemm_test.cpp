// A w4a16 GEMM whose A and C are borrowed host memory on the CPU backend (Backend::borrow): the
// op reads and writes the caller's arrays in place, as it does its own buffers, and refuses them
// before they are lent.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {
namespace {

using ::testing::HasSubstr;

DevicePtr at(const void* p) {
  return DevicePtr{reinterpret_cast<std::uintptr_t>(p)};
}

TEST(BorrowedGemm, ReadsAAndWritesCInTheCallersMemoryAsInItsOwnBuffers) {
  CpuBackend b;
  std::mt19937_64 gen(fresh_seed());
  constexpr std::int64_t kN = 96, kK = 256;
  const HostQuantWeights host =
      quantize(WeightFormat::kNvfp4, random_weight_values(gen, kN, kK), kN, kK);
  ops::QuantWeights w = ops::upload_weights(b, host);
  for (const std::int64_t m : {std::int64_t{1}, std::int64_t{16}}) {  // decode and tiled
    SCOPED_TRACE(m);
    const std::vector<std::uint16_t> a_host =
        random_activations(gen, static_cast<std::size_t>(m * kK));
    const auto mn = static_cast<std::size_t>(m * kN);
    std::vector<std::uint16_t> a = a_host, c(mn + kTailElems, kPoisonBf16);

    // Not lent: refused before anything runs.
    const Error refused = metrale::testing::expect_error(
        [&] { ops::w4a16_gemm(b, b.default_stream(), at(a.data()), m, w, at(c.data()), {}); });
    EXPECT_EQ(refused.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(refused.what(), HasSubstr("not inside any allocation"));
    EXPECT_EQ(c[0], kPoisonBf16);

    int released = 0;
    b.borrow(at(a.data()), a.size() * 2, [&] { ++released; });
    b.borrow(at(c.data()), c.size() * 2, [&] { ++released; });
    ops::w4a16_gemm(b, b.default_stream(), at(a.data()), m, w, at(c.data()), {});
    b.unborrow(at(a.data()));
    b.unborrow(at(c.data()));
    EXPECT_EQ(released, 2);
    EXPECT_EQ(std::count(c.begin() + static_cast<std::ptrdiff_t>(mn), c.end(), kPoisonBf16),
              static_cast<std::ptrdiff_t>(kTailElems))
        << "wrote past C";
    c.resize(mn);
    EXPECT_EQ(a, a_host);  // A is read, not written
    expect_close(compare(c, reference(a_host, m, host, {}, AMode::kBf16)), kNormTol,
                 "against the float64 reference");

    // The same call on the backend's own buffers gives the same bits.
    const DevicePtr da = b.alloc(a.size() * 2), dc = b.alloc(mn * 2);
    b.copy_h2d(da, a.data(), a.size() * 2);
    ops::w4a16_gemm(b, b.default_stream(), da, m, w, dc, {});
    std::vector<std::uint16_t> owned(mn);
    b.copy_d2h(owned.data(), dc, mn * 2);
    EXPECT_EQ(owned, c);
    b.free(da);
    b.free(dc);
  }
  ops::free_weights(b, w);
  b.op_cache().release(b);
  EXPECT_EQ(b.alloc_stats().borrowed_count, 0u);
}

}  // namespace
}  // namespace metrale::testing::gemm
