// Warnings: the user-replaceable handler and the once-per-cause rule.
#include "jit/base/warning.hpp"

#include <pthread.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>

#include "stepfuse/error.hpp"

namespace stepfuse {

namespace {

void default_handler(std::string_view message) {
  std::fprintf(stderr, "stepfuse: warning: %.*s\n", static_cast<int>(message.size()), message.data());
}

std::atomic<WarningHandler> g_handler{&default_handler};
std::mutex g_seen_mutex;

// fork(): the child has only the forking thread; a lock another thread held at the
// fork would never be released there. Hold it across the fork, release it in both.
[[maybe_unused]] const bool g_fork_handlers = [] {
  pthread_atfork([] { g_seen_mutex.lock(); }, [] { g_seen_mutex.unlock(); }, [] { g_seen_mutex.unlock(); });
  return true;
}();
std::set<std::string, std::less<>>& seen() {
  static std::set<std::string, std::less<>> keys;
  return keys;
}

}  // namespace

WarningHandler set_warning_handler(WarningHandler handler) {
  return g_handler.exchange(handler != nullptr ? handler : &default_handler);
}

namespace detail {

void warn_once(std::string_view key, std::string_view message) {
  {
    std::lock_guard lock(g_seen_mutex);
    if (!seen().emplace(key).second) return;
  }
  g_handler.load()(message);
}

void reset_warnings_for_testing() {
  std::lock_guard lock(g_seen_mutex);
  seen().clear();
}

}  // namespace detail
}  // namespace stepfuse
