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

}  // namespace stepfuse
