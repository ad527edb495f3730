// INT4 linear layers as their producers store them (Note [INT4 weights]; the layouts in
// ../shared/reference/formats.md, checked against tests/fixtures/checkpoints): compressed-tensors
// `pack-quantized` ("<l>.weight_packed" I32), GPTQ and AWQ ("<l>.qweight"). load_nvfp4_linear and
// scan_linear_layers (modelopt.cpp) dispatch here for such layers. Internal to src/io.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "metrale/error.h"
#include "metrale/modelopt.h"
#include "metrale/quant.h"
#include "metrale/safetensors.h"

namespace metrale::io {

// What a header check found wrong: the tensor at fault and why.
struct LayerProblem {
  ErrorCode code = ErrorCode::kIo;
  std::string tensor, what;
};

enum class Int4Producer { kCompressedTensors, kGptq, kAwq };

// The tensors of one INT4 layer and its shape, found from the header alone.
struct Int4Plan {
  Int4Producer producer = Int4Producer::kCompressedTensors;
  std::int64_t n = 0, k = 0, group = 0;
  std::string weight, scales, zeros, g_idx;  // zeros, g_idx: empty when the layer has none
};

// Whether `layer` is stored as INT4: an I32 "<layer>.weight_packed", or a "<layer>.qweight".
bool looks_int4(const SafetensorsFile& f, std::string_view layer);

// Checks the header of an INT4 layer into plan; the problem when it cannot be read.
std::optional<LayerProblem> plan_int4(const SafetensorsFile& f, std::string_view layer,
                                      Int4Plan& plan);

// Reads a planned layer: codes in W's [N, K] order, scales as BF16 or FP16 (F32 scales only where
// one of them holds each exactly), zero points (none when every one is 8), act order from g_idx.
// `zeros` says how GPTQ's zero points are stored. Throws Error(kIo) naming the tensor for a
// scale that is not finite, an F32 scale neither type holds, or a g_idx that does not put
// `group` columns in each group.
HostQuantWeights read_int4(const SafetensorsFile& f, const Int4Plan& plan, GptqZeros zeros);

// "compressed-tensors INT4", "GPTQ INT4", "AWQ INT4".
std::string int4_source(Int4Producer producer);

}  // namespace metrale::io
