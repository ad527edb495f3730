// Linear layers of a safetensors file (metrale/safetensors.h) as NVIDIA ModelOpt exports NVFP4
// checkpoints, compressed-tensors its FP4 and INT4 ones, GPTQ and AWQ theirs: load_nvfp4_linear
// reads one (or quantizes a BF16/F32 layer on load), and
// scan_linear_layers sorts every "<layer>.weight" of a file into the layers it can load and the
// candidates it cannot, with the tensor at fault and why.
//
// Every failure is an Error whose message names the file and the tensor, as the reader's do:
// "[safetensors] model.safetensors: tensor 'x.weight_scale': ...". kIo for a layer whose tensors
// do not fit together (a dtype, a shape, a value), kNotFound for a missing tensor.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/error.h"
#include "metrale/quant.h"
#include "metrale/safetensors.h"

namespace metrale {

// A linear layer's 4-bit weights (NVFP4; MXFP4 from compressed-tensors; INT4 from compressed-
// tensors, GPTQ and AWQ) and, when the file has one, its activation (input) scale as a multiplier.
struct Nvfp4Linear {
  HostQuantWeights w;                // row-major [N, K]
  std::optional<float> input_scale;  // "<layer>.input_scale", or 1 / "<layer>.input_global_scale"
  // dtype of the weight tensor: "U8" (FP4), "I32" (INT4), "BF16" or "F32"
  std::string source_dtype;
  // What the file held: "ModelOpt NVFP4", "compressed-tensors NVFP4", "compressed-tensors
  // MXFP4", "compressed-tensors INT4", "GPTQ INT4", "AWQ INT4", or "BF16, quantized to NVFP4 on
  // load" (F32 alike).
  std::string source;
};

// How a GPTQ checkpoint stores its zero points: its config's checkpoint_format "gptq" (the
// default, what GPTQ checkpoints ship as: each packed word minus 0x11111111) or "gptq_v2" (as
// they are). Other producers ignore it.
enum class GptqZeros { kMinusOne, kAsStored };

// Loads linear layer `layer` (e.g. "model.layers.0.mlp.down_proj"):
//  - as ModelOpt exports NVFP4: "<layer>.weight" U8 [N, K/2] (E2M1 codes, low nibble = even k),
//    "<layer>.weight_scale" F8_E4M3 [N, K/16], "<layer>.weight_scale_2" F32 of shape [] or [1]
//    (the tensor scale; finite and >= 0);
//  - as compressed-tensors saves `nvfp4-pack-quantized` / `mxfp4-pack-quantized`:
//    "<layer>.weight_packed" U8 [N, K/2] (the same nibble order), "<layer>.weight_scale"
//    F8_E4M3 [N, K/16] and "<layer>.weight_global_scale" F32 [1] (a divisor, finite and > 0:
//    the tensor scale is its reciprocal), or U8 E8M0 [N, K/32] and no global scale (MXFP4);
//  - as INT4 (WeightFormat::kInt4): compressed-tensors `pack-quantized` ("<layer>.weight_packed"
//    I32 [N, ceil(K/8)], "weight_scale", "weight_shape", optional "weight_zero_point" and
//    "weight_g_idx"), GPTQ ("<layer>.qweight" I32 [K/8, N], "qzeros", "scales", optional "g_idx";
//    `gptq_zeros` says how its zero points are stored) or AWQ ("<layer>.qweight" I32 [K, N/8],
//    "qzeros", "scales"), in groups of 32, 64, a multiple of 128 or one per row; the layouts are
//    in src/io/int4_layers.cpp;
//  - or "<layer>.weight" BF16/F32 [N, K] (no weight_scale tensors), quantized with
//    quantize_nvfp4.
// K must be a positive multiple of 16 for FP4 (INT4: even, and a whole number of its groups).
// "<layer>.input_scale" (F32, [] or [1], finite) is read when
// present. Throws Error(kNotFound) for a missing tensor, Error(kIo) for a wrong dtype or shape,
// a NaN block scale or a non-finite weight, naming the file and tensor; Error(kInvalidArgument)
// for an empty layer name.
Nvfp4Linear load_nvfp4_linear(const SafetensorsFile& file, std::string_view layer,
                              GptqZeros gptq_zeros = GptqZeros::kMinusOne);

// What load_nvfp4_linear gives as `layer`'s source (Nvfp4Linear::source: "ModelOpt NVFP4",
// "GPTQ INT4", "BF16, quantized to NVFP4 on load", ...) from the header alone: nothing is read
// or quantized. Throws as load_nvfp4_linear does for a layer its header refuses.
std::string linear_layer_source(const SafetensorsFile& file, std::string_view layer);

// A "<layer>.weight" tensor that load_nvfp4_linear would refuse by the header, and why.
struct RejectedLayer {
  std::string layer;                // "<layer>"
  std::string tensor;               // the tensor at fault: the weight or one of its scales
  ErrorCode code = ErrorCode::kIo;  // what load_nvfp4_linear would throw: kIo, or kNotFound
  std::string why;  // e.g. "shape is [4, 4]: K = 2 x 4 is not a multiple of 16, ..."
  // Whether the layer looks quantized (packed, integer or FP8 weights, or block scales beside
  // them): a loader must not pass over such a layer in silence.
  bool quantized = false;
};

// Every candidate "<layer>.weight" (or "<layer>.weight_packed", "<layer>.qweight") of a file,
// sorted into the two kinds.
struct LinearLayerScan {
  std::vector<std::string> layers;      // loadable by their header, sorted
  std::vector<RejectedLayer> rejected;  // the others, sorted by layer
};

// Sorts every "<layer>.weight" tensor of the file: accepted by its header (as linear_layers
// lists) or rejected with the tensor at fault and the reason load_nvfp4_linear would give.
LinearLayerScan scan_linear_layers(const SafetensorsFile& file);

// The layers load_nvfp4_linear accepts by their header: every "<layer>.weight" that is U8 with
// matching weight_scale/weight_scale_2 tensors, or a BF16/F32 matrix whose K is a multiple of 16
// (so embeddings qualify too). Sorted.
std::vector<std::string> linear_layers(const SafetensorsFile& file);

// linear_layers, for a caller that needs at least one: when the file has none, Error(kIo) naming
// the file and, one a line, each rejected candidate tensor with its reason (or saying that no
// tensor is named "<layer>.weight").
std::vector<std::string> require_linear_layers(const SafetensorsFile& file);

}  // namespace metrale
