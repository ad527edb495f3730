#include "metrale/ops/elementwise.h"

#include <fmt/format.h>

#include <array>
#include <limits>

#include "core/nvtx.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "ops/published_block.h"

namespace metrale::ops {
namespace {

void check_buffer(std::string_view api, std::string_view name, DevicePtr p) {
  if (!p) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("{} is null", name));
  if (p.address() % 4 != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} = 0x{:x} is not 4-byte aligned", name, p.address()));
  }
}

void check_count(std::string_view api, std::size_t n) {
  if (n == 0 || n > std::numeric_limits<std::uint32_t>::max()) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("n = {} is outside [1, 2^32 - 1]", n));
  }
}

// Grid x from the kernel's own published tile, never from a width assumed here.
Dim3 grid_for(const Backend& backend, const ResolvedKernel& k, std::size_t n) {
  const std::uint64_t tile = backend.kernel_n_tile(k);
  return Dim3{static_cast<std::uint32_t>((n + tile - 1) / tile), 1, 1};
}

}  // namespace

void fill_u32(Backend& backend, StreamHandle stream, DevicePtr out, std::size_t n,
              std::uint32_t value) {
  const nvtx::Range range("metrale::ops::fill_u32");
  check_buffer("fill_u32", "out", out);
  check_count("fill_u32", n);
  backend.check_range("fill_u32", "out", out, std::uint64_t{n} * 4);
  const ResolvedKernel& k = backend.op_cache().kernel(backend, "core", "fill_u32");
  const std::array args{KernelArg::buffer(out), KernelArg::value(value),
                        KernelArg::value(static_cast<std::uint32_t>(n))};
  const Dim3 grid = grid_for(backend, k, n);  // first: a missing tile is named before the block
  backend.launch_typed(k, grid, published_block("fill_u32", backend, k), 0, stream, args);
}

void axpy_f32(Backend& backend, StreamHandle stream, DevicePtr y, DevicePtr x, float a,
              std::size_t n) {
  const nvtx::Range range("metrale::ops::axpy_f32");
  check_buffer("axpy_f32", "y", y);
  check_buffer("axpy_f32", "x", x);
  check_count("axpy_f32", n);
  const std::uint64_t bytes = std::uint64_t{n} * 4;
  if (x.address() < y.address() + bytes && y.address() < x.address() + bytes) {
    throw Error(ErrorCode::kInvalidArgument, "axpy_f32",
                fmt::format("x = 0x{:x} and y = 0x{:x} overlap over {} bytes", x.address(),
                            y.address(), bytes));
  }
  backend.check_range("axpy_f32", "y", y, bytes);
  backend.check_range("axpy_f32", "x", x, bytes);
  const ResolvedKernel& k = backend.op_cache().kernel(backend, "core", "axpy_f32");
  const std::array args{KernelArg::buffer(y), KernelArg::buffer(x), KernelArg::value(a),
                        KernelArg::value(static_cast<std::uint32_t>(n))};
  const Dim3 grid = grid_for(backend, k, n);
  backend.launch_typed(k, grid, published_block("axpy_f32", backend, k), 0, stream, args);
}

void cast_f32_to_bf16(Backend& backend, StreamHandle stream, DevicePtr in, DevicePtr out,
                      std::size_t n) {
  constexpr std::string_view kApi = "cast_f32_to_bf16";
  const nvtx::Range range("metrale::ops::cast_f32_to_bf16");
  check_buffer(kApi, "in", in);
  if (!out) throw Error(ErrorCode::kInvalidArgument, kApi, "out is null");
  if (out.address() % 2 != 0) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("out = 0x{:x} is not 2-byte aligned", out.address()));
  }
  check_count(kApi, n);
  const std::uint64_t in_bytes = std::uint64_t{n} * 4, out_bytes = std::uint64_t{n} * 2;
  if (in.address() < out.address() + out_bytes && out.address() < in.address() + in_bytes) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("in = 0x{:x} and out = 0x{:x} overlap", in.address(), out.address()));
  }
  backend.check_range(kApi, "in", in, in_bytes);
  backend.check_range(kApi, "out", out, out_bytes);
  const ResolvedKernel& k = backend.op_cache().kernel(backend, "core", "cast_f32_bf16");
  const std::array args{KernelArg::buffer(out), KernelArg::buffer(in),
                        KernelArg::value(static_cast<std::uint32_t>(n))};
  const Dim3 grid = grid_for(backend, k, n);
  backend.launch_typed(k, grid, published_block(kApi, backend, k), 0, stream, args);
}

}  // namespace metrale::ops
