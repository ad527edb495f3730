// `metrale info`'s per-kernel line on CUDA (describe_modules, the listing info and info --json
// print): "verified on <GPU>, <date>" for a kernel that publishes a device run, "not yet run on a
// GPU" for one that does not, "not on this target" for a placeholder. On the fake driver.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "cuda/rig.h"
#include "kernels/gemm_params.h"
#include "kernels/verified_devices.h"
#include "metrale/runtime.h"

namespace metrale::cuda::testing {
namespace {

TEST(VerifiedInfo, EachKernelSaysWhetherAndWhereAGpuVerifiedIt) {
  ModuleSpec m;
  m.name = "w4a16";
  for (const char* e : {"gemm_tiled", "gemm_fused", "gemm_decode_packed"}) {
    m.fake.functions[e] = FakeFunction{{}, {sizeof(GemmParams)}};
    m.fake.publish_u32(std::string(e) + "_n_tile", 64);
    m.entries.emplace_back(e);
  }
  m.fake.publish_u32("gemm_tiled_verified", 20261129)
      .publish_u32("gemm_tiled_verified_on", metrale::verified::kH200)
      .publish_u32("gemm_fused_absent", 1);
  Rig rig(RigOptions{.modules = {core_module(), m}});
  std::map<std::string, std::string> said;
  for (const ModuleDescription& d : describe_modules(rig.b())) {
    if (d.name != "w4a16") continue;
    for (const KernelListing& k : d.kernels) said[k.name] = k.verified;
  }
  EXPECT_EQ(said["gemm_tiled"], "verified on NVIDIA H200, 2026-11-29");
  EXPECT_EQ(said["gemm_decode_packed"], "not yet run on a GPU");
  EXPECT_EQ(said["gemm_fused"], "not on this target");
}

}  // namespace
}  // namespace metrale::cuda::testing
