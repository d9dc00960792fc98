// The C ABI's library-wide entry points (include/stepfuse/stepfuse.h): version, messages, conversions, warnings.
//
// The rest of the C ABI is split per handle over one guard and one set of conversions
// (runtime/c_api_support.{hpp,cpp}): c_api_optimizer.cpp, c_api_checkpoint.cpp,
// c_api_grad_scaler.cpp, c_api_loss_scale.cpp, c_api_program.cpp (custom update
// programs) and c_api_emit.cpp (the emit API).
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "stepfuse/stepfuse.hpp"

// version.hpp and stepfuse.h define the same macros. Capture the C++ header's values,
// then let the C header define its own and compare: a version bump must change both.
namespace {
constexpr int kCxxVersionMajor = STEPFUSE_VERSION_MAJOR;
constexpr int kCxxVersionMinor = STEPFUSE_VERSION_MINOR;
constexpr int kCxxVersionPatch = STEPFUSE_VERSION_PATCH;
constexpr int kCxxVersion = STEPFUSE_VERSION;
}  // namespace
#undef STEPFUSE_VERSION_MAJOR
#undef STEPFUSE_VERSION_MINOR
#undef STEPFUSE_VERSION_PATCH
#undef STEPFUSE_VERSION
#include "stepfuse/stepfuse.h"
#include "runtime/c_api_support.hpp"
static_assert(STEPFUSE_VERSION_MAJOR == kCxxVersionMajor && STEPFUSE_VERSION_MINOR == kCxxVersionMinor &&
                  STEPFUSE_VERSION_PATCH == kCxxVersionPatch && STEPFUSE_VERSION == kCxxVersion,
              "stepfuse.h and version.hpp disagree on the version: change both");

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

namespace {

// ---- Warnings -------------------------------------------------------------------

// The C handler and its user pointer, process-wide (the C++ handler is a plain
// function pointer, so the bridge reads them from here).
std::mutex g_warning_mutex;
sf_warning_handler g_warning_handler = nullptr;
void* g_warning_user = nullptr;

void warning_bridge(std::string_view message) {
  sf_warning_handler handler;
  void* user;
  {
    std::lock_guard lock(g_warning_mutex);
    handler = g_warning_handler;
    user = g_warning_user;
  }
  if (handler == nullptr) return;  // replaced concurrently by NULL: the default takes over next time
  try {
    const std::string text(message);  // NUL-terminated for C
    handler(text.c_str(), user);
  } catch (...) {
    // A warning is never worth failing the call that raised it.
  }
}

}  // namespace

extern "C" {

const char* sf_version(void) { return stepfuse::version(); }
int sf_version_number(void) { return STEPFUSE_VERSION; }
const char* sf_cpu_target(void) { return stepfuse::cpu_target(); }
const char* sf_llvm_version(void) { return stepfuse::llvm_version(); }

const char* sf_status_name(sf_status status) {
  switch (enum_value(status)) {
    case SF_OK: return "SF_OK";
    case SF_INVALID_ARGUMENT: return "SF_INVALID_ARGUMENT";
    case SF_INVALID_STATE: return "SF_INVALID_STATE";
    case SF_UNSUPPORTED: return "SF_UNSUPPORTED";
    case SF_COMPILE_FAILED: return "SF_COMPILE_FAILED";
    case SF_DEVICE_ERROR: return "SF_DEVICE_ERROR";
    case SF_IO_ERROR: return "SF_IO_ERROR";
    case SF_OUT_OF_MEMORY: return "SF_OUT_OF_MEMORY";
    case SF_INTERNAL: return "SF_INTERNAL";
  }
  return "SF_UNKNOWN_STATUS";
}

const char* sf_last_error(void) { return stepfuse::c_api::last_message(); }

uint16_t sf_float_to_f16(float value) { return stepfuse::float_to_f16(value); }
float sf_f16_to_float(uint16_t bits) { return stepfuse::f16_to_float(bits); }
uint16_t sf_float_to_bf16(float value) { return stepfuse::float_to_bf16(value); }
float sf_bf16_to_float(uint16_t bits) { return stepfuse::bf16_to_float(bits); }

sf_status sf_to_float(sf_tensor_view src, float* dst, int64_t dst_numel) {
  constexpr const char* fn = "sf_to_float";
  return guard(fn, [&] {
    if (dst_numel < 0) bad_argument(fn, "dst_numel = " + std::to_string(dst_numel) + " is negative");
    if (dst_numel > 0) need(fn, dst, "dst");
    stepfuse::to_float(to_view(fn, src, "src"), {dst, static_cast<std::size_t>(dst_numel)});
  });
}

sf_status sf_from_float(const float* src, int64_t src_numel, sf_tensor_view dst) {
  constexpr const char* fn = "sf_from_float";
  return guard(fn, [&] {
    if (src_numel < 0) bad_argument(fn, "src_numel = " + std::to_string(src_numel) + " is negative");
    if (src_numel > 0) need(fn, src, "src");
    stepfuse::from_float({src, static_cast<std::size_t>(src_numel)}, to_view(fn, dst, "dst"));
  });
}

bool sf_cuda_available(char* reason, size_t cap) {
  try {
    const stepfuse::CudaStatus s = stepfuse::cuda_available();
    copy_truncated(s.available ? std::string() : s.reason, reason, cap);
    return s.available;
  } catch (...) {  // documented never to throw; a bad_alloc copying the reason, say
    copy_truncated("stepfuse: sf_cuda_available: internal error", reason, cap);
    return false;
  }
}

bool sf_nvrtc_available(char* reason, size_t cap) {
  try {
    const stepfuse::CudaStatus s = stepfuse::nvrtc_available();
    copy_truncated(s.available ? std::string() : s.reason, reason, cap);
    return s.available;
  } catch (...) {
    copy_truncated("stepfuse: sf_nvrtc_available: internal error", reason, cap);
    return false;
  }
}

void sf_set_warning_handler(sf_warning_handler handler, void* user) {
  std::lock_guard lock(g_warning_mutex);
  g_warning_handler = handler;
  g_warning_user = user;
  stepfuse::set_warning_handler(handler != nullptr ? &warning_bridge : nullptr);
}

}  // extern "C"
