// The Python classes of model.h: _Model (metrale.Model wraps it), Weights, DenseWeights,
// Fp8Weights, Plan, and
// _bf16_view, through which metrale.Array exports BF16.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <fmt/format.h>

#include <vector>

#include "bindings.h"
#include "model.h"

namespace nb = nanobind;

namespace metrale::py {

namespace {

// An upload's packing as Python names it (the layout argument's words).
std::string packing_name(ops::WeightPacking packing) {
  switch (packing) {
    case ops::WeightPacking::kDecode:
      return "decode";
    case ops::WeightPacking::kPanels:
      return "panels";
    case ops::WeightPacking::kSource:
      break;
  }
  return "source";
}

}  // namespace

void bind_model(nb::module_& m) {
  nb::class_<Weights>(m, "Weights", "4-bit weights on a model's device (released at teardown).")
      .def_prop_ro("n", [](const Weights& w) { return w.q.n; })
      .def_prop_ro(
          "k", [](const Weights& w) { return ops::a_columns(w.q); },
          "K: A's columns (a padded act-order K slice stores more: docs/NOTES.md).")
      .def_prop_ro("format", [](const Weights& w) { return std::string(to_string(w.q.format)); })
      .def_prop_ro("packing", [](const Weights& w) { return packing_name(w.q.packing); })
      .def_ro("label", &Weights::label)
      .def_prop_ro("nbytes", [](const Weights& w) { return w.q.codes_bytes + w.q.scales_bytes; })
      .def_ro("pack_seconds", &Weights::pack_seconds,
              "Seconds the decode- or panel-layout repack took.")
      .def("__repr__", [](const Weights& w) {
        return fmt::format("Weights('{}', {} {} x {})", w.label, to_string(w.q.format), w.q.n,
                           ops::a_columns(w.q));
      });

  nb::class_<DenseWeights>(m, "DenseWeights",
                           "BF16 weights on a model's device for the dense GEMM (released at "
                           "teardown).")
      .def_ro("n", &DenseWeights::n)
      .def_ro("k", &DenseWeights::k)
      .def_prop_ro("format", [](const DenseWeights&) { return std::string("bf16"); })
      .def_ro("label", &DenseWeights::label)
      .def_prop_ro("nbytes", [](const DenseWeights& w) { return w.n * w.k * 2; })
      .def("__repr__", [](const DenseWeights& w) {
        return fmt::format("DenseWeights('{}', bf16 {} x {})", w.label, w.n, w.k);
      });

  nb::class_<GroupedWeights>(m, "GroupedWeights",
                             "One MoE projection's experts on a model's device (NVFP4, MXFP4, "
                             "INT4 or FP8 block-128, one grouped resource), for Model.moe_experts "
                             "(released at teardown).")
      .def_prop_ro("experts", &GroupedWeights::experts)
      .def_prop_ro("n", &GroupedWeights::n)
      .def_prop_ro("k", &GroupedWeights::k)
      .def_prop_ro("format", &GroupedWeights::format)
      .def_prop_ro("has_bias", [](const GroupedWeights& w) { return static_cast<bool>(w.bias); })
      .def_prop_ro(
          "packing",
          [](const GroupedWeights& w) {
            return packing_name(w.fp8 ? w.f.packing : w.q.expert.packing);
          },
          "The layout the experts were uploaded in: source, decode or panels.")
      .def_ro("label", &GroupedWeights::label)
      .def("__repr__", [](const GroupedWeights& w) {
        return fmt::format("GroupedWeights('{}', {} experts of {} {} x {})", w.label, w.experts(),
                           w.format(), w.n(), w.k());
      });

  nb::class_<Fp8Weights>(m, "Fp8Weights",
                         "E4M3 weights with 128 x 128 block scales on a model's device, for the "
                         "W8A8 op (released at teardown).")
      .def_prop_ro("n", [](const Fp8Weights& w) { return w.q.n; })
      .def_prop_ro("k", [](const Fp8Weights& w) { return w.q.k; })
      .def_prop_ro("format", [](const Fp8Weights&) { return std::string("e4m3_block128"); })
      .def_ro("label", &Fp8Weights::label)
      .def_prop_ro("nbytes", [](const Fp8Weights& w) { return w.q.codes_bytes + w.q.scales_bytes; })
      .def("__repr__", [](const Fp8Weights& w) {
        return fmt::format("Fp8Weights('{}', e4m3_block128 {} x {})", w.label, w.q.n, w.q.k);
      });

  nb::class_<PlanView>(m, "Plan", "What a GEMM would run: route, kernels, grid and workspace.")
      .def_ro("route", &PlanView::route, "A route's name, or 'w8a8' for FP8 weights.")
      .def_ro("m", &PlanView::m)
      .def_ro("n", &PlanView::n)
      .def_ro("k", &PlanView::k)
      .def_ro("splits", &PlanView::splits, "Parts K is split into (1: none).")
      .def_ro("workspace_bytes", &PlanView::workspace_bytes)
      .def_ro("launches", &PlanView::launches,
              "Each kernel launch in order: kernel, grid, block, smem_bytes.")
      .def_ro("dense", &PlanView::dense, "The backend's dense GEMM when the plan runs one.")
      .def("describe", [](const PlanView& p) { return p.text; })
      .def("__repr__", [](const PlanView& p) { return "Plan(" + p.text + ")"; });

  nb::class_<Model>(m, "_Model", "The C++ model; metrale.Model wraps it.")
      .def(nb::init<std::string_view>(), nb::arg("backend"))
      .def_prop_ro("backend", &Model::backend_name)
      .def_prop_ro("device", &Model::device)
      .def_prop_ro("chosen", &Model::chosen)
      .def_prop_ro("closed", &Model::closed)
      .def_prop_ro("device_type", &Model::device_type)
      .def_prop_ro("stream", &Model::stream)
      .def("upload_weights", &Model::upload, nb::arg("host"), nb::arg("layout"), nb::arg("label"),
           nb::keep_alive<0, 1>())
      .def("upload_fp8_weights", &Model::upload_fp8, nb::arg("codes"), nb::arg("scales"),
           nb::arg("n"), nb::arg("k"), nb::arg("label"), nb::keep_alive<0, 1>())
      .def("upload_dense_weights", &Model::upload_dense, nb::arg("w"), nb::arg("bits"),
           nb::arg("label"), nb::keep_alive<0, 1>())
      .def("plan", &Model::plan, nb::arg("m"), nb::arg("w"), nb::arg("route"),
           nb::arg("allow_e4m3"), nb::arg("bias"))
      .def("plan_w8a8", &Model::plan_w8a8, nb::arg("m"), nb::arg("w"), nb::arg("bias"))
      .def("plan_dense", &Model::plan_dense, nb::arg("m"), nb::arg("w"), nb::arg("bias"))
      .def("dense_gemm", &Model::dense_gemm, nb::arg("a"), nb::arg("a_bits"), nb::arg("w"),
           nb::arg("out"), nb::arg("out_bits"), nb::arg("bias").none(), nb::arg("bias_bits"),
           nb::arg("stream").none() = nb::none())
      .def("gemm", &Model::gemm, nb::arg("a"), nb::arg("a_bits"), nb::arg("w"), nb::arg("out"),
           nb::arg("out_bits"), nb::arg("route"), nb::arg("allow_e4m3"), nb::arg("bias").none(),
           nb::arg("bias_bits"), nb::arg("stream").none() = nb::none())
      .def("w8a8_gemm", &Model::w8a8_gemm, nb::arg("a"), nb::arg("a_bits"), nb::arg("w"),
           nb::arg("out"), nb::arg("out_bits"), nb::arg("bias").none(), nb::arg("bias_bits"),
           nb::arg("stream").none() = nb::none())
      .def("upload_grouped_weights", &Model::upload_grouped, nb::arg("experts"),
           nb::arg("bias").none(), nb::arg("bias_bits"), nb::arg("layout"), nb::arg("label"),
           nb::keep_alive<0, 1>())
      .def("upload_grouped_fp8_weights", &Model::upload_grouped_fp8, nb::arg("codes"),
           nb::arg("scales"), nb::arg("experts"), nb::arg("bias").none(), nb::arg("bias_bits"),
           nb::arg("layout"), nb::arg("label"), nb::keep_alive<0, 1>())
      .def("moe_experts", &Model::moe_experts, nb::arg("x"), nb::arg("x_bits"), nb::arg("ids"),
           nb::arg("weights"), nb::arg("gate_up"), nb::arg("down"), nb::arg("glu"),
           nb::arg("alpha"), nb::arg("limit"), nb::arg("out"), nb::arg("out_bits"),
           nb::arg("allow_unverified"), nb::arg("route") = "auto",
           nb::arg("stream").none() = nb::none())
      .def("moe_route", &Model::moe_route, nb::arg("logits"), nb::arg("ids"), nb::arg("weights"),
           nb::arg("scoring"), nb::arg("top_k"), nb::arg("renormalize"), nb::arg("scale"),
           nb::arg("groups"), nb::arg("topk_groups"), nb::arg("bias").none(),
           nb::arg("allow_unverified"), nb::arg("stream").none() = nb::none())
      .def("stats", &Model::stats)
      .def("alloc_report", &Model::alloc_report)
      .def("teardown", &Model::teardown);

  m.def(
      "_bf16_view",
      [](const nb::ndarray<>& bits, nb::handle owner) {
        if (bits.dtype() != nb::dtype<std::uint16_t>()) {
          throw DtypeError("bf16_view", "bits: expected uint16 (BF16 bit patterns), got " +
                                            dtype_name(bits.dtype()));
        }
        std::vector<std::size_t> shape(bits.ndim());
        std::vector<std::int64_t> strides(bits.ndim());
        for (std::size_t i = 0; i < bits.ndim(); ++i) {
          shape[i] = bits.shape(i);
          strides[i] = bits.stride(i);
        }
        const nb::dlpack::dtype bf16{static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16,
                                     1};
        return nb::ndarray<nb::array_api>(bits.data(), bits.ndim(), shape.data(), owner,
                                          strides.data(), bf16, bits.device_type(),
                                          bits.device_id());
      },
      nb::arg("bits"), nb::arg("owner"),
      "The same memory as a BF16 DLPack array (no copy), kept alive by owner.");
}

}  // namespace metrale::py
