#include "metrale/ops/moe.h"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "core/nvtx.h"
#include "core/published.h"
#include "kernels/moe_glu.h"
#include "kernels/moe_permute.h"
#include "kernels/moe_route.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "ops/buffer_checks.h"
#include "ops/published_block.h"

namespace metrale::ops {
namespace {

[[noreturn]] void bad(std::string_view api, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, api, what);
}

// A present buffer aligned to `align`, inside the backend's allocations for `bytes`.
void check_buffer(Backend& backend, std::string_view api, const char* name, DevicePtr p,
                  std::uint64_t bytes, std::uint64_t align) {
  if (!p) bad(api, fmt::format("{} is null", name));
  if (p.address() % align != 0) {
    bad(api, fmt::format("{} = 0x{:x} is not {}-byte aligned", name, p.address(), align));
  }
  backend.check_range(api, name, p, bytes);
}

void check_shape(std::string_view api, const MoeShape& s) {
  if (s.tokens < 1 || s.tokens > (std::int64_t{1} << 31) / moe::kMaxTopK) {
    bad(api, fmt::format("tokens = {} is outside [1, 2^26]", s.tokens));
  }
  if (s.experts < 1 || s.experts > moe::kMaxExperts) {
    bad(api, fmt::format("experts = {} is outside [1, {}]", s.experts, moe::kMaxExperts));
  }
  // Not bounded by experts: a rank holding some of a layer's experts takes each token's top_k
  // ids, those held elsewhere as -1 (moe_permute.h's valid_id). Routing bounds it (moe_route).
  if (s.top_k < 1 || s.top_k > moe::kMaxTopK) {
    bad(api, fmt::format("top_k = {} is outside [1, {}]", s.top_k, moe::kMaxTopK));
  }
  if (s.capacity < 0 || (s.capacity > 0 && s.capacity < s.tokens)) {
    bad(api, fmt::format("capacity = {} is neither 0 (contiguous) nor at least tokens = {} "
                         "(masked: a smaller capacity could drop tokens)",
                         s.capacity, s.tokens));
  }
  // Rows are int32 indices and offsets[E] is one past the last: fewer than 2^31 rows, checked
  // before the product that counts them could overflow.
  constexpr std::int64_t kMaxRows = (std::int64_t{1} << 31) - 1;
  if (s.capacity > kMaxRows / s.experts || s.tokens * s.top_k > kMaxRows) {
    bad(api, fmt::format("{} experts x capacity {} or {} tokens x top_k {} rows do not fit int32 "
                         "row indices",
                         s.experts, s.capacity, s.tokens, s.top_k));
  }
}

// The kernel, refused when no device run has verified it and the caller has not opted in.
const ResolvedKernel& kernel(Backend& backend, std::string_view api, std::string_view entry,
                             const MoeOptions& options) {
  const ResolvedKernel& k = backend.op_cache().kernel(backend, "moe", entry);
  if (!options.allow_unverified && !automatic_choice_allowed(k.meta)) {
    throw Error(ErrorCode::kUnavailable, api,
                fmt::format("{} is {}; set MoeOptions::allow_unverified to run it before a device "
                            "run verifies it",
                            backend.kernel_name(k), verification_text(k.meta)));
  }
  return k;
}

// A kernel's grid over `items` in tiles of its published width, and its published block; sized
// before anything is queued, since the block's lookup can throw.
struct Sized {
  const ResolvedKernel& kernel;
  Dim3 grid, block;
};
Sized sized(Backend& backend, std::string_view api, const ResolvedKernel& k, std::int64_t items) {
  const std::uint64_t tile = backend.kernel_n_tile(k);
  const auto blocks = (static_cast<std::uint64_t>(items) + tile - 1) / tile;
  return Sized{k, Dim3{static_cast<std::uint32_t>(blocks), 1, 1}, published_block(api, backend, k)};
}

template <class Params>
void queue(Backend& backend, const Sized& s, StreamHandle stream, const Params& params) {
  backend.launch_typed(s.kernel, s.grid, s.block, 0, stream, std::array{KernelArg::value(params)});
}

template <class Params>
void launch(Backend& backend, std::string_view api, const ResolvedKernel& k, std::int64_t items,
            StreamHandle stream, const Params& params) {
  queue(backend, sized(backend, api, k, items), stream, params);
}

std::uint64_t entries(const MoeShape& s) {
  return static_cast<std::uint64_t>(s.tokens) * static_cast<std::uint64_t>(s.top_k);
}

void check_width(std::string_view api, std::int64_t width) {
  if (width < 8 || width % 8 != 0 || width > (std::int64_t{1} << 24)) {
    bad(api, fmt::format("width = {} is not a multiple of 8 in [8, 2^24]", width));
  }
}

MoePermuteParams permute_params(DevicePtr in, DevicePtr out, DevicePtr rows, const MoeShape& shape,
                                std::int64_t width) {
  MoePermuteParams p;
  p.in = in.address();
  p.out = out.address();
  p.rows = rows.address();
  p.tokens = shape.tokens;
  p.width = width;
  p.top_k = shape.top_k;
  p.row_capacity = shape.row_capacity();
  return p;
}

}  // namespace

void check_moe_shape(std::string_view api, const MoeShape& shape) {
  check_shape(api, shape);
}

void moe_route(Backend& backend, StreamHandle stream, DevicePtr logits, const MoeShape& shape,
               const MoeRouting& r, DevicePtr ids, DevicePtr weights, const MoeOptions& options) {
  constexpr std::string_view kApi = "moe_route";
  const nvtx::Range range("metrale::ops::moe_route");
  check_shape(kApi, shape);
  if (r.scoring != MoeScoring::kSoftmax && r.scoring != MoeScoring::kTopkSoftmax &&
      r.scoring != MoeScoring::kSigmoid) {
    bad(kApi, fmt::format("scoring = {} is not a MoeScoring", static_cast<int>(r.scoring)));
  }
  if (!std::isfinite(r.scale)) {
    bad(kApi, fmt::format("scale = {} is not finite (every weight is multiplied by it)", r.scale));
  }
  const bool sigmoid = r.scoring == MoeScoring::kSigmoid;
  if (r.top_k != shape.top_k) {
    bad(kApi,
        fmt::format("routing.top_k = {} differs from shape.top_k = {}", r.top_k, shape.top_k));
  }
  if (r.groups < 1 || r.groups > moe::kMaxGroups || shape.experts % r.groups != 0) {
    bad(kApi, fmt::format("groups = {} does not divide experts = {} into at most {} groups",
                          r.groups, shape.experts, moe::kMaxGroups));
  }
  if (r.topk_groups < 1 || r.topk_groups > r.groups) {
    bad(kApi, fmt::format("topk_groups = {} is outside [1, groups = {}]", r.topk_groups, r.groups));
  }
  if (!sigmoid && (r.groups != 1 || r.bias)) {
    bad(kApi, "groups and a bias are DeepSeek's sigmoid routing's (scoring kSigmoid) only");
  }
  if (r.scoring == MoeScoring::kTopkSoftmax && r.renormalize) {
    bad(kApi, "renormalize has no meaning for kTopkSoftmax (its k weights already sum to 1)");
  }
  const std::int64_t allowed = shape.experts / r.groups * r.topk_groups;
  if (shape.top_k > allowed) {
    bad(kApi, r.groups == 1
                  ? fmt::format("top_k = {} exceeds experts = {}", shape.top_k, shape.experts)
                  : fmt::format("top_k = {} exceeds the {} experts of the topk_groups = {} groups",
                                shape.top_k, allowed, r.topk_groups));
  }
  const std::uint64_t logit_bytes = static_cast<std::uint64_t>(shape.tokens) * shape.experts * 4;
  check_buffer(backend, kApi, "logits", logits, logit_bytes, 4);
  if (r.bias) check_buffer(backend, kApi, "bias", r.bias, std::uint64_t{4} * shape.experts, 4);
  check_buffer(backend, kApi, "ids", ids, entries(shape) * 4, 4);
  check_buffer(backend, kApi, "weights", weights, entries(shape) * 4, 4);
  const Range in_logits{"logits", logits.address(), logit_bytes};
  const Range in_bias{"bias", r.bias.address(), r.bias ? std::uint64_t{4} * shape.experts : 0};
  const Range out_ids{"ids", ids.address(), entries(shape) * 4};
  const Range out_w{"weights", weights.address(), entries(shape) * 4};
  check_no_overlap(kApi, out_ids, {in_logits, in_bias, out_w});
  check_no_overlap(kApi, out_w, {in_logits, in_bias});
  const ResolvedKernel& k = kernel(backend, kApi, "moe_route", options);
  MoeRouteParams p;
  p.logits = logits.address();
  p.bias = r.bias.address();
  p.ids = ids.address();
  p.weights = weights.address();
  p.tokens = shape.tokens;
  p.experts = shape.experts;
  p.top_k = shape.top_k;
  p.groups = r.groups;
  p.topk_groups = r.topk_groups;
  p.scoring = sigmoid ? kMoeSigmoid
                      : (r.scoring == MoeScoring::kTopkSoftmax ? kMoeTopkSoftmax : kMoeSoftmax);
  p.renormalize = r.renormalize ? 1 : 0;
  p.scale = r.scale;
  launch(backend, kApi, k, shape.tokens, stream, p);
}

void moe_align(Backend& backend, StreamHandle stream, DevicePtr ids, const MoeShape& shape,
               const MoeRows& rows, const MoeOptions& options) {
  constexpr std::string_view kApi = "moe_align";
  const nvtx::Range range("metrale::ops::moe_align");
  check_shape(kApi, shape);
  const std::uint64_t e_bytes = std::uint64_t{4} * shape.experts;
  check_buffer(backend, kApi, "ids", ids, entries(shape) * 4, 4);
  check_buffer(backend, kApi, "counts", rows.counts, e_bytes, 4);
  check_buffer(backend, kApi, "offsets", rows.offsets, e_bytes + 4, 4);
  check_buffer(backend, kApi, "rows", rows.rows, entries(shape) * 4, 4);
  const Range in{"ids", ids.address(), entries(shape) * 4};
  const Range counts{"counts", rows.counts.address(), e_bytes};
  const Range offsets{"offsets", rows.offsets.address(), e_bytes + 4};
  const Range out{"rows", rows.rows.address(), entries(shape) * 4};
  check_no_overlap(kApi, counts, {in, offsets, out});
  check_no_overlap(kApi, offsets, {in, out});
  check_no_overlap(kApi, out, {in});
  const ResolvedKernel& count = kernel(backend, kApi, "moe_count", options);
  const ResolvedKernel& scatter = kernel(backend, kApi, "moe_scatter", options);
  MoeAlignParams p;
  p.ids = ids.address();
  p.counts = rows.counts.address();
  p.offsets = rows.offsets.address();
  p.rows = rows.rows.address();
  p.entries = static_cast<std::int64_t>(entries(shape));
  p.experts = shape.experts;
  p.capacity = shape.capacity;
  // moe_count is one block whatever its tile: it counts every entry and scans every expert. Both
  // launches are sized before either is queued: counts and offsets are not written when the
  // scatter's lookup throws.
  const Sized counting{count, Dim3{1, 1, 1}, published_block(kApi, backend, count)};
  const Sized scattering = sized(backend, kApi, scatter, shape.experts);
  queue(backend, counting, stream, p);
  queue(backend, scattering, stream, p);
}

void moe_gather(Backend& backend, StreamHandle stream, DevicePtr x, const MoeShape& shape,
                std::int64_t width, DevicePtr rows, DevicePtr x_perm, const MoeOptions& options,
                const MoeColumnOrder& order) {
  constexpr std::string_view kApi = "moe_gather";
  const nvtx::Range range("metrale::ops::moe_gather");
  check_shape(kApi, shape);
  check_width(kApi, width);
  const std::uint64_t x_bytes = static_cast<std::uint64_t>(shape.tokens) * width * 2;
  const std::uint64_t perm_bytes = static_cast<std::uint64_t>(shape.row_capacity()) * width * 2;
  check_buffer(backend, kApi, "x", x, x_bytes, kAlign);
  check_buffer(backend, kApi, "rows", rows, entries(shape) * 4, 4);
  check_buffer(backend, kApi, "x_perm", x_perm, perm_bytes, kAlign);
  check_no_overlap(
      kApi, Range{"x_perm", x_perm.address(), perm_bytes},
      {Range{"x", x.address(), x_bytes}, Range{"rows", rows.address(), entries(shape) * 4}});
  if (static_cast<bool>(order.ids) != static_cast<bool>(order.columns)) {
    bad(kApi, "order: ids and columns go together (both for act-ordered experts, or neither)");
  }
  const std::uint64_t columns_bytes = static_cast<std::uint64_t>(shape.experts) * width * 4;
  if (order.columns) {
    check_buffer(backend, kApi, "order.ids", order.ids, entries(shape) * 4, 4);
    check_buffer(backend, kApi, "order.columns", order.columns, columns_bytes, 4);
    check_no_overlap(kApi, Range{"x_perm", x_perm.address(), perm_bytes},
                     {Range{"order.ids", order.ids.address(), entries(shape) * 4},
                      Range{"order.columns", order.columns.address(), columns_bytes}});
  }
  const ResolvedKernel& k = kernel(backend, kApi, "moe_gather", options);
  MoePermuteParams p = permute_params(x, x_perm, rows, shape, width);
  p.ids = order.ids.address();
  p.columns = order.columns.address();
  p.experts = shape.experts;
  launch(backend, kApi, k, static_cast<std::int64_t>(entries(shape)), stream, p);
}

void moe_glu(Backend& backend, StreamHandle stream, DevicePtr y, const MoeShape& shape,
             std::int64_t inter, const MoeActivation& activation, const MoeRows& rows,
             DevicePtr act, const MoeOptions& options) {
  constexpr std::string_view kApi = "moe_glu";
  const nvtx::Range range("metrale::ops::moe_glu");
  check_shape(kApi, shape);
  if (inter < 8 || inter % 8 != 0 || inter > (std::int64_t{1} << 23)) {
    bad(kApi, fmt::format("inter = {} is not a multiple of 8 in [8, 2^23]", inter));
  }
  const bool clamped = activation.glu == MoeGlu::kClampedSwiglu;
  if (!clamped && activation.glu != MoeGlu::kSilu) {
    bad(kApi, fmt::format("activation.glu = {} is not a MoeGlu", static_cast<int>(activation.glu)));
  }
  if (clamped && !(std::isfinite(activation.alpha) && activation.limit > 0.0f)) {
    bad(kApi, fmt::format("alpha = {} and limit = {}: alpha must be finite and limit positive",
                          activation.alpha, activation.limit));
  }
  const auto n = static_cast<std::uint64_t>(shape.row_capacity());
  const std::uint64_t y_bytes = n * static_cast<std::uint64_t>(inter) * 4;
  const std::uint64_t act_bytes = n * static_cast<std::uint64_t>(inter) * 2;
  const std::uint64_t e_bytes = std::uint64_t{4} * shape.experts;
  check_buffer(backend, kApi, "y", y, y_bytes, kAlign);
  check_buffer(backend, kApi, "counts", rows.counts, e_bytes, 4);
  check_buffer(backend, kApi, "offsets", rows.offsets, e_bytes + 4, 4);
  check_buffer(backend, kApi, "act", act, act_bytes, kAlign);
  check_no_overlap(
      kApi, Range{"act", act.address(), act_bytes},
      {Range{"y", y.address(), y_bytes}, Range{"counts", rows.counts.address(), e_bytes},
       Range{"offsets", rows.offsets.address(), e_bytes + 4}});
  const ResolvedKernel& k = kernel(backend, kApi, "moe_glu", options);
  MoeGluParams p;
  p.y = y.address();
  p.act = act.address();
  p.counts = rows.counts.address();
  p.offsets = rows.offsets.address();
  p.row_capacity = shape.row_capacity();
  p.inter = inter;
  p.capacity = shape.capacity;
  p.experts = shape.experts;
  p.kind = clamped ? kMoeGluClampedSwiglu : kMoeGluSilu;
  p.alpha = activation.alpha;
  p.limit = activation.limit;
  launch(backend, kApi, k, shape.row_capacity(), stream, p);
}

void moe_combine(Backend& backend, StreamHandle stream, DevicePtr y, const MoeShape& shape,
                 std::int64_t width, DevicePtr rows, DevicePtr weights, DevicePtr out,
                 const MoeOptions& options) {
  constexpr std::string_view kApi = "moe_combine";
  const nvtx::Range range("metrale::ops::moe_combine");
  check_shape(kApi, shape);
  check_width(kApi, width);
  const std::uint64_t y_bytes = static_cast<std::uint64_t>(shape.row_capacity()) * width * 2;
  const std::uint64_t out_bytes = static_cast<std::uint64_t>(shape.tokens) * width * 2;
  check_buffer(backend, kApi, "y", y, y_bytes, kAlign);
  check_buffer(backend, kApi, "rows", rows, entries(shape) * 4, 4);
  check_buffer(backend, kApi, "weights", weights, entries(shape) * 4, 4);
  check_buffer(backend, kApi, "out", out, out_bytes, kAlign);
  check_no_overlap(
      kApi, Range{"out", out.address(), out_bytes},
      {Range{"y", y.address(), y_bytes}, Range{"rows", rows.address(), entries(shape) * 4},
       Range{"weights", weights.address(), entries(shape) * 4}});
  const ResolvedKernel& k = kernel(backend, kApi, "moe_combine", options);
  MoePermuteParams p = permute_params(y, out, rows, shape, width);
  p.weights = weights.address();
  launch(backend, kApi, k, shape.tokens, stream, p);
}

}  // namespace metrale::ops
