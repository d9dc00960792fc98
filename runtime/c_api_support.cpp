// The C ABI's shared helpers (runtime/c_api_support.hpp): the guard, this thread's message, checks, conversions.
#include "runtime/c_api_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "jit/base/format.hpp"
#include "jit/config_fields.hpp"
#include "runtime/cpu/q8.hpp"
#include "stepfuse/error.hpp"

using stepfuse::DType;
using stepfuse::Error;
using stepfuse::ErrorCode;

// The C enums are the C++ ones, value for value (the conversions below are casts).
static_assert(SF_F32 == static_cast<int>(DType::f32) && SF_F16 == static_cast<int>(DType::f16) &&
              SF_BF16 == static_cast<int>(DType::bf16));
static_assert(SF_DEVICE_CPU == static_cast<int>(stepfuse::Device::Kind::cpu) &&
              SF_DEVICE_CUDA == static_cast<int>(stepfuse::Device::Kind::cuda));
static_assert(SF_STATE_F32 == static_cast<int>(stepfuse::StateFormat::f32) &&
              SF_STATE_BF16 == static_cast<int>(stepfuse::StateFormat::bf16) &&
              SF_STATE_Q8 == static_cast<int>(stepfuse::StateFormat::q8));
static_assert(SF_STATE_Q8_BLOCK == stepfuse::cpu::kQ8Block, "stepfuse.h and runtime/cpu/q8.hpp disagree on the q8 block");
static_assert(SF_FUSION_FUSED == static_cast<int>(stepfuse::Fusion::fused) &&
              SF_FUSION_UNFUSED == static_cast<int>(stepfuse::Fusion::unfused) &&
              SF_FUSION_INTERPRETED == static_cast<int>(stepfuse::Fusion::interpreted));
// sf_optimizer_kind is the index of the config type in stepfuse::OptimizerConfig, the
// registry of built-in optimizers: a kind added there needs its line in the C enum.
static_assert(stepfuse::jit::kNumOptimizers == SF_NUM_OPTIMIZER_KINDS,
              "stepfuse::OptimizerConfig and sf_optimizer_kind disagree: give every optimizer its SF_ kind");

namespace stepfuse::c_api {
namespace {

// ---- This thread's message ---------------------------------------------------------

thread_local std::string t_message;
// Set when the message itself could not be stored (out of memory): a static text.
thread_local const char* t_static_message = nullptr;

// Records this thread's message. `make` builds it (and may throw: then a static
// text stands in), so the catch clauses of guard_call() never throw.
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

std::string num(double v) { return stepfuse::detail::format_number(v); }

// ---- sf_optimizer_config by field name -------------------------------------------

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
    SF_FIELD(momentum_decay, false), SF_FIELD(rho, false),
    SF_FIELD(eta_minus, false), SF_FIELD(eta_plus, false), SF_FIELD(step_size_min, false),
    SF_FIELD(step_size_max, false), SF_FIELD(lambd, false),    SF_FIELD(t0, false),
    SF_FIELD(decoupled_weight_decay, true),
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
static_assert(config_fields_match(std::make_index_sequence<stepfuse::jit::kNumOptimizers>{}),
              "kConfigFields, sf_optimizer_config and the optimizers' fields disagree");
// (struct_size, kind, and the group's state format: state_format, has_state_format)
static_assert(stepfuse::jit::aggregate_members<sf_optimizer_config>() == 4 + std::size(kConfigFields),
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

}  // namespace

// ---- The guard -------------------------------------------------------------------

sf_status guard_call(const char* fn, void (*call)(void*), void* ctx) noexcept {
  try {
    call(ctx);
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

const char* last_message() noexcept { return t_static_message != nullptr ? t_static_message : t_message.c_str(); }

// ---- Argument checks -------------------------------------------------------------

void bad_argument(const char* fn, const std::string& message) {
  throw Error(ErrorCode::invalid_argument, std::string(fn) + ": " + message);
}

void bad_struct_size(const char* fn, const char* name, std::uint32_t size, std::size_t expected, const char* type,
                     const char* how) {
  bad_argument(fn, std::string(name) + "->struct_size = " + std::to_string(size) + ", but this library (" +
                       sf_version() + ") knows only " + std::to_string(expected) + " (sizeof(" + type +
                       ") in its stepfuse.h): " + how + ", and compile against the header of the library you link");
}

// ---- Conversions -----------------------------------------------------------------

TensorView to_view(const char* fn, const sf_tensor_view& v, const std::string& what) {
  const int dtype =
      enum_in_range(fn, v.dtype, SF_F32, SF_BF16, what + ".dtype", "an sf_dtype (SF_F32, SF_F16, SF_BF16)");
  return {v.data, v.numel, static_cast<DType>(dtype)};
}

std::vector<TensorView> to_views(const char* fn, const sf_tensor_view* views, std::size_t count, const char* name) {
  if (count > 0) need(fn, views, name);
  std::vector<TensorView> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i)
    out.push_back(to_view(fn, views[i], std::string(name) + "[" + std::to_string(i) + "]"));
  return out;
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

bool valid_kind(int kind) { return kind >= 0 && kind < SF_NUM_OPTIMIZER_KINDS; }

OptimizerConfig default_config(int kind) { return jit::default_config(static_cast<std::size_t>(kind)); }

OptimizerConfig config_from_c(const char* fn, const sf_optimizer_config& c) {
  const int kind_value = enum_value(c.kind);
  if (!valid_kind(kind_value))
    bad_argument(fn, "config->kind = " + std::to_string(kind_value) + " is not an sf_optimizer_kind (0 .. " +
                         std::to_string(SF_NUM_OPTIMIZER_KINDS - 1) + ")");
  OptimizerConfig config = default_config(kind_value);
  bool used[std::size(kConfigFields)] = {};
  std::visit(
      [&](auto& cfg) {
        jit::for_each_field(cfg, [&](std::string_view name, auto& v) {
          using V = std::remove_cvref_t<decltype(v)>;
          const ConfigField& f = config_field(name);
          used[&f - kConfigFields] = true;
          if constexpr (std::is_same_v<V, bool>) v = bool_value(fn, field_ref<bool>(c, f), std::string("config->") + f.name);
          else v = field_ref<V>(c, f);
        });
      },
      config);
  const std::string kind = std::string(optimizer_name(config));
  for (std::size_t i = 0; i < std::size(kConfigFields); ++i) {
    const ConfigField& f = kConfigFields[i];
    if (used[i]) continue;
    if (f.is_bool ? bool_value(fn, field_ref<bool>(c, f), std::string("config->") + f.name) : field_ref<double>(c, f) != 0.0)
      bad_argument(fn, std::string("config->") + f.name + " = " +
                           (f.is_bool ? "true" : num(field_ref<double>(c, f))) + ", but " + kind + " has no " + f.name +
                           " (the fields of other kinds must be 0/false: start from "
                           "sf_optimizer_config_init(cfg, kind))");
  }
  return config;
}

namespace {
// An older stepfuse.h's config struct (SF_OPTIMIZER_CONFIG_SIZE_V1): its fields' bytes, else 0.
std::size_t older_config_fields(std::uint32_t struct_size) {
  constexpr std::size_t kAlign = alignof(sf_optimizer_config), kEnd = SF_OPTIMIZER_CONFIG_SIZE_V1;
  static_assert(sizeof(sf_optimizer_config) > (kEnd + kAlign - 1) / kAlign * kAlign,
                "the struct's size must tell it from the older one's");
  return older_fields<sf_optimizer_config>(struct_size, {kEnd});
}

// The format group `group`'s state streams take (but those state_formats names).
StateFormat group_takes(const Optimizer& opt, std::size_t group) {
  return opt.group_state_format(group).value_or(opt.options().state_format);
}
}  // namespace

sf_optimizer_config full_config(const char* fn, const sf_optimizer_config* c, const std::string& name) {
  need(fn, c, name.c_str());
  if (const std::size_t fields = older_config_fields(c->struct_size)) {
    sf_optimizer_config full{};
    std::memcpy(static_cast<void*>(&full), c, fields);  // an older header's struct: the rest defaults
    full.struct_size = sizeof full;
    full.state_format = SF_STATE_F32;
    full.has_state_format = false;
    return full;
  }
  check_size(fn, c, name.c_str(), "sf_optimizer_config", "initialize it with sf_optimizer_config_init()");
  return *c;
}

OptimizerConfig to_config(const char* fn, const sf_optimizer_config* config) {
  const sf_optimizer_config full = full_config(fn, config, "config");
  if (bool_value(fn, full.has_state_format, "config->has_state_format"))
    bad_argument(fn, "config->has_state_format is set, but an emitted program keeps no state storage of its own "
                     "(state formats are an optimizer's: sf_optimizer_create); leave it false");
  return config_from_c(fn, full);
}

std::optional<StateFormat> group_format_from_c(const char* fn, const sf_optimizer_config& c, const std::string& name) {
  if (!bool_value(fn, c.has_state_format, name + "->has_state_format")) return std::nullopt;
  return state_format_from_c(fn, c.state_format, name + "->state_format");
}

void write_config(const char* fn, const Optimizer& opt, std::size_t group, sf_optimizer_config* out) {
  need(fn, out, "out");
  sf_optimizer_config full;
  full.struct_size = sizeof full;
  config_to_c(opt.config(group), &full);
  full.has_state_format = opt.group_state_format(group).has_value();
  full.state_format = state_format_to_c(group_takes(opt, group));
  write_struct(fn, full, out, older_config_fields(out->struct_size), "sf_optimizer_config",
               "initialize it with sf_optimizer_config_init()");
}

void check_group_format(const char* fn, const Optimizer& opt, std::size_t group, const sf_optimizer_config& c) {
  const std::optional<StateFormat> asked = group_format_from_c(fn, c, "config");
  if (!asked || group >= opt.num_groups()) return;  // (a bad group index is the setter's error)
  const StateFormat takes = group_takes(opt, group);
  if (*asked == takes) return;
  bad_argument(fn, "config->state_format = " + std::string(state_format_name(*asked)) + ", but group " +
                       std::to_string(group) + " takes " + std::string(state_format_name(takes)) +
                       " as its state format: a group's state format is chosen when the group is created (leave "
                       "has_state_format false here; to change the format, save a checkpoint and load it into a "
                       "new optimizer with sf_load_options.convert_state)");
}

void config_to_c(const OptimizerConfig& config, sf_optimizer_config* out) {
  const std::uint32_t size = out->struct_size;
  std::memset(static_cast<void*>(out), 0, sizeof *out);
  out->struct_size = size;
  out->kind = static_cast<sf_optimizer_kind>(config.index());
  std::visit(
      [&](const auto& c) {
        jit::for_each_field(c, [&](std::string_view name, const auto& v) {
          using V = std::remove_cvref_t<decltype(v)>;
          field_ref<V>(*out, config_field(name)) = v;
        });
      },
      config);
}

StateFormat state_format_from_c(const char* fn, const sf_state_format& f, const std::string& name) {
  return static_cast<StateFormat>(
      enum_in_range(fn, f, SF_STATE_F32, SF_STATE_Q8, name, "an sf_state_format (SF_STATE_F32, SF_STATE_BF16, SF_STATE_Q8)"));
}

std::size_t older_options_fields(std::uint32_t struct_size) {
  return older_fields<sf_optimizer_options>(
      struct_size, {SF_OPTIMIZER_OPTIONS_SIZE_V1, SF_OPTIMIZER_OPTIONS_SIZE_V2, SF_OPTIMIZER_OPTIONS_SIZE_V3,
                    SF_OPTIMIZER_OPTIONS_SIZE_V4, SF_OPTIMIZER_OPTIONS_SIZE_V5});
}

sf_optimizer_options full_options(const char* fn, const sf_optimizer_options* o) {
  need(fn, o, "options");
  sf_optimizer_options full;
  sf_optimizer_options_init(&full);
  if (const std::size_t fields = older_options_fields(o->struct_size)) {
    std::memcpy(static_cast<void*>(&full), o, fields);  // an older header's struct: the rest defaults
    full.struct_size = sizeof full;
    return full;
  }
  check_size(fn, o, "options", "sf_optimizer_options", "initialize it with sf_optimizer_options_init()");
  return *o;
}

OptimizerOptions options_from_c(const char* fn, const sf_optimizer_options& o) {
  OptimizerOptions out;
  const int device_kind = enum_in_range(fn, o.device.kind, SF_DEVICE_CPU, SF_DEVICE_CUDA, "options->device.kind",
                                        "an sf_device_kind (SF_DEVICE_CPU, SF_DEVICE_CUDA)");
  out.device = {static_cast<Device::Kind>(device_kind), o.device.index};
  out.cuda_stream = o.cuda_stream;
  if (bool_value(fn, o.has_max_grad_norm, "options->has_max_grad_norm")) out.max_grad_norm = o.max_grad_norm;
  const int norm_type = enum_in_range(fn, o.norm_type, SF_NORM_L2, SF_NORM_INF, "options->norm_type",
                                      "an sf_norm_type (SF_NORM_L2, SF_NORM_INF)");
  out.norm_type = norm_type == SF_NORM_L2 ? 2.0 : INFINITY;
  out.master_weights = bool_value(fn, o.master_weights, "options->master_weights");
  const int fusion = enum_in_range(fn, o.fusion, SF_FUSION_FUSED, SF_FUSION_INTERPRETED, "options->fusion",
                                   "an sf_fusion (SF_FUSION_FUSED, SF_FUSION_UNFUSED, SF_FUSION_INTERPRETED)");
  out.fusion = static_cast<Fusion>(fusion);
  out.num_threads = o.num_threads;
  out.track_grad_norm = bool_value(fn, o.track_grad_norm, "options->track_grad_norm");
  const int backend =
      enum_in_range(fn, o.cpu_backend, SF_CPU_BACKEND_DEFAULT, SF_CPU_BACKEND_LLVM, "options->cpu_backend",
                    "an sf_cpu_backend (SF_CPU_BACKEND_DEFAULT, _AUTO, _HIGHWAY, _LLVM)");
  if (backend != SF_CPU_BACKEND_DEFAULT) out.cpu_backend = static_cast<CpuBackend>(backend - 1);
  out.llvm_contract = bool_value(fn, o.llvm_contract, "options->llvm_contract");
  out.stochastic_rounding = bool_value(fn, o.stochastic_rounding, "options->stochastic_rounding");
  out.seed = o.seed;
  out.compensated_weights = bool_value(fn, o.compensated_weights, "options->compensated_weights");
  out.state_format = state_format_from_c(fn, o.state_format, "options->state_format");
  if (o.num_state_formats > 0 && o.state_formats == nullptr)
    bad_argument(fn, "options->state_formats is NULL with num_state_formats = " + std::to_string(o.num_state_formats));
  for (std::size_t i = 0; i < o.num_state_formats; ++i) {
    const std::string at = "options->state_formats[" + std::to_string(i) + "]";
    const sf_stream_format& f = o.state_formats[i];
    if (f.stream == nullptr) bad_argument(fn, at + ".stream is NULL (name a state stream: \"exp_avg\", ...)");
    out.state_formats.emplace_back(f.stream, state_format_from_c(fn, f.format, at + ".format"));
  }
  out.min_q8_numel = o.min_q8_numel;
  out.stochastic_state_rounding = bool_value(fn, o.stochastic_state_rounding, "options->stochastic_state_rounding");
  return out;
}

OptimizerOptions to_options(const char* fn, const sf_optimizer_options* options) {
  if (options == nullptr) return OptimizerOptions{};
  return options_from_c(fn, full_options(fn, options));
}

void options_to_c(const OptimizerOptions& o, sf_optimizer_options* out) {
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
  out->stochastic_rounding = o.stochastic_rounding;
  out->seed = o.seed;
  out->compensated_weights = o.compensated_weights;
  out->state_format = state_format_to_c(o.state_format);
  out->state_formats = nullptr;  // (memset above; pointers into a handle: sf_optimizer_get_options)
  out->num_state_formats = 0;
  out->min_q8_numel = o.min_q8_numel;
  out->stochastic_state_rounding = o.stochastic_state_rounding;
}

void write_result(const char* fn, const StepResult& r, sf_step_result* out, const char* name) {
  check_size(fn, out, name, "sf_step_result", "initialize it with sf_step_result_init()");
  out->applied = r.applied;
  out->found_inf = r.found_inf;
  out->pending = r.pending;
  out->grad_norm = r.grad_norm;
  out->clip_coef = r.clip_coef;
}

// ---- Handles and text --------------------------------------------------------------

sf_optimizer* make_optimizer(Optimizer&& opt) {
  auto* h = new sf_optimizer{std::move(opt), {}, {}, {}};
  try {
    for (std::string_view n : h->opt.state_names()) h->state_names.emplace_back(n);
    const auto& formats = h->opt.options().state_formats;
    for (const auto& [stream, format] : formats) h->state_format_streams.push_back(stream);
    for (std::size_t i = 0; i < formats.size(); ++i)  // (the names are all in place: no reallocation moves them)
      h->state_formats.push_back({h->state_format_streams[i].c_str(), state_format_to_c(formats[i].second)});
  } catch (...) {
    delete h;
    throw;
  }
  return h;
}

void copy_truncated(const std::string& text, char* buf, std::size_t cap) {
  if (buf == nullptr || cap == 0) return;
  const std::size_t n = std::min(text.size(), cap - 1);
  std::memcpy(buf, text.data(), n);
  buf[n] = '\0';
}

void copy_text(const char* fn, const std::string& text, const char* what, char* buf, std::size_t cap,
               std::size_t* needed) {
  if (cap > 0) need(fn, buf, "buf");
  const std::size_t size = text.size() + 1;
  if (needed != nullptr) *needed = size;
  if (buf == nullptr) return;  // cap == 0: a size query
  copy_truncated(text, buf, cap);
  if (cap < size)
    bad_argument(fn, "cap = " + std::to_string(cap) + " is too small for " + what + " (" + std::to_string(size) +
                         " bytes with the NUL; the buffer holds a truncated copy)");
}

}  // namespace stepfuse::c_api
