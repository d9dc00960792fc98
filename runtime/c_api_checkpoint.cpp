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

sf_status sf_optimizer_load(sf_optimizer* opt, const char* path, sf_grad_scaler* scaler) {
  constexpr const char* fn = "sf_optimizer_load";
  return guard(fn, [&] {
    need_all(fn, opt, "opt", path, "path");
    if (scaler != nullptr)
      opt->opt.load(path, scaler->scaler);
    else
      opt->opt.load(path);
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
