// metrale check: the backend's whole contract end to end, on fresh random data, against a
// float64 reference. Issue-by-issue this grows into the numerics suite of every op.
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "commands.h"
#include "metrale/backend.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "metrale/runtime.h"
#include "planted_leak.h"
#include "toolkit/gemm_reference.h"
#include "toolkit/gemm_tolerance.h"
#include "w8a8_check.h"

namespace metrale::cli {
namespace {

struct Row {
  std::string name;
  bool passed = false;
  bool skipped = false;  // not run on this backend: detail says why (never a silent pass)
  std::string detail;
  double ms = 0;
};

// Thrown by a row's body when the backend lacks what the row needs (a kernel, a layout, an
// output type): the row is reported skipped with the reason.
struct Skipped {
  std::string why;
};

// Whether backend's w4a16 module has a real gemm_fused (sm_80/sm_89 modules hold a placeholder
// that publishes itself absent).
bool has_fused(Backend& backend) {
  return backend.has_kernel("w4a16", "gemm_fused") &&
         !backend.op_cache().kernel(backend, "w4a16", "gemm_fused").meta.absent;
}

// The BF16 nearest to x (ties to even; past the largest finite value by half a unit or more,
// infinity), chosen by distances in float64: an independent reference for the FP32 → BF16 cast.
// NaN is not handled here (any NaN is accepted for a NaN input).
std::uint16_t nearest_bf16_f64(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, 4);
  const std::uint32_t sign = bits & 0x80000000u, mag = bits & 0x7FFFFFFFu;
  const std::uint32_t lo = mag & 0xFFFF0000u, hi = lo + 0x10000u;       // the two candidates
  if (mag == lo) return static_cast<std::uint16_t>((sign | lo) >> 16);  // exact (or infinity)
  const auto value = [](std::uint32_t m) {
    if (m >= 0x7F800000u) return std::ldexp(1.0, 128);  // infinity, as rounding sees it
    float f = 0;
    std::memcpy(&f, &m, 4);
    return static_cast<double>(f);
  };
  const double v = value(mag), dlo = v - value(lo), dhi = value(hi) - v;
  const bool up = dhi < dlo || (dhi == dlo && (lo & 0x10000u) != 0);
  return static_cast<std::uint16_t>((sign | (up ? hi : lo)) >> 16);
}

// ‖out − ref‖ / ‖ref‖ in float64.
double normalized_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

std::vector<float> random_floats(std::mt19937_64& rng, std::size_t n) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class Checker {
 public:
  Checker(ModelScope& scope, std::uint64_t seed) : scope_(scope), rng_(seed) {}

  void run(const std::string& name, const std::function<std::string()>& body) {
    Row row;
    row.name = name;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      row.detail = body();
      row.passed = true;
    } catch (const Skipped& s) {
      row.skipped = true;
      row.detail = "skipped: " + s.why;
    } catch (const std::exception& e) {
      row.detail = e.what();
    }
    row.ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    rows_.push_back(row);
  }

  std::string axpy() {
    Backend& b = scope_.backend();
    const std::size_t n = 1'000'003;  // not a multiple of any tile: the last block is partial
    const float a = 0.75f;
    const auto x = random_floats(rng_, n), y0 = random_floats(rng_, n);
    const DevicePtr dx = scope_.alloc_buffer("check x", n * 4);
    const DevicePtr dy = scope_.alloc_buffer("check y", n * 4);
    b.copy_h2d(dx, x.data(), n * 4);
    b.copy_h2d(dy, y0.data(), n * 4);
    ops::axpy_f32(b, b.default_stream(), dy, dx, a, n);
    std::vector<float> out(n);
    b.copy_d2h(out.data(), dy, n * 4);
    std::vector<double> ref(n);
    for (std::size_t i = 0; i < n; ++i) ref[i] = double{a} * x[i] + y0[i];
    return expect_close(out, ref, 1e-6);
  }

  std::string fill() {
    Backend& b = scope_.backend();
    const std::size_t n = 70'001;
    const DevicePtr d = scope_.alloc_buffer("check fill", n * 4);
    b.memset(d, 0xAB, n * 4);  // poison: an unwritten element cannot pass
    const auto value = static_cast<std::uint32_t>(rng_() | 1u);
    ops::fill_u32(b, b.default_stream(), d, n, value);
    std::vector<std::uint32_t> out(n);
    b.copy_d2h(out.data(), d, n * 4);
    for (std::size_t i = 0; i < n; ++i) {
      if (out[i] != value) {
        throw Error(ErrorCode::kInternal, "check", fmt::format("element {} was not written", i));
      }
    }
    return fmt::format("{} elements written", n);
  }

  std::string graph() {
    Backend& b = scope_.backend();
    const std::size_t n = 65'537;
    const float a = -1.25f;
    const auto x = random_floats(rng_, n), y0 = random_floats(rng_, n);
    const DevicePtr dx = scope_.alloc_buffer("graph x", n * 4);
    const DevicePtr dy = scope_.alloc_buffer("graph y", n * 4);
    b.copy_h2d(dx, x.data(), n * 4);
    b.copy_h2d(dy, y0.data(), n * 4);
    // Resolve before capture, as every op must.
    b.op_cache().kernel(b, "core", "axpy_f32");
    const StreamHandle s = b.create_stream();
    b.begin_capture(s);
    ops::axpy_f32(b, s, dy, dx, a, n);
    const GraphHandle g = b.end_capture(s);
    const int replays = 3;
    for (int r = 0; r < replays; ++r) b.launch_graph(g, s);
    b.synchronize(s);
    b.destroy_graph(g);
    b.destroy_stream(s);
    std::vector<float> out(n);
    b.copy_d2h(out.data(), dy, n * 4);
    std::vector<double> ref(n);
    for (std::size_t i = 0; i < n; ++i) ref[i] = y0[i] + replays * double{a} * x[i];
    return "3 replays; " + expect_close(out, ref, 1e-6);
  }

  // One w4a16_gemm case on random data against the float64 reference: bf16 A (E4M3-rounded A
  // for the e4m3 route) times the dequantized host weights. Output poisoned first. `upload`:
  // kDecode runs the decode route on the decode layout (at M past 16 too).
  // `out_f32`: C in FP32 (GemmOptions::out_f32), held to the bound without the BF16 rounding. A
  // panel upload or FP32 output the backend does not offer skips the row, with its reason.
  std::string gemm(ops::GemmRoute route, WeightFormat format, WeightLayout layout, bool bias,
                   ops::UploadLayout upload = ops::UploadLayout::kSource, bool out_f32 = false) {
    const bool packed = upload == ops::UploadLayout::kDecode;
    // The fused route's tiles hold 128 tokens: up to 300 rows covers a partial second tile.
    const std::int64_t max_m = route == ops::GemmRoute::kFused    ? 300
                               : packed                           ? 40
                               : route == ops::GemmRoute::kDecode ? 16
                                                                  : 96;
    std::uniform_int_distribution<std::int64_t> pick_m(1, max_m), pick_n(1, 300),
        pick_g(1, packed ? 40 : 12);
    const std::int64_t m = pick_m(rng_), n = pick_n(rng_), k = pick_g(rng_) * group_size(format);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> wf(static_cast<std::size_t>(n * k));
    for (float& x : wf) x = normal(rng_);
    HostQuantWeights hw =
        format == WeightFormat::kNvfp4 ? quantize_nvfp4(wf, n, k) : quantize_mxfp4(wf, n, k);
    hw = with_layout(hw, layout);
    return gemm_on(route, hw, m, bias, upload, out_f32,
                   out_f32 || upload == ops::UploadLayout::kPanels);
  }

  // An INT4 case (groups of `group`, zero points or not, act order or not) as gemm() runs one; a
  // backend whose kernels do not read INT4 skips it, with its reason.
  std::string gemm_int4(ops::GemmRoute route, std::int64_t group, bool zero_points, bool act_order,
                        bool bias, ops::UploadLayout upload = ops::UploadLayout::kSource) {
    std::uniform_int_distribution<std::int64_t> pick_m(1,
                                                       route == ops::GemmRoute::kDecode ? 16 : 96),
        pick_n(1, 300), pick_g(1, 1024 / group);
    const std::int64_t m = pick_m(rng_), n = pick_n(rng_), k = pick_g(rng_) * group;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> wf(static_cast<std::size_t>(n * k));
    for (float& x : wf) x = normal(rng_) + (zero_points ? 1.0f : 0.0f);
    const bool fp16_scales = act_order;  // as GPTQ's act-ordered checkpoints carry them
    HostQuantWeights hw = quantize_int4(wf, n, k, group, zero_points, fp16_scales);
    if (act_order) {
      std::vector<std::int32_t> g_idx(static_cast<std::size_t>(k));
      for (std::int64_t i = 0; i < k; ++i)
        g_idx[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i / group);
      std::shuffle(g_idx.begin(), g_idx.end(), rng_);
      hw = with_act_order(hw, g_idx);
    }
    return gemm_on(route, hw, m, bias, upload, false, true);
  }

  // hw (row-major host weights) times M random rows on route, against the float64 reference;
  // `optional`: a layout or route the backend does not offer (kUnavailable) skips the row.
  std::string gemm_on(ops::GemmRoute route, const HostQuantWeights& hw, std::int64_t m, bool bias,
                      ops::UploadLayout upload, bool out_f32, bool optional) {
    Backend& b = scope_.backend();
    const std::int64_t n = hw.n, k = hw.k;
    const WeightFormat format = hw.format;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<std::uint16_t> a(static_cast<std::size_t>(m * k)), hb(static_cast<std::size_t>(n));
    for (auto& x : a) x = num::f32_to_bf16(normal(rng_));
    for (auto& x : hb) x = num::f32_to_bf16(normal(rng_));
    ops::QuantWeights w;
    try {
      w = ops::upload_weights(b, hw, upload);
    } catch (const Error& e) {
      if (optional && e.code() == ErrorCode::kUnavailable) throw Skipped{e.message()};
      throw;
    }
    const std::size_t c_size = out_f32 ? 4 : 2;
    const DevicePtr da = scope_.alloc_buffer("gemm A", a.size() * 2);
    const DevicePtr dc = scope_.alloc_buffer("gemm C", static_cast<std::size_t>(m * n) * c_size);
    const DevicePtr dbias = scope_.alloc_buffer("gemm bias", hb.size() * 2);
    b.copy_h2d(da, a.data(), a.size() * 2);
    b.copy_h2d(dbias, hb.data(), hb.size() * 2);
    b.memset(dc, 0xFF, static_cast<std::size_t>(m * n) * c_size);  // poison: NaN in either type
    ops::GemmOptions o;
    o.out_f32 = out_f32;
    o.route = route;
    o.activations = route == ops::GemmRoute::kE4m3 ? ops::Activations::kAllowE4m3
                                                   : ops::Activations::kExactBf16;
    if (bias) o.bias = dbias;
    ops::GemmPlan plan;
    try {
      plan = ops::plan(b, m, w, o);
    } catch (const Error& e) {
      ops::free_weights(b, w);
      if (optional && e.code() == ErrorCode::kUnavailable) throw Skipped{e.message()};
      throw;
    }
    ops::run(plan, b.default_stream(), da, w, dc, ops::scratch_workspace(plan, b.default_stream()),
             o.bias);
    std::vector<std::uint16_t> c(out_f32 ? 0 : static_cast<std::size_t>(m * n));
    std::vector<float> c32(out_f32 ? static_cast<std::size_t>(m * n) : 0);
    if (out_f32) {
      b.copy_d2h(c32.data(), dc, c32.size() * 4);
    } else {
      b.copy_d2h(c.data(), dc, c.size() * 2);
    }
    ops::free_weights(b, w);
    // The float64 reference and the route's bounds of the tests' suite (tools/toolkit): the
    // normalized error and every element within its deterministic bound.
    const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(route, format);
    const toolkit::Reference ref =
        toolkit::reference(a, m, hw, bias ? hb : std::vector<std::uint16_t>{}, tol);
    const toolkit::Comparison cmp =
        out_f32 ? toolkit::compare_f32(c32, ref) : toolkit::compare(c, ref);
    if (!toolkit::within(cmp, tol)) {
      throw Error(
          ErrorCode::kInternal, "check",
          fmt::format("M={} N={} K={}: {} (tolerance {:.1g})", m, n, k, cmp.str(), tol.normalized));
    }
    return fmt::format(
        "normalized error {:.3g} (tolerance {:.1g}), worst element at {:.2f} of its bound; plan "
        "{}",
        cmp.normalized, tol.normalized, cmp.worst, plan.describe());
  }

  // The E4M3 cast (docs/CONTRACT.md, E4M3 cast) over all 65,536 BF16 bit patterns against
  // numerics.h's definition.
  std::string cast_all() {
    Backend& b = scope_.backend();
    std::vector<std::uint16_t> in(65536);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<std::uint16_t>(i);
    const DevicePtr din = scope_.alloc_buffer("cast in", in.size() * 2);
    const DevicePtr dout = scope_.alloc_buffer("cast out", in.size());
    b.copy_h2d(din, in.data(), in.size() * 2);
    b.memset(dout, 0x5A, in.size());
    ops::cast_bf16_to_e4m3(b, b.default_stream(), din, dout, static_cast<std::int64_t>(in.size()));
    std::vector<std::uint8_t> out(in.size());
    b.copy_d2h(out.data(), dout, out.size());
    for (std::size_t i = 0; i < in.size(); ++i) {
      if (out[i] != num::bf16_to_e4m3(in[i])) {
        throw Error(ErrorCode::kInternal, "check",
                    fmt::format("bf16 0x{:04x} cast to 0x{:02x}, expected 0x{:02x}", i, out[i],
                                num::bf16_to_e4m3(in[i])));
      }
    }
    return "65536 of 65536 BF16 patterns";
  }

  // The FP32 → BF16 cast (ops::cast_f32_to_bf16) on random bit patterns of every binade, the
  // midpoints between BF16 neighbours (ties), and the special values, against the nearest BF16
  // chosen in float64. Skipped where the backend's core module has no cast_f32_bf16.
  std::string cast_f32() {
    Backend& b = scope_.backend();
    if (!b.has_kernel("core", "cast_f32_bf16")) {
      throw Skipped{
          fmt::format("the {} backend's core module has no cast_f32_bf16 kernel", b.name())};
    }
    std::vector<std::uint32_t> bits;
    for (int i = 0; i < 200'000; ++i) bits.push_back(static_cast<std::uint32_t>(rng_()));
    for (int i = 0; i < 50'000; ++i) {  // ties: halfway between two BF16 values
      bits.push_back((static_cast<std::uint32_t>(rng_()) & 0xFFFF0000u) | 0x8000u);
    }
    for (const std::uint32_t x :
         {0x00000000u, 0x80000000u, 0x00000001u, 0x00008000u, 0x00018000u, 0x007FFFFFu, 0x00800000u,
          0x7F7FFFFFu, 0x7F7F8000u, 0x7F7F7FFFu, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFF800001u,
          0x3F808000u, 0x3F818000u}) {
      bits.push_back(x);
    }
    const std::size_t n = bits.size();
    const DevicePtr din = scope_.alloc_buffer("cast f32 in", n * 4);
    const DevicePtr dout = scope_.alloc_buffer("cast f32 out", n * 2);
    b.copy_h2d(din, bits.data(), n * 4);
    b.memset(dout, 0x5A, n * 2);  // poison: 0x5A5A is no cast of these inputs' neighbours
    ops::cast_f32_to_bf16(b, b.default_stream(), din, dout, n);
    std::vector<std::uint16_t> out(n);
    b.copy_d2h(out.data(), dout, n * 2);
    for (std::size_t i = 0; i < n; ++i) {
      float x = 0;
      std::memcpy(&x, &bits[i], 4);
      const bool nan_in = std::isnan(x), nan_out = (out[i] & 0x7FFFu) > 0x7F80u;
      const std::uint16_t want = nan_in ? std::uint16_t{0x7FC0} : nearest_bf16_f64(x);
      if (nan_in ? !nan_out : out[i] != want) {
        throw Error(ErrorCode::kInternal, "check",
                    fmt::format("f32 0x{:08x} cast to 0x{:04x}, expected {}", bits[i], out[i],
                                nan_in ? std::string("a NaN") : fmt::format("0x{:04x}", want)));
      }
    }
    return fmt::format("{} values (random, ties, specials) equal the float64 nearest", n);
  }

  std::string scratch() {
    Backend& b = scope_.backend();
    OpCache& c = b.op_cache();
    const DevicePtr small = c.scratch(b, "check", 4096);
    if (c.scratch(b, "check", 1024) != small) {
      throw Error(ErrorCode::kInternal, "check", "a request that fits got a new buffer");
    }
    if (c.scratch(b, "check", 1 << 20) == small) {
      throw Error(ErrorCode::kInternal, "check", "a larger request reused the small buffer");
    }
    return c.summary();
  }

  const std::vector<Row>& rows() const { return rows_; }
  std::mt19937_64& rng() noexcept { return rng_; }
  void add(Row row) { rows_.push_back(std::move(row)); }

 private:
  static std::string expect_close(const std::vector<float>& out, const std::vector<double>& ref,
                                  double tol) {
    const double err = normalized_error(out, ref);
    if (!(err <= tol)) {
      throw Error(ErrorCode::kInternal, "check",
                  fmt::format("normalized error {:.3g} above {:.1g}", err, tol));
    }
    return fmt::format("normalized error {:.3g} (tolerance {:.1g})", err, tol);
  }

  ModelScope& scope_;
  std::mt19937_64 rng_;
  std::vector<Row> rows_;
};

}  // namespace

int run_check(const CommonOptions& options, const CheckOptions& check) {
  // One seed for all the random data, printed, so `--seed N` reruns a failure on the same data.
  std::random_device entropy;
  const std::uint64_t seed =
      check.seed ? *check.seed : (std::uint64_t{entropy()} << 32 | std::uint64_t{entropy()});
  std::string why;
  std::unique_ptr<Backend> backend = create_backend(options.backend, &why);
  const std::string backend_name(backend->name());
  const std::string device = backend->device_name();
  const LedgerProbe probe = backend->ledger_probe();
  std::vector<Row> rows;
  {
    ModelScope scope(std::move(backend));
    Checker c(scope, seed);
    c.run("fill_u32 (poisoned output)", [&] { return c.fill(); });
    c.run("axpy_f32 vs float64", [&] { return c.axpy(); });
    c.run("graph capture + replay", [&] { return c.graph(); });
    c.run("grow-only scratch", [&] { return c.scratch(); });
    c.run("bf16 -> e4m3 cast, exhaustive", [&] { return c.cast_all(); });
    c.run("f32 -> bf16 cast vs float64", [&] { return c.cast_f32(); });
    // The dequant route where the backend has a dense BF16 GEMM (its rows are absent otherwise).
    std::vector<ops::GemmRoute> routes = {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled,
                                          ops::GemmRoute::kE4m3};
    if (scope.backend().dense_gemm_unavailable(DenseKind::kBf16).empty()) {
      routes.push_back(ops::GemmRoute::kDequant);
    }
    for (const auto route : routes) {
      for (const auto format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
        for (const auto layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
          const bool bias = layout == WeightLayout::kTransposed;
          c.run(fmt::format("w4a16 {} {} {}{}", ops::to_string(route), to_string(format),
                            layout == WeightLayout::kRowMajor ? "rows" : "transposed",
                            bias ? " +bias" : ""),
                [&] { return c.gemm(route, format, layout, bias); });
        }
      }
    }
    // The decode layout (made at upload; gemm_decode_packed on CUDA, its CPU twin here).
    for (const auto format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
      for (const auto layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
        const bool bias = layout == WeightLayout::kTransposed;
        c.run(fmt::format("w4a16 decode-dl {} {}{}", to_string(format),
                          layout == WeightLayout::kRowMajor ? "rows" : "transposed",
                          bias ? " +bias" : ""),
              [&] {
                return c.gemm(ops::GemmRoute::kDecode, format, layout, bias,
                              ops::UploadLayout::kDecode);
              });
      }
    }
    // The fused prefill route (the decode layout above the decode sizes) where the backend's
    // module has its kernel: CUDA sm_90's gemm_fused, the CPU's twin of the decode kernel (not
    // the placeholder that sm_80/sm_89 modules publish as absent).
    if (has_fused(scope.backend())) {
      for (const auto format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
        for (const auto layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
          const bool bias = layout == WeightLayout::kTransposed;
          c.run(fmt::format("w4a16 fused-dl {} {}{}", to_string(format),
                            layout == WeightLayout::kRowMajor ? "rows" : "transposed",
                            bias ? " +bias" : ""),
                [&] {
                  return c.gemm(ops::GemmRoute::kFused, format, layout, bias,
                                ops::UploadLayout::kDecode);
                });
        }
      }
    }
    // The panel layout (made at upload; the CPU's decode and tiled routes read it), skipped with
    // the reason where the backend does not read it.
    for (const auto route : {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled}) {
      for (const auto format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
        for (const auto layout : {WeightLayout::kRowMajor, WeightLayout::kTransposed}) {
          const bool bias = layout == WeightLayout::kTransposed;
          c.run(fmt::format("w4a16 {}-panels {} {}{}", ops::to_string(route), to_string(format),
                            layout == WeightLayout::kRowMajor ? "rows" : "transposed",
                            bias ? " +bias" : ""),
                [&] { return c.gemm(route, format, layout, bias, ops::UploadLayout::kPanels); });
        }
      }
    }
    // INT4 weights (GPTQ, AWQ, compressed-tensors pack-quantized): groups of 32, 64 and 128,
    // symmetric and with zero points, K in its own order and act-ordered, on the routes with INT4
    // kernels on the source layout; skipped with the reason where the backend has none (CUDA).
    struct Int4Row {
      std::int64_t group;
      bool zero_points, act_order, bias;
    };
    for (const auto route : {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled}) {
      for (const Int4Row r : {Int4Row{32, false, false, false}, Int4Row{128, true, false, true},
                              Int4Row{64, false, true, false}, Int4Row{128, true, true, true}}) {
        c.run(fmt::format("w4a16 {} int4 g{}{}{}{}", ops::to_string(route), r.group,
                          r.zero_points ? " asym" : "", r.act_order ? " act-order" : "",
                          r.bias ? " +bias" : ""),
              [&] { return c.gemm_int4(route, r.group, r.zero_points, r.act_order, r.bias); });
      }
    }
    // The same weights in the panel layout (the CPU's int4_panels.cpp and, on the tiled route
    // past 16 rows, int4_tiled.cpp's panels filled from the lines); skipped with the reason where
    // the backend does not read it.
    for (const auto route : {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled}) {
      for (const Int4Row r : {Int4Row{32, false, false, false}, Int4Row{128, true, true, true}}) {
        c.run(fmt::format("w4a16 {}-panels int4 g{}{}{}{}", ops::to_string(route), r.group,
                          r.zero_points ? " asym" : "", r.act_order ? " act-order" : "",
                          r.bias ? " +bias" : ""),
              [&] {
                return c.gemm_int4(route, r.group, r.zero_points, r.act_order, r.bias,
                                   ops::UploadLayout::kPanels);
              });
      }
    }
    // The same weights in the int4 decode layout (gemm_int4_decode, permute_a_int4 under act
    // order, dequant_int4_bf16 → dense BF16): run by name, verified on a device or not; skipped
    // with the reason where the backend has no such kernels or no dense GEMM.
    for (const auto route : {ops::GemmRoute::kDecode, ops::GemmRoute::kDequant}) {
      for (const Int4Row r : {Int4Row{32, false, false, false}, Int4Row{128, true, false, true},
                              Int4Row{64, false, true, false}, Int4Row{128, true, true, true}}) {
        c.run(fmt::format("w4a16 {} int4-dl g{}{}{}{}", ops::to_string(route), r.group,
                          r.zero_points ? " asym" : "", r.act_order ? " act-order" : "",
                          r.bias ? " +bias" : ""),
              [&] {
                return c.gemm_int4(route, r.group, r.zero_points, r.act_order, r.bias,
                                   ops::UploadLayout::kDecode);
              });
      }
    }
    // FP32 output on every route: run where the route's kernel publishes out_f32, else skipped
    // with the reason (the dequant route's dense GEMM writes BF16 only).
    for (const auto route : {ops::GemmRoute::kDecode, ops::GemmRoute::kTiled, ops::GemmRoute::kE4m3,
                             ops::GemmRoute::kDequant, ops::GemmRoute::kFused}) {
      const bool fused = route == ops::GemmRoute::kFused;
      c.run(fmt::format("w4a16 {} nvfp4 +bias, FP32 C", ops::to_string(route)), [&] {
        if (fused && !has_fused(scope.backend())) {
          throw Skipped{"the backend's w4a16 module has no gemm_fused kernel"};
        }
        if (route == ops::GemmRoute::kDequant &&
            !scope.backend().dense_gemm_unavailable(DenseKind::kBf16).empty()) {
          throw Skipped{scope.backend().dense_gemm_unavailable(DenseKind::kBf16)};
        }
        return c.gemm(route, WeightFormat::kNvfp4, WeightLayout::kRowMajor, true,
                      fused ? ops::UploadLayout::kDecode : ops::UploadLayout::kSource, true);
      });
    }
    // The W8A8 op, on backends whose dense GEMM library has the block-scaled FP8 kind.
    if (has_w8a8(scope)) {
      for (const bool bias : {false, true}) {
        c.run(bias ? "w8a8 e4m3-block128 +bias" : "w8a8 e4m3-block128",
              [&] { return check_w8a8(scope, c.rng(), bias); });
      }
      for (const auto format : {WeightFormat::kNvfp4, WeightFormat::kMxfp4}) {
        c.run(fmt::format("w8a8 requantized {}", to_string(format)),
              [&] { return check_w8a8_requantized(scope, c.rng(), format); });
      }
    }
    rows = c.rows();
    plant_leak_for_tests(scope.backend());
    const TeardownReport report = scope.teardown();
    Row teardown;
    teardown.name = "teardown to zero bytes";
    // The sweep frees what no resource released, so zero live bytes after it proves nothing by
    // itself: anything the sweep found is a leak, and fails the check with its call sites.
    teardown.passed = report.clean() && probe.live_bytes() == 0;
    teardown.detail = fmt::format("{} resource(s) released, {} swept, {} live bytes after",
                                  report.released, report.swept, probe.live_bytes());
    if (report.swept > 0) teardown.detail += "; leaked " + report.leak_summary();
    for (const auto& f : report.failures) teardown.detail += "; " + f.label + ": " + f.message;
    rows.push_back(teardown);
  }

  bool ok = true;
  for (const Row& r : rows) ok = ok && (r.passed || r.skipped);
  if (options.json) {
    nlohmann::json doc{{"backend", backend_name},
                       {"device", device},
                       {"chosen", why},
                       {"seed", seed},
                       {"passed", ok}};
    doc["checks"] = nlohmann::json::array();
    for (const Row& r : rows) {
      doc["checks"].push_back({{"name", r.name},
                               {"passed", r.passed},
                               {"skipped", r.skipped},
                               {"detail", r.detail},
                               {"ms", r.ms}});
    }
    fmt::print("{}\n", doc.dump(2));
  } else {
    fmt::print("metrale check on {} ({})\n  backend {}\n  seed {} (rerun with --seed {})\n",
               backend_name, device, why, seed, seed);
    for (const Row& r : rows) {
      fmt::print("  {:<4}  {:<42} {:>8.1f} ms  {}\n",
                 r.passed    ? "PASS"
                 : r.skipped ? "SKIP"
                             : "FAIL",
                 r.name, r.ms, r.detail);
    }
    std::size_t passed = 0, skipped = 0;
    for (const Row& r : rows) {
      passed += r.passed ? 1 : 0;
      skipped += r.skipped ? 1 : 0;
    }
    fmt::print("{} passed, {} failed, {} skipped\n", passed, rows.size() - passed - skipped,
               skipped);
  }
  return ok ? 0 : 1;
}

}  // namespace metrale::cli
