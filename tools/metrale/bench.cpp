// metrale bench: one transformer block's linear layers of a real model, on the best device
// present, each result checked against a float64 reference before it is timed, timed against
// roofs measured in the same run, and torn down to zero bytes at the end.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <list>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>

#include "bench_dense.h"
#include "bench_fp8.h"
#include "bench_models.h"
#include "bench_timing.h"
#include "commands.h"
#include "interrupt.h"
#include "memory_fit.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/cpu_backend.h"
#include "metrale/e4m3_block.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/model_scope.h"
#include "metrale/modelopt.h"
#include "metrale/moe_checkpoint.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/fp8_gemm.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant_config.h"
#include "metrale/runtime.h"
#include "metrale/safetensors.h"
#include "metrale/sharded_checkpoint.h"
#include "metrale/weights.h"
#include "planted_leak.h"
#include "toolkit/random_weights.h"
#include "toolkit/roof_share.h"
#include "toolkit/roofline.h"
#include "toolkit/rotation.h"
#include "toolkit/sampled_check.h"
#include "toolkit/w8a8_reference.h"

namespace metrale::cli {
namespace {

// What the check before the timing covers, for the report.
constexpr const char* kChecks =
    "every copy of the weight rotation that is timed, against the float64 reference: sampled "
    "outputs (96 of copy 0, 16 of each other copy; toolkit/rotation.h)";

// One way of computing every layer at one M: the quantized GEMM on its automatic route (the
// main table), on one route forced, the W8A8 op on the weights requantized to block-scaled E4M3
// (ops/fp8_requant.h), or the backend's dense BF16 GEMM on the weights dequantized to BF16 (the
// baseline: cuBLASLt on CUDA).
struct Variant {
  std::string name;
  ops::GemmRoute route = ops::GemmRoute::kAuto;
  bool dense_bf16 = false;
  bool w8a8 = false;
};

// The routes the side-by-side table forces, in its column order (the baseline comes last).
constexpr ops::GemmRoute kComparedRoutes[] = {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled,
                                              ops::GemmRoute::kE4m3, ops::GemmRoute::kDequant,
                                              ops::GemmRoute::kFused};

// Each layer's time at each M on every route that ran, side by side, with the fastest marked
// and each route's speed against the dense BF16 baseline (> 1: faster than it).
void print_side_by_side(const std::vector<Case>& cases, const std::vector<Variant>& variants,
                        const std::vector<std::string>& skipped, std::size_t width) {
  fmt::print("\nroutes side by side (ms; * fastest; x: the baseline's time over the route's):\n");
  fmt::print("{:<{}} {:>5}", "layer", width, "M");
  for (const Variant& v : variants) fmt::print(" {:>16}", v.name);
  fmt::print("\n");
  std::vector<std::pair<std::int64_t, std::string>> rows;
  for (const Case& cs : cases) {
    if (std::find(rows.begin(), rows.end(), std::pair{cs.m, cs.layer}) == rows.end())
      rows.emplace_back(cs.m, cs.layer);
  }
  for (const auto& [m, layer] : rows) {
    const auto find = [&](const std::string& variant) -> const Case* {
      for (const Case& cs : cases) {
        if (cs.m == m && cs.layer == layer && cs.variant == variant) return &cs;
      }
      return nullptr;
    };
    double best = 0, base = 0;
    for (const Variant& v : variants) {
      const Case* cs = find(v.name);
      if (cs != nullptr && cs->seconds > 0 && (best == 0 || cs->seconds < best)) best = cs->seconds;
      if (v.dense_bf16 && cs != nullptr) base = cs->seconds;
    }
    fmt::print("{:<{}} {:>5}", layer, width, m);
    for (const Variant& v : variants) {
      const Case* cs = find(v.name);
      std::string cell = "-";
      if (cs != nullptr && !cs->passed) {
        cell = "WRONG";
      } else if (cs != nullptr && cs->timed) {
        cell = fmt::format("{}{}", cs->seconds == best ? "*" : "", toolkit::format_ms(cs->seconds));
        if (base > 0 && cs->seconds > 0 && !v.dense_bf16)
          cell += fmt::format(" {:.2f}x", base / cs->seconds);
        if (v.name == "auto") cell = cs->route + " " + cell;
      }
      fmt::print(" {:>16}", cell);
    }
    fmt::print("\n");
  }
  // One line per route and reason, with the Ms it covers ("<route> at M=<m>: <reason>").
  std::vector<std::pair<std::string, std::string>> lines;  // (route + reason, Ms)
  for (const std::string& why : skipped) {
    const std::size_t at = why.find(" at M="), colon = why.find(':', at);
    const std::string key = why.substr(0, at) + why.substr(colon);
    const std::string m = why.substr(at + 6, colon - at - 6);
    auto it =
        std::find_if(lines.begin(), lines.end(), [&](const auto& l) { return l.first == key; });
    if (it == lines.end()) {
      lines.emplace_back(key, m);
    } else {
      it->second += "," + m;
    }
  }
  for (const auto& [key, m] : lines) {
    const std::size_t colon = key.find(':');
    fmt::print("  not run: {} at M={}{}\n", key.substr(0, colon), m, key.substr(colon));
  }
}

// What a --weights file or checkpoint gave: its FP4 layers (and their sources), its FP8 ones,
// its BF16/F32 linear layers, its embedding tables, and the layers that look quantized but that
// no loader here reads.
struct LoadedWeights {
  ModelShape shape;
  std::vector<HostQuantWeights> host;
  std::vector<Fp8Layer> fp8;
  std::map<std::string, std::vector<std::string>> by_source;
  std::vector<DenseLayer> plain;        // BF16/F32 linears, as BF16
  std::vector<std::string> plain_f32;   // those of them stored as F32 (rounded to BF16)
  std::vector<std::string> embeddings;  // "<name>.weight" tables, looked up, not multiplied
  // Packed MoE projections (gpt-oss's "<p>_blocks"): quantized layers, not benched here.
  std::vector<std::string> experts;
  std::vector<RejectedLayer> unread;
  // Every quantized layer and what it read as (Nvfp4Linear::source, fp8_layer_source).
  std::vector<std::pair<std::string, std::string>> quantized;
  std::optional<DeclaredQuantization> declared;  // the folder's config, when it declares one
};

// Whether a BF16/F32 "<layer>.weight" is an embedding table by transformers' names for them
// (Llama's and Qwen's embed_tokens, GPT-2's wte, BERT's word_embeddings, GPT-NeoX's embed_in,
// Llama's original tok_embeddings): looked up by token, never multiplied, so never benched.
bool is_embedding(std::string_view layer) {
  const std::string_view last = layer.substr(layer.rfind('.') + 1);  // npos + 1: the whole name
  for (const std::string_view e :
       {"embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings"}) {
    if (last == e) return true;
  }
  return false;
}

// A BF16 or F32 "<layer>.weight" [N, K] as BF16 (F32 rounded to nearest even).
DenseLayer read_plain_layer(const SafetensorsFile& file, const std::string& layer) {
  const std::string tensor = layer + ".weight";
  const SafetensorsTensorInfo& info = file.info(tensor);
  const std::span<const std::byte> bytes = file.bytes(tensor);
  DenseLayer l{layer, info.shape[0], info.shape[1], {}};
  l.w.resize(static_cast<std::size_t>(l.n * l.k));
  if (info.dtype == "BF16") {
    std::memcpy(l.w.data(), bytes.data(), l.w.size() * 2);
  } else {
    for (std::size_t i = 0; i < l.w.size(); ++i) {
      float f;
      std::memcpy(&f, bytes.data() + i * 4, 4);
      l.w[i] = num::f32_to_bf16(f);
    }
  }
  return l;
}

// Loads every linear layer of `file` into `out`: the FP8 block-128 ones (views into `file`, or
// into the in-memory rewrite of a layer whose block scales are stored another way, which `keep`
// then holds), the FP4 ones (copied), the BF16/F32 ones (copied as BF16; load_weights decides
// what runs them) and the embedding tables (named), and notes the quantized-looking ones it
// cannot read. Returns whether an FP8 layer views `file` itself.
bool load_layers(const SafetensorsFile& file, LoadedWeights& out, std::list<SafetensorsFile>& keep,
                 GptqZeros gptq_zeros) {
  bool viewed = false;
  const std::vector<std::string> fp8 = fp8_linear_layers(file);
  for (const std::string& name : fp8) {
    if (std::optional<SafetensorsFile> rewritten = fp8_scales_as_inv(file, name)) {
      keep.push_back(std::move(*rewritten));
      out.fp8.push_back({name, load_fp8_linear(keep.back(), name)});
    } else {
      out.fp8.push_back({name, load_fp8_linear(file, name)});
      viewed = true;
    }
    out.quantized.emplace_back(name, fp8_layer_source(file, name));
  }
  // Packed MoE projections are quantized layers of the checkpoint, held to its config by their
  // experts module as metrale.load holds them; --weights runs dense GEMMs, so they are named
  // and not benched (they were passed over in silence, and the attention layers a gpt-oss
  // config leaves in BF16 were then quantized as a checkpoint of floats alone).
  PackedExpertsScan packed = scan_packed_experts(file);
  for (const PackedExperts& e : packed.found) {
    out.experts.push_back(e.projection);
    std::pair<std::string, std::string> module{std::string(module_of(e.projection)), e.source};
    // gate_up and down share their experts module: named once.
    if (std::find(out.quantized.begin(), out.quantized.end(), module) == out.quantized.end()) {
      out.quantized.push_back(std::move(module));
    }
  }
  for (RejectedLayer& r : packed.rejected) out.unread.push_back(std::move(r));
  const LinearLayerScan scan = scan_linear_layers(file);
  for (const RejectedLayer& r : scan.rejected) {
    if (r.quantized && std::find(fp8.begin(), fp8.end(), r.layer) == fp8.end()) {
      out.unread.push_back(r);
    }
  }
  for (const std::string& name : scan.layers) {
    const std::string dtype =
        file.contains(name + ".weight") ? file.info(name + ".weight").dtype : std::string();
    if (dtype == "BF16" || dtype == "F32") {
      if (is_embedding(name)) {
        out.embeddings.push_back(name + ".weight");
        continue;
      }
      out.plain.push_back(read_plain_layer(file, name));
      if (dtype == "F32") out.plain_f32.push_back(name);
      continue;
    }
    Nvfp4Linear l = load_nvfp4_linear(file, name, gptq_zeros);
    out.shape.layers.push_back({name, l.w.n, l.w.k});
    out.host.push_back(std::move(l.w));
    out.by_source[l.source].push_back(name);
    out.quantized.emplace_back(name, l.source);
  }
  return viewed;
}

// A checkpoint of BF16/F32 layers alone (no quantized layer): its linears quantized to NVFP4 on
// load, the bench's way to show a BF16 model's layers as NVFP4. Said by name on stderr.
void quantize_plain_layers(LoadedWeights& out) {
  for (DenseLayer& l : out.plain) {
    std::vector<float> w(l.w.size());
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = num::bf16_to_f32(l.w[i]);
    const bool f32 =
        std::find(out.plain_f32.begin(), out.plain_f32.end(), l.name) != out.plain_f32.end();
    out.shape.layers.push_back({l.name, l.n, l.k});
    out.host.push_back(quantize_nvfp4(w, l.n, l.k));
    out.by_source[f32 ? "F32, quantized to NVFP4 on load" : "BF16, quantized to NVFP4 on load"]
        .push_back(l.name);
  }
  out.plain.clear();
}

// Loads --weights: a safetensors file, a sharded checkpoint's index, or a folder holding either
// (each layer of a sharded one gathered across its shards). `files` keeps what the FP8 layers
// view. Error(kIo), before anything is timed, naming each quantized-looking layer it cannot read
// (rather than a bench of the rest that says nothing of them), or a checkpoint without a layer.
LoadedWeights load_weights(const std::string& weights, std::list<SafetensorsFile>& files,
                           std::string& path) {
  path = resolve_checkpoint_path(weights);
  LoadedWeights out;
  // The folder's config, when it declares a quantization: GPTQ's zero-point convention comes
  // from it (checkpoint_format), and the tensors are held to it below.
  out.declared = read_declared_quantization(std::filesystem::path(path).parent_path().string());
  const GptqZeros gptq_zeros =
      out.declared && out.declared->gptq_v2 ? GptqZeros::kAsStored : GptqZeros::kMinusOne;
  if (is_checkpoint_index(path)) {
    const ShardedCheckpoint ckpt = ShardedCheckpoint::open(path);
    for (const std::string& prefix : tensor_prefixes(ckpt)) {
      const auto view = files.insert(files.end(), gather_layer(ckpt, prefix));
      if (!load_layers(*view, out, files, gptq_zeros)) files.erase(view);  // nothing views it
    }
  } else {
    files.push_back(SafetensorsFile::open(path));
    const SafetensorsFile& file = files.back();
    load_layers(file, out, files, gptq_zeros);
    // A file of FP8 layers alone has no 4-bit layer to load, which is no error; a file of
    // neither is, naming each candidate and why.
    if (out.shape.layers.empty() && out.fp8.empty() && out.plain.empty() && out.experts.empty()) {
      (void)require_linear_layers(file);
    }
  }
  // GPTQ's zero-point convention is the folder config's checkpoint_format; without one a file is
  // read as GPTQ's own default, and a gptq_v2 file would read each zero point one off: say so.
  const bool gptq = std::any_of(out.by_source.begin(), out.by_source.end(),
                                [](const auto& s) { return s.first.starts_with("GPTQ"); });
  if (!out.declared && gptq) {
    fmt::print(stderr,
               "metrale: [bench] warning: {} holds GPTQ layers but no config.json beside it "
               "declares the quantization: zero points read as checkpoint_format \"gptq\" "
               "(stored minus one); a \"gptq_v2\" file needs its config.json\n",
               path);
  }
  // The folder's config, when it declares a quantization, must agree with the tensors: its
  // format in every quantized layer, and no Linear its quantizer targets left in plain floats.
  if (out.declared && out.unread.empty()) {
    std::vector<std::string> plain;
    for (const DenseLayer& l : out.plain) plain.push_back(l.name);
    check_declared(*out.declared, "bench", out.quantized, plain);
  }
  // A quantized checkpoint's BF16/F32 linears were left so by its producer (lm_head, the
  // modules it was told to exclude): they run as dense BF16 GEMMs, as a server runs them. Only
  // a checkpoint with no quantized layer has them quantized, which the bench says by name.
  if (out.host.empty() && out.fp8.empty() && out.experts.empty()) quantize_plain_layers(out);
  if (!out.unread.empty()) {
    std::string why;
    for (const RejectedLayer& r : out.unread) {
      why += fmt::format("\n  tensor '{}': {}", r.tensor, r.why);
    }
    throw Error(ErrorCode::kIo, "bench",
                fmt::format("{}: {} quantized layer(s) that metrale cannot read; nothing was "
                            "benched:{}",
                            path, out.unread.size(), why));
  }
  if (out.shape.layers.empty() && out.fp8.empty() && out.plain.empty()) {
    if (!out.experts.empty()) {
      throw Error(ErrorCode::kIo, "bench",
                  fmt::format("{} holds packed MoE experts alone ({}), which --weights does not "
                              "bench (it runs dense GEMMs); `metrale bench --moe gpt-oss-20b` "
                              "runs their layer shapes",
                              path, fmt::join(out.experts, ", ")));
    }
    throw Error(ErrorCode::kIo, "bench",
                fmt::format("{} holds no linear layer metrale can load{}", path,
                            out.embeddings.empty() ? ""
                                                   : fmt::format(" (only embedding tables: {})",
                                                                 fmt::join(out.embeddings, ", "))));
  }
  return out;
}

// One line on stderr of what --weights gave: its layers by format (the BF16 ones that were
// quantized on load among them, by name), its FP8 layers, the BF16 ones run dense and the
// embedding tables left out, by name.
void say_what_was_loaded(const std::string& path, const LoadedWeights& w) {
  std::string what;
  for (const auto& [source, names] : w.by_source) {
    what += fmt::format("{}{} layer(s) {}", what.empty() ? "" : "; ", names.size(), source);
    if (source.find("on load") != std::string::npos) {
      what += fmt::format(" ({})", fmt::join(names, ", "));
    }
  }
  if (!w.fp8.empty()) {
    what += fmt::format("{}{} FP8 block-128 layer(s)", what.empty() ? "" : "; ", w.fp8.size());
  }
  if (!w.plain.empty()) {
    std::vector<std::string> names;
    for (const DenseLayer& l : w.plain) names.push_back(l.name);
    what += fmt::format("{}{} layer(s) kept BF16, run as dense BF16 GEMMs ({}{})",
                        what.empty() ? "" : "; ", w.plain.size(), fmt::join(names, ", "),
                        w.plain_f32.empty() ? ""
                                            : fmt::format("; stored F32, rounded to BF16: {}",
                                                          fmt::join(w.plain_f32, ", ")));
  }
  if (!w.embeddings.empty()) {
    what += fmt::format("{}not benched, embedding tables (looked up, not multiplied): {}",
                        what.empty() ? "" : "; ", fmt::join(w.embeddings, ", "));
  }
  if (!w.experts.empty()) {
    what += fmt::format(
        "{}not benched, packed MoE experts (`metrale bench --moe` runs MoE "
        "layer shapes): {}",
        what.empty() ? "" : "; ", fmt::join(w.experts, ", "));
  }
  fmt::print(stderr, "metrale: [bench] {}: {}\n", path, what);
  if (w.declared) {
    fmt::print(stderr, "metrale: [bench] declared {}, every quantized layer holds it{}{}\n",
               w.declared->describe(), w.declared->activations.empty() ? "" : "; ",
               w.declared->activations);
  }
}

}  // namespace

int run_bench(const CommonOptions& options, const BenchOptions& bench) {
  const InterruptScope ctrl_c;  // Ctrl-C stops the timing, not the teardown
  std::string why;
  std::unique_ptr<Backend> backend = create_backend(options.backend, &why);
  const bool gpu = backend->name() != "cpu";
  ModelShape shape;
  std::vector<HostQuantWeights> host;
  // A file's FP8 layers (DeepSeek-V3 / Qwen), views into the files kept here: the W8A8 op runs
  // them.
  std::list<SafetensorsFile> files;
  std::string weights_path;
  std::vector<Fp8Layer> fp8_layers;
  // A quantized checkpoint's BF16 linears: the backend's dense BF16 GEMM runs them.
  std::vector<DenseLayer> dense_layers;
  if (!bench.weights.empty()) {
    // Real weights: every FP4 linear layer, every FP8 one and every BF16/F32 one (dense, or
    // quantized on load in a checkpoint without quantized layers); each is loaded (checked) here,
    // so a malformed one is exit 2 naming its tensor before anything is allocated.
    LoadedWeights w = load_weights(bench.weights, files, weights_path);
    say_what_was_loaded(weights_path, w);
    shape = std::move(w.shape);
    host = std::move(w.host);
    fp8_layers = std::move(w.fp8);
    dense_layers = std::move(w.plain);
  } else if (!bench.shapes.empty()) {
    for (const auto& [n, k] : bench.shapes)
      shape.layers.push_back({fmt::format("{}x{}", n, k), n, k});
  } else {
    shape = model_shape(bench.model);
  }
  std::vector<std::int64_t> ms = bench.ms;
  if (ms.empty())
    ms = gpu ? std::vector<std::int64_t>{1, 16, 4096} : std::vector<std::int64_t>{1, 16, 64};
  for (std::int64_t m : ms) {
    if (m < 1)
      throw Error(ErrorCode::kInvalidArgument, "bench",
                  fmt::format("M = {} must be at least 1", m));
  }

  // An impossible size is refused before anything is allocated (std::bad_alloc says nothing).
  std::vector<GemmLayerSize> sizes;
  for (std::size_t i = 0; i < shape.layers.size(); ++i) {
    sizes.push_back({shape.layers[i].name, shape.layers[i].n, shape.layers[i].k, host.size() <= i});
  }
  require_gemm_fit(*backend, "bench", sizes, *std::max_element(ms.begin(), ms.end()));
  // FP8 layers need the backend's block-scaled FP8 GEMM: without it they are left out, saying why.
  if (const std::string no_fp8 = backend->dense_gemm_unavailable(DenseKind::kE4m3Block128);
      !fp8_layers.empty() && !no_fp8.empty()) {
    fmt::print(stderr, "metrale: [bench] {} FP8 layer(s) of {} left out: {}\n", fp8_layers.size(),
               weights_path, no_fp8);
    fp8_layers.clear();
  }
  // Likewise the BF16 layers without its dense BF16 GEMM.
  if (const std::string no_bf16 = backend->dense_gemm_unavailable(DenseKind::kBf16);
      !dense_layers.empty() && !no_bf16.empty()) {
    fmt::print(stderr, "metrale: [bench] {} BF16 layer(s) of {} left out: {}\n",
               dense_layers.size(), weights_path, no_bf16);
    dense_layers.clear();
  }
  if (shape.layers.empty() && fp8_layers.empty() && dense_layers.empty()) {
    throw Error(ErrorCode::kUnavailable, "bench",
                fmt::format("{} holds only layers this backend cannot run", weights_path));
  }

  const std::string backend_name(backend->name()), device = backend->device_name();
  const LedgerProbe probe = backend->ledger_probe();
  ModelScope scope(std::move(backend));
  Backend& b = scope.backend();
  toolkit::Roofline roof = toolkit::measure_roofline(b);
  // The roofs are read again after each M's timing and at the end, and the highest reading is
  // the roof: on a shared machine they drift with other tenants, and a roof read in a busy moment
  // would put kernels timed in a quiet one above 100%.
  toolkit::RoofReadings bw_readings, flops_readings;
  bw_readings.add(roof.bandwidth);
  flops_readings.add(roof.flops);
  const auto read_roofs = [&] {
    std::string of;
    bw_readings.add(toolkit::measure_bandwidth(b));
    flops_readings.add(toolkit::measure_compute(b, &of));
  };

  std::mt19937_64 rng(std::random_device{}());
  std::int64_t max_n = 0, max_k = 0;
  for (std::size_t i = 0; i < shape.layers.size(); ++i) {
    const Layer& l = shape.layers[i];
    if (host.size() <= i) {
      host.push_back(toolkit::random_weights(WeightFormat::kNvfp4, l.n, l.k, rng));
    }
    max_n = std::max(max_n, l.n);
    max_k = std::max(max_k, l.k);
  }
  for (const Fp8Layer& l : fp8_layers) {
    max_n = std::max(max_n, l.w.n);
    max_k = std::max(max_k, l.w.k);
  }
  for (const DenseLayer& l : dense_layers) {
    max_n = std::max(max_n, l.n);
    max_k = std::max(max_k, l.k);
  }
  // The decode layout where the backend has a kernel that reads it (verified on a device or not:
  // a bench measures what the automatic choice does not take yet) for the M that decode takes;
  // the source layout for the rest (only the decode and fused routes read the decode layout).
  const std::int64_t decode_m = ops::decode_max_m(b);
  const bool compare = bench.compare_routes.value_or(gpu);
  // (The fused route reads the decode layout too: the comparison needs it at any M.)
  const bool any_q4 = !shape.layers.empty();
  // INT4 weights have no FP4 decode layout; on the CPU they take the panel layout as FP4 does.
  const bool int4 = std::any_of(host.begin(), host.end(), [](const HostQuantWeights& h) {
    return h.format == WeightFormat::kInt4;
  });
  const bool packed_wanted =
      any_q4 && !int4 && ops::reads_decode_layout(b) &&
      (compare || std::any_of(ms.begin(), ms.end(), [&](std::int64_t m) { return m <= decode_m; }));
  // With --compare-routes (the default on a GPU), every other route the backend offers runs too
  // (on the source layout, which all of them read), and the dense BF16 GEMM of its library on
  // the weights dequantized to BF16 as the baseline.
  const bool source_wanted =
      any_q4 && (!packed_wanted || compare ||
                 std::any_of(ms.begin(), ms.end(), [&](std::int64_t m) { return m > decode_m; }));
  // Timing walks the layers in turn, as a forward pass does, so a layer is not read from a cache
  // its own previous call filled; where one block's weights are too few for that, whole copies
  // of the block join the turn (toolkit/rotation.h). See Note [layer rotation] in docs/NOTES.md.
  double pack_seconds = 0;
  const auto upload_rotation = [&](ops::UploadLayout layout, const char* tag) {
    std::vector<std::vector<const ops::WeightsResource*>> rot;
    std::size_t copies = 1;
    for (std::size_t r = 0; r < copies; ++r) {
      std::vector<const ops::WeightsResource*> copy;
      std::size_t block_bytes = 0;
      for (std::size_t i = 0; i < shape.layers.size(); ++i) {
        const std::string label =
            r == 0 ? fmt::format("weights {}{}", shape.layers[i].name, tag)
                   : fmt::format("weights {}{} (copy {})", shape.layers[i].name, tag, r);
        copy.push_back(&scope.add(ops::make_weights_resource(b, host[i], label, layout)));
        if (r == 0) pack_seconds += copy.back()->pack_seconds();
        block_bytes += copy.back()->weights().codes_bytes + copy.back()->weights().scales_bytes;
      }
      if (r == 0) copies = toolkit::rotation_copies(block_bytes);
      rot.push_back(std::move(copy));
    }
    return rot;
  };
  // The panel layout where the backend prefers it (the CPU with AVX-512 BF16): its decode and
  // tiled routes read it, the routes compared with --compare-routes do not. INT4 layers take it
  // where every K is a multiple of 32 (ops::int4_panels_ok); else the whole block stays in the
  // source layout, so that its layers compare alike.
  const bool panels_fit = (!int4 || ops::reads_int4_panel_layout(b)) &&
                          std::all_of(host.begin(), host.end(), [](const HostQuantWeights& h) {
                            return h.format != WeightFormat::kInt4 || ops::int4_panels_ok(h.k);
                          });
  const bool panels_wanted =
      source_wanted && !compare && !bench.source_layout && panels_fit &&
      ops::upload_packing(b, ops::UploadLayout::kBackendPreferred) == ops::WeightPacking::kPanels;
  const auto rotation_source =
      source_wanted ? panels_wanted ? upload_rotation(ops::UploadLayout::kPanels, " (panel layout)")
                                    : upload_rotation(ops::UploadLayout::kSource, "")
                    : std::vector<std::vector<const ops::WeightsResource*>>{};
  const auto rotation_packed = packed_wanted
                                   ? upload_rotation(ops::UploadLayout::kDecode, " (decode layout)")
                                   : std::vector<std::vector<const ops::WeightsResource*>>{};
  const std::int64_t max_m = *std::max_element(ms.begin(), ms.end());
  const DevicePtr a =
      scope.alloc_buffer("activations", static_cast<std::size_t>(max_m * max_k * 2));
  const DevicePtr c = scope.alloc_buffer("outputs", static_cast<std::size_t>(max_m * max_n * 2));
  std::vector<std::uint16_t> ha(static_cast<std::size_t>(max_m * max_k));
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (auto& x : ha) x = num::f32_to_bf16(unit(rng));
  b.copy_h2d(a, ha.data(), ha.size() * 2);
  const StreamHandle stream = gpu ? b.create_stream() : b.default_stream();
  ops::GemmOptions gemm_options;
  if (bench.allow_e4m3) gemm_options.activations = ops::Activations::kAllowE4m3;

  std::vector<Variant> variants{{"auto"}};
  if (compare) {
    for (const ops::GemmRoute r : kComparedRoutes)
      variants.push_back({std::string(ops::to_string(r)), r});
    variants.push_back({"w8a8", ops::GemmRoute::kAuto, false, true});
    variants.push_back({"bf16", ops::GemmRoute::kAuto, true});
  }
  // The baseline's BF16 weights, one set per copy of the rotation: only where every dequantized
  // weight is exact in BF16 (so the baseline computes what the exact routes do and the same check
  // holds it), and the backend has a dense BF16 GEMM.
  std::string baseline_skipped;
  std::vector<std::vector<DevicePtr>> rotation_bf16;
  if (compare) {
    baseline_skipped = b.dense_gemm_unavailable(DenseKind::kBf16);
    std::vector<std::vector<std::uint16_t>> bf16_host;
    for (std::size_t li = 0; li < shape.layers.size() && baseline_skipped.empty(); ++li) {
      const std::vector<float> wf = dequantize(host[li]);
      std::vector<std::uint16_t> wb(wf.size());
      for (std::size_t i = 0; i < wf.size(); ++i) {
        wb[i] = num::f32_to_bf16(wf[i]);
        if (num::bf16_to_f32(wb[i]) != wf[i]) {
          baseline_skipped =
              fmt::format("{}'s dequantized weights are not exact in BF16", shape.layers[li].name);
          break;
        }
      }
      bf16_host.push_back(std::move(wb));
    }
    const std::size_t copies = std::max(rotation_source.size(), rotation_packed.size());
    for (std::size_t r = 0; r < copies && baseline_skipped.empty(); ++r) {
      std::vector<DevicePtr> copy;
      for (std::size_t li = 0; li < shape.layers.size(); ++li) {
        copy.push_back(
            scope.alloc_buffer(fmt::format("bf16 weights {} (copy {})", shape.layers[li].name, r),
                               bf16_host[li].size() * 2));
        b.copy_h2d(copy.back(), bf16_host[li].data(), bf16_host[li].size() * 2);
      }
      rotation_bf16.push_back(std::move(copy));
    }
  }

  // The W8A8 column's weights: each layer requantized once on the host (ops/fp8_requant.h; the
  // check holds the result to the 4-bit weights), uploaded once per copy of the rotation. Only
  // where the backend has the block-scaled FP8 GEMM and the caller allows E4M3 activations.
  std::string w8a8_skipped;
  std::vector<HostE4m3BlockWeights> fp8_host;
  std::vector<std::vector<const ops::Fp8WeightsResource*>> rotation_fp8;
  double requant_seconds = 0;
  if (compare && any_q4) {
    w8a8_skipped = b.dense_gemm_unavailable(DenseKind::kE4m3Block128);
    if (w8a8_skipped.empty() && int4) {
      w8a8_skipped = "its requantization to E4M3 blocks reads FP4 weights, not INT4";
    }
    if (w8a8_skipped.empty() && !bench.allow_e4m3) {
      w8a8_skipped = "it casts A to E4M3, which --allow-e4m3 allows";
    }
  }
  if (compare && any_q4 && w8a8_skipped.empty()) {
    const auto t0 = std::chrono::steady_clock::now();
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    for (const HostQuantWeights& hw : host)
      fp8_host.push_back(requantize_e4m3_block128(hw, threads));
    requant_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::size_t copies = 1;
    for (std::size_t r = 0; r < copies; ++r) {
      std::vector<const ops::Fp8WeightsResource*> copy;
      std::size_t block_bytes = 0;
      for (std::size_t li = 0; li < fp8_host.size(); ++li) {
        const HostE4m3BlockWeights& q = fp8_host[li];
        const std::span<const std::uint8_t> scales(
            reinterpret_cast<const std::uint8_t*>(q.scales.data()), q.scales.size() * 4);
        copy.push_back(&scope.add(std::make_unique<ops::Fp8WeightsResource>(
            b, q.codes, scales, q.n, q.k,
            fmt::format("fp8 weights {} (requantized, copy {})", shape.layers[li].name, r))));
        block_bytes += copy.back()->weights().codes_bytes + copy.back()->weights().scales_bytes;
      }
      if (r == 0) copies = toolkit::rotation_copies(block_bytes);
      rotation_fp8.push_back(std::move(copy));
    }
  }

  std::vector<Case> cases;
  std::vector<std::string> skipped;  // "route at M: why", for the side-by-side table
  bool ok = true;
  Progress progress(isatty(STDOUT_FILENO) && !options.json,
                    ms.size() * shape.layers.size() * variants.size());
  for (std::int64_t m : ms) {
    if (any_q4 && m != ms.front() && !interrupted()) read_roofs();  // between the Ms' timing
    for (const Variant& v : variants) {
      if (!any_q4 || interrupted()) break;
      if (v.w8a8 && !w8a8_skipped.empty()) {
        skipped.push_back(fmt::format("w8a8 at M={}: {}", m, w8a8_skipped));
        continue;
      }
      // The automatic route reads the layout uploaded for its M; the fused route the decode
      // layout; every other forced route the source one.
      const bool fused = v.route == ops::GemmRoute::kFused;
      if (fused && rotation_packed.empty()) {
        skipped.push_back(
            fmt::format("fused at M={}: the backend does not prefer the decode "
                        "layout, so no weights were uploaded in it",
                        m));
        continue;
      }
      const auto& rotation = fused || (v.name == "auto" && packed_wanted && m <= decode_m)
                                 ? rotation_packed
                                 : rotation_source;
      ops::GemmOptions vopt = gemm_options;
      vopt.route = v.route;
      // A forced route is compared only where it is not the automatic one, reads the weights
      // uploaded for this M, and is offered by the backend (the reason it is not, otherwise).
      if (v.name != "auto" && !v.dense_bf16 && !v.w8a8) {
        try {
          const auto& auto_rotation =
              packed_wanted && m <= decode_m ? rotation_packed : rotation_source;
          if (&auto_rotation == &rotation &&
              ops::choose_route(b, m, rotation.front().front()->weights(), gemm_options) == v.route)
            continue;
          (void)ops::choose_route(b, m, rotation.front().front()->weights(), vopt);
        } catch (const Error& e) {
          skipped.push_back(fmt::format("{} at M={}: {}", v.name, m, e.message()));
          continue;
        }
      }
      // Far above the decode route's largest M its kernels re-read every weight once per
      // batch of rows: minutes of a GPU's time on a prefill M for a figure nobody would choose.
      if (v.route == ops::GemmRoute::kDecode && m > 4 * decode_m) {
        skipped.push_back(
            fmt::format("decode at M={}: the auto route takes it up to M = {}; not timed above "
                        "M = {}",
                        m, decode_m, 4 * decode_m));
        continue;
      }
      if (v.dense_bf16 && !baseline_skipped.empty()) {
        skipped.push_back(fmt::format("bf16 at M={}: {}", m, baseline_skipped));
        continue;
      }
      // Every layer is checked first; the ones that pass are then timed together, in turns.
      std::vector<std::size_t> timed;  // layers that passed, and their entries in cases
      std::vector<std::size_t> case_of(shape.layers.size());
      // One plan per layer at this M, made once and run for the check and every timed call (any
      // copy of the layer's weights has its shape, format and layout).
      std::vector<ops::GemmPlan> plans;
      std::vector<ops::GemmWorkspace> workspaces;
      std::vector<DenseGemmPlan> dense_plans;
      std::vector<DevicePtr> dense_workspaces;
      std::vector<ops::Fp8GemmPlan> fp8_plans;
      std::vector<ops::Fp8Workspace> fp8_workspaces;
      // One call of layer li in copy r of the block, queued on the stream.
      const auto queue = [&](std::size_t r, std::size_t li) {
        if (v.dense_bf16) {
          DenseGemmArgs args;
          args.a = a;
          args.b = rotation_bf16[r][li];
          args.c = c;
          args.workspace = dense_workspaces[li];
          args.workspace_bytes = dense_plans[li].workspace_bytes;
          b.run_dense_gemm(dense_plans[li], args, stream);
        } else if (v.w8a8) {
          ops::run(fp8_plans[li], stream, a, rotation_fp8[r][li]->weights(), c, fp8_workspaces[li]);
        } else {
          ops::run(plans[li], stream, a, rotation[r][li]->weights(), c, workspaces[li],
                   gemm_options.bias);
        }
      };
      const std::size_t copies = v.dense_bf16 ? rotation_bf16.size()
                                 : v.w8a8     ? rotation_fp8.size()
                                              : rotation.size();
      for (std::size_t li = 0; li < shape.layers.size() && !interrupted(); ++li) {
        const Layer& l = shape.layers[li];
        progress.step(cases.size(), fmt::format("{} M={} {}", l.name, m, v.name));
        std::vector<std::uint16_t> a_rows(ha.begin(), ha.begin() + m * l.k);
        // A is [M, K] for this layer's K: the first M·K values of the activation buffer.
        ops::GemmRoute route = ops::GemmRoute::kTiled;  // the baseline is held as an exact route
        std::string plan_text;
        if (v.dense_bf16) {
          dense_plans.push_back(b.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, m, l.n, l.k}));
          dense_workspaces.push_back(
              dense_plans.back().workspace_bytes == 0
                  ? DevicePtr{}
                  : b.op_cache().scratch(b, ops::gemm_scratch_tag(b, stream, "blas_workspace"),
                                         dense_plans.back().workspace_bytes, stream));
          plan_text = fmt::format("dense bf16 M={} N={} K={}: {}; workspace {} B", m, l.n, l.k,
                                  dense_plans.back().describe, dense_plans.back().workspace_bytes);
        } else if (v.w8a8) {
          fp8_plans.push_back(ops::plan(b, m, rotation_fp8.front()[li]->weights(), {}));
          fp8_workspaces.push_back(ops::scratch_workspace(fp8_plans.back(), stream));
          plan_text = fp8_plans.back().describe();
        } else {
          plans.push_back(ops::plan(b, m, rotation.front()[li]->weights(), vopt));
          workspaces.push_back(ops::scratch_workspace(plans.back(), stream));
          route = plans.back().route;
          plan_text = plans.back().describe();
        }
        Case cs{
            l.name,   m,
            l.n,      l.k,
            v.name,   v.dense_bf16 ? "bf16" : v.w8a8 ? "w8a8" : std::string(ops::to_string(route)),
            plan_text};
        // Every copy the timing cycles through is checked (toolkit/rotation.h), so no copy whose
        // upload went wrong is timed: copy 0 with the full sample, the others with a smaller one.
        const auto check_copy = [&](std::size_t r, int samples) {
          b.memset(c, 0xFF, static_cast<std::size_t>(m * l.n * 2));  // poison: NaN in BF16
          queue(r, li);
          b.synchronize(stream);
          std::vector<std::uint16_t> out(static_cast<std::size_t>(m * l.n));
          b.copy_d2h(out.data(), c, out.size() * 2);
          // The W8A8 column against the 4-bit weights it was requantized from, with a GPU's FP8
          // tensor cores' allowance (tests/ops/fp8_gemm_test.cpp).
          return v.w8a8 ? toolkit::sampled_check_w8a8(a_rows, out, fp8_host[li].view(), m,
                                                      gpu ? 2 * toolkit::kFp8MmaTerm : 0.0, rng,
                                                      &host[li], samples)
                        : toolkit::sampled_check(a_rows, out, host[li], m, route, rng, samples);
        };
        const toolkit::RotationCheck check = toolkit::check_rotation(copies, check_copy);
        cs.error = check.failed_copy ? check.failed.normalized : check.first.normalized;
        cs.passed = check.passed();
        cs.copies_checked = check.copies;
        if (check.failed_copy) cs.failed_copy = static_cast<std::int64_t>(*check.failed_copy);
        if (!cs.passed) {
          ok = false;
        } else {
          timed.push_back(li);
          case_of[li] = cases.size();
        }
        cases.push_back(cs);
      }
      if (timed.empty()) continue;

      const auto t = time_in_turns(b, stream, copies, shape.layers.size(), timed, queue,
                                   bench.graph, bench.repeats);
      for (std::size_t li : timed) {
        Case& cs = cases[case_of[li]];
        // The weights' own bytes (the source layout's), whichever layout streamed them: the
        // decode layout's padding and scale table are overhead the kernel pays, not work. The
        // baseline streams its BF16 weights, the W8A8 column its E4M3 ones.
        const double weight_bytes =
            v.dense_bf16 ? static_cast<double>(cs.n * cs.k * 2)
            : v.w8a8     ? static_cast<double>(rotation_fp8.front()[li]->weights().codes_bytes +
                                           rotation_fp8.front()[li]->weights().scales_bytes)
                         : static_cast<double>(host[li].codes.size() + host[li].scales.size());
        set_rates(cs, median(t[li]), weight_bytes, roof.flops);
      }
    }
  }
  // The FP8 checkpoint layers, on the W8A8 op alone.
  if (!fp8_layers.empty() && !interrupted()) {
    ok = bench_fp8_layers(scope, fp8_layers, ms,
                          LayerBenchRun{a, c, ha, stream, bench.graph, bench.repeats, roof.flops},
                          rng, cases) &&
         ok;
  }
  // The BF16 layers a quantized checkpoint kept, on the dense BF16 GEMM.
  if (!dense_layers.empty() && !interrupted()) {
    ok = bench_dense_layers(scope, dense_layers, ms,
                            LayerBenchRun{a, c, ha, stream, bench.graph, bench.repeats, roof.flops},
                            rng, cases) &&
         ok;
  }
  // The last reading, after all the timing; every share is of the highest reading.
  if (!interrupted()) read_roofs();
  roof.bandwidth = bw_readings.highest();
  roof.bandwidth_of +=
      fmt::format(", the highest of {} readings through the run", bw_readings.count());
  roof.flops = flops_readings.highest();
  if (roof.flops > 0)
    roof.flops_of +=
        fmt::format(", the highest of {} readings through the run", flops_readings.count());
  bool roof_low = false;
  for (Case& cs : cases) {
    if (!cs.timed) continue;  // failed its check, not timed
    const toolkit::RoofShare bw = toolkit::roof_share(cs.gbps * 1e9, roof.bandwidth);
    const toolkit::RoofShare fl = toolkit::roof_share(cs.tflops * 1e12, roof.flops);
    cs.pct_bw = bw.pct;
    cs.pct_flops = fl.pct;
    cs.above_bw = bw.above;
    cs.above_flops = fl.above;
    roof_low = roof_low || bw.above || fl.above;
  }
  const std::string roof_note =
      roof_low ? "a share above 100% (marked !) means the roof read low in this run: the machine "
                 "was busier while the roof was read than while that case was timed; the share "
                 "bounds nothing"
               : "";
  if (gpu) b.destroy_stream(stream);
  // The scratch pool's figures after every case ran, before teardown gives its memory back.
  const PoolStats pool = b.alloc_stats().scratch_pool;
  const std::string pool_line = b.op_cache().pool_summary();
  plant_leak_for_tests(b);
  const std::string report_before = b.alloc_report(5);
  const TeardownReport td = scope.teardown();
  // Zero live bytes is not enough: the sweep frees what no resource released, so a leak it
  // found fails the run too, naming the call sites.
  const bool zero = probe.live_bytes() == 0 && td.clean();
  ok = ok && zero;
  if (interrupted()) {
    fmt::print(stderr, "metrale bench: interrupted after {} case(s); teardown {}\n", cases.size(),
               zero ? "left 0 bytes" : "not clean: " + td.leak_summary());
    return kInterrupted;
  }

  // Per block: the sum of its layers at each M, and the decode-step estimate for the model.
  struct Block {
    std::int64_t m;
    double seconds;
    bool timed;  // some layer at this M passed and was timed
  };
  std::vector<Block> blocks;
  for (std::int64_t m : ms) {
    double s = 0;
    bool timed = false;
    for (const Case& cs : cases) {
      if (cs.m != m || cs.variant != "auto" || !cs.timed) continue;
      s += cs.seconds;
      timed = true;
    }
    blocks.push_back({m, s, timed});
  }

  if (options.json) {
    nlohmann::json doc{
        {"backend", backend_name},
        {"device", device},
        // The set the CPU kernels ran with: the roof below is that set's.
        {"cpu_isa", backend_name == "cpu" ? nlohmann::json(cpu_kernel_isa()) : nlohmann::json()},
        {"chosen", why},
        {"model", !bench.weights.empty() ? bench.weights
                  : bench.shapes.empty() ? bench.model
                                         : "custom"},
        {"graph", bench.graph},
        {"timing", kTimingMethod},
        {"allow_e4m3", bench.allow_e4m3},
        {"roofline",
         {{"bandwidth_GBps", roof.bandwidth / 1e9},
          {"bandwidth_of", roof.bandwidth_of},
          {"TFLOPs", roof.flops / 1e12},
          {"flops_of", roof.flops_of},
          {"bandwidth_readings", bw_readings.count()},
          {"flops_readings", flops_readings.count()}}},
        {"checks", kChecks},
        {"roof_read_low", roof_low},
        {"roof_note", roof_note},
        {"decode_layout_pack_s", pack_seconds},
        {"w8a8_requantize_s", requant_seconds},
        {"scratch_pool",
         {{"summary", pool_line},
          {"current_bytes", pool.current_bytes},
          {"peak_bytes", pool.peak_bytes},
          {"reserved_bytes", pool.reserved_bytes},
          {"free_bytes", pool.free_bytes},
          {"largest_free_bytes", pool.largest_free_bytes},
          {"fragmentation", pool.fragmentation()},
          {"allocations", pool.allocations},
          {"reuses", pool.reuses},
          {"grows", pool.grows}}},
        {"live_bytes_after_teardown", probe.live_bytes()},
        {"swept_after_teardown", td.swept},
        {"passed", ok}};
    for (const Case& cs : cases) {
      doc[cs.variant == "auto" ? "layers" : "routes"].push_back(
          {{"layer", cs.layer},
           {"variant", cs.variant},
           {"M", cs.m},
           {"N", cs.n},
           {"K", cs.k},
           {"route", cs.route},
           {"plan", cs.plan},
           {"ms", cs.seconds * 1e3},
           {"GBps", cs.gbps},
           {"TFLOPs", cs.tflops},
           {"pct_bandwidth", cs.pct_bw},
           {"pct_flops", cs.pct_flops},
           {"above_roof", cs.above_bw || cs.above_flops},
           {"error", cs.error},
           {"copies_checked", cs.copies_checked},
           {"failed_copy",
            cs.failed_copy >= 0 ? nlohmann::json(cs.failed_copy) : nlohmann::json()}});
    }
    for (const Block& bl : blocks) {
      // null where nothing was timed or the time was below the timer's resolution, never inf.
      const std::optional<double> tps = toolkit::tokens_per_s(
          static_cast<double>(bl.m), bl.seconds * static_cast<double>(shape.blocks));
      doc["blocks"].push_back({{"M", bl.m},
                               {"ms", bl.seconds * 1e3},
                               {"blocks", shape.blocks},
                               {"timed", bl.timed},
                               {"tokens_per_s", tps ? nlohmann::json(*tps) : nlohmann::json()}});
    }
    for (const auto& f : td.failures)
      doc["teardown_failures"].push_back(f.label + ": " + f.message);
    for (const LedgerEntry& e : td.leaks)
      doc["teardown_leaks"].push_back({{"bytes", e.bytes}, {"site", e.site.str()}});
    for (const std::string& reason : skipped) doc["routes_skipped"].push_back(reason);
    fmt::print("{}\n", doc.dump(2));
    return ok ? 0 : 1;
  }

  const std::string what = !bench.weights.empty() ? bench.weights
                           : bench.shapes.empty() ? bench.model
                                                  : "custom shapes";
  fmt::print("metrale bench: {} on {} ({})\n  backend {}\n", what, backend_name, device, why);
  if (backend_name == "cpu") {
    fmt::print(
        "  CPU kernels: {} (the processor's best, or METRALE_CPU_ISA's cap); the compute "
        "roof is read with its instructions\n",
        cpu_kernel_isa());
  }
  fmt::print("  timed with {}\n", kTimingMethod);
  fmt::print("  checked: {}\n", kChecks);
  fmt::print("  roofs measured now: {:.1f} GB/s ({}); {}\n", roof.bandwidth / 1e9,
             roof.bandwidth_of,
             roof.flops > 0 ? fmt::format("{:.3f} TFLOP/s ({})", roof.flops / 1e12, roof.flops_of)
                            : roof.flops_of);
  if (packed_wanted) {
    fmt::print("  decode layout for M <= {}: {} layer(s) repacked at upload in {:.1f} ms\n",
               decode_m, shape.layers.size(), pack_seconds * 1e3);
  }
  if (panels_wanted) {
    fmt::print("  panel layout: {} layer(s) repacked at upload in {:.1f} ms\n", shape.layers.size(),
               pack_seconds * 1e3);
  }
  if (!fp8_host.empty()) {
    std::uint64_t fp8_bytes = 0, q4_bytes = 0;
    for (std::size_t li = 0; li < fp8_host.size(); ++li) {
      const ops::Fp8Weights& w = rotation_fp8.front()[li]->weights();
      fp8_bytes += w.codes_bytes + w.scales_bytes;
      q4_bytes += host[li].codes.size() + host[li].scales.size();
    }
    fmt::print(
        "  w8a8 column: {} layer(s) requantized to 128x128-block E4M3 on the host in {:.1f} ms, "
        "{:.1f} MB on the device ({:.2f}x the 4-bit weights)\n",
        fp8_host.size(), requant_seconds * 1e3, static_cast<double>(fp8_bytes) / 1e6,
        static_cast<double>(fp8_bytes) / static_cast<double>(q4_bytes));
  }
  std::size_t width = 8;
  for (const Layer& l : shape.layers) width = std::max(width, l.name.size());
  for (const Fp8Layer& l : fp8_layers) width = std::max(width, l.name.size());
  for (const DenseLayer& l : dense_layers) width = std::max(width, l.name.size());
  fmt::print("\n{:<{}} {:>5} {:>6} {:>6} {:<7} {:>9} {:>8} {:>6} {:>8} {:>6}  {}\n", "layer", width,
             "M", "N", "K", "route", "ms", "GB/s", "%bw", "TFLOP/s", "%peak", "check");
  for (const Case& cs : cases) {
    if (cs.variant != "auto") continue;
    fmt::print(
        "{:<{}} {:>5} {:>6} {:>6} {:<7} {:>9} {:>8.1f} {:>6} {:>8.3f} {:>6}  {} (err {:.1e})\n",
        cs.layer, width, cs.m, cs.n, cs.k, cs.route,
        cs.timed ? toolkit::format_ms(cs.seconds) : "-", cs.gbps,
        toolkit::format_share({cs.pct_bw, cs.above_bw}), cs.tflops,
        toolkit::format_share({cs.pct_flops, cs.above_flops}),
        cs.passed             ? "ok"
        : cs.failed_copy >= 0 ? fmt::format("WRONG in copy {}", cs.failed_copy)
                              : std::string("WRONG"),
        cs.error);
  }
  if (roof_low) fmt::print("  ! {}\n", roof_note);
  fmt::print("\nplans (as run):\n");
  for (const Case& cs : cases) {
    if (cs.variant == "auto") fmt::print("  {:<{}} {}\n", cs.layer, width, cs.plan);
  }
  if (compare) print_side_by_side(cases, variants, skipped, width);
  fmt::print("\n{:<{}} {:>5} {:>12} {:>22}\n", "block", width, "M", "ms", "model tokens/s");
  for (const Block& bl : blocks) {
    fmt::print(
        "{:<{}} {:>5} {:>12} {:>14} ({} blocks)\n", "block", width, bl.m,
        bl.timed ? toolkit::format_ms(bl.seconds) : "-",
        toolkit::format_tokens_per_s(static_cast<double>(bl.m),
                                     bl.seconds * static_cast<double>(shape.blocks), bl.timed),
        shape.blocks);
  }
  fmt::print("\nscratch pool: {}\n", pool_line);
  fmt::print("\nteardown: {} resource(s) released, {} swept, {} live bytes on the ledger{}\n",
             td.released, td.swept, probe.live_bytes(), zero ? "" : " — FAILED");
  if (!zero) {
    fmt::print("{}", report_before);
    for (const auto& f : td.failures) fmt::print("  {}: {}\n", f.label, f.message);
    if (td.swept > 0) fmt::print("  leaked (the sweep freed them): {}\n", td.leak_summary());
  }
  return ok ? 0 : 1;
}

}  // namespace metrale::cli
