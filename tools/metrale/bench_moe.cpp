// `metrale bench --moe MODEL`: one MoE layer's grouped GEMMs (gate_up and down, every expert in
// one launch, ops/grouped_gemm.h) at realistic routings, against the roofs measured in the same
// run. A layer reads only the experts tokens were routed to, so its rate is the bytes of the
// experts touched (codes and scales, plus A and C) per second, and its share is of the read roof;
// from 16 rows an expert the dot products set the pace, and the share of the compute roof is
// given too. At one token the routings are disjoint (the experts in a random order, top_k at a
// time), so a cycle over them reads every expert once; above, routings are drawn with expert e
// weighted (e + 1)^-skew (skew 0 uniform, 1.2 a popular few). The experts are uploaded in copies
// until a cycle reads 1 GiB (256 MiB on a GPU), and consecutive runs read other copies, so no run
// finds its experts in the caches. Each expert holds weights of its own (one draw, its rows turned
// by the expert's index), and each case is checked against float64 on every touched expert's rows
// of one routing before it is timed.
#include "bench_moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "interrupt.h"
#include "metrale/error.h"
#include "metrale/model_scope.h"
#include "metrale/numerics.h"
#include "metrale/ops/grouped_fp8.h"
#include "metrale/ops/grouped_gemm.h"
#include "metrale/runtime.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/moe_routing.h"
#include "toolkit/random_weights.h"
#include "toolkit/roof_share.h"
#include "toolkit/roofline.h"
#include "toolkit/sampled_check.h"
#include "toolkit/w8a8_reference.h"

namespace metrale::cli {
namespace {

// A cycle over the copies reads at least this much: past the CPU's caches (this VM reports a
// 480 MiB L3) and many times a GPU's L2 (50 MiB on an H100).
constexpr std::int64_t kMinCycleBytes = std::int64_t{1} << 30;
constexpr std::int64_t kMinCycleBytesGpu = std::int64_t{256} << 20;
constexpr std::int64_t kMaxTokens = 65536;

// Device buffers of one case, freed when it ends however it ends.
class CaseBuffers {
 public:
  explicit CaseBuffers(Backend& b) : b_(b) {}
  CaseBuffers(const CaseBuffers&) = delete;
  CaseBuffers& operator=(const CaseBuffers&) = delete;
  ~CaseBuffers() {
    for (const DevicePtr p : owned_) {
      try {
        b_.free(p);
      } catch (const std::exception&) {
        // The teardown's sweep reports what a failed free left.
      }
    }
  }
  DevicePtr alloc(std::size_t bytes) {
    owned_.push_back(b_.alloc(std::max<std::size_t>(bytes, 16)));
    return owned_.back();
  }

 private:
  Backend& b_;
  std::vector<DevicePtr> owned_;
};

// Expert e: `one` with its rows turned by e (codes and scales alike), so every expert holds other
// weights at no cost of drawing them, and a kernel that reads another expert's weights fails the
// check.
HostQuantWeights expert_of(const HostQuantWeights& one, int e) {
  HostQuantWeights w = one;
  const auto turn = static_cast<std::size_t>(e % one.n);
  // Row-major [N, ...] byte tables turned by `turn` rows: codes, scales, INT4's zero points.
  const auto rotate_rows = [&](std::vector<std::uint8_t>& v) {
    const std::size_t row = v.size() / static_cast<std::size_t>(w.n);
    std::rotate(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(turn * row), v.end());
  };
  rotate_rows(w.codes);
  rotate_rows(w.scales);
  if (!w.zeros.empty()) rotate_rows(w.zeros);
  return w;
}
constexpr int kRoutings = 8;
// FP8 experts: this many distinct ones (each `one` turned by a multiple of 128 rows, so its block
// scales turn with it), expert e the (e mod kFp8Distinct)-th: E copies of DeepSeek-V3's 29 MB
// gate_up would not fit a small machine's memory twice (host and CPU backend). A kernel that reads
// a neighbouring expert's weights still fails the check.
constexpr int kFp8Distinct = 8;

HostE4m3BlockWeights fp8_expert_of(const HostE4m3BlockWeights& one, int e) {
  HostE4m3BlockWeights w = one;
  const std::int64_t blocks = e4m3_blocks(one.n);
  const auto turn = static_cast<std::size_t>(e % blocks);
  const std::size_t code_rows = 128 * turn;  // turn < ceil(N/128): inside the rows
  std::rotate(w.codes.begin(), w.codes.begin() + static_cast<std::ptrdiff_t>(code_rows * w.k),
              w.codes.end());
  // Block rows turn with the code rows when N is whole blocks; otherwise the last block is short,
  // and the scales turn on their own (still other weights for each expert).
  std::rotate(w.scales.begin(),
              w.scales.begin() +
                  static_cast<std::ptrdiff_t>(turn * static_cast<std::size_t>(e4m3_blocks(one.k))),
              w.scales.end());
  return w;
}

// One projection's experts in copies, of either kind: the host weights the check reads, the
// uploaded copies, and the bytes one expert reads.
struct LayerWeights {
  std::vector<HostQuantWeights> host;       // 4-bit: one per expert
  std::vector<HostE4m3BlockWeights> host8;  // FP8: kFp8Distinct of them
  std::vector<const ops::GroupedWeights*> q;
  std::vector<const ops::GroupedFp8Weights*> f;
  std::int64_t expert_bytes = 0;
  std::size_t copies() const { return q.empty() ? f.size() : q.size(); }
};

// A routing with its counts and offsets on the device.
struct Routing : toolkit::MoeRoutingCounts {
  DevicePtr d_counts, d_offsets;
};

struct MoeCase {
  std::string layer;
  std::int64_t tokens = 0, n = 0, k = 0;
  double skew = 0;
  double touched = 0;  // experts with rows, per run
  double seconds = 0;  // per run, median
  double gbps = 0, tflops = 0, rows_per_expert = 0;
  bool passed = false;
  std::string check;
  std::string kernel;  // the grouped GEMM's kernel, as planned
};

}  // namespace

std::string MoeModel::format_name() const {
  return fp8 ? std::string("e4m3_block128") : std::string(to_string(format));
}

MoeModel moe_model(const std::string& name) {
  if (name == "gpt-oss-20b") return {name, 32, 4, 2880, 2880, WeightFormat::kMxfp4};
  if (name == "gpt-oss-120b") return {name, 128, 4, 2880, 2880, WeightFormat::kMxfp4};
  if (name == "qwen3-30b-a3b") return {name, 128, 8, 2048, 768, WeightFormat::kNvfp4};
  // Qwen's GPTQ-Int4 release: INT4 experts in groups of 128 with FP16 scales.
  if (name == "qwen3-30b-a3b-int4") return {name, 128, 8, 2048, 768, WeightFormat::kInt4};
  if (name == "deepseek-v3") return {name, 256, 8, 7168, 2048, WeightFormat::kNvfp4};
  if (name == "qwen3-30b-a3b-fp8") return {name, 128, 8, 2048, 768, WeightFormat::kNvfp4, true};
  if (name == "deepseek-v3-fp8") return {name, 256, 8, 7168, 2048, WeightFormat::kNvfp4, true};
  throw Error(ErrorCode::kInvalidArgument, "bench",
              fmt::format("unknown MoE model '{}' (gpt-oss-20b, gpt-oss-120b, qwen3-30b-a3b, "
                          "qwen3-30b-a3b-int4, deepseek-v3, qwen3-30b-a3b-fp8 or deepseek-v3-fp8)",
                          name));
}

int run_bench_moe(const CommonOptions& options, const BenchOptions& bench) {
  const InterruptScope ctrl_c;
  const MoeModel model = moe_model(bench.moe);
  const ops::GemmRoute route = bench.moe_route == "fused"    ? ops::GemmRoute::kFused
                               : bench.moe_route == "tiled"  ? ops::GemmRoute::kTiled
                               : bench.moe_route == "decode" ? ops::GemmRoute::kDecode
                                                             : ops::GemmRoute::kAuto;
  if (model.fp8 && route == ops::GemmRoute::kFused) {
    throw Error(ErrorCode::kInvalidArgument, "bench",
                fmt::format("--moe-route fused is for 4-bit experts; {} has FP8 experts (auto, "
                            "decode or tiled)",
                            model.name));
  }
  if (!model.fp8 && route == ops::GemmRoute::kTiled) {
    throw Error(ErrorCode::kInvalidArgument, "bench",
                fmt::format("--moe-route tiled is for FP8 experts; {} has 4-bit experts (auto, "
                            "decode or fused)",
                            model.name));
  }
  std::string why;
  std::unique_ptr<Backend> backend = create_backend(options.backend, &why);
  const bool gpu = backend->name() != "cpu";
  if (gpu && !bench.allow_unverified) {
    throw Error(ErrorCode::kUnavailable, "bench",
                "--moe on CUDA runs the grouped GEMMs no device run has verified yet; pass "
                "--allow-unverified to run them");
  }
  std::vector<std::int64_t> ms = bench.ms;
  if (ms.empty())
    ms = gpu ? std::vector<std::int64_t>{1, 16, 128} : std::vector<std::int64_t>{1, 16};
  for (const std::int64_t m : ms) {
    if (m < 1 || m > kMaxTokens) {
      throw Error(ErrorCode::kInvalidArgument, "bench",
                  fmt::format("M = {} must be in [1, {}] tokens", m, kMaxTokens));
    }
  }
  const std::string backend_name(backend->name()), device = backend->device_name();
  const LedgerProbe probe = backend->ledger_probe();
  ModelScope scope(std::move(backend));
  Backend& b = scope.backend();
  const toolkit::Roofline roof = toolkit::measure_roofline(b);
  std::mt19937_64 rng(std::random_device{}());
  const StreamHandle stream = b.default_stream();
  ops::GroupedGemmOptions go;
  go.allow_unverified = bench.allow_unverified;
  go.route = route;
  ops::GroupedFp8Options go8;
  go8.allow_unverified = bench.allow_unverified;
  go8.route = route;

  struct Layer {
    const char* name;
    std::int64_t n, k;
  };
  const Layer layers[] = {{"gate_up", 2 * model.inter, model.hidden},
                          {"down", model.hidden, model.inter}};
  std::vector<MoeCase> cases;
  bool ok = true;
  for (const Layer& layer : layers) {
    if (interrupted()) break;
    // One expert's random weights, turned by its index for each expert (expert_of): E experts'
    // work and bytes, each its own, without drawing E sets.
    LayerWeights lw;
    std::vector<E4m3BlockWeightsView> views;
    if (model.fp8) {
      const HostE4m3BlockWeights one = toolkit::random_e4m3_weights(layer.n, layer.k, rng);
      for (int e = 0; e < kFp8Distinct; ++e) lw.host8.push_back(fp8_expert_of(one, e));
      for (int e = 0; e < model.experts; ++e) views.push_back(lw.host8[e % kFp8Distinct].view());
      lw.expert_bytes = static_cast<std::int64_t>(one.codes.size() + 4 * one.scales.size());
    } else {
      const HostQuantWeights one =
          model.format == WeightFormat::kInt4
              ? toolkit::random_int4_weights(layer.n, layer.k, 128, false, rng)
              : toolkit::random_weights(model.format, layer.n, layer.k, rng);
      for (int e = 0; e < model.experts; ++e) lw.host.push_back(expert_of(one, e));
      lw.expert_bytes =
          static_cast<std::int64_t>(one.codes.size() + one.scales.size() + one.zeros.size());
    }
    const std::int64_t expert_bytes = lw.expert_bytes;
    const std::int64_t copies = std::max<std::int64_t>(
        1, (gpu ? kMinCycleBytesGpu : kMinCycleBytes) / (model.experts * expert_bytes));
    for (std::int64_t c = 0; c < copies; ++c) {
      const std::string label = fmt::format("{} {} copy {}", model.name, layer.name, c);
      if (model.fp8) {
        lw.f.push_back(&scope
                            .add(std::make_unique<ops::GroupedFp8WeightsResource>(
                                b, views, label, ops::UploadLayout::kBackendPreferred))
                            .weights());
      } else {
        lw.q.push_back(&scope
                            .add(std::make_unique<ops::GroupedWeightsResource>(
                                b, lw.host, label,
                                // The fused kernels' layout; and CUDA reads INT4 only in the INT4
                                // decode layout, which no device run has verified (so no
                                // preference takes it).
                                go.route == ops::GemmRoute::kFused ||
                                        (gpu && model.format == WeightFormat::kInt4)
                                    ? ops::UploadLayout::kDecode
                                    : ops::UploadLayout::kBackendPreferred))
                            .weights());
      }
      // The route asked for, planned on the first copy before the others upload: a backend
      // without it refuses by name now, not after a cycle's worth of copies.
      if (c == 0) {
        const std::int64_t rows = ms.front() * model.top_k;
        if (model.fp8) {
          (void)ops::plan_grouped(b, rows, *lw.f[0], go8);
        } else {
          (void)ops::plan_grouped(b, rows, *lw.q[0], go);
        }
      }
    }
    for (const std::int64_t tokens : ms) {
      for (const double skew : tokens == 1 ? std::vector<double>{0.0} : bench.skews) {
        if (interrupted()) break;
        MoeCase cs;
        cs.layer = layer.name;
        cs.tokens = tokens;
        cs.n = layer.n;
        cs.k = layer.k;
        cs.skew = skew;
        std::vector<Routing> rs;
        for (toolkit::MoeRoutingCounts& r :
             toolkit::moe_routings(rng, tokens, model.experts, model.top_k, skew, kRoutings)) {
          rs.push_back({std::move(r), {}, {}});
        }
        const std::int64_t rows = tokens * model.top_k;
        CaseBuffers buffers(b);
        const auto upload = [&](const auto& v) {
          const DevicePtr d = buffers.alloc(v.size() * sizeof(v[0]));
          b.copy_h2d(d, v.data(), v.size() * sizeof(v[0]));
          return d;
        };
        for (Routing& r : rs) {
          r.d_counts = upload(r.counts);
          r.d_offsets = upload(r.offsets);
        }
        std::vector<std::uint16_t> a(static_cast<std::size_t>(rows * layer.k));
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        for (auto& x : a) x = num::f32_to_bf16(unit(rng));
        const DevicePtr da = upload(a);
        const DevicePtr dc = buffers.alloc(static_cast<std::size_t>(rows * layer.n) * 2);
        ops::GroupedGemmPlan plan;
        ops::GroupedFp8Plan plan8;
        ops::Fp8Workspace ws8;
        ops::GroupedGemmWorkspace ws;
        if (model.fp8) {
          plan8 = ops::plan_grouped(b, rows, *lw.f[0], go8);
          ws8 = ops::scratch_workspace(plan8, stream);
          cs.kernel = b.kernel_name(plan8.gemm.kernel);
        } else {
          plan = ops::plan_grouped(b, rows, *lw.q[0], go);
          ws = ops::scratch_workspace(plan, stream);
          // The split of K where the plan makes one (CUDA's decode kernels), so the figures say
          // which path they timed.
          cs.kernel = b.kernel_name(plan.launch.kernel) +
                      (plan.splits > 1 ? fmt::format(" / {} K slices", plan.splits) : "");
        }
        // Run i: copy i mod W, routing (i / W) mod R. The copy changes from one run to the next,
        // so a skewed routing's popular experts are not found in the caches by the next run.
        const auto run = [&](std::size_t i) {
          const Routing& r = rs[i / lw.copies() % rs.size()];
          if (model.fp8) {
            ops::run_grouped(plan8, stream, da, *lw.f[i % lw.copies()], r.d_counts, r.d_offsets, dc,
                             ws8);
          } else {
            ops::run_grouped(plan, stream, da, *lw.q[i % lw.copies()], r.d_counts, r.d_offsets, dc,
                             ws);
          }
        };
        // The check: routing 0's every touched expert against float64 on its own rows.
        run(0);
        b.synchronize(stream);
        std::vector<std::uint16_t> c(static_cast<std::size_t>(rows * layer.n));
        b.copy_d2h(c.data(), dc, c.size() * 2);
        cs.passed = true;
        for (int e = 0; e < model.experts && cs.passed; ++e) {
          const std::int64_t count = rs[0].counts[static_cast<std::size_t>(e)];
          if (count == 0) continue;
          const auto first = static_cast<std::size_t>(rs[0].offsets[static_cast<std::size_t>(e)]);
          const auto a_e =
              std::span(a).subspan(first * layer.k, static_cast<std::size_t>(count * layer.k));
          const auto c_e =
              std::span(c).subspan(first * layer.n, static_cast<std::size_t>(count * layer.n));
          // The CUDA decode kernel scales each 16-K share of a block (two more FP32 roundings
          // each); the tiled one sums a block on the FP8 tensor cores, four chained k32 MMAs
          // (tests/ops/grouped_fp8_test.cpp's allowance for them).
          const double share_term = !gpu ? 0.0
                                    : plan8.route == ops::GemmRoute::kTiled
                                        ? 4 * 2 * toolkit::kFp8MmaTerm
                                        : 2.0 * static_cast<double>(layer.k / 16) * 0x1p-23;
          const toolkit::SampledCheck s =
              model.fp8 ? toolkit::sampled_check_w8a8(a_e, c_e, lw.host8[e % kFp8Distinct].view(),
                                                      count, share_term, rng, nullptr, 32)
                        : toolkit::sampled_check(
                              a_e, c_e, lw.host[static_cast<std::size_t>(e)], count,
                              // The fused INT4 kernel rounds each weight once (the dequant route's
                              // rounding, toolkit::gemm_tolerance); the others round none.
                              gpu && plan.route == ops::GemmRoute::kFused ? ops::GemmRoute::kFused
                              : count <= 16                               ? ops::GemmRoute::kDecode
                                                                          : ops::GemmRoute::kTiled,
                              rng, 32);
          cs.passed = s.passed();
          if (!cs.passed) cs.check = fmt::format("expert {}: {}", e, s.str());
        }
        ok = ok && cs.passed;
        // The timing: a cycle over every routing of every copy, bench.repeats times; the median
        // run. (One warm cycle first.)
        const std::size_t cycle = rs.size() * lw.copies();
        for (std::size_t i = 0; i < cycle; ++i) run(i);
        b.synchronize(stream);
        std::vector<double> per_run;
        for (int rep = 0; rep < bench.repeats && !interrupted(); ++rep) {
          const auto t0 = std::chrono::steady_clock::now();
          for (std::size_t i = 0; i < cycle; ++i) run(i);
          b.synchronize(stream);
          per_run.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
              static_cast<double>(cycle));
        }
        if (!per_run.empty()) {
          std::sort(per_run.begin(), per_run.end());
          cs.seconds = per_run[per_run.size() / 2];
          double touched = 0;
          for (const Routing& r : rs) touched += r.touched;
          cs.touched = touched / static_cast<double>(rs.size());
          const double io = static_cast<double>(rows * (layer.k + layer.n) * 2);
          cs.gbps = (cs.touched * static_cast<double>(expert_bytes) + io) / cs.seconds / 1e9;
          cs.tflops = 2.0 * static_cast<double>(rows * layer.n * layer.k) / cs.seconds / 1e12;
          cs.rows_per_expert = static_cast<double>(rows) / cs.touched;
        }
        cases.push_back(std::move(cs));
      }
    }
  }
  const TeardownReport td = scope.teardown();
  const bool zero = probe.live_bytes() == 0 && td.clean();
  ok = ok && zero;
  if (interrupted()) {
    fmt::print(stderr, "metrale bench: interrupted after {} case(s); teardown {}\n", cases.size(),
               zero ? "left 0 bytes" : "not clean: " + td.leak_summary());
    return kInterrupted;
  }
  const auto pct = [](double rate, double of) {
    return of > 0 ? fmt::format("{:.0f}%", 100.0 * rate / of) : std::string("-");
  };
  if (options.json) {
    nlohmann::json doc{{"backend", backend_name},
                       {"device", device},
                       {"moe", model.name},
                       {"experts", model.experts},
                       {"top_k", model.top_k},
                       {"format", model.format_name()},
                       {"roofline",
                        {{"bandwidth_GBps", roof.bandwidth / 1e9},
                         {"bandwidth_of", roof.bandwidth_of},
                         {"TFLOPs", roof.flops / 1e12},
                         {"flops_of", roof.flops_of}}},
                       {"teardown_clean", zero},
                       {"passed", ok},
                       {"cases", nlohmann::json::array()}};
    for (const MoeCase& cs : cases) {
      doc["cases"].push_back(
          {{"layer", cs.layer},
           {"tokens", cs.tokens},
           {"n", cs.n},
           {"k", cs.k},
           {"skew", cs.skew},
           {"experts_touched", cs.touched},
           {"rows_per_expert", cs.rows_per_expert},
           {"seconds", cs.seconds},
           {"touched_GBps", cs.gbps},
           {"TFLOPs", cs.tflops},
           {"pct_read_roof", roof.bandwidth > 0 ? 100 * cs.gbps * 1e9 / roof.bandwidth : 0},
           {"kernel", cs.kernel},
           {"passed", cs.passed},
           {"check", cs.check}});
    }
    fmt::print("{}\n", doc.dump(2));
    return ok ? 0 : 1;
  }
  fmt::print(
      "metrale bench --moe {}: {} experts, top {}, hidden {}, expert intermediate {}, {} "
      "(random weights), on {} ({})\n",
      model.name, model.experts, model.top_k, model.hidden, model.inter, model.format_name(),
      backend_name, device);
  fmt::print("  roofs measured now: {:.1f} GB/s ({}); {}\n", roof.bandwidth / 1e9,
             roof.bandwidth_of,
             roof.flops > 0 ? fmt::format("{:.3f} TFLOP/s ({})", roof.flops / 1e12, roof.flops_of)
                            : roof.flops_of);
  fmt::print(
      "  rate: bytes of the experts touched (and A, C) per second; dot roof share from "
      "16 rows an expert\n\n");
  fmt::print("{:<8} {:>6} {:>5} {:>8} {:>9} {:>10} {:>10} {:>6} {:>9} {:>6}  {:<6} {}\n", "layer",
             "tokens", "skew", "experts", "rows/exp", "ms", "GB/s", "read", "TFLOP/s", "dot",
             "check", "kernel");
  for (const MoeCase& cs : cases) {
    fmt::print(
        "{:<8} {:>6} {:>5.1f} {:>8.1f} {:>9.1f} {:>10} {:>10.1f} {:>6} {:>9.3f} {:>6}  {:<6} {}\n",
        cs.layer, cs.tokens, cs.skew, cs.touched, cs.rows_per_expert,
        toolkit::format_ms(cs.seconds), cs.gbps, pct(cs.gbps * 1e9, roof.bandwidth), cs.tflops,
        cs.rows_per_expert >= 16 ? pct(cs.tflops * 1e12, roof.flops) : std::string("-"),
        cs.passed ? std::string("ok") : "WRONG " + cs.check, cs.kernel);
  }
  fmt::print("\nteardown: {} resource(s) released, {} swept, {} live bytes on the ledger{}\n",
             td.released, td.swept, probe.live_bytes(), zero ? "" : " — FAILED");
  return ok ? 0 : 1;
}

}  // namespace metrale::cli
