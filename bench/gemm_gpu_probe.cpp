// Diagnoses w4a16_gemm on a CUDA GPU case by case: each route forced over a few shapes chosen to
// cover one tile, several tiles, ragged edges, split-K and a real layer, with the same random
// inputs run on the CPU backend (the reference every GPU result is held to). Per case it prints the
// normalized error against the CPU result, how many outputs are wrong or unwritten (C is poisoned
// with NaN first), which rows and columns they fall in, and the first few. With --dump DIR, every
// case with a wrong output is written to DIR/probe.bin (inputs and both outputs, layout in
// write_case) so that a layout or indexing bug can be taken apart offline after the device lease.
// Exit 0 when every case matches, 1 when one does not, 2 when the program could not run.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "metrale/runtime.h"

namespace {

using namespace metrale;

struct Case {
  ops::GemmRoute route;
  std::int64_t m, n, k;
  WeightFormat format = WeightFormat::kNvfp4;
  WeightLayout layout = WeightLayout::kRowMajor;
  // The device under test gets the weights in the decode layout (gemm_decode_packed); the CPU
  // reference always runs on the source layout.
  bool packed = false;
};

using R = ops::GemmRoute;
constexpr WeightFormat kMx = WeightFormat::kMxfp4;
constexpr WeightLayout kT = WeightLayout::kTransposed;
constexpr WeightFormat kNv = WeightFormat::kNvfp4;
constexpr WeightLayout kRm = WeightLayout::kRowMajor;

// One tile, several tiles, ragged edges, the other format and layout, split-K, a real layer.
const Case kCases[] = {
    {R::kDecode, 1, 256, 512},
    {R::kDecode, 8, 300, 1040},
    {R::kDecode, 16, 1024, 4096},
    {R::kDecode, 1, 8192, 8192},
    {R::kDecode, 3, 520, 1024, kMx},
    {R::kDecode, 5, 256, 512, WeightFormat::kNvfp4, kT},
    {R::kTiled, 128, 128, 256},
    {R::kTiled, 256, 384, 1024},
    {R::kTiled, 200, 300, 1040},
    {R::kTiled, 1, 256, 512},
    {R::kTiled, 130, 264, 544, kMx},
    {R::kTiled, 4096, 1024, 2048},
    {R::kE4m3, 64, 64, 256},
    {R::kE4m3, 128, 256, 1024},
    {R::kE4m3, 200, 300, 1040},
    {R::kE4m3, 100, 264, 544, kMx},
    {R::kE4m3, 4096, 1024, 2048},
    // The decode layout: one tile, ragged N and K (K not a multiple of 128), M at 8, 16 and
    // past 16, split-K on real layers, MXFP4, a transposed source.
    {R::kDecode, 1, 32, 128, kNv, kRm, true},
    {R::kDecode, 8, 300, 1040, kNv, kRm, true},
    {R::kDecode, 16, 1024, 4096, kNv, kRm, true},
    {R::kDecode, 1, 8192, 8192, kNv, kRm, true},
    {R::kDecode, 2, 4096, 14336, kNv, kRm, true},
    {R::kDecode, 3, 520, 1024, kMx, kRm, true},
    {R::kDecode, 13, 200, 4000, kMx, kRm, true},
    {R::kDecode, 5, 256, 512, kNv, kT, true},
    {R::kDecode, 40, 96, 176, kNv, kRm, true},
    // The fused prefill kernel on the decode layout: one 128 x 128 tile, M and N ragged against
    // it, K not a multiple of 128, MXFP4, a transposed source, a real layer.
    {R::kFused, 128, 128, 128, kNv, kRm, true},
    {R::kFused, 17, 300, 1040, kNv, kRm, true},
    {R::kFused, 200, 96, 176, kNv, kRm, true},
    {R::kFused, 130, 264, 544, kMx, kRm, true},
    {R::kFused, 100, 256, 512, kNv, kT, true},
    {R::kFused, 4096, 1024, 2048, kNv, kRm, true},
    // Dequantize → cuBLASLt BF16 (forced; skipped where the backend has no dense GEMM).
    {R::kDequant, 64, 128, 256},
    {R::kDequant, 200, 300, 1040},
    {R::kDequant, 130, 264, 544, kMx},
    {R::kDequant, 4096, 1024, 2048},
};

HostQuantWeights random_weights(const Case& c, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(c.n * c.k));
  for (float& x : v) x = d(rng);
  HostQuantWeights w =
      c.format == WeightFormat::kNvfp4 ? quantize_nvfp4(v, c.n, c.k) : quantize_mxfp4(v, c.n, c.k);
  return c.layout == WeightLayout::kRowMajor ? w : with_layout(w, c.layout);
}

// C = A·Wᵀ on `b`, C poisoned with NaN first.
std::vector<std::uint16_t> run_on(Backend& b, const Case& c, const std::vector<std::uint16_t>& a,
                                  const HostQuantWeights& hw, bool packed) {
  ops::QuantWeights w =
      ops::upload_weights(b, hw, packed ? ops::UploadLayout::kDecode : ops::UploadLayout::kSource);
  const std::size_t mn = static_cast<std::size_t>(c.m * c.n);
  const DevicePtr da = b.alloc(a.size() * 2), dc = b.alloc(mn * 2);
  b.copy_h2d(da, a.data(), a.size() * 2);
  b.memset(dc, 0xFF, mn * 2);
  ops::GemmOptions opt;
  opt.route = c.route;
  if (c.route == R::kE4m3) opt.activations = ops::Activations::kAllowE4m3;
  ops::w4a16_gemm(b, b.default_stream(), da, c.m, w, dc, opt);
  b.synchronize(b.default_stream());
  std::vector<std::uint16_t> out(mn);
  b.copy_d2h(out.data(), dc, mn * 2);
  b.free(dc);
  b.free(da);
  ops::free_weights(b, w);
  return out;
}

// "a..b" runs of the sorted set, at most `most` of them.
std::string runs(const std::set<std::int64_t>& s, int most = 12) {
  std::string out;
  int shown = 0;
  for (auto it = s.begin(); it != s.end() && shown < most; ++shown) {
    std::int64_t lo = *it, hi = lo;
    while (++it != s.end() && *it == hi + 1) ++hi;
    out += lo == hi ? fmt::format("{} ", lo) : fmt::format("{}..{} ", lo, hi);
  }
  return shown == most ? out + "…" : out;
}

// Record: route, m, n, k, format, layout (6 × int64), tensor scale (f32), then A (bf16 M·K),
// codes, scales, the GPU's C and the CPU's C (bf16 M·N each), each preceded by its byte count.
void write_case(std::ofstream& f, const Case& c, const std::vector<std::uint16_t>& a,
                const HostQuantWeights& w, const std::vector<std::uint16_t>& gpu,
                const std::vector<std::uint16_t>& cpu) {
  const std::int64_t head[] = {
      static_cast<std::int64_t>(c.route), c.m, c.n, c.k, static_cast<std::int64_t>(c.format),
      static_cast<std::int64_t>(c.layout)};
  f.write(reinterpret_cast<const char*>(head), sizeof head);
  f.write(reinterpret_cast<const char*>(&w.tensor_scale), 4);
  const auto blob = [&f](const void* p, std::size_t bytes) {
    const std::uint64_t n = bytes;
    f.write(reinterpret_cast<const char*>(&n), 8);
    f.write(static_cast<const char*>(p), static_cast<std::streamsize>(bytes));
  };
  blob(a.data(), a.size() * 2);
  blob(w.codes.data(), w.codes.size());
  blob(w.scales.data(), w.scales.size());
  blob(gpu.data(), gpu.size() * 2);
  blob(cpu.data(), cpu.size() * 2);
}

// Compares one case; returns whether it matched.
bool probe(Backend& gpu, Backend& cpu, const Case& c, std::mt19937_64& rng, std::ofstream* dump) {
  const HostQuantWeights w = random_weights(c, rng);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<std::uint16_t> a(static_cast<std::size_t>(c.m * c.k));
  for (auto& x : a) x = num::f32_to_bf16(u(rng));
  // The reference runs on the source layout: the fused route's reads the decode layout, so the
  // CPU computes its case on the tiled route (both exact BF16).
  Case ref = c;
  if (c.route == R::kFused) ref.route = R::kTiled;
  const std::vector<std::uint16_t> got = run_on(gpu, c, a, w, c.packed),
                                   want = run_on(cpu, ref, a, w, false);

  double num = 0, den = 0, rms = 0;
  for (const std::uint16_t v : want) rms += std::pow(num::bf16_to_f32(v), 2);
  rms = std::sqrt(rms / static_cast<double>(want.size()));
  std::set<std::int64_t> rows, cols;
  std::int64_t bad = 0, unwritten = 0;
  std::string first;
  for (std::int64_t i = 0; i < c.m * c.n; ++i) {
    const double g = num::bf16_to_f32(got[static_cast<std::size_t>(i)]);
    const double r = num::bf16_to_f32(want[static_cast<std::size_t>(i)]);
    const bool nan = std::isnan(g);
    unwritten += nan;
    if (!nan) num += (g - r) * (g - r);
    den += r * r;
    // An output is wrong when it is unwritten or off by more than 2% of the larger of itself and
    // the output's RMS (BF16 rounding and the order of summation stay far below that).
    if (nan || std::abs(g - r) > 0.02 * std::max(std::abs(r), rms)) {
      ++bad;
      rows.insert(i / c.n);
      cols.insert(i % c.n);
      if (bad <= 4) first += fmt::format(" ({},{}) {:.4g} vs {:.4g};", i / c.n, i % c.n, g, r);
    }
  }
  const double err = den > 0 ? std::sqrt(num / den) : 0;
  const std::string route = std::string(ops::to_string(c.route)) + (c.packed ? "-dl" : "");
  fmt::print("{:<9} {} {:<10} M={:<5} N={:<5} K={:<5} err {:.2e} bad {}/{} unwritten {}{}\n", route,
             to_string(c.format), c.layout == WeightLayout::kRowMajor ? "row-major" : "transposed",
             c.m, c.n, c.k, err, bad, c.m * c.n, unwritten, bad ? " WRONG" : "");
  if (bad) {
    fmt::print("   rows {}\n   cols {}\n   first{}\n", runs(rows), runs(cols), first);
    if (dump && c.m * c.n <= (1 << 20)) write_case(*dump, c, a, w, got, want);
  }
  return bad == 0;
}

int run(int argc, char** argv) {
  std::string dir, backend = "cuda";
  bool packed_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--dump" && i + 1 < argc) {
      dir = argv[++i];
    } else if (s == "--decode-layout-only") {  // the decode layout's cases alone
      packed_only = true;
    } else if (s == "--backend" && i + 1 < argc) {  // another backend in place of CUDA (a test)
      backend = argv[++i];
    } else {
      throw Error(ErrorCode::kInvalidArgument, "gemm_gpu_probe",
                  fmt::format("unknown argument '{}' (use --dump DIR, --backend NAME, "
                              "--decode-layout-only)",
                              s));
    }
  }
  auto gpu = create_backend(backend);
  auto cpu = create_backend("cpu");
  std::mt19937_64 rng(std::random_device{}());
  std::ofstream dump;
  if (!dir.empty()) dump.open(dir + "/probe.bin", std::ios::binary);
  fmt::print("device: {}\n", gpu->device_name());
  int wrong = 0, ran = 0;
  for (const Case& c : kCases) {
    if (packed_only && !c.packed) continue;
    if (c.route == R::kDequant) {
      if (const std::string why = gpu->dense_gemm_unavailable(DenseKind::kBf16); !why.empty()) {
        fmt::print("dequant M={} N={} K={}: skipped ({})\n", c.m, c.n, c.k, why);
        continue;
      }
    }
    ++ran;
    try {
      wrong += !probe(*gpu, *cpu, c, rng, dump.is_open() ? &dump : nullptr);
    } catch (const Error& e) {
      // A launch error (or a fault surfacing at the next call) is reported and the rest go on:
      // after a fault the context is lost and later cases say so too.
      fmt::print("{:<7} M={} N={} K={}: ERROR {}\n", ops::to_string(c.route), c.m, c.n, c.k,
                 e.what());
      ++wrong;
    }
  }
  gpu->op_cache().release(*gpu);
  cpu->op_cache().release(*cpu);
  fmt::print("{} of {} cases wrong; live bytes {} ({}) {} (cpu)\n", wrong, ran, gpu->live_bytes(),
             backend, cpu->live_bytes());
  return wrong == 0 && gpu->live_bytes() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    fmt::print(stderr, "gemm_gpu_probe: {}\n", e.what());
    return 2;
  }
}
