// Internal: what the C ABI's units (runtime/c_api*.cpp) share: handles, the one guard, checks, conversions.
//
// Every entry point runs its body through guard(), which turns every exception into an
// sf_status and this thread's message (sf_last_error). The helpers below throw
// Error(invalid_argument) with messages that start with the entry point's name and name
// the argument and its value. runtime/c_api_support.cpp defines them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "stepfuse/grad_scaler.hpp"
#include "stepfuse/loss_scale_optimizer.hpp"
#include "stepfuse/optimizer.hpp"
#include "stepfuse/stepfuse.h"
#include "stepfuse/update_program.hpp"

// The handles shared between units. Each owns its C++ object; what the C side reads by
// pointer (names) is kept here so it lives as long as the handle. The program builder and
// the emit results are their units' own.
struct sf_optimizer {
  stepfuse::Optimizer opt;
  std::vector<std::string> state_names;  // NUL-terminated copies of opt.state_names()
  // opt.options().state_formats as C (sf_optimizer_get_options): the stream names copied,
  // each entry pointing at its copy.
  std::vector<std::string> state_format_streams;
  std::vector<sf_stream_format> state_formats;
};
struct sf_grad_scaler {
  stepfuse::GradScaler scaler;
};
struct sf_loss_scale_optimizer {
  stepfuse::LossScaleOptimizer lso;
  sf_optimizer* inner;  // not owned
};
struct sf_program {
  stepfuse::UpdateProgram program;
};

namespace stepfuse::c_api {

// ---- The guard -------------------------------------------------------------------

// Thrown by the minimize bridge (c_api_loss_scale.cpp) when the C callback reports
// failure; it crosses only C++ frames (the bridge lambda, LossScaleOptimizer::minimize)
// back to the guard, which words the message.
struct CallbackFailed {
  int code;
};

// Runs call(ctx), turning every exception into a status and this thread's message
// (`fn` names the entry point in messages the C++ API does not word itself).
sf_status guard_call(const char* fn, void (*call)(void*), void* ctx) noexcept;
// Runs body() under guard_call: every entry point's body goes through here.
template <class F>
sf_status guard(const char* fn, F&& body) noexcept {
  return guard_call(
      fn, [](void* c) { (*static_cast<std::remove_reference_t<F>*>(c))(); }, static_cast<void*>(&body));
}

// This thread's message of the last failed call (sf_last_error).
const char* last_message() noexcept;

// ---- Argument checks -------------------------------------------------------------

// Error(invalid_argument) "fn: message".
[[noreturn]] void bad_argument(const char* fn, const std::string& message);

// A handle or out pointer the caller must pass.
template <class T>
T* need(const char* fn, T* p, const char* name) {
  if (p == nullptr) bad_argument(fn, std::string(name) + " is NULL");
  return p;
}

// need() for each (pointer, name) in turn: need_all(fn, opt, "opt", name, "name").
inline void need_all(const char*) {}
template <class T, class... Rest>
void need_all(const char* fn, T* p, const char* name, Rest... rest) {
  need(fn, p, name);
  need_all(fn, rest...);
}

// The body of an entry point that reads one value from a handle: checks the handle and the
// out pointer (`handle_name`, `out_name`: their names in stepfuse.h), then *out = read().
// As in `*need(fn, out, ...) = expr`, read() runs first (C++17 evaluates the right side of
// = first): what it checks itself (a name) is checked before `out`.
template <class H, class T, class Read>
sf_status get_value(const char* fn, const H* handle, const char* handle_name, T* out, const char* out_name,
                    Read&& read) noexcept {
  return guard(fn, [&] {
    need(fn, handle, handle_name);
    *need(fn, out, out_name) = read();
  });
}

// A getter entry point of stepfuse.h, named in full: sf_status fn(const Handle* handle,
// type* arg), checking both pointers and writing handle->expr into *arg (get_value).
#define SF_C_GETTER(fn, Handle, handle, type, arg, expr)                                              \
  sf_status fn(const Handle* handle, type* arg) {                                                     \
    return stepfuse::c_api::get_value(#fn, handle, #handle, arg, #arg, [&] { return handle->expr; }); \
  }

// The message of check_size: `name`->struct_size is `size`, this library knows `expected`.
[[noreturn]] void bad_struct_size(const char* fn, const char* name, std::uint32_t size, std::size_t expected,
                                  const char* type, const char* how);

// struct_size: this version knows one size per struct. A later version that grows a
// struct keeps accepting the older sizes in its conversion (and reads only their fields).
template <class T>
void check_size(const char* fn, const T* s, const char* name, const char* type, const char* how) {
  need(fn, s, name);
  if (s->struct_size != sizeof(T)) bad_struct_size(fn, name, s->struct_size, sizeof(T), type, how);
}

// A struct of an older stepfuse.h: the bytes of its fields when struct_size is one of `ends`
// (where an older struct's fields ended: its _SIZE_Vn) or that struct's sizeof (the end
// rounded up to alignof(T)); else 0.
template <class T>
std::size_t older_fields(std::uint32_t struct_size, std::initializer_list<std::size_t> ends) {
  constexpr std::size_t kAlign = alignof(T);
  for (const std::size_t end : ends)
    if (struct_size == end || struct_size == (end + kAlign - 1) / kAlign * kAlign) return end;
  return 0;
}

// Writes `full` (this library's struct) to the caller's `out`: an older header's struct (its
// fields' bytes `older`, from older_fields, nonzero) in its fields only, keeping its
// struct_size; else the whole struct, its size checked (check_size's type and how).
template <class T>
void write_struct(const char* fn, const T& full, T* out, std::size_t older, const char* type, const char* how) {
  if (older != 0) {
    const std::uint32_t size = out->struct_size;
    std::memcpy(static_cast<void*>(out), &full, older);
    out->struct_size = size;
    return;
  }
  check_size(fn, out, "out", type, how);
  *out = full;
}

// What an sf_X_init_size(dst, size) call writes: `full` (this header's struct, its
// fields set) in the caller's `size` bytes and no more, with struct_size = size, so a
// caller built against an older stepfuse.h gets its own (smaller) struct's fields; bytes
// past this header's struct, in a newer header's larger one, are zeroed (the struct_size
// it gets then is one this library refuses, saying which it expects). Nothing is written
// for a NULL dst or a size too small to hold struct_size.
template <class T>
void init_struct(T* dst, std::size_t size, T full) {
  if (dst == nullptr || size < sizeof full.struct_size) return;
  full.struct_size = static_cast<std::uint32_t>(std::min<std::size_t>(size, UINT32_MAX));
  const std::size_t n = std::min(size, sizeof full);
  std::memcpy(static_cast<void*>(dst), &full, n);
  if (size > n) std::memset(reinterpret_cast<unsigned char*>(dst) + n, 0, size - n);
}

// The size sizeof(T) gave when T's last field, ending at `end`, was its last: the size the
// function sf_X_init (the macro's namesake, called by programs built before the macros)
// writes, now and after T grows, so that a later library does not write past the struct
// of a program built against this release's header. (Written as the end of a field so
// that a new field cannot change it: each call site names this release's last field.)
template <class T>
constexpr std::size_t size_through(std::size_t end) {
  return (end + alignof(T) - 1) / alignof(T) * alignof(T);
}
#define SF_SIZE_THROUGH(T, field) \
  ::stepfuse::c_api::size_through<T>(offsetof(T, field) + sizeof(static_cast<T*>(nullptr)->field))

// The value of an enum the caller passed, as an int. A C caller may pass any int; in
// C++ loading an enum object that holds a value outside its enumerators' range is
// undefined (UBSan flags it), so every such enum is read through its bytes, then checked.
template <class E>
int enum_value(const E& e) {
  static_assert(std::is_enum_v<E> && sizeof(E) == sizeof(int), "C enums are int-sized");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

// An enum argument's value (read as enum_value does), which must lie in [lo, hi]; else
// Error(invalid_argument) "fn: <name> = <value> is not <what>" (what: "an sf_dtype (...)").
template <class E>
int enum_in_range(const char* fn, const E& e, int lo, int hi, const std::string& name, const char* what) {
  const int v = enum_value(e);
  if (v < lo || v > hi) bad_argument(fn, name + " = " + std::to_string(v) + " is not " + what);
  return v;
}

// A bool field the caller filled, read through its byte, as enums are: a C caller can
// store any byte there (memset, a char pointer, another compiler's bool), and in C++
// loading a bool object that holds a byte other than 0 or 1 is undefined. 0 or 1, else
// Error(invalid_argument) "fn: <name> = <byte> is not a bool (use 0/false or 1/true)".
inline bool bool_value(const char* fn, const bool& b, const std::string& name) {
  static_assert(sizeof(bool) == 1, "C bools are one byte");
  unsigned char v;
  std::memcpy(&v, &b, 1);
  if (v > 1) bad_argument(fn, name + " = " + std::to_string(v) + " is not a bool (use 0/false or 1/true)");
  return v == 1;
}

// ---- Conversions (checking struct sizes, enums and bools, naming the field) -------

// `what` names the view in messages ("src", "params[2].grad").
TensorView to_view(const char* fn, const sf_tensor_view& v, const std::string& what);
// count views; `views` may be NULL when count is 0. `name` is the argument's name.
std::vector<TensorView> to_views(const char* fn, const sf_tensor_view* views, std::size_t count, const char* name);
std::vector<Param> to_params(const char* fn, const sf_param* params, std::size_t num_params);

// sf_optimizer_kind is the index of the config type in OptimizerConfig.
bool valid_kind(int kind);
OptimizerConfig default_config(int kind);  // valid_kind(kind)
// config (size already checked) as C++: its kind's fields; the other kinds' must be 0/false.
OptimizerConfig config_from_c(const char* fn, const sf_optimizer_config& config);
// The config as this library's struct, checking the pointer and struct_size (`name` names
// the argument: "config", "groups[1].config"): one from an older header
// (SF_OPTIMIZER_CONFIG_SIZE_V1) gets the defaults for the fields it lacks.
sf_optimizer_config full_config(const char* fn, const sf_optimizer_config* config, const std::string& name);
// A built-in program's config (emitting, where storage plays no part: a config that sets
// has_state_format is Error(invalid_argument)). Checks the size, then as config_from_c.
OptimizerConfig to_config(const char* fn, const sf_optimizer_config* config);
// A full_config()'s own state format (ParamGroup::state_format): nullopt unless has_state_format.
std::optional<StateFormat> group_format_from_c(const char* fn, const sf_optimizer_config& config,
                                               const std::string& name);
// Fills every field of `out` (except struct_size) from a C++ config; its state format
// fields as the default (see write_config).
void config_to_c(const OptimizerConfig& config, sf_optimizer_config* out);
// A group's config into the caller's `out` (its struct_size checked, an older header's
// struct written in its fields only): the hyperparameters, has_state_format when the group
// has its own format, and state_format, the format its streams take.
void write_config(const char* fn, const Optimizer& opt, std::size_t group, sf_optimizer_config* out);
// Error(invalid_argument) unless the setter's `config` (a full_config()) leaves the state
// format unset or names the one `group` takes (sf_optimizer_set_config: group 0's).
void check_group_format(const char* fn, const Optimizer& opt, std::size_t group, const sf_optimizer_config& config);

// The C value of a state format, and the C++ one of a checked C value.
inline sf_state_format state_format_to_c(StateFormat f) { return static_cast<sf_state_format>(static_cast<int>(f)); }
// An sf_state_format the caller passed (read as enum_value does), or Error(invalid_argument)
// "fn: <name> = <value> is not an sf_state_format (...)".
StateFormat state_format_from_c(const char* fn, const sf_state_format& f, const std::string& name);

// The options as this library's struct: one from an older header (SF_OPTIMIZER_OPTIONS_SIZE_V1
// .. _V5) gets the defaults for the fields it lacks.
sf_optimizer_options full_options(const char* fn, const sf_optimizer_options* options);
// An older stepfuse.h's options struct: the bytes of its fields when struct_size is the end of
// its fields (SF_OPTIMIZER_OPTIONS_SIZE_V1 .. _V5) or that struct's sizeof; else 0.
std::size_t older_options_fields(std::uint32_t struct_size);
OptimizerOptions options_from_c(const char* fn, const sf_optimizer_options& options);  // a full_options() struct
OptimizerOptions to_options(const char* fn, const sf_optimizer_options* options);  // NULL: the defaults
// Fills every field of `out` (except struct_size) from C++ options; state_formats, which
// must point into a handle, is NULL with num_state_formats 0 (sf_optimizer_get_options
// sets them from the handle).
void options_to_c(const OptimizerOptions& options, sf_optimizer_options* out);

// Writes r to the caller's `out` (the argument `name`), checking its size.
void write_result(const char* fn, const StepResult& r, sf_step_result* out, const char* name);

// The body of an entry point that copies a step's result out: checks the handle and
// `result` (its size), then writes get() into it.
template <class H, class Get>
sf_status get_result(const char* fn, const H* handle, const char* handle_name, sf_step_result* result,
                     Get&& get) noexcept {
  return guard(fn, [&] {
    need(fn, handle, handle_name);
    check_size(fn, result, "result", "sf_step_result", "initialize it with sf_step_result_init()");
    write_result(fn, get(), result, "result");
  });
}

// ---- Handles and text --------------------------------------------------------------

// A new handle owning `opt` (with its state names and per-stream state formats copied for C).
sf_optimizer* make_optimizer(Optimizer&& opt);

// Copies `text` into buf, truncated to cap - 1 bytes and NUL-terminated; nothing when buf
// is NULL or cap is 0.
void copy_truncated(const std::string& text, char* buf, std::size_t cap);

// Copies `text` into a caller buffer with the size protocol of sf_optimizer_program_text
// (`what` names the text in the message when cap is too small: "the program text").
void copy_text(const char* fn, const std::string& text, const char* what, char* buf, std::size_t cap,
               std::size_t* needed);

}  // namespace stepfuse::c_api
