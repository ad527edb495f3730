// The experts of an MoE checkpoint that stores each projection of every expert in one tensor, as
// gpt-oss ships its MXFP4 experts (docs/CONTRACT.md, MoE checkpoints):
//   "<p>_blocks" U8 [E, N, K/32, 16]: expert e's row n, block g: byte j holds k = 32g + 2j in its
//                low nibble and k = 32g + 2j + 1 in its high one (E2M1 codes);
//   "<p>_scales" U8 [E, N, K/32]: each block's E8M0 scale (2^(u - 127));
//   "<p>_bias"   BF16 [E, N], optional;
// with <p> a projection such as "model.layers.0.mlp.experts.gate_up_proj". Each expert's [N, K]
// is then MXFP4 weights in metrale's row-major layout, byte for byte. Per-expert linears
// ("...experts.<e>.gate_proj.weight" and the like: Qwen3-MoE, DeepSeek) are ordinary linear
// layers (metrale/modelopt.h, metrale/fp8_checkpoint.h).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/modelopt.h"
#include "metrale/quant.h"
#include "metrale/safetensors.h"

namespace metrale {

// One projection's packed experts, as the header describes them.
struct PackedExperts {
  std::string projection;  // "<p>", e.g. "model.layers.0.mlp.experts.gate_up_proj"
  std::int32_t experts = 0;
  std::int64_t n = 0, k = 0;
  bool bias = false;
  std::string source = "gpt-oss MXFP4";
};

// Every "<p>_blocks" tensor of a file that is U8 or has "<p>_scales" beside it: those whose
// companions fit, by their headers (sorted by projection), and the others, each with the tensor
// at fault and why (quantized: a loader must not pass over them in silence). Other "_blocks"
// tensors (a float parameter of that name) are not projections and are left to other readers.
struct PackedExpertsScan {
  std::vector<PackedExperts> found;
  std::vector<RejectedLayer> rejected;
};
PackedExpertsScan scan_packed_experts(const SafetensorsFile& file);

// Projection `projection`'s experts: E MXFP4 weights [N, K] (row-major, tensor scale 1) and the
// bias as BF16 bits [E · N] (empty when the file has none). Throws Error(kNotFound) for a missing
// tensor, Error(kIo) naming the file and tensor for a dtype or shape that does not fit, or a NaN
// block scale (0xFF); Error(kInvalidArgument) for an empty projection name.
struct ExpertsWeights {
  std::vector<HostQuantWeights> experts;
  std::vector<std::uint16_t> bias;
};
ExpertsWeights load_packed_experts(const SafetensorsFile& file, std::string_view projection);

}  // namespace metrale
