// What stepfuse-bench's CPU and CUDA paths share: exit codes, the two errors the command
// line reports, printf into a string, numbers with commas, the verification's verdict, the
// JSON report's output, and the progress line.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

#include "verify.hpp"

namespace stepfuse::bench {

inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 1;   // bad arguments, or a combination the library rejects
inline constexpr int kExitVerify = 2;  // a mode disagrees with the reference, or a step was skipped
inline constexpr int kExitError = 3;   // anything else (an unexpected library error, out of memory)

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct VerifyError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// printf into a std::string, of any length. Every call passes at least one argument
// (so the format is never a lone non-literal).
template <class... T>
std::string format(const char* fmt, T... args) {
  const int n = std::snprintf(nullptr, 0, fmt, args...);
  if (n <= 0) return {};
  std::string s(static_cast<std::size_t>(n), '\0');
  std::snprintf(s.data(), s.size() + 1, fmt, args...);
  return s;
}

inline std::string with_commas(std::int64_t n) {
  const std::string digits = std::to_string(n);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && digits[i - 1] != '-' && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

// Throws VerifyError unless `vr` is ok: `headline`, then each of its problems and, when
// values disagree, "<mismatches> of <values checked> <mismatch>: <the worst>".
inline void check_verified(const VerifyReport& vr, const std::string& headline, const std::string& mismatch) {
  if (vr.ok()) return;
  std::string msg = headline;
  for (const auto& p : vr.problems) msg += "\n  " + p;
  if (vr.mismatches > 0)
    msg += "\n  " + with_commas(vr.mismatches) + " of " + with_commas(vr.values_checked) + " " + mismatch + ": " + vr.worst;
  throw VerifyError(msg);
}

// The JSON report `text`: to json_out when it is open (--json; the file json_path, named
// when writing fails) and to stdout with --json-only.
inline void write_json_report(const std::string& text, std::ofstream& json_out, const std::string& json_path,
                              bool json_only) {
  if (json_out.is_open()) {
    json_out << text;
    json_out.flush();
    if (!json_out) throw std::runtime_error("--json: writing '" + json_path + "' failed");
  }
  if (json_only) std::fputs(text.c_str(), stdout);
}

// Phase messages on stderr, one line rewritten in place, only when stderr is a terminal
// and `enabled` (off for --json-only), so logs, pipes and stdout get the report alone.
class Progress {
 public:
  explicit Progress(bool enabled) : tty_(enabled && isatty(STDERR_FILENO) == 1) {}
  ~Progress() { done(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  void say(const std::string& s) {
    if (!tty_) return;
    std::fprintf(stderr, "\r\033[Kstepfuse-bench: %s", s.c_str());
    std::fflush(stderr);
    shown_ = true;
  }
  void done() {
    if (tty_ && shown_) std::fprintf(stderr, "\r\033[K");
    shown_ = false;
  }

 private:
  bool tty_;
  bool shown_ = false;
};

}  // namespace stepfuse::bench
