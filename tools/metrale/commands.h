// The metrale CLI's commands. Each returns the process exit code: 0 ok, 1 a check failed,
// 2 bad usage or input, 130 (kInterrupted) a bench stopped by Ctrl-C.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace metrale::cli {

struct CommonOptions {
  std::string backend = "auto";  // auto, cpu or cuda
  bool json = false;             // one JSON document on stdout instead of tables
};

// Lists every backend, its availability (or the reason it is unavailable), and the loaded
// modules with each kernel's published metadata.
int run_info(const CommonOptions& options);

struct BenchOptions {
  std::string model = "llama3-8b";                            // built-in shape table
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes;  // N×K pairs instead of a model
  std::string weights;           // a safetensors file: its linear layers instead of random ones
  std::vector<std::int64_t> ms;  // rows of A; empty: per device
  bool graph = false;            // replay each GEMM as a graph
  bool allow_e4m3 = false;       // let GEMMs with M >= 64 cast A to E4M3 (the e4m3 route)
  int repeats = 7;               // timed runs after the warm-up
  // Every route side by side with the dense BF16 baseline; unset: on a GPU only.
  std::optional<bool> compare_routes;
  // Upload in the source layout even where the backend prefers the panel layout (to compare).
  bool source_layout = false;
  int tp = 0;  // --tp: ranks of a tensor-parallel run (one process each, under mpirun); 0: none
  std::string moe;  // --moe: a built-in MoE layer instead of dense layers (bench_moe.h)
  std::vector<double> skews{0.0, 1.2};  // --skew: routings' skews above one token
  bool allow_unverified = false;        // --allow-unverified: run kernels no device run verified
  std::string moe_route = "auto";       // --moe-route: auto, decode, fused (4-bit), tiled (FP8)
};

// One transformer block's linear layers on the chosen backend: checked against float64, timed
// against roofs measured in the same run, torn down to zero live bytes.
int run_bench(const CommonOptions& options, const BenchOptions& bench);

// The block split over bench.tp ranks (this process one of them, started by mpirun):
// column- and row-parallel layers, each phase timed (compute, communication) against rank 0
// running the whole layer alone, each case checked against that run, every rank torn down to
// zero bytes.
int run_bench_tp(const CommonOptions& options, const BenchOptions& bench);

struct CheckOptions {
  std::optional<std::uint64_t> seed;  // the random data's seed; unset: a fresh one, printed
};

// Runs the self-check on the chosen backend: every op end to end against a float64 reference,
// capture and replay, scratch, and a teardown that must leave zero live bytes and nothing for
// the ledger sweep to free. Prints its seed: the same seed gives the same data.
int run_check(const CommonOptions& options, const CheckOptions& check);

}  // namespace metrale::cli
