// The optimizer configs (stepfuse::optim::*): one Python class each, with the C++ field
// names and defaults, a constructor taking them positionally (in field order) or by
// keyword, read/write attributes, repr, ==, and pickling.
#include <nanobind/stl/string.h>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common.hpp"

namespace sfpy {

namespace {

namespace optim = stepfuse::optim;

template <class T>
struct Field {
  const char* name;
  double T::*d = nullptr;  // one of the two
  bool T::*b = nullptr;
};

template <class T>
Field<T> f(const char* name, double T::*d) {
  return {name, d, nullptr};
}
template <class T>
Field<T> f(const char* name, bool T::*b) {
  return {name, nullptr, b};
}

// Each config's fields, in declaration order (the order of positional arguments).
template <class T>
std::vector<Field<T>> fields();

template <>
std::vector<Field<optim::SGD>> fields() {
  using T = optim::SGD;
  return {f("lr", &T::lr),         f("momentum", &T::momentum), f("dampening", &T::dampening),
          f("weight_decay", &T::weight_decay), f("nesterov", &T::nesterov), f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::Adam>> fields() {
  using T = optim::Adam;
  return {f("lr", &T::lr),           f("beta1", &T::beta1),     f("beta2", &T::beta2), f("eps", &T::eps),
          f("weight_decay", &T::weight_decay), f("amsgrad", &T::amsgrad), f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::AdamW>> fields() {
  using T = optim::AdamW;
  return {f("lr", &T::lr),           f("beta1", &T::beta1),     f("beta2", &T::beta2), f("eps", &T::eps),
          f("weight_decay", &T::weight_decay), f("amsgrad", &T::amsgrad), f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::Adagrad>> fields() {
  using T = optim::Adagrad;
  return {f("lr", &T::lr),
          f("lr_decay", &T::lr_decay),
          f("weight_decay", &T::weight_decay),
          f("initial_accumulator_value", &T::initial_accumulator_value),
          f("eps", &T::eps),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::RMSprop>> fields() {
  using T = optim::RMSprop;
  return {f("lr", &T::lr),           f("alpha", &T::alpha),       f("eps", &T::eps),
          f("weight_decay", &T::weight_decay), f("momentum", &T::momentum), f("centered", &T::centered),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::Lion>> fields() {
  using T = optim::Lion;
  return {f("lr", &T::lr), f("beta1", &T::beta1), f("beta2", &T::beta2), f("weight_decay", &T::weight_decay),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::NAdam>> fields() {
  using T = optim::NAdam;
  return {f("lr", &T::lr),
          f("beta1", &T::beta1),
          f("beta2", &T::beta2),
          f("eps", &T::eps),
          f("weight_decay", &T::weight_decay),
          f("momentum_decay", &T::momentum_decay),
          f("decoupled_weight_decay", &T::decoupled_weight_decay),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::RAdam>> fields() {
  using T = optim::RAdam;
  return {f("lr", &T::lr),
          f("beta1", &T::beta1),
          f("beta2", &T::beta2),
          f("eps", &T::eps),
          f("weight_decay", &T::weight_decay),
          f("decoupled_weight_decay", &T::decoupled_weight_decay),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::Adamax>> fields() {
  using T = optim::Adamax;
  return {f("lr", &T::lr),   f("beta1", &T::beta1), f("beta2", &T::beta2), f("eps", &T::eps),
          f("weight_decay", &T::weight_decay), f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::Adadelta>> fields() {
  using T = optim::Adadelta;
  return {f("lr", &T::lr), f("rho", &T::rho), f("eps", &T::eps), f("weight_decay", &T::weight_decay),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::Rprop>> fields() {
  using T = optim::Rprop;
  return {f("lr", &T::lr),
          f("eta_minus", &T::eta_minus),
          f("eta_plus", &T::eta_plus),
          f("step_size_min", &T::step_size_min),
          f("step_size_max", &T::step_size_max),
          f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::ASGD>> fields() {
  using T = optim::ASGD;
  return {f("lr", &T::lr), f("lambd", &T::lambd), f("alpha", &T::alpha), f("t0", &T::t0),
          f("weight_decay", &T::weight_decay), f("maximize", &T::maximize)};
}
template <>
std::vector<Field<optim::LAMB>> fields() {
  using T = optim::LAMB;
  return {f("lr", &T::lr),   f("beta1", &T::beta1), f("beta2", &T::beta2), f("eps", &T::eps),
          f("weight_decay", &T::weight_decay), f("maximize", &T::maximize)};
}

std::string py_repr(double v) { return nb::repr(nb::float_(v)).c_str(); }

template <class T>
struct ConfigClass {
  static inline std::vector<Field<T>> F;
  static inline std::string name, init_sig;

  static std::string repr(const T& c) {
    std::string s = name + "(";
    bool first = true;
    for (const Field<T>& fl : F) {
      s += (first ? "" : ", ") + std::string(fl.name) + "=";
      s += fl.d ? py_repr(c.*fl.d) : (c.*fl.b ? "True" : "False");
      first = false;
    }
    return s + ")";
  }

  static void set(T& c, const Field<T>& fl, nb::handle v) {
    if (fl.d) {
      // A float or anything float() takes without loss of meaning (int, NumPy scalars);
      // not a bool (a flag passed to the wrong field) and not a string.
      double x;
      if (nb::isinstance<nb::bool_>(v) || !nb::try_cast(v, x))
        throw nb::type_error((name + "(): " + fl.name + " must be a float, not " + nb::inst_name(v).c_str()).c_str());
      c.*fl.d = x;
    } else {
      // True/False, or a NumPy bool; not an int or a float (a value passed to the wrong field).
      bool x = false;
      const bool ok = nb::isinstance<nb::bool_>(v)
                          ? (x = nb::cast<bool>(v), true)
                          : !nb::isinstance<nb::int_>(v) && !nb::isinstance<nb::float_>(v) && nb::try_cast(v, x);
      if (!ok)
        throw nb::type_error((name + "(): " + fl.name + " must be a bool, not " + nb::inst_name(v).c_str()).c_str());
      c.*fl.b = x;
    }
  }

  static void init(T* self, nb::args args, nb::kwargs kwargs) {
    T c{};
    if (args.size() > F.size())
      throw nb::type_error((name + "() takes at most " + std::to_string(F.size()) + " positional arguments (" +
                            std::to_string(args.size()) + " given)")
                               .c_str());
    std::vector<bool> given(F.size(), false);
    for (std::size_t i = 0; i < args.size(); ++i) {
      set(c, F[i], args[i]);
      given[i] = true;
    }
    for (auto [key, value] : kwargs) {
      const std::string k = nb::cast<std::string>(key);
      std::size_t i = 0;
      while (i < F.size() && k != F[i].name) ++i;
      if (i == F.size()) {
        std::string known;
        for (const Field<T>& fl : F) known += (known.empty() ? "" : ", ") + std::string(fl.name);
        throw nb::type_error(
            (name + "() got an unexpected keyword argument '" + k + "' (its fields: " + known + ")").c_str());
      }
      if (given[i])
        throw nb::type_error((name + "() got multiple values for argument '" + k + "'").c_str());
      set(c, F[i], value);
      given[i] = true;
    }
    new (self) T(c);
  }

  static nb::dict getstate(const T& c) {
    nb::dict d;
    for (const Field<T>& fl : F) {
      if (fl.d) d[fl.name] = c.*fl.d;
      else d[fl.name] = c.*fl.b;
    }
    return d;
  }

  static void bind(nb::module_& m, const char* cls_name, const char* doc) {
    F = fields<T>();
    name = cls_name;
    const T defaults{};
    init_sig = "def __init__(self";
    for (const Field<T>& fl : F) {
      init_sig += std::string(", ") + fl.name + (fl.d ? ": float = " + py_repr(defaults.*fl.d)
                                                      : std::string(": bool = ") + (defaults.*fl.b ? "True" : "False"));
    }
    init_sig += ") -> None";

    nb::class_<T> c(m, cls_name, doc);
    c.def("__init__", &init, nb::sig(init_sig.c_str()));
    for (const Field<T>& fl : F) {
      if (fl.d) c.def_rw(fl.name, fl.d);
      else c.def_rw(fl.name, fl.b);
    }
    c.def("__repr__", &repr);
    c.def(
        "__eq__", [](const T& a, nb::handle b) {
          T other;
          if (!nb::try_cast(b, other, false)) return false;
          for (const Field<T>& fl : F) {
            if (fl.d ? !(a.*fl.d == other.*fl.d) : a.*fl.b != other.*fl.b) return false;
          }
          return true;
        },
        nb::sig("def __eq__(self, other: object, /) -> bool"));
    c.def("__copy__", [](const T& a) { return a; });
    c.def("__deepcopy__", [](const T& a, nb::handle) { return a; }, nb::arg("memo"));
    c.def("__getstate__", &getstate);
    c.def("__setstate__", [](T* self, nb::dict d) {
      new (self) T{};
      for (const Field<T>& fl : F) {
        if (d.contains(fl.name)) set(*self, fl, d[fl.name]);
      }
    });
    c.def("to_dict", &getstate, "The fields as a dict (name: value).");
  }
};

}  // namespace

std::optional<stepfuse::OptimizerConfig> try_config(nb::handle obj) {
  std::optional<stepfuse::OptimizerConfig> out;
  auto attempt = [&](auto tag) {
    using T = decltype(tag);
    if (out) return;
    if (T* p = nullptr; nb::try_cast(obj, p, false) && p != nullptr) out = *p;
  };
  std::apply([&](auto... tags) { (attempt(tags), ...); },
             std::tuple<optim::SGD, optim::Adam, optim::AdamW, optim::Adagrad, optim::RMSprop, optim::Lion,
                        optim::NAdam, optim::RAdam, optim::Adamax, optim::Adadelta, optim::Rprop, optim::ASGD,
                        optim::LAMB>{});
  return out;
}

nb::object config_to_python(const stepfuse::OptimizerConfig& config) {
  return std::visit([](const auto& c) { return nb::cast(c); }, config);
}

const char* config_class_names() {
  return "SGD, Adam, AdamW, Adagrad, RMSprop, Lion, NAdam, RAdam, Adamax, Adadelta, Rprop, ASGD, LAMB";
}

void bind_configs(nb::module_& m) {
  ConfigClass<optim::SGD>::bind(m, "SGD", "torch.optim.SGD's hyperparameters (stepfuse::optim::SGD).");
  ConfigClass<optim::Adam>::bind(
      m, "Adam", "torch.optim.Adam's hyperparameters; weight_decay is an L2 penalty added to the gradient.");
  ConfigClass<optim::AdamW>::bind(
      m, "AdamW", "torch.optim.AdamW's hyperparameters; weight_decay is decoupled (p *= 1 - lr * weight_decay).");
  ConfigClass<optim::Adagrad>::bind(m, "Adagrad", "torch.optim.Adagrad's hyperparameters.");
  ConfigClass<optim::RMSprop>::bind(m, "RMSprop", "torch.optim.RMSprop's hyperparameters.");
  ConfigClass<optim::Lion>::bind(
      m, "Lion", "Lion (Chen et al. 2023), with decoupled weight decay as in the paper's reference code.");
  ConfigClass<optim::NAdam>::bind(m, "NAdam", "torch.optim.NAdam's hyperparameters.");
  ConfigClass<optim::RAdam>::bind(m, "RAdam", "torch.optim.RAdam's hyperparameters.");
  ConfigClass<optim::Adamax>::bind(m, "Adamax", "torch.optim.Adamax's hyperparameters.");
  ConfigClass<optim::Adadelta>::bind(m, "Adadelta", "torch.optim.Adadelta's hyperparameters.");
  ConfigClass<optim::Rprop>::bind(
      m, "Rprop",
      "torch.optim.Rprop's hyperparameters: etas = (eta_minus, eta_plus), step_sizes = (step_size_min, "
      "step_size_max).");
  ConfigClass<optim::ASGD>::bind(m, "ASGD", "torch.optim.ASGD's hyperparameters.");
  ConfigClass<optim::LAMB>::bind(
      m, "LAMB",
      "LAMB (You et al. 2020) as NVIDIA Apex's FusedLAMB; Apex's global grad-norm clipping is the "
      "Optimizer's max_grad_norm here.");
}

}  // namespace sfpy
