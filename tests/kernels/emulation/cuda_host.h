// CUDA C++ on the host, as much as the decode kernels' own sources use, so that g++ or clang
// compile them unchanged and run a grid block by block, each block's threads as fibers
// (fibers.h): threadIdx and blockIdx, __syncthreads, __shared__ (static: one block runs at a
// time), __ldg, the vector types (CUDA's own host headers), and a warp's m16n8k16 MMA computed
// from its 32 lanes' registers by the PTX ISA's fragment rules. Every load through __ldg or
// ptx::ldg* is checked against the buffers the test declares readable and for its alignment.
// Include it first, in a translation unit built with METRALE_KERNEL_HOST_EMULATION (ptx.cuh
// then takes kernel_host_ptx.h).
#pragma once

#if !defined(METRALE_KERNEL_HOST_EMULATION) || defined(__CUDACC__)
#error "cuda_host.h is for host builds with METRALE_KERNEL_HOST_EMULATION defined"
#endif

// Before CUDA's headers, which keep a definition they find.
#define __host__
#define __device__
#define __global__
#define __shared__ static

#include <cuda_bf16.h>
#include <vector_functions.h>
#include <vector_types.h>

#undef __forceinline__
#define __forceinline__ inline

#include <cmath>  // ldexpf
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fibers.h"
#include "sm90_host.h"

namespace metrale::emulation {

// A buffer the kernel may read.
struct Region {
  const void* begin = nullptr;
  std::size_t bytes = 0;
};

inline constexpr int kMaxWarps = 32;

// One warp's MMA exchange: each lane's A and B registers, double-buffered by the parity of the
// lane's MMA count (a lane cannot reach MMA n + 2 before every lane has read MMA n).
struct WarpState {
  Barrier sync{32};
  std::uint32_t a[2][32][4] = {};
  std::uint32_t b[2][32][2] = {};
  int parity[32] = {};
};

// The grid being run: its size, the block's index, its barrier, its warps, what it may read.
struct GridState {
  dim3 grid{1, 1, 1};
  uint3 block{0, 0, 0};
  Barrier block_sync;
  WarpState warps[kMaxWarps];
  std::vector<Region> readable;
};

inline GridState& grid_state() {
  static GridState g;
  return g;
}

// The running thread's index in its block (blocks are one-dimensional here).
inline uint3 thread_index() {
  return uint3{static_cast<unsigned>(current_fiber()), 0u, 0u};
}

// Whether [p, p + bytes) lies inside a readable buffer and p is aligned to `align` (what the
// device's load instruction requires); records a fault where not (the load then reads zeros).
inline bool check_load(const void* p, std::size_t bytes, std::size_t align, const char* what) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  if (at % align != 0) {
    fault(std::string(what) + ": a misaligned load at " + std::to_string(at));
    return false;
  }
  for (const Region& r : grid_state().readable) {
    const auto b = reinterpret_cast<std::uintptr_t>(r.begin);
    if (at >= b && at + bytes <= b + r.bytes) return true;
  }
  fault(std::string(what) + ": a load of " + std::to_string(bytes) + " bytes at " +
        std::to_string(at) + " outside every readable buffer (thread " +
        std::to_string(current_fiber()) + ", block " + std::to_string(grid_state().block.x) + "," +
        std::to_string(grid_state().block.z) + ")");
  return false;
}

// BF16 half `half` of a register as float.
inline float bf16_half(std::uint32_t reg, int half) {
  std::uint32_t bits = (reg >> (16 * half)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d = A · B + d, as the calling lane sees
// it: every lane leaves its registers, the warp meets, and each lane computes its own four D
// elements from the 32 lanes' fragments (lane = 4 g + t). A: reg 0 row g, k 2t and 2t + 1 (low
// half first); reg 1 row g + 8, same k; reg 2 row g, k 2t + 8, 2t + 9; reg 3 row g + 8, those k.
// B: b0 k 2t, 2t + 1, column g; b1 k 2t + 8, 2t + 9. D: d0, d1 row g, columns 2t, 2t + 1; d2,
// d3 row g + 8. Products of BF16 are exact in FP32; the sum runs in FP32 in k order.
inline void warp_mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                     std::uint32_t b1) {
  const int tid = current_fiber();
  WarpState& w = grid_state().warps[tid / 32];
  const int lane = tid % 32, par = w.parity[lane];
  w.parity[lane] ^= 1;
  for (int j = 0; j < 4; ++j) w.a[par][lane][j] = a[j];
  w.b[par][lane][0] = b0;
  w.b[par][lane][1] = b1;
  wait_at(w.sync);
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float sum = d[i];
    for (int kk = 0; kk < 16; ++kk) {
      const int a_lane = 4 * (row % 8) + (kk % 8) / 2,
                a_reg = (row >= 8 ? 1 : 0) + (kk >= 8 ? 2 : 0);
      const int b_lane = 4 * col + (kk % 8) / 2, b_reg = kk >= 8 ? 1 : 0;
      sum +=
          bf16_half(w.a[par][a_lane][a_reg], kk % 2) * bf16_half(w.b[par][b_lane][b_reg], kk % 2);
    }
    d[i] = sum;
  }
}

// Runs body() as every thread of every block of `grid` (x fastest, then y, then z), blocks one
// after another, `threads` fibers a block; `readable` the buffers the kernel may load from.
// Returns "" or the first fault or deadlock, naming the block.
inline std::string run_grid(dim3 grid, int threads, std::vector<Region> readable,
                            std::function<void()> body) {
  GridState& g = grid_state();
  g.readable = std::move(readable);
  g.grid = grid;
  const auto run = [](int, void* f) { (*static_cast<std::function<void()>*>(f))(); };
  set_progress([](bool force) { return sm90_progress(force); });
  sm90_begin_grid();
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        g.block = uint3{x, y, z};
        g.block_sync = Barrier{threads};
        for (WarpState& w : g.warps) w = WarpState{};
        sm90_begin_block();
        std::string error = run_fibers(threads, run, &body);
        if (error.empty()) error = sm90_end_block();
        if (!error.empty()) {
          return "block (" + std::to_string(x) + ", " + std::to_string(y) + ", " +
                 std::to_string(z) + "): " + error;
        }
      }
    }
  }
  g.readable.clear();
  return "";
}

}  // namespace metrale::emulation

#define threadIdx (::metrale::emulation::thread_index())
#define blockIdx (::metrale::emulation::grid_state().block)
#define gridDim (::metrale::emulation::grid_state().grid)

inline void __syncthreads() {
  ::metrale::emulation::wait_at(::metrale::emulation::grid_state().block_sync);
}

// The warp's lanes meet (every lane of the calling warp must call it).
inline void __syncwarp(unsigned = 0xFFFFFFFFu) {
  ::metrale::emulation::wait_at(
      ::metrale::emulation::grid_state().warps[::metrale::emulation::current_fiber() / 32].sync);
}

// A read-only load: a plain one, checked.
template <class T>
T __ldg(const T* p) {
  T v{};
  if (::metrale::emulation::check_load(p, sizeof(T), alignof(T), "__ldg")) {
    std::memcpy(&v, p, sizeof(T));
  }
  return v;
}
