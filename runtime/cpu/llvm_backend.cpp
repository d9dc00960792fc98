#include "runtime/cpu/llvm_backend.hpp"

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
      if (!thread_.joinable() && !stopping_) thread_ = std::thread([this] { run(); });
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
    // A child of fork() has no compile thread (and perhaps a lock its parent's thread held):
    // it starts afresh, with a thread of its own at its first build.
    pthread_atfork(nullptr, nullptr, [] {
      CompileThread& t = get();
      new (&t.mu_) std::mutex();
      new (&t.cv_) std::condition_variable();
      new (&t.thread_) std::thread();  // the parent's thread: not ours to join
    });
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
      Item item;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (stopping_) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      const std::shared_ptr<JitBuild> build = item.build.lock();
      if (!build) continue;  // its optimizer is gone
      try {
        build->kernels_ = jit::cpu_kernels(item.spec);
      } catch (const std::exception& e) {
        build->error_ = e.what();
      }
      build->ready_.store(true, std::memory_order_release);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

std::shared_ptr<JitBuild> build_in_background(jit::CpuSpec spec, std::shared_ptr<const void> keep_alive) {
  auto build = std::make_shared<JitBuild>();
  CompileThread::get().push(build, std::move(spec), std::move(keep_alive));
  return build;
}

}  // namespace stepfuse::cpu
