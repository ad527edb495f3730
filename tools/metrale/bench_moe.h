// `metrale bench --moe MODEL`: one MoE layer's grouped GEMMs at realistic routings (bench_moe.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "commands.h"
#include "metrale/quant.h"

namespace metrale::cli {

// A built-in MoE layer: E experts, top_k per token, each expert a gate_up [2·inter, hidden] and a
// down [hidden, inter], in the format its released checkpoints use: a 4-bit format, or FP8
// block-128 (fp8: the grouped W8A8 op, format unused).
struct MoeModel {
  std::string name;
  int experts = 0, top_k = 0;
  std::int64_t hidden = 0, inter = 0;
  WeightFormat format = WeightFormat::kNvfp4;
  bool fp8 = false;
  // "nvfp4", "mxfp4", "int4" or "e4m3_block128".
  std::string format_name() const;
};

// "gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "deepseek-v3" (NVIDIA's NVFP4 export), the
// INT4 release "qwen3-30b-a3b-int4" (GPTQ, groups of 128, FP16 scales) or the FP8 releases
// "qwen3-30b-a3b-fp8" and "deepseek-v3-fp8"; Error(kInvalidArgument) naming any other.
MoeModel moe_model(const std::string& name);

// The layer's gate_up and down at each M (tokens) and skew of bench: checked against float64,
// timed against the roofs measured in the same run, torn down to zero live bytes. On CUDA only
// with bench.allow_unverified (its grouped GEMMs have not run on a GPU yet).
int run_bench_moe(const CommonOptions& options, const BenchOptions& bench);

}  // namespace metrale::cli
