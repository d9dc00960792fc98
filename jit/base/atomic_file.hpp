// Internal: writing a file so that readers see the old file or the whole new one, never a part.
//
// Shared by the kernel cache's entries (jit/kernel_cache.cpp), which must never fail a
// step, and checkpoints (runtime/checkpoint_file.cpp), which throw Error(io_error): so it
// reports a failure by value and each caller words it its own way.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

namespace stepfuse::detail {

// Where the bytes of an atomic write go. A failed write is remembered and every later
// one does nothing, so a producer can write all its pieces and let the caller look once.
class AtomicFileSink {
 public:
  explicit AtomicFileSink(int fd) : fd_(fd) {}
  void write(const void* data, std::size_t n);
  // The errno of the first failed write, or 0.
  int error() const { return error_; }

 private:
  int fd_;
  int error_ = 0;
};

// Why an atomic write failed: the step ("creating a temporary file", "writing",
// "syncing", "closing", "renaming"), the errno, and the temporary file's path.
struct AtomicWriteFailure {
  std::string step;
  int error = 0;
  std::filesystem::path temp_path;
  // "<step> '<temp_path>' failed: <strerror(error)>", for messages.
  std::string describe() const;
};

// Writes `path` atomically: creates a temporary file with `mode` (less the umask) beside
// it in the same directory (".<name>.tmp-<pid>-<n>", a hidden name that never ends like
// the target), lets `fill` write the bytes, fsyncs it, closes it, renames it over
// `path`, then fsyncs the directory so the rename itself survives a crash (best effort).
// Returns nothing on success, else where it failed; the temporary file is then removed
// and `path` is as it was. Throws only what `fill` throws (the temporary is removed
// first) and std::bad_alloc.
std::optional<AtomicWriteFailure> write_file_atomically(const std::filesystem::path& path, mode_t mode,
                                                        const std::function<void(AtomicFileSink&)>& fill);

// The same, with every name relative to the open directory `dir_fd`: `name` is a file
// name in it (no '/'), the temporary file is created there with O_NOFOLLOW, renamed
// with renameat() and the directory synced through `dir_fd`. For a caller that opened
// and checked its directory once and must not follow its path again (the kernel cache,
// docs/architecture.md §6). temp_path in a failure is the temporary file's name.
std::optional<AtomicWriteFailure> write_file_atomically_at(int dir_fd, const std::string& name, mode_t mode,
                                                           const std::function<void(AtomicFileSink&)>& fill);

}  // namespace stepfuse::detail
