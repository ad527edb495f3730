// What the host-emulation tests of the fused kernels share (fused_host_test.cpp: gemm_fused and
// gemm_grouped_fused; fused_int4_host_test.cpp: gemm_grouped_int4_fused): a run's outcome, the
// grid run under a schedule and a planted fault, and the checks every run and every planted fault
// must pass.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "host_data.h"
#include "kernels/fused_tile.h"
#include "kernels/grouped_params.h"
#include "metrale/numerics.h"
#include "sm90_host.h"

namespace metrale::fused_host {

namespace emu = metrale::emulation;
namespace fu = metrale::fused;

struct Outcome {
  std::string error;      // a fault or deadlock the emulation reported
  long bad = 0;           // elements of C outside the bound
  std::string first_bad;  // the first few of them
  double rel = 0.0;       // normalized error of C
  bool turns = true;      // the consumers' wgmma groups were committed in turns
  emu::BankReport banks;
};

// Runs `block` (one block of a fused kernel) on a grid of `grid` blocks under schedule `seed`
// with `plant`, reading `readable`: the emulation's error, the bank report and whether the
// consumers' wgmma groups were committed in turns, into o.
inline void run_blocks(unsigned grid, std::uint64_t seed, emu::Plant plant,
                       std::vector<emu::Region> readable, const std::function<void()>& block,
                       Outcome& o) {
  emu::set_schedule(seed);
  emu::set_plant(plant);
  emu::reset_bank_report();
  o.error = emu::run_grid(dim3(grid), fu::kThreads, std::move(readable), block);
  emu::set_schedule(0);
  emu::set_plant(emu::Plant::kNone);
  o.banks = emu::bank_report();
  const std::vector<int>& order = emu::wgmma_commit_order();
  for (std::size_t i = 0; i < order.size(); ++i) o.turns &= order[i] == 1 + static_cast<int>(i % 2);
}

// A run with nothing wrong: no fault, C within the bound, turns kept, no bank conflict.
inline void expect_good(const Outcome& o) {
  EXPECT_EQ(o.error, "");
  EXPECT_EQ(o.bad, 0) << "elements out of the bound:" << o.first_bad;
  EXPECT_LT(o.rel, 1.0 / 256);
  EXPECT_TRUE(o.turns) << "the consumer warpgroups' wgmma groups were not committed in turns";
  EXPECT_GT(o.banks.instructions, 0);
  EXPECT_EQ(o.banks.conflicted, 0) << o.banks.first;
}

// The planted fault `what` must fail one of the runs run_seed(seed) makes for seeds 21 .. 24:
// the run's fault or deadlock, a wrong C, or wgmmas out of turn.
inline void expect_caught(const std::function<Outcome(std::uint64_t)>& run_seed, const char* what) {
  SCOPED_TRACE(what);
  bool caught = false;
  std::string how;
  for (std::uint64_t seed = 21; seed < 25 && !caught; ++seed) {
    const Outcome o = run_seed(seed);
    if (!o.error.empty())
      how = "the emulation reported: " + o.error;
    else if (o.bad > 0)
      how = std::to_string(o.bad) + " elements of C wrong";
    else if (!o.turns)
      how = "wgmma groups out of turn";
    caught = !how.empty();
  }
  EXPECT_TRUE(caught) << what << " was not caught";
  std::printf("  planted %s: %s\n", what, how.c_str());
}

// A buffer's size rounded up to the 256-byte stride GroupedWeights keeps between experts.
inline std::size_t stride_of(std::size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

inline constexpr std::uint16_t kPoisonBf16 = 0x7FC1;  // NaNs: an element nobody writes fails
inline constexpr std::uint32_t kPoisonF32 = 0x7FC00001u;

// One call of a grouped fused kernel on the host, its arguments filled as ops::run_grouped fills
// them: A (random BF16) and C (poisoned) over `rows` rows, a random BF16 bias row per expert
// where asked, expert e's counts[e] rows from offsets[e] (none given, or -1: right after the
// previous expert's rows), and the experts' weights end to end at their strides.
struct GroupedCall {
  std::vector<std::uint16_t> a, bias, out16;
  std::vector<std::uint32_t> out32;
  std::vector<std::int32_t> counts, offsets;
  std::vector<float> table;  // FP32 tensor scales [E], then int32 folds [E]
  GroupedGemmParams g;

  GroupedCall(std::int64_t rows, std::int64_t n, std::int64_t k, const std::vector<int>& c,
              const std::vector<int>& o, bool with_bias, bool f32, std::mt19937_64& rng)
      : counts(c.begin(), c.end()), offsets(c.size() + 1) {
    const auto experts = static_cast<std::int64_t>(c.size());
    for (std::size_t e = 0, next = 0; e < c.size(); ++e) {
      offsets[e] = o.empty() || o[e] < 0 ? static_cast<std::int32_t>(next) : o[e];
      next = static_cast<std::size_t>(offsets[e] + std::max(counts[e], 0));
    }
    offsets[c.size()] = static_cast<std::int32_t>(rows);
    table.assign(2 * c.size(), 0.0f);
    a = emu::random_bf16(static_cast<std::size_t>(rows * k), rng);
    if (with_bias) bias = emu::random_bf16(static_cast<std::size_t>(experts * n), rng);
    if (f32) {
      out32.assign(static_cast<std::size_t>(rows * n), kPoisonF32);
    } else {
      out16.assign(static_cast<std::size_t>(rows * n), kPoisonBf16);
    }
    g.gemm.m = rows;
    g.gemm.n = n;
    g.gemm.k = k;
    g.gemm.a = emu::address(a.data());
    g.gemm.flags = kGemmDecodePacked | (with_bias ? kGemmBias : 0u) | (f32 ? kGemmOutF32 : 0u);
    g.gemm.bias = with_bias ? emu::address(bias.data()) : 0;
    g.gemm.out = f32 ? emu::address(out32.data()) : emu::address(out16.data());
    g.counts = emu::address(counts.data());
    g.offsets = emu::address(offsets.data());
    g.expert_table = emu::address(table.data());
    g.experts = experts;
  }

  // Expert e's tensor scale and fold in the table.
  void set_expert(std::size_t e, float tensor_scale, std::int32_t fold) {
    table[e] = tensor_scale;
    std::memcpy(&table[counts.size() + e], &fold, 4);
  }

  // Runs `block` (one block of the kernel on g) as run_blocks does, the weights' buffers `codes`
  // and `scales` (expert e's at e times their strides) readable beside the call's own.
  Outcome run(unsigned grid, std::uint64_t seed, emu::Plant plant,
              const std::vector<std::uint8_t>& codes, std::size_t codes_stride,
              const std::vector<std::uint8_t>& scales, std::size_t scales_stride,
              const std::function<void(const GroupedGemmParams&)>& block) {
    g.gemm.codes = emu::address(codes.data());
    g.gemm.scales = emu::address(scales.data());
    g.codes_stride = codes_stride;
    g.scales_stride = scales_stride;
    Outcome o;
    run_blocks(
        grid, seed, plant,
        {{a.data(), a.size() * 2},
         {codes.data(), codes.size()},
         {scales.data(), scales.size()},
         {bias.data(), bias.size() * 2},
         {counts.data(), counts.size() * 4},
         {offsets.data(), offsets.size() * 4},
         {table.data(), table.size() * 4}},
        [this, &block] { block(g); }, o);
    return o;
  }

  // C[i, j] as a double, and whether it still holds the poison.
  double c(std::int64_t i, std::int64_t j) const {
    const auto at = static_cast<std::size_t>(i * g.gemm.n + j);
    return out16.empty() ? double{num::bits_f32(out32[at])} : double{num::bf16_to_f32(out16[at])};
  }
  bool kept(std::int64_t i, std::int64_t j) const {
    const auto at = static_cast<std::size_t>(i * g.gemm.n + j);
    return out16.empty() ? out32[at] == kPoisonF32 : out16[at] == kPoisonBf16;
  }

  // The expert owning each row (-1: none, or an expert the kernel skips: grouped_slots).
  std::vector<int> owners() const {
    std::vector<int> owner(static_cast<std::size_t>(g.gemm.m), -1);
    for (std::size_t e = 0; e < counts.size(); ++e) {
      if (fu::grouped_slots(counts[e], offsets[e], g.gemm.m) == 0) continue;
      for (int r = offsets[e]; r < offsets[e] + counts[e]; ++r) {
        owner[static_cast<std::size_t>(r)] = static_cast<int>(e);
      }
    }
    return owner;
  }
};

// Counts C[i, j] of no expert that was written into o.
inline void expect_kept(const GroupedCall& call, std::int64_t i, std::int64_t j, Outcome& o) {
  if (!call.kept(i, j) && ++o.bad <= 3) {
    o.first_bad += " C[" + std::to_string(i) + ", " + std::to_string(j) + "] of no expert written";
  }
}

}  // namespace metrale::fused_host
