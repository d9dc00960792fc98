// The kernel cache: an in-memory map with compile-once slots in front of a directory of entry files.
#include "jit/kernel_cache.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
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

// Why `dir` cannot hold the cache (after creating it if missing), or nothing. The
// entries are machine code this process will run, so the directory must be private:
// owned by us and writable by no one else (docs/architecture.md §6). Only the directory itself is
// checked, not its parents.
std::optional<std::string> check_directory(const std::filesystem::path& dir) {
  const std::string shown = dir.string();
  const std::string memory_only = "; kernels are compiled in memory only (";
  if (dir.empty()) {
    return "kernel cache directory is an empty path; kernels are compiled in memory only (set "
           "STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")";
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    // ENOTDIR (a parent is a file): mkdir then says why it cannot be created.
    if (errno != ENOENT && errno != ENOTDIR) {
      return "kernel cache directory " + shown + " cannot be examined (" + errno_text(errno) + ")" + memory_only +
             "check the path or set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")";
    }
    if (const int err = make_directories(dir); err != 0) {
      return "kernel cache directory " + shown + " cannot be created (" + errno_text(err) + ")" + memory_only +
             "create it with mode 0700 or set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")";
    }
    if (::stat(dir.c_str(), &st) != 0) {
      return "kernel cache directory " + shown + " cannot be examined after creating it (" + errno_text(errno) +
             ")" + memory_only + "set STEPFUSE_CACHE_DIR to a directory of your own, or to \"off\")";
    }
  }
  if (!S_ISDIR(st.st_mode)) {
    return "kernel cache directory " + shown + " exists but is not a directory" + memory_only +
           "remove it or set STEPFUSE_CACHE_DIR to a directory of your own)";
  }
  if (st.st_uid != ::geteuid()) {
    return "kernel cache directory " + shown + " is owned by uid " + std::to_string(st.st_uid) +
           ", not by this user (uid " + std::to_string(::geteuid()) + "), and cached kernels are code this process runs" +
           memory_only + "set STEPFUSE_CACHE_DIR to a directory of your own)";
  }
  if ((st.st_mode & 022) != 0) {
    return "kernel cache directory " + shown + " is writable by other users (mode " + octal_mode(st.st_mode) +
           "), and cached kernels are code this process runs" + memory_only +
           "fix its permissions to 0700 or set STEPFUSE_CACHE_DIR)";
  }
  // AT_EACCESS: the effective uid decides, as it does for the writes themselves.
  if (::faccessat(AT_FDCWD, dir.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    return "kernel cache directory " + shown + " is not writable by this user (mode " + octal_mode(st.st_mode) +
           ")" + memory_only + "fix its permissions to 0700 or set STEPFUSE_CACHE_DIR)";
  }
  return std::nullopt;
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
    for (KernelCache* c : h.caches) c->mu_.lock();
  }
  static void parent() {
    ForkHandlers& h = get();
    for (KernelCache* c : h.caches) c->mu_.unlock();
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
    }
    h.mutex.unlock();
  }
};

KernelCache::KernelCache(std::optional<std::filesystem::path> dir) : dir_(std::move(dir)) {
  {
    ForkHandlers& h = ForkHandlers::get();
    std::lock_guard lock(h.mutex);
    h.caches.push_back(this);
  }
  if (!dir_) return;
  // Absolute now, so that a later chdir() does not move the cache.
  std::error_code ec;
  if (!dir_->empty()) {
    if (auto absolute = std::filesystem::absolute(*dir_, ec); !ec) dir_ = std::move(absolute);
  }
  if (auto problem = check_directory(*dir_)) {
    disable_disk(*problem);
    return;
  }
  disk_ok_ = true;
}

KernelCache::~KernelCache() {
  ForkHandlers& h = ForkHandlers::get();
  std::lock_guard lock(h.mutex);
  if (auto it = std::find(h.caches.begin(), h.caches.end(), this); it != h.caches.end()) h.caches.erase(it);
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

bool KernelCache::disk_enabled() const { return disk_ok_.load(std::memory_order_relaxed); }

std::filesystem::path KernelCache::entry_path(const std::string& key) const {
  if (!dir_) return {};
  return *dir_ / (hex_name(key) + ".sfk");
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
  const std::filesystem::path path = entry_path(key);
  const auto reject = [this] {
    std::lock_guard lock(mu_);
    ++stats_.disk_rejects;
    return std::nullopt;
  };
  try {
    detail::Fd file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (file.fd < 0) {
      if (errno == ENOENT) return std::nullopt;
      return reject();
    }
    struct stat st {};
    if (::fstat(file.fd, &st) != 0 || !S_ISREG(st.st_mode)) return reject();
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
    const std::filesystem::path final_path = entry_path(key);
    std::array<unsigned char, kHeaderSize> header;
    std::memcpy(header.data(), kMagic, sizeof kMagic);
    put_u32(header.data() + 8, kFormatVersion);
    put_u32(header.data() + 12, 0);
    put_u64(header.data() + 16, key.size());
    put_u64(header.data() + 24, bytes.size());
    std::array<unsigned char, kTrailerSize> trailer;
    put_u64(trailer.data(), entry_checksum(header.data(), key, bytes));

    // Mode 0600: the entries are code this process runs, for this user only.
    const auto failure = detail::write_file_atomically(final_path, 0600, [&](detail::AtomicFileSink& out) {
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
    std::lock_guard lock(mu_);
    ++stats_.disk_writes;
  } catch (const std::exception&) {
    // Out of memory building a path: skip this write, keep the entry in memory (the
    // helper has removed its temporary file).
  }
}

}  // namespace stepfuse::jit
