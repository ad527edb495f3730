#include "metrale/ops/grouped_gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/nvtx.h"
#include "core/published.h"
#include "kernels/fused_tile.h"
#include "kernels/grouped_params.h"
#include "kernels/tile_math.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "ops/buffer_checks.h"
#include "ops/published_block.h"

namespace metrale::ops {
namespace {

constexpr std::string_view kPlanApi = "plan_grouped";
constexpr std::string_view kRunApi = "run_grouped";
constexpr std::int32_t kMaxExperts = 1024;
static_assert(kMaxExperts <= fused::kGroupedMaxExperts, "gemm_grouped_fused holds every expert");

[[noreturn]] void bad(std::string_view api, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, api, what);
}

// The module's grouped kernel for weights of this packing (and format) on this route.
const char* entry_for(const QuantWeights& w, GemmRoute route) {
  const bool int4 = w.format == WeightFormat::kInt4;
  if (route == GemmRoute::kFused) return int4 ? "gemm_grouped_int4_fused" : "gemm_grouped_fused";
  if (w.packing == WeightPacking::kDecode) {
    return int4 ? "gemm_grouped_int4_decode" : "gemm_grouped_packed";
  }
  return "gemm_grouped";
}

// a × b, refused past 64 bits (no buffer holds that much; a wrapped size would pass the checks).
std::uint64_t product(std::string_view what, std::uint64_t a, std::uint64_t b) {
  if (b != 0 && a > std::numeric_limits<std::uint64_t>::max() / b) {
    bad(kRunApi, fmt::format("{} ({} x {}) does not fit 64 bits", what, a, b));
  }
  return a * b;
}

void check_grouped_weights(const GroupedWeights& w) {
  if (w.experts < 1 || w.experts > kMaxExperts) {
    bad(kPlanApi, fmt::format("experts = {} is outside [1, {}]", w.experts, kMaxExperts));
  }
  if (w.tensor_scales.size() != static_cast<std::size_t>(w.experts) ||
      w.folds.size() != static_cast<std::size_t>(w.experts)) {
    bad(kPlanApi, fmt::format("the weights hold {} tensor scales and {} folds for {} experts",
                              w.tensor_scales.size(), w.folds.size(), w.experts));
  }
  if (w.codes_stride < w.expert.codes_bytes || w.scales_stride < w.expert.scales_bytes ||
      w.codes_stride % kWorkspaceAlign != 0 || w.scales_stride % kWorkspaceAlign != 0) {
    bad(kPlanApi, fmt::format("strides {} and {} do not hold an expert's {} code and {} scale "
                              "bytes on {}-byte boundaries",
                              w.codes_stride, w.scales_stride, w.expert.codes_bytes,
                              w.expert.scales_bytes, kWorkspaceAlign));
  }
  if (w.expert.act_order) {
    bad(kPlanApi,
        "the experts' description has an act order: upload act-ordered experts with "
        "GroupedWeightsResource, which stores them in their K order (k_order)");
  }
  // Every expert's tensor scale and fold as plan() checks one expert's (the table is read as
  // given: a NaN scale would make that expert's C NaN).
  const bool int4 = w.expert.format == WeightFormat::kInt4;
  for (std::int32_t e = 0; e < w.experts; ++e) {
    const float s = w.tensor_scales[static_cast<std::size_t>(e)];
    if (!(s > 0.0f) || !std::isfinite(s) || (int4 && s != 1.0f)) {
      bad(kPlanApi, fmt::format("expert {}'s tensor scale {} is not {}", e, s,
                                int4 ? "1 (int4 weights have none)" : "a positive finite number"));
    }
    // INT4 weights carry no fold either (the INT4 decode kernel reads none; the fused one would
    // apply it).
    const std::int32_t fold = w.folds[static_cast<std::size_t>(e)];
    if (fold < -128 || fold > 127 ||
        ((w.expert.packing != WeightPacking::kDecode || int4) && fold != 0)) {
      bad(kPlanApi, fmt::format("expert {}'s fold {} is outside [-128, 127] or set on weights "
                                "outside the FP4 decode layout",
                                e, fold));
    }
  }
}

// Whether two descriptions are of weights one plan serves: every field but the buffers, the
// tensor scale and the fold (per expert, in the table).
bool same_weights(const QuantWeights& a, const QuantWeights& b) {
  return a.format == b.format && a.layout == b.layout && a.packing == b.packing && a.n == b.n &&
         a.k == b.k && a.codes_bytes == b.codes_bytes && a.scales_bytes == b.scales_bytes &&
         a.group == b.group && a.fp16_scales == b.fp16_scales && a.zero_points == b.zero_points &&
         a.act_order == b.act_order && a.a_k == b.a_k;
}

// The route options ask for, or kAuto's choice: the fused kernel for decode-layout weights (FP4
// in the decode layout, INT4 in the INT4 decode layout) whose rows per expert on average pass
// the decode sizes, where the module's is verified (or the CPU's reference twin); the decode
// kernels otherwise. Asking for kFused on another packing, or for a route the grouped op does not
// have, is refused by name.
GemmRoute route_of(Backend& backend, std::int64_t rows, std::int32_t experts,
                   const QuantWeights& first, const GroupedGemmOptions& options) {
  const bool decode_layout = first.packing == WeightPacking::kDecode;
  const bool int4 = first.format == WeightFormat::kInt4;
  switch (options.route) {
    case GemmRoute::kDecode:
      return GemmRoute::kDecode;
    case GemmRoute::kFused:
      if (!decode_layout) {
        bad(kPlanApi, fmt::format("the fused route reads weights in the decode layout (NVFP4, "
                                  "MXFP4; INT4 in the INT4 decode layout); these are {} in "
                                  "packing {}",
                                  to_string(first.format), static_cast<int>(first.packing)));
      }
      return GemmRoute::kFused;
    case GemmRoute::kAuto:
      break;
    default:
      bad(kPlanApi, fmt::format("route {} is not a grouped route (kAuto, kDecode or kFused)",
                                to_string(options.route)));
  }
  // The fused kernel for these weights, and the dense decode entry whose largest M says where
  // decode sizes end.
  const char* fused_entry = entry_for(first, GemmRoute::kFused);
  const char* decode_entry = int4 ? "gemm_int4_decode" : "gemm_decode";
  if (!decode_layout || !backend.has_kernel("w4a16", fused_entry) ||
      !backend.has_kernel("w4a16", decode_entry)) {
    return GemmRoute::kDecode;
  }
  const KernelMeta& fused = backend.op_cache().kernel(backend, "w4a16", fused_entry).meta;
  const KernelMeta& decode = backend.op_cache().kernel(backend, "w4a16", decode_entry).meta;
  const bool large = decode.max_m != 0 && rows > std::int64_t{decode.max_m} * experts;
  return large && !fused.absent && automatic_choice_allowed(fused) ? GemmRoute::kFused
                                                                   : GemmRoute::kDecode;
}

// Whether the plan's reduction is the one plan_grouped makes: gemm_grouped_split_reduce over (N
// tiles of its published width, experts) blocks of its published size. Another grid or kernel
// would leave columns or experts of C unsummed.
bool reduce_fits(const GroupedGemmPlan& plan) {
  Backend& backend = *plan.backend;
  const PlannedLaunch& r = plan.reduce;
  if (r.kernel.handle !=
      backend.op_cache().kernel(backend, "w4a16", "gemm_grouped_split_reduce").handle) {
    return false;
  }
  const std::uint64_t tile = backend.kernel_n_tile(r.kernel);
  return tile != 0 && r.grid.x == (static_cast<std::uint64_t>(plan.n) + tile - 1) / tile &&
         r.grid.y == static_cast<std::uint64_t>(plan.experts) && r.grid.z == 1 &&
         r.block == Dim3{r.kernel.meta.block_threads} && r.block.x != 0;
}

// Whether the plan's K slices are those plan_grouped makes: none, or `splits` slices of
// k_per_split (a multiple of the kernel's split unit, none empty, the last reaching K) over grid
// z, with partials of splits x rows x N and the reduction planned. An edited plan would leave part
// of K unsummed or the reduction reading partials nobody wrote: refused.
void check_split(const GroupedGemmPlan& plan) {
  const auto fits = [&plan] {
    if (plan.launch.grid.z != static_cast<std::uint64_t>(plan.splits)) return false;
    if (plan.splits == 1) return plan.k_per_split == plan.k && plan.workspace_bytes == 0;
    std::int64_t covered = 0;
    std::uint64_t bytes = 0;
    const std::uint32_t unit = plan.launch.kernel.meta.split_k;
    return plan.splits > 1 && plan.splits <= kMaxSplits && plan.k_per_split > 0 && unit != 0 &&
           plan.k_per_split % unit == 0 &&
           !__builtin_mul_overflow(plan.splits, plan.k_per_split, &covered) && covered >= plan.k &&
           covered - plan.k_per_split < plan.k &&
           !__builtin_mul_overflow(
               static_cast<std::uint64_t>(plan.splits) * static_cast<std::uint64_t>(plan.rows),
               static_cast<std::uint64_t>(plan.n) * sizeof(float), &bytes) &&
           bytes == plan.workspace_bytes && static_cast<bool>(plan.reduce.kernel) &&
           reduce_fits(plan);
  };
  if (!fits()) {
    bad(kRunApi,
        fmt::format("the plan's split of K ({} x {} over grid z {}, workspace {} B) is not "
                    "one plan_grouped makes for K = {}, rows = {}, N = {}",
                    plan.splits, plan.k_per_split, plan.launch.grid.z, plan.workspace_bytes, plan.k,
                    plan.rows, plan.n));
  }
}

}  // namespace

std::string GroupedGemmPlan::describe() const {
  std::string s = fmt::format("grouped rows={} N={} K={} x {} experts: {} {}x{}x{} x {} threads",
                              rows, n, k, experts, backend->kernel_name(launch.kernel),
                              launch.grid.x, launch.grid.y, launch.grid.z, launch.block.x);
  if (splits > 1) {
    s += fmt::format(", {} {}x{}x{} x {} threads; split-K {} x {}; workspace {} B",
                     backend->kernel_name(reduce.kernel), reduce.grid.x, reduce.grid.y,
                     reduce.grid.z, reduce.block.x, splits, k_per_split, workspace_bytes);
  }
  return s;
}

GroupedGemmPlan plan_grouped(Backend& backend, std::int64_t rows, const GroupedWeights& w,
                             const GroupedGemmOptions& options) {
  const nvtx::Range range("metrale::ops::plan_grouped");
  if (rows < 1 || rows > std::numeric_limits<std::int32_t>::max()) {
    bad(kPlanApi, fmt::format("rows = {} is outside [1, 2^31 - 1]", rows));
  }
  check_grouped_weights(w);
  if (static_cast<bool>(w.k_order) != options.a_in_k_order) {
    bad(kPlanApi, w.k_order ? "the experts are act-ordered (k_order): give each expert's rows of "
                              "A in its K order (moe_gather with MoeColumnOrder) and set "
                              "GroupedGemmOptions::a_in_k_order"
                            : "a_in_k_order is set for experts without act order (no k_order)");
  }
  // One expert's weights through the dense planner on the decode route: every check plan() makes
  // of weights, and the kernels' flags for them (format, layout, packing, INT4, bias, FP32 C).
  GemmOptions dense;
  dense.route = GemmRoute::kDecode;
  dense.out_f32 = options.out_f32;
  const QuantWeights first = w.view(0);
  const GemmPlan one = plan(backend, 1, first, dense);
  const GemmRoute route = route_of(backend, rows, w.experts, first, options);
  const char* entry = entry_for(first, route);
  if (!backend.has_kernel("w4a16", entry)) {
    throw Error(ErrorCode::kNotFound, kPlanApi,
                fmt::format("{} has no grouped GEMM w4a16::{}", backend.name(), entry));
  }
  const ResolvedKernel& k = backend.op_cache().kernel(backend, "w4a16", entry);
  if (k.meta.absent) {
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} is a placeholder on this target (it publishes {}_absent): the "
                            "fused route needs wgmma (sm_90a)",
                            backend.kernel_name(k), entry));
  }
  const bool int4 = first.format == WeightFormat::kInt4;
  if ((int4 && !k.meta.int4) || (first.packing == WeightPacking::kPanels && !k.meta.panels) ||
      (options.out_f32 && !k.meta.out_f32)) {
    const char* missing = int4 && !k.meta.int4                                        ? "_int4"
                          : first.packing == WeightPacking::kPanels && !k.meta.panels ? "_panels"
                                                                                      : "_out_f32";
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} does not read {} weights in the {} packing{} (it publishes no "
                            "{})",
                            backend.kernel_name(k), to_string(first.format),
                            static_cast<int>(first.packing), options.out_f32 ? " into FP32 C" : "",
                            missing));
  }
  if (!options.allow_unverified && !automatic_choice_allowed(k.meta)) {
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} is {}; set GroupedGemmOptions::allow_unverified to run it before "
                            "a device run verifies it",
                            backend.kernel_name(k), verification_text(k.meta)));
  }
  const std::uint64_t tile = backend.kernel_n_tile(k);
  const auto n_tiles = (static_cast<std::uint64_t>(first.n) + tile - 1) / tile;
  Dim3 grid{static_cast<std::uint32_t>(n_tiles), static_cast<std::uint32_t>(w.experts), 1};
  if (k.meta.persistent) {
    // The kernel walks the layer's tiles itself: expert e's rows take ceil(rows_e / m_tile) M
    // tiles, at most rows / m_tile + min(experts, rows) of them whatever the routing (rows of no
    // two experts overlapping; the kernel counts no more: fused::grouped_max_slots), a count it
    // keeps in 32 bits. One wave, or a block per tile where the capacity makes fewer.
    if (k.meta.m_tile == 0) {
      throw Error(ErrorCode::kNotFound, kPlanApi,
                  fmt::format("{} is persistent but publishes no M tile", backend.kernel_name(k)));
    }
    const auto most = static_cast<std::uint64_t>(rows) / k.meta.m_tile +
                      std::min<std::uint64_t>(static_cast<std::uint64_t>(w.experts),
                                              static_cast<std::uint64_t>(rows));
    if (most * n_tiles > 0x7FFFFFFFu) {
      bad(kPlanApi, fmt::format("rows = {} and N = {} may make {} tiles for {}, which counts at "
                                "most 2^31 - 1",
                                rows, first.n, most * n_tiles, backend.kernel_name(k)));
    }
    grid = Dim3{static_cast<std::uint32_t>(std::min<std::uint64_t>(
        most * n_tiles, static_cast<std::uint64_t>(wave_blocks(kPlanApi, backend, k))))};
  }
  // Split-K on the decode route, as the dense decode route splits: the experts that can have rows
  // (no more than the rows routed: the capacity unless the caller says fewer) make at most
  // n_tiles x min(experts, rows) blocks that do work (the others leave at once), and where those
  // fill the device's waves poorly K is cut into slices. Sized from the shape, never the routing.
  if (options.routed_rows < 0 || options.routed_rows > rows) {
    bad(kPlanApi,
        fmt::format("routed_rows = {} is outside [0, rows = {}]", options.routed_rows, rows));
  }
  tiles::SplitK split{1, first.k};
  if (!k.meta.persistent && k.meta.split_k != 0) {
    const std::int64_t routed = options.routed_rows > 0 ? options.routed_rows : rows;
    const auto working =
        static_cast<std::int64_t>(n_tiles) * std::min<std::int64_t>(w.experts, routed);
    split = tiles::plan_split_k_waves(first.k, k.meta.split_k, working,
                                      wave_blocks(kPlanApi, backend, k), kMaxSplits);
  }
  grid.z = static_cast<std::uint32_t>(split.splits);
  GroupedGemmPlan p;
  p.backend = &backend;
  p.rows = rows;
  p.n = first.n;
  p.k = first.k;
  p.experts = w.experts;
  p.format = first.format;
  p.layout = first.layout;
  p.packing = first.packing;
  p.group = first.group;
  p.expert = first;
  p.expert.codes = p.expert.scales = DevicePtr{};
  p.bias = options.bias;
  p.out_f32 = options.out_f32;
  p.a_in_k_order = options.a_in_k_order;
  p.flags = (one.flags & ~kGemmBias) | (options.bias ? kGemmBias : 0u);
  p.route = route;
  p.launch = PlannedLaunch{k, grid, published_block(kPlanApi, backend, k), k.meta.smem_bytes};
  p.splits = split.splits;
  p.k_per_split = split.k_per_split;
  if (split.splits > 1) {
    // FP32 partials [splits, rows, N], each expert's slices beside its rows (grouped_params.h);
    // the reduction a block per published tile of an expert's columns.
    if (__builtin_mul_overflow(
            static_cast<std::uint64_t>(split.splits) * static_cast<std::uint64_t>(rows),
            static_cast<std::uint64_t>(first.n) * sizeof(float), &p.workspace_bytes)) {
      bad(kPlanApi, fmt::format("the split-K partials of {} x {} rows x N = {} would be more "
                                "bytes than 64 bits can count",
                                split.splits, rows, first.n));
    }
    const char* reducer = "gemm_grouped_split_reduce";
    if (!backend.has_kernel("w4a16", reducer)) {
      throw Error(ErrorCode::kNotFound, kPlanApi,
                  fmt::format("{} has no w4a16::{} to sum the K slices of {}", backend.name(),
                              reducer, backend.kernel_name(k)));
    }
    const ResolvedKernel& r = backend.op_cache().kernel(backend, "w4a16", reducer);
    if (options.out_f32 && !r.meta.out_f32) {
      throw Error(ErrorCode::kUnavailable, kPlanApi,
                  fmt::format("{} writes C in BF16 only (it publishes no out_f32)",
                              backend.kernel_name(r)));
    }
    const std::uint64_t reduce_tile = backend.kernel_n_tile(r);
    p.reduce = PlannedLaunch{
        r,
        Dim3{static_cast<std::uint32_t>((static_cast<std::uint64_t>(first.n) + reduce_tile - 1) /
                                        reduce_tile),
             static_cast<std::uint32_t>(w.experts), 1},
        published_block(kPlanApi, backend, r), r.meta.smem_bytes};
  }
  return p;
}

void run_grouped(const GroupedGemmPlan& plan, StreamHandle stream, DevicePtr a,
                 const GroupedWeights& w, DevicePtr counts, DevicePtr offsets, DevicePtr c,
                 const GroupedGemmWorkspace& workspace, DevicePtr bias) {
  const nvtx::Range range("metrale::ops::run_grouped");
  if (plan.backend == nullptr) bad(kRunApi, "the plan was made by no backend (plan_grouped)");
  Backend& backend = *plan.backend;
  // A plan's handles belong to its backend's modules: refused once teardown released them.
  if (backend.op_cache().released()) {
    throw Error(ErrorCode::kState, kRunApi,
                "the plan's backend was torn down (its op cache is released); plan again on a "
                "live backend");
  }
  check_grouped_weights(w);
  if (w.experts != plan.experts || !same_weights(w.expert, plan.expert) ||
      plan.n != plan.expert.n || plan.k != plan.expert.k) {
    bad(kRunApi,
        fmt::format("the weights ({} experts of {} x {}, {} packing {}, {} code and {} scale "
                    "bytes{}{}) are not the plan's ({} experts of {} x {}, {} packing {}, {} and "
                    "{} bytes{}{})",
                    w.experts, w.expert.n, w.expert.k, to_string(w.expert.format),
                    static_cast<int>(w.expert.packing), w.expert.codes_bytes, w.expert.scales_bytes,
                    w.expert.zero_points ? ", zero points" : "",
                    w.expert.fp16_scales ? ", fp16 scales" : "", plan.experts, plan.n, plan.k,
                    to_string(plan.format), static_cast<int>(plan.packing), plan.expert.codes_bytes,
                    plan.expert.scales_bytes, plan.expert.zero_points ? ", zero points" : "",
                    plan.expert.fp16_scales ? ", fp16 scales" : ""));
  }
  if (plan.a_in_k_order != static_cast<bool>(w.k_order)) {
    bad(kRunApi, plan.a_in_k_order ? "the plan is for act-ordered experts, the weights have none"
                                   : "the weights are act-ordered (k_order), the plan is not");
  }
  check_split(plan);
  if (plan.bias != static_cast<bool>(bias)) {
    bad(kRunApi, plan.bias ? "the plan takes a bias and none was given"
                           : "a bias was given to a plan made without one");
  }
  const auto experts = static_cast<std::uint64_t>(plan.experts);
  const auto rows = static_cast<std::uint64_t>(plan.rows);
  const std::uint64_t a_bytes = product("A's bytes", rows, product("a row", plan.k, 2));
  const std::uint64_t c_bytes =
      product("C's bytes", rows, product("a row", plan.n, plan.out_f32 ? 4 : 2));
  const std::uint64_t codes_bytes = product("the codes", experts, w.codes_stride);
  const std::uint64_t scales_bytes = product("the scales", experts, w.scales_stride);
  const std::uint64_t bias_bytes = product("the bias", experts, product("a row", plan.n, 2));
  // Null or misaligned weights (check_range passes a null pointer).
  check_pointer(kRunApi, "weight codes", w.expert.codes);
  check_pointer(kRunApi, "weight scales", w.expert.scales);
  const CallRanges r =
      check_call_buffers(kRunApi, backend, a, a_bytes, c, c_bytes, w.expert.codes, codes_bytes,
                         w.expert.scales, scales_bytes, bias, bias_bytes);
  std::array<Range, 3> tables;
  std::size_t t = 0;
  for (const auto& [name, p, bytes] : {std::tuple{"counts", counts, 4 * experts},
                                       {"offsets", offsets, 4 * experts + 4},
                                       {"expert table", w.table, 8 * experts}}) {
    if (!p) bad(kRunApi, fmt::format("{} is null", name));
    if (p.address() % 4 != 0) {
      bad(kRunApi, fmt::format("{} = 0x{:x} is not 4-byte aligned", name, p.address()));
    }
    backend.check_range(kRunApi, name, p, bytes);
    tables[t] = Range{name, p.address(), bytes};
    check_no_overlap(kRunApi, r.c, {tables[t++]});
  }
  // The partials: the decode kernel writes them, the reduction reads them and writes C.
  const Range split{"split-K workspace", workspace.split_k.address(), plan.workspace_bytes};
  check_workspace_part(kRunApi, backend, split, workspace.split_k,
                       {r.a, r.c, r.codes, r.scales, r.bias, tables[0], tables[1], tables[2]});
  GroupedGemmParams g;
  g.gemm.a = a.address();
  g.gemm.codes = w.expert.codes.address();
  g.gemm.scales = w.expert.scales.address();
  g.gemm.out = c.address();
  g.gemm.bias = bias.address();
  g.gemm.m = plan.rows;
  g.gemm.n = plan.n;
  g.gemm.k = plan.k;
  g.gemm.flags = plan.flags;
  g.gemm.workspace = plan.splits > 1 ? workspace.split_k.address() : 0;
  g.gemm.splits = plan.splits;
  g.gemm.k_per_split = plan.k_per_split;
  g.gemm.group = w.expert.group;
  g.gemm.a_k = plan.k;
  g.counts = counts.address();
  g.offsets = offsets.address();
  g.expert_table = w.table.address();
  g.codes_stride = w.codes_stride;
  g.scales_stride = w.scales_stride;
  g.experts = plan.experts;
  backend.launch_typed(plan.launch.kernel, plan.launch.grid, plan.launch.block,
                       plan.launch.smem_bytes, stream, std::array{KernelArg::value(g)});
  if (plan.splits > 1) {
    backend.launch_typed(plan.reduce.kernel, plan.reduce.grid, plan.reduce.block,
                         plan.reduce.smem_bytes, stream, std::array{KernelArg::value(g)});
  }
}

GroupedGemmWorkspace scratch_workspace(const GroupedGemmPlan& plan, StreamHandle stream) {
  if (plan.backend == nullptr) {
    bad("scratch_workspace", "the plan is empty (made by no call to plan_grouped)");
  }
  if (plan.workspace_bytes == 0) return {};
  Backend& backend = *plan.backend;
  return GroupedGemmWorkspace{backend.op_cache().scratch(
      backend, gemm_scratch_tag(backend, stream, "gemm_split_k"), plan.workspace_bytes, stream)};
}

}  // namespace metrale::ops
