// stepfuse.Optimizer and StepResult.
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"

namespace sfpy {

namespace {

using stepfuse::Device;
using stepfuse::Optimizer;
using stepfuse::OptimizerOptions;

// The keyword options every constructor takes, as Python passes them.
struct PyOptions {
  std::optional<std::string> device;
  std::uintptr_t cuda_stream = 0;
  std::optional<double> max_grad_norm;
  double norm_type = 2.0;
  bool master_weights = true;
  bool stochastic_rounding = false;
  std::uint64_t seed = 0;
  bool compensated_weights = false;
  stepfuse::StateFormat state_format = stepfuse::StateFormat::f32;
  std::vector<std::pair<std::string, stepfuse::StateFormat>> state_formats;
  std::int64_t min_q8_numel = 4096;
  std::string fusion = "fused";
  int num_threads = 0;
  bool track_grad_norm = false;
  std::optional<std::string> cpu_backend;
  bool llvm_contract = false;
  std::shared_ptr<stepfuse::Communicator> communicator;
  std::optional<std::vector<stepfuse::TensorSlice>> slices;
  bool stochastic_state_rounding = true;
};

// `seed`, an int in [0, 2**64) (anything with __index__): ValueError when negative,
// OverflowError when too large, TypeError when not an integer.
std::uint64_t to_seed(nb::handle seed) {
  nb::object index = nb::steal(PyNumber_Index(seed.ptr()));
  if (!index.is_valid()) {
    PyErr_Clear();
    throw nb::type_error(
        ("seed must be an int in [0, 2**64), not " + std::string(nb::inst_name(seed).c_str())).c_str());
  }
  const std::string text = nb::repr(index).c_str();
  if (PyObject_RichCompareBool(index.ptr(), nb::int_(0).ptr(), Py_LT) == 1)
    throw nb::value_error(("seed = " + text + " is negative (must be an int in [0, 2**64))").c_str());
  const unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    PyErr_SetString(PyExc_OverflowError,
                    ("seed = " + text + " does not fit in 64 bits (must be an int in [0, 2**64))").c_str());
    throw nb::python_error();
  }
  return static_cast<std::uint64_t>(v);
}

// A state format: a StateFormat, or its name ('f32', 'bf16', 'q8'). `what` names the
// argument in errors: ValueError for an unknown name, TypeError for anything else.
stepfuse::StateFormat to_state_format(nb::handle v, const std::string& what) {
  stepfuse::StateFormat f = stepfuse::StateFormat::f32;
  if (nb::try_cast(v, f, false)) return f;
  if (nb::isinstance<nb::str>(v)) {
    const std::string s = nb::cast<std::string>(v);
    if (s == "f32") return stepfuse::StateFormat::f32;
    if (s == "bf16") return stepfuse::StateFormat::bf16;
    if (s == "q8") return stepfuse::StateFormat::q8;
    throw nb::value_error((what + " '" + s + "' is not one of 'f32', 'bf16', 'q8'").c_str());
  }
  throw nb::type_error((what + " must be a StateFormat or one of 'f32', 'bf16', 'q8', not " +
                        std::string(nb::inst_name(v).c_str()))
                           .c_str());
}

// state_formats: None, a dict {stream name: format}, or (name, format) pairs; in order.
std::vector<std::pair<std::string, stepfuse::StateFormat>> to_state_formats(nb::handle v) {
  std::vector<std::pair<std::string, stepfuse::StateFormat>> out;
  if (v.is_none()) return out;
  nb::object items;
  if (nb::hasattr(v, "items") && !nb::isinstance<nb::str>(v)) items = v.attr("items")();
  else if (nb::isinstance<nb::iterable>(v) && !nb::isinstance<nb::str>(v)) items = nb::borrow(v);
  else
    throw nb::type_error(("state_formats must be a dict {stream name: format}, not " +
                          std::string(nb::inst_name(v).c_str()))
                             .c_str());
  for (nb::handle item : items) {
    if (!(nb::isinstance<nb::tuple>(item) || nb::isinstance<nb::list>(item)) || nb::len(item) != 2)
      throw nb::type_error("state_formats must be a dict {stream name: format} (or (name, format) pairs)");
    nb::handle key = item[0];
    if (!nb::isinstance<nb::str>(key))
      throw nb::type_error(("state_formats: the keys are stream names ('exp_avg', ...), not " +
                            std::string(nb::inst_name(key).c_str()))
                               .c_str());
    std::string name = nb::cast<std::string>(key);
    const stepfuse::StateFormat f = to_state_format(item[1], "state_formats['" + name + "']");
    out.emplace_back(std::move(name), f);
  }
  return out;
}

OptimizerOptions to_options(const PyOptions& o) {
  OptimizerOptions opts;
  opts.cuda_stream = reinterpret_cast<void*>(o.cuda_stream);
  opts.max_grad_norm = o.max_grad_norm;
  opts.norm_type = o.norm_type;
  opts.master_weights = o.master_weights;
  opts.stochastic_rounding = o.stochastic_rounding;
  opts.seed = o.seed;
  opts.stochastic_state_rounding = o.stochastic_state_rounding;
  opts.compensated_weights = o.compensated_weights;
  opts.state_format = o.state_format;
  opts.state_formats = o.state_formats;
  opts.min_q8_numel = o.min_q8_numel;
  if (o.fusion == "fused") opts.fusion = stepfuse::Fusion::fused;
  else if (o.fusion == "unfused") opts.fusion = stepfuse::Fusion::unfused;
  else if (o.fusion == "interpreted") opts.fusion = stepfuse::Fusion::interpreted;
  else
    throw nb::value_error(("fusion '" + o.fusion + "' is not one of 'fused', 'unfused', 'interpreted'").c_str());
  opts.num_threads = o.num_threads;
  opts.track_grad_norm = o.track_grad_norm;
  if (o.cpu_backend) {
    const std::string& b = *o.cpu_backend;
    if (b == "auto") opts.cpu_backend = stepfuse::CpuBackend::automatic;
    else if (b == "highway") opts.cpu_backend = stepfuse::CpuBackend::highway;
    else if (b == "llvm") opts.cpu_backend = stepfuse::CpuBackend::llvm;
    else
      throw nb::value_error(
          ("cpu_backend '" + b + "' is not one of None, 'auto', 'highway', 'llvm'").c_str());
  }
  opts.llvm_contract = o.llvm_contract;
  opts.communicator = o.communicator;
  if (o.slices) opts.slices = *o.slices;
  return opts;
}

// Tensors being gathered for one optimizer (or one added group): every tensor on one
// device, the first one's.
struct Gather {
  std::vector<Tensor> weights, grads;
  std::optional<Device> device;
  std::string device_from;  // the tensor that fixed `device`, for messages

  void check_device(const Tensor& t, const std::string& what) {
    if (!device) {
      device = t.device;
      device_from = what;
    } else if (!(*device == t.device)) {
      throw nb::value_error((device_from + " is on " + device_name(*device) + " but " + what + " is on " +
                             device_name(t.device) + ": all tensors of one optimizer must be on one device")
                                .c_str());
    }
  }

  // `params`: (weight, grad) pairs, or tensors with a .grad (torch parameters).
  // `where` prefixes the names in messages ("groups[1].").
  std::vector<stepfuse::Param> add(nb::handle params, const std::string& where) {
    if (!nb::isinstance<nb::iterable>(params) || nb::isinstance<nb::str>(params))
      throw nb::type_error((where + "params must be a list of (weight, grad) pairs, not " +
                            nb::inst_name(params).c_str())
                               .c_str());
    std::vector<stepfuse::Param> out;
    std::size_t i = 0;
    for (nb::handle item : params) {
      const std::string at = where + "params[" + std::to_string(i) + "]";
      nb::object w, g;
      if (nb::isinstance<nb::tuple>(item) || nb::isinstance<nb::list>(item)) {
        if (nb::len(item) != 2)
          throw nb::type_error((at + " must be a (weight, grad) pair; it has " + std::to_string(nb::len(item)) +
                                " items")
                                   .c_str());
        w = item[0];
        g = item[1];
      } else if (nb::hasattr(item, "grad") && nb::hasattr(item, "__dlpack__")) {
        w = nb::borrow(item);  // a torch parameter: its .grad
        g = item.attr("grad");
      } else {
        throw nb::type_error(
            (at + " must be a (weight, grad) pair, not " + std::string(nb::inst_name(item).c_str())).c_str());
      }
      Tensor tw = import_tensor(w, at + ".weight");
      check_device(tw, at + ".weight");
      Tensor tg = import_tensor(g, at + ".grad");
      check_device(tg, at + ".grad");
      out.push_back({tw.view, tg.view});
      weights.push_back(std::move(tw));
      grads.push_back(std::move(tg));
      ++i;
    }
    return out;
  }
};

// The device the optimizer runs on: the option's, which must be the tensors' device,
// or the tensors' (the CPU when there are none).
Device resolve_device(const std::optional<std::string>& option, const Gather& g) {
  if (!option) return g.device.value_or(Device::cpu());
  bool any_index = false;
  Device d = stepfuse::Device::cpu();
  d = parse_device(*option, &any_index);
  if (any_index && g.device && g.device->kind == Device::Kind::cuda) d = *g.device;
  if (g.device && !(*g.device == d))
    throw nb::value_error(("device='" + *option + "' but " + g.device_from + " is on " + device_name(*g.device) +
                           " (the optimizer runs where its tensors are)")
                              .c_str());
  return d;
}

void check_on(const PyOptimizer& self, const Gather& g) {
  if (g.device && !(*g.device == self.device))
    throw nb::value_error((g.device_from + " is on " + device_name(*g.device) + " but the optimizer is on " +
                           device_name(self.device))
                              .c_str());
}

stepfuse::OptimizerConfig need_config(nb::handle config, const std::string& what) {
  auto c = try_config(config);
  if (!c)
    throw nb::type_error((what + " must be an optimizer config (" + config_class_names() + "), not " +
                          nb::inst_name(config).c_str())
                             .c_str());
  return *c;
}

nb::object self_handle(PyOptimizer& self) { return nb::find(&self); }

std::string repr(const PyOptimizer& self) {
  const Optimizer& o = *self.opt;
  std::string name = o.is_custom() ? std::string(o.update_program().name()) : std::string(stepfuse::optimizer_name(o.config()));
  return "Optimizer(" + name + ", " + std::to_string(o.num_params()) + " params, " + std::to_string(o.num_groups()) +
         (o.num_groups() == 1 ? " group" : " groups") + ", device=" + device_name(self.device) +
         ", backend=" + std::string(o.backend()) + ", step_count=" + std::to_string(o.step_count()) + ")";
}

std::string step_result_repr(const stepfuse::StepResult& r) {
  auto num = [](double x) { return std::string(nb::repr(nb::float_(x)).c_str()); };
  return std::string("StepResult(applied=") + (r.applied ? "True" : "False") +
         ", found_inf=" + (r.found_inf ? "True" : "False") + ", grad_norm=" + num(r.grad_norm) +
         ", clip_coef=" + num(r.clip_coef) + ", pending=" + (r.pending ? "True" : "False") + ")";
}

// The shape a state or master view gets: the weight's.
std::vector<std::size_t> shape_of(const PyOptimizer& self, std::size_t i, std::size_t n) {
  std::vector<std::size_t> shape = i < self.weights.size() ? self.weights[i].shape : std::vector<std::size_t>{};
  std::size_t prod = 1;
  for (std::size_t s : shape) prod *= s;
  if (prod != n) shape = {n};
  return shape;
}

const char* kOptionsDoc =
    "device: None (the tensors' device), 'cpu', 'cuda' or 'cuda:N' (must be the tensors' device).\n"
    "cuda_stream: the CUstream steps are enqueued on, as an int (torch.cuda.current_stream().cuda_stream); "
    "0 is the default stream.\n"
    "max_grad_norm: clip the unscaled gradients' global norm to this, inside the step (None: no clipping).\n"
    "norm_type: 2.0 or math.inf.\n"
    "master_weights: keep fp32 master copies of float16/bfloat16 weights.\n"
    "stochastic_rounding: with master_weights=False, round each updated bfloat16 weight to bfloat16 "
    "stochastically (unbiased: updates below half an ulp still move the weights on average) instead of to "
    "nearest even. Needs at least one bfloat16 weight and no float16 weights (ValueError otherwise, and with "
    "master_weights=True); float32 weights are unaffected. See docs/low-precision.md.\n"
    "seed: the stochastic rounding's random stream, an int in [0, 2**64): the bits are Philox4x32-10 keyed by "
    "seed, counted by the applied step and the element's index in the model, so a run is bitwise reproducible "
    "(a checkpoint continues bitwise given the same seed).\n"
    "stochastic_state_rounding: with stochastic_rounding, whether the bfloat16 state (state_format) of the "
    "stochastically rounded weights rounds stochastically too (True, each stream with bits of its own, so a "
    "second moment decaying by 0.999 a step still decays) or to nearest even (False, as torchao's bfloat16 "
    "state: no random bits drawn for it, faster where drawing them costs more than the memory traffic).\n"
    "compensated_weights: with master_weights=False, keep beside each bfloat16 weight a bfloat16 compensation, "
    "what rounding the weight to bfloat16 lost (Kahan-compensated summation): the parameter is weight + "
    "compensation, and each step writes back the nearest bfloat16 weight and the nearest bfloat16 to the rest. "
    "2 bytes per parameter instead of fp32 masters' 4, with accuracy close to masters (compensation(param) "
    "gives it). Needs at least one bfloat16 weight and no float16 weights (ValueError otherwise, and with "
    "master_weights=True or stochastic_rounding=True); float32 weights are unaffected.\n"
    "state_format: how every state stream is stored between steps: 'f32' (or StateFormat.f32; 4 bytes per "
    "element), 'bf16' (2 bytes, rounded to nearest even) or 'q8' (block-wise 8-bit dynamic quantization, as "
    "bitsandbytes': 1 byte per element and one fp32 absmax per block of 256). The update computes in fp32, decoding "
    "each stream as it loads it and encoding it as it stores it; every format is bitwise the same on every CPU "
    "backend and thread count and on CUDA. A stream the program keeps in full precision (ASGD's 'ax') stays f32.\n"
    "state_formats: a dict {stream name: format} overriding state_format for those streams (e.g. {'exp_avg_sq': "
    "'bf16'}); an unknown name, or a full-precision stream with another format than f32, is a ValueError.\n"
    "min_q8_numel: q8 applies to tensors of at least this many elements (4096, as bitsandbytes' min_8bit_size); "
    "smaller ones keep f32.\n"
    "fusion: 'fused', 'unfused' (the eager baseline) or 'interpreted'.\n"
    "num_threads: CPU threads (0: STEPFUSE_NUM_THREADS, else the machine's cores).\n"
    "track_grad_norm: compute the gradient norm on plain steps too.\n"
    "cpu_backend: None (STEPFUSE_CPU_BACKEND, else 'auto'), 'auto', 'highway' or 'llvm'.\n"
    "llvm_contract: let the LLVM backend fuse multiply-adds (results within fp32 rounding, not bitwise).\n"
    "communicator: a Communicator: a sharded step across processes, each rank's optimizer holding its own shard "
    "of the model's params (same config and options on every rank); every rank gets the global norm, clip "
    "coefficient and skip decision. Construction and steps are then collective. CPU only.\n"
    "slices: with a communicator, one TensorSlice per param (where it lies in the model); None: whole tensors, "
    "rank 0's params first, then rank 1's, and so on.";

}  // namespace

void bind_optimizer(nb::module_& m) {
  nb::class_<stepfuse::StepResult>(m, "StepResult", "What one step did.")
      .def_ro("applied", &stepfuse::StepResult::applied, "False: non-finite gradients, nothing was written.")
      .def_ro("found_inf", &stepfuse::StepResult::found_inf, "Some gradient element was inf or NaN.")
      .def_ro("grad_norm", &stepfuse::StepResult::grad_norm, "Norm of the unscaled gradients (NaN when not computed).")
      .def_ro("clip_coef", &stepfuse::StepResult::clip_coef, "Multiplier clipping applied to the unscaled gradients.")
      .def_ro("pending", &stepfuse::StepResult::pending,
              "CUDA: enqueued, outcome not known yet (Optimizer.last_result waits and tells).")
      .def("__repr__", &step_result_repr);

  static const std::string class_doc = std::string(
      "A fused optimizer over a fixed list of caller-owned tensors, updated in place.\n\n"
      "Optimizer(config, params, *, device=None, cuda_stream=0, max_grad_norm=None, norm_type=2.0,\n"
      "          master_weights=True, stochastic_rounding=False, seed=0, stochastic_state_rounding=True,\n"
      "          compensated_weights=False,\n"
      "          state_format='f32', state_formats=None, min_q8_numel=4096,\n"
      "          fusion='fused', num_threads=0, track_grad_norm=False, cpu_backend=None, llvm_contract=False,\n"
      "          communicator=None, slices=None)\n\n"
      "config: a config (SGD, Adam, AdamW, ...) or an UpdateProgram. params: (weight, grad) pairs of\n"
      "tensors (torch, NumPy, anything with __dlpack__): float32, float16 or bfloat16, contiguous, all on\n"
      "one device (the CPU or one CUDA GPU); a torch parameter with its .grad allocated may stand for its\n"
      "pair. The tensors are used in place, zero-copy: the optimizer keeps references to them, so they\n"
      "outlive it. Not thread-safe: one thread at a time per optimizer.\n\n"
      "Options:\n") + kOptionsDoc;
  nb::class_<PyOptimizer> cls(m, "Optimizer", class_doc.c_str());

  cls.def(
      "__init__",
      [](PyOptimizer* self, nb::handle config, nb::handle params, std::optional<std::string> device,
         std::uintptr_t cuda_stream, std::optional<double> max_grad_norm, double norm_type, bool master_weights,
         bool stochastic_rounding, nb::handle seed, bool stochastic_state_rounding, bool compensated_weights,
         nb::handle state_format, nb::handle state_formats, std::int64_t min_q8_numel, std::string fusion,
         int num_threads,
         bool track_grad_norm, std::optional<std::string> cpu_backend, bool llvm_contract,
         std::shared_ptr<stepfuse::Communicator> communicator,
         std::optional<std::vector<stepfuse::TensorSlice>> slices) {
        PyOptions po{device,         cuda_stream,         max_grad_norm,       norm_type,
                     master_weights, stochastic_rounding, to_seed(seed),       compensated_weights,
                     to_state_format(state_format, "state_format"), to_state_formats(state_formats),
                     min_q8_numel,   std::move(fusion),   num_threads,         track_grad_norm,
                     cpu_backend,    llvm_contract,       std::move(communicator), std::move(slices)};
        po.stochastic_state_rounding = stochastic_state_rounding;
        OptimizerOptions opts = to_options(po);
        Gather g;
        std::optional<stepfuse::OptimizerConfig> cfg = try_config(config);
        stepfuse::UpdateProgram* program = nullptr;
        if (!cfg && !(nb::try_cast(config, program, false) && program != nullptr))
          throw nb::type_error((std::string("config must be an optimizer config (") + config_class_names() +
                                ") or an UpdateProgram, not " + nb::inst_name(config).c_str())
                                   .c_str());
        std::vector<stepfuse::Param> ps = g.add(params, "");
        opts.device = resolve_device(po.device, g);
        std::unique_ptr<Optimizer> opt;
        if (cfg) opt = std::make_unique<Optimizer>(*cfg, std::move(ps), opts);
        else opt = std::make_unique<Optimizer>(*program, std::move(ps), opts);
        new (self) PyOptimizer{std::move(opt), std::move(g.weights), std::move(g.grads), opts.device};
      },
      nb::arg("config"), nb::arg("params"), nb::kw_only(), nb::arg("device") = nb::none(),
      nb::arg("cuda_stream") = 0, nb::arg("max_grad_norm") = nb::none(), nb::arg("norm_type") = 2.0,
      nb::arg("master_weights") = true, nb::arg("stochastic_rounding") = false, nb::arg("seed") = 0,
      nb::arg("stochastic_state_rounding") = true, nb::arg("compensated_weights") = false, nb::arg("state_format") = "f32", nb::arg("state_formats") = nb::none(),
      nb::arg("min_q8_numel") = 4096, nb::arg("fusion") = "fused", nb::arg("num_threads") = 0,
      nb::arg("track_grad_norm") = false, nb::arg("cpu_backend") = nb::none(), nb::arg("llvm_contract") = false,
      nb::arg("communicator").none() = nb::none(), nb::arg("slices") = nb::none(),
      nb::sig("def __init__(self, config: SGD | Adam | AdamW | Adagrad | RMSprop | Lion | NAdam | RAdam | Adamax | "
              "Adadelta | Rprop | ASGD | LAMB | UpdateProgram, params: collections.abc.Iterable[tuple[object, "
              "object]], *, device: str | None = None, cuda_stream: int = 0, max_grad_norm: float | None = None, "
              "norm_type: float = 2.0, master_weights: bool = True, stochastic_rounding: bool = False, "
              "seed: int = 0, stochastic_state_rounding: bool = True, compensated_weights: bool = False, "
              "state_format: StateFormat | str = 'f32', "
              "state_formats: collections.abc.Mapping[str, StateFormat | str] | None = None, "
              "min_q8_numel: int = 4096, fusion: str = 'fused', num_threads: int = 0, "
              "track_grad_norm: bool = False, cpu_backend: str | None = None, llvm_contract: bool = False, "
              "communicator: Communicator | None = None, slices: collections.abc.Sequence[TensorSlice] | None = None) "
              "-> None"));

  cls.def_static(
      "from_groups",
      [](nb::handle groups, std::optional<std::string> device, std::uintptr_t cuda_stream,
         std::optional<double> max_grad_norm, double norm_type, bool master_weights, bool stochastic_rounding,
         nb::handle seed, bool stochastic_state_rounding, bool compensated_weights, nb::handle state_format,
         nb::handle state_formats,
         std::int64_t min_q8_numel, std::string fusion, int num_threads, bool track_grad_norm,
         std::optional<std::string> cpu_backend, bool llvm_contract,
         std::shared_ptr<stepfuse::Communicator> communicator,
         std::optional<std::vector<stepfuse::TensorSlice>> slices) {
        PyOptions po{device,         cuda_stream,         max_grad_norm,       norm_type,
                     master_weights, stochastic_rounding, to_seed(seed),       compensated_weights,
                     to_state_format(state_format, "state_format"), to_state_formats(state_formats),
                     min_q8_numel,   std::move(fusion),   num_threads,         track_grad_norm,
                     cpu_backend,    llvm_contract,       std::move(communicator), std::move(slices)};
        po.stochastic_state_rounding = stochastic_state_rounding;
        OptimizerOptions opts = to_options(po);
        if (!nb::isinstance<nb::iterable>(groups))
          throw nb::type_error(("groups must be a list of (params, config) pairs, not " +
                                std::string(nb::inst_name(groups).c_str()))
                                   .c_str());
        Gather g;
        std::vector<stepfuse::ParamGroup> gs;
        std::size_t k = 0;
        for (nb::handle item : groups) {
          const std::string at = "groups[" + std::to_string(k) + "]";
          if (!(nb::isinstance<nb::tuple>(item) || nb::isinstance<nb::list>(item)) ||
              (nb::len(item) != 2 && nb::len(item) != 3))
            throw nb::type_error((at + " must be a (params, config) pair or a (params, config, state_format) "
                                       "triple")
                                      .c_str());
          stepfuse::OptimizerConfig cfg = need_config(item[1], at + " config");
          std::optional<stepfuse::StateFormat> format;
          if (nb::len(item) == 3 && !item[2].is_none()) format = to_state_format(item[2], at + " state_format");
          gs.push_back({g.add(item[0], at + "."), cfg, format});
          ++k;
        }
        opts.device = resolve_device(po.device, g);
        auto opt = std::make_unique<Optimizer>(std::move(gs), opts);
        return new PyOptimizer{std::move(opt), std::move(g.weights), std::move(g.grads), opts.device};
      },
      nb::arg("groups"), nb::kw_only(), nb::arg("device") = nb::none(), nb::arg("cuda_stream") = 0,
      nb::arg("max_grad_norm") = nb::none(), nb::arg("norm_type") = 2.0, nb::arg("master_weights") = true,
      nb::arg("stochastic_rounding") = false, nb::arg("seed") = 0, nb::arg("stochastic_state_rounding") = true,
      nb::arg("compensated_weights") = false,
      nb::arg("state_format") = "f32", nb::arg("state_formats") = nb::none(), nb::arg("min_q8_numel") = 4096,
      nb::arg("fusion") = "fused",
      nb::arg("num_threads") = 0, nb::arg("track_grad_norm") = false,
      nb::arg("cpu_backend") = nb::none(), nb::arg("llvm_contract") = false,
      nb::arg("communicator").none() = nb::none(), nb::arg("slices") = nb::none(), nb::rv_policy::take_ownership,
      "Parameter groups, as torch.optim param groups: groups is a list of (params, config) pairs, every config "
      "of one kind (all AdamW, say), or (params, config, state_format) triples: that group's state stored in "
      "state_format (None: the options' state_format) instead; streams named in state_formats still take theirs. "
      "One step still has one reduce pass and one global gradient norm over every group. The options are the "
      "constructor's.",
      nb::sig("def from_groups(groups: collections.abc.Iterable[tuple[collections.abc.Iterable[tuple[object, "
              "object]], SGD | Adam | AdamW | Adagrad | RMSprop | Lion | NAdam | RAdam | Adamax | Adadelta | Rprop | "
              "ASGD | LAMB] | tuple[collections.abc.Iterable[tuple[object, object]], SGD | Adam | AdamW | Adagrad | "
              "RMSprop | Lion | NAdam | RAdam | Adamax | Adadelta | Rprop | ASGD | LAMB, StateFormat | str | None]], *, "
              "device: str | None = None, cuda_stream: int = 0, max_grad_norm: float | None = None, "
              "norm_type: float = 2.0, master_weights: bool = True, stochastic_rounding: bool = False, "
              "seed: int = 0, stochastic_state_rounding: bool = True, compensated_weights: bool = False, "
              "state_format: StateFormat | str = 'f32', "
              "state_formats: collections.abc.Mapping[str, StateFormat | str] | None = None, "
              "min_q8_numel: int = 4096, fusion: str = 'fused', num_threads: int = 0, "
              "track_grad_norm: bool = False, cpu_backend: str | None = None, llvm_contract: bool = False, "
              "communicator: Communicator | None = None, slices: collections.abc.Sequence[TensorSlice] | None = None) "
              "-> Optimizer"));

  // ---- stepping ----
  cls.def(
      "step",
      [](PyOptimizer& self) {
        nb::gil_scoped_release nogil;
        self.opt->step();
      },
      "One step on gradients that are already unscaled. With max_grad_norm, clips them first (without "
      "writing them) and skips the step if they are not finite.");
  cls.def(
      "step_scaled",
      [](PyOptimizer& self, double loss_scale) {
        nb::gil_scoped_release nogil;
        return self.opt->step_scaled(loss_scale);
      },
      nb::arg("loss_scale"),
      "One step on gradients scaled by loss_scale: unscale, inf/NaN check, clip and update in one reduce pass and "
      "one update pass. On non-finite gradients nothing is written (result.applied is False).");
  cls.def(
      "set_grads",
      [](PyOptimizer& self, nb::handle grads) {
        if (!nb::isinstance<nb::iterable>(grads))
          throw nb::type_error(
              ("grads must be a list of tensors, not " + std::string(nb::inst_name(grads).c_str())).c_str());
        std::vector<Tensor> ts;
        std::vector<stepfuse::TensorView> views;
        std::size_t i = 0;
        for (nb::handle gobj : grads) {
          const std::string at = "grads[" + std::to_string(i++) + "]";
          Tensor t = import_tensor(gobj, at);
          if (!(t.device == self.device))
            throw nb::value_error((at + " is on " + device_name(t.device) + " but the optimizer is on " +
                                   device_name(self.device))
                                      .c_str());
          views.push_back(t.view);
          ts.push_back(std::move(t));
        }
        self.opt->set_grads(views);  // validates everything; changes nothing on an error
        self.grads = std::move(ts);
      },
      nb::arg("grads"),
      "Points the optimizer at new gradient tensors, one per param in params() order, of the same sizes and "
      "dtypes (fresh gradients each iteration, as torch allocates after zero_grad(set_to_none=True)). "
      "ValueError (and nothing changes) on a count, size or dtype mismatch.",
      nb::sig("def set_grads(self, grads: collections.abc.Iterable[object]) -> None"));
  cls.def(
      "set_grad_pointers",
      [](PyOptimizer& self, const std::vector<std::uintptr_t>& pointers) {
        const std::vector<stepfuse::Param>& params = self.opt->params();
        if (pointers.size() != params.size())
          throw nb::value_error(("set_grad_pointers: " + std::to_string(pointers.size()) + " pointers for " +
                                 std::to_string(params.size()) + " params (one per param, in params() order)")
                                    .c_str());
        std::vector<stepfuse::TensorView> views;
        views.reserve(params.size());
        for (std::size_t i = 0; i < params.size(); ++i) {
          stepfuse::TensorView v = params[i].grad;
          v.data = reinterpret_cast<void*>(pointers[i]);
          views.push_back(v);
        }
        self.opt->set_grads(views);  // validates (null, overlaps); changes nothing on an error
        for (std::size_t i = 0; i < params.size(); ++i) {
          Tensor& t = self.grads[i];
          t.owner = nb::none(), t.array = nb::ndarray<>();
          t.view.data = views[i].data;
        }
      },
      nb::arg("pointers"),
      "set_grads() for a caller that has checked the new gradients itself: their data pointers (torch's "
      "Tensor.data_ptr()), one per param, each of the size, dtype and device the param's gradient had. The "
      "optimizer keeps no reference to them (as after release_grads()): the caller keeps them alive. "
      "stepfuse.torch uses it to re-point thousands of fresh gradients per step without importing each one.");
  cls.def(
      "release_grads",
      [](PyOptimizer& self) {
        for (Tensor& t : self.grads) t.owner = nb::none(), t.array = nb::ndarray<>();
      },
      "Drops the optimizer's references to its gradient tensors, so that freeing them (torch's "
      "zero_grad(set_to_none=True)) frees their memory at once. The optimizer still points at that memory: "
      "until the next set_grads(), the caller must keep it valid for every step (stepfuse.torch calls "
      "set_grads() whenever a gradient's storage moved). params() then gives None for the grads.");

  // ---- hyperparameters and groups ----
  cls.def(
      "config", [](const PyOptimizer& self, std::size_t group) { return config_to_python(self.opt->config(group)); },
      nb::arg("group") = 0,
      "A copy of a group's config (built-in optimizers; RuntimeError for a custom program). Change it with "
      "set_config.",
      nb::sig("def config(self, group: int = 0) -> SGD | Adam | AdamW | Adagrad | RMSprop | Lion | NAdam | RAdam | "
              "Adamax | Adadelta | Rprop | ASGD | LAMB"));
  cls.def(
      "set_config",
      [](PyOptimizer& self, nb::handle config, std::optional<std::size_t> group) {
        stepfuse::OptimizerConfig c = need_config(config, "config");
        if (group) self.opt->set_config(*group, c);
        else self.opt->set_config(c);
      },
      nb::arg("config"), nb::arg("group") = nb::none(),
      "Sets a group's config (None: every group's). Same optimizer kind and program variant; in effect at the "
      "next step, nothing recompiled.",
      nb::sig("def set_config(self, config: SGD | Adam | AdamW | Adagrad | RMSprop | Lion | NAdam | RAdam | Adamax | "
              "Adadelta | Rprop | ASGD | LAMB, group: int | None = None) -> None"));
  cls.def(
      "lr", [](const PyOptimizer& self, std::size_t group) { return self.opt->lr(group); }, nb::arg("group") = 0,
      "A group's learning rate (a custom program's fixed scalar 'lr').");
  cls.def(
      "set_lr",
      [](PyOptimizer& self, double lr, std::optional<std::size_t> group) {
        if (group) self.opt->set_lr(*group, lr);
        else self.opt->set_lr(lr);
      },
      nb::arg("lr"), nb::arg("group") = nb::none(), "Sets a group's learning rate (None: every group's).");
  cls.def_prop_ro("num_groups", [](const PyOptimizer& self) { return self.opt->num_groups(); });
  cls.def(
      "add_param_group",
      [](PyOptimizer& self, nb::handle params, nb::handle config, nb::handle state_format) {
        stepfuse::OptimizerConfig c = need_config(config, "config");
        std::optional<stepfuse::StateFormat> format;
        if (!state_format.is_none()) format = to_state_format(state_format, "state_format");
        Gather g;
        std::vector<stepfuse::Param> ps = g.add(params, "");
        check_on(self, g);
        self.opt->add_param_group({std::move(ps), c, format});
        for (auto& t : g.weights) self.weights.push_back(std::move(t));
        for (auto& t : g.grads) self.grads.push_back(std::move(t));
      },
      nb::arg("params"), nb::arg("config"), nb::arg("state_format") = nb::none(),
      "Appends a parameter group (its params follow the existing ones), with fresh state and its own step "
      "count; state_format: the group's state storage (None: the options' state_format). Call it between steps. "
      "Views from state(), state_storage(), state_absmax(), master() and compensation() taken before it are "
      "invalid after it.",
      nb::sig("def add_param_group(self, params: collections.abc.Iterable[tuple[object, object]], config: SGD | Adam | "
              "AdamW | Adagrad | RMSprop | Lion | NAdam | RAdam | Adamax | Adadelta | Rprop | ASGD | LAMB, "
              "state_format: StateFormat | str | None = None) -> None"));
  cls.def(
      "group_of", [](const PyOptimizer& self, std::size_t i) { return self.opt->group_of(i); }, nb::arg("param"),
      "The group of params()[param].");
  cls.def(
      "group_step_count", [](const PyOptimizer& self, std::size_t g) { return self.opt->group_step_count(g); },
      nb::arg("group"), "Steps the group has applied.");
  cls.def(
      "set_group_step_count",
      [](PyOptimizer& self, std::size_t g, std::int64_t count) { self.opt->set_group_step_count(g, count); },
      nb::arg("group"), nb::arg("count"),
      "Sets a group's step count (what bias corrections see), as when restoring torch's state[p]['step'].");
  cls.def(
      "nadam_mu_product", [](const PyOptimizer& self, std::size_t g) { return self.opt->nadam_mu_product(g); },
      nb::arg("group") = 0,
      "NAdam: the group's mu_product after its steps so far (torch's state 'mu_product'): the product of every "
      "applied step's mu_t under the beta1 and momentum_decay that step ran with.");
  cls.def(
      "set_nadam_mu_product",
      [](PyOptimizer& self, std::size_t g, double v) { self.opt->set_nadam_mu_product(g, v); }, nb::arg("group"),
      nb::arg("mu_product"),
      "NAdam: the group's later steps multiply onto mu_product (in [0, 1]) as the product so far, as when restoring "
      "torch's state; set the group's step count first.");
  cls.def(
      "nadam_mu_product_offset",
      [](const PyOptimizer& self, std::size_t g) { return self.opt->nadam_mu_product_offset(g); },
      nb::arg("group") = 0,
      "NAdam: log(mu_product / its closed form under the current beta1 and momentum_decay); 0 while neither has "
      "changed since step 0 and no mu_product was set.");

  // ---- custom programs ----
  cls.def_prop_ro("is_custom", [](const PyOptimizer& self) { return self.opt->is_custom(); });
  cls.def(
      "update_program", [](const PyOptimizer& self) { return self.opt->update_program(); },
      "The update program and its current scalar rules.");
  cls.def(
      "scalar", [](const PyOptimizer& self, std::string_view name) { return self.opt->scalar(name); },
      nb::arg("name"), "The value of a fixed scalar.");
  cls.def(
      "set_scalar", [](PyOptimizer& self, std::string_view name, double v) { self.opt->set_scalar(name, v); },
      nb::arg("name"), nb::arg("value"), "Custom programs: sets a fixed scalar's value (in effect at the next step).");
  cls.def(
      "set_scalar_rule",
      [](PyOptimizer& self, std::string_view name, const stepfuse::ScalarRule& r) { self.opt->set_scalar_rule(name, r); },
      nb::arg("name"), nb::arg("rule"), "Custom programs: replaces a scalar's rule.");
  cls.def("program_text", [](const PyOptimizer& self) { return self.opt->program_text(); },
          "The update program this optimizer runs, as text.");

  // ---- state ----
  cls.def_prop_ro("step_count", [](const PyOptimizer& self) { return self.opt->step_count(); },
                  "Steps applied (skipped steps do not count).");
  cls.def_prop_ro("last_grad_norm", [](const PyOptimizer& self) { return self.opt->last_grad_norm(); },
                  "Norm of the unscaled grads seen by the last step (inf: not finite; NaN: not computed).");
  cls.def_prop_ro("last_result", [](const PyOptimizer& self) { return self.opt->last_result(); },
                  "What the last step did (CUDA: waits for it).");
  cls.def_prop_ro("backend", [](const PyOptimizer& self) { return std::string(self.opt->backend()); },
                  "What runs the next step's update: 'llvm', 'highway', 'interpreter', 'unfused' or 'cuda'.");
  cls.def_prop_ro("num_threads", [](const PyOptimizer& self) { return self.opt->num_threads(); });
  cls.def_prop_ro("num_params", [](const PyOptimizer& self) { return self.opt->num_params(); });
  cls.def_prop_ro("device", [](const PyOptimizer& self) { return device_name(self.device); },
                  "'cpu' or 'cuda:N'.");
  cls.def(
      "params",
      [](const PyOptimizer& self) {
        nb::list out;
        for (std::size_t i = 0; i < self.weights.size(); ++i)
          out.append(nb::make_tuple(self.weights[i].owner, self.grads[i].owner));
        return out;
      },
      "The (weight, grad) tensors, group after group, as they were passed (grads as last set).",
      nb::sig("def params(self) -> list[tuple[object, object]]"));
  cls.def(
      "state_names",
      [](const PyOptimizer& self) {
        std::vector<std::string> out;
        for (std::string_view s : self.opt->state_names()) out.emplace_back(s);
        return out;
      },
      "The optimizer's state buffers, e.g. ['exp_avg', 'exp_avg_sq'].");
  cls.def(
      "state",
      [](PyOptimizer& self, std::size_t i, std::string_view name) {
        std::span<float> s = self.opt->mutable_state(i, name);
        std::vector<std::size_t> shape = shape_of(self, i, s.size());
        return nb::ndarray<nb::numpy, float>(s.data(), shape.size(), shape.data(), self_handle(self));
      },
      nb::arg("param"), nb::arg("name"),
      "A writable, zero-copy float32 NumPy view of a param's state (the weight's shape). It keeps the optimizer "
      "alive; it is invalid after add_param_group(). On a GPU it is a host copy, sent back before the next step. "
      "A stream stored as bf16 or q8 (state_format()) is a RuntimeError: read it with state_values(), or as stored "
      "with state_storage() and state_absmax().");
  cls.def(
      "state_format",
      [](const PyOptimizer& self, std::size_t i, std::string_view name) { return self.opt->state_format(i, name); },
      nb::arg("param"), nb::arg("name"),
      "How a param's state stream is stored: StateFormat.f32, bf16 or q8 (the options' state_format, the group's "
      "or state_formats', f32 for a full-precision stream, and f32 for q8 below min_q8_numel elements).");
  cls.def(
      "state_values",
      [](const PyOptimizer& self, std::size_t i, std::string_view name) {
        auto* values = new std::vector<float>(self.opt->state_values(i, name));
        nb::capsule owner(values, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
        std::vector<std::size_t> shape = shape_of(self, i, values->size());
        return nb::ndarray<nb::numpy, float>(values->data(), shape.size(), shape.data(), owner);
      },
      nb::arg("param"), nb::arg("name"),
      "A float32 NumPy copy of a param's state stream in any format (the weight's shape): the values the next step "
      "loads (exact for f32 and bf16, code * absmax for q8).");
  cls.def(
      "set_state_values",
      [](PyOptimizer& self, std::size_t i, std::string_view name, nb::handle values) {
        nb::object v = nb::borrow(values);
        if (nb::hasattr(v, "detach") && nb::hasattr(v, "requires_grad")) v = v.attr("detach")();  // a torch tensor
        nb::ndarray<const float, nb::c_contig, nb::device::cpu> a;
        if (!nb::try_cast(v, a, false)) {
          nb::object np = nb::module_::import_("numpy");
          nb::object converted;
          try {
            converted = np.attr("ascontiguousarray")(v, np.attr("float32"));
          } catch (nb::python_error& e) {
            throw nb::type_error(("set_state_values: values must be an array of numbers on the CPU (NumPy, torch, "
                                  "a list), not " + std::string(nb::inst_name(values).c_str()) + " (" + e.what() +
                                  ")")
                                     .c_str());
          }
          a = nb::cast<nb::ndarray<const float, nb::c_contig, nb::device::cpu>>(converted);
          v = converted;
        }
        self.opt->set_state_values(i, name, std::span<const float>(a.data(), a.size()));
      },
      nb::arg("param"), nb::arg("name"), nb::arg("values"),
      "Writes a param's state stream from fp32 values (any shape with the param's number of elements; converted "
      "to float32), encoded as a step stores them: rounded to nearest even for bf16, quantized block by block for "
      "q8, exact for f32. ValueError on a size mismatch.",
      nb::sig("def set_state_values(self, param: int, name: str, values: object) -> None"));
  cls.def(
      "state_storage",
      [](PyOptimizer& self, std::size_t i, std::string_view name) {
        std::span<std::byte> s = self.opt->mutable_state_storage(i, name);
        const std::size_t n = s.size();
        return nb::ndarray<nb::numpy, std::uint8_t>(reinterpret_cast<std::uint8_t*>(s.data()), 1, &n,
                                                    self_handle(self));
      },
      nb::arg("param"), nb::arg("name"),
      "A writable, zero-copy uint8 NumPy view of a param's state stream as stored, flat: 4 bytes per element for "
      "f32 (the fp32 values), 2 for bf16 (the bit patterns; .view(numpy.uint16), or torch's .view(torch.bfloat16)) "
      "and 1 for q8 (the codes). Writing it (and state_absmax()) restores state saved in that format bit for bit. "
      "Like state(), it keeps the optimizer alive and is invalid after add_param_group().");
  cls.def(
      "state_absmax",
      [](PyOptimizer& self, std::size_t i, std::string_view name) -> nb::object {
        std::span<float> s = self.opt->mutable_state_absmax(i, name);
        if (s.empty()) {
          nb::object np = nb::module_::import_("numpy");
          return np.attr("zeros")(0, np.attr("float32"));
        }
        const std::size_t n = s.size();
        return nb::cast(nb::ndarray<nb::numpy, float>(s.data(), 1, &n, self_handle(self)));
      },
      nb::arg("param"), nb::arg("name"),
      "A q8 stream's scales: a writable, zero-copy float32 NumPy view of one absmax per block of 256 elements "
      "(ceil(numel / 256) of them); an empty array for f32 and bf16. Like state_storage(), it keeps the optimizer "
      "alive and is invalid after add_param_group().",
      nb::sig("def state_absmax(self, param: int, name: str) -> numpy.typing.NDArray[numpy.float32]"));
  cls.def(
      "master",
      [](PyOptimizer& self, std::size_t i) -> nb::object {
        // Writable, as state(): for restoring masters from a framework's checkpoint. On a GPU
        // it is the host copy, sent back before the next step as the state's is.
        std::span<float> s = self.opt->mutable_master(i);
        if (s.empty()) return nb::none();
        std::vector<std::size_t> shape = shape_of(self, i, s.size());
        return nb::cast(nb::ndarray<nb::numpy, float>(s.data(), shape.size(), shape.data(), self_handle(self)));
      },
      nb::arg("param"),
      "A writable, zero-copy float32 NumPy view of a param's fp32 master copy (the weight's shape), or None "
      "(float32 weights, or master_weights=False). Edits take effect at the next step, which updates the master "
      "and writes it, rounded, to the weight. Like state(), it keeps the optimizer alive and is invalid after "
      "add_param_group().",
      nb::sig("def master(self, param: int) -> numpy.typing.NDArray[numpy.float32] | None"));
  cls.def(
      "compensation",
      [](PyOptimizer& self, std::size_t i) -> nb::object {
        // NumPy has no bfloat16: the compensation's bits as uint16 (as the collectives'
        // bf16 buffers), which torch.from_numpy(c).view(torch.bfloat16) reads as bfloat16.
        // Writable, as master(): for restoring compensations from a framework's checkpoint.
        std::span<std::uint16_t> s = self.opt->mutable_compensation(i);
        if (s.empty()) return nb::none();
        std::vector<std::size_t> shape = shape_of(self, i, s.size());
        return nb::cast(
            nb::ndarray<nb::numpy, std::uint16_t>(s.data(), shape.size(), shape.data(), self_handle(self)));
      },
      nb::arg("param"),
      "A writable, zero-copy NumPy view of a param's bfloat16 compensation (compensated_weights=True; the "
      "weight's shape), as uint16 bit patterns, since NumPy has no bfloat16 (torch.from_numpy(c).view("
      "torch.bfloat16) reads it as bfloat16), or None (float32 weights, or compensated_weights=False). The "
      "parameter is weight + compensation. Edits take effect at the next step. Like master(), it keeps the "
      "optimizer alive and is invalid after add_param_group().",
      nb::sig("def compensation(self, param: int) -> numpy.typing.NDArray[numpy.uint16] | None"));
  cls.def(
      "last_tensor_grad_norms", [](const PyOptimizer& self) { return self.opt->last_tensor_grad_norms(); },
      "Per-tensor norms of the unscaled gradients from the last reduce pass.");

  // ---- checkpoints ----
  cls.def(
      "save",
      [](const PyOptimizer& self, const std::filesystem::path& path, stepfuse::GradScaler* scaler) {
        const std::string p = path.string();
        nb::gil_scoped_release nogil;
        if (scaler) self.opt->save(p, *scaler);
        else self.opt->save(p);
      },
      nb::arg("path"), nb::arg("scaler") = nb::none(),
      "Writes hyperparameters, step counts, state, masters and compensations (and a GradScaler's state) to a safetensors file, "
      "atomically. The weights are the caller's to save.");
  cls.def(
      "load",
      [](PyOptimizer& self, const std::filesystem::path& path, stepfuse::GradScaler* scaler, bool convert_state) {
        const std::string p = path.string();
        const stepfuse::LoadOptions options{convert_state};
        nb::gil_scoped_release nogil;
        if (scaler) self.opt->load(p, *scaler, options);
        else self.opt->load(p, options);
      },
      nb::arg("path"), nb::arg("scaler") = nb::none(), nb::kw_only(), nb::arg("convert_state") = false,
      "Restores a file written by save() for an optimizer of the same kind, program, sizes and dtypes. A state "
      "stream saved in another format (f32, bf16, q8) than this optimizer stores it is a ValueError, unless "
      "convert_state=True: then it is decoded to fp32 and encoded as a step stores it. Streams saved in this "
      "optimizer's format load bit for bit. On an error nothing changes.");
  cls.def(
      "load_shards",
      [](PyOptimizer& self, const std::vector<std::filesystem::path>& paths, stepfuse::GradScaler* scaler,
         bool convert_state) {
        std::vector<std::string> ps;
        for (const auto& path : paths) ps.push_back(path.string());
        const stepfuse::LoadOptions options{convert_state};
        nb::gil_scoped_release nogil;
        if (scaler) self.opt->load_shards(ps, *scaler, options);
        else self.opt->load_shards(ps, options);
      },
      nb::arg("paths"), nb::arg("scaler") = nb::none(), nb::kw_only(), nb::arg("convert_state") = false,
      "Re-sharding: restores a checkpoint saved by any number of ranks (every rank's file, in any order; an "
      "unsharded save is one file) into this optimizer, whatever its own cut of the model (its params are then "
      "the model's tensors 0, 1, ... in params() order when it is not sharded). Sharded, the call is collective. "
      "convert_state as in load(). On an error nothing changes.");
  cls.def("__repr__", &repr);
}

}  // namespace sfpy
