// Optimizer, GradScaler and LossScaleOptimizer checkpoints (container format in
// runtime/checkpoint_file.hpp).
//
// Section "OPTM" (one optimizer):
//   str optimizer name, str update program, u32 #fields, (str name, f64 value)*,
//   i64 step count, i64 #params, per param (i64 numel, u8 weight dtype,
//   u8 grad dtype, u8 has master), u32 #state tensors, str name*, then per param:
//   each state tensor's numel floats, then the master's numel floats if it has one.
// Custom update programs write "custom" as the optimizer name and no fields, and
// add section "UPRG": str program text (to_string(Program)), u32 #scalars, per
// scalar (str name, u8 rule kind, f64 a, f64 b), in the program's scalar order.
// Section "GSCL": u32 #entries, (str key, f64 value)* — GradScaler::state_dict().
// Section "LSOP": u8 dynamic, f64 loss scale, i64 growth steps, i64 counter.
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "jit/builtins.hpp"
#include "jit/config_fields.hpp"
#include "jit/update_program_rules.hpp"
#include "runtime/checkpoint_file.hpp"
#include "runtime/detail_access.hpp"
#include "runtime/step_engine.hpp"
#include "stepfuse/error.hpp"
#include "stepfuse/grad_scaler.hpp"
#include "stepfuse/loss_scale_optimizer.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse {

namespace {

constexpr std::uint32_t kOptimizerTag = detail::section_tag("OPTM");
constexpr std::uint32_t kScalerTag = detail::section_tag("GSCL");
constexpr std::uint32_t kLossScaleTag = detail::section_tag("LSOP");
constexpr std::uint32_t kProgramTag = detail::section_tag("UPRG");
constexpr std::string_view kCustomKind = "custom";

[[noreturn]] void mismatch(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::invalid_argument, "checkpoint '" + path + "' does not fit this optimizer: " + what);
}

}  // namespace

struct LossScaleCheckpoint {
  static void write(const LossScaleOptimizer& l, detail::SectionWriter& w) {
    w.u8(l.dynamic_ ? 1 : 0);
    w.f64(static_cast<double>(l.scale_));
    w.i64(l.growth_steps_);
    w.i64(l.counter_);
  }
  static void restore(LossScaleOptimizer& l, float scale, std::int64_t counter) {
    l.scale_ = scale;
    l.counter_ = counter;
  }
};

namespace {

// What the optimizer is, for messages: "AdamW", or "custom update program 'x'".
std::string kind_of(const detail::StepEngine& e) {
  if (e.custom_program() != nullptr) return "custom update program '" + std::string(e.program().name) + "'";
  return std::string(optimizer_name(e.config()));
}

void write_program(const UpdateProgram& p, detail::SectionWriter& w) {
  w.str(to_string(p.program()));
  w.u32(static_cast<std::uint32_t>(p.scalars().size()));
  for (const ScalarDef& d : p.scalars()) {
    w.str(d.name);
    w.u8(static_cast<std::uint8_t>(d.rule.kind));
    w.f64(d.rule.a);
    w.f64(d.rule.b);
  }
}

void write_optimizer(const detail::StepEngine& e, detail::SectionWriter& w) {
  const Program& program = e.program();
  std::vector<std::pair<std::string_view, double>> fields;
  if (e.custom_program() != nullptr) {
    w.str(kCustomKind);  // the scalar rules go to section UPRG
  } else {
    OptimizerConfig config = e.config();
    w.str(optimizer_name(config));
    std::visit([&](auto& c) { jit::for_each_field(c, [&](std::string_view n, auto& v) { fields.emplace_back(n, double(v)); }); },
               config);
  }
  w.str(program.name);
  w.u32(static_cast<std::uint32_t>(fields.size()));
  for (const auto& [name, value] : fields) w.str(name), w.f64(value);
  w.i64(e.step_count());
  const std::vector<Param>& params = e.params();
  w.i64(static_cast<std::int64_t>(params.size()));
  for (std::size_t i = 0; i < params.size(); ++i) {
    w.i64(params[i].weight.numel);
    w.u8(static_cast<std::uint8_t>(params[i].weight.dtype));
    w.u8(static_cast<std::uint8_t>(params[i].grad.dtype));
    w.u8(e.master_data(i) != nullptr ? 1 : 0);
  }
  std::vector<int> streams;
  for (int s = 0; s < program.num_streams; ++s)
    if (program.streams[s].role == StreamRole::state) streams.push_back(s);
  w.u32(static_cast<std::uint32_t>(streams.size()));
  for (int s : streams) w.str(program.streams[s].name);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto n = static_cast<std::size_t>(params[i].weight.numel);
    for (int s : streams) w.floats(e.state_data(i, e.state_stream(program.streams[s].name)), n);
    if (const float* m = e.master_data(i)) w.floats(m, n);
  }
}

// Everything an optimizer section restores, parsed and checked against the
// optimizer before anything is written.
struct ParsedOptimizer {
  OptimizerConfig config;                // built-ins
  std::optional<UpdateProgram> program;  // custom programs: the saved scalar rules
  std::int64_t step_count;
  std::vector<std::pair<float*, std::span<const unsigned char>>> copies;  // destination, source bytes
};

// The first line where two texts differ, for a mismatch message.
std::string first_difference(const std::string& saved, const std::string& here) {
  std::size_t line = 1, a = 0, b = 0;
  while (true) {
    const std::size_t ea = saved.find('\n', a), eb = here.find('\n', b);
    const std::string la = saved.substr(a, ea == std::string::npos ? std::string::npos : ea - a);
    const std::string lb = here.substr(b, eb == std::string::npos ? std::string::npos : eb - b);
    if (la != lb || ea == std::string::npos || eb == std::string::npos)
      return "line " + std::to_string(line) + ": saved '" + la + "', here '" + lb + "'";
    a = ea + 1, b = eb + 1, ++line;
  }
}

// Section UPRG: the saved program must be this optimizer's; returns it with the saved rules.
UpdateProgram parse_program(const detail::CheckpointFile& file, const UpdateProgram& current) {
  const std::string& path = file.path();
  const auto body = file.find(kProgramTag);
  if (!body) throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: a custom optimizer without its program section");
  detail::SectionReader r(*body, "checkpoint '" + path + "'");
  const std::string text = r.str(), here = to_string(current.program());
  if (text != here)
    mismatch(path, "it was saved from a different custom update program than '" + std::string(current.name()) +
                       "' (first difference at " + first_difference(text, here) + ")");
  std::vector<ScalarDef> defs;
  for (std::uint32_t n = r.u32(); n > 0; --n) {
    ScalarDef d;
    d.name = r.str();
    const std::uint8_t kind = r.u8();
    d.rule.kind = static_cast<ScalarRule::Kind>(kind);
    d.rule.a = r.f64();
    d.rule.b = r.f64();
    if (kind > static_cast<std::uint8_t>(ScalarRule::Kind::div_linear))
      throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: unknown scalar rule kind " + std::to_string(kind));
    defs.push_back(std::move(d));
  }
  if (!r.done()) throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: extra bytes in the program section");
  if (defs.size() != current.scalars().size())
    throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: " + std::to_string(defs.size()) +
                                         " scalar rules for " + std::to_string(current.scalars().size()) + " scalars");
  try {
    return current.with_rules(defs);
  } catch (const Error& err) {
    mismatch(path, std::string("its scalar rules are not valid here: ") + err.what());
  }
}

ParsedOptimizer parse_optimizer(const detail::CheckpointFile& file, const detail::StepEngine& e) {
  const std::string& path = file.path();
  const auto body = file.find(kOptimizerTag);
  if (!body) throw Error(ErrorCode::io_error, "checkpoint '" + path + "' has no optimizer section");
  detail::SectionReader r(*body, "checkpoint '" + path + "'");
  const UpdateProgram* custom = e.custom_program();
  ParsedOptimizer out{custom ? OptimizerConfig{} : e.config(), std::nullopt, 0, {}};
  const std::string kind = r.str(), program = r.str();
  if (kind != (custom ? kCustomKind : optimizer_name(e.config())))
    mismatch(path, "it holds " + (kind == kCustomKind ? "a custom update program '" + program + "'" : "a " + kind + " optimizer") +
                       ", this one is " + kind_of(e));
  if (program != e.program().name)
    mismatch(path, "it was saved from update program '" + program + "', this optimizer runs '" +
                       std::string(e.program().name) +
                       (custom ? "'" : "' (amsgrad, nesterov, centered or momentum on/off differ)"));
  std::map<std::string, double> fields;
  for (std::uint32_t n = r.u32(); n > 0; --n) {
    std::string name = r.str();
    fields[name] = r.f64();
  }
  if (custom != nullptr) {
    out.program = parse_program(file, *custom);
  } else {
    std::visit(
        [&](auto& c) {
          jit::for_each_field(c, [&](std::string_view name, auto& v) {
            const auto it = fields.find(std::string(name));
            if (it == fields.end()) mismatch(path, "hyperparameter '" + std::string(name) + "' is missing");
            v = static_cast<std::remove_reference_t<decltype(v)>>(it->second);
          });
        },
        out.config);
    try {
      e.check_config(0, out.config);
    } catch (const Error& err) {
      mismatch(path, std::string("its hyperparameters are not valid here: ") + err.what());
    }
  }
  out.step_count = r.i64();
  if (out.step_count < 0) throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: negative step count");
  const std::vector<Param>& params = e.params();
  const std::int64_t nparams = r.i64();
  if (nparams != static_cast<std::int64_t>(params.size()))
    mismatch(path, "it holds " + std::to_string(nparams) + " parameters, this optimizer has " +
                       std::to_string(params.size()));
  std::vector<bool> has_master(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::int64_t numel = r.i64();
    const auto w = static_cast<DType>(r.u8()), g = static_cast<DType>(r.u8());
    has_master[i] = r.u8() != 0;
    const std::string at = "params[" + std::to_string(i) + "]: ";
    if (numel != params[i].weight.numel)
      mismatch(path, at + std::to_string(numel) + " elements saved, " + std::to_string(params[i].weight.numel) + " here");
    if (w != params[i].weight.dtype || g != params[i].grad.dtype)
      mismatch(path, at + "saved with different weight/grad dtypes than " + std::string(dtype_name(params[i].weight.dtype)) +
                         "/" + std::string(dtype_name(params[i].grad.dtype)));
    if (has_master[i] != (e.master_data(i) != nullptr))
      mismatch(path, at + (has_master[i] ? "saved with an fp32 master, this optimizer keeps none"
                                         : "saved without an fp32 master, this optimizer keeps one") +
                         " (OptimizerOptions::master_weights differs)");
  }
  std::vector<int> streams;
  const Program& prog = e.program();
  for (int s = 0; s < prog.num_streams; ++s)
    if (prog.streams[s].role == StreamRole::state) streams.push_back(s);
  if (r.u32() != streams.size()) mismatch(path, "it holds a different number of state tensors");
  for (int s : streams)
    if (r.str() != prog.streams[s].name) mismatch(path, "its state tensors differ from this optimizer's");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = static_cast<std::size_t>(params[i].weight.numel) * sizeof(float);
    for (int s : streams) out.copies.emplace_back(e.state_data(i, e.state_stream(prog.streams[s].name)), r.bytes(bytes));
    if (has_master[i]) out.copies.emplace_back(e.master_data(i), r.bytes(bytes));
  }
  if (!r.done()) throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: extra bytes in the optimizer section");
  return out;
}

void commit_optimizer(detail::StepEngine& e, const ParsedOptimizer& p) {
  for (const auto& [dst, src] : p.copies)
    if (!src.empty()) std::memcpy(dst, src.data(), src.size());
  if (p.program)
    e.set_custom_rules(*p.program);  // checked in parse_optimizer
  else
    e.set_config(0, p.config);  // checked in parse_optimizer
  e.set_steps(p.step_count, {0});
}

std::map<std::string, double> parse_scaler(const detail::CheckpointFile& file) {
  const auto body = file.find(kScalerTag);
  if (!body)
    throw Error(ErrorCode::invalid_argument, "checkpoint '" + file.path() +
                                                 "' has no GradScaler state (it was saved with Optimizer::save(path), "
                                                 "without a scaler; load it with Optimizer::load(path))");
  detail::SectionReader r(*body, "checkpoint '" + file.path() + "'");
  std::map<std::string, double> state;
  for (std::uint32_t n = r.u32(); n > 0; --n) {
    std::string key = r.str();
    state[key] = r.f64();
  }
  return state;
}

}  // namespace

namespace {

// The optimizer's sections (OPTM, and UPRG for a custom program) followed by `extra`.
void save_sections(const detail::StepEngine& e, const std::string& path,
                   std::initializer_list<std::pair<std::uint32_t, const detail::SectionWriter*>> extra) {
  detail::SectionWriter opt, prog;
  write_optimizer(e, opt);
  std::vector<std::pair<std::uint32_t, const detail::SectionWriter*>> sections = {{kOptimizerTag, &opt}};
  if (const UpdateProgram* custom = e.custom_program()) {
    write_program(*custom, prog);
    sections.emplace_back(kProgramTag, &prog);
  }
  sections.insert(sections.end(), extra.begin(), extra.end());
  detail::write_checkpoint(path, sections);
}

}  // namespace

void Optimizer::save(const std::string& path) const { save_sections(*engine_, path, {}); }

void Optimizer::save(const std::string& path, const GradScaler& scaler) const {
  detail::SectionWriter sc;
  const auto state = scaler.state_dict();
  sc.u32(static_cast<std::uint32_t>(state.size()));
  for (const auto& [key, value] : state) sc.str(key), sc.f64(value);
  save_sections(*engine_, path, {{kScalerTag, &sc}});
}

void Optimizer::load(const std::string& path) {
  const detail::CheckpointFile file(path);
  commit_optimizer(*engine_, parse_optimizer(file, *engine_));
}

void Optimizer::load(const std::string& path, GradScaler& scaler) {
  const detail::CheckpointFile file(path);
  const ParsedOptimizer parsed = parse_optimizer(file, *engine_);
  GradScaler restored = scaler;  // validate on a copy: nothing changes on an Error
  restored.load_state_dict(parse_scaler(file));
  commit_optimizer(*engine_, parsed);
  scaler = restored;
}

void LossScaleOptimizer::save(const std::string& path) const {
  detail::SectionWriter ls;
  LossScaleCheckpoint::write(*this, ls);
  save_sections(detail_access::engine(*inner_), path, {{kLossScaleTag, &ls}});
}

void LossScaleOptimizer::load(const std::string& path) {
  const detail::CheckpointFile file(path);
  detail::StepEngine& engine = detail_access::engine(*inner_);
  const ParsedOptimizer parsed = parse_optimizer(file, engine);
  const auto body = file.find(kLossScaleTag);
  if (!body)
    throw Error(ErrorCode::invalid_argument,
                "checkpoint '" + path + "' has no LossScaleOptimizer state (it was saved by Optimizer::save)");
  detail::SectionReader r(*body, "checkpoint '" + path + "'");
  r.u8();  // dynamic: configuration, not state
  const double scale = r.f64();
  r.i64();  // growth steps: configuration
  const std::int64_t counter = r.i64();
  if (!(std::isfinite(scale) && scale > 0) || counter < 0)
    throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: invalid loss-scale state");
  commit_optimizer(engine, parsed);
  LossScaleCheckpoint::restore(*this, static_cast<float>(scale), counter);
}

}  // namespace stepfuse
