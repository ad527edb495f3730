// The source of planted_wgmma_serialized.ptxas.log, never built: each sm_90a entry breaks the
// wgmma pipeline in one way ptxas answers by serializing it, so that the log carries ptxas's
// own advisories for cuda.kernels_wgmma_not_serialized_planted. On sm_80 and sm_89 the entries
// are empty, as the real modules' sm_90a-only entries are. Regenerate the log with
//   nvcc -fatbin -std=c++17 -O3 -Xptxas -v -Isrc -gencode arch=compute_80,code=sm_80
//     -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90a,code=sm_90a
//     -o /dev/null tests/cuda/planted_wgmma_serialized.cu
// (from the repository root; nvcc prints the report on stderr).
#include <cstdint>

#include "cuda/kernels/ptx.cuh"

#if defined(METRALE_HAVE_WGMMA)
namespace ptx = metrale::ptx;

// wgmma issued in a function that is not inlined and waited for in its caller.
__device__ __noinline__ void planted_issue(float (&d)[32], std::uint64_t da, std::uint64_t db) {
  ptx::wgmma_fence();
  ptx::wgmma_e4m3_m64n64k32(d, da, db, 1);
  ptx::wgmma_commit();
}
#endif

extern "C" __global__ void planted_clean(float* out, int k) {
  out[threadIdx.x] = k;
}

// The RS form's A registers are rewritten while the wgmma that reads them is in flight.
extern "C" __global__ void planted_rs_input_rewritten(float* out, const std::uint32_t* in,
                                                      std::uint64_t db, int k) {
#if defined(METRALE_HAVE_WGMMA)
  float d[64] = {};
  std::uint32_t a[4];
  for (int j = 0; j < 4; ++j) a[j] = in[threadIdx.x * 4 + j];
  for (int i = 0; i < k; ++i) {
    ptx::wgmma_fence();
    ptx::wgmma_bf16_m64n128k16_rs(d, a, db + i);
    ptx::wgmma_commit();
    for (int j = 0; j < 4; ++j) asm volatile("add.u32 %0, %0, 1;" : "+r"(a[j]));
    ptx::wgmma_wait<0>();
  }
  for (int j = 0; j < 64; ++j) out[threadIdx.x * 64 + j] = d[j];
#endif
}

// An accumulator is read while the wgmma that writes it is in flight.
extern "C" __global__ void planted_accumulator_read(float* out, std::uint64_t da, std::uint64_t db,
                                                    int k) {
#if defined(METRALE_HAVE_WGMMA)
  float d[32] = {};
  float s = 0;
  for (int i = 0; i < k; ++i) {
    ptx::wgmma_fence();
    ptx::wgmma_e4m3_m64n64k32(d, da + i, db + i, 1);
    ptx::wgmma_commit();
    asm volatile("add.f32 %0, %0, %1;" : "+f"(s) : "f"(d[3]));
    ptx::wgmma_wait<0>();
  }
  for (int j = 0; j < 32; ++j) out[threadIdx.x * 32 + j] = d[j];
  out[0] = s;
#endif
}

// The pipeline crosses a call: issued in planted_issue, waited for here.
extern "C" __global__ void planted_pipeline_across_call(float* out, std::uint64_t da,
                                                        std::uint64_t db, int k) {
#if defined(METRALE_HAVE_WGMMA)
  float d[32] = {};
  for (int i = 0; i < k; ++i) {
    planted_issue(d, da + i, db + i);
    ptx::wgmma_wait<0>();
  }
  for (int j = 0; j < 32; ++j) out[threadIdx.x * 32 + j] = d[j];
#endif
}

// Only half of the warpgroup issues the wgmma.
extern "C" __global__ void planted_divergent_issue(float* out, std::uint64_t da, std::uint64_t db,
                                                   int k) {
#if defined(METRALE_HAVE_WGMMA)
  float d[32] = {};
  for (int i = 0; i < k; ++i) {
    ptx::wgmma_fence();
    if (threadIdx.x < 64) ptx::wgmma_e4m3_m64n64k32(d, da + i, db + i, i);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
  }
  for (int j = 0; j < 32; ++j) out[threadIdx.x * 32 + j] = d[j];
#endif
}
