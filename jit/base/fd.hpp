// Internal: an owned POSIX file descriptor, closed on every path out.
#pragma once

#include <unistd.h>

#include <utility>

namespace stepfuse::detail {

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  // Closes now and reports whether close succeeded (after a write, close can report a
  // deferred error, e.g. on NFS).
  bool close() {
    const int f = std::exchange(fd, -1);
    return f < 0 || ::close(f) == 0;
  }
};

}  // namespace stepfuse::detail
