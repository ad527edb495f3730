// Quantized weights on the host: HostWeights (metrale::HostQuantWeights) made from arrays of
// codes and scales, by quantize_nvfp4/quantize_mxfp4, or read from a safetensors checkpoint.
#include <fmt/format.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "arrays.h"
#include "bindings.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/e4m3_block.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/modelopt.h"
#include "metrale/moe_checkpoint.h"
#include "metrale/quant.h"
#include "metrale/quant_config.h"
#include "metrale/safetensors.h"
#include "metrale/sharded_checkpoint.h"

namespace nb = nanobind;

namespace metrale::py {
namespace {

WeightFormat parse_format(std::string_view api, std::string_view text) {
  if (text == "nvfp4") return WeightFormat::kNvfp4;
  if (text == "mxfp4") return WeightFormat::kMxfp4;
  throw Error(ErrorCode::kInvalidArgument, api,
              fmt::format("format: '{}', expected 'nvfp4' or 'mxfp4'", text));
}

WeightLayout parse_layout(std::string_view api, std::string_view text) {
  if (text == "row_major") return WeightLayout::kRowMajor;
  if (text == "transposed") return WeightLayout::kTransposed;
  throw Error(ErrorCode::kInvalidArgument, api,
              fmt::format("layout: '{}', expected 'row_major' or 'transposed'", text));
}

// A host array of the values of v, owned by the array (the vector moves into its capsule).
template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> v, std::int64_t rows, std::int64_t cols) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  const std::size_t shape[2] = {static_cast<std::size_t>(rows), static_cast<std::size_t>(cols)};
  return nb::ndarray<nb::numpy, T>(owned->data(), 2, shape, owner);
}

// W[N, K] from arrays of codes and scales, checked as the upload will need them.
HostQuantWeights from_arrays(const nb::ndarray<nb::ro>& codes, const nb::ndarray<nb::ro>& scales,
                             std::int64_t n, std::int64_t k, std::string_view format,
                             float tensor_scale, std::string_view layout) {
  constexpr std::string_view api = "HostWeights";
  HostQuantWeights w;
  w.format = parse_format(api, format);
  w.layout = parse_layout(api, layout);
  const int group = group_size(w.format);
  if (n < 1 || k < 1 || k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("n = {}, k = {}: both must be positive and k a multiple of {} ({})", n,
                            k, group, format));
  }
  if (n > std::numeric_limits<std::int64_t>::max() / k) {  // n * k / 2 below must not wrap
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("n = {} x k = {} is too large to address", n, k));
  }
  if (!std::isfinite(tensor_scale) || tensor_scale < 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("tensor_scale: {} is not a finite value >= 0", tensor_scale));
  }
  if (w.format == WeightFormat::kMxfp4 && tensor_scale != 1.0f) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("tensor_scale: {} given for mxfp4, which has none (1)", tensor_scale));
  }
  w.n = n;
  w.k = k;
  w.tensor_scale = tensor_scale;
  // Any shape whose bytes are the matrix's: [N, K/2] and a flat array are both natural.
  const auto take = [&](const nb::ndarray<nb::ro>& a, std::string_view name, std::int64_t bytes,
                        std::vector<std::uint8_t>& out) {
    ArraySpec spec{Element::kU8, static_cast<int>(a.ndim()), -1, -1};
    spec.alignment = 1;
    if (a.ndim() < 1 || a.ndim() > 2) spec.ndim = 2;  // check_array names the bad rank
    const ArrayArg arg = check_array(api, name, a, false, spec);
    if (static_cast<std::int64_t>(arg.bytes) != bytes) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("{}: {} bytes, expected {} for {} x {} {} weights", name, arg.bytes,
                              bytes, n, k, format));
    }
    out.resize(static_cast<std::size_t>(bytes));
    std::memcpy(out.data(), a.data(), out.size());
  };
  take(codes, "codes", n * k / 2, w.codes);
  take(scales, "scales", n * (k / group), w.scales);
  return w;
}

HostQuantWeights quantize(std::string_view api, const nb::ndarray<nb::ro>& a, WeightFormat format) {
  ArraySpec spec{Element::kF32, 2};
  spec.alignment = 4;
  const ArrayArg arg = check_array(api, "w", a, false, spec);
  const auto* p = static_cast<const float*>(a.data());
  const std::span<const float> values(p, static_cast<std::size_t>(arg.rows * arg.cols));
  nb::gil_scoped_release unlocked;
  return format == WeightFormat::kNvfp4 ? quantize_nvfp4(values, arg.rows, arg.cols)
                                        : quantize_mxfp4(values, arg.rows, arg.cols);
}

// The codes or scales as a read-only NumPy view of the weights' own bytes, shaped as the layout
// stores them.
nb::ndarray<nb::numpy, const std::uint8_t, nb::ndim<2>> bytes_view(
    const HostQuantWeights& w, const std::vector<std::uint8_t>& v, std::int64_t per_row) {
  const bool rows_first = w.layout == WeightLayout::kRowMajor;
  const std::size_t shape[2] = {static_cast<std::size_t>(rows_first ? w.n : per_row),
                                static_cast<std::size_t>(rows_first ? per_row : w.n)};
  return nb::ndarray<nb::numpy, const std::uint8_t, nb::ndim<2>>(v.data(), 2, shape, nb::handle());
}

// A safetensors file, or a sharded checkpoint whose layers are gathered across its shards when
// asked for (metrale/checkpoint_layers.h), with its linear layers and its folder's declared
// quantization.
struct Checkpoint {
  std::optional<SafetensorsFile> file;
  std::optional<ShardedCheckpoint> sharded;
  std::string path;
  LinearLayerScan scan;               // FP4 and BF16/F32 layers; rejected: what no loader reads
  std::vector<std::string> fp8;       // FP8 block-128 layers, sorted
  std::vector<PackedExperts> packed;  // MoE projections stored packed (gpt-oss), sorted
  std::optional<DeclaredQuantization> declared;

  // `layer`'s tensors: the file itself, or an in-memory file gathered across the shards.
  template <class F>
  auto with_layer(std::string_view layer, F&& f) const {
    if (file) return f(*file);
    return f(gather_layer(*sharded, layer));
  }
  // Projection `projection`'s packed experts (its tensors share the projection's parent prefix).
  ExpertsWeights load_experts(std::string_view projection) const {
    return with_layer(module_of(projection),
                      [&](const SafetensorsFile& f) { return load_packed_experts(f, projection); });
  }
  bool is_fp8(std::string_view layer) const {
    return std::binary_search(fp8.begin(), fp8.end(), layer);
  }
  // Loads 4-bit (or BF16/F32) layer `layer`; GPTQ zero points as the folder's config says.
  Nvfp4Linear load(std::string_view layer) const {
    const GptqZeros zeros =
        declared && declared->gptq_v2 ? GptqZeros::kAsStored : GptqZeros::kMinusOne;
    return with_layer(layer,
                      [&](const SafetensorsFile& f) { return load_nvfp4_linear(f, layer, zeros); });
  }
  // FP8 layer `layer`'s codes and F32 block scales, copied (its scales converted from the
  // layout the file stores them in).
  HostE4m3BlockWeights load_fp8(std::string_view layer) const {
    if (!is_fp8(layer)) {
      throw Error(ErrorCode::kNotFound, "Checkpoint.fp8_weights",
                  fmt::format("layer '{}': not an FP8 layer of {}", layer, path));
    }
    return with_layer(layer, [&](const SafetensorsFile& f) {
      const std::optional<SafetensorsFile> rewritten = fp8_scales_as_inv(f, layer);
      const E4m3BlockWeightsView v = load_fp8_linear(rewritten ? *rewritten : f, layer);
      return HostE4m3BlockWeights{
          v.n, v.k, {v.codes.begin(), v.codes.end()}, {v.scales.begin(), v.scales.end()}};
    });
  }
  // What the file holds for `layer` (Nvfp4Linear::source, fp8_layer_source).
  std::string source(std::string_view layer) const {
    if (is_fp8(layer)) {
      return with_layer(layer,
                        [&](const SafetensorsFile& f) { return fp8_layer_source(f, layer); });
    }
    return with_layer(layer,
                      [&](const SafetensorsFile& f) { return linear_layer_source(f, layer); });
  }
};

// Adds one file's (or one gathered layer's) layers to `c`.
void scan_into(Checkpoint& c, const SafetensorsFile& f) {
  for (std::string& name : fp8_linear_layers(f)) c.fp8.push_back(std::move(name));
  LinearLayerScan one = scan_linear_layers(f);
  c.scan.layers.insert(c.scan.layers.end(), one.layers.begin(), one.layers.end());
  c.scan.rejected.insert(c.scan.rejected.end(), one.rejected.begin(), one.rejected.end());
  PackedExpertsScan experts = scan_packed_experts(f);
  c.packed.insert(c.packed.end(), experts.found.begin(), experts.found.end());
  c.scan.rejected.insert(c.scan.rejected.end(), experts.rejected.begin(), experts.rejected.end());
}

// Opens `path`: a safetensors file, a model.safetensors.index.json, or a folder holding either;
// a sharded one is scanned layer by layer (one layer's bytes in memory at a time).
Checkpoint open_checkpoint(const std::string& path) {
  Checkpoint c;
  c.path = resolve_checkpoint_path(path);
  if (!is_checkpoint_index(c.path)) {
    c.file.emplace(SafetensorsFile::open(c.path));
    scan_into(c, *c.file);
  } else {
    c.sharded.emplace(ShardedCheckpoint::open(c.path));
    for (const std::string& prefix : tensor_prefixes(*c.sharded)) {
      scan_into(c, gather_layer(*c.sharded, prefix));
    }
  }
  std::sort(c.scan.layers.begin(), c.scan.layers.end());
  std::sort(c.fp8.begin(), c.fp8.end());
  std::sort(c.packed.begin(), c.packed.end(), [](const PackedExperts& a, const PackedExperts& b) {
    return a.projection < b.projection;
  });
  // An FP8 layer is the FP8 loader's: not a rejected FP4 candidate.
  std::erase_if(c.scan.rejected, [&](const RejectedLayer& r) { return c.is_fp8(r.layer); });
  c.declared = read_declared_quantization(std::filesystem::path(c.path).parent_path().string());
  return c;
}

nb::object declared_dict(const std::optional<DeclaredQuantization>& d) {
  if (!d) return nb::none();
  nb::dict out;
  out["file"] = d->file;
  out["producer"] = d->producer;
  out["format"] = d->format;
  out["describe"] = d->describe();
  out["layer_sources"] = d->layer_sources;
  out["ignore"] = d->ignore;
  out["every_linear"] = d->every_linear;
  out["quantized_activations"] = d->quantized_activations;
  out["activations"] = d->activations;
  out["gptq_v2"] = d->gptq_v2;
  return out;
}

}  // namespace

void bind_host_weights(nb::module_& m) {
  nb::class_<HostQuantWeights>(m, "HostWeights",
                               "Quantized weights W[N, K] in host memory (NVFP4, MXFP4 or INT4).")
      .def(
          "__init__",
          [](HostQuantWeights* self, const nb::ndarray<nb::ro>& codes,
             const nb::ndarray<nb::ro>& scales, std::int64_t n, std::int64_t k,
             std::string_view format, float tensor_scale, std::string_view layout) {
            new (self)
                HostQuantWeights(from_arrays(codes, scales, n, k, format, tensor_scale, layout));
          },
          nb::arg("codes"), nb::arg("scales"), nb::kw_only(), nb::arg("n"), nb::arg("k"),
          nb::arg("format") = "nvfp4", nb::arg("tensor_scale") = 1.0f,
          nb::arg("layout") = "row_major",
          "Copies codes (uint8, N*K/2 bytes of E2M1 pairs, low nibble = even k) and scales "
          "(uint8, N*K/group bytes: E4M3 for nvfp4, E8M0 for mxfp4) in the given layout.")
      .def_prop_ro("format",
                   [](const HostQuantWeights& w) { return std::string(to_string(w.format)); })
      .def_prop_ro(
          "layout",
          [](const HostQuantWeights& w) {
            return std::string(w.layout == WeightLayout::kRowMajor ? "row_major" : "transposed");
          })
      .def_ro("n", &HostQuantWeights::n, "Output features (rows of W).")
      .def_ro("k", &HostQuantWeights::k,
              "Stored columns of W: the input features, but for a padded act-order K slice, "
              "whose input features are a_columns.")
      .def_prop_ro(
          "a_columns", [](const HostQuantWeights& w) { return a_columns(w); },
          "Input features (columns of A and of dequantize()'s W).")
      .def_ro("tensor_scale", &HostQuantWeights::tensor_scale)
      .def_prop_ro(
          "codes", [](const HostQuantWeights& w) { return bytes_view(w, w.codes, w.k / 2); },
          nb::rv_policy::reference_internal, "The E2M1 codes, a read-only view (no copy).")
      .def_prop_ro(
          "scales",
          [](const HostQuantWeights& w) {
            // INT4: two bytes per group (BF16 or FP16, little-endian).
            return bytes_view(
                w, w.scales,
                w.format == WeightFormat::kInt4 ? 2 * (w.k / w.group) : w.k / group_size(w.format));
          },
          nb::rv_policy::reference_internal,
          "The block scales, a read-only view (no copy); INT4: uint8 [N, 2 * K/group], the BF16 "
          "or FP16 scales' bytes.")
      .def_prop_ro(
          "group",
          [](const HostQuantWeights& w) {
            return w.format == WeightFormat::kInt4 ? w.group : group_size(w.format);
          },
          "K elements per scale.")
      .def_prop_ro(
          "scale_type",
          [](const HostQuantWeights& w) -> std::string {
            if (w.format == WeightFormat::kInt4) return w.fp16_scales ? "fp16" : "bf16";
            return w.format == WeightFormat::kMxfp4 ? "e8m0" : "e4m3";
          },
          "The scales' type: 'e4m3', 'e8m0', or INT4's 'bf16' / 'fp16'.")
      .def_prop_ro(
          "zeros",
          [](const HostQuantWeights& w) -> nb::object {
            if (w.zeros.empty()) return nb::none();
            return nb::cast(to_numpy(w.zeros, w.n, w.k / w.group));
          },
          "INT4 zero points (uint8 [N, K/group], a copy), or None: symmetric (every zero point 8).")
      .def_prop_ro(
          "k_perm",
          [](const HostQuantWeights& w) -> nb::object {
            if (w.k_perm.empty()) return nb::none();
            return nb::cast(to_numpy(w.k_perm, 1, w.k));
          },
          "INT4 act order: stored column j holds W[:, k_perm[j]] (int32 [1, K], a copy), or "
          "None.")
      .def(
          "dequantize",
          [](const HostQuantWeights& w, bool exact) -> nb::object {
            const std::int64_t cols = a_columns(w);
            if (exact) {
              std::vector<double> out(static_cast<std::size_t>(w.n * cols));
              w.exact_rows(0, w.n, out);
              return nb::cast(to_numpy(std::move(out), w.n, cols));
            }
            return nb::cast(to_numpy(dequantize(w), w.n, cols));
          },
          nb::arg("exact") = false,
          "W as a NumPy array [N, K]: float32, or with exact=True float64 with no rounding "
          "(the reference a GEMM is checked against).")
      .def("__repr__", [](const HostQuantWeights& w) {
        return fmt::format("HostWeights({} {} x {}, {})", to_string(w.format), w.n, w.k,
                           w.layout == WeightLayout::kRowMajor ? "row_major" : "transposed");
      });

  m.def(
      "stack_rows",
      [](nb::list parts) {
        std::vector<HostQuantWeights> copies;
        copies.reserve(parts.size());
        for (std::size_t i = 0; i < parts.size(); ++i) {
          if (!nb::isinstance<HostQuantWeights>(parts[i])) {
            throw DtypeError("stack_rows", fmt::format("parts[{}]: {} is not a metrale.HostWeights",
                                                       i, nb::type_name(parts[i].type()).c_str()));
          }
          copies.push_back(nb::cast<const HostQuantWeights&>(parts[i]));
        }
        nb::gil_scoped_release unlocked;
        return stack_rows(copies);
      },
      nb::arg("parts"),
      "The rows of each part one after another (an MoE expert's gate and up projections as one "
      "gate_up): one format, K, tensor scale and INT4 group and zero-point kind, row-major, one "
      "act order (none, or the same k_perm) for all.");
  m.def(
      "take_rows",
      // nanobind refuses (TypeError) rows that are not a contiguous 1-D int64 array in host memory.
      [](const HostQuantWeights& w,
         const nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>& rows) {
        const std::vector<std::int64_t> picked(rows.data(), rows.data() + rows.shape(0));
        nb::gil_scoped_release unlocked;
        return take_rows(w, picked);
      },
      nb::arg("w"), nb::arg("rows").noconvert(),
      "W[rows, :] of row-major weights: row i of the result is row rows[i] (int64).");
  m.def(
      "in_stored_order",
      [](const HostQuantWeights& w) {
        nb::gil_scoped_release unlocked;
        return in_stored_order(w);
      },
      nb::arg("w"),
      "Act-ordered INT4 weights as weights without act order whose K is the stored order "
      "(W[:, k_perm]): for a caller that gives A in that order. Others come back as they are.");
  m.def(
      "quantize_nvfp4",
      [](const nb::ndarray<nb::ro>& w) {
        return quantize("quantize_nvfp4", w, WeightFormat::kNvfp4);
      },
      nb::arg("w"),
      "Quantizes float32 W[N, K] (K a multiple of 16) to NVFP4: E4M3 scales per 16, one FP32 "
      "tensor scale.");
  m.def(
      "quantize_mxfp4",
      [](const nb::ndarray<nb::ro>& w) {
        return quantize("quantize_mxfp4", w, WeightFormat::kMxfp4);
      },
      nb::arg("w"), "Quantizes float32 W[N, K] (K a multiple of 32) to MXFP4: E8M0 scales per 32.");

  m.def(
      "quantize_int4",
      [](const nb::ndarray<nb::ro>& a, std::int64_t group, bool zero_points, bool fp16_scales) {
        ArraySpec spec{Element::kF32, 2};
        spec.alignment = 4;
        const ArrayArg arg = check_array("quantize_int4", "w", a, false, spec);
        const std::span<const float> values(static_cast<const float*>(a.data()),
                                            static_cast<std::size_t>(arg.rows * arg.cols));
        nb::gil_scoped_release unlocked;
        return quantize_int4(values, arg.rows, arg.cols, group, zero_points, fp16_scales);
      },
      nb::arg("w"), nb::arg("group") = 128, nb::arg("zero_points") = false,
      nb::arg("fp16_scales") = false,
      "Quantizes float32 W[N, K] to INT4 by rounding to nearest in groups of `group` (32, 64, a "
      "multiple of 128, or K): symmetric (zero point 8) or with zero_points; BF16 or FP16 scales.");

  m.def(
      "quantize_e4m3_block128",
      [](const nb::ndarray<nb::ro>& w) {
        ArraySpec spec{Element::kF32, 2};
        spec.alignment = 4;
        const ArrayArg arg = check_array("quantize_e4m3_block128", "w", w, false, spec);
        const std::span<const float> values(static_cast<const float*>(w.data()),
                                            static_cast<std::size_t>(arg.rows * arg.cols));
        HostE4m3BlockWeights q;
        {
          nb::gil_scoped_release unlocked;
          q = quantize_e4m3_block128(values, arg.rows, arg.cols);
        }
        return nb::make_tuple(to_numpy(std::move(q.codes), q.n, q.k),
                              to_numpy(std::move(q.scales), e4m3_blocks(q.n), e4m3_blocks(q.k)));
      },
      nb::arg("w"),
      "Quantizes float32 W[N, K] to E4M3 codes [N, K] (uint8) with one FP32 scale per 128 x 128 "
      "block [ceil(N/128), ceil(K/128)], the FP8 checkpoint layout the W8A8 op takes.");

  nb::class_<Checkpoint>(m, "Checkpoint",
                         "A safetensors file mapped read-only, or a sharded checkpoint, with its "
                         "linear layers.")
      .def_prop_ro("path", [](const Checkpoint& c) { return c.path; })
      .def_prop_ro(
          "tensors",
          [](const Checkpoint& c) { return c.file ? c.file->names() : c.sharded->names(); })
      .def(
          "tensor_bytes",
          [](const Checkpoint& c, std::string_view name) {
            const SafetensorsTensorInfo& info = c.file ? c.file->info(name) : c.sharded->info(name);
            std::vector<std::uint8_t> out;
            if (c.file) {
              const auto b = c.file->bytes(name);
              out.resize(b.size());
              std::memcpy(out.data(), b.data(), b.size());
            } else {
              const std::vector<std::byte> b = c.sharded->read(name);
              out.resize(b.size());
              std::memcpy(out.data(), b.data(), b.size());
            }
            const auto size = static_cast<std::int64_t>(out.size());
            return nb::make_tuple(info.dtype, info.shape, to_numpy(std::move(out), 1, size));
          },
          nb::arg("name"),
          "Tensor `name` as the file stores it: (dtype, shape, uint8 [1, bytes] copy of its "
          "little-endian bytes). NotFoundError for a name the checkpoint lacks.")
      .def_prop_ro(
          "layers", [](const Checkpoint& c) { return c.scan.layers; },
          "The linear layers weights() can load, sorted.")
      .def_prop_ro(
          "rejected",
          [](const Checkpoint& c) {
            nb::list out;
            for (const RejectedLayer& r : c.scan.rejected) {
              nb::dict d;
              d["layer"] = r.layer;
              d["tensor"] = r.tensor;
              d["why"] = r.why;
              d["quantized"] = r.quantized;
              out.append(d);
            }
            return out;
          },
          "Candidate layers that cannot be loaded, each with the tensor at fault, why, and whether "
          "it looks quantized (packed, integer or FP8 weights, or block scales beside them).")
      .def_prop_ro(
          "fp8_layers", [](const Checkpoint& c) { return c.fp8; },
          "The FP8 block-128 linear layers (DeepSeek/Qwen/transformers weight_scale_inv, UE8M0, "
          "compressed-tensors FP8_BLOCK, ModelOpt blockwise), sorted.")
      .def(
          "fp8_weights",
          [](const Checkpoint& c, std::string_view layer) {
            HostE4m3BlockWeights w;
            {
              nb::gil_scoped_release unlocked;
              w = c.load_fp8(layer);
            }
            return nb::make_tuple(
                to_numpy(std::move(w.codes), w.n, w.k),
                to_numpy(std::move(w.scales), e4m3_blocks(w.n), e4m3_blocks(w.k)));
          },
          nb::arg("layer"),
          "An FP8 layer's E4M3 codes (uint8 [N, K]) and FP32 multipliers, one per 128 x 128 block "
          "([ceil(N/128), ceil(K/128)]), whatever layout the file stores them in: "
          "Model.upload_fp8_weights's pair.")
      .def_prop_ro(
          "declared", [](const Checkpoint& c) { return declared_dict(c.declared); },
          "What the folder's config.json (quantization_config) or hf_quant_config.json declares: "
          "a dict (file, producer, format, describe, layer_sources, ignore, every_linear, "
          "quantized_activations, activations), or None.")
      .def(
          "ignores",
          [](const Checkpoint& c, std::string_view module) {
            return c.declared && declared_ignores(*c.declared, module);
          },
          nb::arg("module"), "Whether the declared quantization's ignore list names `module`.")
      .def(
          "check_declared",
          [](const Checkpoint& c, const std::vector<std::pair<std::string, std::string>>& quantized,
             const std::vector<std::string>& plain, std::string_view api) {
            if (c.declared) check_declared(*c.declared, api, quantized, plain);
          },
          nb::arg("quantized"), nb::arg("plain"), nb::arg("api") = "Checkpoint.check_declared",
          "Holds the layers to the declared quantization (nothing when none is declared): "
          "`quantized` (layer, source) pairs and the `plain` Linears left in floats. Raises "
          "IoError naming the layers of another format, quantized layers on the ignore list, or "
          "(when the config quantizes every Linear) plain ones not on it.")
      .def_prop_ro(
          "experts",
          [](const Checkpoint& c) {
            nb::list out;
            for (const PackedExperts& e : c.packed) {
              nb::dict d;
              d["projection"] = e.projection;
              d["experts"] = e.experts;
              d["n"] = e.n;
              d["k"] = e.k;
              d["bias"] = e.bias;
              d["source"] = e.source;
              out.append(d);
            }
            return out;
          },
          "The MoE projections stored packed, every expert in one tensor (gpt-oss MXFP4: "
          "<projection>_blocks, _scales, _bias), sorted: dicts of projection, experts, n, k, bias "
          "(whether the file has one) and source.")
      .def(
          "expert_weights",
          [](const Checkpoint& c, std::string_view projection) {
            ExpertsWeights w;
            {
              nb::gil_scoped_release unlocked;
              w = c.load_experts(projection);
            }
            nb::list experts;
            for (HostQuantWeights& e : w.experts) experts.append(nb::cast(std::move(e)));
            const auto count = static_cast<std::int64_t>(w.experts.size());
            const std::int64_t n = count > 0 ? static_cast<std::int64_t>(w.bias.size()) / count : 0;
            nb::object bias =
                w.bias.empty() ? nb::none() : nb::cast(to_numpy(std::move(w.bias), count, n));
            return nb::make_tuple(experts, bias);
          },
          nb::arg("projection"),
          "A packed MoE projection's experts: (a list of E MXFP4 HostWeights [N, K], the bias as "
          "BF16 bits, uint16 [E, N], or None). NotFoundError or IoError naming the tensor for "
          "tensors that are missing or do not fit.")
      .def(
          "weights", [](const Checkpoint& c, std::string_view layer) { return c.load(layer).w; },
          nb::arg("layer"),
          "The layer's 4-bit weights (NVFP4; MXFP4 from compressed-tensors; INT4 from "
          "compressed-tensors, GPTQ or AWQ; a BF16/F32 layer is quantized to NVFP4 on load).")
      .def(
          "source", [](const Checkpoint& c, std::string_view layer) { return c.source(layer); },
          nb::arg("layer"),
          "What the file holds for the layer: 'ModelOpt NVFP4', 'compressed-tensors NVFP4', "
          "'compressed-tensors MXFP4', 'compressed-tensors INT4', 'GPTQ INT4', 'AWQ INT4', 'BF16, "
          "quantized to NVFP4 on load' (F32 alike), or an FP8 "
          "layout ('FP8 block-128 (F32 weight_scale_inv)', 'compressed-tensors FP8 block-128', "
          "...).")
      .def(
          "input_scale",
          [](const Checkpoint& c, std::string_view layer) { return c.load(layer).input_scale; },
          nb::arg("layer"), "The layer's activation scale, or None when the file has none.");
  m.def(
      "load_safetensors", [](const std::string& path) { return open_checkpoint(path); },
      nb::arg("path"),
      "Opens a safetensors file, a sharded checkpoint's model.safetensors.index.json, or a model "
      "folder holding either (NVIDIA ModelOpt NVFP4, compressed-tensors "
      "nvfp4/mxfp4-pack-quantized and INT4 pack-quantized, GPTQ, AWQ, "
      "or BF16/F32 layers; a layer's tensors may lie in different shards) and validates it.");
}

}  // namespace metrale::py
