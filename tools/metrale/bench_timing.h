// What metrale bench measures and how: one case a layer, M and route; the turns that time the
// layers of a block in the order a forward pass reads them; the progress line.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "metrale/backend.h"

namespace metrale::cli {

struct Case {
  std::string layer;
  std::int64_t m = 0, n = 0, k = 0;
  std::string variant;  // "auto", or the route (or "bf16") forced for the side-by-side table
  std::string route;
  std::string plan;  // the describe() of the plan that ran
  double seconds = 0, gbps = 0, tflops = 0, pct_bw = 0, pct_flops = 0, error = 0;
  bool passed = false;             // the sampled check (toolkit/sampled_check.h)
  std::size_t copies_checked = 0;  // copies of the rotation the check covered
  std::int64_t failed_copy = -1;   // the copy whose check failed; -1: none
  bool timed = false;  // it passed and was timed (seconds 0: below the timer's resolution)
  // The share of a roof is above 100%: that roof read low (toolkit/roof_share.h).
  bool above_bw = false, above_flops = false;
};

// What the checkpoint layers benched on one op alone (FP8 on W8A8, BF16 on the dense GEMM) are
// run with: A's device buffer of at least max M·K BF16 values (ha, its host copy), C's of at
// least max M·N, the stream, and the timing's settings.
struct LayerBenchRun {
  DevicePtr a, c;
  std::span<const std::uint16_t> ha;
  StreamHandle stream;
  bool graph = false;
  int repeats = 7;
  double peak_flops = 0;
};

// The middle element of v (the upper one of an even count); v must not be empty.
double median(std::vector<double> v);

// Sets cs.seconds and its rates: the bytes streamed (weight_bytes plus A and C in BF16) per
// second, FLOP/s and their share of peak_flops (0: unknown); rates 0 for a time the timer read as
// 0. The bench sets the shares again at the end, from the highest roofs read through the run.
void set_rates(Case& cs, double seconds, double weight_bytes, double peak_flops);

// How time_in_turns times a call, as the bench output names it.
inline constexpr const char* kTimingMethod = "events";

// Times queue(r, li) for every copy r < copies of the block and every layer li in timed, on
// stream, in turns: a turn calls each once, as a forward pass does, so that no layer is read
// from a cache its own previous call filled (Note [layer rotation] in docs/NOTES.md). Each call
// is timed by a pair of timing events recorded around it on the stream, and the host waits once
// per turn, after the last call: a synchronize after every call would add the host's wake-up and
// the next launch to each small call's time. The first turn warms up and sizes the rest (about
// a second's worth, at least `repeats` turns; 2 or 4 when a turn is long); with graph each call
// is captured once and replayed. Returns, per layer index below layers, the seconds of each of
// its timed calls (empty for a layer not in timed).
std::vector<std::vector<double>> time_in_turns(
    Backend& b, StreamHandle stream, std::size_t copies, std::size_t layers,
    const std::vector<std::size_t>& timed,
    const std::function<void(std::size_t r, std::size_t li)>& queue, bool graph, int repeats);

// The "[3/40] qkv M=16 decode — 2.0 s elapsed, ETA 25 s" line on a terminal's stderr.
class Progress {
 public:
  Progress(bool on, std::size_t total);
  // Shows step done + 1 of the total, labelled what.
  void step(std::size_t done, const std::string& what);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

 private:
  bool on_;
  std::size_t total_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace metrale::cli
