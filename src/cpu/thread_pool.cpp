#include "cpu/thread_pool.h"

#include "metrale/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace metrale::cpu {
namespace {
thread_local bool t_inside_loop = false;

// Spins until ready() or for at most kSpin, then sleeps. See Note [pool spin before sleep] in
// docs/NOTES.md.
constexpr auto kSpin = std::chrono::microseconds(200);

template <class Ready>
bool spin_until(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 63) == 63) {
      if (std::chrono::steady_clock::now() > until) return false;
      // Lets another runnable thread have this core: torch's OpenMP workers, in a model whose
      // other ops are torch's.
      std::this_thread::yield();
    }
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}
}  // namespace

ThreadPool::ThreadPool(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads - 1);
  for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    posted_.fetch_add(1, std::memory_order_release);  // ends any spin
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_indices() {
  // Claims chunks of indices under the lock; each chunk is large enough that the lock is cheap
  // next to the work it hands out.
  for (;;) {
    std::size_t begin, end;
    const std::function<void(std::size_t)>* fn;
    {
      std::lock_guard lock(mu_);
      if (next_ >= n_ || error_) return;
      begin = next_;
      end = std::min(n_, begin + chunk_);
      next_ = end;
      fn = fn_;
    }
    try {
      for (std::size_t i = begin; i < end; ++i) (*fn)(i);
    } catch (...) {
      std::lock_guard lock(mu_);
      if (!error_) error_ = std::current_exception();
      return;
    }
  }
}

void ThreadPool::worker_loop() {
  std::uint64_t seen = 0;
  for (;;) {
    spin_until([&] { return posted_.load(std::memory_order_acquire) != seen; });
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || posted_.load(std::memory_order_relaxed) != seen; });
      if (stop_) return;
      seen = posted_.load(std::memory_order_relaxed);
      active_.fetch_add(1, std::memory_order_relaxed);
    }
    t_inside_loop = true;
    run_indices();
    t_inside_loop = false;
    {
      std::lock_guard lock(mu_);
      active_.fetch_sub(1, std::memory_order_release);
    }
    done_.notify_all();
  }
}

namespace {

// The executor this thread's loops run on instead of a pool (ScopedCpuExecutor), or null.
thread_local const CpuExecutor* t_executor = nullptr;

// fn over [0, n) on an executor: each range runs fn(i) in order; the first exception is kept
// (the executor's body must not throw) and the ranges after it are skipped.
void run_on(const CpuExecutor& executor, std::size_t n,
            const std::function<void(std::size_t)>& fn) {
  struct Loop {
    const std::function<void(std::size_t)>* fn;
    std::mutex mu;
    std::exception_ptr error;
    std::atomic<bool> failed{false};
  } loop{&fn, {}, nullptr, {}};
  executor.parallel_for(
      executor.ctx, n,
      [](void* arg, std::size_t begin, std::size_t end) {
        auto& l = *static_cast<Loop*>(arg);
        try {
          for (std::size_t i = begin; i < end && !l.failed.load(std::memory_order_relaxed); ++i) {
            (*l.fn)(i);
          }
        } catch (...) {
          std::lock_guard lock(l.mu);
          if (!l.error) l.error = std::current_exception();
          l.failed = true;
        }
      },
      &loop);
  if (loop.error) std::rethrow_exception(loop.error);
}

}  // namespace

void ThreadPool::parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn) {
  if (n == 0) return;
  if (t_executor != nullptr && n > 1 && !t_inside_loop) {
    t_inside_loop = true;  // a loop inside fn runs inline, as on the pool
    try {
      run_on(*t_executor, n, fn);
    } catch (...) {
      t_inside_loop = false;
      throw;
    }
    t_inside_loop = false;
    return;
  }
  std::unique_lock run(run_mu_, std::defer_lock);
  if (workers_.empty() || n == 1 || t_inside_loop || !run.try_lock()) {
    for (std::size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    std::lock_guard lock(mu_);
    fn_ = &fn;
    n_ = n;
    next_ = 0;
    // About sixteen chunks per thread: the last chunk claimed decides when the loop ends, and
    // with four per thread a GEMV over 32 blocks of 3.6 MB (Llama-3-70B down) handed out
    // 15 MB at a time, so one thread could sit idle for a twelfth of the call while the other
    // finished. A claim costs one uncontended lock, noise next to any block worth a thread.
    chunk_ = std::max<std::size_t>(1, n / (size() * 16));
    error_ = nullptr;
    posted_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  t_inside_loop = true;
  run_indices();
  t_inside_loop = false;
  std::exception_ptr error;
  spin_until([&] { return active_.load(std::memory_order_acquire) == 0; });
  {
    std::unique_lock lock(mu_);
    // Wait until every index is claimed and no worker is still inside this loop.
    done_.wait(lock, [&] {
      return active_.load(std::memory_order_relaxed) == 0 && (next_ >= n_ || error_);
    });
    fn_ = nullptr;
    n_ = 0;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace metrale::cpu

namespace metrale {

ScopedCpuExecutor::ScopedCpuExecutor(const CpuExecutor& executor) noexcept
    : previous_(cpu::t_executor) {
  cpu::t_executor = &executor;
}

ScopedCpuExecutor::~ScopedCpuExecutor() {
  cpu::t_executor = previous_;
}

}  // namespace metrale
