// The grouped W8A8 GEMM (ops/grouped_fp8.h): module "fp8"'s activation cast over every row, then
// its grouped kernel of the route, grid (N tiles, experts) for decode or one wave for the tiled
// kernel; and the upload of E experts' E4M3 weights.
#include "metrale/ops/grouped_fp8.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <utility>
#include <vector>

#include "core/nvtx.h"
#include "core/published.h"
#include "kernels/fp8_cast.h"
#include "kernels/fp8_panel_layout.h"
#include "kernels/fused_tile.h"
#include "kernels/grouped_fp8_params.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"
#include "metrale/weights.h"
#include "ops/buffer_checks.h"
#include "ops/free_quietly.h"
#include "ops/published_block.h"

namespace metrale::ops {
namespace {

constexpr std::string_view kPlanApi = "plan_grouped (w8a8)";
constexpr std::string_view kRunApi = "run_grouped (w8a8)";
constexpr std::string_view kUploadApi = "GroupedFp8WeightsResource";
constexpr std::string_view kModule = "fp8";
constexpr std::int32_t kMaxExperts = 1024;
constexpr std::int64_t kKMultiple = 16;  // the GPU kernel's 16-byte loads of a row

[[noreturn]] void bad(std::string_view api, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, api, what);
}

// a × b, refused past 64 bits (no buffer holds that much; a wrapped size would pass the checks).
std::uint64_t product(std::string_view api, std::string_view what, std::uint64_t a,
                      std::uint64_t b) {
  if (b != 0 && a > std::numeric_limits<std::uint64_t>::max() / b) {
    bad(api, fmt::format("{} ({} x {}) does not fit 64 bits", what, a, b));
  }
  return a * b;
}

// An expert's code bytes in `packing` (N x K weights, K a multiple of 16 for kPanels).
std::uint64_t codes_bytes(std::string_view api, WeightPacking packing, std::int64_t n,
                          std::int64_t k) {
  const Fp8Weights need = describe_fp8_weights(api, n, k);
  if (packing != WeightPacking::kPanels) return need.codes_bytes;
  // Whole panels, counted unsigned: fp8_panels::panels' n + 31 overflows for n near 2^63.
  constexpr auto kCols = static_cast<std::uint64_t>(fp8_panels::kCols);
  return product(api, "the panels' codes",
                 (static_cast<std::uint64_t>(n) + kCols - 1) / kCols * kCols,
                 static_cast<std::uint64_t>(k));
}

void check_weights(std::string_view api, const GroupedFp8Weights& w) {
  if (w.experts < 1 || w.experts > kMaxExperts) {
    bad(api, fmt::format("experts = {} is outside [1, {}]", w.experts, kMaxExperts));
  }
  if (w.packing != WeightPacking::kSource && w.packing != WeightPacking::kPanels) {
    bad(api, "the weights' packing is the decode layout, which FP8 experts do not have");
  }
  Fp8Weights need = describe_fp8_weights(api, w.expert.n, w.expert.k);
  need.codes_bytes = codes_bytes(api, w.packing, w.expert.n, w.expert.k);
  if (w.expert.codes_bytes != need.codes_bytes || w.expert.scales_bytes != need.scales_bytes) {
    bad(api, fmt::format("an expert's codes and scales are {} and {} bytes; E4M3 {}x{}{} needs "
                         "{} and {}",
                         w.expert.codes_bytes, w.expert.scales_bytes, w.expert.n, w.expert.k,
                         w.packing == WeightPacking::kPanels ? " in panels" : "", need.codes_bytes,
                         need.scales_bytes));
  }
  if (w.expert.k % kKMultiple != 0) {
    bad(api, fmt::format("K = {} is not a multiple of {} (the grouped kernels read a row {} "
                         "codes at a time)",
                         w.expert.k, kKMultiple, kKMultiple));
  }
  if (w.codes_stride < w.expert.codes_bytes || w.scales_stride < w.expert.scales_bytes ||
      w.codes_stride % kWorkspaceAlign != 0 || w.scales_stride % kWorkspaceAlign != 0) {
    bad(api, fmt::format("strides {} and {} do not hold an expert's {} code and {} scale bytes "
                         "on {}-byte boundaries",
                         w.codes_stride, w.scales_stride, w.expert.codes_bytes,
                         w.expert.scales_bytes, kWorkspaceAlign));
  }
  // Null or misaligned (the kernels read 16 bytes at a time): check_range passes a null pointer.
  check_pointer(api, "weight codes", w.expert.codes);
  check_pointer(api, "weight scales", w.expert.scales);
}

const ResolvedKernel& kernel(std::string_view api, Backend& backend, const char* entry) {
  if (!backend.has_kernel(kModule, entry)) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} has no kernel {}::{}", backend.name(), kModule, entry));
  }
  return backend.op_cache().kernel(backend, kModule, entry);
}

std::uint32_t grid_of(std::string_view api, std::uint64_t count, std::uint64_t tile) {
  const std::uint64_t blocks = (count + tile - 1) / tile;
  if (blocks > 0x7FFFFFFFu) {
    bad(api, fmt::format("{} items in tiles of {} need {} blocks; a launch holds at most "
                         "2^31 - 1",
                         count, tile, blocks));
  }
  return static_cast<std::uint32_t>(blocks);
}

// The layout an upload with `upload` stores on backend (weights N x K), or why not.
WeightPacking upload_packing(Backend& backend, UploadLayout upload, std::int64_t k) {
  switch (upload) {
    case UploadLayout::kSource:
      return WeightPacking::kSource;
    case UploadLayout::kDecode:
      bad(kUploadApi,
          "UploadLayout::kDecode: FP8 experts have no decode layout (kSource, "
          "kPanels or kBackendPreferred)");
    case UploadLayout::kPanels:
      if (k % kKMultiple != 0) {
        bad(kUploadApi,
            fmt::format("the panel layout takes K a multiple of {}; K = {}", kKMultiple, k));
      }
      if (!reads_fp8_panel_layout(backend)) {
        throw Error(ErrorCode::kUnavailable, kUploadApi,
                    fmt::format("{}'s grouped W8A8 kernel does not read the panel layout (it "
                                "publishes no _panels)",
                                backend.name()));
      }
      return WeightPacking::kPanels;
    case UploadLayout::kBackendPreferred:
      break;
  }
  return k % kKMultiple == 0 && reads_fp8_panel_layout(backend) ? WeightPacking::kPanels
                                                                : WeightPacking::kSource;
}

// One expert's row-major codes [N, K] rearranged into the panel layout (out: its bytes, the
// columns past N zero): each panel's pairs in order, its 32 rows read side by side.
void pack_panels(std::span<const std::uint8_t> codes, std::int64_t n, std::int64_t k,
                 std::vector<std::uint8_t>& out) {
  out.assign(static_cast<std::size_t>(fp8_panels::bytes(n, k)), 0);
  std::array<std::int64_t, fp8_panels::kCols> at{};  // column c's even code in a pair
  for (std::int64_t c = 0; c < fp8_panels::kCols; ++c) {
    at[static_cast<std::size_t>(c)] = fp8_panels::pair_byte(c, 0);
  }
  std::uint8_t* dst = out.data();
  for (std::int64_t p = 0; p < fp8_panels::panels(n); ++p) {
    const std::int64_t live = std::min(fp8_panels::kCols, n - p * fp8_panels::kCols);
    const std::uint8_t* rows = codes.data() + p * fp8_panels::kCols * k;
    for (std::int64_t q = 0; q < k; q += 2, dst += fp8_panels::kPairBytes) {
      for (std::int64_t c = 0; c < live; ++c) {
        const std::uint8_t* two = rows + c * k + q;
        dst[at[static_cast<std::size_t>(c)]] = two[0];
        dst[at[static_cast<std::size_t>(c)] + 1] = two[1];
      }
    }
  }
}

constexpr const char* kDecodeEntry = "gemm_grouped_e4m3_block128";
constexpr const char* kTiledEntry = "gemm_grouped_e4m3_block128_tiled";
static_assert(kMaxExperts <= fused::kGroupedMaxExperts,
              "the tiled kernel's scan holds every expert");

// The route options ask for, or kAuto's choice: the tiled kernel for row-major experts whose rows
// per expert on average reach its published _min_m, where the backend has it and a device run
// verified it; the decode kernel otherwise. A route the grouped W8A8 op does not have is refused
// by name.
GemmRoute route_of(Backend& backend, std::int64_t rows, const GroupedFp8Weights& w,
                   const GroupedFp8Options& options) {
  switch (options.route) {
    case GemmRoute::kDecode:
    case GemmRoute::kTiled:
      return options.route;
    case GemmRoute::kAuto:
      break;
    default:
      bad(kPlanApi, fmt::format("route {} is not a grouped W8A8 route (kAuto, kDecode or kTiled)",
                                to_string(options.route)));
  }
  if (w.packing != WeightPacking::kSource || !backend.has_kernel(kModule, kTiledEntry)) {
    return GemmRoute::kDecode;
  }
  const KernelMeta& tiled = backend.op_cache().kernel(backend, kModule, kTiledEntry).meta;
  const bool large = tiled.min_m != 0 && rows >= std::int64_t{tiled.min_m} * w.experts;
  return large && !tiled.absent && automatic_choice_allowed(tiled) ? GemmRoute::kTiled
                                                                   : GemmRoute::kDecode;
}

// The tiled kernel's grid: it walks the layer's tiles itself, expert e's rows taking
// ceil(rows_e / 128) slots, at most grouped_max_slots(rows, experts) of them whatever the
// routing (its scan counts no more), times the N tiles; one wave, or a block per tile where the
// capacity makes fewer.
std::uint32_t tiled_blocks(std::string_view api, Backend& backend, const ResolvedKernel& k,
                           std::int64_t rows, std::int32_t experts, std::int64_t n) {
  if (k.meta.m_tile != fused::kTokens || !k.meta.persistent) {
    throw Error(ErrorCode::kNotFound, api,
                fmt::format("{} publishes M tile {}{}; the grouped tiled kernel walks slots of {} "
                            "rows as one persistent wave",
                            backend.kernel_name(k), k.meta.m_tile,
                            k.meta.persistent ? "" : " and no _persistent", fused::kTokens));
  }
  const auto tiles =
      static_cast<std::uint64_t>(fused::grouped_max_slots(rows, experts)) *
      static_cast<std::uint64_t>((n + backend.kernel_n_tile(k) - 1) / backend.kernel_n_tile(k));
  if (tiles > 0x7FFFFFFFu) {
    bad(api, fmt::format("rows = {} and N = {} may make {} tiles for {}, which counts at most "
                         "2^31 - 1",
                         rows, n, tiles, backend.kernel_name(k)));
  }
  return static_cast<std::uint32_t>(
      std::min<std::uint64_t>(tiles, static_cast<std::uint64_t>(wave_blocks(api, backend, k))));
}

// What a plan launches and the workspace it needs, for its rows, N, K, experts and route: the
// cast over all rows, the GEMM's grid, the cast A and its scales. plan_grouped sets them;
// run_grouped refuses a plan whose own are not these (edited rows or K would cast past the
// workspace it checks).
struct Launches {
  PlannedLaunch cast, gemm;
  Fp8WorkspaceBytes workspace;
};
Launches launches_of(std::string_view api, Backend& backend, std::int64_t rows, std::int64_t n,
                     std::int64_t k, std::int32_t experts, GemmRoute route) {
  const ResolvedKernel& cast = kernel(api, backend, "cast_e4m3_block128");
  const ResolvedKernel& gemm =
      kernel(api, backend, route == GemmRoute::kTiled ? kTiledEntry : kDecodeEntry);
  const auto urows = static_cast<std::uint64_t>(rows);
  const auto kblocks = static_cast<std::uint64_t>(dense_scale_blocks(k));
  Launches l;
  l.cast = PlannedLaunch{cast,
                         Dim3{grid_of(api, product(api, "the cast's blocks", urows, kblocks),
                                      backend.kernel_n_tile(cast))},
                         published_block(api, backend, cast), 0};
  const Dim3 grid =
      route == GemmRoute::kTiled
          ? Dim3{tiled_blocks(api, backend, gemm, rows, experts, n)}
          : Dim3{grid_of(api, static_cast<std::uint64_t>(n), backend.kernel_n_tile(gemm)),
                 static_cast<std::uint32_t>(experts), 1};
  l.gemm = PlannedLaunch{gemm, grid, published_block(api, backend, gemm), gemm.meta.smem_bytes};
  l.workspace.a_codes = product(api, "the cast A", urows, static_cast<std::uint64_t>(k));
  l.workspace.a_scales =
      product(api, "A's scales", kblocks, 4 * static_cast<std::uint64_t>(fp8::scales_ld(rows)));
  return l;
}

bool same_launch(const PlannedLaunch& a, const PlannedLaunch& b) {
  return a.kernel == b.kernel && a.grid == b.grid && a.block == b.block &&
         a.smem_bytes == b.smem_bytes;
}

}  // namespace

bool reads_fp8_panel_layout(Backend& backend) {
  constexpr const char* kEntry = "gemm_grouped_e4m3_block128";
  return backend.has_kernel(kModule, kEntry) &&
         backend.op_cache().kernel(backend, kModule, kEntry).meta.panels;
}

Fp8Weights GroupedFp8Weights::view(std::int32_t e) const {
  if (e < 0 || e >= experts) {
    bad("GroupedFp8Weights::view", fmt::format("expert {} is outside [0, {})", e, experts));
  }
  if (packing != WeightPacking::kSource) {
    bad("GroupedFp8Weights::view",
        fmt::format("the experts are in the {} layout, which the dense W8A8 op does not read "
                    "(upload them with UploadLayout::kSource for views)",
                    packing == WeightPacking::kPanels ? "panel" : "decode"));
  }
  Fp8Weights v = expert;
  v.codes = expert.codes.offset(static_cast<std::uint64_t>(e) * codes_stride);
  v.scales = expert.scales.offset(static_cast<std::uint64_t>(e) * scales_stride);
  return v;
}

GroupedFp8WeightsResource::GroupedFp8WeightsResource(Backend& backend,
                                                     std::span<const E4m3BlockWeightsView> experts,
                                                     std::string label, UploadLayout upload,
                                                     std::source_location loc)
    : label_(std::move(label)) {
  if (experts.empty() || experts.size() > static_cast<std::size_t>(kMaxExperts)) {
    bad(kUploadApi, fmt::format("{} experts is outside [1, {}]", experts.size(), kMaxExperts));
  }
  const std::int64_t n = experts[0].n, k = experts[0].k;
  GroupedFp8Weights w;
  w.expert = describe_fp8_weights(kUploadApi, n, k);
  w.experts = static_cast<std::int32_t>(experts.size());
  const std::size_t source_bytes = w.expert.codes_bytes;
  const auto rows = static_cast<std::size_t>(dense_scale_blocks(n)),
             cols = static_cast<std::size_t>(dense_scale_blocks(k)),
             ld = static_cast<std::size_t>(dense_b_scales_ld(k));
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const E4m3BlockWeightsView& x = experts[e];
    if (x.n != n || x.k != k || x.codes.size() != source_bytes || x.scales.size() != rows * cols) {
      bad(kUploadApi, fmt::format("expert {} is {}x{} with {} codes and {} scales; expert 0 is "
                                  "{}x{}, which needs {} codes and {} scales ([ceil(N/128), "
                                  "ceil(K/128)])",
                                  e, x.n, x.k, x.codes.size(), x.scales.size(), n, k, source_bytes,
                                  rows * cols));
    }
    // NaN codes (0x7F, 0xFF) are refused as the checkpoint loader refuses them: the CUDA kernel
    // widens codes through FP16, where they would read as ±480 instead of NaN.
    const auto nan = std::find_if(x.codes.begin(), x.codes.end(),
                                  [](std::uint8_t c) { return (c & 0x7Fu) == 0x7Fu; });
    if (nan != x.codes.end()) {
      const auto i = static_cast<std::int64_t>(nan - x.codes.begin());
      bad(kUploadApi,
          fmt::format("expert {}'s weight [{}, {}] is NaN (0x{:02X})", e, i / k, i % k, *nan));
    }
  }
  w.packing = upload_packing(backend, upload, k);
  w.expert.codes_bytes = codes_bytes(kUploadApi, w.packing, n, k);
  const auto e_count = static_cast<std::uint64_t>(experts.size());
  w.codes_stride = align_up(w.expert.codes_bytes);
  w.scales_stride = align_up(w.expert.scales_bytes);
  DevicePtr dc, ds;
  try {
    dc = alloc_weights(backend, product(kUploadApi, "the codes", e_count, w.codes_stride), loc);
    ds = alloc_weights(backend, product(kUploadApi, "the scales", e_count, w.scales_stride), loc);
    // Each expert's scale rows ld = round_up(ceil(K/128), 4) apart (fp8_gemm.h's device layout);
    // the pad entries are never read and are written 0 so the buffer's bytes are defined.
    std::vector<float> padded(w.scales_stride / 4, 0.0f);
    std::vector<std::uint8_t> panels;
    for (std::uint64_t e = 0; e < e_count; ++e) {
      const std::uint8_t* codes = experts[e].codes.data();
      if (w.packing == WeightPacking::kPanels) {
        const auto t0 = std::chrono::steady_clock::now();
        pack_panels(experts[e].codes, n, k, panels);
        pack_seconds_ +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        codes = panels.data();
      }
      backend.copy_h2d(dc.offset(e * w.codes_stride), codes, w.expert.codes_bytes);
      for (std::size_t r = 0; r < rows; ++r) {
        std::memcpy(padded.data() + r * ld, experts[e].scales.data() + r * cols, cols * 4);
      }
      backend.copy_h2d(ds.offset(e * w.scales_stride), padded.data(), w.scales_stride);
    }
  } catch (...) {
    free_quietly(backend, dc);
    free_quietly(backend, ds);
    throw;
  }
  w.expert.codes = dc;
  w.expert.scales = ds;
  w_ = w;
}

void GroupedFp8WeightsResource::release(Backend& backend) {
  free_fp8_weights(backend, w_.expert);
}

std::string GroupedFp8Plan::describe() const {
  return fmt::format(
      "grouped w8a8 rows={} N={} K={} x {} experts: {} {}x{}x{} x {} threads, {} "
      "{}x{}x{} x {} threads; workspace {} B{}{}",
      rows, n, k, experts, backend->kernel_name(cast.kernel), cast.grid.x, cast.grid.y, cast.grid.z,
      cast.block.x, backend->kernel_name(gemm.kernel), gemm.grid.x, gemm.grid.y, gemm.grid.z,
      gemm.block.x, workspace.total(), out_f32 ? "; FP32 C" : "",
      packing == WeightPacking::kPanels ? "; experts in panels" : "");
}

GroupedFp8Plan plan_grouped(Backend& backend, std::int64_t rows, const GroupedFp8Weights& w,
                            const GroupedFp8Options& options) {
  const nvtx::Range range("metrale::ops::plan_grouped (w8a8)");
  if (rows < 1 || rows > std::numeric_limits<std::int32_t>::max()) {
    bad(kPlanApi, fmt::format("rows = {} is outside [1, 2^31 - 1]", rows));
  }
  check_weights(kPlanApi, w);
  const ResolvedKernel& cast = kernel(kPlanApi, backend, "cast_e4m3_block128");
  const GemmRoute route = route_of(backend, rows, w, options);
  if (route == GemmRoute::kTiled && !backend.has_kernel(kModule, kTiledEntry)) {
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} has no kernel {}::{} (the tiled route is CUDA's, sm_90a); take "
                            "GemmRoute::kDecode or kAuto",
                            backend.name(), kModule, kTiledEntry));
  }
  const ResolvedKernel& gemm =
      kernel(kPlanApi, backend, route == GemmRoute::kTiled ? kTiledEntry : kDecodeEntry);
  if (gemm.meta.absent) {
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} is a placeholder on this target (it publishes _absent): the tiled "
                            "route needs wgmma (sm_90a)",
                            backend.kernel_name(gemm)));
  }
  if (options.out_f32 && !gemm.meta.out_f32) {
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} does not write FP32 C (it publishes no _out_f32)",
                            backend.kernel_name(gemm)));
  }
  if (w.packing == WeightPacking::kPanels && !gemm.meta.panels) {
    throw Error(ErrorCode::kUnavailable, kPlanApi,
                fmt::format("{} does not read experts in the panel layout (it publishes no "
                            "_panels); upload them with UploadLayout::kSource",
                            backend.kernel_name(gemm)));
  }
  for (const ResolvedKernel* k : {&cast, &gemm}) {
    if (!options.allow_unverified && !automatic_choice_allowed(k->meta)) {
      throw Error(ErrorCode::kUnavailable, kPlanApi,
                  fmt::format("{} is {}; set GroupedFp8Options::allow_unverified to run it "
                              "before a device run verifies it",
                              backend.kernel_name(*k), verification_text(k->meta)));
    }
  }
  GroupedFp8Plan p;
  p.backend = &backend;
  p.rows = rows;
  p.n = w.expert.n;
  p.k = w.expert.k;
  p.experts = w.experts;
  p.bias = options.bias;
  p.out_f32 = options.out_f32;
  p.packing = w.packing;
  p.route = route;
  const Launches l = launches_of(kPlanApi, backend, rows, p.n, p.k, p.experts, route);
  p.cast = l.cast;
  p.gemm = l.gemm;
  p.workspace = l.workspace;
  return p;
}

void run_grouped(const GroupedFp8Plan& plan, StreamHandle stream, DevicePtr a,
                 const GroupedFp8Weights& w, DevicePtr counts, DevicePtr offsets, DevicePtr c,
                 const Fp8Workspace& workspace, DevicePtr bias) {
  const nvtx::Range range("metrale::ops::run_grouped (w8a8)");
  if (plan.backend == nullptr || !plan.gemm.kernel.handle) {
    bad(kRunApi, "the plan is empty (made by no call to plan_grouped)");
  }
  Backend& backend = *plan.backend;
  if (backend.op_cache().released()) {
    throw Error(ErrorCode::kState, kRunApi,
                "the plan's backend was torn down (its op cache is released); plan again on a "
                "live backend");
  }
  check_weights(kRunApi, w);
  if (w.experts != plan.experts || w.expert.n != plan.n || w.expert.k != plan.k) {
    bad(kRunApi, fmt::format("the weights are {} experts of {}x{}; the plan is for {} of {}x{}",
                             w.experts, w.expert.n, w.expert.k, plan.experts, plan.n, plan.k));
  }
  if (w.packing != plan.packing) {
    bad(kRunApi, fmt::format("the weights are in the {} layout; the plan is for the {}",
                             w.packing == WeightPacking::kPanels ? "panel" : "row-major",
                             plan.packing == WeightPacking::kPanels ? "panel" : "row-major"));
  }
  if (plan.bias != static_cast<bool>(bias)) {
    bad(kRunApi, plan.bias ? "the plan takes a bias and none was given"
                           : "a bias was given to a plan made without one");
  }
  if (plan.rows < 1 || plan.rows > std::numeric_limits<std::int32_t>::max() ||
      (plan.route != GemmRoute::kDecode && plan.route != GemmRoute::kTiled)) {
    bad(kRunApi, fmt::format("the plan's rows = {} or route {} is not one plan_grouped makes",
                             plan.rows, to_string(plan.route)));
  }
  const Launches want =
      launches_of(kRunApi, backend, plan.rows, plan.n, plan.k, plan.experts, plan.route);
  if (!same_launch(plan.cast, want.cast) || !same_launch(plan.gemm, want.gemm) ||
      plan.workspace.a_codes != want.workspace.a_codes ||
      plan.workspace.a_scales != want.workspace.a_scales || plan.workspace.dense != 0) {
    bad(kRunApi, fmt::format("the plan's launches or workspace are not those plan_grouped makes "
                             "for its own rows = {}, N = {}, K = {}, {} experts: make it with "
                             "plan_grouped",
                             plan.rows, plan.n, plan.k, plan.experts));
  }
  const auto experts = static_cast<std::uint64_t>(plan.experts);
  const auto rows = static_cast<std::uint64_t>(plan.rows);
  const auto n = static_cast<std::uint64_t>(plan.n), k = static_cast<std::uint64_t>(plan.k);
  const std::uint64_t a_bytes =
      product(kRunApi, "A's bytes", rows, product(kRunApi, "a row", k, 2));
  const std::uint64_t c_bytes =
      product(kRunApi, "C's bytes", rows, product(kRunApi, "a row", n, plan.out_f32 ? 4 : 2));
  const CallRanges r =
      check_call_buffers(kRunApi, backend, a, a_bytes, c, c_bytes, w.expert.codes,
                         product(kRunApi, "the codes", experts, w.codes_stride), w.expert.scales,
                         product(kRunApi, "the scales", experts, w.scales_stride), bias,
                         product(kRunApi, "the bias", experts, product(kRunApi, "a row", n, 2)));
  const Range rc{"counts", counts.address(), 4 * experts},
      ro{"offsets", offsets.address(), 4 * experts + 4};
  for (const auto& [range_of, p] : {std::pair{rc, counts}, std::pair{ro, offsets}}) {
    if (!p) bad(kRunApi, fmt::format("{} is null", range_of.name));
    if (p.address() % 4 != 0) {
      bad(kRunApi, fmt::format("{} = 0x{:x} is not 4-byte aligned", range_of.name, p.address()));
    }
    backend.check_range(kRunApi, range_of.name, p, range_of.bytes);
    check_no_overlap(kRunApi, r.c, {range_of});
  }
  const Range wc{"E4M3 A workspace", workspace.a_codes.address(), plan.workspace.a_codes},
      ws{"A scales workspace", workspace.a_scales.address(), plan.workspace.a_scales};
  check_workspace_part(kRunApi, backend, wc, workspace.a_codes,
                       {r.a, r.c, r.codes, r.scales, r.bias, rc, ro, ws});
  check_workspace_part(kRunApi, backend, ws, workspace.a_scales,
                       {r.a, r.c, r.codes, r.scales, r.bias, rc, ro});
  const Fp8CastParams cast{a.address(), workspace.a_codes.address(), workspace.a_scales.address(),
                           plan.rows, plan.k};
  backend.launch_typed(plan.cast.kernel, plan.cast.grid, plan.cast.block, plan.cast.smem_bytes,
                       stream, std::array{KernelArg::value(cast)});
  GroupedFp8Params g;
  g.a = workspace.a_codes.address();
  g.a_scales = workspace.a_scales.address();
  g.b = w.expert.codes.address();
  g.b_scales = w.expert.scales.address();
  g.c = c.address();
  g.bias = bias.address();
  g.counts = counts.address();
  g.offsets = offsets.address();
  g.b_stride = w.codes_stride;
  g.b_scales_stride = w.scales_stride;
  g.rows = plan.rows;
  g.n = plan.n;
  g.k = plan.k;
  g.experts = plan.experts;
  g.out_f32 = plan.out_f32 ? 1 : 0;
  g.b_panels = plan.packing == WeightPacking::kPanels ? 1 : 0;
  backend.launch_typed(plan.gemm.kernel, plan.gemm.grid, plan.gemm.block, plan.gemm.smem_bytes,
                       stream, std::array{KernelArg::value(g)});
}

Fp8Workspace scratch_workspace(const GroupedFp8Plan& plan, StreamHandle stream) {
  if (plan.backend == nullptr) {
    bad("scratch_workspace", "the plan is empty (made by no call to plan_grouped)");
  }
  Backend& backend = *plan.backend;
  OpCache& cache = backend.op_cache();
  Fp8Workspace ws;
  ws.a_codes = cache.scratch(backend, gemm_scratch_tag(backend, stream, "w8a8_activation"),
                             plan.workspace.a_codes, stream);
  ws.a_scales = cache.scratch(backend, gemm_scratch_tag(backend, stream, "w8a8_activation_scales"),
                              plan.workspace.a_scales, stream);
  return ws;
}

}  // namespace metrale::ops
