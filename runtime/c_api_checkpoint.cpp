// The C ABI's checkpoints (include/stepfuse/stepfuse.h): an optimizer (with its GradScaler), a LossScaleOptimizer.
#include "runtime/c_api_support.hpp"

using namespace stepfuse::c_api;  // guard, need, the checks and conversions (runtime/c_api_support.hpp)

extern "C" {

sf_status sf_optimizer_save(const sf_optimizer* opt, const char* path, const sf_grad_scaler* scaler) {
  constexpr const char* fn = "sf_optimizer_save";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", path, "path");
    if (scaler != nullptr)
      opt->opt.save(path, scaler->scaler);
    else
      opt->opt.save(path);
  });
}

void sf_load_options_init_size(sf_load_options* options, size_t struct_size) {
  sf_load_options full{};
  full.convert_state = stepfuse::LoadOptions{}.convert_state;
  init_struct(options, struct_size, full);
}
void(sf_load_options_init)(sf_load_options* options) {
  sf_load_options_init_size(options, SF_SIZE_THROUGH(sf_load_options, convert_state));
}

namespace {
// sf_optimizer_load and sf_optimizer_load_ex, named `fn`.
sf_status load_checkpoint(const char* fn, sf_optimizer* opt, const char* path, sf_grad_scaler* scaler,
                          const sf_load_options* options) {
  return guard(fn, [&] {
    need_all(fn, opt, "opt", path, "path");
    stepfuse::LoadOptions o;
    if (options != nullptr) {
      check_size(fn, options, "options", "sf_load_options", "initialize it with sf_load_options_init()");
      o.convert_state = bool_value(fn, options->convert_state, "options->convert_state");
    }
    if (scaler != nullptr)
      opt->opt.load(path, scaler->scaler, o);
    else
      opt->opt.load(path, o);
  });
}
}  // namespace

sf_status sf_optimizer_load(sf_optimizer* opt, const char* path, sf_grad_scaler* scaler) {
  return load_checkpoint("sf_optimizer_load", opt, path, scaler, nullptr);
}

sf_status sf_optimizer_load_ex(sf_optimizer* opt, const char* path, sf_grad_scaler* scaler,
                               const sf_load_options* options) {
  return load_checkpoint("sf_optimizer_load_ex", opt, path, scaler, options);
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
