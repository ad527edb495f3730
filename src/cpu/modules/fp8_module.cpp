// Module "fp8" on the CPU: the W8A8 op's activation cast (cast_e4m3_block128), with the same
// published metadata fields as the GPU module (src/cuda/kernels/fp8.cu). One grid block covers
// n_tile (row, 128-K block) pairs.
#include <algorithm>
#include <string>

#include "cpu/kernels/fp8_cpu.h"
#include "cpu/modules/modules.h"
#include "kernels/fp8_cast.h"
#include "kernels/verified_devices.h"
#include "metrale/kernel_args.h"

namespace metrale::cpu {
namespace {

// Pairs per block: a pair is at most 128 elements, so a block is a few thousand of them, enough
// to pay for one host call (the GPU module publishes its own tile: a warp per pair).
constexpr std::uint32_t kCastTile = 64;
constexpr std::uint32_t kBlockThreads = 256;  // the shape the launch checks see, as on the GPU

void cast_e4m3_block128(const HostBlock& b) {
  const auto p = read_param<Fp8CastParams>(b.params, 0);
  const std::int64_t pairs =
      p.m * ((p.k + metrale::fp8::kCastBlock - 1) / metrale::fp8::kCastBlock);
  const std::int64_t i0 = std::int64_t{b.block_idx.x} * kCastTile;
  const std::int64_t i1 = std::min<std::int64_t>(pairs, i0 + kCastTile);
  if (i0 < i1) fp8::cast_e4m3_block128(p, i0, i1);
}

}  // namespace

HostModule make_fp8_module() {
  HostModule m("fp8");
  const std::string e = "cast_e4m3_block128";
  m.add_kernel(e, cast_e4m3_block128, {static_cast<std::uint16_t>(sizeof(Fp8CastParams))});
  m.publish_u32(e + "_n_tile", kCastTile).publish_u32(e + "_block_threads", kBlockThreads);
  m.publish_u32(e + "_verified_on", verified::kHostReference);  // the reference itself
  return m;
}

}  // namespace metrale::cpu
