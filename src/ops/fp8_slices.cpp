// Cutting block-scaled E4M3 weights along N or K at 128-block edges: the codes' rows or columns
// and the scales' block rows or block columns, copied into a new host shard.
#include "metrale/ops/fp8_slices.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <string_view>

#include "metrale/dense_gemm.h"
#include "metrale/error.h"

namespace metrale::ops {
namespace {

// The sizes of W and the range [begin, end) along a dimension of `extent`.
void check_slice(std::string_view api, std::size_t codes, std::size_t scales, std::int64_t n,
                 std::int64_t k, std::string_view dim, std::int64_t extent, std::int64_t begin,
                 std::int64_t end) {
  if (n < 1 || k < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("W is {} x {}; both must be at least 1", n, k));
  }
  const auto un = static_cast<std::uint64_t>(n), uk = static_cast<std::uint64_t>(k);
  std::uint64_t need = 0;
  if (__builtin_mul_overflow(un, uk, &need) || codes != need) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("the codes are {} bytes; E4M3 {}x{} needs {}", codes, n, k, n * k));
  }
  const auto blocks = static_cast<std::uint64_t>(dense_scale_blocks(n)) *
                      static_cast<std::uint64_t>(dense_scale_blocks(k));
  if (scales != blocks * 4) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("the scales are {} bytes; {}x{} has {} blocks of 128 x 128, {} bytes "
                            "of FP32",
                            scales, n, k, blocks, blocks * 4));
  }
  if (begin < 0 || end > extent || begin >= end) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} range [{}, {}) is not a non-empty range inside [0, {})", dim, begin,
                            end, extent));
  }
  for (const std::int64_t edge : {begin, end}) {
    if (edge % kDenseScaleBlock != 0 && edge != extent) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("{} edge {} is inside a 128-block (neither a multiple of 128 nor "
                              "{} = {}): its block's scale would be shared by two shards",
                              dim, edge, dim, extent));
    }
  }
}

}  // namespace

HostFp8Weights slice_fp8_rows(std::span<const std::uint8_t> codes,
                              std::span<const std::uint8_t> scales, std::int64_t n, std::int64_t k,
                              std::int64_t begin, std::int64_t end) {
  check_slice("slice_fp8_rows", codes.size(), scales.size(), n, k, "N", n, begin, end);
  HostFp8Weights out;
  out.n = end - begin;
  out.k = k;
  const auto uk = static_cast<std::size_t>(k);
  out.codes.assign(
      codes.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(begin) * uk),
      codes.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(end) * uk));
  // Whole block rows: begin is on a block edge, and end on one or at N.
  const auto row_bytes = static_cast<std::size_t>(dense_scale_blocks(k)) * 4;
  const auto b0 = static_cast<std::size_t>(begin / kDenseScaleBlock),
             b1 = static_cast<std::size_t>(dense_scale_blocks(end));
  out.scales.assign(scales.begin() + static_cast<std::ptrdiff_t>(b0 * row_bytes),
                    scales.begin() + static_cast<std::ptrdiff_t>(b1 * row_bytes));
  return out;
}

HostFp8Weights slice_fp8_columns(std::span<const std::uint8_t> codes,
                                 std::span<const std::uint8_t> scales, std::int64_t n,
                                 std::int64_t k, std::int64_t begin, std::int64_t end) {
  check_slice("slice_fp8_columns", codes.size(), scales.size(), n, k, "K", k, begin, end);
  HostFp8Weights out;
  out.n = n;
  out.k = end - begin;
  const auto uk = static_cast<std::size_t>(k), width = static_cast<std::size_t>(end - begin);
  out.codes.reserve(static_cast<std::size_t>(n) * width);
  for (std::int64_t r = 0; r < n; ++r) {
    const auto at = codes.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * uk +
                                                                static_cast<std::size_t>(begin));
    out.codes.insert(out.codes.end(), at, at + static_cast<std::ptrdiff_t>(width));
  }
  const auto kblocks = static_cast<std::size_t>(dense_scale_blocks(k));
  const auto b0 = static_cast<std::size_t>(begin / kDenseScaleBlock),
             b1 = static_cast<std::size_t>(dense_scale_blocks(end));
  for (std::size_t br = 0; br < static_cast<std::size_t>(dense_scale_blocks(n)); ++br) {
    const auto at = scales.begin() + static_cast<std::ptrdiff_t>((br * kblocks + b0) * 4);
    out.scales.insert(out.scales.end(), at, at + static_cast<std::ptrdiff_t>((b1 - b0) * 4));
  }
  return out;
}

}  // namespace metrale::ops
