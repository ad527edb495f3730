// INT4 weights on the CUDA backend over the fake driver, whose w4a16 module publishes what the
// real one does. In their source layout no entry reads them (gemm_decode and gemm_tiled publish no
// <entry>_int4), and the INT4 decode layout's kernels are not verified on a device, so uploads
// that follow the backend's preference keep the source layout and every route is refused by name
// before anything is launched, the automatic one included. Uploaded in the int4 decode layout by
// name, the weights run on gemm_int4_decode (after permute_a_int4 under act order) and, above its
// largest M, dequant_int4_bf16 with the dense GEMM where the backend has one (this fake process
// has none): the fake's kernels are the CPU twins, so C matches the CPU backend's on the same route
// bit for bit. Nothing is left on the ledger.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/expect_error.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "reliability/fake_model.h"

namespace metrale::testing::reliability {
namespace {

TEST(FakeInt4, EveryRouteIsRefusedByNameAndNothingLaunches) {
  FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  std::vector<float> wv(64 * 256, 0.25f);
  ops::QuantWeights w = ops::upload_weights(*b, quantize_int4(wv, 64, 256, 128, true, false),
                                            ops::UploadLayout::kBackendPreferred);
  EXPECT_EQ(w.packing, ops::WeightPacking::kSource);
  const std::size_t before = proc.fd.launches().size();
  const DevicePtr a = b->alloc(64 * 256 * 2), c = b->alloc(64 * 64 * 2);
  for (const ops::GemmRoute route :
       {ops::GemmRoute::kAuto, ops::GemmRoute::kDecode, ops::GemmRoute::kTiled}) {
    for (const std::int64_t m : {1, 64}) {
      const ops::GemmOptions o{ops::Activations::kExactBf16, route, DevicePtr{}};
      for (const auto& call : std::vector<std::function<void()>>{
               [&] { (void)ops::plan(*b, m, w, o); },
               [&] { ops::w4a16_gemm(*b, b->default_stream(), a, m, w, c, o); }}) {
        const Error e = expect_error(call);
        EXPECT_EQ(e.code(), ErrorCode::kUnavailable) << e.what();
        EXPECT_NE(std::string(e.what()).find("does not read int4 weights"), std::string::npos)
            << e.what();
      }
    }
  }
  EXPECT_EQ(proc.fd.launches().size(), before);
  b->free(a);
  b->free(c);
  ops::free_weights(*b, w);
  EXPECT_EQ(b->ledger_probe().live_bytes(), 0u);
}

// C of w4a16_gemm on backend `b` for host weights uploaded in `layout` and A, read back.
std::vector<std::uint16_t> run_gemm(Backend& b, const HostQuantWeights& host,
                                    ops::UploadLayout layout, const std::vector<std::uint16_t>& a,
                                    std::int64_t m, const ops::GemmOptions& o) {
  ops::QuantWeights w = ops::upload_weights(b, host, layout);
  const DevicePtr da = b.alloc(a.size() * 2),
                  dc = b.alloc(static_cast<std::size_t>(m * host.n) * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  ops::w4a16_gemm(b, b.default_stream(), da, m, w, dc, o);
  std::vector<std::uint16_t> c(static_cast<std::size_t>(m * host.n));
  b.copy_d2h_after(c.data(), dc, c.size() * 2, b.default_stream());
  b.free(da);
  b.free(dc);
  ops::free_weights(b, w);
  return c;
}

TEST(FakeInt4, TheDecodeLayoutRunsItsKernelsByNameOnly) {
  FakeProcess proc;
  std::unique_ptr<Backend> b = proc.make_backend();
  CpuBackend cpu;
  std::vector<float> wv(40 * 256);
  for (std::size_t i = 0; i < wv.size(); ++i)
    wv[i] = static_cast<float>((i * 37) % 29) / 7.0f - 2.0f;
  const HostQuantWeights plain = quantize_int4(wv, 40, 256, 128, true, true);
  std::vector<std::int32_t> g_idx(256);
  for (std::int32_t k = 0; k < 256; ++k) g_idx[static_cast<std::size_t>(k)] = (k * 5 % 256) / 128;
  const HostQuantWeights ordered = with_act_order(plain, g_idx);
  ASSERT_FALSE(ordered.k_perm.empty());
  bool dequant_ran = false;
  for (const HostQuantWeights* host : {&plain, &ordered}) {
    for (const std::int64_t m : {1, 16, 20}) {
      SCOPED_TRACE(::testing::Message() << "M=" << m << (host->k_perm.empty() ? "" : " act order"));
      std::vector<std::uint16_t> a(static_cast<std::size_t>(m * 256));
      for (std::size_t i = 0; i < a.size(); ++i)
        a[i] = num::f32_to_bf16(static_cast<float>(i % 13) / 8.0f - 0.75f);
      const std::size_t before = proc.fd.launches().size();
      const std::vector<std::uint16_t> c =
          run_gemm(*b, *host, ops::UploadLayout::kDecode, a, m, ops::GemmOptions{});
      std::vector<std::string> names;
      const std::vector<fake::FakeLaunch> all = proc.fd.launches();
      for (std::size_t i = before; i < all.size(); ++i) names.push_back(all[i].function);
      const bool dequant = m > kDecodeMaxM && b->dense_gemm_unavailable(DenseKind::kBf16).empty();
      const auto ran = [&](const char* e) {
        return std::find(names.begin(), names.end(), e) != names.end();
      };
      EXPECT_EQ(ran("gemm_int4_decode"), !dequant);
      EXPECT_EQ(ran("dequant_int4_bf16"), dequant);
      EXPECT_EQ(ran("permute_a_int4"), !dequant && !host->k_perm.empty());
      // The CPU backend on the same route (its decode twin takes every M).
      ops::GemmOptions same;
      same.route = dequant ? ops::GemmRoute::kDequant : ops::GemmRoute::kDecode;
      EXPECT_EQ(c, run_gemm(cpu, *host, ops::UploadLayout::kDecode, a, m, same));
      dequant_ran = dequant_ran || dequant;
    }
  }
  // This fake process loads no cuBLASLt, so M = 20 stays on the decode kernel here; the dequant
  // choice with a dense GEMM is tests/cuda/gemm_route_policy_test.cpp's (FakeBlas).
  EXPECT_EQ(dequant_ran, b->dense_gemm_unavailable(DenseKind::kBf16).empty());
  // The scratch the routes grew (the permuted A, the BF16 weights) goes with the OpCache.
  b->op_cache().release(*b);
  EXPECT_EQ(b->ledger_probe().live_bytes(), 0u);
}

}  // namespace
}  // namespace metrale::testing::reliability
