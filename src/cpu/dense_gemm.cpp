// CpuBackend's dense GEMMs: the kernels of its "blas" host module, one per DenseKind, launched
// like any other kernel (so streams, captures and injected faults treat them alike). Nothing to
// choose per shape, so a plan is the kernel's name and needs no workspace.
#include <fmt/format.h>

#include <array>

#include "cpu/kernels/w4a16_cpu.h"
#include "kernels/dense_params.h"
#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale {
namespace {

constexpr std::string_view kModule = "blas";

std::string_view kernel_of(DenseKind kind) {
  return kind == DenseKind::kBf16 ? "gemm_bf16" : "gemm_e4m3_block128";
}

}  // namespace

std::string CpuBackend::dense_gemm_unavailable(DenseKind kind) const {
  if (has_kernel(kModule, kernel_of(kind))) return {};
  return fmt::format("the cpu backend's modules have no {}::{} (the {} dense GEMM)", kModule,
                     kernel_of(kind), to_string(kind));
}

DenseGemmPlan CpuBackend::plan_dense_gemm_checked(const DenseGemmShape& shape) {
  DenseGemmPlan p;
  p.shape = shape;
  // Which body the kernel runs (modules/blas_module.cpp): the block-scaled FP8 one is vectorized
  // on AVX-512 BF16, the BF16 one is the reference everywhere.
  const bool vector = shape.kind == DenseKind::kE4m3Block128 &&
                      cpu::w4a16::best_isa() == cpu::w4a16::Isa::kAvx512Bf16;
  p.describe = fmt::format("cpu {} {}::{}", vector ? "avx512_bf16" : "reference", kModule,
                           kernel_of(shape.kind));
  return p;
}

void CpuBackend::run_dense_gemm_checked(const DenseGemmPlan& plan, const DenseGemmArgs& args,
                                        StreamHandle stream) {
  const ResolvedKernel& k = op_cache().kernel(*this, kModule, kernel_of(plan.shape.kind));
  const std::uint64_t tile = kernel_n_tile(k);
  const auto blocks = (static_cast<std::uint64_t>(plan.shape.n) + tile - 1) / tile;
  if (blocks > 0x7FFFFFFFu) {
    throw Error(ErrorCode::kInvalidArgument, "run_dense_gemm",
                fmt::format("N = {} needs {} blocks of {}; one launch holds at most 2^31 - 1",
                            plan.shape.n, blocks, tile));
  }
  DenseParams p;
  p.a = args.a.address();
  p.b = args.b.address();
  p.c = args.c.address();
  p.bias = args.bias.address();
  p.a_scales = args.a_scales.address();
  p.b_scales = args.b_scales.address();
  p.m = plan.shape.m;
  p.n = plan.shape.n;
  p.k = plan.shape.k;
  p.out_f32 = plan.shape.out_f32 ? 1u : 0u;
  launch_typed(k.handle, Dim3{static_cast<std::uint32_t>(blocks)}, Dim3{k.meta.block_threads}, 0,
               stream, std::array{KernelArg::value(p)});
}

}  // namespace metrale
