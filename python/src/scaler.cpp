// stepfuse.GradScaler (torch.amp.GradScaler's semantics) and stepfuse.LossScaleOptimizer
// (tf.keras.mixed_precision.LossScaleOptimizer's), over the fused step.
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"

namespace sfpy {

namespace {

using stepfuse::GradScaler;

// One tensor or a list of them.
std::vector<Tensor> tensors_of(nb::handle obj, const char* what) {
  std::vector<Tensor> out;
  if (nb::isinstance<nb::list>(obj) || nb::isinstance<nb::tuple>(obj)) {
    std::size_t i = 0;
    for (nb::handle t : obj) out.push_back(import_tensor(t, std::string(what) + "[" + std::to_string(i++) + "]"));
  } else {
    out.push_back(import_tensor(obj, what));
  }
  return out;
}

std::vector<stepfuse::TensorView> views_of(const std::vector<Tensor>& ts) {
  std::vector<stepfuse::TensorView> v;
  for (const Tensor& t : ts) v.push_back(t.view);
  return v;
}

std::string num(double x) { return nb::repr(nb::float_(x)).c_str(); }

// The Python LossScaleOptimizer: the C++ one and the Python Optimizer it
// wraps (whose C++ optimizer it points to): keep_alive on the constructor keeps that one alive.
struct PyLossScaleOptimizer {
  PyOptimizer* inner;
  stepfuse::LossScaleOptimizer lso;
};

}  // namespace

void bind_scaler(nb::module_& m) {
  nb::class_<GradScaler>(
      m, "GradScaler",
      "Dynamic loss scaling with the semantics of torch.amp.GradScaler, over the fused step:\n\n"
      "    scaler = GradScaler('cpu')\n"
      "    (loss * scaler.get_scale()).backward()   # or scaler.scale(loss) for a float loss\n"
      "    scaler.step(opt)                          # unscale + inf/NaN check + clip + update, fused\n"
      "    scaler.update()\n\n"
      "device: 'cuda' (default; warns once and keeps the scale on the CPU where no GPU is usable) or 'cpu'.\n"
      "The scaler keeps every Optimizer it stepped or unscaled alive (the C++ scaler refers to them).\n"
      "Not thread-safe: one scaler per training loop.")
      .def(nb::init<std::string_view, double, double, double, std::int64_t, bool>(), nb::arg("device") = "cuda",
           nb::arg("init_scale") = 65536.0, nb::arg("growth_factor") = 2.0, nb::arg("backoff_factor") = 0.5,
           nb::arg("growth_interval") = 2000, nb::arg("enabled") = true)
      .def(
          "scale", [](const GradScaler& s, double loss) { return s.scale(loss); }, nb::arg("loss"),
          "loss * scale (loss itself when disabled).")
      .def(
          "scale_",
          [](const GradScaler& s, nb::handle outputs) {
            std::vector<Tensor> ts = tensors_of(outputs, "outputs");
            std::vector<stepfuse::TensorView> v = views_of(ts);
            nb::gil_scoped_release nogil;
            s.scale_(std::span<const stepfuse::TensorView>(v));
          },
          nb::arg("outputs"),
          "Multiplies a tensor (or each of a list) in place by the scale, rounding to its dtype. No-op when "
          "disabled.",
          nb::sig("def scale_(self, outputs: object) -> None"))
      .def(
          "unscale_",
          [](GradScaler& s, PyOptimizer& opt) {
            nb::gil_scoped_release nogil;
            s.unscale_(opt.get());
          },
          nb::arg("optimizer"), nb::keep_alive<1, 2>(),
          "Divides the optimizer's gradients in place by the scale and records whether any was inf/NaN. Optional: "
          "for code that inspects or clips gradients before step().")
      .def(
          "step",
          [](GradScaler& s, PyOptimizer& opt) {
            nb::gil_scoped_release nogil;
            return s.step(opt.get());
          },
          nb::arg("optimizer"), nb::keep_alive<1, 2>(),
          "The fused step (unscale, inf/NaN check, clip, update); skipped on inf/NaN. Returns whether it was "
          "applied (on a GPU: True, the skip is decided on the device; see last_step_result).")
      .def("update", &GradScaler::update, nb::arg("new_scale") = nb::none(),
           "Ends the iteration: backs off after a skipped step, grows after growth_interval good ones; or sets "
           "new_scale.")
      .def("get_scale", &GradScaler::get_scale, "The scale (1.0 when disabled).")
      .def("get_growth_factor", &GradScaler::get_growth_factor)
      .def("set_growth_factor", &GradScaler::set_growth_factor, nb::arg("new_factor"))
      .def("get_backoff_factor", &GradScaler::get_backoff_factor)
      .def("set_backoff_factor", &GradScaler::set_backoff_factor, nb::arg("new_factor"))
      .def("get_growth_interval", &GradScaler::get_growth_interval)
      .def("set_growth_interval", &GradScaler::set_growth_interval, nb::arg("new_interval"))
      .def("is_enabled", &GradScaler::is_enabled)
      .def(
          "state_dict",
          [](const GradScaler& s) {
            nb::dict d;
            for (const auto& [k, v] : s.state_dict()) {
              // As torch's: growth_interval and _growth_tracker are ints.
              if (k == "growth_interval" || k == "_growth_tracker") d[k.c_str()] = static_cast<std::int64_t>(v);
              else d[k.c_str()] = v;
            }
            return d;
          },
          "scale, growth_factor, backoff_factor, growth_interval and _growth_tracker (empty when disabled), as "
          "torch.amp.GradScaler.state_dict(). Call it after update().",
          nb::sig("def state_dict(self) -> dict[str, float | int]"))
      .def(
          "load_state_dict",
          [](GradScaler& s, nb::dict state) {
            std::map<std::string, double> m;
            for (auto [k, v] : state) {
              std::string key;
              double value;
              if (!nb::try_cast(k, key)) throw nb::type_error("load_state_dict: the keys must be strings");
              // Numbers (and anything float() takes: NumPy scalars, 0-d tensors); other entries
              // are ignored, as the C++ scaler ignores extra keys.
              if (nb::try_cast(v, value)) m[key] = value;
            }
            s.load_state_dict(m);
          },
          nb::arg("state_dict"), "Restores a state_dict(); nothing changes on an error.",
          nb::sig("def load_state_dict(self, state_dict: dict[str, float | int]) -> None"))
      .def_prop_ro("last_step_result", &GradScaler::last_step_result, "What the last step() did.")
      .def_prop_ro("device", &GradScaler::device, "'cuda' or 'cpu', as given.")
      .def_prop_ro(
          "where_scale_lives", [](const GradScaler& s) { return device_name(s.where_scale_lives()); },
          "Where the scale actually is: 'cpu' or 'cuda:N'.")
      .def_prop_ro("growth_tracker", &GradScaler::growth_tracker)
      .def("__repr__", [](const GradScaler& s) {
        if (!s.is_enabled()) return std::string("GradScaler(enabled=False)");
        return "GradScaler(device='" + s.device() + "', scale=" + num(s.get_scale()) +
               ", growth_factor=" + num(s.get_growth_factor()) + ", backoff_factor=" + num(s.get_backoff_factor()) +
               ", growth_interval=" + std::to_string(s.get_growth_interval()) + ")";
      });

  using L = PyLossScaleOptimizer;
  nb::class_<L>(m, "LossScaleOptimizer",
                "Dynamic loss scaling with the semantics of tf.keras.mixed_precision.LossScaleOptimizer, over an "
                "Optimizer (which it keeps alive). The scale halves (never below 1) on a step with inf/NaN "
                "gradients, which is skipped, and doubles after dynamic_growth_steps finite steps in a row.")
      .def(
          "__init__",
          [](L* self, PyOptimizer& inner, bool dynamic, double initial_scale, std::int64_t growth_steps) {
            new (self) L{&inner,
                         stepfuse::LossScaleOptimizer(inner.get(), dynamic, initial_scale, growth_steps)};
          },
          nb::arg("inner"), nb::arg("dynamic") = true, nb::arg("initial_scale") = 32768.0,
          nb::arg("dynamic_growth_steps") = 2000, nb::keep_alive<1, 2>())
      .def(
          "get_scaled_loss", [](const L& s, double loss) { return s.lso.get_scaled_loss(loss); }, nb::arg("loss"),
          "loss * loss_scale.")
      .def(
          "get_unscaled_gradients",
          [](const L& s, nb::handle grads) {
            std::vector<Tensor> ts = tensors_of(grads, "grads");
            for (std::size_t i = 0; i < ts.size(); ++i) {
              if (!(ts[i].device == s.inner->device))
                throw nb::value_error(("grads[" + std::to_string(i) + "] is on " + device_name(ts[i].device) +
                                       " but the optimizer is on " + device_name(s.inner->device))
                                          .c_str());
            }
            std::vector<stepfuse::TensorView> v = views_of(ts);
            nb::gil_scoped_release nogil;
            s.lso.get_unscaled_gradients(v);
          },
          nb::arg("grads"), "Divides each tensor in place by loss_scale, rounding to its dtype.",
          nb::sig("def get_unscaled_gradients(self, grads: object) -> None"))
      .def(
          "apply_gradients",
          [](L& s) {
            nb::gil_scoped_release nogil;
            return s.lso.apply_gradients();
          },
          "The inner optimizer's gradients are unscaled: checks them, applies the step or skips it, updates the "
          "loss scale. Returns whether it applied.")
      .def(
          "minimize", [](L& s, const std::function<void(double)>& backward) { return s.lso.minimize(backward); },
          nb::arg("backward"),
          "Calls backward(loss_scale), which must write the gradients of loss * loss_scale into the inner "
          "optimizer's gradient tensors, then runs the fused step and updates the scale. Returns whether it "
          "applied.")
      .def_prop_ro("loss_scale", [](const L& s) { return s.lso.loss_scale(); })
      .def_prop_ro("dynamic", [](const L& s) { return s.lso.dynamic(); })
      .def_prop_ro("dynamic_counter", [](const L& s) { return s.lso.dynamic_counter(); })
      .def_prop_ro("dynamic_growth_steps", [](const L& s) { return s.lso.dynamic_growth_steps(); })
      .def_prop_ro(
          "inner_optimizer", [](const L& s) -> PyOptimizer& { return *s.inner; }, nb::rv_policy::reference)
      .def_prop_ro("iterations", [](const L& s) { return s.lso.iterations(); })
      .def_prop_rw(
          "lr", [](const L& s) { return s.lso.lr(); }, [](L& s, double lr) { s.lso.set_lr(lr); },
          "The inner optimizer's learning rate.")
      .def_prop_ro("last_result", [](const L& s) { return s.lso.last_result(); },
                   "What the last apply_gradients()/minimize() did.")
      .def(
          "get_hyper", [](const L& s, std::string_view name, std::size_t group) { return s.lso.get_hyper(name, group); },
          nb::arg("name"), nb::arg("group") = 0,
          "A hyperparameter under Keras's name ('learning_rate'/'lr', 'beta_1', 'beta_2', 'momentum', 'rho').")
      .def(
          "set_hyper",
          [](L& s, std::string_view name, double value, std::size_t group) { s.lso.set_hyper(name, value, group); },
          nb::arg("name"), nb::arg("value"), nb::arg("group") = 0)
      .def(
          "hyper_names", [](const L& s) { return s.lso.hyper_names(); }, "The names get_hyper accepts.")
      .def(
          "save",
          [](const L& s, const std::filesystem::path& path) {
            const std::string p = path.string();
            nb::gil_scoped_release nogil;
            s.lso.save(p);
          },
          nb::arg("path"), "Checkpoint of the inner optimizer with the loss-scale state.")
      .def(
          "load",
          [](L& s, const std::filesystem::path& path, bool convert_state) {
            const std::string p = path.string();
            const stepfuse::LoadOptions options{convert_state};
            nb::gil_scoped_release nogil;
            s.lso.load(p, options);
          },
          nb::arg("path"), nb::kw_only(), nb::arg("convert_state") = false,
          "Restores a checkpoint save() wrote: the inner optimizer's state and the loss-scale state. A state stream "
          "saved in another format than the inner optimizer stores it in (state_format, state_formats) is a "
          "ValueError unless convert_state=True: then it is decoded to fp32 and encoded as a step stores it. On an "
          "error nothing changes.")
      .def("__repr__", [](const L& s) {
        return "LossScaleOptimizer(loss_scale=" + num(s.lso.loss_scale()) +
               ", dynamic=" + (s.lso.dynamic() ? "True" : "False") +
               ", dynamic_growth_steps=" + std::to_string(s.lso.dynamic_growth_steps()) +
               ", iterations=" + std::to_string(s.lso.iterations()) + ")";
      });
}

}  // namespace sfpy
