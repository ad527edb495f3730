// metrale: inspect the runtime's backends and check them.
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "bench_moe.h"
#include "commands.h"
#include "metrale/error.h"

namespace {

// Exit code of a command that threw code: 2 when the user can fix the call (a bad option value,
// a backend this machine lacks, an input file that cannot be read or is malformed), else 1.
int exit_code(metrale::ErrorCode code) {
  using metrale::ErrorCode;
  return code == ErrorCode::kInvalidArgument || code == ErrorCode::kUnavailable ||
                 code == ErrorCode::kIo
             ? 2
             : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"metrale: a GPU runtime for quantized LLM inference"};
  app.require_subcommand(1);
  app.footer(
      "Examples:\n"
      "  metrale info                 backends, devices, modules and kernel metadata\n"
      "  metrale info --json          the same as one JSON document\n"
      "  metrale check --backend cpu  run the self-check on the CPU backend\n"
      "  metrale bench                Llama-3 8B's GEMMs on the best device, checked and timed\n"
      "  metrale bench --model llama3-70b --m 1,16 --json\n"
      "  metrale bench --shapes 4096x4096,28672x4096 --graph\n"
      "Exit codes: 0 ok, 1 a check failed, 2 bad usage or input, 130 bench stopped by Ctrl-C\n"
      "(after the case it was timing, with the model torn down).");

  metrale::cli::CommonOptions opts;
  auto add_common = [&](CLI::App* cmd) {
    cmd->add_option("--backend", opts.backend, "auto (CUDA when available, else CPU), cpu, cuda")
        ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
    cmd->add_flag("--json", opts.json, "print one JSON document for scripts");
  };
  CLI::App* info = app.add_subcommand("info", "list backends, modules and kernel metadata");
  add_common(info);
  CLI::App* check = app.add_subcommand("check", "self-check the chosen backend");
  add_common(check);
  metrale::cli::CheckOptions check_opts;
  std::uint64_t seed = 0;
  CLI::Option* seed_opt = check->add_option(
      "--seed", seed, "seed of the random data (check prints the one it used), to rerun a failure");
  metrale::cli::BenchOptions bench_opts;
  std::vector<std::string> shapes;
  CLI::App* bench = app.add_subcommand("bench", "time a model's GEMMs against the roofline");
  add_common(bench);
  bench->add_option("--model", bench_opts.model, "built-in shapes")
      ->check(CLI::IsMember({"llama3-8b", "llama3-70b"}));
  bench->add_option("--shapes", shapes, "N x K pairs instead of a model, e.g. 4096x4096,8192x4096")
      ->delimiter(',');
  bench->add_option("--m", bench_opts.ms, "rows of A, e.g. 1,16,4096")->delimiter(',');
  bench
      ->add_option("--weights", bench_opts.weights,
                   "a safetensors file, a sharded checkpoint's model.safetensors.index.json, or a "
                   "model folder holding either: bench its FP4 (ModelOpt NVFP4, compressed-tensors "
                   "NVFP4/MXFP4), FP8 block-128 or BF16 linear layers (with --tp: an index)")
      ->check(CLI::ExistingPath);
  bench->add_flag(
      "--allow-e4m3", bench_opts.allow_e4m3,
      "allow routes that cast A to E4M3 (auto takes one only where a module offers it)");
  bench->add_flag("--graph", bench_opts.graph, "capture each GEMM once and replay it as a graph");
  CLI::Option* compare_routes =
      bench->add_flag("--compare-routes,!--no-compare-routes", bench_opts.compare_routes,
                      "time every route side by side with the dense BF16 GEMM (default: on a GPU)");
  bench->add_flag("--source-layout", bench_opts.source_layout,
                  "upload the weights as given, not in the CPU's panel layout it prefers");
  bench->add_option("--repeats", bench_opts.repeats, "timed runs per case")
      ->check(CLI::Range(1, 1000));
  bench
      ->add_option("--tp", bench_opts.tp,
                   "split the layers over N ranks, one process each: mpirun -np N metrale bench "
                   "--tp N (CPU over MPI; CUDA over NCCL, a GPU per process)")
      ->check(CLI::Range(1, 4096));

  bench
      ->add_option("--moe", bench_opts.moe,
                   "an MoE layer's grouped GEMMs at realistic routings instead of dense layers")
      ->check(CLI::IsMember({"gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "qwen3-30b-a3b-int4",
                             "deepseek-v3", "qwen3-30b-a3b-fp8", "deepseek-v3-fp8"}));
  bench
      ->add_option("--skew", bench_opts.skews,
                   "--moe: routings' skews above one token (0: uniform)")
      ->delimiter(',')
      ->check(CLI::Range(0.0, 4.0));
  bench
      ->add_option("--moe-route", bench_opts.moe_route,
                   "--moe: the grouped GEMM's route (fused: 4-bit experts' prefill kernel on "
                   "the decode layout; tiled: FP8 experts' prefill kernel, CUDA sm_90a)")
      ->check(CLI::IsMember({"auto", "decode", "fused", "tiled"}));
  bench->add_flag("--allow-unverified", bench_opts.allow_unverified,
                  "run kernels no device run has verified (--moe on CUDA needs it)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    if (info->parsed()) return metrale::cli::run_info(opts);
    if (check->parsed()) {
      if (seed_opt->count() > 0) check_opts.seed = seed;
      return metrale::cli::run_check(opts, check_opts);
    }
    if (bench->parsed()) {
      // CLI11 (2.1) sets an optional flag to false when it is not given at all; neither flag
      // given is "unset", the per-backend default (the GPU default was lost so in run 6).
      if (compare_routes->count() == 0) bench_opts.compare_routes.reset();
      for (const std::string& s : shapes) {
        const auto x = s.find('x');
        std::size_t used = 0;
        long long n = -1, k = -1;
        try {
          n = std::stoll(s.substr(0, x), &used);
          if (used != x) n = -1;
          k = std::stoll(s.substr(x + 1), &used);
          if (used != s.size() - x - 1) k = -1;
        } catch (const std::exception&) {
        }
        if (x == std::string::npos || n < 1 || k < 1) {
          std::fprintf(stderr, "metrale: [bench] --shapes: '%s' is not NxK\n", s.c_str());
          return 2;
        }
        bench_opts.shapes.emplace_back(n, k);
      }
      // --moe times one MoE layer of its own: the dense bench's sources of layers and its
      // tensor-parallel split do not apply to it, and --skew applies to nothing else.
      if (!bench_opts.moe.empty()) {
        for (const auto* o : {"--tp", "--weights", "--shapes", "--model", "--graph",
                              "--compare-routes", "--source-layout", "--allow-e4m3"}) {
          if (bench->count(o) > 0) {
            std::fprintf(stderr, "metrale: [bench] %s does not apply to --moe\n", o);
            return 2;
          }
        }
        return metrale::cli::run_bench_moe(opts, bench_opts);
      }
      if (bench->count("--skew") > 0 || bench->count("--moe-route") > 0) {
        std::fprintf(stderr, "metrale: [bench] --%s applies to --moe only\n",
                     bench->count("--skew") > 0 ? "skew" : "moe-route");
        return 2;
      }
      if (bench_opts.tp > 0) return metrale::cli::run_bench_tp(opts, bench_opts);
      return metrale::cli::run_bench(opts, bench_opts);
    }
  } catch (const metrale::Error& e) {
    std::fprintf(stderr, "metrale: %s\n", e.what());
    return exit_code(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "metrale: %s\n", e.what());
    return 1;
  }
  return 2;
}
