// A fixed pool of worker threads for data-parallel loops. The calling thread works too, so a
// pool of size 1 has no workers and runs everything inline.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace metrale::cpu {

class ThreadPool {
 public:
  // A pool of `threads` threads in all (the caller counts as one); 0 means hardware threads.
  explicit ThreadPool(unsigned threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool();

  // Threads that run a parallel_for (workers + caller).
  unsigned size() const noexcept { return static_cast<unsigned>(workers_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) across the pool and returns when all are done; rethrows
  // the first exception (remaining indices are skipped). Calls from inside fn, or while another
  // thread's loop is running, run inline on the caller so they cannot deadlock.
  void parallel_for(std::size_t n, const std::function<void(std::size_t)>& fn);

 private:
  void worker_loop();
  void run_indices();

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::mutex run_mu_;  // one loop at a time
  // The current loop; all guarded by mu_.
  const std::function<void(std::size_t)>* fn_ = nullptr;
  std::size_t n_ = 0;
  std::size_t next_ = 0;
  std::size_t chunk_ = 1;
  bool stop_ = false;
  std::exception_ptr error_;
  // Loops posted so far (and once more at shutdown), and workers inside a loop: written under
  // mu_, atomic so that threads can spin on them for a moment before they sleep on a condition
  // variable (spin_until in thread_pool.cpp).
  std::atomic<std::uint64_t> posted_{0};
  std::atomic<std::size_t> active_{0};
};

}  // namespace metrale::cpu
