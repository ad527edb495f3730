// A tensor-parallel rank's shard of block-scaled E4M3 weights on the host, in the layout
// Fp8WeightsResource takes (metrale/ops/fp8_gemm.h): codes row-major [N, K], scales FP32
// row-major [ceil(N/128), ceil(K/128)], one per 128 x 128 block. A shard's edges lie on the
// 128-blocks (or at the end of the dimension), so every block keeps its own scale.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace metrale::ops {

// E4M3 weights [n, k] with their scales, as host bytes.
struct HostFp8Weights {
  std::int64_t n = 0, k = 0;
  std::vector<std::uint8_t> codes;   // n · k bytes
  std::vector<std::uint8_t> scales;  // 4 · ceil(n/128) · ceil(k/128) bytes, FP32
};

// Rows [begin, end) of W (a column-parallel rank's shard, N split). Error(kInvalidArgument)
// naming the bad value for sizes that do not match n × k, a range outside [0, n], or an edge
// that is neither a multiple of 128 nor n.
HostFp8Weights slice_fp8_rows(std::span<const std::uint8_t> codes,
                              std::span<const std::uint8_t> scales, std::int64_t n, std::int64_t k,
                              std::int64_t begin, std::int64_t end);

// Columns [begin, end) of W (a row-parallel rank's shard, K split); the same rules along K.
HostFp8Weights slice_fp8_columns(std::span<const std::uint8_t> codes,
                                 std::span<const std::uint8_t> scales, std::int64_t n,
                                 std::int64_t k, std::int64_t begin, std::int64_t end);

}  // namespace metrale::ops
