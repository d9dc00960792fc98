// The kernel cache: compiled kernels (CUBIN, PTX, object code) by spec, in
// memory and on disk (docs/architecture.md §6).
//
// A key is the canonical text of everything the compiled bytes depend on: the
// spec, the compiler and its version, the options, the target, and our format
// version. In memory: a thread-safe map; two threads asking for the same key
// compile it once (the second waits for the first). On disk: one file per key
// in the cache directory, named by the key's 128-bit xxHash, holding the key
// text itself (so a hash collision or a stale entry is detected), the bytes and
// a checksum; written to a temporary file and renamed, so readers see a whole
// entry or none. An unreadable, torn, corrupt or mismatched entry is ignored and
// recompiled (and rewritten). A directory that cannot be used (not creatable,
// not writable, not owned by this user, writable by group or others, or a
// symbolic link itself) warns once and the cache works in memory only. The
// directory is opened and checked once, at construction, and every later file
// operation is relative to that open directory, never to its path again; each
// entry opened is checked too (a private regular file of this user, else it is
// refused with one warning and recompiled). The disk holds at most
// max_disk_bytes() of entries (least recently used go first), and temporary
// files that writers left behind are removed (docs/architecture.md §6).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace stepfuse::jit {

struct CacheStats {
  std::uint64_t memory_hits = 0;     // including threads that waited for another's compile or load
  std::uint64_t disk_hits = 0;
  std::uint64_t compiles = 0;       // misses: the compile function ran (whether or not it threw)
  std::uint64_t disk_writes = 0;
  std::uint64_t disk_rejects = 0;   // entries found on disk but unusable (torn, corrupt, stale, refused)
  std::uint64_t disk_evictions = 0; // entries removed: by evict() and by the size cap
  double compile_ms = 0;            // total time in the compile function
  double last_compile_ms = 0;
  double last_disk_load_ms = 0;
};

class KernelCache {
 public:
  // The default cap on the entries' total size on disk (STEPFUSE_CACHE_MAX_SIZE).
  static constexpr std::uint64_t kDefaultMaxDiskBytes = std::uint64_t{1} << 30;

  // Uses `dir` for the disk cache (created with mode 0700 if missing), opened now
  // and kept open; std::nullopt: memory only. The size cap is read from
  // STEPFUSE_CACHE_MAX_SIZE (bytes, or with a K, M or G suffix; 0: no cap; unset
  // or empty: kDefaultMaxDiskBytes; anything else warns once and uses the default).
  // Removes temporary files older than 10 minutes, and entries beyond the cap.
  explicit KernelCache(std::optional<std::filesystem::path> dir);
  ~KernelCache();
  KernelCache(const KernelCache&) = delete;
  KernelCache& operator=(const KernelCache&) = delete;

  // The process-wide cache. Directory: $STEPFUSE_CACHE_DIR, else
  // $XDG_CACHE_HOME/stepfuse, else $HOME/.cache/stepfuse; STEPFUSE_CACHE_DIR=""
  // or "off" disables the disk cache.
  static KernelCache& shared();
  // The directory the process-wide cache would use (std::nullopt when disabled).
  static std::optional<std::filesystem::path> default_dir();

  // The bytes for `key`: from memory, else from disk, else from compile() (which
  // may throw; nothing is cached then, and the exception propagates to every
  // thread waiting on that key). Thread-safe; compile() and the disk I/O run
  // without the cache's lock, so other keys proceed meanwhile. compile() must not
  // get() its own key (it would wait for itself). Disk problems never throw: a bad
  // entry is recompiled, an unusable directory warns once and turns the disk off.
  std::shared_ptr<const std::string> get(const std::string& key, const std::function<std::string()>& compile);

  // The bytes for `key` if they are in memory (counted as a memory hit), else null.
  // Never compiles and never reads the disk.
  std::shared_ptr<const std::string> find(const std::string& key);

  // The bytes for `key` from memory, else from disk (then kept in memory), else
  // null. Never compiles: for callers that compile elsewhere when it is not cached.
  std::shared_ptr<const std::string> find_or_load(const std::string& key);

  // Forgets `key`: its bytes in memory (a compile in progress for it is left to
  // finish) and its entry on disk. For bytes that passed every check of the cache
  // but proved unusable (an object that does not link), which every later process
  // would otherwise load again. Never throws.
  void evict(const std::string& key) noexcept;

  // The cap on the entries' total size on disk, in bytes (0: none).
  std::uint64_t max_disk_bytes() const { return max_disk_bytes_; }

  // Whether the disk cache is in use (false after a warning disabled it).
  bool disk_enabled() const;
  const std::optional<std::filesystem::path>& dir() const { return dir_; }
  // The file an entry for `key` lives in (whether or not it exists): dir() /
  // (32 hex digits of the key's XXH3-128) + ".sfk"; an empty path without a dir().
  // (For messages and tests: the cache itself opens it relative to its directory.)
  std::filesystem::path entry_path(const std::string& key) const;
  CacheStats stats() const;
  // Forgets the in-memory entries and the counters (tests, benchmarks of cold paths).
  void clear_memory();

 private:
  struct Slot;
  struct ForkHandlers;
  std::optional<std::string> load_from_disk(const std::string& key);
  void store_to_disk(const std::string& key, const std::string& bytes);
  void disable_disk(const std::string& why);
  // Removes temporary files left by dead writers and, beyond the cap, the least
  // recently used entries (never `keep`, the entry just written). Never throws.
  void sweep(const std::string& keep) noexcept;

  std::optional<std::filesystem::path> dir_;
  int dir_fd_ = -1;  // the directory, opened once (O_DIRECTORY | O_NOFOLLOW); -1 without one
  std::uint64_t max_disk_bytes_ = kDefaultMaxDiskBytes;
  std::mutex sweep_mu_;  // one sweep at a time; taken before mu_
  // Cleared (once) by disable_disk() while other threads may be reading it.
  std::atomic<bool> disk_ok_ = false;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Slot>> slots_;
  CacheStats stats_;
};

}  // namespace stepfuse::jit
