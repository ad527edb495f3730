// A model folder's declared quantization (config.json's quantization_config,
// hf_quant_config.json) and the check that its tensors hold it. The keys were read from the
// producers' own files: compressed-tensors 0.19/0.20 (tests/fixtures/checkpoints/ct-*),
// ModelOpt 0.47 (its export writes quant_algo "NVFP4", "W4A16_NVFP4", "fp8_pb_wo", ... in
// modelopt/torch/export/quant_utils.py; tests/fixtures/checkpoints/modelopt-nvfp4), and the FP8
// block configs of DeepSeek-V3 and transformers' FineGrainedFP8Config (quant_method "fp8",
// weight_block_size [128, 128], activation_scheme "dynamic", scale_fmt "ue8m0" for UE8M0).
#include "metrale/quant_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>

#include "metrale/error.h"

namespace metrale {
namespace {

// Ordered: GPTQModel's "dynamic" rules apply in the order the file lists them.
using json = nlohmann::ordered_json;

constexpr std::string_view kApi = "quantization config";

// What metrale does with NVFP4 activations: there is no FP4 tensor-core MMA on sm_90, so an
// NVFP4 W4A4 checkpoint runs weight-only there, as vLLM's Marlin FP4 path runs it on GPUs
// without FP4 MMA.
constexpr std::string_view kFp4ActivationsKept =
    "the config quantizes activations to NVFP4 (W4A4); metrale keeps them BF16 and runs W4A16 "
    "(input scales read, unused): Hopper has no FP4 MMA";
constexpr std::string_view kFp8ActivationsCast =
    "activations cast to E4M3 per row per 128 K by the W8A8 op, as the config's dynamic "
    "per-token-group scheme does";
constexpr std::string_view kInt4ActivationsKept =
    "the config quantizes activations too (W4A8); metrale keeps them BF16 and runs the INT4 "
    "weights W4A16";
constexpr std::string_view kFp8WeightOnly =
    "the config keeps activations in 16 bits (FP8 weight-only), but metrale's FP8 op is W8A8: "
    "it casts them to E4M3 per row per 128 K";

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) {
    throw Error(ErrorCode::kIo, kApi, fmt::format("{}: cannot be read", path.string()));
  }
  std::stringstream text;
  text << in.rdbuf();
  json j = json::parse(text.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    throw Error(ErrorCode::kIo, kApi,
                fmt::format("{}: not a JSON object (does not parse)", path.string()));
  }
  return j;
}

// The string at `key` of `obj` ("" when absent or null); Error(kIo) for another type.
std::string string_at(const json& obj, const char* key, std::string_view where) {
  if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return {};
  if (!obj[key].is_string()) {
    throw Error(ErrorCode::kIo, kApi,
                fmt::format("{}: \"{}\" is {}, expected a string", where, key, obj[key].dump()));
  }
  return obj[key].get<std::string>();
}

// The list of strings at `key` (empty when absent or null); Error(kIo) for another type.
std::vector<std::string> strings_at(const json& obj, const char* key, std::string_view where) {
  std::vector<std::string> out;
  if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return out;
  const json& v = obj[key];
  if (!v.is_array() ||
      !std::all_of(v.begin(), v.end(), [](const json& e) { return e.is_string(); })) {
    throw Error(ErrorCode::kIo, kApi,
                fmt::format("{}: \"{}\" is {}, expected a list of strings", where, key, v.dump()));
  }
  for (const json& e : v) out.push_back(e.get<std::string>());
  return out;
}

// The integer at `key` of `obj` (nullopt when absent or null); Error(kIo) for another type, a
// fraction included ("bits": 4.5 is no bit width).
std::optional<std::int64_t> int_at(const json& obj, const char* key, std::string_view where) {
  if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return std::nullopt;
  const json& v = obj[key];
  if (v.is_number_integer() && !(v.is_number_unsigned() && v.get<std::uint64_t>() > INT64_MAX)) {
    return v.get<std::int64_t>();
  }
  throw Error(ErrorCode::kIo, kApi,
              fmt::format("{}: \"{}\" is {}, expected an integer", where, key, v.dump()));
}

// The boolean at `key` of `obj` (`fallback` when absent or null); Error(kIo) for another type.
bool bool_at(const json& obj, const char* key, std::string_view where, bool fallback) {
  if (!obj.is_object() || !obj.contains(key) || obj[key].is_null()) return fallback;
  if (!obj[key].is_boolean()) {
    throw Error(
        ErrorCode::kIo, kApi,
        fmt::format("{}: \"{}\" is {}, expected true or false", where, key, obj[key].dump()));
  }
  return obj[key].get<bool>();
}

// compressed-tensors: the format (top-level, or the groups' own when they agree), whether every
// group targets every Linear, and whether any quantizes activations.
DeclaredQuantization compressed_tensors(const json& q, const std::string& where) {
  DeclaredQuantization d;
  d.producer = "compressed-tensors";
  d.format = string_at(q, "format", where);
  d.ignore = strings_at(q, "ignore", where);
  const json groups = q.value("config_groups", json::object());
  d.every_linear = groups.is_object() && !groups.empty();
  const json* weights = nullptr;
  for (const auto& [name, g] : groups.items()) {
    if (!g.is_object()) continue;
    d.every_linear = d.every_linear && g.value("targets", json()) == json::array({"Linear"});
    if (g.contains("input_activations") && !g["input_activations"].is_null()) {
      d.quantized_activations = true;
    }
    if (d.format.empty()) d.format = string_at(g, "format", where);
    if (g.contains("weights") && g["weights"].is_object()) weights = &g["weights"];
  }
  if (d.format == "nvfp4-pack-quantized") {
    d.layer_sources = {"compressed-tensors NVFP4"};
    if (d.quantized_activations) d.activations = kFp4ActivationsKept;
  } else if (d.format == "mxfp4-pack-quantized") {
    d.layer_sources = {"compressed-tensors MXFP4"};
    if (d.quantized_activations) d.activations = kFp4ActivationsKept;
  } else if (d.format == "pack-quantized" && weights != nullptr &&
             int_at(*weights, "num_bits", where) == 4 &&
             string_at(*weights, "type", where) == "int") {
    // INT4 weights (W4A16, W4A16_ASYM): group or channel; the loader checks the groups. A W4A8
    // scheme's integer activations are not quantized here.
    d.layer_sources = {"compressed-tensors INT4"};
    if (d.quantized_activations) d.activations = kInt4ActivationsKept;
  } else if (d.format == "float-quantized" && weights != nullptr &&
             int_at(*weights, "num_bits", where) == 8 &&
             string_at(*weights, "strategy", where) == "block" &&
             weights->value("block_structure", json()) == json::array({128, 128})) {
    // FP8_BLOCK; a per-tensor or per-channel FP8 scheme is another format, not read.
    d.format = "float-quantized (FP8 block [128, 128])";
    d.layer_sources = {"compressed-tensors FP8 block-128"};
    d.activations = d.quantized_activations ? kFp8ActivationsCast : kFp8WeightOnly;
  }
  return d;
}

// ModelOpt: quant_algo and the modules it excluded, from hf_quant_config.json's "quantization" or
// config.json's quantization_config (whose list is "ignore").
DeclaredQuantization modelopt(const json& q, const std::string& where) {
  DeclaredQuantization d;
  d.producer = "modelopt";
  d.format = string_at(q, "quant_algo", where);
  d.ignore = strings_at(q, q.contains("exclude_modules") ? "exclude_modules" : "ignore", where);
  d.every_linear = true;  // ModelOpt's export lists every Linear it left alone
  if (d.format == "NVFP4") {
    d.layer_sources = {"ModelOpt NVFP4"};
    d.quantized_activations = true;
    d.activations = kFp4ActivationsKept;
  } else if (d.format == "W4A16_NVFP4") {
    d.layer_sources = {"ModelOpt NVFP4"};
  } else if (d.format == "fp8_pb_wo" || d.format == "FP8_PB_WO") {
    d.layer_sources = {"ModelOpt FP8 block-128"};
    d.activations = kFp8WeightOnly;
  }
  return d;
}

// DeepSeek-V3, Qwen3-FP8 and transformers' FineGrainedFP8Config: quant_method "fp8".
DeclaredQuantization fp8_block(const json& q, const std::string& where) {
  DeclaredQuantization d;
  d.producer = "fp8";
  const json block = q.value("weight_block_size", json());
  const std::string scheme = string_at(q, "activation_scheme", where);
  const std::string scale_fmt = string_at(q, "scale_fmt", where);
  d.format = fmt::format("fp8 {}{}{}", block.is_null() ? "per-tensor" : block.dump(),
                         scheme.empty() ? "" : ", activation_scheme " + scheme,
                         scale_fmt.empty() ? "" : ", scale_fmt " + scale_fmt);
  // transformers leaves the output embedding unconverted when the config names nothing
  // (FineGrainedFP8 quantizer: modules_to_not_convert defaults to the model's lm_head).
  d.ignore = strings_at(q, "modules_to_not_convert", where);
  if (d.ignore.empty()) d.ignore = {"lm_head"};
  d.transformers_patterns = true;
  d.every_linear = true;
  d.quantized_activations = scheme == "dynamic";
  if (block == json::array({128, 128}) && scheme == "dynamic") {
    d.layer_sources = {scale_fmt == "ue8m0" ? "FP8 block-128 (UE8M0 weight_scale_inv)"
                                            : "FP8 block-128 (F32 weight_scale_inv)"};
    d.activations = kFp8ActivationsCast;
  }
  return d;
}

// gpt-oss (transformers' Mxfp4Config): quant_method "mxfp4". Only the MoE experts are quantized
// (transformers' replace_with_mxfp4_linear converts the experts modules alone), each projection
// packed for every expert (metrale/moe_checkpoint.h); its modules_to_not_convert names the
// attention, the router, the embeddings and lm_head, all plain, and reads as transformers'
// should_convert_module reads it, against the experts module's name (the caller passes that
// module for its packed projections).
DeclaredQuantization mxfp4_experts(const json& q, const std::string& where) {
  DeclaredQuantization d;
  d.producer = "mxfp4";
  d.format = "mxfp4";  // the file names no format beside its quant_method
  d.ignore = strings_at(q, "modules_to_not_convert", where);
  d.transformers_patterns = true;
  d.layer_sources = {"gpt-oss MXFP4"};
  return d;
}

// GPTQ (GPTQModel, AutoGPTQ; transformers' GPTQConfig): quant_method "gptq", bits 4,
// checkpoint_format "gptq" (zero points minus one, the default) or "gptq_v2". The quantizer
// replaces every Linear of the decoder blocks; the config names no ignore list of its own
// (lm_head stays plain unless lm_head is true), so every other plain Linear is one it skipped.
DeclaredQuantization gptq(const json& q, const std::string& where) {
  DeclaredQuantization d;
  d.producer = "gptq";
  const std::string format = string_at(q, "checkpoint_format", where);
  d.gptq_v2 = format == "gptq_v2";
  const std::optional<std::int64_t> bits = int_at(q, "bits", where);
  d.format = fmt::format("{}, {} bits, group {}{}", format.empty() ? "gptq" : format,
                         q.value("bits", json()).dump(), q.value("group_size", json()).dump(),
                         bool_at(q, "desc_act", where, false) ? ", desc_act" : "");
  d.ignore = strings_at(q, "modules_to_not_convert", where);
  if (!bool_at(q, "lm_head", where, false)) d.ignore.push_back("lm_head");
  d.every_linear = true;  // a plain Linear it does not name is a layer its quantizer skipped
  // GPTQModel's per-module rules, {"<regex>" or "+:<regex>": overrides, "-:<regex>": {}}: the
  // first rule whose regex matches a module's name from its start decides it (vLLM's
  // get_dynamic_override, GPTQModel's dynamic_get); "-:" leaves the module unquantized. An
  // override of the bit width to another than 4 is a layer metrale cannot read.
  std::string other_bits;
  if (q.contains("dynamic") && !q["dynamic"].is_null()) {
    if (!q["dynamic"].is_object()) {
      throw Error(ErrorCode::kIo, kApi,
                  fmt::format("{}: \"dynamic\" is {}, expected an object of rules", where,
                              q["dynamic"].dump()));
    }
    for (const auto& [key, rule] : q["dynamic"].items()) {
      const bool skip = key.starts_with("-:");
      const std::string regex = key.substr(skip || key.starts_with("+:") ? 2 : 0);
      if (!rule.is_object()) {
        throw Error(ErrorCode::kIo, kApi,
                    fmt::format("{}: dynamic rule \"{}\" is {}, expected an object", where, key,
                                rule.dump()));
      }
      const std::optional<std::int64_t> rule_bits =
          skip ? std::nullopt
               : int_at(rule, "bits", fmt::format("{}: dynamic rule \"{}\"", where, key));
      if (rule_bits && *rule_bits != 4 && other_bits.empty()) {
        other_bits = fmt::format("; dynamic rule \"{}\" sets {} bits", key, *rule_bits);
      }
      d.dynamic.emplace_back(skip, regex);
    }
  }
  d.format += other_bits;
  if (bits == 4 && other_bits.empty() &&
      (format.empty() || format == "gptq" || format == "gptq_v2")) {
    d.layer_sources = {"GPTQ INT4"};
  }
  return d;
}

// AWQ (AutoAWQ; transformers' AwqConfig): quant_method "awq", bits 4, version "gemm" (the GEMV
// and other versions pack differently and are not read), zero_point true.
DeclaredQuantization awq(const json& q, const std::string& where) {
  DeclaredQuantization d;
  d.producer = "awq";
  const std::string version = string_at(q, "version", where);
  d.format = fmt::format("{}, {} bits, group {}", version, q.value("bits", json()).dump(),
                         q.value("group_size", json()).dump());
  d.ignore = strings_at(q, "modules_to_not_convert", where);
  d.ignore.push_back("lm_head");
  d.every_linear = true;
  if (int_at(q, "bits", where) == 4 && (version == "gemm" || version == "GEMM") &&
      bool_at(q, "zero_point", where, true)) {
    d.layer_sources = {"AWQ INT4"};
  }
  return d;
}

// fnmatch's wildcards, case-sensitive: '*' any run, '?' one character, "[...]" a set ("[!...]"
// its complement, "a-z" ranges).
bool glob_match(std::string_view p, std::string_view s) {
  if (p.empty()) return s.empty();
  if (p[0] == '*') {
    for (std::size_t i = 0; i <= s.size(); ++i) {
      if (glob_match(p.substr(1), s.substr(i))) return true;
    }
    return false;
  }
  if (s.empty()) return false;
  if (p[0] == '[') {
    const std::size_t close = p.find(']', p.size() > 2 && (p[1] == '!') ? 3 : 2);
    if (close != std::string_view::npos) {
      const bool negate = p[1] == '!';
      const std::string_view set = p.substr(negate ? 2 : 1, close - (negate ? 2 : 1));
      bool hit = false;
      for (std::size_t i = 0; i < set.size(); ++i) {
        if (i + 2 < set.size() && set[i + 1] == '-') {
          hit = hit || (set[i] <= s[0] && s[0] <= set[i + 2]);
          i += 2;
        } else {
          hit = hit || set[i] == s[0];
        }
      }
      return hit != negate && glob_match(p.substr(close + 1), s.substr(1));
    }
  }
  return (p[0] == '?' || p[0] == s[0]) && glob_match(p.substr(1), s.substr(1));
}

}  // namespace

std::string DeclaredQuantization::describe() const {
  return fmt::format("{} '{}' ({})", producer, format, file);
}

std::optional<DeclaredQuantization> read_declared_quantization(const std::string& folder) {
  namespace fs = std::filesystem;
  const fs::path config = fs::path(folder) / "config.json";
  const fs::path hf = fs::path(folder) / "hf_quant_config.json";
  std::error_code ec;
  if (fs::is_regular_file(config, ec)) {
    const json c = read_json(config);
    const json q = c.value("quantization_config", json());
    if (q.is_object() && !q.empty()) {
      const std::string where = config.string() + " (quantization_config)";
      const std::string method = string_at(q, "quant_method", where);
      DeclaredQuantization d = method == "compressed-tensors" ? compressed_tensors(q, where)
                               : method == "modelopt"         ? modelopt(q, where)
                               : method == "fp8"              ? fp8_block(q, where)
                               : method == "gptq"             ? gptq(q, where)
                               : method == "awq"              ? awq(q, where)
                               : method == "mxfp4"            ? mxfp4_experts(q, where)
                                                              : DeclaredQuantization{};
      if (d.producer.empty()) d.producer = method.empty() ? "(no quant_method)" : method;
      d.file = where;
      return d;
    }
  }
  if (fs::is_regular_file(hf, ec)) {
    const json h = read_json(hf);
    const json q = h.value("quantization", json());
    if (q.is_object() && !string_at(q, "quant_algo", hf.string()).empty()) {
      DeclaredQuantization d = modelopt(q, hf.string());
      d.file = hf.string();
      return d;
    }
  }
  return std::nullopt;
}

bool declared_ignores(const DeclaredQuantization& declared, std::string_view module) {
  for (const auto& [skip, pattern] : declared.dynamic) {
    try {
      if (std::regex_search(module.begin(), module.end(), std::regex(pattern),
                            std::regex_constants::match_continuous)) {
        if (skip) return true;
        break;  // the first matching rule decides; an override leaves it to the ignore list
      }
    } catch (const std::regex_error&) {
      // As below: a rule std::regex cannot read matches nothing.
    }
  }
  for (const std::string& pattern : declared.ignore) {
    if (declared.transformers_patterns) {
      // should_convert_module: re.match(key + "\\.", name) or re.match(key, name) or
      // name.endswith(key); the first implies the second.
      if (module.ends_with(pattern)) return true;
      try {
        if (std::regex_search(module.begin(), module.end(), std::regex(pattern),
                              std::regex_constants::match_continuous)) {
          return true;
        }
      } catch (const std::regex_error&) {
        // As below: a pattern std::regex cannot read matches nothing more.
      }
      continue;
    }
    if (pattern.rfind("re:", 0) == 0) {
      try {
        // compressed-tensors' match_name: re.match, anchored at the start only.
        if (std::regex_search(module.begin(), module.end(), std::regex(pattern.substr(3)),
                              std::regex_constants::match_continuous)) {
          return true;
        }
      } catch (const std::regex_error&) {
        // A pattern std::regex cannot read matches nothing; check_declared then names the layer.
      }
    } else if (glob_match(pattern, module)) {
      return true;
    }
  }
  return false;
}

void check_declared(const DeclaredQuantization& declared, std::string_view api,
                    const std::vector<std::pair<std::string, std::string>>& quantized,
                    const std::vector<std::string>& plain) {
  const std::string where = fmt::format("{} declares {}", declared.file,
                                        declared.producer + " '" + declared.format + "'");
  if (declared.layer_sources.empty()) {
    throw Error(ErrorCode::kIo, api, fmt::format("{}, which metrale does not read", where));
  }
  std::vector<std::string> wrong, listed, skipped;
  for (const auto& [layer, source] : quantized) {
    const auto& ok = declared.layer_sources;
    if (std::find(ok.begin(), ok.end(), source) == ok.end()) {
      wrong.push_back(fmt::format("{} ({})", layer, source));
    }
    if (declared_ignores(declared, layer)) listed.push_back(layer);
  }
  if (!wrong.empty()) {
    throw Error(ErrorCode::kIo, api,
                fmt::format("{} ({} layers), but these layers hold another format: {}", where,
                            fmt::join(declared.layer_sources, " or "), fmt::join(wrong, ", ")));
  }
  if (!listed.empty()) {
    throw Error(ErrorCode::kIo, api,
                fmt::format("{} and ignores {}, which the checkpoint holds quantized", where,
                            fmt::join(listed, ", ")));
  }
  if (declared.every_linear) {
    for (const std::string& layer : plain) {
      if (!declared_ignores(declared, layer)) skipped.push_back(layer);
    }
  }
  if (!skipped.empty()) {
    throw Error(ErrorCode::kIo, api,
                fmt::format("{}, which quantizes every Linear but its ignore list, yet the "
                            "checkpoint holds these in plain floats: {}",
                            where, fmt::join(skipped, ", ")));
  }
}

}  // namespace metrale
