#include "sampled_check.h"

#include <cmath>

#include "metrale/numerics.h"

namespace metrale::cli {

double sampled_error(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& c,
                     const HostQuantWeights& w, std::int64_t m, bool e4m3_activations,
                     std::mt19937_64& rng) {
  std::uniform_int_distribution<std::int64_t> pick_m(0, m - 1), pick_n(0, w.n - 1);
  double num = 0, den = 0;
  for (int s = 0; s < 96; ++s) {
    const std::int64_t i = pick_m(rng), j = pick_n(rng);
    double ref = 0;
    for (std::int64_t kk = 0; kk < w.k; ++kk) {
      const std::uint16_t x = a[i * w.k + kk];
      const float av =
          e4m3_activations ? num::e4m3_to_f32(num::bf16_to_e4m3(x)) : num::bf16_to_f32(x);
      ref += static_cast<double>(av) * w.weight(j, kk);
    }
    const double got = num::bf16_to_f32(c[i * w.n + j]);
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  return den > 0 ? std::sqrt(num / den) : INFINITY;
}

}  // namespace metrale::cli
