// Module "core" on the CPU: the element-wise kernels that exercise the whole path of lookup,
// published tile, grid sizing and launch. Each block covers one tile of n_tile elements, as the
// matching GPU kernel's thread block does.
#include <algorithm>
#include <cstdint>

#include "cpu/modules/modules.h"
#include "kernels/verified_devices.h"
#include "metrale/kernel_args.h"
#include "metrale/numerics.h"

namespace metrale::cpu {
namespace {

// The GPU kernels' block size, published so the launcher reads it on either backend.
constexpr std::uint32_t kThreads = 256;
constexpr std::uint32_t kFillTile = 256;
constexpr std::uint32_t kAxpyTile = 1024;
constexpr std::uint32_t kCastTile = 1024;

template <class T>
T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address));
}

// fill_u32(out, value, n): out[i] = value for i in this block's tile.
void fill_u32(const HostBlock& b) {
  auto* out = at<std::uint32_t>(read_param<std::uint64_t>(b.params, 0));
  const auto value = read_param<std::uint32_t>(b.params, 1);
  const auto n = read_param<std::uint32_t>(b.params, 2);
  const std::uint64_t begin = std::uint64_t{b.block_idx.x} * kFillTile;
  const std::uint64_t end = std::min<std::uint64_t>(n, begin + kFillTile);
  for (std::uint64_t i = begin; i < end; ++i) out[i] = value;
}

// axpy_f32(y, x, a, n): y[i] = a * x[i] + y[i] for i in this block's tile.
void axpy_f32(const HostBlock& b) {
  auto* y = at<float>(read_param<std::uint64_t>(b.params, 0));
  const auto* x = at<const float>(read_param<std::uint64_t>(b.params, 1));
  const auto a = read_param<float>(b.params, 2);
  const auto n = read_param<std::uint32_t>(b.params, 3);
  const std::uint64_t begin = std::uint64_t{b.block_idx.x} * kAxpyTile;
  const std::uint64_t end = std::min<std::uint64_t>(n, begin + kAxpyTile);
  for (std::uint64_t i = begin; i < end; ++i) y[i] = a * x[i] + y[i];
}

// cast_f32_bf16(out, in, n): out[i] = in[i] rounded to BF16 for i in this block's tile.
void cast_f32_bf16(const HostBlock& b) {
  auto* out = at<std::uint16_t>(read_param<std::uint64_t>(b.params, 0));
  const auto* in = at<const float>(read_param<std::uint64_t>(b.params, 1));
  const auto n = read_param<std::uint32_t>(b.params, 2);
  const std::uint64_t begin = std::uint64_t{b.block_idx.x} * kCastTile;
  const std::uint64_t end = std::min<std::uint64_t>(n, begin + kCastTile);
  for (std::uint64_t i = begin; i < end; ++i) out[i] = num::f32_to_bf16(in[i]);
}

}  // namespace

HostModule make_core_module() {
  HostModule m("core");
  m.add_kernel("fill_u32", fill_u32, {8, 4, 4})
      .publish_u32("fill_u32_n_tile", kFillTile)
      .publish_u32("fill_u32_block_threads", kThreads)
      .publish_u32("fill_u32_verified_on", verified::kHostReference);
  m.add_kernel("axpy_f32", axpy_f32, {8, 8, 4, 4})
      .publish_u32("axpy_f32_n_tile", kAxpyTile)
      .publish_u32("axpy_f32_block_threads", kThreads)
      .publish_u32("axpy_f32_verified_on", verified::kHostReference);
  m.add_kernel("cast_f32_bf16", cast_f32_bf16, {8, 8, 4})
      .publish_u32("cast_f32_bf16_n_tile", kCastTile)
      .publish_u32("cast_f32_bf16_block_threads", kThreads)
      .publish_u32("cast_f32_bf16_verified_on", verified::kHostReference);
  return m;
}

}  // namespace metrale::cpu
