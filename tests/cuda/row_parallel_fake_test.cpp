// ops::row_parallel_gemm on the CUDA backend over the fake driver and a one-rank fake NCCL: the
// whole route (an FP32-output GEMM into scratch, the all-reduce, the core module's
// cast_f32_bf16) runs end to end and matches the float64 reference. Until the fake core module
// carried cast_f32_bf16 this route had never run on the CUDA backend anywhere.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include "cuda/fake_gemm.h"
#include "cuda/fake_nccl.h"
#include "cuda/nccl_api.h"
#include "cuda/nccl_communicator.h"
#include "cuda/rig.h"
#include "kernels/gemm_params.h"
#include "metrale/communicator.h"
#include "metrale/numerics.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/parallel_linear.h"
#include "ops/gemm_reference.h"

namespace metrale::cuda::testing {
namespace {

namespace ref = metrale::testing::gemm;

constexpr std::uint32_t kDecodeTile = 8;

// W[n, k] in the source layout (row-major codes, per-group scales), as gemm_decode reads it.
float weight_of(const GemmParams& p, std::int64_t n, std::int64_t k) {
  const auto* codes = at<const std::uint8_t>(p.codes);
  const std::uint8_t byte = codes[n * (p.k / 2) + k / 2];
  const auto code = static_cast<std::uint8_t>((k & 1) ? byte >> 4 : byte & 0xF);
  const std::uint8_t sb =
      at<const std::uint8_t>(p.scales)[n * (p.k / num::kNvfp4Group) + k / num::kNvfp4Group];
  return num::e2m1_to_f32(code) * num::e4m3_to_f32(sb);
}

// A w4a16 module whose decode kernel writes FP32 C when asked, and says so.
ModuleSpec out_f32_module() {
  ModuleSpec m;
  m.name = "w4a16";
  m.fake.functions["gemm_decode"] = fake_split_decode(kDecodeTile, weight_of);
  m.fake.publish_u32("gemm_decode_n_tile", kDecodeTile)
      .publish_u32("gemm_decode_block_threads", 128)
      .publish_u32("gemm_decode_max_m", 16)
      .publish_u32("gemm_decode_out_f32", 1);
  m.entries = {"gemm_decode"};
  return m;
}

TEST(RowParallelFake, OneRankMatchesTheFloat64Reference) {
  const std::uint64_t seed = ref::fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  Rig rig(RigOptions{.modules = {core_module(), out_f32_module()}});
  CudaBackend& b = rig.b();
  FakeNccl nccl;
  auto comm = make_nccl_communicator(b, nccl.api(), NcclJoin{0, 1, [](std::span<std::byte>) {}},
                                     CommunicatorOptions{});
  constexpr std::int64_t kM = 3, kN = 40, kK = 128;
  const auto wv = ref::random_weight_values(gen, kN, kK);
  const HostQuantWeights hw = ref::quantize(WeightFormat::kNvfp4, wv, kN, kK);
  const auto a = ref::random_activations(gen, static_cast<std::size_t>(kM * kK));
  const auto bias = ref::random_bias(gen, kN);
  ops::QuantWeights w = ops::upload_weights(b, hw);
  const DevicePtr da = b.alloc(a.size() * 2), db = b.alloc(bias.size() * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  b.copy_h2d(db, bias.data(), bias.size() * 2);
  const auto out_elems = static_cast<std::size_t>(kM * kN);
  const DevicePtr dc = b.alloc((out_elems + ref::kTailElems) * 2);
  b.memset(dc, ref::kPoisonByte, (out_elems + ref::kTailElems) * 2);
  ops::GemmOptions o;
  o.route = ops::GemmRoute::kDecode;
  o.bias = db;
  o.out_f32 = true;
  const ops::GemmPlan p = ops::plan(b, kM, w, o);
  const StreamHandle s = b.default_stream();
  ops::row_parallel_gemm(*comm, p, s, da, w, dc, db);
  b.synchronize(s);
  std::vector<std::uint16_t> out(out_elems + ref::kTailElems);
  b.copy_d2h(out.data(), dc, out.size() * 2);
  const ref::Reference r = ref::reference(a, kM, hw, bias, ref::AMode::kBf16);
  ref::expect_close(ref::compare(out, r), ref::kNormTol, "row-parallel, one rank");
  for (std::size_t i = out_elems; i < out.size(); ++i) EXPECT_EQ(out[i], ref::kPoisonBf16) << i;
  bool cast_ran = false;
  for (const FakeLaunch& l : rig.fd.launches()) cast_ran |= l.function == "cast_f32_bf16";
  EXPECT_TRUE(cast_ran);
  b.free(dc);
  b.free(db);
  b.free(da);
  ops::free_weights(b, w);
}

}  // namespace
}  // namespace metrale::cuda::testing
