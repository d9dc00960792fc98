// stepfuse::Error and the names of its codes.
#include "stepfuse/error.hpp"

namespace stepfuse {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::invalid_state: return "invalid_state";
    case ErrorCode::unsupported: return "unsupported";
    case ErrorCode::compile_failed: return "compile_failed";
    case ErrorCode::device_error: return "device_error";
    case ErrorCode::io_error: return "io_error";
  }
  return "unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error("stepfuse: " + message), code_(code) {}

}  // namespace stepfuse
