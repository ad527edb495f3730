// w4a16_gemm on a CUDA GPU next to the device's own figures measured in the same run: its
// device-to-device copy bandwidth (bytes read + written, measured first) and cuBLASLt's BF16 GEMM
// on the same shape (for M >= 64). Each case is checked on sampled outputs against a float64
// reference before it is timed, then timed as a CUDA graph of R back-to-back GEMMs so that the
// host's launch rate does not hide the kernel's time. Output: a table, and with --json FILE one
// JSON object per case (scripts/device-check.sh reads it for its summary). INT4 rows follow the
// FP4 ones (run_int4). Method: docs/PERF.md.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "metrale/error.h"
#include "metrale/numerics.h"
#include "metrale/op_cache.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "metrale/runtime.h"
#include "toolkit/blas_roof.h"
#include "toolkit/random_weights.h"
#include "toolkit/roofline.h"
#include "toolkit/rotation.h"
#include "toolkit/sampled_check.h"

namespace {

using namespace metrale;
using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  std::int64_t n, k;
};

// Llama-3 8B and 70B linear layers (N x K), issue 5's shapes.
constexpr Shape kShapes[] = {{"8b.qkv", 6144, 4096},       {"8b.o", 4096, 4096},
                             {"8b.gate_up", 28672, 4096},  {"8b.down", 4096, 14336},
                             {"70b.qkv", 10240, 8192},     {"70b.o", 8192, 8192},
                             {"70b.gate_up", 57344, 8192}, {"70b.down", 8192, 28672}};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Seconds per call of `op` (which queues work on `stream`), timed as replays of a graph of `reps`
// calls: the median of 5 replays after one warm-up, divided by reps. Each replay is timed by a
// pair of timing events around it on the stream, so the host's wake-up after the synchronize is
// not in the time.
template <class Op>
double time_graph(Backend& b, StreamHandle stream, int reps, Op op) {
  b.begin_capture(stream);
  for (int r = 0; r < reps; ++r) op();
  const GraphHandle g = b.end_capture(stream);
  b.launch_graph(g, stream);
  b.synchronize(stream);
  const EventHandle start = b.create_timing_event(), end = b.create_timing_event();
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    b.record_event(start, stream);
    b.launch_graph(g, stream);
    b.record_event(end, stream);
    b.synchronize(stream);
    t.push_back(b.event_elapsed_ms(start, end) / 1e3);
  }
  b.destroy_event(start);
  b.destroy_event(end);
  b.destroy_graph(g);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2] / reps;
}

// Calls that fill about 20 ms of GPU time, from one synchronized call's time.
int reps_for(Backend& b, StreamHandle stream, const auto& op) {
  op();
  b.synchronize(stream);
  const auto t0 = Clock::now();
  op();
  b.synchronize(stream);
  const double once = seconds_since(t0);
  return std::clamp(static_cast<int>(0.02 / once), 1, 200);
}

struct Args {
  std::vector<std::int64_t> ms = {1, 2, 4, 8, 16, 32, 64, 128, 512, 4096};
  std::string json;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--quick") {
      a.ms = {1, 2, 4, 8, 16, 4096};
    } else if (s == "--json" && i + 1 < argc) {
      a.json = argv[++i];
    } else {
      throw Error(ErrorCode::kInvalidArgument, "gemm_gpu_bench",
                  fmt::format("unknown argument '{}' (use --quick, --json FILE)", s));
    }
  }
  return a;
}

// The case run once into C (poisoned first) and checked on sampled outputs against the reference
// and bounds of `route` in the tests' table (toolkit/gemm_tolerance.h).
template <class Gemm>
toolkit::SampledCheck run_checked(Backend& b, StreamHandle stream, DevicePtr c, std::int64_t m,
                                  std::int64_t n, Gemm& gemm, std::span<const std::uint16_t> ha,
                                  const HostQuantWeights& hw, ops::GemmRoute route,
                                  std::mt19937_64& rng) {
  b.memset(c, 0xFF, static_cast<std::size_t>(m * n) * 2);
  gemm();
  b.synchronize(stream);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(m * n));
  b.copy_d2h(out.data(), c, out.size() * 2);
  return toolkit::sampled_check(ha, out, hw, m, route, rng);
}

// A timed case's fields of its JSON row.
void add_timing(nlohmann::json& row, double s, double bytes, double flops, double copy_bw) {
  row["ok"] = true;
  row["timing"] = "events";
  row["us"] = s * 1e6;
  row["pct_copy"] = 100.0 * bytes / s / copy_bw;
  row["tflops"] = flops / s / 1e12;
}

// INT4 (GPTQ/AWQ-style: groups of 128, zero points, FP16 scales; and with act order) in the
// int4 decode layout, uploaded by name (its kernels are not verified yet): gemm_int4_decode at
// the decode sizes and dequant_int4_bf16 → cuBLASLt above, on the 8B layers and the 70B down
// layer (issue 37's 8192 x 28672), checked on sampled outputs and timed as the FP4 rows. The
// bytes are the INT4 weights' own: half a byte per weight and 3 bytes per group.
bool run_int4(Backend& b, StreamHandle stream, const Args& args, double copy_bw,
              std::ofstream& json, std::mt19937_64& rng) {
  bool ok = true;
  for (const Shape& sh : kShapes) {
    const std::string name = sh.name;
    if (!name.starts_with("8b.") && name != "70b.down") continue;
    for (const bool act : {false, true}) {
      if (act && name != "70b.down") continue;
      const HostQuantWeights hw = toolkit::random_int4_weights(sh.n, sh.k, 128, act, rng);
      std::vector<ops::QuantWeights> set;
      const std::size_t n_copies = toolkit::rotation_copies(hw.codes.size() + hw.scales.size());
      for (std::size_t i = 0; i < n_copies; ++i) {
        set.push_back(ops::upload_weights(b, hw, ops::UploadLayout::kDecode));
      }
      const std::int64_t max_m = *std::max_element(args.ms.begin(), args.ms.end());
      std::vector<std::uint16_t> ha(static_cast<std::size_t>(max_m * sh.k));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (auto& x : ha) x = num::f32_to_bf16(u(rng));
      const DevicePtr a = b.alloc(ha.size() * 2);
      const DevicePtr c = b.alloc(static_cast<std::size_t>(max_m * sh.n) * 2);
      b.copy_h2d(a, ha.data(), ha.size() * 2);
      for (const std::int64_t m : args.ms) {
        if (m > 16 && m != max_m) continue;  // decode sizes, and the largest M's prefill
        std::size_t next = 0;
        const auto gemm = [&] {
          ops::w4a16_gemm(b, stream, a, m, set[next], c, ops::GemmOptions{});
          next = next + 1 == set.size() ? 0 : next + 1;
        };
        const ops::GemmRoute chosen = ops::choose_route(b, m, set.front());
        const toolkit::SampledCheck check =
            run_checked(b, stream, c, m, sh.n, gemm, ha, hw, chosen, rng);
        const std::string route =
            std::string(ops::to_string(chosen)) + "-int4" + (act ? "-act" : "");
        nlohmann::json row = {{"shape", sh.name}, {"m", m},         {"n", sh.n},
                              {"k", sh.k},        {"route", route}, {"error", check.normalized}};
        if (!check.passed()) {
          ok = false;
          fmt::print("{:<12} {:>5} {:<14} WRONG: {}\n", sh.name, m, route, check.str());
          row["ok"] = false;
          if (json) json << row.dump() << "\n";
          continue;
        }
        const double s = time_graph(b, stream, reps_for(b, stream, gemm), gemm);
        const double bytes = static_cast<double>(sh.n * sh.k) / 2.0 +
                             3.0 * static_cast<double>(sh.n * (sh.k / 128)) +
                             2.0 * static_cast<double>(m * sh.k + m * sh.n);
        const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(sh.n * sh.k);
        fmt::print("{:<12} {:>5} {:<14} {:>10.1f} {:>9.0f} {:>6.1f}% {:>9.1f}\n", sh.name, m, route,
                   s * 1e6, bytes / s / 1e9, 100.0 * bytes / s / copy_bw, flops / s / 1e12);
        add_timing(row, s, bytes, flops, copy_bw);
        if (json) json << row.dump() << "\n";
      }
      b.free(c);
      b.free(a);
      for (ops::QuantWeights& w : set) ops::free_weights(b, w);
    }
  }
  return ok;
}

int run(const Args& args) {
  auto backend = create_backend("cuda");
  Backend& b = *backend;
  const StreamHandle stream = b.create_stream();
  std::mt19937_64 rng(std::random_device{}());

  // The copy roof, measured as `metrale bench` measures it (toolkit/roofline.h): eager
  // 1 GiB device-to-device copies, bytes read + written. See Note [copy roof timed eagerly] in
  // docs/NOTES.md.
  const double copy_bw = toolkit::measure_roofline(b).bandwidth;
  fmt::print("device: {}; copy bandwidth {:.0f} GB/s (1 GiB device to device, read + write)\n",
             b.device_name(), copy_bw / 1e9);
  fmt::print("timed with events\n");
  fmt::print("{:<12} {:>5} {:<7} {:>10} {:>9} {:>7} {:>9} {:>10} {:>9}\n", "shape", "M", "route",
             "us", "GB/s", "%copy", "TFLOP/s", "cuBLAS us", "x cuBLAS");

  std::ofstream json;
  if (!args.json.empty()) json.open(args.json);
  const std::int64_t max_m = *std::max_element(args.ms.begin(), args.ms.end());
  bool ok = true;
  for (const Shape& sh : kShapes) {
    const HostQuantWeights hw = toolkit::random_weights(WeightFormat::kNvfp4, sh.n, sh.k, rng);
    // Copies of the weights that the timed calls cycle through (toolkit/rotation.h). See Note
    // [layer rotation] in docs/NOTES.md.
    // Both layouts: decode runs on each, side by side (the decode layout's kernel against
    // today's), where the backend has a decode kernel that reads the decode layout.
    std::vector<ops::QuantWeights> copies, packed;
    const std::size_t n_copies = toolkit::rotation_copies(hw.codes.size() + hw.scales.size());
    const bool pack = ops::reads_decode_layout(b);  // verified on a device or not
    double pack_s = 0;
    for (std::size_t i = 0; i < n_copies; ++i) {
      copies.push_back(ops::upload_weights(b, hw));
      if (!pack) continue;
      const auto t0 = Clock::now();
      packed.push_back(ops::upload_weights(b, hw, ops::UploadLayout::kDecode));
      if (i == 0) pack_s = seconds_since(t0);
    }
    if (pack) {
      fmt::print("{:<12} repack into the decode layout and upload: {:.1f} ms\n", sh.name,
                 pack_s * 1e3);
    }
    std::vector<std::uint16_t> ha(static_cast<std::size_t>(max_m * sh.k));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto& x : ha) x = num::f32_to_bf16(u(rng));
    const DevicePtr a = b.alloc(ha.size() * 2);
    const DevicePtr c = b.alloc(static_cast<std::size_t>(max_m * sh.n) * 2);
    b.copy_h2d(a, ha.data(), ha.size() * 2);
    for (const std::int64_t m : args.ms) {
      // The exact-BF16 route for every M; the E4M3 route too where auto would take it; the
      // decode layout's kernel where decode runs, and its fused prefill kernel above; and the
      // dequant route (dequantize → cuBLASLt BF16) from M = 64 where the backend has cuBLASLt.
      enum class Variant { kExact, kE4m3, kPacked, kFused, kDequant };
      const bool large = m > ops::decode_max_m(b);
      for (const Variant v : {Variant::kExact, Variant::kE4m3, Variant::kPacked, Variant::kFused,
                              Variant::kDequant}) {
        if (v == Variant::kE4m3 && m < ops::kE4m3MinM) continue;
        if (v == Variant::kPacked && (packed.empty() || large)) continue;
        if (v == Variant::kFused && (packed.empty() || !large)) continue;
        if (v == Variant::kDequant &&
            (m < 64 || !b.dense_gemm_unavailable(DenseKind::kBf16).empty() ||
             ops::choose_route(b, m, copies.front()) == ops::GemmRoute::kDequant))
          continue;  // (where auto takes it, the exact row above is this route)
        ops::GemmOptions opt;
        if (v == Variant::kE4m3) opt.activations = ops::Activations::kAllowE4m3;
        if (v == Variant::kFused) opt.route = ops::GemmRoute::kFused;
        if (v == Variant::kDequant) opt.route = ops::GemmRoute::kDequant;
        const std::vector<ops::QuantWeights>& set =
            v == Variant::kPacked || v == Variant::kFused ? packed : copies;
        const ops::QuantWeights& w = set.front();
        std::size_t next = 0;
        const auto gemm = [&] {
          ops::w4a16_gemm(b, stream, a, m, set[next], c, opt);
          next = next + 1 == set.size() ? 0 : next + 1;
        };
        const ops::GemmRoute chosen = ops::choose_route(b, m, w, opt);
        const toolkit::SampledCheck check =
            run_checked(b, stream, c, m, sh.n, gemm, ha, hw, chosen, rng);
        // "decode-dl": the decode route on the decode layout (gemm_decode_packed).
        const std::string route =
            std::string(ops::to_string(chosen)) + (v == Variant::kPacked ? "-dl" : "");
        nlohmann::json row = {{"shape", sh.name}, {"m", m},         {"n", sh.n},
                              {"k", sh.k},        {"route", route}, {"error", check.normalized}};
        if (v == Variant::kPacked) row["pack_ms"] = pack_s * 1e3;
        if (!check.passed()) {
          ok = false;
          fmt::print("{:<12} {:>5} {:<7} WRONG: {}\n", sh.name, m, route, check.str());
          row["ok"] = false;
          if (json) json << row.dump() << "\n";
          continue;
        }
        const double s = time_graph(b, stream, reps_for(b, stream, gemm), gemm);
        // The weights' own bytes in either layout (the decode layout's padding and table are
        // overhead, not work).
        const double bytes = static_cast<double>(hw.codes.size() + hw.scales.size()) +
                             2.0 * static_cast<double>(m * sh.k + m * sh.n);
        const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(sh.n * sh.k);
        double blas_s = 0;
        if (m >= 64 && m % 16 == 0) {
          blas_s = toolkit::measure_bf16_gemm(b, static_cast<int>(m), static_cast<int>(sh.n),
                                              static_cast<int>(sh.k))
                       .seconds;
        }
        fmt::print("{:<12} {:>5} {:<7} {:>10.1f} {:>9.0f} {:>6.1f}% {:>9.1f} {:>10} {:>9}\n",
                   sh.name, m, route, s * 1e6, bytes / s / 1e9, 100.0 * bytes / s / copy_bw,
                   flops / s / 1e12, blas_s > 0 ? fmt::format("{:.1f}", blas_s * 1e6) : "-",
                   blas_s > 0 ? fmt::format("{:.2f}", blas_s / s) : "-");
        add_timing(row, s, bytes, flops, copy_bw);
        row["cublas_us"] = blas_s * 1e6;
        if (json) json << row.dump() << "\n";
      }
    }
    b.free(c);
    b.free(a);
    for (ops::QuantWeights& cw : copies) ops::free_weights(b, cw);
    for (ops::QuantWeights& cw : packed) ops::free_weights(b, cw);
  }
  ok = run_int4(b, stream, args, copy_bw, json, rng) && ok;
  b.destroy_stream(stream);
  b.op_cache().release(b);
  fmt::print("live bytes at the end: {}\n", b.live_bytes());
  return ok && b.live_bytes() == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    fmt::print(stderr, "gemm_gpu_bench: {}\n", e.what());
    return 2;
  }
}
