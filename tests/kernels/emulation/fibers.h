// Cooperative fibers on one OS thread, for running a CUDA thread block's threads on the host:
// each thread is a fiber that runs until it waits (at a barrier, for a condition) or yields, and
// another fiber that can go runs then. One thread of the OS, so the block's "shared memory" needs
// no locks and a run is deterministic for a given schedule.
//
// Two schedules: round robin (the default: the next fiber in index order that can go), and a
// seeded random one (set_schedule), which picks any fiber that can go and, at each switch, may
// first complete some of the asynchronous work a progress hook owns (the bulk copies of
// sm90_host.h), so that a kernel that forgets a wait or releases a buffer early meets the
// interleaving that exposes it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace metrale::emulation {

// A barrier for `count` fibers; the last to arrive releases the others.
struct Barrier {
  int count = 0;
  int arrived = 0;
  std::uint64_t generation = 0;
};

// Runs body(i, context) for i in [0, count) as fibers until every one has returned. Returns ""
// or what went wrong: a deadlock (fibers left waiting with none able to go and no asynchronous
// work left) or the first fault that fault() recorded during the run. Not reentrant.
std::string run_fibers(int count, void (*body)(int, void*), void* context);

// The schedule of the next runs: seed 0 is round robin; any other seed picks the next fiber, and
// whether to make asynchronous progress at a switch, from a generator seeded with it.
void set_schedule(std::uint64_t seed);

// The asynchronous work of the next runs: progress(force) completes some pending work and says
// whether it did any. The scheduler calls it with force = false at random switches (random
// schedule only) and with force = true whenever no fiber can go, before calling it a deadlock.
// An empty function (the default) means there is none.
void set_progress(std::function<bool(bool force)> progress);

// A draw from the schedule's generator in [0, n) (0 under round robin): for the progress hook's
// choice of which pending work completes.
std::uint64_t schedule_draw(std::uint64_t n);

// Inside a fiber: its index.
int current_fiber();

// Inside a fiber: waits until b.count fibers have arrived at b.
void wait_at(Barrier& b);

// Inside a fiber: as wait_at, and the last fiber to arrive runs on_last before any is released.
void wait_at(Barrier& b, const std::function<void()>& on_last);

// Inside a fiber: returns once ready() is true (checked now, then whenever the scheduler looks
// for a fiber that can go). ready must stay valid until then.
void wait_until(const std::function<bool()>& ready);

// Inside a fiber: lets another fiber go first under the random schedule (nothing under round
// robin, so that runs without a seed switch no more than before).
void yield();

// Records a fault of the code under test (the first one is what run_fibers returns).
void fault(const std::string& what);

}  // namespace metrale::emulation
