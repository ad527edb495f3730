// w4a16_gemm against custom w4a16 modules on the CPU backend:
//  - the real kernels wrapped to count launches and blocks: the grid of every route comes from
//    the kernel's published N tile and covers every column (N no multiple of the tile), and bad
//    arguments launch nothing;
//  - small scalar kernels written here from gemm_params.h (an independent implementation of the
//    contract): a module publishing narrower tiles than the real one still gets every column
//    written; a gemm_decode that publishes gemm_decode_a_e4m3 = 1 is refused to exact-BF16
//    callers ("casts A to E4M3") and accepted with kAllowE4m3; a module without gemm_e4m3 never
//    gets the e4m3 route;
//  - deliberately broken kernels, to show the checks of this suite catch each kind of defect.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "kernels/gemm_params.h"
#include "kernels/manifest.h"
#include "metrale/cpu_backend.h"
#include "metrale/host_module.h"
#include "metrale/kernel_args.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {
namespace {

using ops::Activations;
using ops::GemmRoute;
using ::testing::HasSubstr;

template <class T>
T* at(std::uint64_t address) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(address));
}

// ---- the real kernels, counted ----

// One counter a manifest entry: a new entry is counted without an edit here.
constexpr std::size_t kMaxKernels = manifest::kW4a16Entries.size();
struct Counter {
  std::atomic<std::uint64_t> launches{0}, blocks{0};
};
std::array<HostKernelFn, kMaxKernels> g_real{};
std::array<std::string, kMaxKernels> g_names;
std::array<Counter, kMaxKernels> g_counts;

template <std::size_t I>
void counted(const HostBlock& blk) {
  if (blk.block_idx.x == 0 && blk.block_idx.y == 0 && blk.block_idx.z == 0) {
    ++g_counts[I].launches;
  }
  ++g_counts[I].blocks;
  g_real[I](blk);
}
template <std::size_t... I>
constexpr std::array<HostKernelFn, sizeof...(I)> counted_kernels(std::index_sequence<I...>) {
  return {counted<I>...};
}
constexpr std::array<HostKernelFn, kMaxKernels> kCounted =
    counted_kernels(std::make_index_sequence<kMaxKernels>{});

void reset_counts() {
  for (Counter& c : g_counts) {
    c.launches = 0;
    c.blocks = 0;
  }
}
std::uint64_t launches(std::string_view name) {
  for (std::size_t i = 0; i < kMaxKernels; ++i) {
    if (g_names[i] == name) return g_counts[i].launches;
  }
  ADD_FAILURE() << "no counted kernel " << name;
  return 0;
}
std::uint64_t blocks(std::string_view name) {
  for (std::size_t i = 0; i < kMaxKernels; ++i) {
    if (g_names[i] == name) return g_counts[i].blocks;
  }
  ADD_FAILURE() << "no counted kernel " << name;
  return 0;
}
std::uint64_t all_launches() {
  std::uint64_t n = 0;
  for (const Counter& c : g_counts) n += c.launches;
  return n;
}

// The built-in modules with w4a16's kernels wrapped, publishing the same symbols.
CpuBackendOptions counting_backend() {
  CpuBackendOptions o;
  o.threads = 2;
  for (HostModule& m : o.modules) {
    if (m.name() != "w4a16") continue;
    HostModule wrapped("w4a16");
    std::size_t i = 0;
    for (const HostKernel& k : m.kernels()) {
      if (i == kMaxKernels || k.param_sizes.size() != 1) {
        ADD_FAILURE() << "w4a16 has more kernels, or other parameters, than expected: " << k.name;
        break;
      }
      g_real[i] = k.fn;
      g_names[i] = k.name;
      wrapped.add_kernel(k.name, kCounted[i], {k.param_sizes[0]});
      // Every field a kernel may publish (kernels/published.def), copied as the module has it.
      for (const std::string_view suffix : manifest::kPublishedSuffixes) {
        const std::string symbol = k.name + std::string(suffix);
        if (const auto* bytes = m.find_symbol(symbol)) wrapped.publish(symbol, *bytes);
      }
      ++i;
    }
    m = std::move(wrapped);
  }
  reset_counts();
  return o;
}

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) {
  return (a + b - 1) / b;
}

// A test's data on a CPU backend: weights, A, bias and a poisoned C with a tail.
struct Case {
  HostQuantWeights row;
  ops::QuantWeights w;
  std::vector<std::uint16_t> a, bias;
  DevicePtr da, dbias, dc;
  std::int64_t m = 0;
};

Case make_case(Backend& b, std::mt19937_64& gen, WeightFormat f, WeightLayout layout,
               std::int64_t m, std::int64_t n, std::int64_t k, bool bias) {
  Case c;
  c.m = m;
  c.row = quantize(f, random_weight_values(gen, n, k), n, k);
  c.w = ops::upload_weights(b,
                            layout == WeightLayout::kRowMajor ? c.row : with_layout(c.row, layout));
  c.a = random_activations(gen, static_cast<std::size_t>(m * k));
  c.da = b.alloc(c.a.size() * 2);
  b.copy_h2d(c.da, c.a.data(), c.a.size() * 2);
  if (bias) {
    c.bias = random_bias(gen, n);
    c.dbias = b.alloc(c.bias.size() * 2);
    b.copy_h2d(c.dbias, c.bias.data(), c.bias.size() * 2);
  }
  const auto bytes = (static_cast<std::size_t>(m * n) + kTailElems) * 2;
  c.dc = b.alloc(bytes);
  b.memset(c.dc, kPoisonByte, bytes);
  return c;
}

void free_case(Backend& b, Case& c) {
  ops::free_weights(b, c.w);
  b.free(c.da);
  b.free(c.dbias);
  b.free(c.dc);
}

// C read back; expects the tail past C untouched.
std::vector<std::uint16_t> output(Backend& b, const Case& c) {
  const auto mn = static_cast<std::size_t>(c.m * c.w.n);
  std::vector<std::uint16_t> out(mn + kTailElems);
  b.copy_d2h(out.data(), c.dc, out.size() * 2);
  EXPECT_EQ(std::count(out.begin() + static_cast<std::ptrdiff_t>(mn), out.end(), kPoisonBf16),
            static_cast<std::ptrdiff_t>(kTailElems))
      << "wrote past C";
  out.resize(mn);
  return out;
}

TEST(GemmLaunches, EveryRouteSizesItsGridFromThePublishedTileAndWritesEveryColumn) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  CpuBackend b(counting_backend());
  OpCache& cache = b.op_cache();
  const auto tile_of = [&](const char* entry) {
    return std::uint64_t{b.kernel_n_tile(cache.kernel(b, "w4a16", entry))};
  };
  const std::uint64_t decode_tile = tile_of("gemm_decode"), tiled_tile = tile_of("gemm_tiled"),
                      e4m3_tile = tile_of("gemm_e4m3"), cast_tile = tile_of("bf16_to_fp8"),
                      dequant_tile = tile_of("dequant_e4m3");
  struct RouteCase {
    GemmRoute route;
    const char* entry;
    std::uint64_t tile;
    std::int64_t m;
  };
  bool some_n_not_a_multiple = false;
  int i = 0;
  for (const RouteCase rc : {RouteCase{GemmRoute::kDecode, "gemm_decode", decode_tile, 3},
                             RouteCase{GemmRoute::kTiled, "gemm_tiled", tiled_tile, 33},
                             RouteCase{GemmRoute::kE4m3, "gemm_e4m3", e4m3_tile, 64}}) {
    for (const std::int64_t n : {1, 7, 63, 65, 255, 257, 300, 1000}) {
      SCOPED_TRACE(
          fmt::format("route {} M={} N={} (tile {})", ops::to_string(rc.route), rc.m, n, rc.tile));
      some_n_not_a_multiple |= n % static_cast<std::int64_t>(rc.tile) != 0;
      const WeightFormat f = i % 2 ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
      Case c = make_case(b, gen, f, i % 3 ? WeightLayout::kRowMajor : WeightLayout::kTransposed,
                         rc.m, n, f == WeightFormat::kNvfp4 ? 48 : 32, i % 2 == 0);
      ++i;
      reset_counts();
      const bool e4m3 = rc.route == GemmRoute::kE4m3;
      ops::w4a16_gemm(
          b, b.default_stream(), c.da, c.m, c.w, c.dc,
          {e4m3 ? Activations::kAllowE4m3 : Activations::kExactBf16, rc.route, c.dbias});
      b.synchronize(b.default_stream());
      EXPECT_EQ(launches(rc.entry), 1u);
      EXPECT_EQ(blocks(rc.entry), ceil_div(static_cast<std::uint64_t>(n), rc.tile));
      EXPECT_EQ(launches("bf16_to_fp8"), e4m3 ? 1u : 0u);
      EXPECT_EQ(launches("dequant_e4m3"), e4m3 ? 1u : 0u);
      if (e4m3) {
        EXPECT_EQ(blocks("bf16_to_fp8"),
                  ceil_div(static_cast<std::uint64_t>(c.m * c.w.k), cast_tile));
        EXPECT_EQ(blocks("dequant_e4m3"), ceil_div(static_cast<std::uint64_t>(n), dequant_tile));
      }
      EXPECT_EQ(all_launches(), e4m3 ? 3u : 1u);
      const std::vector<std::uint16_t> out = output(b, c);
      for (std::int64_t col = 0; col < n; ++col) {
        std::int64_t unwritten = 0;
        for (std::int64_t row = 0; row < c.m; ++row) {
          unwritten += out[static_cast<std::size_t>(row * n + col)] == kPoisonBf16;
        }
        EXPECT_EQ(unwritten, 0) << "column " << col;
        if (unwritten != 0) break;
      }
      const Reference ref = reference(c.a, c.m, c.row, c.bias, e4m3 ? AMode::kE4m3 : AMode::kBf16);
      expect_close(compare(out, ref), kNormTol, "numerics");
      free_case(b, c);
    }
  }
  EXPECT_TRUE(some_n_not_a_multiple);
  b.op_cache().release(b);
}

TEST(GemmLaunches, BadArgumentsLaunchNothing) {
  std::mt19937_64 gen(fresh_seed());
  CpuBackend b(counting_backend());
  Case c = make_case(b, gen, WeightFormat::kNvfp4, WeightLayout::kRowMajor, 64, 65, 48, true);
  reset_counts();
  const ops::GemmOptions exact{Activations::kExactBf16, GemmRoute::kAuto, c.dbias};
  ops::QuantWeights bad_k = c.w;
  bad_k.k = 40;
  ops::QuantWeights bad_scales = c.w;
  bad_scales.scales_bytes += 1;
  ops::QuantWeights bad_ts = c.w;
  bad_ts.tensor_scale = -1.0f;
  const auto s = b.default_stream();
  expect_error([&] { ops::w4a16_gemm(b, s, c.da, 0, c.w, c.dc, exact); });
  expect_error([&] { ops::w4a16_gemm(b, s, c.da, c.m, bad_k, c.dc, exact); });
  expect_error([&] { ops::w4a16_gemm(b, s, c.da, c.m, bad_scales, c.dc, exact); });
  expect_error([&] { ops::w4a16_gemm(b, s, c.da, c.m, bad_ts, c.dc, exact); });
  expect_error([&] { ops::w4a16_gemm(b, s, c.da.offset(2), c.m, c.w, c.dc, exact); });
  // A read from inside C (in bounds, should the op wrongly run).
  expect_error([&] { ops::w4a16_gemm(b, s, c.dc, c.m, c.w, c.dc, exact); });
  expect_error([&] {
    ops::w4a16_gemm(b, s, c.da, c.m, c.w, c.dc, {Activations::kExactBf16, GemmRoute::kE4m3, {}});
  });
  expect_error([&] { ops::cast_bf16_to_e4m3(b, s, c.da, c.da.offset(16), 16); });
  b.synchronize(s);
  EXPECT_EQ(all_launches(), 0u);
  const std::vector<std::uint16_t> out = output(b, c);
  EXPECT_EQ(std::count(out.begin(), out.end(), kPoisonBf16),
            static_cast<std::ptrdiff_t>(out.size()));
  free_case(b, c);
}

// ---- small scalar kernels written from the contract ----

// What a broken kernel gets wrong (kNone: nothing).
enum class Defect {
  kNone,
  kSwappedNibbles,     // the high nibble for even k
  kNeighbourScale,     // the next group's scale
  kNoBias,             // bias ignored
  kNoTensorScale,      // tensor scale ignored
  kDropsLastK,         // the last k of each row skipped
  kIgnoresTransposed,  // reads transposed weights as row-major
  kSkipsLastColumn,    // column N - 1 never written
  kOneElementOff,      // C[0, 0] 2% off
  kTruncatesOutput,    // BF16 by truncation instead of round to nearest even
};

std::atomic<std::uint64_t> g_tiny_launches{0};

// One grid block of Tile output columns: C = A·dequant(W)ᵀ (+ bias), FP32 sums per group, the
// group scale, the tensor scale and the bias applied as ops/gemm.h says; with CastA the
// activations are cast to E4M3 first (what a kernel publishing _a_e4m3 does).
template <std::uint32_t Tile, bool CastA, Defect D = Defect::kNone>
void tiny_gemm(const HostBlock& blk) {
  if (blk.block_idx.x == 0) ++g_tiny_launches;
  const auto p = read_param<GemmParams>(blk.params, 0);
  const bool mx = (p.flags & kGemmMxfp4) != 0;
  const bool tr = (p.flags & kGemmTransposed) != 0 && D != Defect::kIgnoresTransposed;
  const std::int64_t group = mx ? 32 : 16, groups = p.k / group;
  const auto* a = at<const std::uint16_t>(p.a);
  const auto* codes = at<const std::uint8_t>(p.codes);
  const auto* scales = at<const std::uint8_t>(p.scales);
  auto* out = at<std::uint16_t>(p.out);
  const std::int64_t n0 = std::int64_t{blk.block_idx.x} * Tile;
  const std::int64_t n1 = std::min<std::int64_t>(p.n, n0 + Tile);
  for (std::int64_t n = n0; n < n1; ++n) {
    if (D == Defect::kSkipsLastColumn && n == p.n - 1) continue;
    for (std::int64_t m = 0; m < p.m; ++m) {
      float sum = 0.0f;
      for (std::int64_t g = 0; g < groups; ++g) {
        float part = 0.0f;
        for (std::int64_t k = g * group; k < (g + 1) * group; ++k) {
          if (D == Defect::kDropsLastK && k == p.k - 1) continue;
          const std::uint8_t byte = tr ? codes[(k / 2) * p.n + n] : codes[n * (p.k / 2) + k / 2];
          const bool high = (k & 1) != (D == Defect::kSwappedNibbles);
          const std::uint8_t code =
              high ? static_cast<std::uint8_t>(byte >> 4) : static_cast<std::uint8_t>(byte & 0xF);
          float av = num::bf16_to_f32(a[m * p.k + k]);
          if (CastA) av = num::e4m3_to_f32(num::bf16_to_e4m3(a[m * p.k + k]));
          part += num::e2m1_to_f32(code) * av;
        }
        const std::int64_t gs = D == Defect::kNeighbourScale ? (g + 1) % groups : g;
        const std::uint8_t s = tr ? scales[gs * p.n + n] : scales[n * groups + gs];
        sum += part * (mx ? num::e8m0_to_f32(s) : num::e4m3_to_f32(s));
      }
      float v = D == Defect::kNoTensorScale ? sum : sum * p.tensor_scale;
      if ((p.flags & kGemmBias) != 0 && D != Defect::kNoBias) {
        v += num::bf16_to_f32(at<const std::uint16_t>(p.bias)[n]);
      }
      if (D == Defect::kOneElementOff && m == 0 && n == 0) v *= 1.02f;
      out[m * p.n + n] = D == Defect::kTruncatesOutput
                             ? static_cast<std::uint16_t>(num::f32_bits(v) >> 16)
                             : num::f32_to_bf16(v);
    }
  }
}

constexpr auto kGemmParamBytes = static_cast<std::uint16_t>(sizeof(GemmParams));

// A backend whose only module is a "w4a16" with gemm_decode and gemm_tiled (no e4m3 route).
std::unique_ptr<CpuBackend> tiny_backend(HostKernelFn decode, std::uint32_t decode_tile,
                                         HostKernelFn tiled, std::uint32_t tiled_tile,
                                         bool decode_a_e4m3 = false) {
  HostModule m("w4a16");
  m.add_kernel("gemm_decode", decode, {kGemmParamBytes})
      .publish_u32("gemm_decode_n_tile", decode_tile)
      .publish_u32("gemm_decode_block_threads", 256)
      .publish_u32("gemm_decode_max_m", 16)
      .add_kernel("gemm_tiled", tiled, {kGemmParamBytes})
      .publish_u32("gemm_tiled_n_tile", tiled_tile)
      .publish_u32("gemm_tiled_block_threads", 256);
  if (decode_a_e4m3) m.publish_u32("gemm_decode_a_e4m3", 1);
  CpuBackendOptions o;
  o.modules.clear();
  o.modules.push_back(std::move(m));
  o.threads = 2;
  g_tiny_launches = 0;
  return std::make_unique<CpuBackend>(std::move(o));
}

TEST(GemmModules, NarrowerPublishedTilesStillGetEveryColumnWritten) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  // 8 and 24 columns per block (the real kernels cover 256 and 64).
  auto b = tiny_backend(tiny_gemm<8, false>, 8, tiny_gemm<24, false>, 24);
  int i = 0;
  for (const std::int64_t m : {1, 5, 17, 40}) {
    for (const std::int64_t n : {1, 7, 63, 65, 257, 300}) {
      SCOPED_TRACE(fmt::format("M={} N={}", m, n));
      const WeightFormat f = i % 2 ? WeightFormat::kMxfp4 : WeightFormat::kNvfp4;
      Case c = make_case(*b, gen, f, i % 3 ? WeightLayout::kRowMajor : WeightLayout::kTransposed, m,
                         n, f == WeightFormat::kNvfp4 ? 80 : 96, i % 2 == 1);
      ++i;
      ops::w4a16_gemm(*b, b->default_stream(), c.da, m, c.w, c.dc,
                      {Activations::kExactBf16, GemmRoute::kAuto, c.dbias});
      expect_close(compare(output(*b, c), reference(c.a, m, c.row, c.bias, AMode::kBf16)), kNormTol,
                   "narrow tiles");
      free_case(*b, c);
    }
  }
  b->op_cache().release(*b);
}

TEST(GemmModules, AKernelThatCastsAToE4m3IsRefusedToExactBf16Callers) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  auto b = tiny_backend(tiny_gemm<16, true>, 16, tiny_gemm<32, false>, 32, /*decode_a_e4m3=*/true);
  const StreamHandle s = b->default_stream();
  Case c = make_case(*b, gen, WeightFormat::kNvfp4, WeightLayout::kRowMajor, 1, 65, 48, true);
  const ops::GemmOptions exact{Activations::kExactBf16, GemmRoute::kAuto, c.dbias};
  const ops::GemmOptions allow{Activations::kAllowE4m3, GemmRoute::kAuto, c.dbias};

  // Exact BF16 on the decode route (M = 1): refused before anything runs, by choose_route too.
  for (const Error& e :
       {expect_error([&] { ops::w4a16_gemm(*b, s, c.da, 1, c.w, c.dc, exact); }),
        expect_error([&] { ops::choose_route(*b, 1, c.w, exact); }), expect_error([&] {
          ops::w4a16_gemm(*b, s, c.da, 1, c.w, c.dc,
                          {Activations::kExactBf16, GemmRoute::kDecode, c.dbias});
        })}) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_THAT(e.what(), ::testing::StartsWith("[w4a16_gemm] "));
    EXPECT_THAT(e.what(), HasSubstr("w4a16::gemm_decode casts A to E4M3"));
    EXPECT_THAT(e.what(), HasSubstr("gemm_decode_a_e4m3"));
  }
  b->synchronize(s);
  EXPECT_EQ(g_tiny_launches, 0u);
  {
    const std::vector<std::uint16_t> out = output(*b, c);
    EXPECT_EQ(std::count(out.begin(), out.end(), kPoisonBf16),
              static_cast<std::ptrdiff_t>(out.size()))
        << "C was written";
  }

  // Allowed: it runs, and matches the e4m3-aware reference.
  EXPECT_EQ(ops::choose_route(*b, 1, c.w, allow), GemmRoute::kDecode);
  ops::w4a16_gemm(*b, s, c.da, 1, c.w, c.dc, allow);
  EXPECT_EQ(g_tiny_launches, 1u);
  expect_close(compare(output(*b, c), reference(c.a, 1, c.row, c.bias, AMode::kE4m3)), kNormTol,
               "allowed");
  free_case(*b, c);

  // Exact BF16 above kDecodeMaxM takes gemm_tiled, which does not cast: fine. With E4M3 allowed
  // and M >= kE4m3MinM, a module without gemm_e4m3 gets the tiled route too.
  for (const std::int64_t m : {ops::decode_max_m(*b) + 1, ops::kE4m3MinM}) {
    Case t = make_case(*b, gen, WeightFormat::kMxfp4, WeightLayout::kTransposed, m, 63, 64, false);
    for (const ops::GemmOptions& o : {exact, allow}) {
      const ops::GemmOptions oo{o.activations, o.route, DevicePtr{}};
      EXPECT_EQ(ops::choose_route(*b, m, t.w, oo), GemmRoute::kTiled) << "M = " << m;
      ops::w4a16_gemm(*b, s, t.da, m, t.w, t.dc, oo);
      expect_close(compare(output(*b, t), reference(t.a, m, t.row, {}, AMode::kBf16)), kNormTol,
                   fmt::format("tiled M={}", m));
    }
    free_case(*b, t);
  }
  // Forcing the e4m3 route on a module without it names the missing kernel.
  {
    Case t = make_case(*b, gen, WeightFormat::kNvfp4, WeightLayout::kRowMajor, 64, 7, 16, false);
    const Error e = expect_error([&] {
      ops::w4a16_gemm(*b, s, t.da, 64, t.w, t.dc, {Activations::kAllowE4m3, GemmRoute::kE4m3, {}});
    });
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_THAT(e.what(), HasSubstr("gemm_e4m3"));
    const std::vector<std::uint16_t> out = output(*b, t);
    EXPECT_EQ(std::count(out.begin(), out.end(), kPoisonBf16),
              static_cast<std::ptrdiff_t>(out.size()));
    free_case(*b, t);
  }
  b->op_cache().release(*b);
}

// The checks of this suite against kernels with one defect each: every defect must be caught,
// and the two that a norm can hide (one element off, truncation instead of rounding) are caught
// by the per-element bound.
template <Defect D>
Comparison run_defective(std::mt19937_64& gen) {
  auto b = tiny_backend(tiny_gemm<16, false, D>, 16, tiny_gemm<16, false, D>, 16);
  Case c = make_case(*b, gen, WeightFormat::kNvfp4, WeightLayout::kTransposed, 33, 300, 48, true);
  ops::w4a16_gemm(*b, b->default_stream(), c.da, c.m, c.w, c.dc,
                  {Activations::kExactBf16, GemmRoute::kAuto, c.dbias});
  const Comparison cmp = compare(output(*b, c), reference(c.a, c.m, c.row, c.bias, AMode::kBf16));
  free_case(*b, c);
  return cmp;
}

bool caught(const Comparison& c) {
  return !(c.normalized <= kNormTol) || !(c.worst <= 1.0) || c.unwritten > 0 || c.nonzero == 0;
}

TEST(GemmModules, TheChecksCatchEveryKindOfDefect) {
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  std::mt19937_64 gen(seed);
  const Comparison good = run_defective<Defect::kNone>(gen);
  EXPECT_FALSE(caught(good)) << "the defect-free kernel: " << good.str();
  const std::vector<std::pair<const char*, Comparison>> bad = {
      {"swapped nibbles", run_defective<Defect::kSwappedNibbles>(gen)},
      {"neighbour's scale", run_defective<Defect::kNeighbourScale>(gen)},
      {"no bias", run_defective<Defect::kNoBias>(gen)},
      {"no tensor scale", run_defective<Defect::kNoTensorScale>(gen)},
      {"drops the last k", run_defective<Defect::kDropsLastK>(gen)},
      {"ignores the transposed layout", run_defective<Defect::kIgnoresTransposed>(gen)},
      {"skips the last column", run_defective<Defect::kSkipsLastColumn>(gen)},
      {"one element off", run_defective<Defect::kOneElementOff>(gen)},
      {"truncates the output", run_defective<Defect::kTruncatesOutput>(gen)},
  };
  for (const auto& [what, c] : bad) EXPECT_TRUE(caught(c)) << what << ": " << c.str();
  // The norm alone would miss these two.
  EXPECT_LE(bad[7].second.normalized, kNormTol) << bad[7].second.str();
  EXPECT_GT(bad[7].second.worst, 1.0) << bad[7].second.str();
  EXPECT_EQ(bad[7].second.worst_at, 0);
  EXPECT_LE(bad[8].second.normalized, kNormTol) << bad[8].second.str();
  EXPECT_GT(bad[8].second.worst, 1.0) << bad[8].second.str();
  EXPECT_EQ(bad[6].second.unwritten, 33) << "one column of 33 rows left as poison";
}

}  // namespace
}  // namespace metrale::testing::gemm
