// The offline occupancy rules (occupancy.h) on resource lines written out here: what fits for
// kernels of known usage, each limit holding a planted kernel below what it would publish, and
// the reader of `cuobjdump -res-usage`.
#include "occupancy.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

namespace metrale::offline {
namespace {

// cuobjdump -res-usage of this tree's w4a16 fatbin, cut down: its PTX section (no usage), the
// decode-layout kernel on sm_80, and it with the fused kernel on sm_90a.
constexpr const char* kResUsage = R"(
Fatbin ptx code:
================
arch = sm_80
code version = [9,0]

Fatbin elf code:
================
arch = sm_80
code version = [1,8]

Resource usage:
 Common:
  GLOBAL:144 CONSTANT[4]:288
 Function gemm_decode_packed:
  REG:211 STACK:0 SHARED:17408 LOCAL:0 CONSTANT[0]:456 TEXTURE:0 SURFACE:0 SAMPLER:0

Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

Resource usage:
 Common:
  GLOBAL:216 CONSTANT[4]:432
 Function gemm_fused:
  REG:168 STACK:0 SHARED:2112 LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function gemm_decode_packed:
  REG:209 STACK:0 SHARED:18432 LOCAL:0 CONSTANT[0]:632 TEXTURE:0 SURFACE:0 SAMPLER:0
)";

const SmLimits& sm(const char* target) {
  const SmLimits* s = sm_limits(target);
  if (s == nullptr) throw std::runtime_error(std::string("no limits for ") + target);
  return *s;
}

TEST(Occupancy, TheResourceReaderKeepsEachTargetsFunctionsAndSkipsPtx) {
  const ResUsage usage = parse_res_usage(kResUsage);
  ASSERT_EQ(usage.size(), 2u);
  EXPECT_EQ(usage.at("sm_80").size(), 1u);
  EXPECT_EQ(usage.at("sm_80").at("gemm_decode_packed").at("REG"), 211);
  EXPECT_EQ(usage.at("sm_90a").at("gemm_fused").at("SHARED"), 2112);
  EXPECT_EQ(usage.at("sm_90a").at("gemm_decode_packed").at("CONSTANT[0]"), 632);
  EXPECT_EQ(usage.at("sm_90a").at("gemm_decode_packed").at("LOCAL"), 0);
}

// gemm_decode_packed: 209 registers x 32 lanes is 6688 a warp, 6912 allocated; a sub-partition's
// 16384 hold 2 warps, the SM 8: one block of 8 warps. A planted publication of 2 is caught.
TEST(Occupancy, ThePackedDecodeKernelFitsOneBlockAndAPlantedTwoFails) {
  const ResUsage usage = parse_res_usage(kResUsage);
  for (const char* target : {"sm_80", "sm_90a"}) {
    SCOPED_TRACE(target);
    const auto& u = usage.at(target).at("gemm_decode_packed");
    const Fit fit = blocks_that_fit(sm(target), {u.at("REG"), u.at("SHARED"), 0, 256});
    EXPECT_EQ(fit.blocks, 1);
    EXPECT_EQ(fit.limited_by, "registers");
    EXPECT_LT(fit.blocks, 2) << "a kernel publishing 2 blocks per SM would pass";
  }
}

// gemm_fused: 384 threads of 168 registers (5376 a warp: 3 warps a sub-partition, 12 the SM) and
// 2112 + 168960 + 1024 reserved bytes of shared memory (172160 allocated, one in 228 KiB).
TEST(Occupancy, TheFusedKernelFitsOneBlock) {
  const auto& u = parse_res_usage(kResUsage).at("sm_90a").at("gemm_fused");
  const Fit fit = blocks_that_fit(sm("sm_90a"), {u.at("REG"), u.at("SHARED"), 168960, 384});
  EXPECT_EQ(fit.blocks, 1);
  // With 32 registers (5 blocks by registers and by threads): still one, by shared memory.
  const Fit small = blocks_that_fit(sm("sm_90a"), {32, u.at("SHARED"), 168960, 384});
  EXPECT_EQ(small.blocks, 1);
  EXPECT_EQ(small.limited_by, "shared memory");
}

// Each limit alone holds a planted kernel below what it would publish.
TEST(Occupancy, EachLimitHoldsAPlantedKernel) {
  struct Case {
    const char* target;
    BlockResources block;
    long blocks;
    const char* limit;
  };
  const Case cases[] = {
      // Small blocks: the SM's block slots (24 on sm_89, 32 on sm_90a).
      {"sm_89", {16, 0, 0, 32}, 24, "blocks"},
      {"sm_90a", {16, 0, 0, 32}, 32, "blocks"},
      // 1024 threads: one block in sm_89's 1536, two in sm_90a's 2048.
      {"sm_89", {16, 0, 0, 1024}, 1, "threads"},
      {"sm_90a", {16, 0, 0, 1024}, 2, "threads"},
      // 128 registers x 256 threads: 32768 a block, two in 64 K; 129 rounds to 4352 a warp.
      {"sm_90a", {128, 0, 0, 256}, 2, "registers"},
      {"sm_90a", {129, 0, 0, 256}, 1, "registers"},
      // 1024 threads of 65 registers: 2304 a warp, 73728 the block, past the 64 K file.
      {"sm_80", {65, 0, 0, 1024}, 0, "registers"},
      // 113 KiB + 1 KiB reserved: two in sm_90a's 228 KiB, one in sm_80's 164 KiB.
      {"sm_90a", {32, 0, 113 * 1024, 128}, 2, "shared memory"},
      {"sm_80", {32, 0, 113 * 1024, 128}, 1, "shared memory"},
      // 100 KiB dynamic: past sm_89's 99 KiB a block, so none.
      {"sm_89", {32, 0, 100 * 1024, 128}, 0, "shared memory"},
      // Static shared memory counts as well: 1 byte past 227 KiB with the dynamic part.
      {"sm_90a", {32, 1, 227 * 1024, 128}, 0, "shared memory"},
      {"sm_90a", {32, 0, 227 * 1024, 128}, 1, "shared memory"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.target << " REG " << c.block.registers_per_thread
                                      << " SHARED " << c.block.static_shared << " + "
                                      << c.block.dynamic_shared << " threads " << c.block.threads);
    const Fit fit = blocks_that_fit(sm(c.target), c.block);
    EXPECT_EQ(fit.blocks, c.blocks);
    EXPECT_EQ(fit.limited_by, c.limit);
  }
}

TEST(Occupancy, UnknownTargetsHaveNoLimits) {
  EXPECT_EQ(sm_limits("sm_75"), nullptr);
  EXPECT_EQ(sm_limits("sm_90"), nullptr);  // the modules build sm_90a; a plain sm_90 is new
  EXPECT_NE(sm_limits("sm_86"), nullptr);
}

}  // namespace
}  // namespace metrale::offline
