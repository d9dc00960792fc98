// Custom update programs: ProgramBuilder, Program, ScalarRule, ScalarDef, UpdateProgram
// (program.hpp, update_program.hpp; docs/update-programs.md).
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"

namespace sfpy {

namespace {

using stepfuse::ScalarDef;
using stepfuse::ScalarRule;
using stepfuse::UpdateProgram;

// A Program holds its names as string_views: whatever they point into is its owner.
struct Names {
  std::deque<std::string> strings;  // a deque never moves what it holds
  std::string_view intern(std::string s) { return strings.emplace_back(std::move(s)); }
};

struct PyProgram {
  std::shared_ptr<const void> owner;  // the Names of a builder, or an UpdateProgram
  stepfuse::Program program;
};

// Values and streams remember their builder, so that one from another builder is an
// error instead of a silently wrong program.
struct PyValue {
  std::uint16_t id = 0;
  std::uint64_t builder = 0;
};
struct PyStream {
  std::uint8_t index = 0;
  std::uint64_t builder = 0;
  std::string name;
};

std::atomic<std::uint64_t> g_builders{0};

struct PyProgramBuilder {
  std::shared_ptr<Names> names;
  stepfuse::ProgramBuilder b;
  std::uint64_t serial;

  explicit PyProgramBuilder(std::string name)
      : names(std::make_shared<Names>()), b(names->intern(std::move(name))), serial(++g_builders) {}

  stepfuse::Value v(const PyValue& x) const {
    if (x.builder != serial)
      throw nb::value_error(("Value %" + std::to_string(x.id) + " belongs to another ProgramBuilder").c_str());
    return stepfuse::Value{x.id};
  }
  stepfuse::Stream s(const PyStream& x) const {
    if (x.builder != serial)
      throw nb::value_error(("Stream '" + x.name + "' belongs to another ProgramBuilder").c_str());
    return stepfuse::Stream{x.index};
  }
  PyValue out(stepfuse::Value x) const { return {x.id, serial}; }
};

std::string rule_repr(const ScalarRule& r) {
  auto num = [](double x) { return std::string(nb::repr(nb::float_(x)).c_str()); };
  return "ScalarRule(ScalarRule.Kind." + std::string(stepfuse::scalar_rule_name(r.kind)) + ", a=" + num(r.a) +
         ", b=" + num(r.b) + ", c=" + num(r.c) + ")";
}

}  // namespace

void bind_program(nb::module_& m) {
  nb::enum_<stepfuse::DType>(m, "DType", "Storage formats (all arithmetic is fp32).")
      .value("f32", stepfuse::DType::f32)
      .value("f16", stepfuse::DType::f16)
      .value("bf16", stepfuse::DType::bf16);

  nb::enum_<stepfuse::StateFormat>(
      m, "StateFormat",
      "How an optimizer state stream is stored between steps (Optimizer's state_format option); the update "
      "computes in fp32 either way. Wherever a StateFormat is taken, its name ('f32', 'bf16', 'q8') is too.")
      .value("f32", stepfuse::StateFormat::f32, "4 bytes per element, exact")
      .value("bf16", stepfuse::StateFormat::bf16, "2 bytes per element, rounded to nearest even")
      .value("q8", stepfuse::StateFormat::q8,
             "block-wise 8-bit dynamic quantization: per block of 256 elements one fp32 absmax, and one byte per "
             "element (a signed code, or an unsigned one for a non-negative stream)");

  nb::enum_<stepfuse::StateValues>(
      m, "StateValues",
      "What a state stream's values allow in storage (ProgramBuilder.stream's values): q8 quantizes a "
      "non-negative stream with an unsigned code, and a full-precision stream stays f32 whatever the options say.")
      .value("any", stepfuse::StateValues::any, "signed values (first moments, momentum buffers)")
      .value("nonnegative", stepfuse::StateValues::nonnegative,
             "never negative (second moments, sums of squares, step sizes)")
      .value("full_precision", stepfuse::StateValues::full_precision,
             "needs fp32 (a running average of the weights, say)");

  nb::enum_<stepfuse::StreamRole>(m, "StreamRole", "What a program's stream is.")
      .value("grad", stepfuse::StreamRole::grad, "the gradient: loaded (converted to fp32), never stored")
      .value("param", stepfuse::StreamRole::param, "the parameter's fp32 value (the master copy when masters are kept)")
      .value("state", stepfuse::StreamRole::state, "optimizer state, fp32, owned by the optimizer");

  // ---- scalar rules and definitions ----
  nb::class_<ScalarRule> rule(m, "ScalarRule",
                              "How a per-step scalar gets its value for step t (1-based) and the step's gradient "
                              "multiplier gscale (docs/update-programs.md, 'Scalars and their rules').");
  nb::enum_<ScalarRule::Kind>(rule, "Kind")
      .value("fixed", ScalarRule::Kind::fixed, "a")
      .value("gscale", ScalarRule::Kind::gscale, "a * gscale")
      .value("first_step", ScalarRule::Kind::first_step, "t == 1 ? a : b")
      .value("div_one_minus_pow", ScalarRule::Kind::div_one_minus_pow, "a / (1 - b^t)")
      .value("sqrt_one_minus_pow", ScalarRule::Kind::sqrt_one_minus_pow, "sqrt(1 - b^t)")
      .value("div_linear", ScalarRule::Kind::div_linear, "a / (1 + (t - 1) * b)")
      .value("one_minus_pow", ScalarRule::Kind::one_minus_pow, "1 - b^t")
      .value("nadam_grad_coef", ScalarRule::Kind::nadam_grad_coef, "NAdam's gradient coefficient")
      .value("nadam_momentum_coef", ScalarRule::Kind::nadam_momentum_coef, "NAdam's momentum coefficient")
      .value("radam_rect", ScalarRule::Kind::radam_rect, "RAdam's rectification term")
      .value("asgd_eta", ScalarRule::Kind::asgd_eta, "ASGD's eta_t")
      .value("asgd_decay", ScalarRule::Kind::asgd_decay, "ASGD's parameter decay 1 - lambd * eta_t")
      .value("asgd_mu", ScalarRule::Kind::asgd_mu, "ASGD's averaging weight");
  rule.def(
          "__init__",
          [](ScalarRule* self, ScalarRule::Kind kind, double a, double b, double c) {
            new (self) ScalarRule{kind, a, b, c};
          },
          nb::arg("kind") = ScalarRule::Kind::fixed, nb::arg("a") = 0.0, nb::arg("b") = 0.0, nb::arg("c") = 0.0)
      .def_rw("kind", &ScalarRule::kind)
      .def_rw("a", &ScalarRule::a)
      .def_rw("b", &ScalarRule::b)
      .def_rw("c", &ScalarRule::c)
      .def("eval", &ScalarRule::eval, nb::arg("step"), nb::arg("gscale") = 1.0,
           "The rule's value for step `step` (1-based) in double, before the rounding to fp32.")
      .def("__repr__", &rule_repr)
      .def(
          "__eq__",
          [](const ScalarRule& a, nb::handle b) {
            ScalarRule* o = nullptr;
            return nb::try_cast(b, o, false) && o != nullptr && a == *o;
          },
          nb::sig("def __eq__(self, other: object, /) -> bool"));

  nb::class_<ScalarDef>(m, "ScalarDef", "One scalar of a program and its rule (see the UpdateProgram factories).")
      .def(
          "__init__", [](ScalarDef* self, std::string name, ScalarRule r) { new (self) ScalarDef{std::move(name), r}; },
          nb::arg("name"), nb::arg("rule") = ScalarRule{})
      .def_rw("name", &ScalarDef::name)
      .def_rw("rule", &ScalarDef::rule)
      .def("__repr__",
           [](const ScalarDef& d) {
             return "ScalarDef(" + std::string(nb::repr(nb::str(d.name.c_str())).c_str()) + ", " + rule_repr(d.rule) +
                    ")";
           })
      .def(
          "__eq__",
          [](const ScalarDef& a, nb::handle b) {
            ScalarDef* o = nullptr;
            return nb::try_cast(b, o, false) && o != nullptr && a == *o;
          },
          nb::sig("def __eq__(self, other: object, /) -> bool"));

  // ---- building a program ----
  nb::class_<PyValue>(m, "Value", "A value in a program under construction (%id in the listing).")
      .def_ro("id", &PyValue::id)
      .def("__repr__", [](const PyValue& v) { return "%" + std::to_string(v.id); });
  nb::class_<PyStream>(m, "Stream", "A stream of a program under construction.")
      .def_ro("index", &PyStream::index)
      .def_ro("name", &PyStream::name)
      .def("__repr__", [](const PyStream& s) { return "Stream(" + s.name + ", index=" + std::to_string(s.index) + ")"; });

  nb::class_<PyProgram>(m, "Program",
                        "A built update program (the IR); UpdateProgram(program, scalars) makes it runnable.")
      .def_prop_ro("name", [](const PyProgram& p) { return std::string(p.program.name); })
      .def_prop_ro("text", [](const PyProgram& p) { return stepfuse::to_string(p.program); },
                   "The listing, one instruction a line.")
      .def_prop_ro("num_instrs", [](const PyProgram& p) { return int(p.program.num_instrs); })
      .def_prop_ro("stream_names",
                   [](const PyProgram& p) {
                     std::vector<std::string> v;
                     for (int i = 0; i < p.program.num_streams; ++i) v.emplace_back(p.program.streams[i].name);
                     return v;
                   })
      .def_prop_ro("stream_values",
                   [](const PyProgram& p) {
                     std::vector<stepfuse::StateValues> v;
                     for (int i = 0; i < p.program.num_streams; ++i) v.push_back(p.program.streams[i].values);
                     return v;
                   },
                   "Each stream's StateValues, in stream_names' order (StateValues.any for grad and param streams).")
      .def_prop_ro("scalar_names",
                   [](const PyProgram& p) {
                     std::vector<std::string> v;
                     for (int i = 0; i < p.program.num_scalars; ++i) v.emplace_back(p.program.scalars[i]);
                     return v;
                   })
      .def("__str__", [](const PyProgram& p) { return stepfuse::to_string(p.program); })
      .def("__repr__", [](const PyProgram& p) {
        return "Program(" + std::string(p.program.name) + ", " + std::to_string(p.program.num_streams) + " streams, " +
               std::to_string(p.program.num_scalars) + " scalars, " + std::to_string(p.program.num_instrs) +
               " instructions)";
      });

  using B = PyProgramBuilder;
  nb::class_<B>(m, "ProgramBuilder",
                "Builds an update program one op at a time (stepfuse::ProgramBuilder):\n\n"
                "    b = ProgramBuilder('sgd')\n"
                "    g = b.stream('grad', StreamRole.grad); p = b.stream('param', StreamRole.param)\n"
                "    step = b.mul(b.scalar('lr'), b.mul(b.load(g), b.scalar('gscale')))\n"
                "    b.store(p, b.sub(b.load(p), step))\n"
                "    prog = UpdateProgram(b.build(), [UpdateProgram.gscale(), UpdateProgram.fixed('lr', 0.1)])\n\n"
                "Values are numbered in call order; build() validates (ValueError naming the instruction).")
      .def(nb::init<std::string>(), nb::arg("name"))
      .def(
          "stream",
          [](B& b, std::string name, stepfuse::StreamRole role, float init, stepfuse::StateValues values) {
            const std::string_view n = b.names->intern(name);
            return PyStream{b.b.stream(n, role, init, values).index, b.serial, std::move(name)};
          },
          nb::arg("name"), nb::arg("role") = stepfuse::StreamRole::state, nb::arg("init") = 0.0f,
          nb::arg("values") = stepfuse::StateValues::any,
          "Declares a stream; a state stream starts at `init` for every element. `values` (state streams only) says "
          "what its values allow in storage: StateValues.nonnegative lets q8 use an unsigned code, "
          "StateValues.full_precision keeps it f32 under any state_format (build() refuses another value on a grad "
          "or param stream).")
      .def(
          "scalar", [](B& b, std::string name) { return b.out(b.b.scalar(b.names->intern(std::move(name)))); },
          nb::arg("name"), "Declares (or finds) a per-step scalar and returns its value.")
      .def("load", [](B& b, const PyStream& s) { return b.out(b.b.load(b.s(s))); }, nb::arg("stream"))
      .def("store", [](B& b, const PyStream& s, const PyValue& v) { b.b.store(b.s(s), b.v(v)); }, nb::arg("stream"),
           nb::arg("value"))
      .def("constant", [](B& b, float x) { return b.out(b.b.constant(x)); }, nb::arg("x"))
      .def("add", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.add(b.v(x), b.v(y))); })
      .def("sub", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.sub(b.v(x), b.v(y))); })
      .def("mul", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.mul(b.v(x), b.v(y))); })
      .def("div", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.div(b.v(x), b.v(y))); })
      .def("fma",
           [](B& b, const PyValue& x, const PyValue& y, const PyValue& z) {
             return b.out(b.b.fma(b.v(x), b.v(y), b.v(z)));
           },
           "x * y + z with one rounding.")
      .def("neg", [](B& b, const PyValue& x) { return b.out(b.b.neg(b.v(x))); })
      .def("abs", [](B& b, const PyValue& x) { return b.out(b.b.abs(b.v(x))); })
      .def("sqrt", [](B& b, const PyValue& x) { return b.out(b.b.sqrt(b.v(x))); })
      .def("max", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.max(b.v(x), b.v(y))); })
      .def("min", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.min(b.v(x), b.v(y))); })
      .def("sign", [](B& b, const PyValue& x) { return b.out(b.b.sign(b.v(x))); })
      .def("select",
           [](B& b, const PyValue& c, const PyValue& t, const PyValue& f) {
             return b.out(b.b.select(b.v(c), b.v(t), b.v(f)));
           },
           nb::arg("cond"), nb::arg("if_true"), nb::arg("if_false"), "cond != 0 ? if_true : if_false")
      .def("lt", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.lt(b.v(x), b.v(y))); }, "x < y: 1.0 or 0.0")
      .def("le", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.le(b.v(x), b.v(y))); }, "x <= y: 1.0 or 0.0")
      .def("eq", [](B& b, const PyValue& x, const PyValue& y) { return b.out(b.b.eq(b.v(x), b.v(y))); }, "x == y: 1.0 or 0.0")
      .def("convert", [](B& b, const PyValue& x, stepfuse::DType to) { return b.out(b.b.convert(b.v(x), to)); },
           nb::arg("value"), nb::arg("dtype"), "The value rounded to dtype (nearest even) and widened back.")
      .def("phase", [](B& b) { b.b.phase(); }, "The phase marker of a two-phase program.")
      .def("reduce_sumsq", [](B& b, int slot, const PyValue& x) { b.b.reduce_sumsq(slot, b.v(x)); }, nb::arg("slot"),
           nb::arg("value"), "Phase 1: adds value * value to the tensor's sum of reduction slot `slot`.")
      .def("tensor_norm", [](B& b, int slot) { return b.out(b.b.tensor_norm(slot)); }, nb::arg("slot"),
           "Phase 2: the square root of the tensor's sum of slot `slot`.")
      .def(
          "build", [](const B& b) { return PyProgram{b.names, b.b.build()}; },
          "The finished program (validated: ValueError saying what is wrong).");

  // ---- UpdateProgram ----
  nb::class_<UpdateProgram>(m, "UpdateProgram",
                            "An update program with the definitions of its scalars, validated and ready to run: "
                            "pass it to Optimizer in place of a config.")
      .def(
          "__init__",
          [](UpdateProgram* self, const PyProgram& p, std::vector<ScalarDef> scalars) {
            new (self) UpdateProgram(p.program, std::move(scalars));
          },
          nb::arg("program"), nb::arg("scalars"))
      .def_static(
          "from_config",
          [](nb::handle config) {
            auto c = try_config(config);
            if (!c)
              throw nb::type_error((std::string("from_config: expected a config (") + config_class_names() + "), not " +
                                    nb::inst_name(config).c_str())
                                       .c_str());
            return UpdateProgram::from_config(*c);
          },
          nb::arg("config"), "The built-in program a config runs, with that config's scalar rules.",
          nb::sig("def from_config(config: SGD | Adam | AdamW | Adagrad | RMSprop | Lion | NAdam | RAdam | Adamax | "
                  "Adadelta | Rprop | ASGD | LAMB) -> UpdateProgram"))
      .def_static("fixed", &UpdateProgram::fixed, nb::arg("name"), nb::arg("value"),
                  "A fixed value (a hyperparameter); Optimizer.set_scalar changes it.")
      .def_static("gscale", &UpdateProgram::gscale, nb::arg("name") = "gscale", nb::arg("multiplier") = 1.0,
                  "The step's gradient multiplier times `multiplier` (-1 to maximize).")
      .def_static("first_step", &UpdateProgram::first_step, nb::arg("name"), nb::arg("first"), nb::arg("later"))
      .def_static("bias_correction1_step_size", &UpdateProgram::bias_correction1_step_size, nb::arg("name"),
                  nb::arg("lr"), nb::arg("beta1"), "lr / (1 - beta1^t)")
      .def_static("bias_correction2_sqrt", &UpdateProgram::bias_correction2_sqrt, nb::arg("name"), nb::arg("beta2"),
                  "sqrt(1 - beta2^t)")
      .def_static("lr_decay", &UpdateProgram::lr_decay, nb::arg("name"), nb::arg("lr"), nb::arg("decay"),
                  "lr / (1 + (t - 1) * decay)")
      .def_static("bias_correction", &UpdateProgram::bias_correction, nb::arg("name"), nb::arg("beta"), "1 - beta^t")
      .def_static("nadam_grad_coef", &UpdateProgram::nadam_grad_coef, nb::arg("name"), nb::arg("lr"),
                  nb::arg("beta1"), nb::arg("momentum_decay"))
      .def_static("nadam_momentum_coef", &UpdateProgram::nadam_momentum_coef, nb::arg("name"), nb::arg("lr"),
                  nb::arg("beta1"), nb::arg("momentum_decay"))
      .def_static("radam_rect", &UpdateProgram::radam_rect, nb::arg("name"), nb::arg("beta2"))
      .def_static("asgd_eta", &UpdateProgram::asgd_eta, nb::arg("name"), nb::arg("lr"), nb::arg("lambd"),
                  nb::arg("alpha"))
      .def_static("asgd_decay", &UpdateProgram::asgd_decay, nb::arg("name"), nb::arg("lr"), nb::arg("lambd"),
                  nb::arg("alpha"))
      .def_static("asgd_mu", &UpdateProgram::asgd_mu, nb::arg("name"), nb::arg("t0"))
      .def_prop_ro("name", [](const UpdateProgram& p) { return std::string(p.name()); })
      .def_prop_ro("scalars", &UpdateProgram::scalars, "One definition per program scalar, in the program's order.")
      .def_prop_ro(
          "program",
          [](const UpdateProgram& p) {
            auto owner = std::make_shared<const UpdateProgram>(p);  // copies share the storage the views point into
            return PyProgram{owner, owner->program()};
          },
          "The program itself (the IR).")
      .def("scalar", &UpdateProgram::scalar, nb::arg("name"), "The definition of scalar `name`.")
      .def("with_rule", &UpdateProgram::with_rule, nb::arg("name"), nb::arg("rule"),
           "A copy with scalar `name`'s rule replaced.")
      .def("with_rules", &UpdateProgram::with_rules, nb::arg("defs"),
           "A copy with the rules of the named scalars replaced.")
      .def("with_value", &UpdateProgram::with_value, nb::arg("name"), nb::arg("value"),
           "A copy with a fixed scalar's value replaced.")
      .def_prop_ro("text", &UpdateProgram::text, "The program listing followed by the scalar rules.")
      .def("__str__", &UpdateProgram::text)
      .def("__repr__", [](const UpdateProgram& p) {
        return "UpdateProgram(" + std::string(p.name()) + ", " + std::to_string(p.scalars().size()) + " scalars)";
      });
}

}  // namespace sfpy
