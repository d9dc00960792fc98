// Internal: what the C ABI's translation units share (runtime/c_api.cpp defines it):
// the optimizer handle, the guard that turns exceptions into a status and this
// thread's message, and the conversions of the C structs.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

#include "stepfuse/optimizer.hpp"
#include "stepfuse/stepfuse.h"

struct sf_optimizer {
  stepfuse::Optimizer opt;
  std::vector<std::string> state_names;  // NUL-terminated copies of opt.state_names()
};

namespace stepfuse::c_api {

// Runs call(ctx), turning every exception into a status and this thread's message
// (`fn` names the entry point in messages the C++ API does not word itself).
sf_status guarded_call(const char* fn, void (*call)(void*), void* ctx) noexcept;
template <class F>
sf_status guarded(const char* fn, F&& body) noexcept {
  return guarded_call(
      fn, [](void* c) { (*static_cast<std::remove_reference_t<F>*>(c))(); }, static_cast<void*>(&body));
}

// Error(invalid_argument) "fn: message".
[[noreturn]] void bad_argument(const char* fn, const std::string& message);

// The C++ value of a C enum passed by the caller, read through its bytes (any int may arrive).
int enum_int(const void* e);

// Conversions, checking struct sizes and enums (Error(invalid_argument) naming the field).
std::vector<Param> to_params(const char* fn, const sf_param* params, std::size_t num_params);
OptimizerOptions to_options(const char* fn, const sf_optimizer_options* options);  // NULL: the defaults
OptimizerConfig to_config(const char* fn, const sf_optimizer_config* config);

// A new handle owning `opt` (with its state names copied for C).
sf_optimizer* make_optimizer(Optimizer&& opt);

// Copies `text` into a caller buffer with the size protocol of sf_optimizer_program_text.
void copy_text(const char* fn, const std::string& text, char* buf, std::size_t cap, std::size_t* needed);

}  // namespace stepfuse::c_api
