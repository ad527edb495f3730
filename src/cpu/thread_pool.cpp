#include "cpu/thread_pool.h"

#include <algorithm>

namespace metrale::cpu {
namespace {
thread_local bool t_inside_loop = false;
}

ThreadPool::ThreadPool(unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads - 1);
  for (unsigned i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
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
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++busy_;
    }
    t_inside_loop = true;
    run_indices();
    t_inside_loop = false;
    {
      std::lock_guard lock(mu_);
      --busy_;
    }
    done_.notify_all();
  }
}

void ThreadPool::parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn) {
  if (n == 0) return;
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
    // About four chunks per thread balances uneven blocks without much locking.
    chunk_ = std::max<std::size_t>(1, n / (size() * 4));
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  t_inside_loop = true;
  run_indices();
  t_inside_loop = false;
  std::exception_ptr error;
  {
    std::unique_lock lock(mu_);
    // Wait until every index is claimed and no worker is still inside this loop.
    done_.wait(lock, [&] { return busy_ == 0 && (next_ >= n_ || error_); });
    fn_ = nullptr;
    n_ = 0;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace metrale::cpu
