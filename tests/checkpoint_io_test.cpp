// Checkpoint writes whose fsync fails, through an fsync that this test binary defines
// (the library's calls resolve to it; it passes through unless a test asks it to fail):
// a failed sync of the file is an io_error that leaves the old checkpoint and no
// temporary file; a failed sync of the directory after the rename is a warning.
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <string>
#include <vector>

#include "checkpoint_support.hpp"
#include "jit/base/warning.hpp"

namespace {

enum class FailSync { none, files, directories };
std::atomic<FailSync> g_fail_sync{FailSync::none};

}  // namespace

extern "C" int fsync(int fd) {
  const FailSync fail = g_fail_sync.load();
  struct stat st;
  if (fail != FailSync::none && ::fstat(fd, &st) == 0 &&
      (fail == FailSync::files ? S_ISREG(st.st_mode) : S_ISDIR(st.st_mode))) {
    errno = EIO;
    return -1;
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}

namespace stepfuse {
namespace {

using namespace ckpt_test;

std::mutex g_warnings_mutex;
std::vector<std::string> g_warnings;
void record_warning(std::string_view message) {
  std::lock_guard lock(g_warnings_mutex);
  g_warnings.emplace_back(message);
}

// Sets the fsync shim for the scope.
struct FailingSync {
  explicit FailingSync(FailSync what) { g_fail_sync = what; }
  ~FailingSync() { g_fail_sync = FailSync::none; }
};

struct Trained {
  TempDir dir;
  std::string path = dir.file("opt.ckpt");
  Model model = Model::make(kSpec, 3);
  Optimizer opt{optim::AdamW{.lr = 1e-2}, model.params()};
  GradScaler scaler{"cpu", 256.0, 2.0, 0.5, 3};
  Trained() {
    for (int k = 0; k < 2; ++k) iterate(model, opt, scaler, k);
  }
};

TEST(CheckpointSync, AFailedSyncOfTheFileIsAnIoErrorAndKeepsTheOldFile) {
  Trained t;
  t.opt.save(t.path, t.scaler);
  const auto old = read_bytes(t.path);
  iterate(t.model, t.opt, t.scaler, 2);
  std::string message;
  {
    FailingSync failing(FailSync::files);
    EXPECT_EQ(code_of([&] { t.opt.save(t.path, t.scaler); }, &message), ErrorCode::io_error);
  }
  EXPECT_NE(message.find("syncing"), std::string::npos) << message;
  EXPECT_NE(message.find(std::strerror(EIO)), std::string::npos) << message;
  EXPECT_NE(message.find(t.path), std::string::npos) << message;
  EXPECT_EQ(read_bytes(t.path), old);
  EXPECT_EQ(t.dir.entries(), 1u) << "the temporary file is removed";
  t.opt.load(t.path, t.scaler);
  EXPECT_EQ(t.opt.step_count(), 2);
}

// The new file is complete and in place, so the save succeeds; but the rename may not
// survive a crash, which the user hears about (once per directory).
TEST(CheckpointSync, AFailedSyncOfTheDirectoryIsAWarning) {
  Trained t;
  detail::reset_warnings_for_testing();
  const WarningHandler previous = set_warning_handler(&record_warning);
  {
    FailingSync failing(FailSync::directories);
    t.opt.save(t.path, t.scaler);
    t.opt.save(t.path, t.scaler);
  }
  set_warning_handler(previous);
  std::lock_guard lock(g_warnings_mutex);
  ASSERT_EQ(g_warnings.size(), 1u);
  EXPECT_NE(g_warnings[0].find("syncing the directory"), std::string::npos) << g_warnings[0];
  EXPECT_NE(g_warnings[0].find(t.path), std::string::npos) << g_warnings[0];
  EXPECT_NE(g_warnings[0].find(std::strerror(EIO)), std::string::npos) << g_warnings[0];
  t.opt.load(t.path, t.scaler);
  EXPECT_EQ(t.dir.entries(), 1u);
}

}  // namespace
}  // namespace stepfuse
