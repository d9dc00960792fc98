// The C ABI of sf_loss_scale_optimizer (include/stepfuse/stepfuse.h): Keras's LossScaleOptimizer over an sf_optimizer.
#include <cstdint>
#include <vector>

#include "runtime/c_api_support.hpp"

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

extern "C" {

void sf_loss_scale_optimizer_options_init_size(sf_loss_scale_optimizer_options* options, size_t struct_size) {
  // The defaults of LossScaleOptimizer's constructor (loss_scale_optimizer.hpp), Keras's.
  sf_loss_scale_optimizer_options full{};
  full.dynamic = true;
  full.initial_scale = 32768.0;
  full.dynamic_growth_steps = 2000;
  init_struct(options, struct_size, full);
}
void(sf_loss_scale_optimizer_options_init)(sf_loss_scale_optimizer_options* options) {
  sf_loss_scale_optimizer_options_init_size(
      options, SF_SIZE_THROUGH(sf_loss_scale_optimizer_options, dynamic_growth_steps));
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
      bool_value(fn, options->dynamic, "options->dynamic");  // before the bool is copied as one
      o = *options;
    }
    need(fn, out, "out");
    *out = new sf_loss_scale_optimizer{
        stepfuse::LossScaleOptimizer(inner->opt, o.dynamic, o.initial_scale, o.dynamic_growth_steps), inner};
  });
}

void sf_loss_scale_optimizer_destroy(sf_loss_scale_optimizer* lso) { delete lso; }

sf_status sf_loss_scale_optimizer_inner(const sf_loss_scale_optimizer* lso, sf_optimizer** inner) {
  return get_value("sf_loss_scale_optimizer_inner", lso, "lso", inner, "inner", [&] { return lso->inner; });
}

sf_status sf_loss_scale_optimizer_get_scaled_loss(const sf_loss_scale_optimizer* lso, double loss, double* scaled) {
  return get_value("sf_loss_scale_optimizer_get_scaled_loss", lso, "lso", scaled, "scaled",
                   [&] { return lso->lso.get_scaled_loss(loss); });
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
    if (backward == nullptr) bad_argument(fn, "backward is NULL");
    // minimize() changes nothing before it calls backward, so throwing out of the
    // bridge on failure leaves the optimizer and the loss scale as they were.
    const bool a = lso->lso.minimize([&](double loss_scale) {
      if (const int rc = backward(loss_scale, user); rc != 0) throw CallbackFailed{rc};
    });
    if (applied != nullptr) *applied = a;
  });
}

sf_status sf_loss_scale_optimizer_last_result(const sf_loss_scale_optimizer* lso, sf_step_result* result) {
  return get_result("sf_loss_scale_optimizer_last_result", lso, "lso", result, [&] { return lso->lso.last_result(); });
}

SF_C_GETTER(sf_loss_scale_optimizer_loss_scale, sf_loss_scale_optimizer, lso, double, scale, lso.loss_scale())
SF_C_GETTER(sf_loss_scale_optimizer_dynamic, sf_loss_scale_optimizer, lso, bool, dynamic, lso.dynamic())
SF_C_GETTER(sf_loss_scale_optimizer_dynamic_counter, sf_loss_scale_optimizer, lso, int64_t, counter,
            lso.dynamic_counter())
SF_C_GETTER(sf_loss_scale_optimizer_dynamic_growth_steps, sf_loss_scale_optimizer, lso, int64_t, steps,
            lso.dynamic_growth_steps())

sf_status sf_loss_scale_optimizer_get_hyper(const sf_loss_scale_optimizer* lso, const char* name, double* value) {
  constexpr const char* fn = "sf_loss_scale_optimizer_get_hyper";
  return get_value(fn, lso, "lso", value, "value", [&] { return lso->lso.get_hyper(need(fn, name, "name")); });
}

sf_status sf_loss_scale_optimizer_set_hyper(sf_loss_scale_optimizer* lso, const char* name, double value) {
  constexpr const char* fn = "sf_loss_scale_optimizer_set_hyper";
  return guard(fn, [&] { need(fn, lso, "lso")->lso.set_hyper(need(fn, name, "name"), value); });
}

}  // extern "C"
