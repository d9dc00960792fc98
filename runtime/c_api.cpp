// The C ABI (include/stepfuse/stepfuse.h) over the C++ API: handles, struct
// conversions, and one guard that turns every exception into a status and a
// thread-local message.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "jit/config_fields.hpp"
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

using stepfuse::DType;
using stepfuse::Error;
using stepfuse::ErrorCode;

// The C enums are the C++ ones, value for value (the conversions below are casts).
static_assert(SF_F32 == static_cast<int>(DType::f32) && SF_F16 == static_cast<int>(DType::f16) &&
              SF_BF16 == static_cast<int>(DType::bf16));
static_assert(SF_DEVICE_CPU == static_cast<int>(stepfuse::Device::Kind::cpu) &&
              SF_DEVICE_CUDA == static_cast<int>(stepfuse::Device::Kind::cuda));
static_assert(SF_FUSION_FUSED == static_cast<int>(stepfuse::Fusion::fused) &&
              SF_FUSION_UNFUSED == static_cast<int>(stepfuse::Fusion::unfused) &&
              SF_FUSION_INTERPRETED == static_cast<int>(stepfuse::Fusion::interpreted));
// sf_optimizer_kind is the index of the config type in stepfuse::OptimizerConfig, the
// registry of built-in optimizers: a kind added there needs its line in the C enum.
static_assert(stepfuse::jit::kNumOptimizers == SF_NUM_OPTIMIZER_KINDS,
              "stepfuse::OptimizerConfig and sf_optimizer_kind disagree: give every optimizer its SF_ kind");

// The handles. Each owns its C++ object; what the C side reads by pointer (names)
// is kept here so it lives as long as the handle.
// sf_optimizer is in runtime/c_api_support.hpp (custom programs create it too).
struct sf_grad_scaler {
  stepfuse::GradScaler scaler;
};
struct sf_loss_scale_optimizer {
  stepfuse::LossScaleOptimizer lso;
  sf_optimizer* inner;  // not owned
};

namespace {

// ---- Errors ---------------------------------------------------------------------

thread_local std::string t_message;
// Set when the message itself could not be stored (out of memory): a static text.
thread_local const char* t_static_message = nullptr;

// Records this thread's message. `make` builds it (and may throw: then a static
// text stands in), so the catch clauses of guard() never throw.
template <class Make>
void set_message(Make&& make) noexcept {
  try {
    t_message = make();
    t_static_message = nullptr;
  } catch (...) {
    t_static_message = "stepfuse: out of memory (while recording an error message)";
  }
}

sf_status status_of(ErrorCode code) {
  switch (code) {
    case ErrorCode::invalid_argument: return SF_INVALID_ARGUMENT;
    case ErrorCode::invalid_state: return SF_INVALID_STATE;
    case ErrorCode::unsupported: return SF_UNSUPPORTED;
    case ErrorCode::compile_failed: return SF_COMPILE_FAILED;
    case ErrorCode::device_error: return SF_DEVICE_ERROR;
    case ErrorCode::io_error: return SF_IO_ERROR;
  }
  return SF_INTERNAL;
}

// Thrown by the minimize bridge when the C callback reports failure; it crosses only
// C++ frames (the bridge lambda, LossScaleOptimizer::minimize) back to guard().
struct CallbackFailed {
  int code;
};

// Runs `body`, turning every exception into a status and this thread's message.
// `fn` names the entry point in messages the C++ API does not word itself.
template <class F>
sf_status guard(const char* fn, F&& body) noexcept {
  try {
    body();
    return SF_OK;
  } catch (const Error& e) {
    set_message([&] { return std::string(e.what()); });
    return status_of(e.code());
  } catch (const std::bad_alloc&) {
    set_message([&] { return std::string("stepfuse: ") + fn + ": out of memory"; });
    return SF_OUT_OF_MEMORY;
  } catch (const CallbackFailed& e) {
    set_message([&] {
      return std::string("stepfuse: ") + fn + ": the backward callback returned " + std::to_string(e.code) +
             " (failure); nothing was stepped and the loss scale is unchanged";
    });
    return SF_INVALID_STATE;
  } catch (const std::exception& e) {
    set_message([&] { return std::string("stepfuse: ") + fn + ": internal error: " + e.what(); });
    return SF_INTERNAL;
  } catch (...) {
    set_message([&] { return std::string("stepfuse: ") + fn + ": internal error: an unknown exception"; });
    return SF_INTERNAL;
  }
}

[[noreturn]] void bad(const char* fn, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, std::string(fn) + ": " + message);
}

// A handle or out pointer the caller must pass.
template <class T>
T* need(const char* fn, T* p, const char* name) {
  if (p == nullptr) bad(fn, std::string(name) + " is NULL");
  return p;
}

// struct_size: this version knows one size per struct. A later version that grows a
// struct keeps accepting the older sizes here (and reads only their fields).
template <class T>
void check_size(const char* fn, const T* s, const char* name, const char* type, const char* how) {
  need(fn, s, name);
  if (s->struct_size != sizeof(T))
    bad(fn, std::string(name) + "->struct_size = " + std::to_string(s->struct_size) + ", but this library (" +
                stepfuse::version() + ") knows only " + std::to_string(sizeof(T)) + " (sizeof(" + type +
                ") in its stepfuse.h): " + how + ", and compile against the header of the library you link");
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// ---- Conversions ----------------------------------------------------------------

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

stepfuse::TensorView to_view(const char* fn, const sf_tensor_view& v, const std::string& what) {
  const int dtype = enum_value(v.dtype);
  if (dtype < SF_F32 || dtype > SF_BF16)
    bad(fn, what + ".dtype = " + std::to_string(dtype) + " is not an sf_dtype (SF_F32, SF_F16, SF_BF16)");
  return {v.data, v.numel, static_cast<DType>(dtype)};
}

std::vector<stepfuse::TensorView> to_views(const char* fn, const sf_tensor_view* views, std::size_t count,
                                           const char* name) {
  if (count > 0) need(fn, views, name);
  std::vector<stepfuse::TensorView> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i)
    out.push_back(to_view(fn, views[i], std::string(name) + "[" + std::to_string(i) + "]"));
  return out;
}

// The fields of sf_optimizer_config by PyTorch name, as stepfuse::jit::for_each_field names them:
// which kind has which field is decided there, once.
struct ConfigField {
  const char* name;
  std::size_t offset;
  bool is_bool;
};
#define SF_FIELD(f, b) ConfigField{#f, offsetof(sf_optimizer_config, f), b}
constexpr ConfigField kConfigFields[] = {
    SF_FIELD(lr, false),       SF_FIELD(beta1, false),       SF_FIELD(beta2, false),
    SF_FIELD(eps, false),      SF_FIELD(weight_decay, false), SF_FIELD(momentum, false),
    SF_FIELD(dampening, false), SF_FIELD(alpha, false),      SF_FIELD(lr_decay, false),
    SF_FIELD(initial_accumulator_value, false),
    SF_FIELD(amsgrad, true),   SF_FIELD(nesterov, true),     SF_FIELD(centered, true),
    SF_FIELD(maximize, true),
};
#undef SF_FIELD

// Every field of every kind has its sf_optimizer_config field, of the same type, and
// every sf_optimizer_config field belongs to some kind, so a hyperparameter added to a
// config without its C field, or a C field without its row above, fails to build.
template <class Config>
constexpr bool config_fields_match(bool* used) {
  Config config{};
  bool ok = true;
  stepfuse::jit::for_each_field(config, [&](std::string_view name, const auto& v) {
    const bool is_bool = std::is_same_v<std::remove_cvref_t<decltype(v)>, bool>;
    bool found = false;
    for (std::size_t i = 0; i < std::size(kConfigFields); ++i)
      if (name == kConfigFields[i].name && is_bool == kConfigFields[i].is_bool) found = used[i] = true;
    ok = ok && found;
  });
  return ok;
}
template <std::size_t... K>
constexpr bool config_fields_match(std::index_sequence<K...>) {
  bool used[std::size(kConfigFields)] = {};
  bool ok = (config_fields_match<std::variant_alternative_t<K, stepfuse::OptimizerConfig>>(used) && ...);
  for (const bool u : used) ok = ok && u;
  return ok;
}
static_assert(config_fields_match(std::make_index_sequence<stepfuse::jit::kNumOptimizers>{}), "kConfigFields, sf_optimizer_config and the optimizers' fields disagree");
static_assert(stepfuse::jit::aggregate_members<sf_optimizer_config>() == 2 + std::size(kConfigFields),
              "an sf_optimizer_config field without its kConfigFields row");

const ConfigField& config_field(std::string_view name) {
  for (const ConfigField& f : kConfigFields)
    if (name == f.name) return f;
  throw std::logic_error("sf_optimizer_config has no field '" + std::string(name) + "'");  // see config_fields_match
}
template <class T>
T& field_ref(sf_optimizer_config& c, const ConfigField& f) {
  return *reinterpret_cast<T*>(reinterpret_cast<char*>(&c) + f.offset);
}
template <class T>
const T& field_ref(const sf_optimizer_config& c, const ConfigField& f) {
  return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(&c) + f.offset);
}

stepfuse::OptimizerConfig default_config(int kind) { return stepfuse::jit::default_config(static_cast<std::size_t>(kind)); }

bool valid_kind(int kind) { return kind >= 0 && kind < SF_NUM_OPTIMIZER_KINDS; }

// Fills every field of `out` (except struct_size) from a C++ config.
void from_cpp(const stepfuse::OptimizerConfig& config, sf_optimizer_config* out) {
  const std::uint32_t size = out->struct_size;
  std::memset(static_cast<void*>(out), 0, sizeof *out);
  out->struct_size = size;
  out->kind = static_cast<sf_optimizer_kind>(config.index());
  std::visit(
      [&](const auto& c) {
        stepfuse::jit::for_each_field(c, [&](std::string_view name, const auto& v) {
          using V = std::remove_cvref_t<decltype(v)>;
          field_ref<V>(*out, config_field(name)) = v;
        });
      },
      config);
}

stepfuse::OptimizerConfig to_cpp(const char* fn, const sf_optimizer_config& c) {
  const int kind_value = enum_value(c.kind);
  if (!valid_kind(kind_value))
    bad(fn, "config->kind = " + std::to_string(kind_value) + " is not an sf_optimizer_kind (0 .. " +
                std::to_string(SF_NUM_OPTIMIZER_KINDS - 1) + ")");
  stepfuse::OptimizerConfig config = default_config(kind_value);
  bool used[std::size(kConfigFields)] = {};
  std::visit(
      [&](auto& cfg) {
        stepfuse::jit::for_each_field(cfg, [&](std::string_view name, auto& v) {
          using V = std::remove_cvref_t<decltype(v)>;
          const ConfigField& f = config_field(name);
          used[&f - kConfigFields] = true;
          v = field_ref<V>(c, f);
        });
      },
      config);
  const std::string kind = std::string(stepfuse::optimizer_name(config));
  for (std::size_t i = 0; i < std::size(kConfigFields); ++i) {
    const ConfigField& f = kConfigFields[i];
    if (used[i]) continue;
    if (f.is_bool ? field_ref<bool>(c, f) : field_ref<double>(c, f) != 0.0)
      bad(fn, std::string("config->") + f.name + " = " + (f.is_bool ? "true" : num(field_ref<double>(c, f))) +
                  ", but " + kind + " has no " + f.name +
                  " (the fields of other kinds must be 0/false: start from sf_optimizer_config_init(cfg, kind))");
  }
  return config;
}

stepfuse::OptimizerOptions to_cpp(const char* fn, const sf_optimizer_options& o) {
  stepfuse::OptimizerOptions out;
  const int device_kind = enum_value(o.device.kind);
  if (device_kind != SF_DEVICE_CPU && device_kind != SF_DEVICE_CUDA)
    bad(fn, "options->device.kind = " + std::to_string(device_kind) +
                " is not an sf_device_kind (SF_DEVICE_CPU, SF_DEVICE_CUDA)");
  out.device = {static_cast<stepfuse::Device::Kind>(device_kind), o.device.index};
  out.cuda_stream = o.cuda_stream;
  if (o.has_max_grad_norm) out.max_grad_norm = o.max_grad_norm;
  const int norm_type = enum_value(o.norm_type);
  if (norm_type == SF_NORM_L2)
    out.norm_type = 2.0;
  else if (norm_type == SF_NORM_INF)
    out.norm_type = INFINITY;
  else
    bad(fn, "options->norm_type = " + std::to_string(norm_type) +
                " is not an sf_norm_type (SF_NORM_L2, SF_NORM_INF)");
  out.master_weights = o.master_weights;
  const int fusion = enum_value(o.fusion);
  if (fusion < SF_FUSION_FUSED || fusion > SF_FUSION_INTERPRETED)
    bad(fn, "options->fusion = " + std::to_string(fusion) +
                " is not an sf_fusion (SF_FUSION_FUSED, SF_FUSION_UNFUSED, SF_FUSION_INTERPRETED)");
  out.fusion = static_cast<stepfuse::Fusion>(fusion);
  out.num_threads = o.num_threads;
  out.track_grad_norm = o.track_grad_norm;
  const int backend = enum_value(o.cpu_backend);
  if (backend < SF_CPU_BACKEND_DEFAULT || backend > SF_CPU_BACKEND_LLVM)
    bad(fn, "options->cpu_backend = " + std::to_string(backend) +
                " is not an sf_cpu_backend (SF_CPU_BACKEND_DEFAULT, _AUTO, _HIGHWAY, _LLVM)");
  if (backend != SF_CPU_BACKEND_DEFAULT) out.cpu_backend = static_cast<stepfuse::CpuBackend>(backend - 1);
  out.llvm_contract = o.llvm_contract;
  return out;
}

// The options as this library's struct: one from an older header (SF_OPTIMIZER_OPTIONS_SIZE_V1)
// gets the defaults for the fields it lacks.
sf_optimizer_options full_options(const char* fn, const sf_optimizer_options* o) {
  need(fn, o, "options");
  sf_optimizer_options full;
  sf_optimizer_options_init(&full);
  if (o->struct_size == SF_OPTIMIZER_OPTIONS_SIZE_V1) {
    std::memcpy(static_cast<void*>(&full), o, SF_OPTIMIZER_OPTIONS_SIZE_V1);
    full.struct_size = sizeof full;
    return full;
  }
  check_size(fn, o, "options", "sf_optimizer_options", "initialize it with sf_optimizer_options_init()");
  return *o;
}

void from_cpp(const stepfuse::OptimizerOptions& o, sf_optimizer_options* out) {
  const std::uint32_t size = out->struct_size;
  std::memset(static_cast<void*>(out), 0, sizeof *out);
  out->struct_size = size;
  out->cpu_backend = o.cpu_backend ? static_cast<sf_cpu_backend>(static_cast<int>(*o.cpu_backend) + 1)
                                   : SF_CPU_BACKEND_DEFAULT;
  out->llvm_contract = o.llvm_contract;
  out->device = {static_cast<sf_device_kind>(o.device.kind), o.device.index};
  out->cuda_stream = o.cuda_stream;
  out->has_max_grad_norm = o.max_grad_norm.has_value();
  out->max_grad_norm = o.max_grad_norm.value_or(0.0);
  out->norm_type = o.norm_type == 2.0 ? SF_NORM_L2 : SF_NORM_INF;
  out->master_weights = o.master_weights;
  out->fusion = static_cast<sf_fusion>(o.fusion);
  out->num_threads = o.num_threads;
  out->track_grad_norm = o.track_grad_norm;
}

void write_result(const char* fn, const stepfuse::StepResult& r, sf_step_result* out, const char* name) {
  check_size(fn, out, name, "sf_step_result", "initialize it with sf_step_result_init()");
  out->applied = r.applied;
  out->found_inf = r.found_inf;
  out->pending = r.pending;
  out->grad_norm = r.grad_norm;
  out->clip_coef = r.clip_coef;
}

void copy_reason(const std::string& reason, char* buf, std::size_t cap) {
  if (buf == nullptr || cap == 0) return;
  const std::size_t n = std::min(reason.size(), cap - 1);
  std::memcpy(buf, reason.data(), n);
  buf[n] = '\0';
}

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

// ---- Shared with the other C ABI units (runtime/c_api_support.hpp) ---------------

namespace stepfuse::c_api {

sf_status guarded_call(const char* fn, void (*call)(void*), void* ctx) noexcept {
  return guard(fn, [&] { call(ctx); });
}

void bad_argument(const char* fn, const std::string& message) { bad(fn, message); }

int enum_int(const void* e) {
  int v;
  std::memcpy(&v, e, sizeof v);
  return v;
}

std::vector<Param> to_params(const char* fn, const sf_param* params, std::size_t num_params) {
  if (num_params > 0) need(fn, params, "params");
  std::vector<Param> ps;
  ps.reserve(num_params);
  for (std::size_t i = 0; i < num_params; ++i) {
    const std::string at = "params[" + std::to_string(i) + "]";
    ps.push_back({to_view(fn, params[i].weight, at + ".weight"), to_view(fn, params[i].grad, at + ".grad")});
  }
  return ps;
}

OptimizerOptions to_options(const char* fn, const sf_optimizer_options* options) {
  if (options == nullptr) return OptimizerOptions{};
  return to_cpp(fn, full_options(fn, options));
}

OptimizerConfig to_config(const char* fn, const sf_optimizer_config* config) {
  check_size(fn, config, "config", "sf_optimizer_config", "initialize it with sf_optimizer_config_init()");
  return to_cpp(fn, *config);
}

sf_optimizer* make_optimizer(Optimizer&& opt) {
  auto* h = new sf_optimizer{std::move(opt), {}};
  try {
    for (std::string_view n : h->opt.state_names()) h->state_names.emplace_back(n);
  } catch (...) {
    delete h;
    throw;
  }
  return h;
}

void copy_text(const char* fn, const std::string& text, char* buf, std::size_t cap, std::size_t* needed) {
  if (cap > 0) need(fn, buf, "buf");
  const std::size_t size = text.size() + 1;
  if (needed != nullptr) *needed = size;
  if (buf == nullptr) return;  // cap == 0: a size query
  copy_reason(text, buf, cap);
  if (cap < size)
    bad(fn, "cap = " + std::to_string(cap) + " is too small for the text (" + std::to_string(size) +
                " bytes with the NUL; the buffer holds a truncated copy)");
}

}  // namespace stepfuse::c_api

// ---- Entry points ---------------------------------------------------------------

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

const char* sf_last_error(void) { return t_static_message != nullptr ? t_static_message : t_message.c_str(); }

uint16_t sf_float_to_f16(float value) { return stepfuse::float_to_f16(value); }
float sf_f16_to_float(uint16_t bits) { return stepfuse::f16_to_float(bits); }
uint16_t sf_float_to_bf16(float value) { return stepfuse::float_to_bf16(value); }
float sf_bf16_to_float(uint16_t bits) { return stepfuse::bf16_to_float(bits); }

sf_status sf_to_float(sf_tensor_view src, float* dst, int64_t dst_numel) {
  constexpr const char* fn = "sf_to_float";
  return guard(fn, [&] {
    if (dst_numel < 0) bad(fn, "dst_numel = " + std::to_string(dst_numel) + " is negative");
    if (dst_numel > 0) need(fn, dst, "dst");
    stepfuse::to_float(to_view(fn, src, "src"), {dst, static_cast<std::size_t>(dst_numel)});
  });
}

sf_status sf_from_float(const float* src, int64_t src_numel, sf_tensor_view dst) {
  constexpr const char* fn = "sf_from_float";
  return guard(fn, [&] {
    if (src_numel < 0) bad(fn, "src_numel = " + std::to_string(src_numel) + " is negative");
    if (src_numel > 0) need(fn, src, "src");
    stepfuse::from_float({src, static_cast<std::size_t>(src_numel)}, to_view(fn, dst, "dst"));
  });
}

bool sf_cuda_available(char* reason, size_t cap) {
  try {
    const stepfuse::CudaStatus s = stepfuse::cuda_available();
    copy_reason(s.available ? std::string() : s.reason, reason, cap);
    return s.available;
  } catch (...) {  // documented never to throw; a bad_alloc copying the reason, say
    copy_reason("stepfuse: sf_cuda_available: internal error", reason, cap);
    return false;
  }
}

bool sf_nvrtc_available(char* reason, size_t cap) {
  try {
    const stepfuse::CudaStatus s = stepfuse::nvrtc_available();
    copy_reason(s.available ? std::string() : s.reason, reason, cap);
    return s.available;
  } catch (...) {
    copy_reason("stepfuse: sf_nvrtc_available: internal error", reason, cap);
    return false;
  }
}

void sf_set_warning_handler(sf_warning_handler handler, void* user) {
  std::lock_guard lock(g_warning_mutex);
  g_warning_handler = handler;
  g_warning_user = user;
  stepfuse::set_warning_handler(handler != nullptr ? &warning_bridge : nullptr);
}

// ---- Optimizer ------------------------------------------------------------------

const char* sf_optimizer_kind_name(sf_optimizer_kind kind) {
  const int k = enum_value(kind);
  if (!valid_kind(k)) return nullptr;
  return stepfuse::optimizer_name(default_config(k)).data();  // string literals
}

void sf_optimizer_config_init(sf_optimizer_config* config, sf_optimizer_kind kind) {
  if (config == nullptr) return;
  config->struct_size = sizeof(sf_optimizer_config);
  if (const int k = enum_value(kind); valid_kind(k)) {
    from_cpp(default_config(k), config);
  } else {
    std::memset(static_cast<void*>(config), 0, sizeof *config);
    config->struct_size = sizeof(sf_optimizer_config);
    std::memcpy(&config->kind, &k, sizeof k);  // rejected, with its value, by whatever uses it
  }
}

void sf_optimizer_options_init(sf_optimizer_options* options) {
  if (options == nullptr) return;
  options->struct_size = sizeof(sf_optimizer_options);
  from_cpp(stepfuse::OptimizerOptions{}, options);
}

void sf_step_result_init(sf_step_result* result) {
  if (result == nullptr) return;
  *result = sf_step_result{};
  result->struct_size = sizeof(sf_step_result);
}

sf_status sf_optimizer_create(const sf_optimizer_config* config, const sf_param* params, size_t num_params,
                              const sf_optimizer_options* options, sf_optimizer** out) {
  constexpr const char* fn = "sf_optimizer_create";
  return guard(fn, [&] {
    check_size(fn, config, "config", "sf_optimizer_config", "initialize it with sf_optimizer_config_init()");
    const sf_optimizer_options full = options != nullptr ? full_options(fn, options) : sf_optimizer_options{};
    need(fn, out, "out");
    if (num_params > 0) need(fn, params, "params");
    stepfuse::OptimizerConfig cfg = to_cpp(fn, *config);
    std::vector<stepfuse::Param> ps;
    ps.reserve(num_params);
    for (std::size_t i = 0; i < num_params; ++i) {
      const std::string at = "params[" + std::to_string(i) + "]";
      ps.push_back({to_view(fn, params[i].weight, at + ".weight"), to_view(fn, params[i].grad, at + ".grad")});
    }
    const stepfuse::OptimizerOptions opts = options != nullptr ? to_cpp(fn, full) : stepfuse::OptimizerOptions{};
    auto* h = new sf_optimizer{stepfuse::Optimizer(std::move(cfg), std::move(ps), opts), {}};
    try {
      for (std::string_view n : h->opt.state_names()) h->state_names.emplace_back(n);
    } catch (...) {
      delete h;
      throw;
    }
    *out = h;
  });
}

void sf_optimizer_destroy(sf_optimizer* opt) { delete opt; }

sf_status sf_optimizer_step(sf_optimizer* opt) {
  constexpr const char* fn = "sf_optimizer_step";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.step(); });
}

sf_status sf_optimizer_step_scaled(sf_optimizer* opt, double loss_scale, sf_step_result* result) {
  constexpr const char* fn = "sf_optimizer_step_scaled";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    if (result != nullptr)
      check_size(fn, result, "result", "sf_step_result", "initialize it with sf_step_result_init()");
    const stepfuse::StepResult r = opt->opt.step_scaled(loss_scale);
    if (result != nullptr) write_result(fn, r, result, "result");
  });
}

sf_status sf_optimizer_last_result(const sf_optimizer* opt, sf_step_result* result) {
  constexpr const char* fn = "sf_optimizer_last_result";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    check_size(fn, result, "result", "sf_step_result", "initialize it with sf_step_result_init()");
    write_result(fn, opt->opt.last_result(), result, "result");
  });
}

sf_status sf_optimizer_get_config(const sf_optimizer* opt, sf_optimizer_config* out) {
  constexpr const char* fn = "sf_optimizer_get_config";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    check_size(fn, out, "out", "sf_optimizer_config", "initialize it with sf_optimizer_config_init()");
    from_cpp(opt->opt.config(), out);
  });
}

sf_status sf_optimizer_set_config(sf_optimizer* opt, const sf_optimizer_config* config) {
  constexpr const char* fn = "sf_optimizer_set_config";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    check_size(fn, config, "config", "sf_optimizer_config", "initialize it with sf_optimizer_config_init()");
    opt->opt.set_config(to_cpp(fn, *config));
  });
}

sf_status sf_optimizer_get_options(const sf_optimizer* opt, sf_optimizer_options* out) {
  constexpr const char* fn = "sf_optimizer_get_options";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, out, "out");
    if (out->struct_size == SF_OPTIMIZER_OPTIONS_SIZE_V1) {  // an older header's struct: its fields only
      sf_optimizer_options full;
      full.struct_size = sizeof full;
      from_cpp(opt->opt.options(), &full);
      std::memcpy(static_cast<void*>(out), &full, SF_OPTIMIZER_OPTIONS_SIZE_V1);
      out->struct_size = SF_OPTIMIZER_OPTIONS_SIZE_V1;
      return;
    }
    check_size(fn, out, "out", "sf_optimizer_options", "initialize it with sf_optimizer_options_init()");
    from_cpp(opt->opt.options(), out);
  });
}

sf_status sf_optimizer_set_lr(sf_optimizer* opt, double lr) {
  constexpr const char* fn = "sf_optimizer_set_lr";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.set_lr(lr); });
}

sf_status sf_optimizer_get_lr(const sf_optimizer* opt, double* lr) {
  constexpr const char* fn = "sf_optimizer_get_lr";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, lr, "lr") = opt->opt.lr();
  });
}

sf_status sf_optimizer_step_count(const sf_optimizer* opt, int64_t* count) {
  constexpr const char* fn = "sf_optimizer_step_count";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, count, "count") = opt->opt.step_count();
  });
}

sf_status sf_optimizer_last_grad_norm(const sf_optimizer* opt, double* norm) {
  constexpr const char* fn = "sf_optimizer_last_grad_norm";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, norm, "norm") = opt->opt.last_grad_norm();
  });
}

sf_status sf_optimizer_last_tensor_grad_norms(const sf_optimizer* opt, const double** norms, size_t* count) {
  constexpr const char* fn = "sf_optimizer_last_tensor_grad_norms";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, norms, "norms");
    need(fn, count, "count");
    const std::vector<double>& v = opt->opt.last_tensor_grad_norms();
    *norms = v.data();
    *count = v.size();
  });
}

sf_status sf_optimizer_num_params(const sf_optimizer* opt, size_t* count) {
  constexpr const char* fn = "sf_optimizer_num_params";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, count, "count") = opt->opt.num_params();
  });
}

sf_status sf_optimizer_num_threads(const sf_optimizer* opt, int* threads) {
  constexpr const char* fn = "sf_optimizer_num_threads";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, threads, "threads") = opt->opt.num_threads();
  });
}

sf_status sf_optimizer_backend(const sf_optimizer* opt, const char** name) {
  constexpr const char* fn = "sf_optimizer_backend";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, name, "name") = opt->opt.backend().data();  // string literals: NUL-terminated, static
  });
}

sf_status sf_optimizer_state_names(const sf_optimizer* opt, size_t* count) {
  constexpr const char* fn = "sf_optimizer_state_names";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, count, "count") = opt->state_names.size();
  });
}

sf_status sf_optimizer_state_name(const sf_optimizer* opt, size_t index, const char** name) {
  constexpr const char* fn = "sf_optimizer_state_name";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, name, "name");
    if (index >= opt->state_names.size())
      bad(fn, "index " + std::to_string(index) + " is out of range (the optimizer has " +
                  std::to_string(opt->state_names.size()) + " state names)");
    *name = opt->state_names[index].c_str();
  });
}

sf_status sf_optimizer_state(const sf_optimizer* opt, size_t param, const char* name, const float** data,
                             int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_state";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, name, "name");
    need(fn, data, "data");
    need(fn, numel, "numel");
    const std::span<const float> s = opt->opt.state(param, name);
    *data = s.data();
    *numel = static_cast<int64_t>(s.size());
  });
}

sf_status sf_optimizer_mutable_state(sf_optimizer* opt, size_t param, const char* name, float** data,
                                     int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_mutable_state";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, name, "name");
    need(fn, data, "data");
    need(fn, numel, "numel");
    const std::span<float> s = opt->opt.mutable_state(param, name);
    *data = s.data();
    *numel = static_cast<int64_t>(s.size());
  });
}

sf_status sf_optimizer_master(const sf_optimizer* opt, size_t param, const float** data, int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_master";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, data, "data");
    need(fn, numel, "numel");
    const std::span<const float> m = opt->opt.master(param);
    *data = m.empty() ? nullptr : m.data();
    *numel = static_cast<int64_t>(m.size());
  });
}

sf_status sf_optimizer_program_text(const sf_optimizer* opt, char* buf, size_t cap, size_t* needed) {
  constexpr const char* fn = "sf_optimizer_program_text";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    if (cap > 0) need(fn, buf, "buf");
    const std::string text = opt->opt.program_text();
    const std::size_t size = text.size() + 1;
    if (needed != nullptr) *needed = size;
    if (buf == nullptr) return;  // cap == 0: a size query
    copy_reason(text, buf, cap);
    if (cap < size)
      bad(fn, "cap = " + std::to_string(cap) + " is too small for the program text (" + std::to_string(size) +
                  " bytes with the NUL; the buffer holds a truncated copy)");
  });
}

sf_status sf_optimizer_save(const sf_optimizer* opt, const char* path, const sf_grad_scaler* scaler) {
  constexpr const char* fn = "sf_optimizer_save";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, path, "path");
    if (scaler != nullptr)
      opt->opt.save(path, scaler->scaler);
    else
      opt->opt.save(path);
  });
}

sf_status sf_optimizer_load(sf_optimizer* opt, const char* path, sf_grad_scaler* scaler) {
  constexpr const char* fn = "sf_optimizer_load";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    need(fn, path, "path");
    if (scaler != nullptr)
      opt->opt.load(path, scaler->scaler);
    else
      opt->opt.load(path);
  });
}

// ---- GradScaler -----------------------------------------------------------------

void sf_grad_scaler_options_init(sf_grad_scaler_options* options) {
  if (options == nullptr) return;
  // The defaults of GradScaler's constructor (grad_scaler.hpp), which are PyTorch's.
  *options = sf_grad_scaler_options{};
  options->struct_size = sizeof(sf_grad_scaler_options);
  options->device = "cuda";
  options->init_scale = 65536.0;
  options->growth_factor = 2.0;
  options->backoff_factor = 0.5;
  options->growth_interval = 2000;
  options->enabled = true;
}

sf_status sf_grad_scaler_create(const sf_grad_scaler_options* options, sf_grad_scaler** out) {
  constexpr const char* fn = "sf_grad_scaler_create";
  return guard(fn, [&] {
    sf_grad_scaler_options o;
    sf_grad_scaler_options_init(&o);
    if (options != nullptr) {
      check_size(fn, options, "options", "sf_grad_scaler_options", "initialize it with sf_grad_scaler_options_init()");
      o = *options;
    }
    need(fn, out, "out");
    need(fn, o.device, "options->device");
    *out = new sf_grad_scaler{stepfuse::GradScaler(o.device, o.init_scale, o.growth_factor, o.backoff_factor,
                                                   o.growth_interval, o.enabled)};
  });
}

void sf_grad_scaler_destroy(sf_grad_scaler* scaler) { delete scaler; }

sf_status sf_grad_scaler_scale(const sf_grad_scaler* scaler, double loss, double* scaled) {
  constexpr const char* fn = "sf_grad_scaler_scale";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    *need(fn, scaled, "scaled") = scaler->scaler.scale(loss);
  });
}

sf_status sf_grad_scaler_scale_(const sf_grad_scaler* scaler, sf_tensor_view tensor) {
  constexpr const char* fn = "sf_grad_scaler_scale_";
  return guard(fn, [&] { need(fn, scaler, "scaler")->scaler.scale_(to_view(fn, tensor, "tensor")); });
}

sf_status sf_grad_scaler_scale_views_(const sf_grad_scaler* scaler, const sf_tensor_view* tensors, size_t count) {
  constexpr const char* fn = "sf_grad_scaler_scale_views_";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    const std::vector<stepfuse::TensorView> views = to_views(fn, tensors, count, "tensors");
    scaler->scaler.scale_(std::span<const stepfuse::TensorView>(views));
  });
}

sf_status sf_grad_scaler_unscale_(sf_grad_scaler* scaler, sf_optimizer* opt) {
  constexpr const char* fn = "sf_grad_scaler_unscale_";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    need(fn, opt, "opt");
    scaler->scaler.unscale_(opt->opt);
  });
}

sf_status sf_grad_scaler_step(sf_grad_scaler* scaler, sf_optimizer* opt, bool* applied) {
  constexpr const char* fn = "sf_grad_scaler_step";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    need(fn, opt, "opt");
    const bool a = scaler->scaler.step(opt->opt);
    if (applied != nullptr) *applied = a;
  });
}

sf_status sf_grad_scaler_last_step_result(const sf_grad_scaler* scaler, sf_step_result* result) {
  constexpr const char* fn = "sf_grad_scaler_last_step_result";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    check_size(fn, result, "result", "sf_step_result", "initialize it with sf_step_result_init()");
    write_result(fn, scaler->scaler.last_step_result(), result, "result");
  });
}

sf_status sf_grad_scaler_update(sf_grad_scaler* scaler, const double* new_scale) {
  constexpr const char* fn = "sf_grad_scaler_update";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    scaler->scaler.update(new_scale != nullptr ? std::optional<double>(*new_scale) : std::nullopt);
  });
}

// Getters: `arg` is the out parameter's name in stepfuse.h (messages name it).
#define SF_SCALER_GETTER(name, type, arg, expr)                                  \
  sf_status sf_grad_scaler_##name(const sf_grad_scaler* scaler, type* arg) {    \
    constexpr const char* fn = "sf_grad_scaler_" #name;                         \
    return guard(fn, [&] {                                                      \
      need(fn, scaler, "scaler");                                               \
      *need(fn, arg, #arg) = scaler->scaler.expr;                               \
    });                                                                         \
  }
SF_SCALER_GETTER(get_scale, double, scale, get_scale())
SF_SCALER_GETTER(get_growth_factor, double, factor, get_growth_factor())
SF_SCALER_GETTER(get_backoff_factor, double, factor, get_backoff_factor())
SF_SCALER_GETTER(get_growth_interval, int64_t, interval, get_growth_interval())
SF_SCALER_GETTER(get_growth_tracker, int64_t, tracker, growth_tracker())
SF_SCALER_GETTER(is_enabled, bool, enabled, is_enabled())
SF_SCALER_GETTER(device, const char*, device, device().c_str())
#undef SF_SCALER_GETTER

sf_status sf_grad_scaler_set_growth_factor(sf_grad_scaler* scaler, double factor) {
  constexpr const char* fn = "sf_grad_scaler_set_growth_factor";
  return guard(fn, [&] { need(fn, scaler, "scaler")->scaler.set_growth_factor(factor); });
}

sf_status sf_grad_scaler_set_backoff_factor(sf_grad_scaler* scaler, double factor) {
  constexpr const char* fn = "sf_grad_scaler_set_backoff_factor";
  return guard(fn, [&] { need(fn, scaler, "scaler")->scaler.set_backoff_factor(factor); });
}

sf_status sf_grad_scaler_set_growth_interval(sf_grad_scaler* scaler, int64_t interval) {
  constexpr const char* fn = "sf_grad_scaler_set_growth_interval";
  return guard(fn, [&] { need(fn, scaler, "scaler")->scaler.set_growth_interval(interval); });
}

sf_status sf_grad_scaler_where_scale_lives(const sf_grad_scaler* scaler, sf_device* device) {
  constexpr const char* fn = "sf_grad_scaler_where_scale_lives";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    need(fn, device, "device");
    const stepfuse::Device d = scaler->scaler.where_scale_lives();
    *device = {static_cast<sf_device_kind>(d.kind), d.index};
  });
}

void sf_grad_scaler_state_init(sf_grad_scaler_state* state) {
  if (state == nullptr) return;
  *state = sf_grad_scaler_state{};
  state->struct_size = sizeof(sf_grad_scaler_state);
}

sf_status sf_grad_scaler_state_dict(const sf_grad_scaler* scaler, sf_grad_scaler_state* state) {
  constexpr const char* fn = "sf_grad_scaler_state_dict";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    check_size(fn, state, "state", "sf_grad_scaler_state", "initialize it with sf_grad_scaler_state_init()");
    const std::map<std::string, double> m = scaler->scaler.state_dict();
    sf_grad_scaler_state s{};
    s.struct_size = state->struct_size;
    s.empty = m.empty();
    if (!m.empty()) {
      s.scale = m.at("scale");
      s.growth_factor = m.at("growth_factor");
      s.backoff_factor = m.at("backoff_factor");
      s.growth_interval = static_cast<int64_t>(m.at("growth_interval"));
      s.growth_tracker = static_cast<int64_t>(m.at("_growth_tracker"));
    }
    *state = s;
  });
}

sf_status sf_grad_scaler_load_state_dict(sf_grad_scaler* scaler, const sf_grad_scaler_state* state) {
  constexpr const char* fn = "sf_grad_scaler_load_state_dict";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    check_size(fn, state, "state", "sf_grad_scaler_state", "initialize it with sf_grad_scaler_state_init()");
    std::map<std::string, double> m;
    if (!state->empty) {
      m["scale"] = state->scale;
      m["growth_factor"] = state->growth_factor;
      m["backoff_factor"] = state->backoff_factor;
      m["growth_interval"] = static_cast<double>(state->growth_interval);
      m["_growth_tracker"] = static_cast<double>(state->growth_tracker);
    }
    scaler->scaler.load_state_dict(m);
  });
}

// ---- LossScaleOptimizer ---------------------------------------------------------

void sf_loss_scale_optimizer_options_init(sf_loss_scale_optimizer_options* options) {
  if (options == nullptr) return;
  // The defaults of LossScaleOptimizer's constructor (loss_scale_optimizer.hpp), Keras's.
  *options = sf_loss_scale_optimizer_options{};
  options->struct_size = sizeof(sf_loss_scale_optimizer_options);
  options->dynamic = true;
  options->initial_scale = 32768.0;
  options->dynamic_growth_steps = 2000;
}

sf_status sf_loss_scale_optimizer_create(sf_optimizer* inner, const sf_loss_scale_optimizer_options* options,
                                         sf_loss_scale_optimizer** out) {
  constexpr const char* fn = "sf_loss_scale_optimizer_create";
  return guard(fn, [&] {
    need(fn, inner, "inner");
    sf_loss_scale_optimizer_options o;
    sf_loss_scale_optimizer_options_init(&o);
    if (options != nullptr) {
      check_size(fn, options, "options", "sf_loss_scale_optimizer_options",
                 "initialize it with sf_loss_scale_optimizer_options_init()");
      o = *options;
    }
    need(fn, out, "out");
    *out = new sf_loss_scale_optimizer{
        stepfuse::LossScaleOptimizer(inner->opt, o.dynamic, o.initial_scale, o.dynamic_growth_steps), inner};
  });
}

void sf_loss_scale_optimizer_destroy(sf_loss_scale_optimizer* lso) { delete lso; }

sf_status sf_loss_scale_optimizer_inner(const sf_loss_scale_optimizer* lso, sf_optimizer** inner) {
  constexpr const char* fn = "sf_loss_scale_optimizer_inner";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    *need(fn, inner, "inner") = lso->inner;
  });
}

sf_status sf_loss_scale_optimizer_get_scaled_loss(const sf_loss_scale_optimizer* lso, double loss, double* scaled) {
  constexpr const char* fn = "sf_loss_scale_optimizer_get_scaled_loss";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    *need(fn, scaled, "scaled") = lso->lso.get_scaled_loss(loss);
  });
}

sf_status sf_loss_scale_optimizer_get_unscaled_gradients(const sf_loss_scale_optimizer* lso,
                                                         const sf_tensor_view* grads, size_t count) {
  constexpr const char* fn = "sf_loss_scale_optimizer_get_unscaled_gradients";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    lso->lso.get_unscaled_gradients(to_views(fn, grads, count, "grads"));
  });
}

sf_status sf_loss_scale_optimizer_apply_gradients(sf_loss_scale_optimizer* lso, bool* applied) {
  constexpr const char* fn = "sf_loss_scale_optimizer_apply_gradients";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    const bool a = lso->lso.apply_gradients();
    if (applied != nullptr) *applied = a;
  });
}

sf_status sf_loss_scale_optimizer_minimize(sf_loss_scale_optimizer* lso, sf_backward_fn backward, void* user,
                                           bool* applied) {
  constexpr const char* fn = "sf_loss_scale_optimizer_minimize";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    if (backward == nullptr) bad(fn, "backward is NULL");
    // minimize() changes nothing before it calls backward, so throwing out of the
    // bridge on failure leaves the optimizer and the loss scale as they were.
    const bool a = lso->lso.minimize([&](double loss_scale) {
      if (const int rc = backward(loss_scale, user); rc != 0) throw CallbackFailed{rc};
    });
    if (applied != nullptr) *applied = a;
  });
}

sf_status sf_loss_scale_optimizer_last_result(const sf_loss_scale_optimizer* lso, sf_step_result* result) {
  constexpr const char* fn = "sf_loss_scale_optimizer_last_result";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    check_size(fn, result, "result", "sf_step_result", "initialize it with sf_step_result_init()");
    write_result(fn, lso->lso.last_result(), result, "result");
  });
}

#define SF_LSO_GETTER(name, type, arg, expr)                                               \
  sf_status sf_loss_scale_optimizer_##name(const sf_loss_scale_optimizer* lso, type* arg) { \
    constexpr const char* fn = "sf_loss_scale_optimizer_" #name;                          \
    return guard(fn, [&] {                                                                \
      need(fn, lso, "lso");                                                               \
      *need(fn, arg, #arg) = lso->lso.expr;                                               \
    });                                                                                   \
  }
SF_LSO_GETTER(loss_scale, double, scale, loss_scale())
SF_LSO_GETTER(dynamic, bool, dynamic, dynamic())
SF_LSO_GETTER(dynamic_counter, int64_t, counter, dynamic_counter())
SF_LSO_GETTER(dynamic_growth_steps, int64_t, steps, dynamic_growth_steps())
#undef SF_LSO_GETTER

sf_status sf_loss_scale_optimizer_get_hyper(const sf_loss_scale_optimizer* lso, const char* name, double* value) {
  constexpr const char* fn = "sf_loss_scale_optimizer_get_hyper";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    need(fn, name, "name");
    *need(fn, value, "value") = lso->lso.get_hyper(name);
  });
}

sf_status sf_loss_scale_optimizer_set_hyper(sf_loss_scale_optimizer* lso, const char* name, double value) {
  constexpr const char* fn = "sf_loss_scale_optimizer_set_hyper";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    need(fn, name, "name");
    lso->lso.set_hyper(name, value);
  });
}

sf_status sf_loss_scale_optimizer_save(const sf_loss_scale_optimizer* lso, const char* path) {
  constexpr const char* fn = "sf_loss_scale_optimizer_save";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    lso->lso.save(need(fn, path, "path"));
  });
}

sf_status sf_loss_scale_optimizer_load(sf_loss_scale_optimizer* lso, const char* path) {
  constexpr const char* fn = "sf_loss_scale_optimizer_load";
  return guard(fn, [&] {
    need(fn, lso, "lso");
    lso->lso.load(need(fn, path, "path"));
  });
}

}  // extern "C"
