// The CPU thread pool's contract (runtime/thread_pool.hpp): every index runs once, an
// exception on any thread is caught, all threads finish, and the first one is rethrown
// on the caller; a nested run does not deadlock; the shared pools are bounded by the
// largest thread count asked for, not by the number of distinct counts.
#include <gmock/gmock-matchers.h>  // header-only matchers: HasSubstr
#include <gtest/gtest.h>

#include <dirent.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/thread_pool.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse {
namespace {

// The threads of this process, from /proc/self/task.
int process_threads() {
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n;
}

// Waits (boundedly) until the thread count settles at or below `limit`: a thread that
// has been joined may still be listed for a moment.
int threads_settled(int limit) {
  int n = process_threads();
  for (int i = 0; i < 200 && n > limit; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    n = process_threads();
  }
  return n;
}

void expect_each_index_once(detail::ThreadPool& pool) {
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(pool.size()));
  for (int rep = 0; rep < 3; ++rep) pool.run([&](int t) { hits[static_cast<std::size_t>(t)].fetch_add(1); });
  for (int t = 0; t < pool.size(); ++t) EXPECT_EQ(hits[static_cast<std::size_t>(t)].load(), 3) << "thread " << t;
}

TEST(ThreadPool, AThrowOnTheCallerWaitsForEveryWorkerThenRethrows) {
  detail::ThreadPool pool(4);
  std::atomic<int> finished{0};
  try {
    pool.run([&](int t) {
      if (t == 0) throw std::runtime_error("caller failed");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // still running when thread 0 throws
      finished.fetch_add(1);
    });
    FAIL() << "expected the exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "caller failed");
    EXPECT_EQ(finished.load(), 3) << "run() returned while workers still ran fn";
  }
  expect_each_index_once(pool);  // the pool is usable afterwards
}

TEST(ThreadPool, AThrowOnAWorkerReachesTheCaller) {
  detail::ThreadPool pool(4);
  std::atomic<int> finished{0};
  try {
    pool.run([&](int t) {
      if (t == 2) throw Error(ErrorCode::invalid_state, "worker 2 failed");
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      finished.fetch_add(1);
    });
    FAIL() << "expected the exception";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("worker 2 failed"));
    EXPECT_EQ(finished.load(), 3);
  }
  // Every thread throwing: one exception, the pool still usable.
  EXPECT_THROW(pool.run([](int t) { throw std::runtime_error("thread " + std::to_string(t)); }), std::runtime_error);
  expect_each_index_once(pool);
}

TEST(ThreadPool, ASingleThreadPoolRethrowsToo) {
  detail::ThreadPool pool(1);
  EXPECT_THROW(pool.run([](int) { throw std::runtime_error("x"); }), std::runtime_error);
  expect_each_index_once(pool);
}

TEST(ThreadPool, ANestedRunDoesNotDeadlock) {
  detail::ThreadPool& outer = detail::ThreadPool::shared(3);
  detail::ThreadPool& inner = detail::ThreadPool::shared(4);
  std::vector<std::atomic<int>> hits(3 * 4);
  outer.run([&](int t) {
    inner.run([&](int u) { hits[static_cast<std::size_t>(t * 4 + u)].fetch_add(1); });
    outer.run([&](int) {});  // the same pool, from inside its own job
  });
  for (std::size_t i = 0; i < hits.size(); ++i) EXPECT_EQ(hits[i].load(), 1) << i;
}

TEST(ThreadPool, SharedPoolsAreBoundedByTheLargestCount) {
  const int before = process_threads();
  ASSERT_GT(before, 0);
  // Distinct counts 2..9: one pool each, before this was bounded, 1 + 2 + ... + 8 = 36 threads.
  for (int n = 2; n <= 9; ++n) {
    detail::ThreadPool& pool = detail::ThreadPool::shared(n);
    EXPECT_EQ(pool.size(), n);
    EXPECT_EQ(&pool, &detail::ThreadPool::shared(n));
    expect_each_index_once(pool);
  }
  EXPECT_LE(threads_settled(before + 8), before + 8);
  // Smaller pools still run exactly their own indexes after a larger one exists.
  for (int n = 2; n <= 9; ++n) expect_each_index_once(detail::ThreadPool::shared(n));
}

TEST(ThreadPool, PoolsOfDifferentSizesRunConcurrentlyFromSeveralThreads) {
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      detail::ThreadPool& pool = detail::ThreadPool::shared(2 + c);
      for (int rep = 0; rep < 200; ++rep) {
        std::vector<int> hits(static_cast<std::size_t>(pool.size()), 0);
        pool.run([&](int t) { ++hits[static_cast<std::size_t>(t)]; });
        for (int h : hits) bad += h != 1;
      }
    });
  }
  for (auto& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace stepfuse
