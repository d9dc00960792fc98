// Writing a file atomically: temporary file, fsync, rename, directory fsync.
#include "jit/base/atomic_file.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string_view>
#include <utility>

#include "jit/base/fd.hpp"

namespace stepfuse::detail {

namespace {

namespace fs = std::filesystem;

// Mixed into the random suffix, so that two calls differ even without getrandom().
std::atomic<std::uint64_t> g_temp_counter{0};

// A temporary file older than this that nobody holds locked was left by a writer that
// died. The age keeps a file that a live writer has just created, and not yet locked,
// from being taken for one.
constexpr time_t kStaleTempSeconds = 60;

// ".<name>.tmp-": every temporary file of `name` starts so.
std::string temp_prefix(const std::string& name) {
  // Appended piece by piece: g++ 12 warns falsely (-Wrestrict, GCC bug 105329) on
  // "literal" + std::string&&.
  std::string prefix = ".";
  prefix += name;
  prefix += ".tmp-";
  return prefix;
}

// "<pid>-<16 hex digits>": the pid tells a person whose file it was, the random part
// keeps a restarted process with the same pid (in a container, say) off its
// predecessor's names.
std::string temp_suffix() {
  std::uint64_t r = 0;
  if (::getrandom(&r, sizeof r, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof r)) r = 0;
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  r ^= (g_temp_counter.fetch_add(1) + 1) * 0x9e3779b97f4a7c15ull;
  r ^= static_cast<std::uint64_t>(ts.tv_nsec) << 20 ^ static_cast<std::uint64_t>(ts.tv_sec);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s = std::to_string(::getpid());
  s += '-';
  for (int i = 15; i >= 0; --i) s += kHex[(r >> (4 * i)) & 0xf];
  return s;
}

// Removes a temporary file (by name, relative to a directory fd) unless the rename took it.
struct TempNameAt {
  int dir_fd;
  std::string name;
  bool owned = false;
  ~TempNameAt() {
    if (owned) ::unlinkat(dir_fd, name.c_str(), 0);
  }
};

// The write itself, in the open directory `dir_fd`: a new temporary file (mode `mode`,
// then `keep_mode` if set), filled, synced, closed and renamed over `name`. `shown_dir`
// prefixes the temporary file's name in a failure (empty: the name alone).
std::optional<AtomicWriteFailure> write_in(int dir_fd, const std::string& name, mode_t mode,
                                           std::optional<mode_t> keep_mode, const fs::path& shown_dir,
                                           const std::function<void(AtomicFileSink&)>& fill) {
  const std::string prefix = temp_prefix(name);
  TempNameAt temp{dir_fd, {}};
  const auto failed = [&](const char* step, int err) {
    return std::optional<AtomicWriteFailure>(
        AtomicWriteFailure{step, err, shown_dir.empty() ? fs::path(temp.name) : shown_dir / temp.name});
  };
  int fd = -1;
  // A name that exists (vanishingly unlikely with 64 random bits) is skipped, a few times.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    temp.name = prefix + temp_suffix();
    fd = ::openat(dir_fd, temp.name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return failed("creating a temporary file", errno);  // not ours to remove
  temp.owned = true;
  Fd file(fd);
  // Held until the file is renamed or removed: a later writer's stale-file sweep skips
  // locked files. Where the file system has no locks the sweep cannot lock either.
  ::flock(fd, LOCK_EX | LOCK_NB);
  if (keep_mode && ::fchmod(fd, *keep_mode) != 0) return failed("setting the permissions of", errno);

  AtomicFileSink sink(fd);
  fill(sink);
  if (sink.error() != 0) return failed("writing", sink.error());
  // Data on disk before the rename makes it visible: otherwise a crash could leave a
  // complete-looking name over incomplete data.
  if (::fsync(fd) != 0) return failed("syncing", errno);
  if (!file.close()) return failed("closing", errno);
  if (::renameat(dir_fd, temp.name.c_str(), dir_fd, name.c_str()) != 0) return failed("renaming", errno);
  temp.owned = false;
  return std::nullopt;
}

// Removes the temporary files of `name` in `dir_fd` whose writers died: regular files
// of this user, last written kStaleTempSeconds ago or more, that nobody holds locked.
int remove_stale_temps(int dir_fd, const std::string& name) {
  const std::string prefix = temp_prefix(name);
  const int listing = ::openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (listing < 0) return 0;
  DIR* d = ::fdopendir(listing);
  if (d == nullptr) {
    ::close(listing);
    return 0;
  }
  const time_t now = ::time(nullptr);
  int removed = 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view entry = e->d_name;
    if (entry.size() <= prefix.size() || entry.substr(0, prefix.size()) != prefix) continue;
    struct stat st;
    if (::fstatat(dir_fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || now - st.st_mtime < kStaleTempSeconds) continue;
    const int fd = ::openat(dir_fd, e->d_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    Fd file(fd);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) continue;  // a live writer's, or no locks here
    if (::unlinkat(dir_fd, e->d_name, 0) == 0) ++removed;
  }
  ::closedir(d);
  return removed;
}

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
    written_ += static_cast<std::uint64_t>(w);
  }
}

void AtomicFileSink::write_at(std::uint64_t offset, const void* data, std::size_t n) {
  if (error_ != 0) return;
  if (offset > written_ || n > written_ - offset) {
    error_ = EINVAL;  // not written yet: a caller's mistake, reported as a failed write
    return;
  }
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      error_ = w < 0 ? errno : EIO;
      return;
    }
    p += w;
    n -= static_cast<std::size_t>(w);
    offset += static_cast<std::uint64_t>(w);
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

std::optional<AtomicWriteFailure> write_file_atomically_at(int dir_fd, const std::string& name, mode_t mode,
                                                           const std::function<void(AtomicFileSink&)>& fill) {
  if (auto failure = write_in(dir_fd, name, mode, std::nullopt, {}, fill)) return failure;
  ::fsync(dir_fd);  // the rename made durable; best effort: the new file is complete either way
  return std::nullopt;
}

AtomicWriteResult write_file_atomically(const fs::path& path, mode_t new_mode,
                                        const std::function<void(AtomicFileSink&)>& fill) {
  AtomicWriteResult result;
  const fs::path dir = path.parent_path();
  const fs::path shown_dir = dir.empty() ? fs::path(".") : dir;
  const std::string name = path.filename().string();
  if (name.empty() || name == "." || name == "..") {
    result.failure = AtomicWriteFailure{"naming a file as", EISDIR, path};
    return result;
  }
  // The directory is opened once; every later step works relative to it.
  int dfd = ::open(shown_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  bool can_sync = true;
  if (dfd < 0 && errno == EACCES) {
    // Writable and searchable but not readable (mode 0300): files can still be created
    // there, but the directory cannot be synced or listed.
    const int err = errno;
    dfd = ::open(shown_dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      can_sync = false;
      result.directory_sync = AtomicWriteFailure{"opening the directory", err, shown_dir};
    }
  }
  if (dfd < 0) {
    result.failure = AtomicWriteFailure{"opening the directory", errno, shown_dir};
    return result;
  }
  Fd dir_fd(dfd);
  if (can_sync) result.stale_temps_removed = remove_stale_temps(dfd, name);
  std::optional<mode_t> keep_mode;
  struct stat st;
  if (::fstatat(dfd, name.c_str(), &st, 0) == 0 && S_ISREG(st.st_mode)) keep_mode = st.st_mode & 07777;
  result.failure = write_in(dfd, name, new_mode, keep_mode, shown_dir, fill);
  if (result.failure) {
    result.directory_sync.reset();
    return result;
  }
  // Make the rename itself durable.
  if (can_sync && ::fsync(dfd) != 0) result.directory_sync = AtomicWriteFailure{"syncing the directory", errno, shown_dir};
  return result;
}

}  // namespace stepfuse::detail
