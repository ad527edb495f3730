// Fibers on ucontext: switches go straight from the fiber that waits to the next one that can
// go, skipping those still held at a barrier, so a barrier costs one switch per waiting fiber.
#include "fibers.h"

#include <ucontext.h>

#include <memory>
#include <vector>

namespace metrale::emulation {
namespace {

// Deep enough for a kernel's frames in an unoptimized build.
constexpr std::size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t context{};
  std::unique_ptr<char[]> stack;
  bool done = false;
  const Barrier* waiting = nullptr;  // the barrier it waits at, if any
  std::uint64_t generation = 0;      // that barrier's generation when it arrived
};

struct Runtime {
  std::vector<Fiber> fibers;
  ucontext_t main{};
  int count = 0, live = 0, current = -1;
  void (*body)(int, void*) = nullptr;
  void* context = nullptr;
  std::string error;
};

Runtime& rt() {
  static Runtime r;
  return r;
}

bool can_go(const Fiber& f) {
  return !f.done && (f.waiting == nullptr || f.waiting->generation != f.generation);
}

// Leaves fiber `from` for the next one that can go (from itself last), or for the caller of
// run_fibers when none is left or none can go.
void switch_from(int from) {
  Runtime& r = rt();
  for (int step = 1; step <= r.count; ++step) {
    const int to = (from + step) % r.count;
    if (!can_go(r.fibers[to])) continue;
    if (to == from) return;
    r.current = to;
    swapcontext(&r.fibers[from].context, &r.fibers[to].context);
    return;
  }
  if (r.live > 0 && r.error.empty()) {
    r.error = "deadlock: " + std::to_string(r.live) +
              " threads wait at a barrier that not enough threads reach";
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

int current_fiber() {
  return rt().current;
}

void wait_at(Barrier& b) {
  if (++b.arrived == b.count) {
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

void fault(const std::string& what) {
  Runtime& r = rt();
  if (r.error.empty()) r.error = what;
}

}  // namespace metrale::emulation
