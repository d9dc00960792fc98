// The one exception type the library throws, with a machine-readable code.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace stepfuse {

enum class ErrorCode {
  invalid_argument,  // a bad value passed by the caller; the message names it
  invalid_state,     // a call that is not allowed at this point
  unsupported,       // a valid request this build or machine cannot serve
  compile_failed,    // a generated kernel did not compile (log and source attached)
  device_error,      // the accelerator or its driver reported an error
  io_error,          // a file could not be read or written
};

std::string_view error_code_name(ErrorCode code);

// Thrown for every bad input, always before anything is written.
// Non-finite gradients are data (a flag), never an Error.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// Warnings: things the library works around but the user should know about (a
// GradScaler asked for "cuda" where no GPU is usable, say). Each goes to the
// handler, once per process per cause. The default handler writes
// "stepfuse: warning: <message>" and a newline to stderr.
using WarningHandler = void (*)(std::string_view message);
// Installs `handler` (nullptr restores the default) and returns the previous one.
WarningHandler set_warning_handler(WarningHandler handler);

}  // namespace stepfuse
