#include "metrale/ops/gemm.h"

#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/log.h"
#include "kernels/gemm_params.h"
#include "kernels/tile_math.h"
#include "metrale/error.h"
#include "metrale/op_cache.h"

namespace metrale::ops {
namespace {

constexpr std::string_view kModule = "w4a16";
constexpr std::uint32_t kBlockThreads = 256;
constexpr std::uint64_t kAlign = 16;  // vector loads on every backend
// Split-K: enough blocks for two per SM, and at most this many K slices (each slice adds an
// M x N FP32 plane to the workspace and to the reduction's reads).
constexpr std::int64_t kBlocksPerSm = 2;
constexpr std::int64_t kMaxSplits = 16;

// METRALE_GEMM_SHAPE_LOG=1 adds one info line per (route, M, N, K) with its FLOP count.
bool shape_log_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("METRALE_GEMM_SHAPE_LOG");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

const char* entry_of(GemmRoute route) {
  switch (route) {
    case GemmRoute::kDecode:
      return "gemm_decode";
    case GemmRoute::kTiled:
      return "gemm_tiled";
    case GemmRoute::kE4m3:
      return "gemm_e4m3";
    case GemmRoute::kAuto:
      break;
  }
  return "?";
}

struct Range {
  const char* name;
  std::uint64_t begin, bytes;
};

void check_pointer(std::string_view api, const char* name, DevicePtr p) {
  if (!p) throw Error(ErrorCode::kInvalidArgument, api, fmt::format("{} is null", name));
  if (p.address() % kAlign != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} = 0x{:x} is not {}-byte aligned", name, p.address(), kAlign));
  }
}

void check_no_overlap(std::string_view api, const Range& out, std::initializer_list<Range> inputs) {
  for (const Range& in : inputs) {
    if (in.bytes == 0) continue;
    if (out.begin < in.begin + in.bytes && in.begin < out.begin + out.bytes) {
      throw Error(ErrorCode::kInvalidArgument, api,
                  fmt::format("{} [0x{:x}, +{}) overlaps {} [0x{:x}, +{})", out.name, out.begin,
                              out.bytes, in.name, in.begin, in.bytes));
    }
  }
}

// a × b × c bytes; Error(kInvalidArgument) when that does not fit 64 bits. No buffer holds that
// much, and a size that wrapped around would pass the range checks (fuzz_gemm_args found N × K
// overflowing int64 here; M × N × 2 and M × K × 2 wrapped the same way in uint64).
std::uint64_t bytes_of(std::string_view api, std::string_view what, std::uint64_t a,
                       std::uint64_t b, std::uint64_t c) {
  std::uint64_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("{} would be {} x {} x {} bytes, more than 64 bits can count", what, a, b, c));
  }
  return abc;
}

void check_weights(std::string_view api, const QuantWeights& w) {
  const int group = group_size(w.format);
  if (w.n < 1 || w.k < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weights are {}x{}; N and K must be at least 1", w.n, w.k));
  }
  if (w.k % group != 0) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("K = {} is not a multiple of {} ({} block size)", w.k, group,
                            to_string(w.format)));
  }
  check_pointer(api, "weight codes", w.codes);
  check_pointer(api, "weight scales", w.scales);
  const auto un = static_cast<std::uint64_t>(w.n), uk = static_cast<std::uint64_t>(w.k);
  const std::uint64_t codes = bytes_of(api, "the weights", un, uk, 1) / 2;  // [N, K/2]
  const std::uint64_t scales = un * (uk / static_cast<std::uint64_t>(group));
  if (w.codes_bytes != codes) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weight codes are {} bytes; {} {}x{} needs {} ([N, K/2])",
                            w.codes_bytes, to_string(w.format), w.n, w.k, codes));
  }
  if (w.scales_bytes != scales) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("weight scales are {} bytes; {} {}x{} needs {} ([N, K/{}])",
                            w.scales_bytes, to_string(w.format), w.n, w.k, scales, group));
  }
  if (!(w.tensor_scale > 0.0f) || !std::isfinite(w.tensor_scale)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("tensor scale {} is not a positive finite number", w.tensor_scale));
  }
}

// The route, with every kernel it needs resolved (so a missing one fails before any launch).
struct Plan {
  GemmRoute route = GemmRoute::kAuto;
  KernelHandle gemm, cast, dequant;
  KernelHandle reduce;  // gemm_split_reduce, where the GEMM kernel can split K
};

bool module_has(Backend& backend, const char* entry) {
  if (!backend.has_module(kModule)) return false;
  for (const ModuleListing& m : backend.modules()) {
    if (m.name != kModule) continue;
    for (const std::string& k : m.kernels) {
      if (k == entry) return true;
    }
  }
  return false;
}

Plan plan(Backend& backend, std::int64_t m, const GemmOptions& options) {
  constexpr std::string_view api = "w4a16_gemm";
  GemmRoute route = options.route;
  if (route == GemmRoute::kAuto) {
    if (options.activations == Activations::kAllowE4m3 && m >= kE4m3MinM &&
        module_has(backend, "gemm_e4m3")) {
      route = GemmRoute::kE4m3;
    } else {
      route = m <= kDecodeMaxM ? GemmRoute::kDecode : GemmRoute::kTiled;
    }
  }
  if (route == GemmRoute::kE4m3 && options.activations != Activations::kAllowE4m3) {
    throw Error(ErrorCode::kInvalidArgument, api,
                "the e4m3 route casts A to E4M3, but the caller asked for exact BF16 activations");
  }
  OpCache& cache = backend.op_cache();
  Plan p;
  p.route = route;
  p.gemm = cache.kernel(backend, kModule, entry_of(route));
  if (cache.launch_meta(p.gemm).split_k != 0) {
    p.reduce = cache.kernel(backend, kModule, "gemm_split_reduce");
  }
  if (route == GemmRoute::kE4m3) {
    p.cast = cache.kernel(backend, kModule, "bf16_to_fp8");
    p.dequant = cache.kernel(backend, kModule, "dequant_e4m3");
  } else if (options.activations == Activations::kExactBf16 &&
             backend.kernel_casts_a_to_e4m3(p.gemm)) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} casts A to E4M3 (it publishes {}_a_e4m3), but the caller asked "
                            "for exact BF16 activations",
                            backend.kernel_name(p.gemm), entry_of(route)));
  }
  return p;
}

// ceil(count / tile) as a grid dimension; Error(kInvalidArgument) past what a launch can hold.
std::uint32_t blocks_of(std::string_view api, std::string_view what, std::int64_t count,
                        std::uint64_t tile, std::uint64_t limit) {
  const std::uint64_t blocks = (static_cast<std::uint64_t>(count) + tile - 1) / tile;
  if (blocks > limit) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{} = {} needs {} blocks of {}; one launch holds at most {}", what,
                            count, blocks, tile, limit));
  }
  return static_cast<std::uint32_t>(blocks);
}

Dim3 grid_over(Backend& backend, KernelHandle k, std::int64_t columns) {
  return Dim3{blocks_of("launch", "the grid", columns, backend.kernel_n_tile(k), 0x7FFFFFFFu)};
}

// One GEMM launch, sized from what its kernel publishes alone: grid x over N by the N tile,
// grid y over M by the M tile (where published), grid z over K slices (where it can split K and
// N x M alone leaves SMs idle), and its dynamic shared memory.
struct GemmLaunch {
  Dim3 grid;
  std::uint32_t smem = 0;
  tiles::SplitK split;
};

GemmLaunch launch_of(Backend& backend, KernelHandle k, std::int64_t m, std::int64_t n,
                     std::int64_t kk) {
  constexpr std::string_view api = "w4a16_gemm";
  const KernelLaunchMeta meta = backend.op_cache().launch_meta(k);
  GemmLaunch l;
  l.grid.x = blocks_of(api, "N", n, backend.kernel_n_tile(k), 0x7FFFFFFFu);
  l.grid.y = meta.m_tile != 0 ? blocks_of(api, "M", m, meta.m_tile, 0xFFFFu) : 1;
  l.smem = meta.smem_bytes;
  l.split = tiles::SplitK{1, kk};
  if (meta.split_k != 0) {
    const auto blocks = static_cast<std::int64_t>(l.grid.x) * l.grid.y;
    const auto target = kBlocksPerSm * static_cast<std::int64_t>(backend.sm_count());
    l.split = tiles::plan_split_k(kk, meta.split_k, blocks, target, kMaxSplits);
  }
  l.grid.z = static_cast<std::uint32_t>(l.split.splits);
  return l;
}

void log_route(Backend& backend, GemmRoute route, std::int64_t m, std::int64_t n, std::int64_t k) {
  const auto mm = static_cast<std::uint32_t>(m), nn = static_cast<std::uint32_t>(n),
             kk = static_cast<std::uint32_t>(k);
  if (!backend.op_cache().first_shape(to_string(route), mm, nn, kk)) return;
  log::debug("{} w4a16_gemm: route {} for M={} N={} K={}", backend.name(), to_string(route), m, n,
             k);
  if (shape_log_enabled()) {
    log::info("{} w4a16_gemm shape M={} N={} K={}: {:.3g} GFLOP", backend.name(), m, n, k,
              2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / 1e9);
  }
}

}  // namespace

std::string_view to_string(GemmRoute route) noexcept {
  switch (route) {
    case GemmRoute::kAuto:
      return "auto";
    case GemmRoute::kDecode:
      return "decode";
    case GemmRoute::kTiled:
      return "tiled";
    case GemmRoute::kE4m3:
      return "e4m3";
  }
  return "?";
}

GemmRoute choose_route(Backend& backend, std::int64_t m, const QuantWeights&,
                       const GemmOptions& options) {
  return plan(backend, m, options).route;
}

void w4a16_gemm(Backend& backend, StreamHandle stream, DevicePtr a, std::int64_t m,
                const QuantWeights& w, DevicePtr c, const GemmOptions& options) {
  constexpr std::string_view api = "w4a16_gemm";
  if (m < 1)
    throw Error(ErrorCode::kInvalidArgument, api, fmt::format("M = {}; it must be at least 1", m));
  check_weights(api, w);
  check_pointer(api, "A", a);
  check_pointer(api, "C", c);
  if (options.bias) check_pointer(api, "bias", options.bias);
  const auto um = static_cast<std::uint64_t>(m), un = static_cast<std::uint64_t>(w.n),
             uk = static_cast<std::uint64_t>(w.k);
  const std::uint64_t a_bytes = bytes_of(api, "A", um, uk, 2),
                      c_bytes = bytes_of(api, "C", um, un, 2);
  check_no_overlap(
      api, Range{"C", c.address(), c_bytes},
      {Range{"A", a.address(), a_bytes}, Range{"weight codes", w.codes.address(), w.codes_bytes},
       Range{"weight scales", w.scales.address(), w.scales_bytes},
       Range{"bias", options.bias.address(), options.bias ? un * 2 : 0}});
  // The kernels read and write these ranges without bounds; a backend that knows its
  // allocations refuses any that lies outside one.
  backend.check_range(api, "A", a, a_bytes);
  backend.check_range(api, "weight codes", w.codes, w.codes_bytes);
  backend.check_range(api, "weight scales", w.scales, w.scales_bytes);
  if (options.bias) backend.check_range(api, "bias", options.bias, un * 2);
  backend.check_range(api, "C", c, c_bytes);

  const Plan p = plan(backend, m, options);
  GemmParams params;
  params.a = a.address();
  params.codes = w.codes.address();
  params.scales = w.scales.address();
  params.out = c.address();
  params.bias = options.bias.address();
  params.m = m;
  params.n = w.n;
  params.k = w.k;
  params.tensor_scale = w.tensor_scale;
  params.flags = (w.format == WeightFormat::kMxfp4 ? kGemmMxfp4 : 0u) |
                 (w.layout == WeightLayout::kTransposed ? kGemmTransposed : 0u) |
                 (options.bias ? kGemmBias : 0u);

  const GemmLaunch l = launch_of(backend, p.gemm, m, w.n, w.k);
  params.splits = l.split.splits;
  params.k_per_split = l.split.k_per_split;
  if (l.split.splits > 1) {
    // FP32 partials [splits, M, N], summed in slice order by gemm_split_reduce: the result does
    // not depend on which slice finishes first.
    const std::uint64_t bytes =
        bytes_of(api, "the split-K workspace", static_cast<std::uint64_t>(l.split.splits) * um, un,
                 sizeof(float));
    params.workspace =
        backend.op_cache()
            .scratch(backend, gemm_scratch_tag(backend, stream, "gemm_split_k"), bytes)
            .address();
  }

  if (p.route == GemmRoute::kE4m3) {
    // The contract's scratch tag for the cast activations, fp8_activation
    // (docs/CONTRACT.md, GEMM routes), and one for the E4M3 weights.
    OpCache& cache = backend.op_cache();
    const DevicePtr a8 =
        cache.scratch(backend, gemm_scratch_tag(backend, stream, "fp8_activation"), um * uk);
    const DevicePtr w8 =
        cache.scratch(backend, gemm_scratch_tag(backend, stream, "fp8_weights"), un * uk);
    const CastParams cast{a.address(), a8.address(), m * w.k, 0, 0};
    backend.launch_typed(p.cast, grid_over(backend, p.cast, m * w.k), Dim3{kBlockThreads}, 0,
                         stream, std::array{KernelArg::value(cast)});
    const CastParams deq{w.codes.address(), w8.address(), w.n, w.k, params.flags};
    backend.launch_typed(p.dequant, grid_over(backend, p.dequant, w.n), Dim3{kBlockThreads}, 0,
                         stream, std::array{KernelArg::value(deq)});
    params.a = a8.address();
    params.codes = w8.address();
  }
  log_route(backend, p.route, m, w.n, w.k);
  backend.launch_typed(p.gemm, l.grid, Dim3{kBlockThreads}, l.smem, stream,
                       std::array{KernelArg::value(params)});
  if (l.split.splits > 1) {
    backend.launch_typed(p.reduce, grid_over(backend, p.reduce, m * w.n), Dim3{kBlockThreads}, 0,
                         stream, std::array{KernelArg::value(params)});
  }
}

std::string gemm_scratch_tag(Backend& backend, StreamHandle stream, std::string_view base) {
  if (stream == backend.default_stream()) return std::string(base);
  return fmt::format("{}@{:x}", base, stream.value());
}

void cast_bf16_to_e4m3(Backend& backend, StreamHandle stream, DevicePtr in, DevicePtr out,
                       std::int64_t count) {
  constexpr std::string_view api = "cast_bf16_to_e4m3";
  if (count < 1) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("count = {}; it must be at least 1", count));
  }
  check_pointer(api, "in", in);
  check_pointer(api, "out", out);
  const auto n = static_cast<std::uint64_t>(count);
  check_no_overlap(api, Range{"out", out.address(), n}, {Range{"in", in.address(), n * 2}});
  backend.check_range(api, "in", in, n * 2);
  backend.check_range(api, "out", out, n);
  const KernelHandle k = backend.op_cache().kernel(backend, kModule, "bf16_to_fp8");
  const CastParams params{in.address(), out.address(), count, 0, 0};
  backend.launch_typed(k, grid_over(backend, k, count), Dim3{kBlockThreads}, 0, stream,
                       std::array{KernelArg::value(params)});
}

}  // namespace metrale::ops
