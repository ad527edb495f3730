// GroupedWeights and their upload (ops/grouped_gemm.h): each expert rearranged as WeightsResource
// would, copied into its place in one buffer per tensor.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "metrale/error.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/weights.h"
#include "ops/buffer_checks.h"
#include "ops/free_quietly.h"
#include "ops/pack_source.h"
#include "ops/weights_pack.h"

namespace metrale::ops {
namespace {

constexpr std::string_view kApi = "GroupedWeightsResource";

// Whether expert x can share expert 0's (first's) kernels and launch: format, layout, shape and
// the INT4 side buffer's contents.
void check_like_first(const HostQuantWeights& first, const HostQuantWeights& x, std::size_t e) {
  const auto differs = [&](const char* what, auto a, auto b) {
    if (a != b) {
      throw Error(ErrorCode::kInvalidArgument, kApi,
                  fmt::format("expert {} has {} {} where expert 0 has {}", e, what, b, a));
    }
  };
  const auto layout = [](WeightLayout l) {
    return l == WeightLayout::kRowMajor ? "row-major" : "transposed";
  };
  differs("format", to_string(first.format), to_string(x.format));
  differs("layout", layout(first.layout), layout(x.layout));
  differs("N", first.n, x.n);
  differs("K", first.k, x.k);
  differs("group", first.group, x.group);
  differs("fp16 scales", first.fp16_scales, x.fp16_scales);
  differs("zero points", !first.zeros.empty(), !x.zeros.empty());
  // Act order: a whole layer's order of K, or none (an expert whose GPTQ order came out as K's
  // own, one no calibration token reached, say: its order is the identity).
  if (!x.k_perm.empty() && x.k_perm.size() != static_cast<std::size_t>(x.k)) {
    throw Error(
        ErrorCode::kInvalidArgument, kApi,
        fmt::format("expert {} has {} act-order entries for K = {}", e, x.k_perm.size(), x.k));
  }
  if (std::find(x.k_perm.begin(), x.k_perm.end(), -1) != x.k_perm.end()) {
    throw Error(
        ErrorCode::kInvalidArgument, kApi,
        fmt::format("expert {} is a K slice (padded act order); experts are whole layers", e));
  }
}

}  // namespace

QuantWeights GroupedWeights::view(std::int32_t e) const {
  if (e < 0 || e >= experts || tensor_scales.size() != static_cast<std::size_t>(experts) ||
      folds.size() != static_cast<std::size_t>(experts)) {
    throw Error(ErrorCode::kInvalidArgument, "GroupedWeights::view",
                fmt::format("expert {} is outside [0, {}) or the table holds {} scales and {} "
                            "folds",
                            e, experts, tensor_scales.size(), folds.size()));
  }
  QuantWeights v = expert;
  v.codes = expert.codes.offset(static_cast<std::uint64_t>(e) * codes_stride);
  v.scales = expert.scales.offset(static_cast<std::uint64_t>(e) * scales_stride);
  v.tensor_scale = tensor_scales[static_cast<std::size_t>(e)];
  v.fold = folds[static_cast<std::size_t>(e)];
  return v;
}

GroupedWeightsResource::GroupedWeightsResource(Backend& backend,
                                               std::span<const HostQuantWeights> experts,
                                               std::string label, UploadLayout upload,
                                               std::source_location loc)
    : label_(std::move(label)) {
  if (experts.empty() || experts.size() > 1024) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("{} experts is outside [1, 1024]", experts.size()));
  }
  for (std::size_t e = 0; e < experts.size(); ++e) check_like_first(experts[0], experts[e], e);
  // FP4 experts uploaded as they are have no packing to check their sizes before the buffers
  // are allocated (expert 0's packing runs first; the others' only in the copy loop), so every
  // expert's are checked here.
  if (experts[0].format != WeightFormat::kInt4 &&
      upload_packing(backend, upload) == WeightPacking::kSource) {
    for (std::size_t e = 0; e < experts.size(); ++e) {
      try {
        pack::check_source(kApi, experts[e], 0, 0);
      } catch (const Error& x) {
        throw Error(x.code(), kApi, fmt::format("expert {}: {}", e, x.message()));
      }
    }
  }
  // Act order (any expert's): each expert's codes in its stored K order, the order itself in
  // k_order, where the gather of A reads it; an expert without one reads K in its own order
  // (Note [Experts' act order]). A packed expert's spans point into the weights it was packed
  // from, so expert 0's stored copy lives as long as `first`, the others' one loop turn each.
  const bool act_order = std::any_of(experts.begin(), experts.end(),
                                     [](const HostQuantWeights& x) { return !x.k_perm.empty(); });
  const auto as_stored = [&](std::size_t e,
                             std::optional<HostQuantWeights>& hold) -> const HostQuantWeights& {
    if (experts[e].k_perm.empty()) return experts[e];
    return hold.emplace(in_stored_order(experts[e]));
  };
  std::optional<HostQuantWeights> hold0;
  const HostQuantWeights& host0 = as_stored(0, hold0);
  // Expert 0 packed first: its sizes give the strides (every expert of one shape packs to the
  // same sizes; checked as each is packed). Its description is of the weights as stored.
  const QuantWeights described = describe_weights(host0);
  HostPacked first = pack_host_weights(backend, host0, upload);
  const std::size_t codes0 = first.codes.size(), scales0 = first.scales.size();
  const WeightPacking packing0 = first.packing;
  const std::uint64_t codes_stride = align_up(first.codes.size());
  const std::uint64_t scales_stride = align_up(first.scales.size());
  const auto count = static_cast<std::uint64_t>(experts.size());
  DevicePtr codes, scales, table, k_order;
  GroupedWeights w;
  try {
    codes = alloc_weights(backend, codes_stride * count, loc);
    scales = alloc_weights(backend, scales_stride * count, loc);
    table = alloc_weights(backend, 8 * count, loc);
    if (act_order) {
      const auto k = static_cast<std::uint64_t>(experts[0].k);
      k_order = alloc_weights(backend, 4 * k * count, loc);
      std::vector<std::int32_t> identity(k);
      std::iota(identity.begin(), identity.end(), 0);
      for (std::size_t e = 0; e < experts.size(); ++e) {
        const auto& order = experts[e].k_perm.empty() ? identity : experts[e].k_perm;
        backend.copy_h2d(k_order.offset(4 * k * e), order.data(), 4 * k);
      }
    }
    for (std::size_t e = 0; e < experts.size(); ++e) {
      std::optional<HostQuantWeights> hold;
      HostPacked p =
          e == 0 ? std::move(first) : pack_host_weights(backend, as_stored(e, hold), upload);
      if (p.codes.size() != codes0 || p.scales.size() != scales0 || p.packing != packing0) {
        throw Error(ErrorCode::kInvalidArgument, kApi,
                    fmt::format("expert {} packs to {} code and {} scale bytes in packing {}, "
                                "expert 0 to {} and {} in packing {}",
                                e, p.codes.size(), p.scales.size(), static_cast<int>(p.packing),
                                codes0, scales0, static_cast<int>(packing0)));
      }
      backend.copy_h2d(codes.offset(e * codes_stride), p.codes.data(), p.codes.size());
      backend.copy_h2d(scales.offset(e * scales_stride), p.scales.data(), p.scales.size());
      // Each stride's padding zeroed too: the buffers then hold the same bytes on every upload,
      // on device or managed memory (the padding held whatever the allocation held).
      static constexpr std::array<std::uint8_t, kWorkspaceAlign> kZeros{};
      if (codes_stride > codes0) {
        backend.copy_h2d(codes.offset(e * codes_stride + codes0), kZeros.data(),
                         codes_stride - codes0);
      }
      if (scales_stride > scales0) {
        backend.copy_h2d(scales.offset(e * scales_stride + scales0), kZeros.data(),
                         scales_stride - scales0);
      }
      if (e == 0) {
        w.expert = described;
        w.expert.packing = p.packing;
        w.expert.codes_bytes = p.codes.size();
        w.expert.scales_bytes = p.scales.size();
        w.expert.fold = p.fold;
      }
      w.tensor_scales.push_back(experts[e].tensor_scale);
      w.folds.push_back(p.fold);
    }
    std::vector<std::uint8_t> bytes(8 * count);
    std::memcpy(bytes.data(), w.tensor_scales.data(), 4 * count);
    std::memcpy(bytes.data() + 4 * count, w.folds.data(), 4 * count);
    backend.copy_h2d(table, bytes.data(), bytes.size());
  } catch (...) {
    free_quietly(backend, codes);
    free_quietly(backend, scales);
    free_quietly(backend, table);
    free_quietly(backend, k_order);
    throw;
  }
  w.expert.codes = codes;
  w.expert.scales = scales;
  w.expert.tensor_scale = w.tensor_scales[0];
  w.experts = static_cast<std::int32_t>(experts.size());
  w.codes_stride = codes_stride;
  w.scales_stride = scales_stride;
  w.table = table;
  w.k_order = k_order;
  w_ = std::move(w);
}

void GroupedWeightsResource::release(Backend& backend) {
  const DevicePtr ptrs[] = {w_.expert.codes, w_.expert.scales, w_.table, w_.k_order};
  w_.expert.codes = w_.expert.scales = w_.table = w_.k_order = DevicePtr{};
  std::exception_ptr first;
  for (const DevicePtr p : ptrs) {
    if (!p) continue;
    try {
      backend.free(p);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace metrale::ops
