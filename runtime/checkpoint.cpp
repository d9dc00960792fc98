// Optimizer, GradScaler and LossScaleOptimizer checkpoints: format version 3 (a
// safetensors file, runtime/safetensors.hpp) written and read; versions 1 and 2 (the
// STEPFUSE container, runtime/checkpoint_file.hpp) read, for one param group.
//
// Version 3 (docs/architecture.md §9): tensors "group.<g>.param.<i>.<state>"
// for each state stream of group g's program (i counts within the group) and
// "group.<g>.param.<i>.master" for fp32 masters, all F32 of shape [numel]; the
// "__metadata__" entries, every value a string (JSON where structured):
//   format "stepfuse-optimizer", format_version "3", optimizer (the kind's name, or
//   "custom"), step_count, num_groups; per group g: group.<g>.program (the program
//   variant's name), group.<g>.hyperparameters (built-ins: a JSON object of every field
//   by PyTorch name, numbers in their shortest exact form, flags as JSON booleans),
//   group.<g>.step_count (the steps the group has applied), group.<g>.num_params,
//   group.<g>.params (a JSON array of {"numel", "weight_dtype", "grad_dtype", "master"});
//   custom programs: update_program (the program's text) and scalar_rules (a JSON array
//   of {"name", "rule", "a", "b", "c"} in the program's scalar order); grad_scaler (a
//   JSON object: GradScaler::state_dict()) or loss_scale_optimizer (a JSON object:
//   dynamic, loss_scale, dynamic_growth_steps, dynamic_counter) when saved with one;
//   checksum (safetensors.hpp).
//
// Versions 1 and 2: section "OPTM" (one optimizer):
//   str optimizer name, str update program, u32 #fields, (str name, f64 value)*,
//   i64 step count, i64 #params, per param (i64 numel, u8 weight dtype,
//   u8 grad dtype, u8 has master), u32 #state tensors, str name*, then per param:
//   each state tensor's numel floats, then the master's numel floats if it has one.
// Custom update programs wrote "custom" as the optimizer name and no fields, and
// section "UPRG": str program text (to_string(Program)), u32 #scalars, per scalar
// (str name, u8 rule kind, f64 a, f64 b), in the program's scalar order.
// Section "GSCL": u32 #entries, (str key, f64 value)* — GradScaler::state_dict().
// Section "LSOP": u8 dynamic, f64 loss scale, i64 growth steps, i64 counter.
//
// Every load checks the whole file and everything in it against the optimizer before
// it changes anything, then commits all of it.
#include <charconv>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

#include "jit/base/format.hpp"
#include "jit/builtins.hpp"
#include "jit/config_fields.hpp"
#include "jit/update_program_rules.hpp"
#include "runtime/checkpoint_file.hpp"
#include "runtime/detail_access.hpp"
#include "runtime/safetensors.hpp"
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
constexpr std::string_view kFormatName = "stepfuse-optimizer";
constexpr std::string_view kScalerKey = "grad_scaler";
constexpr std::string_view kLossScaleKey = "loss_scale_optimizer";

[[noreturn]] void mismatch(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::invalid_argument, "checkpoint '" + path + "' does not fit this optimizer: " + what);
}
[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: " + what);
}

std::string group_key(std::size_t g, std::string_view field) {
  std::string key = "group.";
  key += std::to_string(g);
  key += '.';
  key += field;
  return key;
}
std::string tensor_name(std::size_t g, std::size_t i, std::string_view what) {
  return group_key(g, "param." + std::to_string(i) + "." + std::string(what));
}

// The state streams of a program, in stream order: a param's tensors.
std::vector<std::string_view> state_streams(const Program& p) {
  std::vector<std::string_view> out;
  for (int s = 0; s < p.num_streams; ++s)
    if (p.streams[s].role == StreamRole::state) out.push_back(p.streams[s].name);
  return out;
}

// What the optimizer is, for messages: "AdamW", or "custom update program 'x'".
std::string kind_of(const detail::StepEngine& e) {
  if (e.custom_program() != nullptr) return "custom update program '" + std::string(e.program().name) + "'";
  return std::string(optimizer_name(e.config()));
}

// Everything a load restores, parsed and checked against the optimizer before anything
// is written.
struct ParsedOptimizer {
  std::vector<OptimizerConfig> configs;  // built-ins, per group
  std::optional<UpdateProgram> program;  // custom programs: the saved scalar rules
  std::int64_t step_count = 0;
  std::vector<std::int64_t> step_bases;  // per group
  std::vector<std::pair<float*, std::span<const unsigned char>>> copies;  // destination, source bytes
};

void commit_optimizer(detail::StepEngine& e, const ParsedOptimizer& p) {
  if (p.program) {
    e.set_custom_rules(*p.program);  // checked while parsing
  } else {
    for (std::size_t g = 0; g < p.configs.size(); ++g) e.set_config(g, p.configs[g]);  // checked while parsing
  }
  for (const auto& [dst, src] : p.copies)
    if (!src.empty()) std::memcpy(dst, src.data(), src.size());
  e.set_steps(p.step_count, p.step_bases);
}

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

void check_program_text(const std::string& path, const std::string& saved, const UpdateProgram& current) {
  const std::string here = to_string(current.program());
  if (saved != here)
    mismatch(path, "it was saved from a different custom update program than '" + std::string(current.name()) +
                       "' (first difference at " + first_difference(saved, here) + ")");
}

UpdateProgram with_saved_rules(const std::string& path, const UpdateProgram& current, const std::vector<ScalarDef>& defs) {
  if (defs.size() != current.scalars().size())
    corrupt(path, std::to_string(defs.size()) + " scalar rules for " + std::to_string(current.scalars().size()) + " scalars");
  try {
    return current.with_rules(defs);
  } catch (const Error& err) {
    mismatch(path, std::string("its scalar rules are not valid here: ") + err.what());
  }
}

// The loss scale of a LossScaleOptimizer checkpoint, checked as the constructor checks
// its initial_scale: finite and > 0 as a double, and still so as the fp32 it is kept in
// (1e39 would become inf, 1e-46 zero).
float checked_loss_scale(const std::string& path, double scale) {
  if (!(std::isfinite(scale) && scale > 0) || !std::isfinite(static_cast<float>(scale)) ||
      static_cast<float>(scale) == 0.0f)
    corrupt(path, "its loss scale " + detail::format_number(scale) + " is not a finite value > 0 within the fp32 range");
  return static_cast<float>(scale);
}

// ---- format version 3: writing ----

std::string json_object_of_doubles(const std::map<std::string, double>& values) {
  std::string s = "{";
  for (const auto& [key, value] : values) {
    if (s.size() > 1) s += ',';
    detail::append_json_string(s, key);
    s += ':';
    detail::append_json_double(s, value);
  }
  return s + "}";
}

// The metadata and tensors of an optimizer (format version 3), read from it at write time.
struct Described {
  std::map<std::string, std::string> metadata;
  std::vector<detail::SafetensorsSource> tensors;
};

Described describe(const detail::StepEngine& e) {
  Described d;
  auto& m = d.metadata;
  const UpdateProgram* custom = e.custom_program();
  m["format"] = kFormatName;
  m["format_version"] = std::to_string(detail::kCheckpointFormat);
  m["optimizer"] = custom ? std::string(kCustomKind) : std::string(optimizer_name(e.config()));
  m["step_count"] = std::to_string(e.step_count());
  m["num_groups"] = std::to_string(e.num_groups());
  if (custom != nullptr) {
    m["update_program"] = to_string(custom->program());
    std::string rules = "[";
    for (const ScalarDef& def : custom->scalars()) {
      if (rules.size() > 1) rules += ',';
      rules += "{\"name\":";
      detail::append_json_string(rules, def.name);
      rules += ",\"rule\":";
      detail::append_json_string(rules, scalar_rule_name(def.rule.kind));
      for (const auto& [field, value] : {std::pair{"a", def.rule.a}, std::pair{"b", def.rule.b}, std::pair{"c", def.rule.c}}) {
        rules += ",\"";
        rules += field;
        rules += "\":";
        detail::append_json_double(rules, value);
      }
      rules += '}';
    }
    m["scalar_rules"] = rules + "]";
  }
  const std::vector<Param>& params = e.params();
  for (std::size_t g = 0; g < e.num_groups(); ++g) {
    const Program& program = e.program(g);
    m[group_key(g, "program")] = program.name;
    if (custom == nullptr) {
      std::string fields = "{";
      std::visit(
          [&](const auto& c) {
            jit::for_each_field(c, [&](std::string_view name, const auto& v) {
              if (fields.size() > 1) fields += ',';
              detail::append_json_string(fields, name);
              fields += ':';
              if constexpr (std::is_same_v<std::remove_cvref_t<decltype(v)>, bool>)
                fields += v ? "true" : "false";
              else
                detail::append_json_double(fields, static_cast<double>(v));
            });
          },
          e.config(g));
      m[group_key(g, "hyperparameters")] = fields + "}";
    }
    m[group_key(g, "step_count")] = std::to_string(e.group_step_count(g));
    m[group_key(g, "num_params")] = std::to_string(e.group_end(g) - e.group_begin(g));
    std::string list = "[";
    const std::vector<std::string_view> streams = state_streams(program);
    for (std::size_t p = e.group_begin(g); p < e.group_end(g); ++p) {
      const std::size_t i = p - e.group_begin(g);
      const auto numel = static_cast<std::uint64_t>(params[p].weight.numel);
      if (list.size() > 1) list += ',';
      list += "{\"numel\":" + std::to_string(numel) + ",\"weight_dtype\":\"" +
              std::string(dtype_name(params[p].weight.dtype)) + "\",\"grad_dtype\":\"" +
              std::string(dtype_name(params[p].grad.dtype)) + "\",\"master\":" +
              (e.master_data(p) != nullptr ? "true" : "false") + "}";
      for (std::string_view s : streams) d.tensors.push_back({tensor_name(g, i, s), e.state_data(p, e.state_stream(s)), numel});
      if (const float* master = e.master_data(p)) d.tensors.push_back({tensor_name(g, i, "master"), master, numel});
    }
    m[group_key(g, "params")] = list + "]";
  }
  return d;
}

// Writes the optimizer and `extra` metadata entries (a scaler's state).
void save_checkpoint(const detail::StepEngine& e, const std::string& path,
                     std::initializer_list<std::pair<std::string_view, std::string>> extra) {
  Described d = describe(e);
  for (const auto& [key, value] : extra) d.metadata[std::string(key)] = value;
  detail::write_safetensors(path, d.metadata, d.tensors);
}

// ---- format version 3: reading ----

// The metadata of a version-3 file, read with checks: anything missing or malformed is
// corrupt (the checksum held, so some other writer made it).
class MetadataReader {
 public:
  explicit MetadataReader(const detail::SafetensorsFile& f) : f_(f) {}
  const std::string& path() const { return f_.path(); }

  const std::string& text(std::string_view key) const {
    const std::string* v = f_.meta(key);
    if (v == nullptr) corrupt(path(), "its metadata has no \"" + std::string(key) + "\" entry");
    return *v;
  }
  std::int64_t integer(std::string_view key) const {
    const std::string& v = text(key);
    std::int64_t n = 0;
    const auto r = std::from_chars(v.data(), v.data() + v.size(), n);
    if (r.ec != std::errc{} || r.ptr != v.data() + v.size() || n < 0)
      corrupt(path(), "its metadata \"" + std::string(key) + "\" is not a non-negative integer");
    return n;
  }
  detail::JsonValue json(std::string_view key, detail::JsonValue::Kind kind) const {
    detail::JsonValue v;
    try {
      v = detail::parse_json(text(key));
    } catch (const detail::JsonError& err) {
      corrupt(path(), "its metadata \"" + std::string(key) + "\" is not valid JSON (" + err.what() + ")");
    }
    if (v.kind != kind)
      corrupt(path(), "its metadata \"" + std::string(key) + "\" is not a JSON " +
                          (kind == detail::JsonValue::Kind::object ? "object" : "array"));
    return v;
  }
  // A member of a JSON object from the metadata `key`, as a double, a bool, an integer, a string.
  double number(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    const detail::JsonValue* m = v.find(member);
    const auto d = m ? detail::json_double(*m) : std::nullopt;
    if (!d) bad_member(key, member, "a number");
    return *d;
  }
  bool boolean(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    const detail::JsonValue* m = v.find(member);
    if (m == nullptr || m->kind != detail::JsonValue::Kind::boolean) bad_member(key, member, "true or false");
    return m->boolean;
  }
  std::uint64_t uint(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    const detail::JsonValue* m = v.find(member);
    const auto n = m ? detail::json_uint(*m) : std::nullopt;
    if (!n) bad_member(key, member, "a non-negative integer");
    return *n;
  }
  const std::string& string(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    const detail::JsonValue* m = v.find(member);
    if (m == nullptr || m->kind != detail::JsonValue::Kind::string) bad_member(key, member, "a string");
    return m->text;
  }

 private:
  [[noreturn]] void bad_member(std::string_view key, std::string_view member, const char* kind) const {
    corrupt(path(), "its metadata \"" + std::string(key) + "\" has no \"" + std::string(member) + "\" that is " + kind);
  }
  const detail::SafetensorsFile& f_;
};

std::optional<ScalarRule::Kind> rule_kind(std::string_view name) {
  for (unsigned k = 0; k < 256; ++k) {
    const auto kind = static_cast<ScalarRule::Kind>(k);
    const std::string_view n = scalar_rule_name(kind);
    if (n == "?") break;  // past the last kind
    if (n == name) return kind;
  }
  return std::nullopt;
}

ParsedOptimizer parse_v3(const detail::SafetensorsFile& f, const detail::StepEngine& e) {
  const std::string& path = f.path();
  const MetadataReader meta(f);
  const UpdateProgram* custom = e.custom_program();
  ParsedOptimizer out;

  const std::string& kind = meta.text("optimizer");
  if (kind != (custom ? kCustomKind : optimizer_name(e.config()))) {
    const std::string* name = f.meta(group_key(0, "program"));
    mismatch(path, "it holds " +
                       (kind == kCustomKind ? "a custom update program '" + (name ? *name : std::string("?")) + "'"
                                            : "a " + kind + " optimizer") +
                       ", this one is " + kind_of(e));
  }
  const std::int64_t groups = meta.integer("num_groups");
  if (groups < 1) corrupt(path, "it has no param groups");
  if (static_cast<std::uint64_t>(groups) != e.num_groups())
    mismatch(path, "it holds " + std::to_string(groups) + " param group" + (groups == 1 ? "" : "s") +
                       ", this optimizer has " + std::to_string(e.num_groups()));
  const bool one_group = e.num_groups() == 1;
  for (std::size_t g = 0; g < e.num_groups(); ++g) {
    const std::string& saved_program = meta.text(group_key(g, "program"));
    const std::string_view here = e.program(g).name;
    if (saved_program != here)
      mismatch(path, std::string(one_group ? "" : "group " + std::to_string(g) + ": ") + "it was saved from update program '" +
                         saved_program + "', this optimizer" + (one_group ? "" : "'s group " + std::to_string(g)) +
                         " runs '" + std::string(here) +
                         (custom ? "'" : "' (amsgrad, nesterov, centered or momentum on/off differ)"));
  }
  if (custom != nullptr) {
    check_program_text(path, meta.text("update_program"), *custom);
    std::vector<ScalarDef> defs;
    const detail::JsonValue rules = meta.json("scalar_rules", detail::JsonValue::Kind::array);
    for (const detail::JsonValue& r : rules.items) {
      ScalarDef d;
      d.name = meta.string(r, "scalar_rules", "name");
      const std::string& rule = meta.string(r, "scalar_rules", "rule");
      const auto k = rule_kind(rule);
      if (!k) corrupt(path, "its scalar rule '" + rule + "' is not one this build knows");
      d.rule.kind = *k;
      d.rule.a = meta.number(r, "scalar_rules", "a");
      d.rule.b = meta.number(r, "scalar_rules", "b");
      d.rule.c = meta.number(r, "scalar_rules", "c");
      defs.push_back(std::move(d));
    }
    out.program = with_saved_rules(path, *custom, defs);
  }
  out.step_count = meta.integer("step_count");

  const std::vector<Param>& params = e.params();
  std::size_t tensors = 0;
  for (std::size_t g = 0; g < e.num_groups(); ++g) {
    const Program& program = e.program(g);
    const std::string in_group = one_group ? "" : "group " + std::to_string(g) + ": ";
    if (custom == nullptr) {
      const std::string key = group_key(g, "hyperparameters");
      const detail::JsonValue fields = meta.json(key, detail::JsonValue::Kind::object);
      OptimizerConfig config = e.config(g);
      std::visit(
          [&](auto& c) {
            jit::for_each_field(c, [&](std::string_view name, auto& v) {
              if (fields.find(name) == nullptr)
                mismatch(path, in_group + "hyperparameter '" + std::string(name) + "' is missing");
              if constexpr (std::is_same_v<std::remove_reference_t<decltype(v)>, bool>)
                v = meta.boolean(fields, key, name);
              else
                v = meta.number(fields, key, name);
            });
          },
          config);
      try {
        e.check_config(g, config);
      } catch (const Error& err) {
        mismatch(path, in_group + "its hyperparameters are not valid here: " + err.what());
      }
      out.configs.push_back(config);
    }
    const std::int64_t group_steps = meta.integer(group_key(g, "step_count"));
    if (group_steps > out.step_count)
      corrupt(path, "group " + std::to_string(g) + " has applied " + std::to_string(group_steps) +
                        " steps, more than the optimizer's " + std::to_string(out.step_count));
    out.step_bases.push_back(out.step_count - group_steps);

    const std::size_t here = e.group_end(g) - e.group_begin(g);
    const std::int64_t saved = meta.integer(group_key(g, "num_params"));
    const detail::JsonValue list = meta.json(group_key(g, "params"), detail::JsonValue::Kind::array);
    if (list.items.size() != static_cast<std::uint64_t>(saved))
      corrupt(path, "group " + std::to_string(g) + " lists " + std::to_string(list.items.size()) + " params, not " +
                        std::to_string(saved));
    if (static_cast<std::uint64_t>(saved) != here)
      mismatch(path, one_group ? "it holds " + std::to_string(saved) + " parameters, this optimizer has " + std::to_string(here)
                               : "group " + std::to_string(g) + " has " + std::to_string(here) +
                                     " params, the checkpoint's group " + std::to_string(g) + " has " + std::to_string(saved));
    const std::vector<std::string_view> streams = state_streams(program);
    const std::string params_key = group_key(g, "params");
    for (std::size_t i = 0; i < here; ++i) {
      const std::size_t p = e.group_begin(g) + i;
      const detail::JsonValue& entry = list.items[i];
      const std::string at = (one_group ? "params[" : "groups[" + std::to_string(g) + "].params[") + std::to_string(i) + "]: ";
      const std::uint64_t numel = meta.uint(entry, params_key, "numel");
      const std::string& w = meta.string(entry, params_key, "weight_dtype");
      const std::string& gr = meta.string(entry, params_key, "grad_dtype");
      const bool master = meta.boolean(entry, params_key, "master");
      const auto numel_here = static_cast<std::uint64_t>(params[p].weight.numel);
      if (numel != numel_here)
        mismatch(path, at + std::to_string(numel) + " elements saved, " + std::to_string(numel_here) + " here");
      const std::string_view w_here = dtype_name(params[p].weight.dtype), g_here = dtype_name(params[p].grad.dtype);
      if (w != w_here || gr != g_here)
        mismatch(path, at + "saved with weight/grad dtypes " + w + "/" + gr + ", here " + std::string(w_here) + "/" +
                           std::string(g_here));
      if (master != (e.master_data(p) != nullptr))
        mismatch(path, at + (master ? "saved with an fp32 master, this optimizer keeps none"
                                    : "saved without an fp32 master, this optimizer keeps one") +
                           " (OptimizerOptions::master_weights differs)");
      const auto take = [&](std::string_view what, float* dst) {
        const std::string name = tensor_name(g, i, what);
        const detail::SafetensorsTensor* t = f.find(name);
        if (t == nullptr) corrupt(path, "tensor '" + name + "' is missing");
        if (t->dtype != "F32" || t->shape.size() != 1 || t->shape[0] != numel)
          corrupt(path, "tensor '" + name + "' is not F32 of shape [" + std::to_string(numel) + "]");
        out.copies.emplace_back(dst, f.data(*t));
        ++tensors;
      };
      for (std::string_view s : streams) take(s, e.state_data(p, e.state_stream(s)));
      if (float* m = e.master_data(p)) take("master", m);
    }
  }
  if (tensors != f.tensors().size()) {
    std::set<std::string> known;
    for (std::size_t g = 0; g < e.num_groups(); ++g)
      for (std::size_t i = 0; i < e.group_end(g) - e.group_begin(g); ++i) {
        for (std::string_view s : state_streams(e.program(g))) known.insert(tensor_name(g, i, s));
        known.insert(tensor_name(g, i, "master"));
      }
    for (const detail::SafetensorsTensor& t : f.tensors())
      if (known.count(t.name) == 0) corrupt(path, "it holds tensor '" + t.name + "', which is none of this optimizer's");
  }
  return out;
}

// ---- format versions 1 and 2: reading ----

ParsedOptimizer parse_container(const detail::CheckpointFile& file, const detail::StepEngine& e) {
  const std::string& path = file.path();
  if (e.num_groups() != 1)
    mismatch(path, "it is a format-" + std::to_string(file.version()) +
                       " checkpoint, which holds one param group; this optimizer has " + std::to_string(e.num_groups()));
  const auto body = file.find(kOptimizerTag);
  if (!body) throw Error(ErrorCode::io_error, "checkpoint '" + path + "' has no optimizer section");
  detail::SectionReader r(*body, "checkpoint '" + path + "'");
  const UpdateProgram* custom = e.custom_program();
  ParsedOptimizer out;
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
    const auto prog = file.find(kProgramTag);
    if (!prog) corrupt(path, "a custom optimizer without its program section");
    detail::SectionReader pr(*prog, "checkpoint '" + path + "'");
    check_program_text(path, pr.str(), *custom);
    std::vector<ScalarDef> defs;
    for (std::uint32_t n = pr.u32(); n > 0; --n) {
      ScalarDef d;
      d.name = pr.str();
      const std::uint8_t k = pr.u8();
      d.rule.kind = static_cast<ScalarRule::Kind>(k);
      d.rule.a = pr.f64();
      d.rule.b = pr.f64();
      // The rules these versions knew; their files have no third parameter.
      if (k > static_cast<std::uint8_t>(ScalarRule::Kind::div_linear))
        corrupt(path, "unknown scalar rule kind " + std::to_string(k));
      defs.push_back(std::move(d));
    }
    if (!pr.done()) corrupt(path, "extra bytes in the program section");
    out.program = with_saved_rules(path, *custom, defs);
  } else {
    OptimizerConfig config = e.config();
    std::visit(
        [&](auto& c) {
          jit::for_each_field(c, [&](std::string_view name, auto& v) {
            const auto it = fields.find(std::string(name));
            if (it == fields.end()) mismatch(path, "hyperparameter '" + std::string(name) + "' is missing");
            v = static_cast<std::remove_reference_t<decltype(v)>>(it->second);
          });
        },
        config);
    try {
      e.check_config(0, config);
    } catch (const Error& err) {
      mismatch(path, std::string("its hyperparameters are not valid here: ") + err.what());
    }
    out.configs.push_back(config);
  }
  out.step_count = r.i64();
  if (out.step_count < 0) corrupt(path, "negative step count");
  out.step_bases = {0};
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
  const std::vector<std::string_view> streams = state_streams(e.program());
  if (r.u32() != streams.size()) mismatch(path, "it holds a different number of state tensors");
  for (std::string_view s : streams)
    if (r.str() != s) mismatch(path, "its state tensors differ from this optimizer's");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = static_cast<std::size_t>(params[i].weight.numel) * sizeof(float);
    for (std::string_view s : streams) out.copies.emplace_back(e.state_data(i, e.state_stream(s)), r.bytes(bytes));
    if (has_master[i]) out.copies.emplace_back(e.master_data(i), r.bytes(bytes));
  }
  if (!r.done()) corrupt(path, "extra bytes in the optimizer section");
  return out;
}

// ---- either version ----

// A checkpoint file of any version, checked as a file (container, version, checksum).
struct OpenedCheckpoint {
  std::optional<detail::CheckpointFile> container;  // versions 1 and 2
  std::optional<detail::SafetensorsFile> file;      // version 3
};

OpenedCheckpoint open_checkpoint(const std::string& path) {
  detail::MappedFile mapped(path);
  OpenedCheckpoint out;
  if (detail::is_container_file(mapped.bytes())) {
    out.container.emplace(std::move(mapped));
    return out;
  }
  detail::SafetensorsFile f(std::move(mapped));
  const std::string* format = f.meta("format");
  if (format == nullptr || *format != kFormatName)
    throw Error(ErrorCode::io_error, "checkpoint '" + path +
                                         "' is not a stepfuse checkpoint (a safetensors file whose metadata has no "
                                         "\"format\": \"stepfuse-optimizer\"; model weights, perhaps?)");
  const std::string* version_text = f.meta("format_version");
  std::uint32_t version = 0;
  if (version_text == nullptr ||
      std::from_chars(version_text->data(), version_text->data() + version_text->size(), version).ptr !=
          version_text->data() + version_text->size() ||
      version_text->empty())
    corrupt(path, "its metadata has no \"format_version\" number");
  if (version > detail::kCheckpointFormat)
    throw Error(ErrorCode::io_error, "checkpoint '" + path + "' has format version " + std::to_string(version) +
                                         "; this build of stepfuse reads versions " +
                                         std::to_string(detail::kOldestCheckpointFormat) + " to " +
                                         std::to_string(detail::kCheckpointFormat) + " (it was written by a newer stepfuse)");
  if (version != detail::kCheckpointFormat)
    corrupt(path, "format version " + std::to_string(version) + " in a safetensors file (versions " +
                      std::to_string(detail::kOldestCheckpointFormat) + " to " +
                      std::to_string(detail::kLastContainerFormat) + " are STEPFUSE files)");
  f.verify_checksum();
  out.file.emplace(std::move(f));
  return out;
}

ParsedOptimizer parse_optimizer(const OpenedCheckpoint& c, const detail::StepEngine& e) {
  return c.container ? parse_container(*c.container, e) : parse_v3(*c.file, e);
}

std::map<std::string, double> parse_scaler(const OpenedCheckpoint& c) {
  const std::string& path = c.container ? c.container->path() : c.file->path();
  const auto absent = [&] {
    throw Error(ErrorCode::invalid_argument, "checkpoint '" + path +
                                                 "' has no GradScaler state (it was saved with Optimizer::save(path), "
                                                 "without a scaler; load it with Optimizer::load(path))");
  };
  std::map<std::string, double> state;
  if (c.container) {
    const auto body = c.container->find(kScalerTag);
    if (!body) absent();
    detail::SectionReader r(*body, "checkpoint '" + path + "'");
    for (std::uint32_t n = r.u32(); n > 0; --n) {
      std::string key = r.str();
      state[key] = r.f64();
    }
    return state;
  }
  if (c.file->meta(kScalerKey) == nullptr) absent();
  const MetadataReader meta(*c.file);
  const detail::JsonValue v = meta.json(kScalerKey, detail::JsonValue::Kind::object);
  for (const auto& [key, value] : v.members) state[key] = meta.number(v, kScalerKey, key);
  return state;
}

}  // namespace

// ---- the front-ends ----

struct LossScaleCheckpoint {
  static std::string to_json(const LossScaleOptimizer& l) {
    std::string s = "{\"dynamic\":";
    s += l.dynamic_ ? "true" : "false";
    s += ",\"loss_scale\":";
    detail::append_json_double(s, static_cast<double>(l.scale_));
    s += ",\"dynamic_growth_steps\":" + std::to_string(l.growth_steps_);
    s += ",\"dynamic_counter\":" + std::to_string(l.counter_) + "}";
    return s;
  }
  static void restore(LossScaleOptimizer& l, float scale, std::int64_t counter) {
    l.scale_ = scale;
    l.counter_ = counter;
  }
};

void Optimizer::save(const std::string& path) const { save_checkpoint(*engine_, path, {}); }

void Optimizer::save(const std::string& path, const GradScaler& scaler) const {
  save_checkpoint(*engine_, path, {{kScalerKey, json_object_of_doubles(scaler.state_dict())}});
}

void Optimizer::load(const std::string& path) {
  const OpenedCheckpoint c = open_checkpoint(path);
  commit_optimizer(*engine_, parse_optimizer(c, *engine_));
}

void Optimizer::load(const std::string& path, GradScaler& scaler) {
  const OpenedCheckpoint c = open_checkpoint(path);
  const ParsedOptimizer parsed = parse_optimizer(c, *engine_);
  GradScaler restored = scaler;  // validate on a copy: nothing changes on an Error
  restored.load_state_dict(parse_scaler(c));
  commit_optimizer(*engine_, parsed);
  scaler = restored;
}

void LossScaleOptimizer::save(const std::string& path) const {
  save_checkpoint(detail_access::engine(*inner_), path, {{kLossScaleKey, LossScaleCheckpoint::to_json(*this)}});
}

void LossScaleOptimizer::load(const std::string& path) {
  const OpenedCheckpoint c = open_checkpoint(path);
  detail::StepEngine& engine = detail_access::engine(*inner_);
  const ParsedOptimizer parsed = parse_optimizer(c, engine);
  const auto absent = [&] {
    throw Error(ErrorCode::invalid_argument,
                "checkpoint '" + path + "' has no LossScaleOptimizer state (it was saved by Optimizer::save)");
  };
  double scale = 0;
  std::int64_t counter = 0;
  if (c.container) {
    const auto body = c.container->find(kLossScaleTag);
    if (!body) absent();
    detail::SectionReader r(*body, "checkpoint '" + path + "'");
    r.u8();  // dynamic: configuration, not state
    scale = r.f64();
    r.i64();  // growth steps: configuration
    counter = r.i64();
    if (counter < 0) corrupt(path, "a negative loss-scale counter");
  } else {
    if (c.file->meta(kLossScaleKey) == nullptr) absent();
    const MetadataReader meta(*c.file);
    const detail::JsonValue v = meta.json(kLossScaleKey, detail::JsonValue::Kind::object);
    scale = meta.number(v, kLossScaleKey, "loss_scale");  // dynamic and the growth steps: configuration
    const std::uint64_t n = meta.uint(v, kLossScaleKey, "dynamic_counter");
    if (n > static_cast<std::uint64_t>(INT64_MAX)) corrupt(path, "a loss-scale counter out of range");
    counter = static_cast<std::int64_t>(n);
  }
  const float checked = checked_loss_scale(path, scale);
  commit_optimizer(engine, parsed);
  LossScaleCheckpoint::restore(*this, checked, counter);
}

}  // namespace stepfuse
