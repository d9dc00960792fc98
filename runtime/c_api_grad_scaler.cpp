// The C ABI of sf_grad_scaler (include/stepfuse/stepfuse.h): torch.amp.GradScaler's loss scaling over an optimizer.
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "runtime/c_api_support.hpp"

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

extern "C" {

void sf_grad_scaler_options_init_size(sf_grad_scaler_options* options, size_t struct_size) {
  // The defaults of GradScaler's constructor (grad_scaler.hpp), which are PyTorch's.
  sf_grad_scaler_options full{};
  full.device = "cuda";
  full.init_scale = 65536.0;
  full.growth_factor = 2.0;
  full.backoff_factor = 0.5;
  full.growth_interval = 2000;
  full.enabled = true;
  init_struct(options, struct_size, full);
}
void(sf_grad_scaler_options_init)(sf_grad_scaler_options* options) {
  sf_grad_scaler_options_init_size(options, SF_SIZE_THROUGH(sf_grad_scaler_options, enabled));
}

sf_status sf_grad_scaler_create(const sf_grad_scaler_options* options, sf_grad_scaler** out) {
  constexpr const char* fn = "sf_grad_scaler_create";
  return guard(fn, [&] {
    sf_grad_scaler_options o;
    sf_grad_scaler_options_init(&o);
    if (options != nullptr) {
      check_size(fn, options, "options", "sf_grad_scaler_options", "initialize it with sf_grad_scaler_options_init()");
      bool_value(fn, options->enabled, "options->enabled");  // before the bool is copied as one
      o = *options;
    }
    need_all(fn, out, "out", o.device, "options->device");
    *out = new sf_grad_scaler{stepfuse::GradScaler(o.device, o.init_scale, o.growth_factor, o.backoff_factor,
                                                   o.growth_interval, o.enabled)};
  });
}

void sf_grad_scaler_destroy(sf_grad_scaler* scaler) { delete scaler; }

sf_status sf_grad_scaler_scale(const sf_grad_scaler* scaler, double loss, double* scaled) {
  return get_value("sf_grad_scaler_scale", scaler, "scaler", scaled, "scaled",
                   [&] { return scaler->scaler.scale(loss); });
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
    need_all(fn, scaler, "scaler", opt, "opt");
    scaler->scaler.unscale_(opt->opt);
  });
}

sf_status sf_grad_scaler_step(sf_grad_scaler* scaler, sf_optimizer* opt, bool* applied) {
  constexpr const char* fn = "sf_grad_scaler_step";
  return guard(fn, [&] {
    need_all(fn, scaler, "scaler", opt, "opt");
    const bool a = scaler->scaler.step(opt->opt);
    if (applied != nullptr) *applied = a;
  });
}

sf_status sf_grad_scaler_last_step_result(const sf_grad_scaler* scaler, sf_step_result* result) {
  return get_result("sf_grad_scaler_last_step_result", scaler, "scaler", result,
                    [&] { return scaler->scaler.last_step_result(); });
}

sf_status sf_grad_scaler_update(sf_grad_scaler* scaler, const double* new_scale) {
  constexpr const char* fn = "sf_grad_scaler_update";
  return guard(fn, [&] {
    need(fn, scaler, "scaler");
    scaler->scaler.update(new_scale != nullptr ? std::optional<double>(*new_scale) : std::nullopt);
  });
}

SF_C_GETTER(sf_grad_scaler_get_scale, sf_grad_scaler, scaler, double, scale, scaler.get_scale())
SF_C_GETTER(sf_grad_scaler_get_growth_factor, sf_grad_scaler, scaler, double, factor, scaler.get_growth_factor())
SF_C_GETTER(sf_grad_scaler_get_backoff_factor, sf_grad_scaler, scaler, double, factor, scaler.get_backoff_factor())
SF_C_GETTER(sf_grad_scaler_get_growth_interval, sf_grad_scaler, scaler, int64_t, interval, scaler.get_growth_interval())
SF_C_GETTER(sf_grad_scaler_get_growth_tracker, sf_grad_scaler, scaler, int64_t, tracker, scaler.growth_tracker())
SF_C_GETTER(sf_grad_scaler_is_enabled, sf_grad_scaler, scaler, bool, enabled, scaler.is_enabled())
SF_C_GETTER(sf_grad_scaler_device, sf_grad_scaler, scaler, const char*, device, scaler.device().c_str())

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
    need_all(fn, scaler, "scaler", device, "device");
    const stepfuse::Device d = scaler->scaler.where_scale_lives();
    *device = {static_cast<sf_device_kind>(d.kind), d.index};
  });
}

void sf_grad_scaler_state_init_size(sf_grad_scaler_state* state, size_t struct_size) {
  init_struct(state, struct_size, sf_grad_scaler_state{});
}
void(sf_grad_scaler_state_init)(sf_grad_scaler_state* state) {
  sf_grad_scaler_state_init_size(state, SF_SIZE_THROUGH(sf_grad_scaler_state, growth_tracker));
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
    if (!bool_value(fn, state->empty, "state->empty")) {
      m["scale"] = state->scale;
      m["growth_factor"] = state->growth_factor;
      m["backoff_factor"] = state->backoff_factor;
      m["growth_interval"] = static_cast<double>(state->growth_interval);
      m["_growth_tracker"] = static_cast<double>(state->growth_tracker);
    }
    scaler->scaler.load_state_dict(m);
  });
}

}  // extern "C"
