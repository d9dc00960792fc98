// Writing a file atomically: temporary file, fsync, rename, directory fsync.
#include "jit/base/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "jit/base/fd.hpp"

namespace stepfuse::detail {

namespace {

// With the pid, tells apart the temporary files of every thread of every process.
std::atomic<std::uint64_t> g_temp_counter{0};

// Removes the temporary file unless the rename took it.
struct TempName {
  std::filesystem::path path;
  bool owned = false;
  ~TempName() {
    if (owned) ::unlink(path.c_str());
  }
};

}  // namespace

void AtomicFileSink::write(const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0 && error_ == 0) {
    // At most 1 GiB a call: Linux writes at most about 2 GiB at once anyway.
    const ssize_t w = ::write(fd_, p, std::min<std::size_t>(n, std::size_t{1} << 30));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      error_ = w < 0 ? errno : EIO;
      return;
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

std::string AtomicWriteFailure::describe() const {
  std::string s = step;
  s += " '";
  s += temp_path.string();
  s += "' failed: ";
  s += std::strerror(error);
  return s;
}

namespace {

// Removes a temporary file (by name, relative to a directory fd) unless the rename took it.
struct TempNameAt {
  int dir_fd;
  std::string name;
  bool owned = false;
  ~TempNameAt() {
    if (owned) ::unlinkat(dir_fd, name.c_str(), 0);
  }
};

}  // namespace

std::optional<AtomicWriteFailure> write_file_atomically_at(int dir_fd, const std::string& name, mode_t mode,
                                                           const std::function<void(AtomicFileSink&)>& fill) {
  // ".<name>.tmp-<pid>-<n>", as write_file_atomically names it.
  std::string prefix = ".";
  prefix += name;
  prefix += ".tmp-";
  prefix += std::to_string(::getpid());
  prefix += '-';
  TempNameAt temp{dir_fd, {}};
  const auto failed = [&](const char* step, int err) {
    return std::optional<AtomicWriteFailure>(AtomicWriteFailure{step, err, temp.name});
  };
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    temp.name = prefix + std::to_string(g_temp_counter.fetch_add(1));
    fd = ::openat(dir_fd, temp.name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return failed("creating a temporary file", errno);
  temp.owned = true;
  Fd file(fd);
  AtomicFileSink sink(fd);
  fill(sink);
  if (sink.error() != 0) return failed("writing", sink.error());
  if (::fsync(fd) != 0) return failed("syncing", errno);
  if (!file.close()) return failed("closing", errno);
  if (::renameat(dir_fd, temp.name.c_str(), dir_fd, name.c_str()) != 0) return failed("renaming", errno);
  temp.owned = false;
  ::fsync(dir_fd);  // the rename made durable; best effort: the new file is complete either way
  return std::nullopt;
}

std::optional<AtomicWriteFailure> write_file_atomically(const std::filesystem::path& path, mode_t mode,
                                                        const std::function<void(AtomicFileSink&)>& fill) {
  const std::filesystem::path dir = path.parent_path();
  // ".<name>.tmp-<pid>-<n>". (Appended piece by piece: g++ 12 warns falsely
  // (-Wrestrict, GCC bug 105329) on "literal" + std::string&&.)
  std::string prefix = ".";
  prefix += path.filename().string();
  prefix += ".tmp-";
  prefix += std::to_string(::getpid());
  prefix += '-';
  TempName temp;
  const auto failed = [&](const char* step, int err) {
    return std::optional<AtomicWriteFailure>(AtomicWriteFailure{step, err, temp.path});
  };

  int fd = -1;
  // A name left by a crashed process whose pid this one reuses is skipped, a few times.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    temp.path = dir / (prefix + std::to_string(g_temp_counter.fetch_add(1)));
    fd = ::open(temp.path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return failed("creating a temporary file", errno);  // not ours to remove
  temp.owned = true;
  Fd file(fd);

  AtomicFileSink sink(fd);
  fill(sink);
  if (sink.error() != 0) return failed("writing", sink.error());
  // Data on disk before the rename makes it visible: otherwise a crash could leave a
  // complete-looking name over incomplete data.
  if (::fsync(fd) != 0) return failed("syncing", errno);
  if (!file.close()) return failed("closing", errno);
  if (::rename(temp.path.c_str(), path.c_str()) != 0) return failed("renaming", errno);
  temp.owned = false;
  // Make the rename itself durable. Best effort: the new file is complete either way.
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return std::nullopt;
}

}  // namespace stepfuse::detail
