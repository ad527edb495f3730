// The roofs a benchmark is measured against, measured on this machine in the same run: memory
// bandwidth (what decode GEMMs can reach) and a compute rate (what prefill GEMMs can reach).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "metrale/backend.h"

namespace metrale::toolkit {

struct Roofline {
  double bandwidth = 0;      // bytes per second
  std::string bandwidth_of;  // what was measured, for the report
  double flops = 0;          // FLOP per second; 0 when not measured
  std::string flops_of;
};

// CPU: a multi-threaded read of a buffer larger than the caches (on huge pages), and FP32 FMAs
// (BF16 dot products on AVX-512 BF16 processors, as the kernels use) in registers on every thread.
// CUDA: a device-to-device copy (bytes read + written) and cuBLASLt's BF16 GEMM rate
// (toolkit/blas_roof.h; flops is 0, with the reason in flops_of, where cuBLASLt cannot be loaded
// or run).
Roofline measure_roofline(Backend& backend);
// The CPU read of measure_roofline, one read at a time, for benchmarks that pair each timed
// stretch of a kernel with a read of the same size (the ratio then shares the machine's moment).
class CpuReadProbe {
 public:
  static constexpr std::size_t kBytes = std::size_t{512} << 20;  // far beyond any cache
  // Allocates and touches the buffer (on huge pages).
  CpuReadProbe();
  // Bytes per second of one multi-threaded read of the whole buffer; 0 if it was not allocated.
  double read() const;

 private:
  std::size_t words_;
  std::unique_ptr<std::uint64_t, decltype(&std::free)> buf_;
};

// The bandwidth half of measure_roofline alone (bytes per second), cheap enough to measure next
// to every benchmark case on a machine whose bandwidth drifts with other tenants.
double measure_bandwidth(Backend& backend);

// The CPU's compute half of measure_roofline alone (FLOP per second of every thread, with the
// instructions of the set the CPU kernels use, cpu_kernel_isa; 0 for portable code), what was
// measured in *of (not null): for benchmarks that pair each timed stretch of a compute-bound
// kernel with a reading of the roof.
double measure_cpu_compute(std::string* of);

// The compute half of measure_roofline alone, on either backend (FLOP per second; 0 where not
// measured, with the reason in *of, not null): for a benchmark that reads the roof again between
// its timed stretches and keeps the highest reading (toolkit/roof_share.h).
double measure_compute(Backend& backend, std::string* of);

}  // namespace metrale::toolkit
