#include "bench_timing.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <utility>

namespace metrale::cli {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void set_rates(Case& cs, double seconds, double weight_bytes, double peak_flops) {
  cs.seconds = seconds;
  cs.timed = true;
  if (!(seconds > 0)) {  // below the timer's resolution: no rate to divide out
    cs.gbps = cs.tflops = cs.pct_flops = 0;
    return;
  }
  const double bytes = weight_bytes + static_cast<double>(cs.m * cs.k * 2 + cs.m * cs.n * 2);
  cs.gbps = bytes / seconds / 1e9;
  cs.tflops = 2.0 * static_cast<double>(cs.m * cs.n * cs.k) / seconds / 1e12;
  cs.pct_flops = peak_flops > 0 ? 100.0 * cs.tflops * 1e12 / peak_flops : 0;
}

std::vector<std::vector<double>> time_in_turns(
    Backend& b, StreamHandle stream, std::size_t copies, std::size_t layers,
    const std::vector<std::size_t>& timed,
    const std::function<void(std::size_t r, std::size_t li)>& queue, bool graph, int repeats) {
  std::vector<std::vector<GraphHandle>> graphs(copies, std::vector<GraphHandle>(layers));
  if (graph) {
    for (std::size_t r = 0; r < copies; ++r) {
      for (std::size_t li : timed) {
        b.begin_capture(stream);
        queue(r, li);
        graphs[r][li] = b.end_capture(stream);
      }
    }
  }
  // Two timing events per call of a turn, made once and reused by every turn.
  struct Pairs {
    Backend& b;
    std::vector<std::pair<EventHandle, EventHandle>> ev;
    ~Pairs() {
      for (auto& [start, end] : ev) {
        for (EventHandle e : {start, end}) {
          try {
            if (e) b.destroy_event(e);
          } catch (const std::exception&) {  // a destructor: the error that unwinds wins
          }
        }
      }
    }
  } pairs{b, {}};
  pairs.ev.resize(copies * timed.size());
  for (auto& [start, end] : pairs.ev) {
    start = b.create_timing_event();
    end = b.create_timing_event();
  }
  const auto turn = [&] {
    std::size_t i = 0;
    for (std::size_t r = 0; r < copies; ++r) {
      for (std::size_t li : timed) {
        b.record_event(pairs.ev[i].first, stream);
        if (graph) {
          b.launch_graph(graphs[r][li], stream);
        } else {
          queue(r, li);
        }
        b.record_event(pairs.ev[i++].second, stream);
      }
    }
    b.synchronize(stream);
  };
  const auto turn_start = Clock::now();
  turn();
  const double turn_s = std::chrono::duration<double>(Clock::now() - turn_start).count();
  // Short turns are repeated for about a second, so one slow moment of a shared machine cannot
  // decide a whole case.
  const int turns = turn_s > 1.0   ? 2
                    : turn_s > 0.2 ? 4
                                   : std::clamp(static_cast<int>(std::ceil(1.0 / turn_s)), repeats,
                                                std::max(repeats, 100));
  std::vector<std::vector<double>> t(layers);
  for (int n = 0; n < turns; ++n) {
    turn();
    std::size_t i = 0;
    for (std::size_t r = 0; r < copies; ++r) {
      for (std::size_t li : timed) {
        t[li].push_back(b.event_elapsed_ms(pairs.ev[i].first, pairs.ev[i].second) / 1e3);
        ++i;
      }
    }
  }
  if (graph) {
    for (auto& per_copy : graphs) {
      for (std::size_t li : timed) b.destroy_graph(per_copy[li]);
    }
  }
  return t;
}

Progress::Progress(bool on, std::size_t total) : on_(on), total_(total), t0_(Clock::now()) {}

void Progress::step(std::size_t done, const std::string& what) {
  if (!on_) return;
  const double el = std::chrono::duration<double>(Clock::now() - t0_).count();
  const double eta =
      done > 0 ? el / static_cast<double>(done) * static_cast<double>(total_ - done) : 0;
  fmt::print(stderr, "\r\033[K[{}/{}] {} — {:.1f} s elapsed, ETA {:.0f} s", done + 1, total_, what,
             el, eta);
  std::fflush(stderr);
}

Progress::~Progress() {
  if (on_) fmt::print(stderr, "\r\033[K");
}

}  // namespace metrale::cli
