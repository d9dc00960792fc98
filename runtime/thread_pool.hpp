// A small thread pool for the CPU backend's chunked passes.
#pragma once

#include <atomic>  // (kept for the files that include this header and use them)
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace stepfuse::detail {

// Runs one function on `size()` threads at once (the caller is thread 0) and
// waits for all of them. Workers sleep on a futex between jobs and spin briefly
// after one, so back-to-back passes of a step start quickly.
//
// The pools of shared() share one crew of worker threads, as many as the largest
// pool asked for needs: a pool of n threads runs on the crew's first n - 1 workers,
// so distinct thread counts cost no threads beyond the largest (results never depend
// on the thread count, only the speed does). Runs on the crew are serialized.
//
// fork(): a child process has none of its parent's threads; its pools start new
// workers at their first run() there (the parent's are abandoned, never joined), so a
// child can step the optimizers it inherited (docs/architecture.md §6). Calling fork()
// from inside fn is not supported.
class ThreadPool {
 public:
  // A pool with its own workers (threads - 1 of them), joined by the destructor.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_; }

  // Calls fn(t) for every t in [0, size()), t = 0 on the calling thread, and
  // returns when all calls have returned. Calls from several threads are
  // serialized. An exception thrown by any call is caught on its thread; once every
  // call has returned, the first one caught is rethrown here (the others are
  // dropped). A run() from inside fn on the same crew (a nested run) calls its fn(t)
  // one after another on the calling thread instead of deadlocking. Does not
  // allocate (except to start workers, in a child after fork(), and to throw).
  template <class F>
  void run(F&& fn) {
    run_impl(&invoke<std::remove_reference_t<F>>, &fn);
  }

  // The process-wide pool with `threads` threads (>= 1), created on first use and
  // never destroyed; its workers are started here, not by run().
  static ThreadPool& shared(int threads);

  // STEPFUSE_NUM_THREADS if set (>= 1), else the number of cores.
  static int default_threads();

  struct Crew;  // worker threads and the job they run (thread_pool.cpp)

 private:
  ThreadPool(int threads, Crew* crew);
  using Thunk = void (*)(void* fn, int thread);
  template <class F>
  static void invoke(void* fn, int thread) {
    (*static_cast<F*>(fn))(thread);
  }
  void run_impl(Thunk thunk, void* fn);

  int size_ = 1;
  Crew* crew_ = nullptr;
  bool owns_crew_ = false;
};

}  // namespace stepfuse::detail
