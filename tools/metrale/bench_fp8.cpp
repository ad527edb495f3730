#include "bench_fp8.h"

#include <fmt/format.h>

#include <memory>

#include "metrale/ops/fp8_gemm.h"
#include "toolkit/gemm_tolerance.h"
#include "toolkit/rotation.h"
#include "toolkit/w8a8_reference.h"

namespace metrale::cli {

bool bench_fp8_layers(ModelScope& scope, const std::vector<Fp8Layer>& layers,
                      const std::vector<std::int64_t>& ms, const LayerBenchRun& run,
                      std::mt19937_64& rng, std::vector<Case>& cases) {
  Backend& b = scope.backend();
  std::vector<std::vector<const ops::Fp8WeightsResource*>> rotation;
  std::size_t copies = 1;
  for (std::size_t r = 0; r < copies; ++r) {
    std::vector<const ops::Fp8WeightsResource*> copy;
    std::size_t block_bytes = 0;
    for (const Fp8Layer& l : layers) {
      const std::span<const std::uint8_t> scales(
          reinterpret_cast<const std::uint8_t*>(l.w.scales.data()), l.w.scales.size_bytes());
      const std::string label = r == 0 ? fmt::format("fp8 weights {}", l.name)
                                       : fmt::format("fp8 weights {} (copy {})", l.name, r);
      copy.push_back(&scope.add(
          std::make_unique<ops::Fp8WeightsResource>(b, l.w.codes, scales, l.w.n, l.w.k, label)));
      block_bytes += copy.back()->weights().codes_bytes + copy.back()->weights().scales_bytes;
    }
    if (r == 0) copies = toolkit::rotation_copies(block_bytes);
    rotation.push_back(std::move(copy));
  }
  // A GPU's FP8 tensor cores: the numerics suite's allowance (tests/ops/fp8_gemm_test.cpp).
  const double mma = b.name() == "cpu" ? 0.0 : 2 * toolkit::kFp8MmaTerm;
  bool ok = true;
  for (const std::int64_t m : ms) {
    std::vector<ops::Fp8GemmPlan> plans;
    std::vector<ops::Fp8Workspace> workspaces;
    std::vector<std::size_t> timed, case_of(layers.size());
    for (std::size_t li = 0; li < layers.size(); ++li) {
      const Fp8Layer& l = layers[li];
      plans.push_back(ops::plan(b, m, rotation.front()[li]->weights(), {}));
      workspaces.push_back(ops::scratch_workspace(plans.back(), run.stream));
      Case cs{l.name, m, l.w.n, l.w.k, "auto", "w8a8", plans.back().describe()};
      // Every copy the timing cycles through is checked (toolkit/rotation.h).
      const auto check_copy = [&](std::size_t r, int samples) {
        b.memset(run.c, 0xFF, static_cast<std::size_t>(m * l.w.n * 2));  // poison: NaN in BF16
        ops::run(plans[li], run.stream, run.a, rotation[r][li]->weights(), run.c, workspaces[li]);
        b.synchronize(run.stream);
        std::vector<std::uint16_t> out(static_cast<std::size_t>(m * l.w.n));
        b.copy_d2h(out.data(), run.c, out.size() * 2);
        return toolkit::sampled_check_w8a8(run.ha.first(static_cast<std::size_t>(m * l.w.k)), out,
                                           l.w, m, mma, rng, nullptr, samples);
      };
      const toolkit::RotationCheck check = toolkit::check_rotation(rotation.size(), check_copy);
      cs.error = check.failed_copy ? check.failed.normalized : check.first.normalized;
      cs.passed = check.passed();
      cs.copies_checked = check.copies;
      if (check.failed_copy) cs.failed_copy = static_cast<std::int64_t>(*check.failed_copy);
      ok = ok && cs.passed;
      if (cs.passed) {
        timed.push_back(li);
        case_of[li] = cases.size();
      }
      cases.push_back(cs);
    }
    if (timed.empty()) continue;
    const auto t = time_in_turns(
        b, run.stream, rotation.size(), layers.size(), timed,
        [&](std::size_t r, std::size_t li) {
          ops::run(plans[li], run.stream, run.a, rotation[r][li]->weights(), run.c, workspaces[li]);
        },
        run.graph, run.repeats);
    for (const std::size_t li : timed) {
      const ops::Fp8Weights& w = rotation.front()[li]->weights();
      set_rates(cases[case_of[li]], median(t[li]),
                static_cast<double>(w.codes_bytes + w.scales_bytes), run.peak_flops);
    }
  }
  return ok;
}

}  // namespace metrale::cli
