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

}  // namespace

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
  std::lock_guard lock(call_mu_);
  const ops::GroupedWeightsResource* r = as_call(api, [&] {
    return &scope_->add(
        std::make_unique<ops::GroupedWeightsResource>(b, std::span(host), label, upload));
  });
  GroupedWeights w{this, r->weights(), DevicePtr{}, label};
  if (bias_arg) {
    w.bias = scope_->alloc_buffer(label + ".bias", bias_arg->bytes);
    b.copy_h2d(w.bias, reinterpret_cast<const void*>(bias_arg->ptr.address()), bias_arg->bytes);
  }
  return w;
}

void Model::moe_experts(nb::handle x, bool x_bits, nb::handle ids, nb::handle weights,
                        const GroupedWeights& gate_up, const GroupedWeights& down,
                        std::string_view glu, float alpha, float limit, nb::handle out,
                        bool out_bits, bool allow_unverified, std::optional<std::uint64_t> stream) {
  constexpr std::string_view api = kExperts;
  Backend& b = open(api);
  check_owner(api, gate_up.model, gate_up.label, "gate_up");
  check_owner(api, down.model, down.label, "down");
  const ops::MoeActivation activation = parse_glu(glu, alpha, limit);
  const std::int64_t hidden = gate_up.q.expert.k, width = gate_up.q.expert.n;
  const std::int32_t experts = gate_up.q.experts;
  if (width % 2 != 0 || down.q.expert.k != width / 2 || down.q.expert.n != hidden ||
      down.q.experts != experts) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("down: {} experts of {} x {}, expected {} experts of {} x {} for "
                            "gate_up's {} x {} (gate and up of {} each)",
                            down.q.experts, down.q.expert.n, down.q.expert.k, experts, hidden,
                            width / 2, width, hidden, width / 2));
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
  std::lock_guard lock(call_mu_);
  const CallStream on = as_call(api, [&] { return CallStream(b, stream); });
  const Loan lx(b, *probe_, xa, on.ordered()), li(b, *probe_, ia, on.ordered());
  const Loan lw(b, *probe_, wa, on.ordered()), lo(b, *probe_, oa, on.ordered());
  as_call(api, [&] {
    const ops::MoeOptions mo{allow_unverified};
    ops::GroupedGemmOptions go;
    go.allow_unverified = allow_unverified;
    go.bias = static_cast<bool>(gate_up.bias);
    const ops::GroupedGemmPlan p1 = ops::plan_grouped(b, shape.tokens * shape.top_k, gate_up.q, go);
    go.bias = static_cast<bool>(down.bias);
    const ops::GroupedGemmPlan p2 = ops::plan_grouped(b, shape.tokens * shape.top_k, down.q, go);
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
    ops::moe_gather(b, s, xa.ptr, shape, hidden, r.rows, base.offset(xp), mo);
    ops::run_grouped(p1, s, base.offset(xp), gate_up.q, r.counts, r.offsets, base.offset(y1),
                     gate_up.bias);
    ops::moe_glu(b, s, base.offset(y1), shape, width / 2, activation, r, base.offset(act), mo);
    ops::run_grouped(p2, s, base.offset(act), down.q, r.counts, r.offsets, base.offset(y2),
                     down.bias);
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
  std::lock_guard lock(call_mu_);
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
