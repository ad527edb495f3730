// Module "blas" on the CPU: the dense GEMMs CpuBackend::run_dense_gemm launches, one kernel per
// DenseKind, so a dense GEMM is ordered, captured and fault-injected like any other launch. One
// grid block covers one tile of output columns.
#include <algorithm>
#include <string>

#include "cpu/kernels/dense_bf16.h"
#include "cpu/kernels/dense_e4m3.h"
#include "cpu/modules/modules.h"
#include "kernels/dense_params.h"
#include "kernels/verified_devices.h"
#include "metrale/kernel_args.h"

namespace metrale::cpu {
namespace {

constexpr std::uint32_t kDenseTile = 64;  // columns of C per block
constexpr std::uint32_t kBlockThreads = 256;

void gemm_bf16(const HostBlock& b) {
  const auto p = read_param<DenseParams>(b.params, 0);
  const std::int64_t n0 = std::int64_t{b.block_idx.x} * kDenseTile;
  const std::int64_t n1 = std::min<std::int64_t>(p.n, n0 + kDenseTile);
  if (n0 < n1) blas::gemm_bf16(p, n0, n1);
}

void gemm_e4m3_block128(const HostBlock& b) {
  const auto p = read_param<DenseParams>(b.params, 0);
  const std::int64_t n0 = std::int64_t{b.block_idx.x} * kDenseTile;
  const std::int64_t n1 = std::min<std::int64_t>(p.n, n0 + kDenseTile);
  if (n0 < n1) blas::gemm_e4m3_block128_best(p, n0, n1);
}

void add(HostModule& m, const std::string& name, HostKernelFn fn) {
  m.add_kernel(name, fn, {static_cast<std::uint16_t>(sizeof(DenseParams))});
  m.publish_u32(name + "_n_tile", kDenseTile).publish_u32(name + "_block_threads", kBlockThreads);
  m.publish_u32(name + "_verified_on", verified::kHostReference);  // the reference itself
}

}  // namespace

HostModule make_blas_module() {
  HostModule m("blas");
  add(m, "gemm_bf16", gemm_bf16);
  add(m, "gemm_e4m3_block128", gemm_e4m3_block128);
  return m;
}

}  // namespace metrale::cpu
