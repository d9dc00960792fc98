// The CPU backend's thread pool.
#include "runtime/thread_pool.hpp"

#include <cstdlib>
#include <map>
#include <memory>

#include "stepfuse/error.hpp"

namespace stepfuse::detail {

namespace {
// Spin this many polls before sleeping: covers the gap between the passes of
// one step (a few microseconds) without burning a core between steps.
constexpr int kSpinPolls = 20000;
}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads < 1) throw Error(ErrorCode::invalid_argument, "thread pool: threads = " + std::to_string(threads) + " (must be >= 1)");
  workers_.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) workers_.emplace_back([this, t] { worker(t); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  generation_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_impl(Thunk thunk, void* fn) {
  if (workers_.empty()) {
    thunk(fn, 0);
    return;
  }
  std::lock_guard<std::mutex> lock(run_mutex_);
  thunk_ = thunk;
  fn_ = fn;
  pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  thunk(fn, 0);
  for (int spin = 0; spin < kSpinPolls; ++spin)
    if (pending_.load(std::memory_order_acquire) == 0) return;
  for (int left; (left = pending_.load(std::memory_order_acquire)) != 0;) pending_.wait(left);
}

void ThreadPool::worker(int index) {
  std::uint32_t seen = 0;
  for (;;) {
    std::uint32_t gen = generation_.load(std::memory_order_acquire);
    for (int spin = 0; gen == seen && spin < kSpinPolls; ++spin) gen = generation_.load(std::memory_order_acquire);
    while (gen == seen) {
      generation_.wait(seen);
      gen = generation_.load(std::memory_order_acquire);
    }
    seen = gen;
    if (stop_.load()) return;
    thunk_(fn_, index);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

ThreadPool& ThreadPool::shared(int threads) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  std::lock_guard<std::mutex> lock(mutex);
  auto& pool = pools[threads];
  if (!pool) pool = std::make_unique<ThreadPool>(threads);
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
