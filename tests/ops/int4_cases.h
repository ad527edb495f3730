// INT4 test cases shared by the INT4 GEMM suites (gemm_int4_test.cpp on the source layout,
// gemm_int4_packed_test.cpp on the int4 decode layout): a case's description and its random
// weights.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "ops/gemm_reference.h"

namespace metrale::testing::gemm {

struct Int4Case {
  std::int64_t m = 1, n = 1, k = 32, group = 32;
  bool zero_points = false, fp16 = false, act_order = false, bias = false, out_f32 = false;
  ops::GemmRoute route = ops::GemmRoute::kAuto;

  std::string str() const {
    return fmt::format("M={} N={} K={} group {}{}{}{}{}{} route {}", m, n, k, group,
                       zero_points ? " zero points" : " symmetric",
                       fp16 ? " fp16 scales" : " bf16 scales", act_order ? " act order" : "",
                       bias ? " bias" : "", out_f32 ? " fp32 C" : "", ops::to_string(route));
  }
};

// Weights for c: normal values whose groups are shifted by up to their own spread (so that the
// asymmetric zero points spread over 0..15, not only around 8), quantized in c's groups; with act
// order, the groups are then a random assignment of K's columns (`group` each).
inline HostQuantWeights random_int4(std::mt19937_64& gen, const Int4Case& c) {
  std::vector<float> values = random_weight_values(gen, c.n, c.k);
  std::uniform_real_distribution<float> shift(-1.0f, 1.0f);
  for (std::int64_t r = 0; r < c.n; ++r) {
    for (std::int64_t g0 = 0; g0 < c.k; g0 += c.group) {
      float spread = 0.0f;
      for (std::int64_t j = g0; j < g0 + c.group; ++j) {
        spread = std::max(spread, std::fabs(values[static_cast<std::size_t>(r * c.k + j)]));
      }
      const float s = shift(gen) * spread;
      for (std::int64_t j = g0; j < g0 + c.group; ++j)
        values[static_cast<std::size_t>(r * c.k + j)] += s;
    }
  }
  HostQuantWeights w = quantize_int4(values, c.n, c.k, c.group, c.zero_points, c.fp16);
  if (!c.act_order) return w;
  std::vector<std::int32_t> g_idx(static_cast<std::size_t>(c.k));
  for (std::int64_t k = 0; k < c.k; ++k)
    g_idx[static_cast<std::size_t>(k)] = static_cast<std::int32_t>(k / c.group);
  std::shuffle(g_idx.begin(), g_idx.end(), gen);
  return with_act_order(w, g_idx);
}

// The INT4 suites' fixture: one case on fresh data, uploaded in `layout`, checked against the
// float64 reference with the tolerance of the route it took (toolkit/gemm_tolerance.h), C
// poisoned first and the bytes past it checked untouched.
class Int4GemmTest : public GemmBackendTest {
 protected:
  // Runs c and checks it; returns the route the op took.
  ops::GemmRoute run_case(const Int4Case& c, ops::UploadLayout layout) {
    return run_weights(random_int4(gen(), c), c, layout);
  }

  // The same for given weights (c's M, bias, route and output; A has a_columns(host) columns).
  ops::GemmRoute run_weights(const HostQuantWeights& host, const Int4Case& c,
                             ops::UploadLayout layout) {
    SCOPED_TRACE(c.str());
    const ops::QuantWeights w = upload_weights(host, layout);
    const std::vector<std::uint16_t> a =
        random_activations(gen(), static_cast<std::size_t>(c.m * a_columns(host)));
    const std::vector<std::uint16_t> bias =
        c.bias ? random_bias(gen(), c.n) : std::vector<std::uint16_t>{};
    const auto mn = static_cast<std::size_t>(c.m * c.n);
    const std::size_t elem = c.out_f32 ? 4 : 2;
    const DevicePtr dc = poisoned((mn + kTailElems) * elem);
    ops::GemmOptions options;
    options.route = c.route;
    options.bias = c.bias ? upload(bias) : DevicePtr{};
    options.out_f32 = c.out_f32;
    const ops::GemmRoute taken = ops::choose_route(b(), c.m, w, options);
    ops::w4a16_gemm(b(), stream(), upload(a), c.m, w, dc, options);
    const std::vector<std::uint8_t> bytes = read<std::uint8_t>(dc, (mn + kTailElems) * elem);
    EXPECT_TRUE(std::all_of(bytes.begin() + static_cast<std::ptrdiff_t>(mn * elem), bytes.end(),
                            [](std::uint8_t x) { return x == kPoisonByte; }))
        << "wrote past C";
    const toolkit::GemmTolerance tol = toolkit::gemm_tolerance(taken, host.format);
    const Reference ref = toolkit::reference(a, c.m, host, bias, tol);
    if (c.out_f32) {
      std::vector<float> out(mn);
      std::memcpy(out.data(), bytes.data(), mn * 4);
      const Comparison cmp = toolkit::compare_f32(out, ref);
      EXPECT_EQ(cmp.unwritten, 0) << cmp.str();
      EXPECT_LE(cmp.worst, 1.0) << cmp.str();
      EXPECT_LE(cmp.normalized, tol.normalized) << cmp.str();
    } else {
      std::vector<std::uint16_t> out(mn);
      std::memcpy(out.data(), bytes.data(), mn * 2);
      expect_close(toolkit::compare(out, ref), tol.normalized,
                   fmt::format("route {} against the float64 reference", ops::to_string(taken)));
    }
    free_all();
    return taken;
  }
};

}  // namespace metrale::testing::gemm
