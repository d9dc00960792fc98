#include "runtime/cpu/llvm_backend.hpp"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <new>
#include <string_view>
#include <thread>

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "jit/kernel_cache.hpp"
#include "stepfuse/error.hpp"

namespace stepfuse::cpu {

CpuBackend resolve_cpu_backend(const std::optional<CpuBackend>& option) {
  if (option) return *option;
  const char* env = std::getenv("STEPFUSE_CPU_BACKEND");
  if (env == nullptr || *env == '\0') return CpuBackend::automatic;
  const std::string_view v(env);
  if (v == "auto") return CpuBackend::automatic;
  if (v == "highway") return CpuBackend::highway;
  if (v == "llvm") return CpuBackend::llvm;
  throw Error(ErrorCode::invalid_argument,
              "STEPFUSE_CPU_BACKEND = '" + std::string(v) + "' is not a CPU backend (use auto, highway or llvm)");
}

namespace {
// Set in a child of fork() that inherited builds (queued, or compiling in the parent's
// thread, which the child does not have).
std::atomic<bool> g_builds_after_fork{false};
}  // namespace

// The process's compile thread. It starts with the first background build and
// is joined at exit (after at most the compile in progress), before the kernel
// cache it writes to is destroyed.
class CompileThread {
 public:
  static CompileThread& get() {
    static CompileThread* thread = new CompileThread();  // joined by the atexit handler, never deleted
    return *thread;
  }

  void push(std::shared_ptr<JitBuild> build, jit::CpuSpec spec, std::shared_ptr<const void> keep_alive) {
    build->keep_alive_ = std::move(keep_alive);  // this thread holds `build` while it compiles
    {
      std::lock_guard lock(mu_);
      queue_.push_back({std::move(build), std::move(spec)});
      start_locked();
    }
    cv_.notify_one();
  }

  // In a child of fork(): the thread for the builds it inherited.
  void resume() {
    {
      std::lock_guard lock(mu_);
      if (!g_builds_after_fork.exchange(false)) return;
      start_locked();
    }
    cv_.notify_one();
  }

 private:
  struct Item {
    std::weak_ptr<JitBuild> build;
    jit::CpuSpec spec;
  };

  CompileThread() {
    jit::KernelCache::shared();  // constructed first, so destroyed after the thread is joined
    std::atexit([] { get().stop(); });
    // fork(): mu_ is held across it (it guards only queue operations), so the child's
    // queue is whole. The child has no compile thread: the spec the parent's thread was
    // compiling goes back to the front of the queue, and the child starts a thread of its
    // own for its queue at its next build or poll (resume_after_fork).
    pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); },
                   [] {
                     CompileThread& t = get();
                     new (&t.cv_) std::condition_variable();  // its waiter was the parent's thread
                     new (&t.thread_) std::thread();  // the parent's thread: not ours to join
                     // (A build that is ready already is not compiled again: its kernels may be in use.)
                     if (auto b = t.current_.build.lock(); b && !b->ready_.load()) t.queue_.push_front(std::move(t.current_));
                     t.current_ = Item{};
                     g_builds_after_fork.store(!t.queue_.empty() && !t.stopping_);
                     t.mu_.unlock();
                   });
  }

  void start_locked() {
    if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { run(); });
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void run() {
    // Below the step's threads: compiling must not slow the steps it is meant to speed up.
    setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);
    for (;;) {
      {
        std::unique_lock lock(mu_);
        current_ = Item{};
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        current_ = std::move(queue_.front());  // kept for a fork() during the compile
        queue_.pop_front();
      }
      const std::shared_ptr<JitBuild> build = current_.build.lock();
      if (!build) continue;  // its optimizer is gone
      try {
        build->kernels_ = jit::cpu_kernels(current_.spec);
      } catch (const std::exception& e) {
        build->error_ = e.what();
      }
      build->ready_.store(true, std::memory_order_release);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  Item current_;  // what the thread compiles (written under mu_, read by the thread)
  bool stopping_ = false;
  std::thread thread_;
};

void resume_after_fork() {
  if (g_builds_after_fork.load(std::memory_order_relaxed)) CompileThread::get().resume();
}

std::shared_ptr<JitBuild> build_in_background(jit::CpuSpec spec, std::shared_ptr<const void> keep_alive) {
  auto build = std::make_shared<JitBuild>();
  CompileThread::get().push(build, std::move(spec), std::move(keep_alive));
  return build;
}

}  // namespace stepfuse::cpu
