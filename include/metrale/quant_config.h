// What a model folder's configuration declares of its weights' quantization, and the check that
// the tensors hold it. The declaration lives in config.json's "quantization_config" (where
// transformers looks: compressed-tensors, FP8 block checkpoints, ModelOpt's newer exports) or in
// ModelOpt's hf_quant_config.json; the keys each producer writes are in
// ../shared/reference/formats.md and were read from files the producers made
// (tests/fixtures/checkpoints, tests/fixtures/models).
//
// Why hold tensors to the declaration: a loader that decides from the tensors alone cannot see a
// layer the quantizer skipped (left in BF16 although the config quantizes every Linear) or a
// layer quantized in another format than the one declared; both load "fine" and run a model
// that is not the one published.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace metrale {

// A folder's declared quantization.
struct DeclaredQuantization {
  // Where: "<folder>/config.json (quantization_config)" or "<folder>/hf_quant_config.json".
  std::string file;
  // "compressed-tensors", "modelopt", "fp8" (DeepSeek, Qwen, transformers), "gptq", "awq" or
  // "mxfp4" (gpt-oss's experts)
  std::string producer;
  std::string format;  // as the file names it: "nvfp4-pack-quantized", "NVFP4", "fp8 [128, 128]"
  // What each quantized layer of the format reads as (Nvfp4Linear::source, fp8_layer_source);
  // empty for a format metrale does not read.
  std::vector<std::string> layer_sources;
  std::vector<std::string> ignore;  // module names and patterns the quantizer left alone
  // The ignore list reads as transformers' quantizers read modules_to_not_convert
  // (should_convert_module): a pattern ignores a module when it matches as a regex from the
  // name's start, or when the name ends with it. Set for quant_method "fp8" and "mxfp4".
  bool transformers_patterns = false;
  bool every_linear = false;           // the quantizer targets every Linear but those it ignores
  bool quantized_activations = false;  // W4A4, W8A8: the config quantizes activations too
  // What metrale does with the activations the config quantizes (empty when it quantizes none):
  // the W8A8 op's own dynamic E4M3 casts, or BF16 activations for an FP4 W4A4 or an INT4 W4A8
  // checkpoint.
  std::string activations;
  // GPTQModel's "dynamic" rules in the file's order, (skips, regex): the first whose regex
  // matches a module's name from its start decides it; a skipping ("-:") rule puts the module
  // on the ignore list, an override keeps it quantized (its bits are checked when read).
  std::vector<std::pair<bool, std::string>> dynamic;
  // GPTQ's checkpoint_format "gptq_v2": zero points stored as they are (GptqZeros::kAsStored);
  // "gptq", the default, stores them minus one.
  bool gptq_v2 = false;

  // "compressed-tensors 'nvfp4-pack-quantized' (<folder>/config.json (quantization_config))".
  std::string describe() const;
};

// The declaration in `folder` (config.json's quantization_config first, then
// hf_quant_config.json); std::nullopt when the folder has no config.json or neither declares any
// quantization. Error(kIo) naming the file for JSON that does not parse or a key of the wrong
// type.
std::optional<DeclaredQuantization> read_declared_quantization(const std::string& folder);

// Whether `module` is on the ignore list: a name, a compressed-tensors "re:<regex>" (matched from
// the start as its match_name's re.match does; ECMAScript syntax) or a ModelOpt wildcard ('*',
// '?', "[...]", as fnmatch); with transformers_patterns, transformers' own rule instead; or
// whether the first of the dynamic rules to match it skips it.
bool declared_ignores(const DeclaredQuantization& declared, std::string_view module);

// Holds a checkpoint's layers to the declaration: `quantized` (layer, source) pairs and the
// `plain` linear layers held in BF16/F32 (embedding tables left out). Error(kIo, api) naming the
// layers: a format metrale does not read; a quantized layer of another source than the
// format's; a quantized layer on the ignore list; with every_linear, a plain layer not on it (a
// layer its quantizer skipped).
void check_declared(const DeclaredQuantization& declared, std::string_view api,
                    const std::vector<std::pair<std::string, std::string>>& quantized,
                    const std::vector<std::string>& plain);

}  // namespace metrale
