// The C ABI of sf_optimizer (include/stepfuse/stepfuse.h): configs, options, creation, steps, what it reports.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "runtime/c_api_support.hpp"
#include "stepfuse/error.hpp"

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

extern "C" {

const char* sf_optimizer_kind_name(sf_optimizer_kind kind) {
  const int k = enum_value(kind);
  if (!valid_kind(k)) return nullptr;
  return stepfuse::optimizer_name(default_config(k)).data();  // string literals
}

// Today the sizes the sf_X_init functions write are the structs' (size_through).
static_assert(SF_SIZE_THROUGH(sf_optimizer_config, has_state_format) == sizeof(sf_optimizer_config));
static_assert(SF_SIZE_THROUGH(sf_optimizer_options, stochastic_state_rounding) == sizeof(sf_optimizer_options));
static_assert(SF_SIZE_THROUGH(sf_step_result, clip_coef) == sizeof(sf_step_result));
static_assert(SF_SIZE_THROUGH(sf_load_options, convert_state) == sizeof(sf_load_options));
static_assert(SF_SIZE_THROUGH(sf_grad_scaler_options, enabled) == sizeof(sf_grad_scaler_options));
static_assert(SF_SIZE_THROUGH(sf_grad_scaler_state, growth_tracker) == sizeof(sf_grad_scaler_state));
static_assert(SF_SIZE_THROUGH(sf_loss_scale_optimizer_options, dynamic_growth_steps) ==
              sizeof(sf_loss_scale_optimizer_options));
static_assert(SF_SIZE_THROUGH(sf_emit_request, cpu_features) == sizeof(sf_emit_request));
static_assert(SF_SIZE_THROUGH(sf_kernel_tables_info, step_state_bytes) == sizeof(sf_kernel_tables_info));

// (The sf_X_init functions are named in parentheses: stepfuse.h defines macros of those
// names, which pass the caller's sizeof to sf_X_init_size.)
void sf_optimizer_config_init_size(sf_optimizer_config* config, sf_optimizer_kind kind, size_t struct_size) {
  sf_optimizer_config full{};
  full.struct_size = sizeof full;
  if (const int k = enum_value(kind); valid_kind(k)) {
    config_to_c(default_config(k), &full);
  } else {
    std::memcpy(&full.kind, &k, sizeof k);  // rejected, with its value, by whatever uses it
  }
  init_struct(config, struct_size, full);
}
void(sf_optimizer_config_init)(sf_optimizer_config* config, sf_optimizer_kind kind) {
  sf_optimizer_config_init_size(config, kind, SF_SIZE_THROUGH(sf_optimizer_config, has_state_format));
}

void sf_optimizer_options_init_size(sf_optimizer_options* options, size_t struct_size) {
  sf_optimizer_options full{};
  full.struct_size = sizeof full;
  options_to_c(stepfuse::OptimizerOptions{}, &full);
  init_struct(options, struct_size, full);
}
void(sf_optimizer_options_init)(sf_optimizer_options* options) {
  sf_optimizer_options_init_size(options, SF_SIZE_THROUGH(sf_optimizer_options, stochastic_state_rounding));
}

void sf_step_result_init_size(sf_step_result* result, size_t struct_size) {
  init_struct(result, struct_size, sf_step_result{});
}
void(sf_step_result_init)(sf_step_result* result) {
  sf_step_result_init_size(result, SF_SIZE_THROUGH(sf_step_result, clip_coef));
}

sf_status sf_optimizer_create(const sf_optimizer_config* config, const sf_param* params, size_t num_params,
                              const sf_optimizer_options* options, sf_optimizer** out) {
  constexpr const char* fn = "sf_optimizer_create";
  return guard(fn, [&] {
    const sf_optimizer_config c = full_config(fn, config, "config");
    const sf_optimizer_options full = options != nullptr ? full_options(fn, options) : sf_optimizer_options{};
    need(fn, out, "out");
    if (num_params > 0) need(fn, params, "params");
    stepfuse::OptimizerConfig cfg = config_from_c(fn, c);
    const std::optional<stepfuse::StateFormat> format = group_format_from_c(fn, c, "config");
    std::vector<stepfuse::Param> ps = to_params(fn, params, num_params);
    const stepfuse::OptimizerOptions opts =
        options != nullptr ? options_from_c(fn, full) : stepfuse::OptimizerOptions{};
    if (!format) {
      *out = make_optimizer(stepfuse::Optimizer(std::move(cfg), std::move(ps), opts));
      return;
    }
    std::vector<stepfuse::ParamGroup> groups;  // the one group, with its own state format
    groups.push_back({std::move(ps), std::move(cfg), format});
    *out = make_optimizer(stepfuse::Optimizer(std::move(groups), opts));
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
  return get_result("sf_optimizer_last_result", opt, "opt", result, [&] { return opt->opt.last_result(); });
}

sf_status sf_optimizer_get_config(const sf_optimizer* opt, sf_optimizer_config* out) {
  constexpr const char* fn = "sf_optimizer_get_config";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    write_config(fn, opt->opt, 0, out);
  });
}

sf_status sf_optimizer_set_config(sf_optimizer* opt, const sf_optimizer_config* config) {
  constexpr const char* fn = "sf_optimizer_set_config";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    const sf_optimizer_config c = full_config(fn, config, "config");
    const stepfuse::OptimizerConfig cfg = config_from_c(fn, c);
    check_group_format(fn, opt->opt, 0, c);  // (group 0's, as sf_optimizer_get_config reports it)
    opt->opt.set_config(cfg);
  });
}

sf_status sf_optimizer_get_options(const sf_optimizer* opt, sf_optimizer_options* out) {
  constexpr const char* fn = "sf_optimizer_get_options";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", out, "out");
    sf_optimizer_options full;
    full.struct_size = sizeof full;
    options_to_c(opt->opt.options(), &full);
    full.state_formats = opt->state_formats.empty() ? nullptr : opt->state_formats.data();  // into the handle
    full.num_state_formats = opt->state_formats.size();
    write_struct(fn, full, out, older_options_fields(out->struct_size), "sf_optimizer_options",
                 "initialize it with sf_optimizer_options_init()");
  });
}

sf_status sf_optimizer_set_lr(sf_optimizer* opt, double lr) {
  constexpr const char* fn = "sf_optimizer_set_lr";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.set_lr(lr); });
}

sf_status sf_optimizer_get_lr(const sf_optimizer* opt, double* lr) {
  return get_value("sf_optimizer_get_lr", opt, "opt", lr, "lr", [&] { return opt->opt.lr(); });
}

namespace {
// A C param group as a ParamGroup; `where` names it in errors ("groups[1]").
stepfuse::ParamGroup group_from_c(const char* fn, const sf_param_group& g, const std::string& where) {
  if (g.config == nullptr)
    throw stepfuse::Error(stepfuse::ErrorCode::invalid_argument,
                          std::string(fn) + ": " + where + ".config is NULL (point it at an sf_optimizer_config)");
  const sf_optimizer_config c = full_config(fn, g.config, where + ".config");
  if (g.num_params > 0 && g.params == nullptr)
    throw stepfuse::Error(stepfuse::ErrorCode::invalid_argument, std::string(fn) + ": " + where +
                                                                     ".params is NULL with num_params = " +
                                                                     std::to_string(g.num_params));
  return {to_params(fn, g.params, g.num_params), config_from_c(fn, c), group_format_from_c(fn, c, where + ".config")};
}
}  // namespace

sf_status sf_optimizer_create_groups(const sf_param_group* groups, size_t num_groups,
                                     const sf_optimizer_options* options, sf_optimizer** out) {
  constexpr const char* fn = "sf_optimizer_create_groups";
  return guard(fn, [&] {
    const sf_optimizer_options full = options != nullptr ? full_options(fn, options) : sf_optimizer_options{};
    need(fn, out, "out");
    if (num_groups > 0) need(fn, groups, "groups");
    std::vector<stepfuse::ParamGroup> gs;
    for (size_t g = 0; g < num_groups; ++g) gs.push_back(group_from_c(fn, groups[g], "groups[" + std::to_string(g) + "]"));
    const stepfuse::OptimizerOptions opts =
        options != nullptr ? options_from_c(fn, full) : stepfuse::OptimizerOptions{};
    *out = make_optimizer(stepfuse::Optimizer(std::move(gs), opts));
  });
}

sf_status sf_optimizer_num_groups(const sf_optimizer* opt, size_t* count) {
  return get_value("sf_optimizer_num_groups", opt, "opt", count, "count", [&] { return opt->opt.num_groups(); });
}

sf_status sf_optimizer_get_group_config(const sf_optimizer* opt, size_t group, sf_optimizer_config* out) {
  constexpr const char* fn = "sf_optimizer_get_group_config";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    write_config(fn, opt->opt, group, out);
  });
}

sf_status sf_optimizer_set_group_config(sf_optimizer* opt, size_t group, const sf_optimizer_config* config) {
  constexpr const char* fn = "sf_optimizer_set_group_config";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    const sf_optimizer_config c = full_config(fn, config, "config");
    const stepfuse::OptimizerConfig cfg = config_from_c(fn, c);
    check_group_format(fn, opt->opt, group, c);
    opt->opt.set_config(group, cfg);
  });
}

sf_status sf_optimizer_get_group_lr(const sf_optimizer* opt, size_t group, double* lr) {
  return get_value("sf_optimizer_get_group_lr", opt, "opt", lr, "lr", [&] { return opt->opt.lr(group); });
}

sf_status sf_optimizer_set_group_lr(sf_optimizer* opt, size_t group, double lr) {
  constexpr const char* fn = "sf_optimizer_set_group_lr";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.set_lr(group, lr); });
}

sf_status sf_optimizer_group_step_count(const sf_optimizer* opt, size_t group, int64_t* count) {
  return get_value("sf_optimizer_group_step_count", opt, "opt", count, "count",
                   [&] { return opt->opt.group_step_count(group); });
}

sf_status sf_optimizer_set_group_step_count(sf_optimizer* opt, size_t group, int64_t count) {
  constexpr const char* fn = "sf_optimizer_set_group_step_count";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.set_group_step_count(group, count); });
}

sf_status sf_optimizer_nadam_mu_product(const sf_optimizer* opt, size_t group, double* mu_product) {
  return get_value("sf_optimizer_nadam_mu_product", opt, "opt", mu_product, "mu_product",
                   [&] { return opt->opt.nadam_mu_product(group); });
}

sf_status sf_optimizer_set_nadam_mu_product(sf_optimizer* opt, size_t group, double mu_product) {
  constexpr const char* fn = "sf_optimizer_set_nadam_mu_product";
  return guard(fn, [&] { need(fn, opt, "opt")->opt.set_nadam_mu_product(group, mu_product); });
}

sf_status sf_optimizer_add_param_group(sf_optimizer* opt, const sf_param_group* group) {
  constexpr const char* fn = "sf_optimizer_add_param_group";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", group, "group");
    opt->opt.add_param_group(group_from_c(fn, *group, "group"));
  });
}

sf_status sf_optimizer_group_of(const sf_optimizer* opt, size_t param, size_t* group) {
  return get_value("sf_optimizer_group_of", opt, "opt", group, "group", [&] { return opt->opt.group_of(param); });
}

sf_status sf_optimizer_step_count(const sf_optimizer* opt, int64_t* count) {
  return get_value("sf_optimizer_step_count", opt, "opt", count, "count", [&] { return opt->opt.step_count(); });
}

sf_status sf_optimizer_last_grad_norm(const sf_optimizer* opt, double* norm) {
  return get_value("sf_optimizer_last_grad_norm", opt, "opt", norm, "norm", [&] { return opt->opt.last_grad_norm(); });
}

sf_status sf_optimizer_last_tensor_grad_norms(const sf_optimizer* opt, const double** norms, size_t* count) {
  constexpr const char* fn = "sf_optimizer_last_tensor_grad_norms";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", norms, "norms", count, "count");
    const std::vector<double>& v = opt->opt.last_tensor_grad_norms();
    *norms = v.data();
    *count = v.size();
  });
}

sf_status sf_optimizer_num_params(const sf_optimizer* opt, size_t* count) {
  return get_value("sf_optimizer_num_params", opt, "opt", count, "count", [&] { return opt->opt.num_params(); });
}

sf_status sf_optimizer_num_threads(const sf_optimizer* opt, int* threads) {
  return get_value("sf_optimizer_num_threads", opt, "opt", threads, "threads", [&] { return opt->opt.num_threads(); });
}

sf_status sf_optimizer_backend(const sf_optimizer* opt, const char** name) {
  constexpr const char* fn = "sf_optimizer_backend";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    *need(fn, name, "name") = opt->opt.backend().data();  // string literals: NUL-terminated, static
  });
}

sf_status sf_optimizer_state_names(const sf_optimizer* opt, size_t* count) {
  return get_value("sf_optimizer_state_names", opt, "opt", count, "count", [&] { return opt->state_names.size(); });
}

sf_status sf_optimizer_state_name(const sf_optimizer* opt, size_t index, const char** name) {
  constexpr const char* fn = "sf_optimizer_state_name";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name");
    if (index >= opt->state_names.size())
      bad_argument(fn, "index " + std::to_string(index) + " is out of range (the optimizer has " +
                           std::to_string(opt->state_names.size()) + " state names)");
    *name = opt->state_names[index].c_str();
  });
}

sf_status sf_optimizer_state(const sf_optimizer* opt, size_t param, const char* name, const float** data,
                             int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_state";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", data, "data", numel, "numel");
    const std::span<const float> s = opt->opt.state(param, name);
    *data = s.data();
    *numel = static_cast<int64_t>(s.size());
  });
}

sf_status sf_optimizer_mutable_state(sf_optimizer* opt, size_t param, const char* name, float** data,
                                     int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_mutable_state";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", data, "data", numel, "numel");
    const std::span<float> s = opt->opt.mutable_state(param, name);
    *data = s.data();
    *numel = static_cast<int64_t>(s.size());
  });
}

sf_status sf_optimizer_state_format(const sf_optimizer* opt, size_t param, const char* name, sf_state_format* format) {
  constexpr const char* fn = "sf_optimizer_state_format";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", format, "format");
    *format = state_format_to_c(opt->opt.state_format(param, name));
  });
}

namespace {
// numel as a caller passed it for `values` (NULL allowed when 0).
std::size_t value_count(const char* fn, const float* values, int64_t numel) {
  if (numel < 0) bad_argument(fn, "numel = " + std::to_string(numel) + " is negative");
  if (numel > 0) need(fn, values, "values");
  return static_cast<std::size_t>(numel);
}
}  // namespace

sf_status sf_optimizer_state_values(const sf_optimizer* opt, size_t param, const char* name, float* values,
                                    int64_t numel) {
  constexpr const char* fn = "sf_optimizer_state_values";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name");
    const std::size_t n = value_count(fn, values, numel);
    const std::vector<float> v = opt->opt.state_values(param, name);
    if (v.size() != n)
      bad_argument(fn, "numel = " + std::to_string(numel) + ", but state '" + name + "' of param " +
                           std::to_string(param) + " has " + std::to_string(v.size()) + " elements");
    std::copy(v.begin(), v.end(), values);
  });
}

sf_status sf_optimizer_set_state_values(sf_optimizer* opt, size_t param, const char* name, const float* values,
                                        int64_t numel) {
  constexpr const char* fn = "sf_optimizer_set_state_values";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name");
    opt->opt.set_state_values(param, name, {values, value_count(fn, values, numel)});
  });
}

sf_status sf_optimizer_state_storage(const sf_optimizer* opt, size_t param, const char* name, const void** data,
                                     size_t* bytes) {
  constexpr const char* fn = "sf_optimizer_state_storage";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", data, "data", bytes, "bytes");
    const std::span<const std::byte> s = opt->opt.state_storage(param, name);
    *data = s.data();
    *bytes = s.size();
  });
}

sf_status sf_optimizer_mutable_state_storage(sf_optimizer* opt, size_t param, const char* name, void** data,
                                             size_t* bytes) {
  constexpr const char* fn = "sf_optimizer_mutable_state_storage";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", data, "data", bytes, "bytes");
    const std::span<std::byte> s = opt->opt.mutable_state_storage(param, name);
    *data = s.data();
    *bytes = s.size();
  });
}

sf_status sf_optimizer_state_absmax(const sf_optimizer* opt, size_t param, const char* name, const float** data,
                                    size_t* count) {
  constexpr const char* fn = "sf_optimizer_state_absmax";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", data, "data", count, "count");
    const std::span<const float> a = opt->opt.state_absmax(param, name);
    *data = a.empty() ? nullptr : a.data();
    *count = a.size();
  });
}

sf_status sf_optimizer_mutable_state_absmax(sf_optimizer* opt, size_t param, const char* name, float** data,
                                            size_t* count) {
  constexpr const char* fn = "sf_optimizer_mutable_state_absmax";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", name, "name", data, "data", count, "count");
    const std::span<float> a = opt->opt.mutable_state_absmax(param, name);
    *data = a.empty() ? nullptr : a.data();
    *count = a.size();
  });
}

sf_status sf_optimizer_master(const sf_optimizer* opt, size_t param, const float** data, int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_master";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", data, "data", numel, "numel");
    const std::span<const float> m = opt->opt.master(param);
    *data = m.empty() ? nullptr : m.data();
    *numel = static_cast<int64_t>(m.size());
  });
}

sf_status sf_optimizer_compensation(const sf_optimizer* opt, size_t param, const uint16_t** data, int64_t* numel) {
  constexpr const char* fn = "sf_optimizer_compensation";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", data, "data", numel, "numel");
    const std::span<const std::uint16_t> c = opt->opt.compensation(param);
    *data = c.empty() ? nullptr : c.data();
    *numel = static_cast<int64_t>(c.size());
  });
}

sf_status sf_optimizer_program_text(const sf_optimizer* opt, char* buf, size_t cap, size_t* needed) {
  constexpr const char* fn = "sf_optimizer_program_text";
  return guard(fn, [&] {
    need(fn, opt, "opt");
    copy_text(fn, opt->opt.program_text(), "the program text", buf, cap, needed);
  });
}

}  // extern "C"
