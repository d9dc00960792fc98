// A small fixed-size thread pool for the CPU backend's chunked passes.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace stepfuse::detail {

// Runs one function on `size()` threads at once (the caller is thread 0) and
// waits for all of them. Workers sleep on a futex between jobs and spin briefly
// after one, so back-to-back passes of a step start quickly.
class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(t) for every t in [0, size()), t = 0 on the calling thread, and
  // returns when all calls have returned. Calls from several threads are
  // serialized. fn must not throw. Does not allocate.
  template <class F>
  void run(F&& fn) {
    run_impl(&invoke<std::remove_reference_t<F>>, &fn);
  }

  // The process-wide pool with `threads` threads, created on first use.
  static ThreadPool& shared(int threads);

  // STEPFUSE_NUM_THREADS if set (>= 1), else the number of cores.
  static int default_threads();

 private:
  using Thunk = void (*)(void* fn, int thread);
  template <class F>
  static void invoke(void* fn, int thread) {
    (*static_cast<F*>(fn))(thread);
  }
  void run_impl(Thunk thunk, void* fn);
  void worker(int index);

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  Thunk thunk_ = nullptr;
  void* fn_ = nullptr;
  std::atomic<std::uint32_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace stepfuse::detail
