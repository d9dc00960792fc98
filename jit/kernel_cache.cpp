// The kernel cache: an in-memory map with compile-once slots in front of a directory of entry files.
#include "jit/kernel_cache.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

// Header-only: nothing to link (see the find_path in CMakeLists.txt).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <string_view>
#include <utility>
#include <vector>

#include "jit/base/atomic_file.hpp"
#include "jit/base/fd.hpp"
#include "jit/base/warning.hpp"

#if !defined(XXH_VERSION_NUMBER) || XXH_VERSION_NUMBER < 800
#error "the kernel cache needs xxHash 0.8 or newer (XXH3); install a newer libxxhash-dev"
#endif

namespace stepfuse::jit {

// An entry file, all integers little-endian:
//
//   offset  size  field
//        0     8  magic "SFKCACHE"
//        8     4  u32 format version (kFormatVersion)
//       12     4  u32 flags (0; any other value is rejected)
//       16     8  u64 key length K
//       24     8  u64 payload length P
//       32     K  the key text
//     32+K     P  the payload (the compiled bytes)
//   32+K+P     8  u64 XXH3_64 (seed 0) of bytes [0, 32+K+P)
//
// The file is named by the key's XXH3_128 (32 lowercase hex digits of its canonical,
// big-endian form) + ".sfk". The key is stored so that a hash collision, or an entry
// whose name was computed differently, is told apart from a hit. Bump kFormatVersion
// when this layout, or the meaning of any field, changes; old entries are then
// rejected and recompiled.
namespace {

constexpr char kMagic[8] = {'S', 'F', 'K', 'C', 'A', 'C', 'H', 'E'};
constexpr std::uint32_t kFormatVersion = 1;
constexpr std::size_t kHeaderSize = 32;
constexpr std::size_t kTrailerSize = 8;

void put_u32(unsigned char* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
std::uint32_t get_u32(const unsigned char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(p[i]) << (8 * i);
  return v;
}
std::uint64_t get_u64(const unsigned char* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
  return v;
}

// XXH3_64 of header + key + payload, streamed so the payload is not copied.
std::uint64_t entry_checksum(const unsigned char* header, const std::string& key, const std::string& payload) {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  XXH3_64bits_update(&state, header, kHeaderSize);
  XXH3_64bits_update(&state, key.data(), key.size());
  XXH3_64bits_update(&state, payload.data(), payload.size());
  return XXH3_64bits_digest(&state);
}

std::string hex_name(const std::string& key) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits(key.data(), key.size()));
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string name;
  name.reserve(32 + 4);
  for (unsigned char byte : canonical.digest) {
    name += kDigits[byte >> 4];
    name += kDigits[byte & 15];
  }
  return name;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

std::string errno_text(int err) { return std::strerror(err); }

std::string octal_mode(mode_t mode) {
  char text[8];
  std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode & 07777));
  return text;
}

bool read_all(int fd, void* data, std::size_t size) {
  auto* p = static_cast<char*>(data);
  while (size > 0) {
    const ssize_t n = ::read(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // an error, or the file shrank under us
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return true;
}

// mkdir -p with mode 0700 for every directory it creates: the parents too, since a
// fresh ~/.cache is as private as the cache itself. Returns 0 or an errno.
int make_directories(const std::filesystem::path& dir) {
  std::filesystem::path prefix;
  for (const auto& part : dir) {
    prefix /= part;
    if (part.empty() || part == prefix.root_path()) continue;
    if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) return errno;
  }
  return 0;
}

// The cache directory, opened, or why it cannot hold the cache (fd -1).
struct OpenedDirectory {
  int fd = -1;
  std::string problem;
};

// Opens `dir` (after creating it if missing) and checks the directory it opened. The
// entries are machine code this process will run, so the directory must be private:
// owned by us and writable by no one else (docs/architecture.md §6). It is opened with
// O_NOFOLLOW, so the directory itself may not be a symbolic link (its parents may):
// what a link points to is decided by whoever can change the link. The checks are made
// on the open directory (fstat), and the caller keeps it open and never follows the
// path again, so the directory checked is the directory used.
OpenedDirectory open_directory(const std::filesystem::path& dir) {
  const std::string shown = dir.string();
  const std::string memory_only = "; kernels are compiled in memory only (";
  const auto fail = [](std::string problem) { return OpenedDirectory{-1, std::move(problem)}; };
  if (dir.empty()) {
    return fail("kernel cache directory is an empty path; kernels are compiled in memory only (set "
                "STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")");
  }
  const auto open_dir = [&] { return ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC); };
  int fd = open_dir();
  if (fd < 0) {
    const int open_error = errno;
    struct stat st {};
    if (::lstat(dir.c_str(), &st) == 0) {
      if (S_ISLNK(st.st_mode)) {
        std::error_code ec;
        const std::filesystem::path target = std::filesystem::read_symlink(dir, ec);
        return fail("kernel cache directory " + shown + " is a symbolic link" +
                    (ec ? std::string() : " (to " + target.string() + ")") +
                    ", and cached kernels are code this process runs: the directory itself must not be a link, "
                    "whose target whoever can change the link decides" + memory_only +
                    "set STEPFUSE_CACHE_DIR to the real directory, or to \"off\")");
      }
      if (!S_ISDIR(st.st_mode)) {
        return fail("kernel cache directory " + shown + " exists but is not a directory" + memory_only +
                    "remove it or set STEPFUSE_CACHE_DIR to a directory of your own)");
      }
      return fail("kernel cache directory " + shown + " cannot be opened (" + errno_text(open_error) + ")" +
                  memory_only + "fix its permissions to 0700 or set STEPFUSE_CACHE_DIR)");
    }
    // ENOTDIR (a parent is a file): mkdir then says why it cannot be created.
    if (errno != ENOENT && errno != ENOTDIR) {
      return fail("kernel cache directory " + shown + " cannot be examined (" + errno_text(errno) + ")" +
                  memory_only + "check the path or set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")");
    }
    if (const int err = make_directories(dir); err != 0) {
      return fail("kernel cache directory " + shown + " cannot be created (" + errno_text(err) + ")" + memory_only +
                  "create it with mode 0700 or set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")");
    }
    fd = open_dir();
    if (fd < 0) {
      return fail("kernel cache directory " + shown + " cannot be opened after creating it (" + errno_text(errno) +
                  ")" + memory_only + "set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")");
    }
  }
  detail::Fd opened(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return fail("kernel cache directory " + shown + " cannot be examined (" + errno_text(errno) + ")" + memory_only +
                "check the path or set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")");
  }
  if (st.st_uid != ::geteuid()) {
    return fail("kernel cache directory " + shown + " is owned by uid " + std::to_string(st.st_uid) +
                ", not by this user (uid " + std::to_string(::geteuid()) +
                "), and cached kernels are code this process runs" + memory_only +
                "set STEPFUSE_CACHE_DIR to a directory of your own)");
  }
  // Strict: no write permission for group or others at all (a sticky bit does not make
  // a shared directory private).
  if ((st.st_mode & 022) != 0) {
    return fail("kernel cache directory " + shown + " is writable by other users (mode " + octal_mode(st.st_mode) +
                "), and cached kernels are code this process runs" + memory_only +
                "fix its permissions to 0700 or set STEPFUSE_CACHE_DIR)");
  }
  // AT_EACCESS: the effective uid decides, as it does for the writes themselves.
  if (::faccessat(fd, ".", W_OK | X_OK, AT_EACCESS) != 0) {
    return fail("kernel cache directory " + shown + " is not writable by this user (mode " + octal_mode(st.st_mode) +
                ")" + memory_only + "fix its permissions to 0700 or set STEPFUSE_CACHE_DIR)");
  }
  return OpenedDirectory{std::exchange(opened.fd, -1), {}};
}

// An entry's file name: 32 hex digits and ".sfk".
std::string entry_name(const std::string& key) { return hex_name(key) + ".sfk"; }

bool is_entry_name(std::string_view name) {
  if (name.size() != 36 || name.substr(32) != ".sfk") return false;
  return std::all_of(name.begin(), name.begin() + 32, [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// A temporary file of write_file_atomically_at: ".<entry name>.tmp-<pid>-<n>".
bool is_temp_name(std::string_view name) {
  return name.size() > 1 + 36 + 5 && name[0] == '.' && is_entry_name(name.substr(1, 36)) &&
         name.substr(37, 5) == ".tmp-";
}

// A temporary file this old was left by a writer that died (a write takes milliseconds).
constexpr time_t kStaleTempSeconds = 10 * 60;

// STEPFUSE_CACHE_MAX_SIZE: decimal bytes, or with a K, M or G suffix (powers of 1024,
// either case). Nothing for anything else.
std::optional<std::uint64_t> parse_size(std::string_view text) {
  std::uint64_t unit = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'k': case 'K': unit = std::uint64_t{1} << 10; break;
      case 'm': case 'M': unit = std::uint64_t{1} << 20; break;
      case 'g': case 'G': unit = std::uint64_t{1} << 30; break;
      default: break;
    }
    if (unit != 1) text.remove_suffix(1);
  }
  if (text.empty() || text.size() > 19) return std::nullopt;  // 19 digits cannot overflow 64 bits
  std::uint64_t n = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + static_cast<std::uint64_t>(c - '0');
  }
  if (n > ~std::uint64_t{0} / unit) return std::nullopt;
  return n * unit;
}

std::uint64_t max_disk_bytes_from_environment() {
  const char* env = std::getenv("STEPFUSE_CACHE_MAX_SIZE");
  if (env == nullptr || *env == '\0') return KernelCache::kDefaultMaxDiskBytes;
  if (const auto bytes = parse_size(env)) return *bytes;
  detail::warn_once(std::string("kernel_cache_max_size:") + env,
                    std::string("STEPFUSE_CACHE_MAX_SIZE = '") + env +
                        "' is not a size (use bytes, or a number with a K, M or G suffix, or 0 for no cap); the "
                        "kernel cache keeps at most the default, 1G, of entries on disk");
  return KernelCache::kDefaultMaxDiskBytes;
}

}  // namespace

// A key's entry in memory. `value` is set (under the cache's mutex) once the bytes
// are known; until then `pending` is what other threads asking for the key wait on.
// `pending` is written before the slot is published and never after, so waiters
// read it without the lock.
struct KernelCache::Slot {
  std::shared_ptr<const std::string> value;
  std::shared_future<std::shared_ptr<const std::string>> pending;
};

// fork(): a child has only the thread that forked. A slot still pending in the parent
// (a compile or load by another thread) would be waited for forever there, so the child
// forgets the pending slots and loads or compiles those keys itself. The cache's locks
// are held across the fork, so the child's copies are consistent and free.
struct KernelCache::ForkHandlers {
  std::mutex mutex;  // guards caches
  std::vector<KernelCache*> caches;

  static ForkHandlers& get() {
    static ForkHandlers* const handlers = [] {
      auto* h = new ForkHandlers();  // never destroyed: caches may be destroyed during exit
      pthread_atfork(&prepare, &parent, &child);
      return h;
    }();
    return *handlers;
  }
  static void prepare() {
    ForkHandlers& h = get();
    h.mutex.lock();
    for (KernelCache* c : h.caches) {
      c->sweep_mu_.lock();
      c->mu_.lock();
    }
  }
  static void parent() {
    ForkHandlers& h = get();
    for (KernelCache* c : h.caches) {
      c->mu_.unlock();
      c->sweep_mu_.unlock();
    }
    h.mutex.unlock();
  }
  static void child() {
    ForkHandlers& h = get();
    for (KernelCache* c : h.caches) {
      for (auto it = c->slots_.begin(); it != c->slots_.end();) {
        if (it->second->value) ++it;
        else it = c->slots_.erase(it);
      }
      c->mu_.unlock();
      c->sweep_mu_.unlock();
    }
    h.mutex.unlock();
  }
};

KernelCache::KernelCache(std::optional<std::filesystem::path> dir) : dir_(std::move(dir)) {
  max_disk_bytes_ = max_disk_bytes_from_environment();
  if (dir_) {
    // Absolute now, for messages (the directory itself is held open from here on).
    std::error_code ec;
    if (!dir_->empty()) {
      if (auto absolute = std::filesystem::absolute(*dir_, ec); !ec) dir_ = std::move(absolute);
    }
    OpenedDirectory opened = open_directory(*dir_);
    if (opened.fd < 0) {
      disable_disk(opened.problem);
    } else {
      dir_fd_ = opened.fd;
      disk_ok_ = true;
      sweep(std::string());
    }
  }
  // Last, once nothing can throw any more (a constructor that throws runs no destructor
  // to take it out again).
  try {
    ForkHandlers& h = ForkHandlers::get();
    std::lock_guard lock(h.mutex);
    h.caches.push_back(this);
  } catch (...) {
    if (dir_fd_ >= 0) ::close(dir_fd_);
    throw;
  }
}

KernelCache::~KernelCache() {
  {
    ForkHandlers& h = ForkHandlers::get();
    std::lock_guard lock(h.mutex);
    if (auto it = std::find(h.caches.begin(), h.caches.end(), this); it != h.caches.end()) h.caches.erase(it);
  }
  if (dir_fd_ >= 0) ::close(dir_fd_);
}

KernelCache& KernelCache::shared() {
  // Never destroyed: code running in other static destructors may still compile.
  static KernelCache* const cache = new KernelCache(default_dir());
  return *cache;
}

std::optional<std::filesystem::path> KernelCache::default_dir() {
  if (const char* env = std::getenv("STEPFUSE_CACHE_DIR")) {
    const std::string_view value = env;
    if (value.empty() || value == "off") return std::nullopt;
    return std::filesystem::path(value);
  }
  // The XDG base directory spec says to ignore a relative XDG_CACHE_HOME.
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && xdg[0] == '/') {
    return std::filesystem::path(xdg) / "stepfuse";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && home[0] != '\0') {
    return std::filesystem::path(home) / ".cache" / "stepfuse";
  }
  return std::nullopt;
}

std::shared_ptr<const std::string> KernelCache::find(const std::string& key) {
  std::lock_guard lock(mu_);
  const auto it = slots_.find(key);
  if (it == slots_.end() || !it->second->value) return nullptr;
  ++stats_.memory_hits;
  return it->second->value;
}

std::shared_ptr<const std::string> KernelCache::find_or_load(const std::string& key) {
  if (auto value = find(key)) return value;
  if (!disk_ok_.load(std::memory_order_relaxed)) return nullptr;
  auto bytes = load_from_disk(key);
  if (!bytes) return nullptr;
  auto value = std::make_shared<const std::string>(std::move(*bytes));
  std::lock_guard lock(mu_);
  std::shared_ptr<Slot>& slot = slots_[key];
  if (!slot) {
    slot = std::make_shared<Slot>();
    slot->value = value;
  } else if (slot->value) {
    return slot->value;  // another thread got there first: one copy in memory
  }
  return value;  // (a slot still pending: its owner fills it in)
}

std::shared_ptr<const std::string> KernelCache::get(const std::string& key,
                                                     const std::function<std::string()>& compile) {
  std::shared_ptr<Slot> slot;
  std::promise<std::shared_ptr<const std::string>> promise;
  bool owner = false;
  {
    std::lock_guard lock(mu_);
    if (auto it = slots_.find(key); it != slots_.end()) {
      slot = it->second;
      if (slot->value) {
        ++stats_.memory_hits;
        return slot->value;
      }
    } else {
      slot = std::make_shared<Slot>();
      slot->pending = promise.get_future().share();
      slots_.emplace(key, slot);
      owner = true;
    }
  }

  if (!owner) {
    // Another thread is loading or compiling this key: wait for it, and share its
    // result or its exception.
    auto value = slot->pending.get();
    std::lock_guard lock(mu_);
    ++stats_.memory_hits;
    return value;
  }

  // This thread owns the slot: load or compile, without the lock.
  std::shared_ptr<const std::string> value;
  bool compiled = false;
  try {
    if (disk_ok_.load(std::memory_order_relaxed)) {
      if (auto bytes = load_from_disk(key)) value = std::make_shared<const std::string>(std::move(*bytes));
    }
    if (!value) {
      const auto start = std::chrono::steady_clock::now();
      const auto count_compile = [&] {
        const double ms = ms_since(start);
        std::lock_guard lock(mu_);
        ++stats_.compiles;
        stats_.compile_ms += ms;
        stats_.last_compile_ms = ms;
      };
      std::string bytes;
      try {
        bytes = compile();
      } catch (...) {
        count_compile();
        throw;
      }
      count_compile();
      value = std::make_shared<const std::string>(std::move(bytes));
      compiled = true;
    }
  } catch (...) {
    // Nothing is cached: forget the slot (unless clear_memory() already did and a
    // new one took its place), so that a later get() tries again.
    {
      std::lock_guard lock(mu_);
      if (auto it = slots_.find(key); it != slots_.end() && it->second == slot) slots_.erase(it);
    }
    promise.set_exception(std::current_exception());
    throw;
  }
  {
    std::lock_guard lock(mu_);
    slot->value = value;
  }
  // Waiters go on now; the write below is for later processes.
  promise.set_value(value);
  if (compiled && disk_ok_.load(std::memory_order_relaxed)) store_to_disk(key, *value);
  return value;
}

void KernelCache::evict(const std::string& key) noexcept {
  try {
    {
      std::lock_guard lock(mu_);
      if (auto it = slots_.find(key); it != slots_.end() && it->second->value) slots_.erase(it);
    }
    if (dir_fd_ < 0) return;
    if (::unlinkat(dir_fd_, entry_name(key).c_str(), 0) == 0) {
      std::lock_guard lock(mu_);
      ++stats_.disk_evictions;
    }
  } catch (const std::exception&) {
    // Out of memory for the name: the entry stays; it is checked again when loaded.
  }
}

bool KernelCache::disk_enabled() const { return disk_ok_.load(std::memory_order_relaxed); }

std::filesystem::path KernelCache::entry_path(const std::string& key) const {
  if (!dir_) return {};
  return *dir_ / entry_name(key);
}

CacheStats KernelCache::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void KernelCache::clear_memory() {
  std::lock_guard lock(mu_);
  // In-progress slots are dropped too: their owners still hand the result to the
  // threads already waiting, and only the map forgets them.
  slots_.clear();
  stats_ = CacheStats{};
}

void KernelCache::disable_disk(const std::string& why) {
  disk_ok_ = false;
  // One warning per directory and process, however many caches use it.
  detail::warn_once("kernel_cache_dir:" + (dir_ ? dir_->string() : std::string()), why);
}

// Returns the payload of a good entry for `key`; nothing for a missing entry (a
// miss) or a bad one (a reject, counted). Never throws: a disk problem is a miss.
std::optional<std::string> KernelCache::load_from_disk(const std::string& key) {
  const auto start = std::chrono::steady_clock::now();
  const auto reject = [this] {
    std::lock_guard lock(mu_);
    ++stats_.disk_rejects;
    return std::nullopt;
  };
  // An entry this cache did not write as it writes them (only this user, or root, can
  // put files in a private directory): not loaded, one warning per directory.
  const auto refuse = [&](const std::string& problem) {
    detail::warn_once("kernel_cache_entry:" + dir_->string(),
                      "kernel cache entry " + entry_path(key).string() + " " + problem +
                          ", and cached kernels are code this process runs: it was not loaded; the kernel is "
                          "compiled and the entry rewritten (check what else writes to " + dir_->string() + ")");
    return reject();
  };
  try {
    // O_NOFOLLOW: a symbolic link is refused, not followed; O_NONBLOCK: opening a FIFO
    // does not wait for a writer (it is then refused as not a regular file).
    detail::Fd file(::openat(dir_fd_, entry_name(key).c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (file.fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      if (errno == ELOOP) return refuse("is a symbolic link");
      return reject();
    }
    struct stat st {};
    if (::fstat(file.fd, &st) != 0) return reject();
    if (!S_ISREG(st.st_mode)) return refuse("is not a regular file");
    if (st.st_uid != ::geteuid())
      return refuse("is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
                    std::to_string(::geteuid()) + ")");
    if ((st.st_mode & 022) != 0) return refuse("is writable by group or others (mode " + octal_mode(st.st_mode) + ")");
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (size < kHeaderSize + kTrailerSize) return reject();

    std::array<unsigned char, kHeaderSize> header;
    if (!read_all(file.fd, header.data(), header.size())) return reject();
    if (std::memcmp(header.data(), kMagic, sizeof kMagic) != 0) return reject();
    if (get_u32(header.data() + 8) != kFormatVersion || get_u32(header.data() + 12) != 0) return reject();
    const std::uint64_t key_size = get_u64(header.data() + 16);
    const std::uint64_t payload_size = get_u64(header.data() + 24);
    // A different key length is a different key; checked first, it also bounds the
    // sum below. The size check before any allocation keeps a corrupt length from
    // asking for more memory than the file holds.
    if (key_size != key.size()) return reject();
    if (payload_size > size || size != kHeaderSize + key_size + payload_size + kTrailerSize) return reject();

    std::string stored_key(key_size, '\0');
    if (!read_all(file.fd, stored_key.data(), stored_key.size()) || stored_key != key) return reject();
    std::string payload(payload_size, '\0');
    if (!read_all(file.fd, payload.data(), payload.size())) return reject();
    std::array<unsigned char, kTrailerSize> trailer;
    if (!read_all(file.fd, trailer.data(), trailer.size())) return reject();
    if (get_u64(trailer.data()) != entry_checksum(header.data(), stored_key, payload)) return reject();
    // The size cap evicts the least recently used entries first, by modification time.
    ::futimens(file.fd, nullptr);

    const double ms = ms_since(start);
    std::lock_guard lock(mu_);
    ++stats_.disk_hits;
    stats_.last_disk_load_ms = ms;
    return payload;
  } catch (const std::exception&) {
    // Out of memory for a (checked, so real) huge entry: compile instead.
    return std::nullopt;
  }
}

// Writes the entry atomically (jit/base/atomic_file.hpp), so a reader sees the old
// entry, no entry or the whole new one, never a part; two processes writing one key
// both rename complete files. A failure warns once and turns the disk cache off.
// Never throws.
void KernelCache::store_to_disk(const std::string& key, const std::string& bytes) {
  try {
    const std::filesystem::path final_path = entry_path(key);  // for messages
    const std::string name = entry_name(key);
    std::array<unsigned char, kHeaderSize> header;
    std::memcpy(header.data(), kMagic, sizeof kMagic);
    put_u32(header.data() + 8, kFormatVersion);
    put_u32(header.data() + 12, 0);
    put_u64(header.data() + 16, key.size());
    put_u64(header.data() + 24, bytes.size());
    std::array<unsigned char, kTrailerSize> trailer;
    put_u64(trailer.data(), entry_checksum(header.data(), key, bytes));

    // Mode 0600: the entries are code this process runs, for this user only.
    // Relative to the directory opened at construction, never by its path again.
    const auto failure = detail::write_file_atomically_at(dir_fd_, name, 0600, [&](detail::AtomicFileSink& out) {
      out.write(header.data(), header.size());
      out.write(key.data(), key.size());
      out.write(bytes.data(), bytes.size());
      out.write(trailer.data(), trailer.size());
    });
    if (failure) {
      disable_disk("writing kernel cache entry " + final_path.string() + " failed (" + failure->step + ": " +
                   errno_text(failure->error) + "); the disk cache is off for the rest of this process and kernels "
                   "are compiled in memory only (free space in, or fix, " + dir_->string() +
                   ", or set STEPFUSE_CACHE_DIR)");
      return;
    }
    {
      std::lock_guard lock(mu_);
      ++stats_.disk_writes;
    }
    sweep(name);
  } catch (const std::exception&) {
    // Out of memory building a path: skip this write, keep the entry in memory (the
    // helper has removed its temporary file).
  }
}

void KernelCache::sweep(const std::string& keep) noexcept {
  try {
    std::lock_guard sweeping(sweep_mu_);
    const int fd = ::openat(dir_fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return;
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      ::close(fd);
      return;
    }
    struct Entry {
      std::string name;
      struct timespec mtime;
      std::uint64_t bytes;
    };
    std::vector<Entry> entries;
    std::uint64_t total = 0;
    const time_t now = ::time(nullptr);
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name = e->d_name;
      const bool entry = is_entry_name(name), temp = !entry && is_temp_name(name);
      if (!entry && !temp) continue;  // not the cache's: left alone
      struct stat st {};
      if (::fstatat(dir_fd_, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) continue;  // refused when read, not removed
      if (temp) {
        if (now - st.st_mtime > kStaleTempSeconds) ::unlinkat(dir_fd_, e->d_name, 0);
        continue;
      }
      entries.push_back({std::string(name), st.st_mtim, static_cast<std::uint64_t>(st.st_size)});
      total += static_cast<std::uint64_t>(st.st_size);
    }
    ::closedir(d);
    if (max_disk_bytes_ == 0 || total <= max_disk_bytes_) return;
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
      return a.mtime.tv_sec != b.mtime.tv_sec ? a.mtime.tv_sec < b.mtime.tv_sec : a.mtime.tv_nsec < b.mtime.tv_nsec;
    });
    std::uint64_t evicted = 0;
    for (const Entry& e : entries) {
      if (total <= max_disk_bytes_) break;
      if (e.name == keep) continue;
      // (Another process may have removed or replaced it meanwhile: either way it is gone.)
      if (::unlinkat(dir_fd_, e.name.c_str(), 0) == 0 || errno == ENOENT) {
        total -= e.bytes;
        ++evicted;
      }
    }
    std::lock_guard lock(mu_);
    stats_.disk_evictions += evicted;
  } catch (const std::exception&) {
    // Out of memory listing the directory: no sweep this time.
  }
}

}  // namespace stepfuse::jit
