// Model's GEMMs: the operands checked, the caller's arrays lent for the call, the plans.
#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <cstdio>
#include <optional>

#include "bindings.h"
#include "call.h"
#include "metrale/backend.h"
#include "metrale/dense_gemm.h"
#include "metrale/foreign_stream.h"
#include "metrale/op_cache.h"
#include "model.h"

namespace nb = nanobind;

namespace metrale::py {
namespace {

ops::GemmRoute parse_route(std::string_view api, std::string_view text) {
  for (ops::GemmRoute r :
       {ops::GemmRoute::kAuto, ops::GemmRoute::kDecode, ops::GemmRoute::kTiled,
        ops::GemmRoute::kE4m3, ops::GemmRoute::kDequant, ops::GemmRoute::kFused}) {
    if (ops::to_string(r) == text) return r;
  }
  throw Error(
      ErrorCode::kInvalidArgument, api,
      fmt::format("route: '{}', expected auto, decode, tiled, e4m3, dequant or fused", text));
}

ops::GemmOptions gemm_options(std::string_view api, std::string_view route, bool allow_e4m3) {
  ops::GemmOptions o;
  o.route = parse_route(api, route);
  o.activations = allow_e4m3 ? ops::Activations::kAllowE4m3 : ops::Activations::kExactBf16;
  return o;
}

// Every operand of one call lent, in order, for as long as this lives.
struct Loans {
  Loans(Backend& b, const LedgerProbe& probe, const Operands& args, const CallStream& stream)
      : a(b, probe, args.a, stream.ordered()), c(b, probe, args.c, stream.ordered()) {
    if (args.bias) bias.emplace(b, probe, *args.bias, stream.ordered());
  }
  Loan a, c;
  std::optional<Loan> bias;
};

nb::dict launch_dict(Backend& b, const ops::PlannedLaunch& l) {
  nb::dict d;
  d["kernel"] = b.kernel_name(l.kernel.handle);
  d["grid"] = nb::make_tuple(l.grid.x, l.grid.y, l.grid.z);
  d["block"] = nb::make_tuple(l.block.x, l.block.y, l.block.z);
  d["smem_bytes"] = l.smem_bytes;
  return d;
}

}  // namespace

Operands Model::check_operands(std::string_view api, nb::handle a, bool a_bits, nb::handle out,
                               bool out_bits, nb::handle bias, bool bias_bits, std::int64_t n,
                               std::int64_t k) const {
  Operands args;
  ArraySpec spec{Element::kBf16, 2, -1, k, device_type()};
  args.a = check_array(api, "a", as_array(api, "a", a, false), a_bits, spec);
  spec.rows = args.a.rows;
  spec.cols = n;
  args.c = check_array(api, "out", as_array(api, "out", out, true), out_bits, spec);
  if (overlap(args.a, args.c)) {
    throw Error(ErrorCode::kInvalidArgument, api, "out: overlaps a (pass another array)");
  }
  if (!bias.is_none()) {
    args.bias = check_array(api, "bias", as_array(api, "bias", bias, false), bias_bits,
                            ArraySpec{Element::kBf16, 1, 1, n, device_type()});
    if (overlap(*args.bias, args.c)) {
      throw Error(ErrorCode::kInvalidArgument, api, "out: overlaps bias (pass another array)");
    }
    // Harmless to read, but two loans of one range cannot be lent (the borrow ledger refused it
    // naming its own internals).
    if (overlap(*args.bias, args.a)) {
      throw Error(ErrorCode::kInvalidArgument, api, "bias: overlaps a (pass a copy)");
    }
  }
  return args;
}

PlanView Model::plan(std::int64_t m, const Weights& w, std::string_view route, bool allow_e4m3,
                     bool bias) {
  Backend& b = open("plan");
  check_owner("plan", w.model, w.label);
  ops::GemmOptions options = gemm_options("plan", route, allow_e4m3);
  // plan() only records whether there is a bias: any aligned pointer stands for it.
  if (bias) options.bias = w.q.codes;
  const ops::GemmPlan p = ops::plan(b, m, w.q, options);
  PlanView v;
  v.route = ops::to_string(p.route);
  v.m = p.m, v.n = p.n, v.k = p.k, v.splits = p.splits;
  v.workspace_bytes = p.workspace.total();
  for (const ops::PlannedLaunch& l : p.launches) v.launches.append(launch_dict(b, l));
  if (p.dense) v.dense = p.dense->describe;
  v.text = p.describe();
  return v;
}

PlanView Model::plan_w8a8(std::int64_t m, const Fp8Weights& w, bool bias) {
  Backend& b = open("plan");
  check_owner("plan", w.model, w.label);
  ops::Fp8GemmOptions options;
  if (bias) options.bias = w.q.codes;
  const ops::Fp8GemmPlan p = ops::plan(b, m, w.q, options);
  PlanView v;
  v.route = "w8a8";
  v.m = p.m, v.n = p.n, v.k = p.k;
  v.workspace_bytes = p.workspace.total();
  v.launches.append(launch_dict(b, p.cast));
  v.dense = p.dense.describe;
  v.text = p.describe();
  return v;
}

void Model::gemm(nb::handle a, bool a_bits, const Weights& w, nb::handle out, bool out_bits,
                 std::string_view route, bool allow_e4m3, nb::handle bias, bool bias_bits,
                 std::optional<std::uint64_t> stream) {
  Backend& b = open("gemm");
  check_owner("gemm", w.model, w.label);
  const Operands args =
      check_operands("gemm", a, a_bits, out, out_bits, bias, bias_bits, w.q.n, ops::a_columns(w.q));
  ops::GemmOptions options = gemm_options("gemm", route, allow_e4m3);
  if (args.bias) options.bias = args.bias->ptr;
  run_planned(b, args, w.q, options, stream);
}

void Model::w8a8_gemm(nb::handle a, bool a_bits, const Fp8Weights& w, nb::handle out, bool out_bits,
                      nb::handle bias, bool bias_bits, std::optional<std::uint64_t> stream) {
  Backend& b = open("gemm");
  check_owner("gemm", w.model, w.label);
  const Operands args =
      check_operands("gemm", a, a_bits, out, out_bits, bias, bias_bits, w.q.n, w.q.k);
  ops::Fp8GemmOptions options;
  if (args.bias) options.bias = args.bias->ptr;
  run_planned(b, args, w.q, options, stream);
}

PlanView Model::plan_dense(std::int64_t m, const DenseWeights& w, bool bias) {
  Backend& b = open("plan");
  check_owner("plan", w.model, w.label);
  const DenseGemmPlan p = as_call("plan", [&] {
    return b.plan_dense_gemm({DenseKind::kBf16, m, w.n, w.k, bias});
  });
  PlanView v;
  v.route = "dense";
  v.m = m, v.n = w.n, v.k = w.k;
  v.workspace_bytes = p.workspace_bytes;
  v.dense = p.describe;
  v.text = fmt::format("dense M={} N={} K={}{}: {}", m, w.n, w.k, bias ? " +bias" : "", p.describe);
  return v;
}

void Model::dense_gemm(nb::handle a, bool a_bits, const DenseWeights& w, nb::handle out,
                       bool out_bits, nb::handle bias, bool bias_bits,
                       std::optional<std::uint64_t> stream) {
  Backend& b = open("gemm");
  check_owner("gemm", w.model, w.label);
  const Operands args = check_operands("gemm", a, a_bits, out, out_bits, bias, bias_bits, w.n, w.k);
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open("gemm");
  const DenseGemmPlan p = as_call("gemm", [&] {
    return b.plan_dense_gemm({DenseKind::kBf16, args.a.rows, w.n, w.k, args.bias.has_value()});
  });
  const CallStream on = as_call("gemm", [&] { return CallStream(b, stream); });
  const Loans loans(b, *probe_, args, on);
  DenseGemmArgs run;
  run.a = args.a.ptr;
  run.b = w.w;
  run.c = args.c.ptr;
  if (args.bias) run.bias = args.bias->ptr;
  if (p.workspace_bytes != 0) {
    run.workspace = b.op_cache().scratch(b, ops::gemm_scratch_tag(b, on.handle(), "blas_workspace"),
                                         p.workspace_bytes, on.handle());
    run.workspace_bytes = p.workspace_bytes;
  }
  b.run_dense_gemm(p, run, on.handle());
  on.finish();
}

void Model::gemm_host(const void* w, bool fp8, const std::uint16_t* a, std::int64_t rows,
                      std::uint16_t* c, const std::uint16_t* bias, const CpuExecutor* executor) {
  constexpr std::string_view api = "metrale.torch.linear";
  Backend& b = open(api);
  if (device_type() != nb::device::cpu::value) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("x: a CPU tensor given to a model on {}", name_));
  }
  const auto n = fp8 ? static_cast<const Fp8Weights*>(w)->q.n : static_cast<const Weights*>(w)->q.n;
  const auto k = fp8 ? static_cast<const Fp8Weights*>(w)->q.k
                     : ops::a_columns(static_cast<const Weights*>(w)->q);
  const auto arg = [&](const void* p, std::int64_t r, std::int64_t cols, std::string_view name) {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (address % 16 != 0) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("{}: address 0x{:x} is not 16-byte aligned", name, address));
    }
    return ArrayArg{DevicePtr{address}, static_cast<std::size_t>(r * cols * 2), r, cols, {}};
  };
  Operands args{arg(a, rows, k, "x"), arg(c, rows, n, "out"), std::nullopt};
  std::optional<ScopedCpuExecutor> lent;
  if (executor != nullptr) lent.emplace(*executor);
  if (bias) args.bias = arg(bias, 1, n, "bias");
  if (fp8) {
    const auto& fw = *static_cast<const Fp8Weights*>(w);
    check_owner(api, fw.model, fw.label);
    ops::Fp8GemmOptions options;
    if (args.bias) options.bias = args.bias->ptr;
    run_planned_unlocked(b, args, fw.q, options, std::nullopt);
  } else {
    const auto& qw = *static_cast<const Weights*>(w);
    check_owner(api, qw.model, qw.label);
    ops::GemmOptions options = gemm_options(api, "auto", false);
    if (args.bias) options.bias = args.bias->ptr;
    run_planned_unlocked(b, args, qw.q, options, std::nullopt);
  }
}

template <class W, class Options>
void Model::run_planned(Backend& b, const Operands& args, const W& w, const Options& options,
                        std::optional<std::uint64_t> stream) {
  nb::gil_scoped_release unlocked;
  run_planned_unlocked(b, args, w, options, stream);
}

template <class W, class Options>
void Model::run_planned_unlocked(Backend& b, const Operands& args, const W& w,
                                 const Options& options, std::optional<std::uint64_t> stream) {
  const auto lock = lock_open("gemm");
  const auto p = as_call("gemm", [&] { return ops::plan(b, args.a.rows, w, options); });
  const CallStream on = as_call("gemm", [&] { return CallStream(b, stream); });
  const Loans loans(b, *probe_, args, on);
  ops::run(p, on.handle(), args.a.ptr, w, args.c.ptr, ops::scratch_workspace(p, on.handle()),
           options.bias);
  on.finish();
}

}  // namespace metrale::py
