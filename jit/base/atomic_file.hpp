// Internal: writing a file so that readers see the old file or the whole new one, never a part.
//
// Shared by the kernel cache's entries (jit/kernel_cache.cpp), which must never fail a
// step, and checkpoints (runtime/checkpoint_file.cpp), which throw Error(io_error): so it
// reports a failure by value and each caller words it its own way.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
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
  // Overwrites n bytes at `offset`, bytes write() has already written: a field known
  // only once what follows it is written (a checksum in a header).
  void write_at(std::uint64_t offset, const void* data, std::size_t n);
  // Bytes write() has written so far.
  std::uint64_t written() const { return written_; }
  // The errno of the first failed write, or 0.
  int error() const { return error_; }

 private:
  int fd_;
  int error_ = 0;
  std::uint64_t written_ = 0;
};

// Why an atomic write failed: the step ("opening the directory", "creating a temporary
// file", "writing", "syncing", "closing", "renaming", ...), the errno, and the path the
// step worked on (the temporary file's, or the directory's).
struct AtomicWriteFailure {
  std::string step;
  int error = 0;
  std::filesystem::path temp_path;
  // "<step> '<temp_path>' failed: <strerror(error)>", for messages.
  std::string describe() const;
};

// What write_file_atomically did.
struct AtomicWriteResult {
  // Set: the write failed and `path` is as it was (no temporary file is left).
  std::optional<AtomicWriteFailure> failure;
  // Set on success: the new file is complete and in place, but the directory could not
  // be opened for reading or synced, so after a crash the rename may be undone (the old
  // file back). Callers warn.
  std::optional<AtomicWriteFailure> directory_sync;
  // Temporary files of `path` left by writers that died, removed before this write.
  int stale_temps_removed = 0;
};

// Writes `path` atomically:
//  - removes the temporary files of `path` that writers which died left behind (named
//    as below, owned by this user, not locked, last written over a minute ago);
//  - creates a temporary file beside it, ".<name>.tmp-<pid>-<16 random hex digits>" (a
//    hidden name that never ends like the target; another name is tried if it exists,
//    such as one left by a crashed process whose pid this one reuses), with mode
//    `new_mode` less the umask, then, if `path` exists, the existing file's permission
//    bits (so saving over a 0600 file never widens it). The writer holds an flock on it,
//    which is how a later writer tells a live write from a dead one's leftovers;
//  - lets `fill` write the bytes, fsyncs the file (a failure is a failure: the data may
//    not be on disk), closes it, renames it over `path`, then fsyncs the directory so
//    the rename survives a crash (a failure there is reported in directory_sync).
// On a failure the temporary file is removed and `path` is as it was. Throws only what
// `fill` throws (the temporary is removed first) and std::bad_alloc.
AtomicWriteResult write_file_atomically(const std::filesystem::path& path, mode_t new_mode,
                                        const std::function<void(AtomicFileSink&)>& fill);

// The same write (without the stale-file removal and the mode copy), with every name
// relative to the open directory `dir_fd`: `name` is a file name in it (no '/'), the
// temporary file is created there with O_NOFOLLOW and `mode`, renamed with renameat()
// and the directory synced through `dir_fd` (best effort). For a caller that opened and
// checked its directory once and must not follow its path again (the kernel cache,
// docs/architecture.md §6), and that removes its own stale temporaries. temp_path in a
// failure is the temporary file's name.
std::optional<AtomicWriteFailure> write_file_atomically_at(int dir_fd, const std::string& name, mode_t mode,
                                                           const std::function<void(AtomicFileSink&)>& fill);

}  // namespace stepfuse::detail
