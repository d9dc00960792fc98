// The CPU backend's thread pool: crews of workers, the shared crew, fork() handling.
#include "runtime/thread_pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <utility>

#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {
// Spin this many polls before sleeping: covers the gap between the passes of
// one step (a few microseconds) without burning a core between steps.
constexpr int kSpinPolls = 20000;

// The crew whose job this thread is running (as its caller or as a worker), for
// telling a nested run() from a deadlock.
thread_local const ThreadPool::Crew* t_crew = nullptr;
}  // namespace

// Worker threads and the job they run. Worker i runs index i + 1 of a job; a job of
// n threads wakes workers 0 .. n - 2 only, each on its own futex word.
struct ThreadPool::Crew {
  struct Worker {
    alignas(64) std::atomic<std::uint32_t> wake{0};  // bumped once per job for this worker
    std::thread thread;
  };

  Crew();
  ~Crew();

  // Starts workers until there are `n` (under `mutex`, so no job is running).
  void grow(int n) {
    std::lock_guard lock(grow_mutex);
    while (static_cast<int>(workers.size()) < n) {
      auto w = std::make_unique<Worker>();
      Worker* const raw = w.get();
      const int index = static_cast<int>(workers.size()) + 1;
      w->thread = std::thread([this, raw, index] { work(*raw, index); });
      workers.push_back(std::move(w));
    }
  }

  void work(Worker& w, int index) {
    t_crew = this;
    std::uint32_t seen = 0;
    for (;;) {
      std::uint32_t wake = w.wake.load(std::memory_order_acquire);
      for (int spin = 0; wake == seen && spin < kSpinPolls; ++spin) wake = w.wake.load(std::memory_order_acquire);
      while (wake == seen) {
        w.wake.wait(seen);
        wake = w.wake.load(std::memory_order_acquire);
      }
      seen = wake;
      if (stop.load()) return;
      call(index);
      if (pending.fetch_sub(1, std::memory_order_acq_rel) == 1) pending.notify_one();
    }
  }

  // Runs the job's fn(index), keeping the first exception of the job.
  void call(int index) noexcept {
    try {
      thunk(fn, index);
    } catch (...) {
      std::lock_guard lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }

  // In a child of fork(): the workers are gone, and `mutex` may be held by a thread that
  // no longer exists. `workers` is whole (the fork's prepare handler holds `grow_mutex`, so
  // no grow() was half-way), but each std::thread names a thread of the parent: it is
  // overwritten with an empty one, never joined (there is nothing to join) nor destroyed
  // joinable (that would terminate). The Worker objects are then freed; run() starts new
  // workers.
  void reset_in_child() noexcept {
    new (&mutex) std::mutex();
    new (&error_mutex) std::mutex();
    for (auto& w : workers) new (&w->thread) std::thread();
    workers.clear();
    new (&error) std::exception_ptr();  // the parent's job's exception, if any, is leaked
    pending.store(0);
    stop.store(false);
    grow_mutex.unlock();  // held by this thread, the one that forked
  }

  std::mutex mutex;  // one job at a time; guards workers
  std::mutex grow_mutex;  // held while grow() changes workers, and across fork()
  std::vector<std::unique_ptr<Worker>> workers;
  Thunk thunk = nullptr;
  void* fn = nullptr;
  std::atomic<int> pending{0};
  std::atomic<bool> stop{false};
  std::mutex error_mutex;
  std::exception_ptr error;
};

namespace {

// Every live crew, for the fork() handlers; its mutex also guards the shared pools.
struct Registry {
  std::mutex mutex;
  std::vector<ThreadPool::Crew*> crews;
  ThreadPool::Crew* shared_crew = nullptr;
  std::map<int, std::unique_ptr<ThreadPool>> shared_pools;
};

Registry& registry() {
  // Never destroyed: pools may run during other static destructors, and a child of
  // fork() must not join its parent's workers at exit.
  static Registry* const r = [] {
    auto* reg = new Registry();
    pthread_atfork(
        [] {
          // The crew list, and each crew's worker list, stay whole across fork().
          Registry& g = registry();
          g.mutex.lock();
          for (ThreadPool::Crew* c : g.crews) c->grow_mutex.lock();
        },
        [] {
          Registry& g = registry();
          for (ThreadPool::Crew* c : g.crews) c->grow_mutex.unlock();
          g.mutex.unlock();
        },
        [] {
          Registry& g = registry();
          for (ThreadPool::Crew* c : g.crews) c->reset_in_child();
          g.mutex.unlock();  // held by this thread, the one that forked
        });
    return reg;
  }();
  return *r;
}

}  // namespace

// Registered by whoever creates a crew, under the registry's lock.
ThreadPool::Crew::Crew() = default;

ThreadPool::Crew::~Crew() {
  {
    Registry& g = registry();
    std::lock_guard lock(g.mutex);
    if (auto it = std::find(g.crews.begin(), g.crews.end(), this); it != g.crews.end()) g.crews.erase(it);
  }
  stop.store(true);
  for (auto& w : workers) {
    w->wake.fetch_add(1, std::memory_order_release);
    w->wake.notify_one();
  }
  for (auto& w : workers) w->thread.join();
}

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) throw Error(ErrorCode::invalid_argument, "thread pool: threads = " + std::to_string(threads) + " (must be >= 1)");
  auto crew = std::make_unique<Crew>();
  {
    Registry& g = registry();
    std::lock_guard lock(g.mutex);
    g.crews.push_back(crew.get());
  }
  {
    std::lock_guard lock(crew->mutex);
    crew->grow(threads - 1);
  }
  size_ = threads;
  crew_ = crew.release();
  owns_crew_ = true;
}

ThreadPool::ThreadPool(int threads, Crew* crew) : size_(threads), crew_(crew) {}

ThreadPool::~ThreadPool() {
  if (owns_crew_) delete crew_;
}

void ThreadPool::run_impl(Thunk thunk, void* fn) {
  Crew& c = *crew_;
  const int workers = size_ - 1;
  if (workers == 0 || t_crew == &c) {
    // One thread, or a run() from inside a job of this crew: every index here, in turn.
    std::exception_ptr first;
    for (int t = 0; t < size_; ++t) {
      try {
        thunk(fn, t);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
    return;
  }
  std::unique_lock lock(c.mutex);
  c.grow(workers);  // nothing to do, except in a child of fork()
  c.thunk = thunk;
  c.fn = fn;
  c.pending.store(workers, std::memory_order_relaxed);
  for (int i = 0; i < workers; ++i) {
    Crew::Worker& w = *c.workers[static_cast<std::size_t>(i)];
    w.wake.fetch_add(1, std::memory_order_release);
    w.wake.notify_one();
  }
  const Crew* const outer = std::exchange(t_crew, &c);
  c.call(0);
  t_crew = outer;
  // Every worker is done with fn before this returns, also when fn threw.
  bool done = false;
  for (int spin = 0; spin < kSpinPolls && !done; ++spin) done = c.pending.load(std::memory_order_acquire) == 0;
  if (!done)
    for (int left; (left = c.pending.load(std::memory_order_acquire)) != 0;) c.pending.wait(left);
  if (c.error) {
    std::exception_ptr e = std::exchange(c.error, nullptr);
    lock.unlock();
    std::rethrow_exception(e);
  }
}

ThreadPool& ThreadPool::shared(int threads) {
  if (threads < 1) throw Error(ErrorCode::invalid_argument, "thread pool: threads = " + std::to_string(threads) + " (must be >= 1)");
  Registry& g = registry();
  std::lock_guard lock(g.mutex);
  if (g.shared_crew == nullptr) {
    g.crews.reserve(g.crews.size() + 1);  // (so that the push cannot throw after the new)
    g.shared_crew = new Crew();
    g.crews.push_back(g.shared_crew);
  }
  std::unique_ptr<ThreadPool>& pool = g.shared_pools[threads];
  if (!pool) {
    {
      std::lock_guard crew_lock(g.shared_crew->mutex);
      g.shared_crew->grow(threads - 1);  // here, so that a step's run() never starts threads
    }
    pool.reset(new ThreadPool(threads, g.shared_crew));
  }
  return *pool;
}

int ThreadPool::default_threads() {
  if (const char* env = std::getenv("STEPFUSE_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1 || n > 1024)
      throw Error(ErrorCode::invalid_argument,
                  std::string("STEPFUSE_NUM_THREADS = '") + env + "' is not a thread count (use an integer from 1 to 1024)");
    return static_cast<int>(n);
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

}  // namespace stepfuse::detail
