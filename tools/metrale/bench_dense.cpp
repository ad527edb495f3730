#include "bench_dense.h"

#include <fmt/format.h>

#include "metrale/dense_gemm.h"
#include "metrale/ops/gemm.h"
#include "toolkit/rotation.h"
#include "toolkit/sampled_check.h"

namespace metrale::cli {

bool bench_dense_layers(ModelScope& scope, const std::vector<DenseLayer>& layers,
                        const std::vector<std::int64_t>& ms, const LayerBenchRun& run,
                        std::mt19937_64& rng, std::vector<Case>& cases) {
  Backend& b = scope.backend();
  std::vector<std::vector<DevicePtr>> rotation;
  std::size_t copies = 1;
  for (std::size_t r = 0; r < copies; ++r) {
    std::vector<DevicePtr> copy;
    std::size_t block_bytes = 0;
    for (const DenseLayer& l : layers) {
      const std::string label = r == 0 ? fmt::format("bf16 weights {}", l.name)
                                       : fmt::format("bf16 weights {} (copy {})", l.name, r);
      copy.push_back(scope.alloc_buffer(label, l.w.size() * 2));
      b.copy_h2d(copy.back(), l.w.data(), l.w.size() * 2);
      block_bytes += l.w.size() * 2;
    }
    if (r == 0) copies = toolkit::rotation_copies(block_bytes);
    rotation.push_back(std::move(copy));
  }
  bool ok = true;
  for (const std::int64_t m : ms) {
    std::vector<DenseGemmPlan> plans;
    std::vector<DevicePtr> workspaces;
    std::vector<std::size_t> timed, case_of(layers.size());
    const auto queue = [&](std::size_t r, std::size_t li) {
      DenseGemmArgs args;
      args.a = run.a;
      args.b = rotation[r][li];
      args.c = run.c;
      args.workspace = workspaces[li];
      args.workspace_bytes = plans[li].workspace_bytes;
      b.run_dense_gemm(plans[li], args, run.stream);
    };
    for (std::size_t li = 0; li < layers.size(); ++li) {
      const DenseLayer& l = layers[li];
      plans.push_back(b.plan_dense_gemm(DenseGemmShape{DenseKind::kBf16, m, l.n, l.k}));
      workspaces.push_back(
          plans.back().workspace_bytes == 0
              ? DevicePtr{}
              : b.op_cache().scratch(b, ops::gemm_scratch_tag(b, run.stream, "blas_workspace"),
                                     plans.back().workspace_bytes, run.stream));
      Case cs{l.name,
              m,
              l.n,
              l.k,
              "auto",
              "bf16",
              fmt::format("dense bf16 M={} N={} K={}: {} (kept BF16 by the checkpoint)", m, l.n,
                          l.k, plans.back().describe)};
      // Every copy the timing cycles through is checked (toolkit/rotation.h).
      const auto check_copy = [&](std::size_t r, int samples) {
        b.memset(run.c, 0xFF, static_cast<std::size_t>(m * l.n * 2));  // poison: NaN in BF16
        queue(r, li);
        b.synchronize(run.stream);
        std::vector<std::uint16_t> out(static_cast<std::size_t>(m * l.n));
        b.copy_d2h(out.data(), run.c, out.size() * 2);
        return toolkit::sampled_check_dense_bf16(run.ha.first(static_cast<std::size_t>(m * l.k)),
                                                 out, l.w, l.n, l.k, m, rng, samples);
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
    const auto t = time_in_turns(b, run.stream, rotation.size(), layers.size(), timed, queue,
                                 run.graph, run.repeats);
    for (const std::size_t li : timed) {
      set_rates(cases[case_of[li]], median(t[li]), static_cast<double>(layers[li].w.size() * 2),
                run.peak_flops);
    }
  }
  return ok;
}

}  // namespace metrale::cli
