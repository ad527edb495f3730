#include "reliability/lifecycle.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <stdexcept>
#include <utility>
#include <vector>

#include "metrale/model_resources.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "metrale/ops/gemm.h"
#include "metrale/ops/quant_weights.h"
#include "metrale/quant.h"
#include "metrale/weights.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::reliability {
namespace {

namespace gemm = metrale::testing::gemm;

// A mismatch between a result and its reference.
struct VerifyError : std::runtime_error {
  explicit VerifyError(const std::string& what) : std::runtime_error("verification: " + what) {}
};

void require(bool ok, const std::string& what) {
  if (!ok) throw VerifyError(what);
}

// ---- the model's resources, released newest-first by the scope ----

// Added first, so released after everything but the op scratch: counts what is still alive.
class HandleProbe final : public ModelResource {
 public:
  HandleProbe(const std::function<std::size_t(Backend&)>& hook, std::size_t* out)
      : hook_(hook), out_(out) {}
  std::string label() const override { return "handle probe"; }
  void release(Backend& b) override {
    if (hook_) *out_ = hook_(b);
  }

 private:
  const std::function<std::size_t(Backend&)>& hook_;
  std::size_t* out_;
};

// ---- data and references ----

constexpr std::uint32_t kFillPoison = 0xABABABABu;
constexpr std::size_t kTail = 16;  // elements after each output that no op may touch

template <class T>
std::vector<T> read_back(Backend& b, StreamHandle s, DevicePtr p, std::size_t n) {
  std::vector<T> out(n);
  b.copy_d2h_after(out.data(), p, n * sizeof(T), s);
  return out;
}

// Every byte from `from` on still holds the poison byte.
void require_tail(std::span<const std::byte> bytes, std::size_t from, std::uint8_t poison,
                  const std::string& what) {
  for (std::size_t i = from; i < bytes.size(); ++i) {
    require(bytes[i] == std::byte{poison},
            fmt::format("{}: byte {} past the end was written (0x{:02x})", what, i - from,
                        std::to_integer<int>(bytes[i])));
  }
}

// One GEMM the lifecycle runs: its inputs, its output buffer and the reference.
struct GemmCase {
  const char* name;
  ops::GemmRoute route;
  std::int64_t m;
  const ops::QuantWeights* w;
  const HostQuantWeights* host_w;
  bool bias;
  DevicePtr c;  // m·n BF16 plus kTail poisoned elements
};

struct Model {
  Backend* b = nullptr;
  StreamHandle s;
  Shapes shapes;
  std::vector<std::uint16_t> a, bias;  // host A [m_max, K] and bias [N]
  std::vector<float> x, y;
  float alpha = 0.0f;
  std::uint32_t fill_value = 0;
  DevicePtr d_a, d_bias, d_fill, d_x, d_y, d_y0, d_cast, d_copy_src, d_copy_dst;
};

void run_gemm(Model& md, const GemmCase& g) {
  ops::GemmOptions o;
  o.route = g.route;
  o.activations = g.route == ops::GemmRoute::kE4m3 ? ops::Activations::kAllowE4m3
                                                   : ops::Activations::kExactBf16;
  if (g.bias) o.bias = md.d_bias;
  ops::w4a16_gemm(*md.b, md.s, md.d_a, g.m, *g.w, g.c, o);
}

void check_gemm(Model& md, const GemmCase& g, const char* when) {
  const auto n = static_cast<std::size_t>(g.m * md.shapes.n);
  const auto out = read_back<std::uint16_t>(*md.b, md.s, g.c, n + kTail);
  const auto ref = gemm::reference(
      std::span(md.a).first(static_cast<std::size_t>(g.m * md.shapes.k)), g.m, *g.host_w,
      g.bias ? std::span<const std::uint16_t>(md.bias) : std::span<const std::uint16_t>(),
      g.route == ops::GemmRoute::kE4m3 ? gemm::AMode::kE4m3 : gemm::AMode::kBf16);
  const gemm::Comparison c = gemm::compare(std::span(out).first(n), ref);
  const std::string what =
      fmt::format("{} gemm ({}) M={} N={} K={}", g.name, when, g.m, md.shapes.n, md.shapes.k);
  require(c.unwritten == 0 && c.ref_norm > 0.0 && c.nonzero > 0 && c.worst <= 1.0 &&
              c.normalized <= gemm::kNormTol,
          what + ": " + c.str());
  for (std::size_t i = n; i < n + kTail; ++i) {
    require(out[i] == gemm::kPoisonBf16,
            fmt::format("{}: element {} past C was written", what, i - n));
  }
}

void poison_gemm(Model& md, const GemmCase& g) {
  md.b->memset_async(g.c, gemm::kPoisonByte,
                     static_cast<std::size_t>(g.m * md.shapes.n + kTail) * 2, md.s);
}

// fill_u32, axpy_f32 (y starts as y0) and the E4M3 cast, checked.
void check_elementwise(Model& md, const char* when) {
  const std::size_t n = md.shapes.elems;
  const auto fill = read_back<std::uint32_t>(*md.b, md.s, md.d_fill, n + kTail);
  for (std::size_t i = 0; i < n + kTail; ++i) {
    require(fill[i] == (i < n ? md.fill_value : kFillPoison),
            fmt::format("fill_u32 ({}): element {} of {} is 0x{:08x}", when, i, n, fill[i]));
  }
  const auto y = read_back<float>(*md.b, md.s, md.d_y, n);
  for (std::size_t i = 0; i < n; ++i) {
    const double ref = double{md.alpha} * md.x[i] + md.y[i];
    // Two float roundings (or one fused): within 2^-22 of the magnitudes involved.
    const double tol = std::ldexp(std::fabs(double{md.alpha} * md.x[i]) + std::fabs(md.y[i]), -22);
    require(std::fabs(y[i] - ref) <= tol,
            fmt::format("axpy_f32 ({}): y[{}] = {} vs {}", when, i, y[i], ref));
  }
  const auto cast = read_back<std::uint8_t>(*md.b, md.s, md.d_cast, n + kTail);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint8_t want = num::bf16_to_e4m3(md.a[i]);
    require(cast[i] == want,
            fmt::format("cast_bf16_to_e4m3 ({}): out[{}] = 0x{:02x}, want 0x{:02x}", when, i,
                        cast[i], want));
  }
  require_tail(std::as_bytes(std::span(cast)), n, 0xFF, fmt::format("cast ({})", when));
}

void poison_elementwise(Model& md) {
  const std::size_t n = md.shapes.elems;
  md.b->memset_async(md.d_fill, 0xAB, (n + kTail) * 4, md.s);
  md.b->memset_async(md.d_y, 0xFF, n * 4, md.s);
  md.b->memset_async(md.d_cast, 0xFF, n + kTail, md.s);
}

// The element-wise ops, with y reset from y0 first (so a replay computes the same values).
void run_elementwise(Model& md) {
  const std::size_t n = md.shapes.elems;
  md.b->copy_d2d_async(md.d_y, md.d_y0, n * 4, md.s);
  ops::fill_u32(*md.b, md.s, md.d_fill, n, md.fill_value);
  ops::axpy_f32(*md.b, md.s, md.d_y, md.d_x, md.alpha, n);
  ops::cast_bf16_to_e4m3(*md.b, md.s, md.d_a, md.d_cast, static_cast<std::int64_t>(n));
}

// A pitched copy of `rows` rows of 32 bytes from a 48-byte pitch to a 64-byte one.
constexpr std::size_t kRows = 4, kWidth = 32, kSrcPitch = 48, kDstPitch = 64;

void check_copy_2d(Model& md, std::span<const std::byte> src) {
  const auto dst = read_back<std::byte>(*md.b, md.s, md.d_copy_dst, kRows * kDstPitch);
  for (std::size_t r = 0; r < kRows; ++r) {
    for (std::size_t c = 0; c < kDstPitch; ++c) {
      const std::byte want = c < kWidth ? src[r * kSrcPitch + c] : std::byte{0xEE};
      require(dst[r * kDstPitch + c] == want, fmt::format("copy_2d: row {} byte {}", r, c));
    }
  }
}

void run_model(ModelScope& scope, const Shapes& sh, std::mt19937_64& gen) {
  Backend& b = scope.backend();
  Model md;
  md.b = &b;
  md.shapes = sh;
  const std::int64_t m_max = std::max({sh.m_decode, sh.m_tiled, sh.m_e4m3});
  const auto a_elems =
      std::max(static_cast<std::size_t>(m_max * sh.k), sh.elems);  // the cast reads A too

  // Host data: fresh every run.
  const HostQuantWeights w1 =
      quantize_nvfp4(gemm::random_weight_values(gen, sh.n, sh.k), sh.n, sh.k);
  const HostQuantWeights w2 =
      quantize_mxfp4(gemm::random_weight_values(gen, sh.n, sh.k), sh.n, sh.k);
  md.a = gemm::random_activations(gen, a_elems);
  md.bias = gemm::random_bias(gen, sh.n);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  md.x.resize(sh.elems);
  md.y.resize(sh.elems);
  for (float& v : md.x) v = u(gen);
  for (float& v : md.y) v = u(gen);
  md.alpha = u(gen);
  md.fill_value = static_cast<std::uint32_t>(gen());
  std::vector<std::byte> copy_src(kRows * kSrcPitch);
  for (std::byte& v : copy_src) v = static_cast<std::byte>(gen());

  // Weights: the NVFP4 set as the weights resource (ops::WeightsResource), the MXFP4 set through
  // alloc_weights and pinned staging; both take the managed-memory fallback.
  const ops::QuantWeights& d_w1 = scope.add(ops::make_weights_resource(b, w1)).weights();
  const auto round_up = [](std::size_t v) { return (v + 255) / 256 * 256; };
  const std::size_t off_scales = round_up(w2.codes.size());
  const std::size_t off_a = off_scales + round_up(w2.scales.size());
  const std::size_t off_x = off_a + round_up(a_elems * 2);
  auto* staging = static_cast<std::byte*>(scope
                                              .add(std::make_unique<PinnedBufferResource>(
                                                  "staging", b.alloc_pinned(off_x + sh.elems * 4)))
                                              .get());
  ops::QuantWeights d_w2 = ops::describe_weights(w2);
  d_w2.codes = alloc_weights(b, d_w2.codes_bytes);
  scope.add(std::make_unique<DeviceBufferResource>("mxfp4 codes", d_w2.codes));
  d_w2.scales = alloc_weights(b, d_w2.scales_bytes);
  scope.add(std::make_unique<DeviceBufferResource>("mxfp4 scales", d_w2.scales));

  md.s = scope.add(std::make_unique<StreamResource>("stream", b.create_stream())).get();
  const EventHandle ev =
      scope.add(std::make_unique<EventResource>("event", b.create_event())).get();

  std::memcpy(staging, w2.codes.data(), w2.codes.size());
  std::memcpy(staging + off_scales, w2.scales.data(), w2.scales.size());
  std::memcpy(staging + off_a, md.a.data(), a_elems * 2);
  std::memcpy(staging + off_x, md.x.data(), sh.elems * 4);
  md.d_a = scope.alloc_buffer("activations", a_elems * 2);
  b.copy_h2d_async(d_w2.codes, staging, w2.codes.size(), md.s);
  b.copy_h2d_async(d_w2.scales, staging + off_scales, w2.scales.size(), md.s);
  b.copy_h2d_async(md.d_a, staging + off_a, a_elems * 2, md.s);
  md.d_x = b.pinned_device_address(staging + off_x);  // kernels read x from pinned memory

  md.d_bias = scope.alloc_buffer("bias", md.bias.size() * 2);
  md.d_y0 = scope.alloc_buffer("y0", sh.elems * 4);
  md.d_y = scope.alloc_buffer("y", sh.elems * 4);
  md.d_fill = scope.alloc_buffer("fill", (sh.elems + kTail) * 4);
  md.d_cast = scope.alloc_buffer("cast", sh.elems + kTail);
  md.d_copy_src = scope.alloc_buffer("copy_2d src", kRows * kSrcPitch);
  md.d_copy_dst = scope.alloc_buffer("copy_2d dst", kRows * kDstPitch);
  b.copy_h2d(md.d_bias, md.bias.data(), md.bias.size() * 2);
  b.copy_h2d(md.d_y0, md.y.data(), sh.elems * 4);
  b.copy_h2d(md.d_copy_src, copy_src.data(), copy_src.size());
  b.memset(md.d_copy_dst, 0xEE, kRows * kDstPitch);

  const auto c_bytes = [&](std::int64_t m) {
    return static_cast<std::size_t>(m * sh.n + kTail) * 2;
  };
  std::vector<GemmCase> gemms = {
      {"decode", ops::GemmRoute::kDecode, sh.m_decode, &d_w1, &w1, true, {}},
      {"tiled", ops::GemmRoute::kTiled, sh.m_tiled, &d_w2, &w2, false, {}},
      {"e4m3", ops::GemmRoute::kE4m3, sh.m_e4m3, &d_w2, &w2, true, {}},
  };
  for (GemmCase& g : gemms) g.c = scope.alloc_buffer(g.name, c_bytes(g.m));

  // Every op once, eagerly (this also resolves every kernel before the capture).
  poison_elementwise(md);
  for (const GemmCase& g : gemms) poison_gemm(md, g);
  run_elementwise(md);
  b.copy_2d_async(md.d_copy_dst, kDstPitch, md.d_copy_src, kSrcPitch, kWidth, kRows, md.s);
  for (const GemmCase& g : gemms) run_gemm(md, g);
  b.record_event(ev, md.s);
  b.wait_event(b.default_stream(), ev);
  b.event_synchronize(ev);
  require(b.event_query(ev) == EventStatus::kDone, "the event is not done after synchronizing");
  check_elementwise(md, "eager");
  check_copy_2d(md, copy_src);
  for (const GemmCase& g : gemms) check_gemm(md, g, "eager");

  // A graph of the same ops, replayed twice into freshly poisoned outputs.
  b.begin_capture(md.s);
  GraphHandle graph;
  try {
    run_elementwise(md);
    for (const GemmCase& g : gemms) run_gemm(md, g);
    graph = scope.add(std::make_unique<GraphResource>("graph", b.end_capture(md.s))).get();
  } catch (...) {
    b.abort_capture(md.s);  // error paths end the capture (a no-op when end_capture did)
    throw;
  }
  for (const char* when : {"replay 1", "replay 2"}) {
    poison_elementwise(md);
    for (const GemmCase& g : gemms) poison_gemm(md, g);
    b.launch_graph(graph, md.s);
    b.synchronize(md.s);
    check_elementwise(md, when);
    for (const GemmCase& g : gemms) check_gemm(md, g, when);
  }
}

}  // namespace

Outcome run_lifecycle(const Hooks& hooks, const Shapes& shapes, std::mt19937_64& gen) {
  Outcome out;
  std::unique_ptr<Backend> backend;
  try {
    backend = hooks.make_backend();
  } catch (const Error& e) {
    out.error = e;
    return out;
  } catch (const std::exception& e) {
    out.other_exception = e.what();
    return out;
  }
  ModelScope scope(std::move(backend));
  out.scope_built = true;
  const LedgerProbe probe = scope.backend().ledger_probe();
  scope.add(std::make_unique<HandleProbe>(hooks.at_teardown, &out.handles_at_teardown));
  try {
    run_model(scope, shapes, gen);
    out.verified = true;
  } catch (const Error& e) {
    out.error = e;
  } catch (const std::exception& e) {
    out.other_exception = e.what();
  }
  out.teardown = scope.teardown();
  out.live_bytes_after = probe.live_bytes();
  out.live_allocs_after = probe.live_count();
  return out;
}

}  // namespace metrale::testing::reliability
