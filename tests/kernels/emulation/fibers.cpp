// Fibers on ucontext: switches go straight from the fiber that waits to the next one that can
// go, skipping those still held, so a barrier costs one switch per waiting fiber.
#include "fibers.h"

#include <ucontext.h>

#include <memory>
#include <random>
#include <vector>

namespace metrale::emulation {
namespace {

// Deep enough for a kernel's frames in an unoptimized build.
constexpr std::size_t kStackBytes = 256 * 1024;
// Under the random schedule, the chance (1 in this) that a switch first completes asynchronous
// work: often enough that copies land at scattered points, rarely enough that some stay pending
// across many switches.
constexpr std::uint64_t kProgressOdds = 4;

struct Fiber {
  ucontext_t context{};
  std::unique_ptr<char[]> stack;
  bool done = false;
  const Barrier* waiting = nullptr;              // the barrier it waits at, if any
  std::uint64_t generation = 0;                  // that barrier's generation when it arrived
  const std::function<bool()>* until = nullptr;  // the condition it waits for, if any
};

struct Runtime {
  std::vector<Fiber> fibers;
  ucontext_t main{};
  int count = 0, live = 0, current = -1;
  void (*body)(int, void*) = nullptr;
  void* context = nullptr;
  std::string error;
  std::uint64_t seed = 0;
  std::mt19937_64 rng;
  std::function<bool(bool)> progress;
};

Runtime& rt() {
  static Runtime r;
  return r;
}

bool can_go(const Fiber& f) {
  if (f.done) return false;
  if (f.waiting != nullptr) return f.waiting->generation != f.generation;
  if (f.until != nullptr) return (*f.until)();
  return true;
}

// The next fiber after `from` that can go (from itself last), or -1.
int next_round_robin(int from) {
  Runtime& r = rt();
  for (int step = 1; step <= r.count; ++step) {
    const int to = (from + step) % r.count;
    if (can_go(r.fibers[to])) return to;
  }
  return -1;
}

// A fiber that can go, drawn at random (from included), or -1.
int next_random() {
  Runtime& r = rt();
  const int start = static_cast<int>(r.rng() % static_cast<std::uint64_t>(r.count));
  for (int step = 0; step < r.count; ++step) {
    const int to = (start + step) % r.count;
    if (can_go(r.fibers[to])) return to;
  }
  return -1;
}

// Leaves fiber `from` for the next one that can go, or for the caller of run_fibers when none
// is left or none can go even after the pending asynchronous work is done.
void switch_from(int from) {
  Runtime& r = rt();
  if (r.seed != 0 && r.progress && r.rng() % kProgressOdds == 0) r.progress(false);
  for (;;) {
    const int to = r.seed != 0 ? next_random() : next_round_robin(from);
    if (to == from) return;
    if (to >= 0) {
      r.current = to;
      swapcontext(&r.fibers[from].context, &r.fibers[to].context);
      return;
    }
    if (r.live > 0 && r.progress && r.progress(true)) continue;
    break;
  }
  if (r.live > 0 && r.error.empty()) {
    r.error = "deadlock: " + std::to_string(r.live) +
              " threads wait at a barrier or for a condition that nothing left can satisfy";
  }
  swapcontext(&r.fibers[from].context, &r.main);
}

// A fiber's first code: it is the current one when it first runs.
void trampoline() {
  Runtime& r = rt();
  const int i = r.current;
  r.body(i, r.context);
  r.fibers[i].done = true;
  --r.live;
  switch_from(i);  // never comes back: a done fiber cannot go
}

}  // namespace

std::string run_fibers(int count, void (*body)(int, void*), void* context) {
  Runtime& r = rt();
  if (static_cast<int>(r.fibers.size()) < count) r.fibers.resize(static_cast<std::size_t>(count));
  r.count = count;
  r.live = count;
  r.body = body;
  r.context = context;
  r.error.clear();
  for (int i = 0; i < count; ++i) {
    Fiber& f = r.fibers[i];
    if (!f.stack) f.stack = std::make_unique<char[]>(kStackBytes);
    f.done = false;
    f.waiting = nullptr;
    f.until = nullptr;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, &trampoline, 0);
  }
  r.current = 0;
  swapcontext(&r.main, &r.fibers[0].context);
  r.current = -1;
  return r.error;
}

void set_schedule(std::uint64_t seed) {
  Runtime& r = rt();
  r.seed = seed;
  r.rng.seed(seed);
}

void set_progress(std::function<bool(bool)> progress) {
  rt().progress = std::move(progress);
}

std::uint64_t schedule_draw(std::uint64_t n) {
  Runtime& r = rt();
  return r.seed == 0 || n == 0 ? 0 : r.rng() % n;
}

int current_fiber() {
  return rt().current;
}

void wait_at(Barrier& b) {
  static const std::function<void()> nothing;
  wait_at(b, nothing);
}

void wait_at(Barrier& b, const std::function<void()>& on_last) {
  if (++b.arrived == b.count) {
    if (on_last) on_last();
    b.arrived = 0;
    ++b.generation;
    return;
  }
  Runtime& r = rt();
  const int me = r.current;
  r.fibers[me].waiting = &b;
  r.fibers[me].generation = b.generation;
  switch_from(me);
  r.fibers[me].waiting = nullptr;
}

void wait_until(const std::function<bool()>& ready) {
  if (ready()) return;
  Runtime& r = rt();
  const int me = r.current;
  r.fibers[me].until = &ready;
  switch_from(me);
  r.fibers[me].until = nullptr;
}

void yield() {
  Runtime& r = rt();
  if (r.seed != 0) switch_from(r.current);
}

void fault(const std::string& what) {
  Runtime& r = rt();
  if (r.error.empty()) r.error = what;
}

}  // namespace metrale::emulation
