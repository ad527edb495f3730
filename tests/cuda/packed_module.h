// The w4a16 module with a fake gemm_decode_packed (its kernel emulated over the launched grid,
// fake_gemm.h) and the values it publishes: shared by the tests that run packed decode GEMMs on
// the fake driver (gemm_packed_launch_test.cpp, foreign_stream_test.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/fake_gemm.h"
#include "cuda/rig.h"
#include "kernels/decode_layout.h"
#include "kernels/gemm_params.h"
#include "kernels/verified_devices.h"
#include "metrale/numerics.h"

namespace metrale::cuda::testing {

// Small and unlike the real kernel's 32 columns and 1024 K, so that several blocks, slices and
// a partial last slice appear on small shapes, and a grid sized from the layout's tile is caught.
inline constexpr std::uint32_t kPackedTile = 12, kPackedSplit = 96, kReduceTile = 128;
inline constexpr std::uint32_t kPackedThreads = 160;
// Unlike the real kernel's 1 and the old constant target of 2.
inline constexpr std::uint32_t kPackedBlocksPerSm = 3;

// W[n, k] as gemm_decode_packed computes it from the packed buffers, tensor scale not included.
inline float packed_weight_of(const GemmParams& p, std::int64_t n, std::int64_t k) {
  const std::uint16_t bits =
      decode_layout::weight_bits(at<const std::uint8_t>(p.codes), at<const std::uint8_t>(p.scales),
                                 n, k, decode_layout::k_blocks(p.k), (p.flags & kGemmMxfp4) != 0);
  return std::ldexp(num::bf16_to_f32(bits), p.weight_fold);
}

// gemm_decode_packed: block (x, z) of the launched grid computes its kPackedTile columns over K
// slice z (fake_gemm.h). Without kGemmDecodePacked (or with a source-layout flag) it writes
// nothing: the buffers are not in a layout it reads.
inline FakeFunction packed_decode() {
  return fake_split_decode(kPackedTile, packed_weight_of, [](const GemmParams& p) {
    return (p.flags & kGemmDecodePacked) != 0 && (p.flags & kGemmTransposed) == 0;
  });
}

struct Published {
  std::uint32_t n_tile = kPackedTile, split_k = kPackedSplit, threads = kPackedThreads;
  std::uint32_t layout = decode_layout::kLayoutId, max_m = 16, blocks_per_sm = kPackedBlocksPerSm;
  bool with_packed = true;
  // gemm_decode_packed_verified(_on): as if a device run had verified the kernel, so that uploads
  // following the backend's preference take its layout (ops/quant_weights.cpp).
  bool verified = true;
};

// The w4a16 module: gemm_decode (for source weights; no body, never launched here),
// gemm_split_reduce and, unless left out, gemm_decode_packed publishing `pub`.
inline ModuleSpec packed_module(const Published& pub = {}) {
  ModuleSpec m;
  m.name = "w4a16";
  m.fake.functions["gemm_decode"] = FakeFunction{{}, {sizeof(GemmParams)}};
  m.fake.functions["gemm_split_reduce"] = fake_split_reduce(kReduceTile);
  m.fake.publish_u32("gemm_decode_n_tile", 8)
      .publish_u32("gemm_decode_max_m", 16)
      .publish_u32("gemm_decode_block_threads", 256)
      .publish_u32("gemm_split_reduce_n_tile", kReduceTile)
      .publish_u32("gemm_split_reduce_block_threads", 256);
  m.entries = {"gemm_decode", "gemm_split_reduce"};
  if (pub.with_packed) {
    m.fake.functions["gemm_decode_packed"] = packed_decode();
    m.fake.publish_u32("gemm_decode_packed_n_tile", pub.n_tile)
        .publish_u32("gemm_decode_packed_split_k", pub.split_k)
        .publish_u32("gemm_decode_packed_block_threads", pub.threads)
        .publish_u32("gemm_decode_packed_layout", pub.layout)
        .publish_u32("gemm_decode_packed_max_m", pub.max_m)
        .publish_u32("gemm_decode_packed_blocks_per_sm", pub.blocks_per_sm);
    if (pub.verified) {
      m.fake.publish_u32("gemm_decode_packed_verified", 20261129)
          .publish_u32("gemm_decode_packed_verified_on", metrale::verified::kH200);
    }
    m.entries.push_back("gemm_decode_packed");
  }
  return m;
}

}  // namespace metrale::cuda::testing
