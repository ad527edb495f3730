// Linear layers of a safetensors file (metrale/safetensors.h) in the FP8 layout of DeepSeek-V3
// and Qwen FP8 checkpoints: "<layer>.weight" F8_E4M3 (float8_e4m3fn) [N, K] and
// "<layer>.weight_scale_inv" F32 [ceil(N/128), ceil(K/128)], the multiplier of each 128 x 128
// block (weight = e4m3 code x scale; the "_inv" is the inverse of the quantizer's divisor). A
// loaded layer is a view into the file's map, no copy: metrale/e4m3_block.h's block-scaled E4M3
// weights, the W8A8 GEMM's weight operand.
//
// Every failure is an Error(kIo) whose message names the file and the tensor, as the reader's
// do: "[safetensors] model.safetensors: tensor 'x.weight_scale_inv': ...". A missing tensor is
// kIo here too (load_nvfp4_linear says kNotFound): a layer the file holds half of is a malformed
// file, which the CLI answers with exit 2.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/e4m3_block.h"
#include "metrale/safetensors.h"

namespace metrale {

// Loads FP8 linear layer `layer` (e.g. "model.layers.0.mlp.down_proj") as a view into `file`,
// valid while `file` lives. Checks, each failing with Error(kIo) naming the file and tensor:
// both tensors present; the weight F8_E4M3 of rank 2 with N, K > 0; the scales F32 of shape
// [ceil(N/128), ceil(K/128)] and 4-byte aligned in the file (they are read in place; the
// reference writer aligns them); every scale finite and >= 0 (0 is an all-zero block, -0 reads
// as 0; a negative scale would flip a block's signs, which no exporter writes); no code NaN
// (0x7F or 0xFF). The last two read every scale and code once. An empty layer name is
// Error(kInvalidArgument).
E4m3BlockWeightsView load_fp8_linear(const SafetensorsFile& file, std::string_view layer);

// The layers the file presents as FP8, whether or not they load: every "<layer>" whose
// "<layer>.weight" is F8_E4M3 or that has a "<layer>.weight_scale_inv". Sorted. A caller loads
// each, so a malformed one is an error rather than a layer silently left out.
std::vector<std::string> fp8_linear_layers(const SafetensorsFile& file);

// FP8 layer `layer` with its block scales stored another way, as one in-memory file that
// load_fp8_linear reads: "<layer>.weight" copied, and "<layer>.weight_scale_inv" F32
// [ceil(N/128), ceil(K/128)] from F8_E8M0 "weight_scale_inv" (DeepSeek's UE8M0 variant:
// 2^(e - 127)), BF16 "weight_scale" [ceil(N/128), ceil(K/128)] (compressed-tensors FP8_BLOCK, a
// multiplier) or F32 "weight_scale" [ceil(N/128), 1, ceil(K/128), 1] (ModelOpt's 2-D blockwise
// FP8). std::nullopt when the layer has F32 weight_scale_inv already, or no scale at all (then
// load_fp8_linear says what is missing). Error(kIo) naming the file and the scale tensor for any
// other scale, saying what it is and which layouts are read; or for a NaN UE8M0 scale.
std::optional<SafetensorsFile> fp8_scales_as_inv(const SafetensorsFile& file,
                                                 std::string_view layer);

// What a loaded FP8 layer's scales say of its producer: "FP8 block-128 (F32 weight_scale_inv)"
// (DeepSeek, Qwen, transformers), "FP8 block-128 (UE8M0 weight_scale_inv)", "compressed-tensors
// FP8 block-128" (BF16 weight_scale) or "ModelOpt FP8 block-128" (F32 4-D weight_scale). For a
// layer fp8_scales_as_inv and load_fp8_linear accepted; read from the header alone.
std::string fp8_layer_source(const SafetensorsFile& file, std::string_view layer);

}  // namespace metrale
