// Cooperative fibers on one OS thread, for running a CUDA thread block's threads on the host:
// each thread is a fiber that runs until it waits at a barrier or returns, and the next fiber
// that can go runs then. One thread of the OS, so the block's "shared memory" needs no locks
// and a run is deterministic.
#pragma once

#include <cstdint>
#include <string>

namespace metrale::emulation {

// A barrier for `count` fibers; the last to arrive releases the others.
struct Barrier {
  int count = 0;
  int arrived = 0;
  std::uint64_t generation = 0;
};

// Runs body(i, context) for i in [0, count) as fibers until every one has returned. Returns ""
// or what went wrong: a deadlock (fibers left waiting with none able to go) or the first fault
// that fault() recorded during the run. Not reentrant.
std::string run_fibers(int count, void (*body)(int, void*), void* context);

// Inside a fiber: its index.
int current_fiber();

// Inside a fiber: waits until b.count fibers have arrived at b.
void wait_at(Barrier& b);

// Records a fault of the code under test (the first one is what run_fibers returns).
void fault(const std::string& what);

}  // namespace metrale::emulation
