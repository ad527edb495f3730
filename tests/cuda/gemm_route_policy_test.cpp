// The automatic route's choice above the decode sizes, on the fake driver: dequantize → dense
// BF16 from the M dequant_bf16 publishes as its smallest (<entry>_min_m), only where the backend
// has a dense BF16 GEMM; the tiled kernel below it, without it, or when nothing is published.
// The choice is read from the plan alone: nothing is launched.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "cuda/fake_blas.h"
#include "cuda/rig.h"
#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/int4_decode_layout.h"
#include "kernels/verified_devices.h"
#include "metrale/error.h"
#include "metrale/ops/gemm.h"

namespace metrale::cuda::testing {
namespace {

constexpr std::uint32_t kTile = 64, kBlockThreads = 128, kDecodeMaxM = 16;

// Publishes that a device run verified the entry (kernels/verified_devices.h), as the real module's
// METRALE_VERIFIED line does.
void publish_verified(ModuleSpec& m, const std::string& entry) {
  m.fake.publish_u32(entry + "_verified", 20261129)
      .publish_u32(entry + "_verified_on", metrale::verified::kH200);
}

// A w4a16 module with the three entries the choice looks at; dequant_bf16 publishes min_m when
// it is not 0, and that a device verified it unless `verified_dequant` is false. No entry has a
// body: these tests plan only.
ModuleSpec route_module(std::uint32_t min_m, bool verified_dequant = true) {
  ModuleSpec m;
  m.name = "w4a16";
  for (const char* e : {"gemm_decode", "gemm_tiled", "dequant_bf16"}) {
    FakeFunction f;
    f.param_sizes = {sizeof(GemmParams)};
    m.fake.functions[e] = f;
    m.fake.publish_u32(std::string(e) + "_n_tile", kTile)
        .publish_u32(std::string(e) + "_block_threads", kBlockThreads);
    m.entries.emplace_back(e);
  }
  m.fake.publish_u32("gemm_decode_max_m", kDecodeMaxM);
  if (min_m != 0) m.fake.publish_u32("dequant_bf16_min_m", min_m);
  publish_verified(m, "gemm_decode");
  publish_verified(m, "gemm_tiled");
  if (verified_dequant) publish_verified(m, "dequant_bf16");
  return m;
}

ops::QuantWeights weights(CudaBackend& b) {
  ops::QuantWeights w;
  w.format = WeightFormat::kNvfp4;
  w.n = 256;
  w.k = 128;
  w.codes_bytes = 256 * 64;
  w.scales_bytes = 256 * 8;
  w.codes = b.alloc(w.codes_bytes);
  w.scales = b.alloc(w.scales_bytes);
  return w;
}

ops::GemmRoute route_at(Rig& rig, std::int64_t m) {
  const ops::QuantWeights w = weights(rig.b());
  const ops::GemmRoute r = ops::plan(rig.b(), m, w).route;
  rig.b().free(w.codes);
  rig.b().free(w.scales);
  return r;
}

TEST(GemmRoutePolicy, DequantFromThePublishedMinimumWhereADenseGemmExists) {
  FakeBlas blas;
  RigOptions o;
  o.modules = {core_module(), route_module(256)};
  o.blas = blas.source();
  Rig rig(std::move(o));
  EXPECT_EQ(route_at(rig, 1), ops::GemmRoute::kDecode);
  EXPECT_EQ(route_at(rig, kDecodeMaxM), ops::GemmRoute::kDecode);
  EXPECT_EQ(route_at(rig, kDecodeMaxM + 1), ops::GemmRoute::kTiled);
  EXPECT_EQ(route_at(rig, 255), ops::GemmRoute::kTiled);
  EXPECT_EQ(route_at(rig, 256), ops::GemmRoute::kDequant);
  EXPECT_EQ(route_at(rig, 4096), ops::GemmRoute::kDequant);
}

TEST(GemmRoutePolicy, TiledWithoutADenseGemm) {
  RigOptions o;
  o.modules = {core_module(), route_module(256)};  // no cuBLASLt
  Rig rig(std::move(o));
  ASSERT_FALSE(rig.b().dense_gemm_unavailable(DenseKind::kBf16).empty());
  EXPECT_EQ(route_at(rig, 4096), ops::GemmRoute::kTiled);
}

TEST(GemmRoutePolicy, TiledWhenTheDequantKernelPublishesNoMinimum) {
  FakeBlas blas;
  RigOptions o;
  o.modules = {core_module(), route_module(0)};
  o.blas = blas.source();
  Rig rig(std::move(o));
  EXPECT_EQ(route_at(rig, 4096), ops::GemmRoute::kTiled);
}

// Until a device run verifies dequant_bf16, the automatic route never takes it, whatever M it
// publishes; asked for, the route is planned on it.
TEST(GemmRoutePolicy, AnUnverifiedDequantKernelRunsOnlyWhenAskedFor) {
  FakeBlas blas;
  RigOptions o;
  o.modules = {core_module(), route_module(256, /*verified_dequant=*/false)};
  o.blas = blas.source();
  Rig rig(std::move(o));
  EXPECT_EQ(route_at(rig, 256), ops::GemmRoute::kTiled);
  EXPECT_EQ(route_at(rig, 4096), ops::GemmRoute::kTiled);
  const ops::QuantWeights w = weights(rig.b());
  ops::GemmOptions dequant;
  dequant.route = ops::GemmRoute::kDequant;
  const ops::GemmPlan p = ops::plan(rig.b(), 4096, w, dequant);
  EXPECT_EQ(p.route, ops::GemmRoute::kDequant);
  EXPECT_NE(p.describe().find("w4a16::dequant_bf16"), std::string::npos) << p.describe();
  rig.b().free(w.codes);
  rig.b().free(w.scales);
}

// INT4 weights in the int4 decode layout: the module's gemm_int4_decode up to the largest M it
// publishes, dequant_int4_bf16 → dense BF16 above it where the backend has a dense GEMM (the
// caller chose these unverified kernels by the upload), gemm_int4_decode for every M without one
// or for FP32 C; act order adds permute_a_int4 before the decode kernel. Read from plans alone.
ModuleSpec int4_layout_module() {
  ModuleSpec m = route_module(0);
  for (const char* e : {"gemm_int4_decode", "dequant_int4_bf16", "permute_a_int4"}) {
    FakeFunction f;
    f.param_sizes = {sizeof(GemmParams)};
    m.fake.functions[e] = f;
    m.fake.publish_u32(std::string(e) + "_n_tile", kTile)
        .publish_u32(std::string(e) + "_block_threads", kBlockThreads)
        .publish_u32(std::string(e) + "_layout", metrale::int4_decode::kLayoutId)
        .publish_u32(std::string(e) + "_int4", 1);
    m.entries.emplace_back(e);
  }
  m.fake.publish_u32("gemm_int4_decode_max_m", kDecodeMaxM)
      .publish_u32("gemm_int4_decode_out_f32", 1);
  return m;
}

ops::QuantWeights int4_weights(CudaBackend& b, bool act_order) {
  ops::QuantWeights w;
  w.format = WeightFormat::kInt4;
  w.packing = ops::WeightPacking::kDecode;
  w.n = 256;
  w.k = 256;
  w.group = 128;
  w.act_order = act_order;
  const metrale::int4_decode::Sizes s =
      metrale::int4_decode::sizes_of(w.n, w.k, w.group, act_order);
  w.codes_bytes = static_cast<std::uint64_t>(s.codes);
  w.scales_bytes = static_cast<std::uint64_t>(s.side);
  w.codes = b.alloc(w.codes_bytes);
  w.scales = b.alloc(w.scales_bytes);
  return w;
}

TEST(GemmRoutePolicy, Int4DecodeLayoutDecodesThenDequantizesWhereADenseGemmExists) {
  for (const bool with_blas : {true, false}) {
    SCOPED_TRACE(with_blas ? "with cuBLASLt" : "without cuBLASLt");
    FakeBlas blas;
    RigOptions o;
    o.modules = {core_module(), int4_layout_module()};
    if (with_blas) o.blas = blas.source();
    Rig rig(std::move(o));
    for (const bool act : {false, true}) {
      const ops::QuantWeights w = int4_weights(rig.b(), act);
      const ops::GemmPlan one = ops::plan(rig.b(), 1, w);
      EXPECT_EQ(one.route, ops::GemmRoute::kDecode);
      EXPECT_EQ(one.launches.size(), act ? 2u : 1u) << one.describe();
      EXPECT_NE(one.describe().find("w4a16::gemm_int4_decode"), std::string::npos);
      EXPECT_EQ(one.describe().find("permute_a_int4") != std::string::npos, act);
      EXPECT_EQ(ops::plan(rig.b(), kDecodeMaxM, w).route, ops::GemmRoute::kDecode);
      const ops::GemmPlan big = ops::plan(rig.b(), 4096, w);
      EXPECT_EQ(big.route, with_blas ? ops::GemmRoute::kDequant : ops::GemmRoute::kDecode);
      if (with_blas) {
        EXPECT_NE(big.describe().find("w4a16::dequant_int4_bf16"), std::string::npos)
            << big.describe();
        // Act order: A gathered into the stored order, which the dequantization writes W in.
        EXPECT_EQ(big.workspace.a_perm != 0, act);
        EXPECT_EQ(big.describe().find("permute_a_int4") != std::string::npos, act);
      }
      ops::GemmOptions f32;
      f32.out_f32 = true;
      EXPECT_EQ(ops::plan(rig.b(), 4096, w, f32).route, ops::GemmRoute::kDecode);
      rig.b().free(w.codes);
      rig.b().free(w.scales);
    }
  }
}

// The decode layout's kernels: gemm_decode_packed (every M) and gemm_fused (prefill), as the real
// module publishes them on sm_90a, or gemm_fused as the placeholder of the other targets.
enum class Fused { kUnverified, kVerified, kAbsent };
ModuleSpec decode_layout_module(Fused fused) {
  ModuleSpec m = route_module(0);
  for (const char* e : {"gemm_decode_packed", "gemm_fused"}) {
    FakeFunction f;
    f.param_sizes = {sizeof(GemmParams)};
    m.fake.functions[e] = f;
    m.entries.emplace_back(e);
  }
  m.fake.publish_u32("gemm_decode_packed_n_tile", 32)
      .publish_u32("gemm_decode_packed_block_threads", kBlockThreads)
      .publish_u32("gemm_decode_packed_layout", decode_layout::kLayoutId)
      .publish_u32("gemm_decode_packed_max_m", kDecodeMaxM);
  if (fused == Fused::kAbsent) {
    m.fake.publish_u32("gemm_fused_absent", 1);
    publish_verified(m, "gemm_fused");  // even so: a placeholder is never chosen
    return m;
  }
  m.fake.publish_u32("gemm_fused_n_tile", 128)
      .publish_u32("gemm_fused_m_tile", 128)
      .publish_u32("gemm_fused_block_threads", 384)
      .publish_u32("gemm_fused_layout", decode_layout::kLayoutId);
  if (fused == Fused::kVerified) publish_verified(m, "gemm_fused");
  return m;
}

// Weights in the decode layout (buffers of its sizes; never read: planning only).
ops::QuantWeights decode_layout_weights(CudaBackend& b) {
  ops::QuantWeights w = weights(b);
  b.free(w.codes);
  b.free(w.scales);
  w.packing = ops::WeightPacking::kDecode;
  w.fold = decode_layout::kNvfp4Fold;
  w.codes_bytes = static_cast<std::size_t>(decode_layout::code_bytes(w.n, w.k));
  w.scales_bytes = static_cast<std::size_t>(decode_layout::scale_bytes(w.n, w.k, false));
  w.codes = b.alloc(w.codes_bytes);
  w.scales = b.alloc(w.scales_bytes);
  return w;
}

ops::GemmRoute decode_layout_route(Rig& rig, std::int64_t m, ops::GemmRoute asked) {
  const ops::QuantWeights w = decode_layout_weights(rig.b());
  ops::GemmOptions o;
  o.route = asked;
  const auto free_weights = [&] {
    rig.b().free(w.codes);
    rig.b().free(w.scales);
  };
  try {
    const ops::GemmRoute r = ops::plan(rig.b(), m, w, o).route;
    free_weights();
    return r;
  } catch (...) {
    free_weights();
    throw;
  }
}

// gemm_fused is the automatic choice above the decode sizes only once a device verified it;
// until then the decode kernel takes every M, and the fused route runs when asked for.
TEST(GemmRoutePolicy, TheFusedKernelIsChosenOnlyOnceADeviceVerifiedIt) {
  {
    Rig rig(RigOptions{.modules = {core_module(), decode_layout_module(Fused::kUnverified)}});
    EXPECT_EQ(decode_layout_route(rig, 4096, ops::GemmRoute::kAuto), ops::GemmRoute::kDecode);
    EXPECT_EQ(decode_layout_route(rig, 4096, ops::GemmRoute::kFused), ops::GemmRoute::kFused);
  }
  Rig rig(RigOptions{.modules = {core_module(), decode_layout_module(Fused::kVerified)}});
  EXPECT_EQ(decode_layout_route(rig, kDecodeMaxM, ops::GemmRoute::kAuto), ops::GemmRoute::kDecode);
  EXPECT_EQ(decode_layout_route(rig, 4096, ops::GemmRoute::kAuto), ops::GemmRoute::kFused);
}

// Where gemm_fused is a placeholder (sm_80, sm_89): never the automatic choice, and asking for the
// fused route is Error(kUnavailable) naming the kernel, before anything is launched.
TEST(GemmRoutePolicy, APlaceholderFusedKernelIsNeverChosenAndRefusedWhenAskedFor) {
  Rig rig(RigOptions{.modules = {core_module(), decode_layout_module(Fused::kAbsent)}});
  EXPECT_EQ(decode_layout_route(rig, 4096, ops::GemmRoute::kAuto), ops::GemmRoute::kDecode);
  try {
    (void)decode_layout_route(rig, 4096, ops::GemmRoute::kFused);
    ADD_FAILURE() << "the placeholder gemm_fused was planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("w4a16::gemm_fused is a placeholder"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(rig.fd.launches().empty());
}

}  // namespace
}  // namespace metrale::cuda::testing

namespace metrale::cuda::testing {
namespace {

// FP32 output is a kernel's to offer: refused, naming the kernel, where the one that writes C
// publishes no out_f32 (a module of this fake's), planned with the flag where it does, and never
// sent to the dequant route, whose dense GEMM writes BF16.
TEST(GemmOutF32, OnlyFromAKernelThatPublishesIt) {
  FakeBlas blas;
  RigOptions o;
  ModuleSpec with = route_module(256);
  with.fake.publish_u32("gemm_tiled_out_f32", 1);
  o.modules = {core_module(), with};
  o.blas = blas.source();
  Rig rig(std::move(o));
  const ops::QuantWeights w = weights(rig.b());
  ops::GemmOptions f32;
  f32.out_f32 = true;
  try {
    (void)ops::plan(rig.b(), 1, w, f32);
    ADD_FAILURE() << "gemm_decode publishes no out_f32, yet FP32 output was planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("w4a16::gemm_decode kernel writes C in BF16 only"),
              std::string::npos)
        << e.what();
  }
  const ops::GemmPlan tiled = ops::plan(rig.b(), 4096, w, f32);
  EXPECT_EQ(tiled.route, ops::GemmRoute::kTiled) << "the dequant route writes BF16";
  EXPECT_NE(tiled.flags & kGemmOutF32, 0u);
  EXPECT_EQ(ops::plan(rig.b(), 4096, w).route, ops::GemmRoute::kDequant);
  rig.b().free(w.codes);
  rig.b().free(w.scales);
}

}  // namespace
}  // namespace metrale::cuda::testing
