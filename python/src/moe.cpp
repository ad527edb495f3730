// Model's mixture-of-experts calls: experts' weights uploaded as one grouped resource, and an MoE
// layer's experts run on tokens a router has routed (ops/moe.h, ops/grouped_gemm.h).
#include <fmt/format.h>
#include <nanobind/stl/string.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bindings.h"
#include "call.h"
#include "metrale/e4m3_block.h"
#include "metrale/ops/grouped_fp8.h"
#include "metrale/ops/moe.h"
#include "model.h"

namespace nb = nanobind;

namespace metrale::py {
namespace {

constexpr std::string_view kExperts = "moe_experts";

ops::MoeActivation parse_glu(std::string_view glu, float alpha, float limit) {
  ops::MoeActivation a;
  if (glu == "silu") {
    a.glu = ops::MoeGlu::kSilu;
  } else if (glu == "clamped_swiglu") {
    a.glu = ops::MoeGlu::kClampedSwiglu;
    a.alpha = alpha;
    a.limit = limit;
    // moe_glu's own rule, checked before anything is allocated or queued.
    if (!(std::isfinite(alpha) && limit > 0.0f)) {
      throw Error(ErrorCode::kInvalidArgument, kExperts,
                  fmt::format("alpha = {} and limit = {}: alpha must be finite and limit positive",
                              alpha, limit));
    }
  } else {
    throw Error(ErrorCode::kInvalidArgument, kExperts,
                fmt::format("glu: '{}', expected silu or clamped_swiglu", glu));
  }
  return a;
}

// The call's temporaries, carved from one scratch buffer at 256-byte boundaries.
struct Carve {
  std::uint64_t at = 0;
  std::uint64_t take(std::uint64_t bytes) {
    const std::uint64_t start = at;
    at += (bytes + 255) / 256 * 256;
    return start;
  }
};

// One projection's grouped GEMM, planned for either kind of weights: 4-bit (ops/grouped_gemm.h)
// or FP8 block-128 through the grouped W8A8 op (ops/grouped_fp8.h, with its cast's workspace).
class Projection {
 public:
  // a_in_k_order: A comes gathered in the experts' K order (gate_up's, by moe_gather).
  Projection(Backend& b, std::int64_t rows, const GroupedWeights& w, bool allow_unverified,
             ops::GemmRoute route, bool a_in_k_order)
      : w_(w) {
    if (w.fp8) {
      ops::GroupedFp8Options o;
      o.bias = static_cast<bool>(w.bias);
      o.allow_unverified = allow_unverified;
      o.route = route;
      fp8_ = ops::plan_grouped(b, rows, w.f, o);
    } else {
      ops::GroupedGemmOptions o;
      o.bias = static_cast<bool>(w.bias);
      o.allow_unverified = allow_unverified;
      o.route = route;
      o.a_in_k_order = a_in_k_order;
      fp4_ = ops::plan_grouped(b, rows, w.q, o);
    }
  }
  void run(StreamHandle s, DevicePtr a, const ops::MoeRows& r, DevicePtr c) const {
    if (w_.fp8) {
      ops::run_grouped(fp8_, s, a, w_.f, r.counts, r.offsets, c, ops::scratch_workspace(fp8_, s),
                       w_.bias);
    } else {
      ops::run_grouped(fp4_, s, a, w_.q, r.counts, r.offsets, c, ops::scratch_workspace(fp4_, s),
                       w_.bias);
    }
  }

 private:
  const GroupedWeights& w_;
  ops::GroupedGemmPlan fp4_;
  ops::GroupedFp8Plan fp8_;
};

// The grouped GEMMs' route by name: each weight kind's plan refuses the other's own route by
// name (fused is 4-bit experts', tiled FP8 experts').
ops::GemmRoute parse_route(std::string_view api, std::string_view route) {
  if (route == "auto") return ops::GemmRoute::kAuto;
  if (route == "decode") return ops::GemmRoute::kDecode;
  if (route == "fused") return ops::GemmRoute::kFused;
  if (route == "tiled") return ops::GemmRoute::kTiled;
  throw Error(ErrorCode::kInvalidArgument, api,
              fmt::format("route: '{}', expected auto, decode, fused (4-bit experts) or tiled "
                          "(FP8 experts)",
                          route));
}

}  // namespace

std::string GroupedWeights::format() const {
  return fp8 ? std::string("e4m3_block128") : std::string(to_string(q.expert.format));
}

GroupedWeights Model::upload_grouped_fp8(nb::handle codes, nb::handle scales, std::int32_t experts,
                                         nb::handle bias, bool bias_bits, std::string_view layout,
                                         std::string label) {
  constexpr std::string_view api = "upload_grouped_fp8_weights";
  Backend& b = open(api);
  const ops::UploadLayout upload = parse_upload_layout(api, layout);
  if (experts < 1 || experts > 1024) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("experts = {} is outside [1, 1024]", experts));
  }
  ArraySpec cs{Element::kU8, 2};
  cs.alignment = 1;
  const ArrayArg c = check_array(api, "codes", as_array(api, "codes", codes, false), false, cs);
  if (c.rows % experts != 0) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("codes: {} rows are not {} experts' [N, K] end to end", c.rows, experts));
  }
  const std::int64_t n = c.rows / experts, k = c.cols;
  (void)ops::describe_fp8_weights(api, n, k);
  ArraySpec spec{Element::kF32, 2, experts * e4m3_blocks(n), e4m3_blocks(k)};
  spec.alignment = 4;
  const ArrayArg s =
      check_array(api, "scales", as_array(api, "scales", scales, false), false, spec);
  std::optional<ArrayArg> bias_arg;
  if (!bias.is_none()) {
    ArraySpec bs{Element::kBf16, 2, experts, n};
    bs.alignment = 2;
    bias_arg = check_array(api, "bias", as_array(api, "bias", bias, false), bias_bits, bs);
  }
  const auto* code_bytes = reinterpret_cast<const std::uint8_t*>(c.ptr.address());
  const auto* scale_values = reinterpret_cast<const float*>(s.ptr.address());
  const auto codes_each = static_cast<std::size_t>(n * k);
  const auto scales_each = static_cast<std::size_t>(e4m3_blocks(n) * e4m3_blocks(k));
  std::vector<E4m3BlockWeightsView> views;
  for (std::size_t e = 0; e < static_cast<std::size_t>(experts); ++e) {
    views.push_back({n, k, std::span(code_bytes + e * codes_each, codes_each),
                     std::span(scale_values + e * scales_each, scales_each)});
  }
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open(api);
  const ops::GroupedFp8WeightsResource* r = as_call(api, [&] {
    return &scope_->add(std::make_unique<ops::GroupedFp8WeightsResource>(b, views, label, upload));
  });
  GroupedWeights w{this, {}, DevicePtr{}, label, true, r->weights()};
  if (bias_arg) {
    w.bias = scope_->alloc_buffer(label + ".bias", bias_arg->bytes);
    b.copy_h2d(w.bias, reinterpret_cast<const void*>(bias_arg->ptr.address()), bias_arg->bytes);
  }
  return w;
}

GroupedWeights Model::upload_grouped(nb::list experts, nb::handle bias, bool bias_bits,
                                     std::string_view layout, std::string label) {
  constexpr std::string_view api = "upload_grouped_weights";
  Backend& b = open(api);
  const ops::UploadLayout upload = parse_upload_layout(api, layout);
  if (experts.size() == 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "experts: an empty list, expected one HostWeights per expert");
  }
  std::vector<HostQuantWeights> host;
  host.reserve(experts.size());
  for (std::size_t e = 0; e < experts.size(); ++e) {
    if (!nb::isinstance<HostQuantWeights>(experts[e])) {
      throw DtypeError(api, fmt::format("experts[{}]: {} is not a metrale.HostWeights", e,
                                        nb::type_name(experts[e].type()).c_str()));
    }
    host.push_back(nb::cast<const HostQuantWeights&>(experts[e]));
  }
  const auto e_count = static_cast<std::int64_t>(host.size());
  std::optional<ArrayArg> bias_arg;
  if (!bias.is_none()) {
    ArraySpec spec{Element::kBf16, 2, e_count, host[0].n};
    spec.alignment = 2;
    bias_arg = check_array(api, "bias", as_array(api, "bias", bias, false), bias_bits, spec);
  }
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open(api);
  const ops::GroupedWeightsResource* r = as_call(api, [&] {
    return &scope_->add(
        std::make_unique<ops::GroupedWeightsResource>(b, std::span(host), label, upload));
  });
  GroupedWeights w{this, r->weights(), DevicePtr{}, label, false, {}};
  if (bias_arg) {
    w.bias = scope_->alloc_buffer(label + ".bias", bias_arg->bytes);
    b.copy_h2d(w.bias, reinterpret_cast<const void*>(bias_arg->ptr.address()), bias_arg->bytes);
  }
  return w;
}

void Model::moe_experts(nb::handle x, bool x_bits, nb::handle ids, nb::handle weights,
                        const GroupedWeights& gate_up, const GroupedWeights& down,
                        std::string_view glu, float alpha, float limit, nb::handle out,
                        bool out_bits, bool allow_unverified, std::string_view route,
                        std::optional<std::uint64_t> stream) {
  constexpr std::string_view api = kExperts;
  Backend& b = open(api);
  const ops::GemmRoute gemm_route = parse_route(api, route);
  check_owner(api, gate_up.model, gate_up.label, "gate_up");
  check_owner(api, down.model, down.label, "down");
  const ops::MoeActivation activation = parse_glu(glu, alpha, limit);
  const std::int64_t hidden = gate_up.k(), width = gate_up.n();
  const std::int32_t experts = gate_up.experts();
  if (width % 2 != 0 || down.k() != width / 2 || down.n() != hidden || down.experts() != experts) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("down: {} experts of {} x {}, expected {} experts of {} x {} for "
                            "gate_up's {} x {} (gate and up of {} each)",
                            down.experts(), down.n(), down.k(), experts, hidden, width / 2, width,
                            hidden, width / 2));
  }
  // Act order: gate_up's K order is gathered with x (moe_gather's column order); down's would
  // have to be gathered from the activation, so it is folded into gate_up's rows before upload
  // (Note [Experts' act order]).
  if (!down.fp8 && down.q.k_order) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "down: act-ordered experts; fold each one's K order into its gate_up rows "
                "(gate and up rows taken in that order with take_rows, down in_stored_order) "
                "before upload, as metrale.torch does");
  }
  ArraySpec spec{Element::kBf16, 2, -1, hidden, device_type()};
  const ArrayArg xa = check_array(api, "x", as_array(api, "x", x, false), x_bits, spec);
  spec.rows = xa.rows;
  const ArrayArg oa = check_array(api, "out", as_array(api, "out", out, true), out_bits, spec);
  ArraySpec routed{Element::kI32, 2, xa.rows, -1, device_type()};
  routed.alignment = 4;
  const ArrayArg ia = check_array(api, "ids", as_array(api, "ids", ids, false), false, routed);
  routed.element = Element::kF32;
  routed.cols = ia.cols;
  const ArrayArg wa =
      check_array(api, "weights", as_array(api, "weights", weights, false), false, routed);
  for (const ArrayArg* in : {&xa, &ia, &wa}) {
    if (overlap(*in, oa)) {
      throw Error(ErrorCode::kInvalidArgument, api, "out: overlaps an input (pass another array)");
    }
  }
  if (ia.cols > INT32_MAX) {
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("ids: {} columns", ia.cols));
  }
  const ops::MoeShape shape{xa.rows, experts, static_cast<std::int32_t>(ia.cols), 0};
  // Before the scratch is sized from it: a refused call must leave nothing allocated.
  ops::check_moe_shape(api, shape);
  const auto rows = static_cast<std::uint64_t>(shape.tokens * shape.top_k);
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open(api);
  const CallStream on = as_call(api, [&] { return CallStream(b, stream); });
  const Loan lx(b, *probe_, xa, on.ordered()), li(b, *probe_, ia, on.ordered());
  const Loan lw(b, *probe_, wa, on.ordered()), lo(b, *probe_, oa, on.ordered());
  as_call(api, [&] {
    const ops::MoeOptions mo{allow_unverified};
    const ops::MoeColumnOrder order = gate_up.fp8 || !gate_up.q.k_order
                                          ? ops::MoeColumnOrder{}
                                          : ops::MoeColumnOrder{ia.ptr, gate_up.q.k_order};
    const Projection p1(b, shape.tokens * shape.top_k, gate_up, allow_unverified, gemm_route,
                        static_cast<bool>(order.columns));
    const Projection p2(b, shape.tokens * shape.top_k, down, allow_unverified, gemm_route, false);
    const auto e = static_cast<std::uint64_t>(experts);
    const auto h = static_cast<std::uint64_t>(hidden), n = static_cast<std::uint64_t>(width);
    Carve c;
    const std::uint64_t counts = c.take(4 * e), offsets = c.take(4 * e + 4), row = c.take(4 * rows),
                        xp = c.take(2 * rows * h), y1 = c.take(2 * rows * n),
                        act = c.take(rows * n), y2 = c.take(2 * rows * h);
    const DevicePtr base = b.op_cache().scratch(
        b, ops::gemm_scratch_tag(b, on.handle(), "moe_experts"), c.at, on.handle());
    const ops::MoeRows r{base.offset(counts), base.offset(offsets), base.offset(row)};
    const StreamHandle s = on.handle();
    ops::moe_align(b, s, ia.ptr, shape, r, mo);
    ops::moe_gather(b, s, xa.ptr, shape, hidden, r.rows, base.offset(xp), mo, order);
    p1.run(s, base.offset(xp), r, base.offset(y1));
    ops::moe_glu(b, s, base.offset(y1), shape, width / 2, activation, r, base.offset(act), mo);
    p2.run(s, base.offset(act), r, base.offset(y2));
    ops::moe_combine(b, s, base.offset(y2), shape, hidden, r.rows, wa.ptr, oa.ptr, mo);
    return 0;
  });
  on.finish();
}

void Model::moe_route(nb::handle logits, nb::handle ids, nb::handle weights,
                      std::string_view scoring, std::int32_t top_k, bool renormalize, float scale,
                      std::int32_t groups, std::int32_t topk_groups, nb::handle bias,
                      bool allow_unverified, std::optional<std::uint64_t> stream) {
  constexpr std::string_view api = "moe_route";
  Backend& b = open(api);
  ops::MoeRouting r;
  if (scoring == "softmax") {
    r.scoring = ops::MoeScoring::kSoftmax;
  } else if (scoring == "topk_softmax") {
    r.scoring = ops::MoeScoring::kTopkSoftmax;
  } else if (scoring == "sigmoid") {
    r.scoring = ops::MoeScoring::kSigmoid;
  } else {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("scoring: '{}', expected softmax, topk_softmax or sigmoid", scoring));
  }
  r.top_k = top_k;
  r.renormalize = renormalize;
  r.scale = scale;
  r.groups = groups;
  r.topk_groups = topk_groups;
  ArraySpec spec{Element::kF32, 2, -1, -1, device_type()};
  spec.alignment = 4;
  const ArrayArg la =
      check_array(api, "logits", as_array(api, "logits", logits, false), false, spec);
  spec.rows = la.rows;
  spec.cols = top_k;
  const ArrayArg wa =
      check_array(api, "weights", as_array(api, "weights", weights, true), false, spec);
  spec.element = Element::kI32;
  const ArrayArg ia = check_array(api, "ids", as_array(api, "ids", ids, true), false, spec);
  std::optional<ArrayArg> ba;
  if (!bias.is_none()) {
    ArraySpec bs{Element::kF32, 1, 1, la.cols, device_type()};
    bs.alignment = 4;
    ba = check_array(api, "bias", as_array(api, "bias", bias, false), false, bs);
    r.bias = ba->ptr;
  }
  if (la.cols > INT32_MAX) {
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("logits: {} columns", la.cols));
  }
  const ops::MoeShape shape{la.rows, static_cast<std::int32_t>(la.cols), top_k, 0};
  nb::gil_scoped_release unlocked;
  const auto lock = lock_open(api);
  const CallStream on = as_call(api, [&] { return CallStream(b, stream); });
  const Loan ll(b, *probe_, la, on.ordered()), li(b, *probe_, ia, on.ordered());
  const Loan lw(b, *probe_, wa, on.ordered());
  std::optional<Loan> lb;
  if (ba) lb.emplace(b, *probe_, *ba, on.ordered());
  as_call(api, [&] {
    ops::moe_route(b, on.handle(), la.ptr, shape, r, ia.ptr, wa.ptr,
                   ops::MoeOptions{allow_unverified});
    return 0;
  });
  on.finish();
}

}  // namespace metrale::py
