// Optimizer, GradScaler and LossScaleOptimizer checkpoints: format version 3 (a
// safetensors file, runtime/safetensors.hpp) written and read; versions 1 and 2 (the
// STEPFUSE container, runtime/checkpoint_file.hpp) read, for one param group.
//
// Version 3 (docs/architecture.md §9): tensors "group.<g>.param.<i>.<state>"
// for each state stream of group g's program (i counts within the group) and
// "group.<g>.param.<i>.master" for fp32 masters, all F32 of shape [numel], in that
// order; after all of them (so that every F32 tensor stays 4-byte aligned)
// "group.<g>.param.<i>.compensation" for bf16 compensations
// (OptimizerOptions::compensated_weights), BF16 bit patterns of shape [numel]; the
// "__metadata__" entries, every value a string (JSON where structured):
//   format "stepfuse-optimizer", format_version "3", optimizer (the kind's name, or
//   "custom"), step_count, num_groups; per group g: group.<g>.program (the program
//   variant's name), group.<g>.hyperparameters (built-ins: a JSON object of every field
//   by PyTorch name, numbers in their shortest exact form, flags as JSON booleans),
//   group.<g>.step_count (the steps the group has applied), group.<g>.num_params,
//   group.<g>.params (a JSON array of {"numel", "weight_dtype", "grad_dtype", "master",
//   "compensation"}; a file without "compensation", written before it, has none);
//   custom programs: update_program (the program's text) and scalar_rules (a JSON array
//   of {"name", "rule", "a", "b", "c"} in the program's scalar order); grad_scaler (a
//   JSON object: GradScaler::state_dict()) or loss_scale_optimizer (a JSON object:
//   dynamic, loss_scale, dynamic_growth_steps, dynamic_counter) when saved with one;
//   checksum (safetensors.hpp). A sharded optimizer's file (one per rank) adds shard (a
//   JSON object: rank, ranks, tensors — the model's tensor count) and, in each
//   group.<g>.params entry, tensor, offset and tensor_numel: where the param lies in the
//   model. Optimizer::load_shards reads a set of such files saved with any cut of the
//   model into this optimizer's cut (the section "sharded checkpoints" below).
//
// Versions 1 and 2: section "OPTM" (one optimizer):
//   str optimizer name, str update program, u32 #fields, (str name, f64 value)*,
//   i64 step count, i64 #params, per param (i64 numel, u8 weight dtype,
//   u8 grad dtype, u8 has master), u32 #state tensors, str name*, then per param:
//   each state tensor's numel floats, then the master's numel floats if it has one.
//   They hold no compensations: an optimizer that keeps them cannot load these files.
// Custom update programs wrote "custom" as the optimizer name and no fields, and
// section "UPRG": str program text (to_string(Program)), u32 #scalars, per scalar
// (str name, u8 rule kind, f64 a, f64 b), in the program's scalar order.
// Section "GSCL": u32 #entries, (str key, f64 value)* — GradScaler::state_dict().
// Section "LSOP": u8 dynamic, f64 loss scale, i64 growth steps, i64 counter.
//
// Every load checks the whole file and everything in it against the optimizer before
// it changes anything, then commits all of it.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <vector>

// Header-only, as in runtime/safetensors.cpp: nothing to link.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "jit/base/format.hpp"
#include "jit/builtins.hpp"
#include "jit/config_fields.hpp"
#include "jit/step_scalars.h"
#include "jit/step_stage.h"
#include "jit/update_program_rules.hpp"
#include "runtime/checkpoint_file.hpp"
#include "runtime/cpu/host_buffers.hpp"
#include "runtime/cpu/q8.hpp"
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
// A group's NAdam mu_product offset (StepEngine::product_offset), where it is not 0.
constexpr std::string_view kProductOffset = "mu_product_offset";

// A double's shortest text that reads back bit for bit with from_chars ("-inf" included).
std::string shortest(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

[[noreturn]] void mismatch(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::invalid_argument, "checkpoint '" + path + "' does not fit this optimizer: " + what);
}
[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw Error(ErrorCode::io_error, "checkpoint '" + path + "' is corrupt: " + what);
}

// A group's saved NAdam product offset (`steps` applied under `config`, null for a custom
// program): 0, or for NAdam finite or -inf with a product in [0, 1]; else the file is corrupt.
void check_product_offset(const std::string& path, std::size_t g, const OptimizerConfig* config, std::int64_t steps,
                          double d) {
  if (d == 0.0) return;
  const auto* c = config != nullptr ? std::get_if<optim::NAdam>(config) : nullptr;
  double product = 2.0;  // (not NAdam: no offset belongs there)
  if (c != nullptr && !std::isnan(d) && d != std::numeric_limits<double>::infinity())
    product = c->beta1 > 0.0 ? sf_nadam_mu_product(c->beta1, c->momentum_decay, steps, d) : sf_exp(d);
  if (!(product >= 0.0 && product <= 1.0))
    corrupt(path, "group " + std::to_string(g) + "'s " + std::string(kProductOffset) + " " + shortest(d) +
                      (c != nullptr ? " gives NAdam a mu_product outside [0, 1]" : " belongs to no NAdam group"));
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

// A q8 stream's absmaxes: "<stream>.absmax", one F32 per block of kQ8Block elements.
std::string absmax_name(std::string_view stream) { return std::string(stream) + ".absmax"; }
using cpu::q8_blocks;

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

// Where a param lies in the model: elements [offset, offset + numel) of the model's
// tensor `tensor`, which has tensor_numel elements.
struct Placement {
  std::int64_t tensor = 0, offset = 0, tensor_numel = 0;
};

// The model an optimizer's params are part of: a sharded optimizer's (its Shard's
// tensors, by the ids the ranks gave them), or, unsharded, its params as model
// tensors 0, 1, ... in params() order. `params`: where each param lies.
struct ModelView {
  std::vector<detail::Shard::ModelTensor> tensors;  // in id order
  std::vector<Placement> params;
  bool sharded = false;
};

ModelView model_view(const detail::StepEngine& e) {
  ModelView v;
  const std::vector<Param>& params = e.params();
  const detail::Shard* shard = e.shard();
  v.sharded = shard != nullptr;
  if (shard != nullptr) v.tensors = shard->tensors();
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (shard != nullptr) {
      v.params.push_back({shard->tensor_of(p).id, shard->offset_of(p), shard->tensor_of(p).numel});
    } else {
      v.tensors.push_back({static_cast<std::int64_t>(p), params[p].weight.numel});
      v.params.push_back({static_cast<std::int64_t>(p), 0, params[p].weight.numel});
    }
  }
  return v;
}

// Everything a load restores, parsed and checked against the optimizer before anything
// is written.
struct ParsedOptimizer {
  std::vector<OptimizerConfig> configs;  // built-ins, per group
  std::optional<UpdateProgram> program;  // custom programs: the saved scalar rules
  std::int64_t step_count = 0;
  std::vector<std::int64_t> step_bases;  // per group
  std::vector<double> product_offsets;   // per group (StepEngine::product_offset); none: all 0
  std::vector<std::pair<void*, std::span<const unsigned char>>> copies;  // destination, source bytes
  // State saved in another format than this optimizer stores it (LoadOptions::convert_state).
  struct Conversion {
    detail::StateSlot to;
    std::size_t to_at = 0;  // the first element written (a multiple of kQ8Block)
    std::size_t numel = 0;
    StateFormat from = StateFormat::f32;
    const unsigned char* data = nullptr;    // as saved
    const unsigned char* absmax = nullptr;  // q8: as saved
    bool nonnegative = false;               // q8: saved with the unsigned code (the stream's StateValues)
  };
  std::vector<Conversion> conversions;
};

// The values a saved stream holds (its bytes may be unaligned in the file).
std::vector<float> saved_values(const ParsedOptimizer::Conversion& c) {
  std::vector<float> out(c.numel);
  if (c.from == StateFormat::f32) {
    std::memcpy(out.data(), c.data, c.numel * sizeof(float));
    return out;
  }
  std::vector<unsigned char> bytes(c.data, c.data + c.numel * (c.from == StateFormat::bf16 ? 2 : 1));
  std::vector<float> absmax(c.from == StateFormat::q8 ? q8_blocks(c.numel) : 0);
  if (!absmax.empty()) std::memcpy(absmax.data(), c.absmax, absmax.size() * sizeof(float));
  cpu::HostBuffers::decode({c.from, bytes.data(), absmax.data(), c.nonnegative}, 0, c.numel, out.data());
  return out;
}

void commit_optimizer(detail::StepEngine& e, const ParsedOptimizer& p) {
  if (p.program) {
    e.set_custom_rules(*p.program);  // checked while parsing
  } else {
    for (std::size_t g = 0; g < p.configs.size(); ++g) e.set_config(g, p.configs[g]);  // checked while parsing
  }
  for (const auto& [dst, src] : p.copies)
    if (!src.empty()) std::memcpy(dst, src.data(), src.size());
  for (const ParsedOptimizer::Conversion& c : p.conversions) {
    const std::vector<float> values = saved_values(c);
    if (c.to.format == StateFormat::f32) std::copy(values.begin(), values.end(), static_cast<float*>(c.to.data) + c.to_at);
    else cpu::HostBuffers::encode(values.data(), c.to, c.to_at, c.numel);
  }
  e.set_steps(p.step_count, p.step_bases);
  // (after set_config, which computes an offset from the steps before the load)
  for (std::size_t g = 0; g < e.num_groups(); ++g)
    e.set_product_offset(g, g < p.product_offsets.size() ? p.product_offsets[g] : 0.0);
}

// What a param keeps beside its weight: an fp32 master, a bf16 compensation, or neither
// (never both: they are options of one optimizer).
struct Kept {
  bool master = false, compensation = false;
};
Kept kept_here(const detail::StepEngine& e, std::size_t p) {
  return {e.master_data(p) != nullptr, e.compensation_data(p) != nullptr};
}

// "" when a saved param kept what this optimizer's param keeps; else what differs, and
// the option that makes it differ.
std::string kept_difference(Kept saved, Kept here) {
  const auto what = [](Kept k) { return k.master ? "an fp32 master" : "a bf16 compensation"; };
  const bool saved_any = saved.master || saved.compensation, here_any = here.master || here.compensation;
  if (saved.master == here.master && saved.compensation == here.compensation) return "";
  if (saved_any && here_any)
    return std::string("saved with ") + what(saved) + ", this optimizer keeps " + what(here) +
           " instead (OptimizerOptions::master_weights and compensated_weights differ)";
  const Kept k = saved_any ? saved : here;
  return std::string(saved_any ? "saved with " : "saved without ") + what(k) + ", this optimizer keeps " +
         (saved_any ? "none" : "one") + " (OptimizerOptions::" + (k.master ? "master_weights" : "compensated_weights") +
         " differs)";
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

// The listing without the marks of stream values ("(nonnegative)", "(full precision)"),
// which files written before state formats existed do not have.
std::string without_stream_values(std::string text) {
  for (const std::string_view mark : {" (nonnegative)", " (full precision)"})
    for (std::size_t at; (at = text.find(mark)) != std::string::npos;) text.erase(at, mark.size());
  return text;
}

void check_program_text(const std::string& path, const std::string& saved, const UpdateProgram& current) {
  std::string here = to_string(current.program());
  // A file from before the marks held f32 state only, where they change no bits.
  if (saved.find(" (nonnegative)") == std::string::npos && saved.find(" (full precision)") == std::string::npos)
    here = without_stream_values(here);
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
// its initial_scale: finite and above 2^-128 as the fp32 it is kept in (1e39 would become
// inf, 1e-46 zero) and steps with (its fp32 reciprocal must be finite).
float checked_loss_scale(const std::string& path, double scale) {
  if (!std::isfinite(static_cast<float>(scale)) || sf_unscalable(static_cast<float>(scale)))
    corrupt(path, "its loss scale " + detail::format_number(scale) +
                      " is not a finite value above 2^-128 within the fp32 range");
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
  const detail::Shard* shard = e.shard();
  const ModelView model = shard ? model_view(e) : ModelView{};
  std::vector<detail::SafetensorsSource> two_byte, one_byte;  // BF16 (compensations, bf16 state), U8 (q8 codes)
  if (shard != nullptr)
    m["shard"] = "{\"rank\":" + std::to_string(shard->communicator().rank()) + ",\"ranks\":" +
                 std::to_string(shard->communicator().size()) + ",\"tensors\":" + std::to_string(model.tensors.size()) + "}";
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
    // NAdam's mu_product offset, where beta1 or momentum_decay changed (older files, and
    // files without it, load it as 0): the shortest text that reads back bit for bit.
    if (const double offset = e.product_offset(g); offset != 0.0) m[group_key(g, kProductOffset)] = shortest(offset);
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
              (e.master_data(p) != nullptr ? "true" : "false") + ",\"compensation\":" +
              (e.compensation_data(p) != nullptr ? "true" : "false");
      std::string formats;  // the streams not stored as f32 (none: the key is left out, as older files have it)
      for (std::string_view s : streams) {
        const StateFormat f = e.state_slot(p, e.state_stream(s)).format;
        if (f == StateFormat::f32) continue;
        formats += formats.empty() ? "{" : ",";
        detail::append_json_string(formats, s);
        formats += ":\"" + std::string(state_format_name(f)) + "\"";
      }
      if (!formats.empty()) list += ",\"state_formats\":" + formats + "}";
      if (shard != nullptr) {
        const Placement& at = model.params[p];
        list += ",\"tensor\":" + std::to_string(at.tensor) + ",\"offset\":" + std::to_string(at.offset) +
                ",\"tensor_numel\":" + std::to_string(at.tensor_numel);
      }
      list += '}';
      for (std::string_view s : streams) {
        const detail::StateSlot slot = e.state_slot(p, e.state_stream(s));
        if (slot.format == StateFormat::f32) d.tensors.push_back({tensor_name(g, i, s), slot.data, numel});
        if (slot.format == StateFormat::bf16) two_byte.push_back({tensor_name(g, i, s), slot.data, numel, "BF16"});
        if (slot.format == StateFormat::q8) {
          one_byte.push_back({tensor_name(g, i, s), slot.data, numel, "U8"});
          d.tensors.push_back({tensor_name(g, i, absmax_name(s)), slot.absmax, q8_blocks(numel)});
        }
      }
      if (const float* master = e.master_data(p)) d.tensors.push_back({tensor_name(g, i, "master"), master, numel});
      if (const std::uint16_t* c = e.compensation_data(p))
        two_byte.push_back({tensor_name(g, i, "compensation"), c, numel, "BF16"});
    }
    m[group_key(g, "params")] = list + "]";
  }
  // Last: 2 and 1 bytes an element, they would leave the tensors after them unaligned.
  d.tensors.insert(d.tensors.end(), two_byte.begin(), two_byte.end());
  d.tensors.insert(d.tensors.end(), one_byte.begin(), one_byte.end());
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
  // A double written by shortest() ("-inf" included), or 0 when the key is absent.
  double real_or_zero(std::string_view key) const {
    const std::string* v = f_.meta(key);
    if (v == nullptr) return 0.0;
    double d = 0.0;
    const auto r = std::from_chars(v->data(), v->data() + v->size(), d);
    if (r.ec != std::errc{} || r.ptr != v->data() + v->size() || d != d)
      corrupt(path(), "its metadata \"" + std::string(key) + "\" is not a number");
    return d;
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
  // A member added to the format later: false where absent (a file written before it).
  bool boolean_or_false(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    return v.find(member) != nullptr && boolean(v, key, member);
  }
  std::uint64_t uint(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    const detail::JsonValue* m = v.find(member);
    const auto n = m ? detail::json_uint(*m) : std::nullopt;
    if (!n) bad_member(key, member, "a non-negative integer");
    return *n;
  }
  std::int64_t int64(const detail::JsonValue& v, std::string_view key, std::string_view member) const {
    const detail::JsonValue* m = v.find(member);
    std::int64_t n = 0;
    if (m == nullptr || m->kind != detail::JsonValue::Kind::number) bad_member(key, member, "an integer");
    const auto r = std::from_chars(m->text.data(), m->text.data() + m->text.size(), n);
    if (r.ec != std::errc{} || r.ptr != m->text.data() + m->text.size()) bad_member(key, member, "an integer");
    return n;
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

// A custom program's saved scalar rules, in the file's order.
std::vector<ScalarDef> read_scalar_rules(const MetadataReader& meta) {
  std::vector<ScalarDef> defs;
  const detail::JsonValue rules = meta.json("scalar_rules", detail::JsonValue::Kind::array);
  for (const detail::JsonValue& r : rules.items) {
    ScalarDef d;
    d.name = meta.string(r, "scalar_rules", "name");
    const std::string& rule = meta.string(r, "scalar_rules", "rule");
    const auto k = rule_kind(rule);
    if (!k) corrupt(meta.path(), "its scalar rule '" + rule + "' is not one this build knows");
    d.rule.kind = *k;
    d.rule.a = meta.number(r, "scalar_rules", "a");
    d.rule.b = meta.number(r, "scalar_rules", "b");
    d.rule.c = meta.number(r, "scalar_rules", "c");
    defs.push_back(std::move(d));
  }
  return defs;
}

// `config` (of the optimizer's kind) with every field set from `fields`, the JSON
// object of the metadata entry `key`; not yet checked (StepEngine::check_config).
OptimizerConfig read_config(const MetadataReader& meta, const std::string& key, const detail::JsonValue& fields,
                            OptimizerConfig config, const std::string& in_group) {
  std::visit(
      [&](auto& c) {
        jit::for_each_field(c, [&](std::string_view name, auto& v) {
          if (fields.find(name) == nullptr)
            mismatch(meta.path(), in_group + "hyperparameter '" + std::string(name) + "' is missing");
          if constexpr (std::is_same_v<std::remove_reference_t<decltype(v)>, bool>)
            v = meta.boolean(fields, key, name);
          else
            v = meta.number(fields, key, name);
        });
      },
      config);
  return config;
}

// Error(invalid_argument) unless the file holds this optimizer's kind (or a custom program).
void check_kind(const detail::SafetensorsFile& f, const detail::StepEngine& e) {
  const std::string& kind = MetadataReader(f).text("optimizer");
  if (kind != (e.custom_program() ? kCustomKind : optimizer_name(e.config()))) {
    const std::string* name = f.meta(group_key(0, "program"));
    mismatch(f.path(), "it holds " +
                           (kind == kCustomKind ? "a custom update program '" + (name ? *name : std::string("?")) + "'"
                                                : "the state of " + kind) +
                           ", this one is " + kind_of(e));
  }
}

// Whether the optimizer's stream `s` is non-negative: q8 stores it with the unsigned code.
bool nonnegative(const detail::StepEngine& e, std::string_view s) {
  return e.programs().state_values[static_cast<std::size_t>(e.state_stream(s))] == StateValues::nonnegative;
}

bool parse_state_format(std::string_view text, StateFormat& out) {
  for (StateFormat f : {StateFormat::f32, StateFormat::bf16, StateFormat::q8})
    if (text == state_format_name(f)) {
      out = f;
      return true;
    }
  return false;
}

// A params entry's "state_formats": the streams saved in another format than f32
// (absent: every stream f32, as files written before the formats existed).
std::map<std::string, StateFormat, std::less<>> read_state_formats(const detail::JsonValue& entry, const std::string& path,
                                                                   const std::string& at) {
  std::map<std::string, StateFormat, std::less<>> out;
  const detail::JsonValue* formats = entry.find("state_formats");
  if (formats == nullptr) return out;
  if (formats->kind != detail::JsonValue::Kind::object) corrupt(path, at + "\"state_formats\" is not an object");
  for (const detail::JsonMember& m : formats->members) {
    StateFormat f = StateFormat::f32;
    if (m.second.kind != detail::JsonValue::Kind::string || !parse_state_format(m.second.text, f))
      corrupt(path, at + "state '" + m.first + "' has an unknown format (not \"f32\", \"bf16\" or \"q8\")");
    out[m.first] = f;
  }
  return out;
}
StateFormat saved_format(const std::map<std::string, StateFormat, std::less<>>& formats, std::string_view stream) {
  const auto it = formats.find(stream);
  return it == formats.end() ? StateFormat::f32 : it->second;
}

// The safetensors dtype a state stream is saved as.
std::string_view saved_dtype(StateFormat f) { return f == StateFormat::f32 ? "F32" : f == StateFormat::bf16 ? "BF16" : "U8"; }

// Which elements of a saved stream go where: saved elements [src, src + n) to this
// param's elements [dst, dst + n) (src and dst multiples of kQ8Block); none when
// the saved piece does not overlap the param (its tensors are still checked).
struct StateRange {
  std::size_t src = 0, dst = 0, n = 0;
  bool overlaps = true;
};

// One saved state stream of param p, `saved_numel` elements saved in format `from`:
// `range` of it copied as stored when this optimizer stores it so, converted when
// asked (LoadOptions::convert_state), else a mismatch (`at` says where). find(what,
// dtype, numel) checks and returns a saved tensor's bytes.
template <class Find>
void take_state(ParsedOptimizer& out, const detail::StepEngine& e, std::size_t p, std::string_view s, StateFormat from,
                std::uint64_t saved_numel, const StateRange& range, bool convert, const std::string& path,
                const std::string& at, const Find& find) {
  const std::span<const unsigned char> data = find(s, saved_dtype(from), saved_numel);
  const std::span<const unsigned char> absmax =
      from == StateFormat::q8 ? find(absmax_name(s), "F32", q8_blocks(saved_numel)) : std::span<const unsigned char>{};
  if (!range.overlaps) return;
  const detail::StateSlot here = e.state_slot(p, e.state_stream(s));
  const std::size_t size = state_format_size(from);
  const unsigned char* blocks = absmax.empty() ? nullptr : absmax.data() + range.src / cpu::kQ8Block * sizeof(float);
  if (from == here.format) {
    out.copies.emplace_back(static_cast<unsigned char*>(here.data) + range.dst * size,
                            data.subspan(range.src * size, range.n * size));
    if (from == StateFormat::q8)
      out.copies.emplace_back(here.absmax + range.dst / cpu::kQ8Block,
                              std::span<const unsigned char>(blocks, q8_blocks(range.n) * sizeof(float)));
    return;
  }
  if (!convert)
    mismatch(path, at + "state '" + std::string(s) + "' was saved as " + std::string(state_format_name(from)) +
                       ", this optimizer stores it as " + std::string(state_format_name(here.format)) +
                       " (OptimizerOptions::state_format, state_formats, min_q8_numel or the group's state_format differ; load "
                       "with LoadOptions::convert_state to convert it)");
  out.conversions.push_back({here, range.dst, range.n, from, data.data() + range.src * size, blocks, nonnegative(e, s)});
}

ParsedOptimizer parse_v3(const detail::SafetensorsFile& f, const detail::StepEngine& e, bool convert) {
  const std::string& path = f.path();
  const MetadataReader meta(f);
  const UpdateProgram* custom = e.custom_program();
  ParsedOptimizer out;

  check_kind(f, e);
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
    out.program = with_saved_rules(path, *custom, read_scalar_rules(meta));
  }
  out.step_count = meta.integer("step_count");

  const std::vector<Param>& params = e.params();
  // A shard file loaded by a sharded optimizer: each param must lie where it lay.
  const bool placed = e.shard() != nullptr && f.meta("shard") != nullptr;
  const ModelView model = placed ? model_view(e) : ModelView{};
  std::size_t tensors = 0;
  for (std::size_t g = 0; g < e.num_groups(); ++g) {
    const Program& program = e.program(g);
    const std::string in_group = one_group ? "" : "group " + std::to_string(g) + ": ";
    if (custom == nullptr) {
      const std::string key = group_key(g, "hyperparameters");
      const OptimizerConfig config =
          read_config(meta, key, meta.json(key, detail::JsonValue::Kind::object), e.config(g), in_group);
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
    out.product_offsets.push_back(meta.real_or_zero(group_key(g, kProductOffset)));
    check_product_offset(path, g, custom == nullptr ? &out.configs.back() : nullptr, group_steps,
                         out.product_offsets.back());

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
      const Kept kept{meta.boolean(entry, params_key, "master"), meta.boolean_or_false(entry, params_key, "compensation")};
      if (kept.master && kept.compensation) corrupt(path, at + "listed with both an fp32 master and a bf16 compensation");
      const auto numel_here = static_cast<std::uint64_t>(params[p].weight.numel);
      if (numel != numel_here)
        mismatch(path, at + std::to_string(numel) + " elements saved, " + std::to_string(numel_here) + " here");
      const std::string_view w_here = dtype_name(params[p].weight.dtype), g_here = dtype_name(params[p].grad.dtype);
      if (w != w_here || gr != g_here)
        mismatch(path, at + "saved with weight/grad dtypes " + w + "/" + gr + ", here " + std::string(w_here) + "/" +
                           std::string(g_here));
      if (const std::string d = kept_difference(kept, kept_here(e, p)); !d.empty()) mismatch(path, at + d);
      if (placed) {
        const Placement& here_at = model.params[p];
        const std::int64_t tensor = meta.int64(entry, params_key, "tensor"), offset = meta.int64(entry, params_key, "offset");
        if (tensor != here_at.tensor || offset != here_at.offset)
          mismatch(path, at + "saved as elements [" + std::to_string(offset) + ", " + std::to_string(offset + static_cast<std::int64_t>(numel)) +
                             ") of model tensor " + std::to_string(tensor) + ", here elements [" + std::to_string(here_at.offset) +
                             ", " + std::to_string(here_at.offset + static_cast<std::int64_t>(numel)) + ") of model tensor " +
                             std::to_string(here_at.tensor) +
                             " (the ranks cut the model differently: load the whole set of shard files with load_shards)");
      }
      // dtype: F32, BF16 (a compensation, bf16 state: bit patterns) or U8 (q8 codes), copied as they are.
      const auto find = [&](std::string_view what, std::string_view dtype, std::uint64_t n) {
        const std::string name = tensor_name(g, i, what);
        const detail::SafetensorsTensor* t = f.find(name);
        if (t == nullptr) corrupt(path, "tensor '" + name + "' is missing");
        if (t->dtype != dtype || t->shape.size() != 1 || t->shape[0] != n)
          corrupt(path, "tensor '" + name + "' is not " + std::string(dtype) + " of shape [" + std::to_string(n) + "]");
        ++tensors;
        return f.data(*t);
      };
      const auto take = [&](std::string_view what, void* dst, std::string_view dtype) {
        out.copies.emplace_back(dst, find(what, dtype, numel));
      };
      const auto saved_formats = read_state_formats(entry, path, at);
      const StateRange whole{0, 0, static_cast<std::size_t>(numel)};
      for (std::string_view s : streams)
        take_state(out, e, p, s, saved_format(saved_formats, s), numel, whole, convert, path, at, find);
      if (float* m = e.master_data(p)) take("master", m, "F32");
      if (std::uint16_t* c = e.compensation_data(p)) take("compensation", c, "BF16");
    }
  }
  if (tensors != f.tensors().size()) {
    std::set<std::string> known;
    for (std::size_t g = 0; g < e.num_groups(); ++g)
      for (std::size_t i = 0; i < e.group_end(g) - e.group_begin(g); ++i) {
        for (std::string_view s : state_streams(e.program(g))) {
          known.insert(tensor_name(g, i, s));
          known.insert(tensor_name(g, i, absmax_name(s)));
        }
        known.insert(tensor_name(g, i, "master"));
        known.insert(tensor_name(g, i, "compensation"));
      }
    for (const detail::SafetensorsTensor& t : f.tensors())
      if (known.count(t.name) == 0) corrupt(path, "it holds tensor '" + t.name + "', which is none of this optimizer's");
  }
  return out;
}

// ---- format versions 1 and 2: reading ----

ParsedOptimizer parse_container(const detail::CheckpointFile& file, const detail::StepEngine& e, bool convert) {
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
    mismatch(path, "it holds " + (kind == kCustomKind ? "a custom update program '" + program + "'" : "the state of " + kind) +
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
    if (e.compensation_data(i) != nullptr)
      mismatch(path, at + "this optimizer keeps a bf16 compensation (OptimizerOptions::compensated_weights), which a format-" +
                         std::to_string(file.version()) + " checkpoint does not hold (only format " +
                         std::to_string(detail::kCheckpointFormat) + " does)");
    if (const std::string d = kept_difference({has_master[i], false}, kept_here(e, i)); !d.empty()) mismatch(path, at + d);
  }
  const std::vector<std::string_view> streams = state_streams(e.program());
  if (r.u32() != streams.size()) mismatch(path, "it holds a different number of state tensors");
  for (std::string_view s : streams)
    if (r.str() != s) mismatch(path, "its state tensors differ from this optimizer's");
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto bytes = static_cast<std::size_t>(params[i].weight.numel) * sizeof(float);
    const std::string at = "params[" + std::to_string(i) + "]: ";
    for (std::string_view s : streams) {
      const std::span<const unsigned char> saved = r.bytes(bytes);
      const auto n = static_cast<std::uint64_t>(params[i].weight.numel);
      take_state(out, e, i, s, StateFormat::f32, n, StateRange{0, 0, static_cast<std::size_t>(n)}, convert, path, at,
                 [&](std::string_view, std::string_view, std::uint64_t) { return saved; });
    }
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

// verify: check the checksum now (load_shards checks it only for the files it takes data from).
OpenedCheckpoint open_checkpoint(const std::string& path, bool verify = true) {
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
  if (verify) f.verify_checksum();
  out.file.emplace(std::move(f));
  return out;
}

ParsedOptimizer parse_optimizer(const OpenedCheckpoint& c, const detail::StepEngine& e, bool convert = false) {
  return c.container ? parse_container(*c.container, e, convert) : parse_v3(*c.file, e, convert);
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

// ---- sharded checkpoints: load_shards ----

// One param of a file in the set: group.<group>.param.<index>, where it lies in the model.
struct SavedParam {
  std::size_t file = 0;
  std::size_t group = 0, index = 0;
  Placement at;
  std::int64_t numel = 0;
  std::string weight_dtype, grad_dtype;
  Kept kept;
  std::map<std::string, StateFormat, std::less<>> formats;  // streams saved as bf16 or q8
  std::int64_t end() const { return at.offset + numel; }
};

// A file of the set, its metadata read and checked on its own. A file without
// "shard" metadata (saved unsharded) is rank 0 of 1, its params model tensors 0, 1, ...
struct SetFile {
  explicit SetFile(OpenedCheckpoint opened) : c(std::move(opened)) {}
  OpenedCheckpoint c;
  std::int64_t rank = 0, ranks = 1;
  std::int64_t tensors = -1;  // the model's tensor count ("shard" metadata), or -1
  std::int64_t step_count = 0;
  std::vector<std::string> programs;               // per group
  std::vector<std::int64_t> group_steps;           // per group
  std::vector<double> product_offsets;             // per group
  std::vector<detail::JsonValue> hyperparameters;  // per group (built-ins)
  std::vector<ScalarDef> rules;                    // custom programs
  bool used = false;                               // this rank takes data from it
  const std::string& path() const { return c.file->path(); }
};

[[noreturn]] void set_error(const std::string& what) {
  throw Error(ErrorCode::invalid_argument, "load_shards: " + what);
}
std::string quoted(const std::string& path) { return "'" + path + "'"; }
std::string range(std::int64_t begin, std::int64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}
constexpr std::int64_t kMaxElements = std::int64_t{1} << 56;  // bounds a file's numbers far from overflow

SetFile read_set_file(const std::string& path, std::size_t index, const detail::StepEngine& e,
                      std::vector<SavedParam>& out) {
  SetFile s{open_checkpoint(path, /*verify=*/false)};
  if (s.c.container)
    mismatch(path, "it is a format-" + std::to_string(s.c.container->version()) +
                       " checkpoint, which says nothing of where its params lie in a model; load_shards reads files "
                       "of format version " + std::to_string(detail::kCheckpointFormat) + " (load it with load())");
  const detail::SafetensorsFile& f = *s.c.file;
  const MetadataReader meta(f);
  check_kind(f, e);
  if (const UpdateProgram* custom = e.custom_program()) {
    check_program_text(path, meta.text("update_program"), *custom);
    s.rules = read_scalar_rules(meta);
  }
  s.step_count = meta.integer("step_count");
  const std::int64_t groups = meta.integer("num_groups");
  if (groups < 1) corrupt(path, "it has no param groups");
  const bool sharded = f.meta("shard") != nullptr;
  if (sharded) {
    const detail::JsonValue v = meta.json("shard", detail::JsonValue::Kind::object);
    s.rank = meta.int64(v, "shard", "rank");
    s.ranks = meta.int64(v, "shard", "ranks");
    s.tensors = meta.int64(v, "shard", "tensors");
    if (s.ranks < 1 || s.rank < 0 || s.rank >= s.ranks || s.tensors < 0)
      corrupt(path, "its metadata \"shard\" says rank " + std::to_string(s.rank) + " of " + std::to_string(s.ranks) +
                        ", " + std::to_string(s.tensors) + " tensors");
  }
  std::int64_t flat = 0;  // an unsharded file's param index: its model tensor
  for (std::size_t g = 0; g < static_cast<std::size_t>(groups); ++g) {
    s.programs.push_back(meta.text(group_key(g, "program")));
    s.group_steps.push_back(meta.integer(group_key(g, "step_count")));
    s.product_offsets.push_back(meta.real_or_zero(group_key(g, kProductOffset)));
    if (s.group_steps.back() > s.step_count)
      corrupt(path, "group " + std::to_string(g) + " has applied " + std::to_string(s.group_steps.back()) +
                        " steps, more than the optimizer's " + std::to_string(s.step_count));
    if (e.custom_program() == nullptr)
      s.hyperparameters.push_back(meta.json(group_key(g, "hyperparameters"), detail::JsonValue::Kind::object));
    const std::string key = group_key(g, "params");
    const std::int64_t saved = meta.integer(group_key(g, "num_params"));
    const detail::JsonValue list = meta.json(key, detail::JsonValue::Kind::array);
    if (list.items.size() != static_cast<std::uint64_t>(saved))
      corrupt(path, "group " + std::to_string(g) + " lists " + std::to_string(list.items.size()) + " params, not " +
                        std::to_string(saved));
    for (std::size_t i = 0; i < list.items.size(); ++i, ++flat) {
      const detail::JsonValue& entry = list.items[i];
      SavedParam p;
      p.file = index;
      p.group = g;
      p.index = i;
      const std::uint64_t numel = meta.uint(entry, key, "numel");
      if (numel > static_cast<std::uint64_t>(kMaxElements)) corrupt(path, "a param of " + std::to_string(numel) + " elements");
      p.numel = static_cast<std::int64_t>(numel);
      p.weight_dtype = meta.string(entry, key, "weight_dtype");
      p.grad_dtype = meta.string(entry, key, "grad_dtype");
      p.kept = {meta.boolean(entry, key, "master"), meta.boolean_or_false(entry, key, "compensation")};
      if (p.kept.master && p.kept.compensation)
        corrupt(path, "group " + std::to_string(g) + " param " + std::to_string(i) +
                          " has both an fp32 master and a bf16 compensation");
      p.formats = read_state_formats(entry, path, "group " + std::to_string(g) + " param " + std::to_string(i) + ": ");
      if (sharded) {
        p.at = {meta.int64(entry, key, "tensor"), meta.int64(entry, key, "offset"), meta.int64(entry, key, "tensor_numel")};
        if (p.at.offset < 0 || p.at.tensor_numel > kMaxElements || p.end() > p.at.tensor_numel)
          corrupt(path, "group " + std::to_string(g) + " param " + std::to_string(i) + " lies at elements " +
                            range(p.at.offset, p.end()) + " of a model tensor of " + std::to_string(p.at.tensor_numel));
      } else {
        p.at = {flat, 0, p.numel};
      }
      out.push_back(std::move(p));
    }
  }
  return s;
}

std::string where_saved(const SetFile& f, const SavedParam& p) {
  return quoted(f.path()) + " (group " + std::to_string(p.group) + " param " + std::to_string(p.index) + ", elements " +
         range(p.at.offset, p.end()) + ")";
}

// The checks of the set as a whole (its metadata only; the same on every rank): one
// save's files, every rank's once, at one step, whose params tile exactly the model
// this optimizer is part of. `pieces` comes back ordered by (tensor, offset).
void check_set(const std::vector<SetFile>& files, std::vector<SavedParam>& pieces, const ModelView& model) {
  const SetFile& first = files[0];
  std::map<std::int64_t, std::size_t> by_rank;
  for (std::size_t k = 0; k < files.size(); ++k) {
    const SetFile& f = files[k];
    if (f.ranks != first.ranks || f.tensors != first.tensors)
      set_error(quoted(first.path()) + " is rank " + std::to_string(first.rank) + "'s shard of a checkpoint saved by " +
                std::to_string(first.ranks) + " rank" + (first.ranks == 1 ? "" : "s") + " (" +
                (first.tensors < 0 ? std::string("unsharded") : std::to_string(first.tensors) + " model tensors") + "), " +
                quoted(f.path()) + " rank " + std::to_string(f.rank) + "'s of " + std::to_string(f.ranks) + " (" +
                (f.tensors < 0 ? std::string("unsharded") : std::to_string(f.tensors) + " model tensors") +
                "): the files are not the shards of one checkpoint");
    const auto [it, fresh] = by_rank.emplace(f.rank, k);
    if (!fresh)
      set_error(quoted(files[it->second].path()) + " and " + quoted(f.path()) + " are both rank " + std::to_string(f.rank) +
                "'s shard (each rank's file must be given once)");
    if (f.step_count != first.step_count)
      set_error(quoted(first.path()) + " was saved after " + std::to_string(first.step_count) + " steps, " +
                quoted(f.path()) + " after " + std::to_string(f.step_count) +
                ": the files are not the shards of one checkpoint");
    if (f.rules != first.rules)
      set_error(quoted(first.path()) + " and " + quoted(f.path()) + " hold different scalar rules");
  }
  if (static_cast<std::int64_t>(files.size()) != first.ranks) {
    std::int64_t missing = 0;
    while (by_rank.count(missing) != 0) ++missing;
    set_error("the files are shards of a checkpoint saved by " + std::to_string(first.ranks) + " ranks, but none is rank " +
              std::to_string(missing) + "'s (" + std::to_string(files.size()) + " of " + std::to_string(first.ranks) +
              " given): every rank's file must be in the list");
  }

  std::stable_sort(pieces.begin(), pieces.end(), [](const SavedParam& a, const SavedParam& b) {
    return a.at.tensor != b.at.tensor ? a.at.tensor < b.at.tensor : a.at.offset < b.at.offset;
  });
  std::size_t distinct = 0;
  auto here = model.tensors.begin();
  for (std::size_t k = 0; k < pieces.size();) {
    const std::int64_t t = pieces[k].at.tensor, numel = pieces[k].at.tensor_numel;
    const std::string tensor = "model tensor " + std::to_string(t);
    ++distinct;
    // The pieces of tensor t: [k, next).
    std::int64_t covered = 0;  // [0, covered) is covered
    const SavedParam* last = nullptr;  // the piece that reaches `covered`
    std::size_t next = k;
    for (; next < pieces.size() && pieces[next].at.tensor == t; ++next) {
      const SavedParam& p = pieces[next];
      const SetFile& f = files[p.file];
      if (p.at.tensor_numel != numel)
        set_error(tensor + " has " + std::to_string(numel) + " elements in " + quoted(files[pieces[k].file].path()) + " but " +
                  std::to_string(p.at.tensor_numel) + " in " + quoted(f.path()));
      if (p.at.offset > covered)
        set_error(tensor + ": elements " + range(covered, p.at.offset) + " are in none of the files (" +
                  (last ? "before them: " + where_saved(files[last->file], *last) + "; " : std::string()) +
                  "after them: " + where_saved(f, p) + ")");
      if (p.at.offset < covered && p.numel > 0)
        set_error(tensor + ": elements " + range(p.at.offset, std::min(covered, p.end())) + " are in two files: " +
                  where_saved(files[last->file], *last) + " and " + where_saved(f, p));
      if (p.end() >= covered) {
        covered = p.end();
        last = &p;
      }
    }
    if (covered < numel)
      set_error(tensor + ": elements " + range(covered, numel) + " are in none of the files (the last before them: " +
                where_saved(files[last->file], *last) + ")");
    // Against this optimizer's model.
    if (here != model.tensors.end() && here->id < t)
      set_error("model tensor " + std::to_string(here->id) + " (" + std::to_string(here->numel) +
                " elements) is in none of the files");
    if (here == model.tensors.end() || here->id != t)
      set_error(tensor + " (" + std::to_string(numel) + " elements, in " + quoted(files[pieces[k].file].path()) +
                ") is not one of this model's " + std::to_string(model.tensors.size()) + " tensors (" +
                (model.sharded ? std::string("the ids OptimizerOptions::slices gives, or without slices the ranks' params in order")
                               : "an unsharded optimizer's params are model tensors 0 to " +
                                     std::to_string(static_cast<std::int64_t>(model.tensors.size()) - 1) + ", in order") +
                ")");
    if (here->numel != numel)
      set_error(tensor + " has " + std::to_string(numel) + " elements in the files (" + quoted(files[pieces[k].file].path()) +
                "), " + std::to_string(here->numel) + " here");
    ++here;
    k = next;
  }
  if (here != model.tensors.end())
    set_error("model tensor " + std::to_string(here->id) + " (" + std::to_string(here->numel) +
              " elements) is in none of the files");
  if (first.tensors >= 0 && static_cast<std::int64_t>(distinct) != first.tensors)
    corrupt(first.path(), "its metadata says the model has " + std::to_string(first.tensors) + " tensors; the files hold " +
                              std::to_string(distinct));
}

// The first field in which two configs of one kind differ ("lr 0.01 vs 0.02"), or "".
std::string config_difference(const OptimizerConfig& a, const OptimizerConfig& b) {
  std::vector<std::pair<std::string_view, double>> fa, fb;
  const auto fields = [](const OptimizerConfig& c, std::vector<std::pair<std::string_view, double>>& out) {
    std::visit([&](const auto& x) { jit::for_each_field(x, [&](std::string_view n, const auto& v) { out.emplace_back(n, static_cast<double>(v)); }); }, c);
  };
  fields(a, fa);
  fields(b, fb);
  for (std::size_t i = 0; i < fa.size() && i < fb.size(); ++i)
    if (std::memcmp(&fa[i].second, &fb[i].second, sizeof(double)) != 0)
      return std::string(fa[i].first) + " " + detail::format_number(fa[i].second) + " vs " + detail::format_number(fb[i].second);
  return fa.size() == fb.size() ? std::string() : std::string("their fields");
}

// What this rank takes from the set: for each of its params, the state and master (or
// compensation) of the elements it covers, from the pieces that hold them; each group's
// hyperparameters and step count from the saved groups its elements come from (which
// must agree).
ParsedOptimizer take_shard(std::vector<SetFile>& files, const std::vector<SavedParam>& pieces, const ModelView& model,
                           const detail::StepEngine& e, bool convert) {
  ParsedOptimizer out;
  out.step_count = files[0].step_count;
  const UpdateProgram* custom = e.custom_program();
  if (custom != nullptr) out.program = with_saved_rules(files[0].path(), *custom, files[0].rules);
  const std::size_t groups = e.num_groups();
  const bool one_group = groups == 1;
  if (custom == nullptr) out.configs.resize(groups);
  std::vector<const SavedParam*> source(groups, nullptr);  // the saved param a group first took its metadata from
  std::vector<std::int64_t> group_steps(groups, 0);
  std::vector<double> offsets(groups, 0.0);
  std::set<std::tuple<std::size_t, std::size_t, std::size_t>> checked;  // (file, saved group, group) pairs seen
  const std::vector<Param>& params = e.params();
  for (std::size_t p = 0; p < params.size(); ++p) {
    const std::size_t g = e.group_of(p);
    const Placement& at = model.params[p];
    const std::int64_t numel = params[p].weight.numel, end = at.offset + numel;
    const std::string here = (one_group ? "params[" : "groups[" + std::to_string(g) + "].params[") +
                             std::to_string(p - e.group_begin(g)) + "] (elements " + range(at.offset, end) +
                             " of model tensor " + std::to_string(at.tensor) + ")";
    const auto lo = std::lower_bound(pieces.begin(), pieces.end(), at.tensor,
                                     [](const SavedParam& q, std::int64_t t) { return q.at.tensor < t; });
    for (auto it = lo; it != pieces.end() && it->at.tensor == at.tensor; ++it) {
      const SavedParam& q = *it;
      const bool overlaps = q.at.offset < end && at.offset < q.end();
      if (!overlaps && !(numel == 0 && it == lo)) continue;  // a param of no elements: its tensor's first piece
      SetFile& f = files[q.file];
      const std::string& path = f.path();
      const std::string saved = "group " + std::to_string(q.group) + " param " + std::to_string(q.index) + ", for " + here + ": ";
      const std::string_view program = e.program(g).name;
      if (f.programs[q.group] != program)
        mismatch(path, saved + "saved from update program '" + f.programs[q.group] + "', this one runs '" +
                           std::string(program) + (custom ? "'" : "' (amsgrad, nesterov, centered or momentum on/off differ)"));
      const std::string_view w = dtype_name(params[p].weight.dtype), gr = dtype_name(params[p].grad.dtype);
      if (q.weight_dtype != w || q.grad_dtype != gr)
        mismatch(path, saved + "saved with weight/grad dtypes " + q.weight_dtype + "/" + q.grad_dtype + ", here " +
                           std::string(w) + "/" + std::string(gr));
      if (const std::string d = kept_difference(q.kept, kept_here(e, p)); !d.empty()) mismatch(path, saved + d);
      if (checked.emplace(q.file, q.group, g).second) {
        const std::string group_here = one_group ? "this optimizer" : "this optimizer's group " + std::to_string(g);
        if (custom == nullptr) {
          const std::string key = group_key(q.group, "hyperparameters");
          const OptimizerConfig config = read_config(MetadataReader(*f.c.file), key, f.hyperparameters[q.group], e.config(g),
                                                     "group " + std::to_string(q.group) + ": ");
          try {
            e.check_config(g, config);
          } catch (const Error& err) {
            mismatch(path, "group " + std::to_string(q.group) + ": its hyperparameters are not valid for " + group_here +
                               ": " + err.what());
          }
          if (source[g] == nullptr) {
            out.configs[g] = config;
          } else if (const std::string d = config_difference(out.configs[g], config); !d.empty()) {
            set_error(group_here + " takes elements from " + quoted(files[source[g]->file].path()) + " group " +
                      std::to_string(source[g]->group) + " and " + quoted(path) + " group " + std::to_string(q.group) +
                      ", whose hyperparameters differ (" + d + ")");
          }
        }
        const std::int64_t steps = f.group_steps[q.group];
        if (source[g] == nullptr) {
          group_steps[g] = steps;
          offsets[g] = f.product_offsets[q.group];
          source[g] = &q;
        } else if (const double d = f.product_offsets[q.group];
                   steps == group_steps[g] && std::memcmp(&d, &offsets[g], sizeof d) != 0) {
          set_error(group_here + " takes elements from " + quoted(files[source[g]->file].path()) + " group " +
                    std::to_string(source[g]->group) + " and " + quoted(path) + " group " + std::to_string(q.group) +
                    ", whose NAdam mu_product differs (" + std::string(kProductOffset) + " " + shortest(offsets[g]) +
                    " and " + shortest(d) + ")");
        } else if (steps != group_steps[g]) {
          set_error(group_here + " takes elements from " + quoted(files[source[g]->file].path()) + " group " +
                    std::to_string(source[g]->group) + " (" + std::to_string(group_steps[g]) + " steps applied) and " +
                    quoted(path) + " group " + std::to_string(q.group) + " (" + std::to_string(steps) + ")");
        }
      }
      // Elements [first, last) of the model tensor: this param's and the saved one's.
      const std::int64_t first = std::max(at.offset, q.at.offset), last = std::min(end, q.end());
      // dtype: F32, or BF16 for a compensation (bit patterns, copied as they are: 2 bytes
      // an element, so its slices are not a master's).
      const auto take = [&](std::string_view what, void* dst, std::string_view dtype) {
        const std::size_t size = dtype == "BF16" ? sizeof(std::uint16_t) : sizeof(float);
        const std::string name = tensor_name(q.group, q.index, what);
        const detail::SafetensorsTensor* t = f.c.file->find(name);
        if (t == nullptr) corrupt(path, "tensor '" + name + "' is missing");
        if (t->dtype != dtype || t->shape.size() != 1 || t->shape[0] != static_cast<std::uint64_t>(q.numel))
          corrupt(path, "tensor '" + name + "' is not " + std::string(dtype) + " of shape [" + std::to_string(q.numel) + "]");
        if (last > first)
          out.copies.emplace_back(static_cast<unsigned char*>(dst) + static_cast<std::size_t>(first - at.offset) * size,
                                  f.c.file->data(*t).subspan(static_cast<std::size_t>(first - q.at.offset) * size,
                                                             static_cast<std::size_t>(last - first) * size));
      };
      // A state stream: elements [first, last) as saved (bf16: 2 bytes, q8: 1 byte and the absmaxes of
      // its blocks, which the slices' chunk-aligned cuts keep whole), copied or converted.
      const auto take_stream = [&](std::string_view s) {
        const auto bytes = [&](std::string_view what, std::string_view type, std::uint64_t n) {
          const std::string name = tensor_name(q.group, q.index, what);
          const detail::SafetensorsTensor* t = f.c.file->find(name);
          if (t == nullptr) corrupt(path, "tensor '" + name + "' is missing");
          if (t->dtype != type || t->shape.size() != 1 || t->shape[0] != n)
            corrupt(path, "tensor '" + name + "' is not " + std::string(type) + " of shape [" + std::to_string(n) + "]");
          return f.c.file->data(*t);
        };
        const StateRange range{static_cast<std::size_t>(std::max<std::int64_t>(first - q.at.offset, 0)),
                               static_cast<std::size_t>(std::max<std::int64_t>(first - at.offset, 0)),
                               static_cast<std::size_t>(std::max<std::int64_t>(last - first, 0)), last > first};
        take_state(out, e, p, s, saved_format(q.formats, s), static_cast<std::uint64_t>(q.numel), range, convert, path,
                   saved, bytes);
      };
      for (std::string_view s : state_streams(e.program(g))) take_stream(s);
      if (float* m = e.master_data(p)) take("master", m, "F32");
      if (std::uint16_t* c = e.compensation_data(p)) take("compensation", c, "BF16");
      f.used = true;
    }
  }
  for (std::size_t g = 0; g < groups; ++g) {
    out.step_bases.push_back(out.step_count - group_steps[g]);
    check_product_offset(source[g] != nullptr ? files[source[g]->file].path() : files[0].path(), g,
                         custom == nullptr ? &out.configs[g] : nullptr, group_steps[g], offsets[g]);
  }
  out.product_offsets = offsets;
  for (const SetFile& f : files)
    if (f.used) f.c.file->verify_checksum();
  return out;
}

// The GradScaler state of the set: every file's, which must be the same.
std::map<std::string, double> set_scaler_state(const std::vector<SetFile>& files) {
  std::map<std::string, double> state = parse_scaler(files[0].c);
  for (std::size_t k = 1; k < files.size(); ++k) {
    const std::map<std::string, double> other = parse_scaler(files[k].c);
    bool same = other.size() == state.size();
    for (auto a = state.cbegin(), b = other.cbegin(); same && a != state.end(); ++a, ++b)
      same = a->first == b->first && std::memcmp(&a->second, &b->second, sizeof(double)) == 0;
    if (!same)
      set_error(quoted(files[0].path()) + " and " + quoted(files[k].path()) +
                " hold different GradScaler states (every rank's scaler must be the same)");
  }
  return state;
}

// A rank's outcome of its checks, exchanged with every rank (plain bytes, zero-filled).
struct LoadStatus {
  detail::RankStatus status;
  std::uint64_t list = 0;  // a hash of the list of paths, which must be the same on every rank
};
static_assert(sizeof(LoadStatus) == sizeof(detail::RankStatus) + 8);

std::uint64_t hash_paths(const std::vector<std::string>& paths) {
  std::string joined;  // each path and a separator
  for (const std::string& p : paths) joined.append(p).push_back('\0');
  return XXH3_64bits(joined.data(), joined.size());
}

// The collective decision: every rank's status, exchanged. Rethrows this rank's own
// error; throws an Error naming the rank that failed when another did; returns only
// when every rank may commit.
void agree(Communicator& comm, const std::vector<std::string>& paths, const std::exception_ptr& error) {
  LoadStatus mine;
  mine.status = detail::RankStatus::of(error);
  mine.list = hash_paths(paths);
  std::vector<LoadStatus> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&mine, all.data(), sizeof(LoadStatus), CommType::u8);
  detail::throw_if_any_failed(all, error, "load_shards",
                              "could not take its part of the checkpoint, so no rank changed anything");
  for (std::size_t r = 1; r < all.size(); ++r)
    if (all[r].list != all[0].list)
      set_error("rank " + std::to_string(r) + " was given another list of files than rank 0 (every rank must pass the "
                "same list, in the same order), so no rank changed anything");
}

// load_shards: reads and checks everything; sharded, agrees with the other ranks; then
// commits (the optimizer, and the scaler when given one).
void load_shard_set(detail::StepEngine& e, const std::vector<std::string>& paths, GradScaler* scaler, bool convert) {
  std::vector<SetFile> files;
  ParsedOptimizer parsed;
  std::optional<GradScaler> restored;
  std::exception_ptr error;
  try {
    if (paths.empty()) set_error("no files given");
    std::vector<SavedParam> pieces;
    files.reserve(paths.size());
    for (std::size_t k = 0; k < paths.size(); ++k) files.push_back(read_set_file(paths[k], k, e, pieces));
    const ModelView model = model_view(e);
    check_set(files, pieces, model);
    parsed = take_shard(files, pieces, model, e, convert);
    if (scaler != nullptr) {
      restored.emplace(*scaler);  // validate on a copy: nothing changes on an Error
      restored->load_state_dict(set_scaler_state(files));
    }
  } catch (...) {
    error = std::current_exception();
  }
  if (const detail::Shard* shard = e.shard())
    agree(shard->communicator(), paths, error);
  else if (error)
    std::rethrow_exception(error);
  commit_optimizer(e, parsed);
  if (scaler != nullptr) *scaler = *restored;
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

void Optimizer::load(const std::string& path) { load(path, LoadOptions{}); }

void Optimizer::load(const std::string& path, const LoadOptions& options) {
  const OpenedCheckpoint c = open_checkpoint(path);
  commit_optimizer(*engine_, parse_optimizer(c, *engine_, options.convert_state));
}

void Optimizer::load_shards(const std::vector<std::string>& paths) { load_shard_set(*engine_, paths, nullptr, false); }

void Optimizer::load_shards(const std::vector<std::string>& paths, GradScaler& scaler) {
  load_shard_set(*engine_, paths, &scaler, false);
}

void Optimizer::load_shards(const std::vector<std::string>& paths, const LoadOptions& options) {
  load_shard_set(*engine_, paths, nullptr, options.convert_state);
}

void Optimizer::load_shards(const std::vector<std::string>& paths, GradScaler& scaler, const LoadOptions& options) {
  load_shard_set(*engine_, paths, &scaler, options.convert_state);
}

void Optimizer::load(const std::string& path, GradScaler& scaler) { load(path, scaler, LoadOptions{}); }

void Optimizer::load(const std::string& path, GradScaler& scaler, const LoadOptions& options) {
  const OpenedCheckpoint c = open_checkpoint(path);
  const ParsedOptimizer parsed = parse_optimizer(c, *engine_, options.convert_state);
  GradScaler restored = scaler;  // validate on a copy: nothing changes on an Error
  restored.load_state_dict(parse_scaler(c));
  commit_optimizer(*engine_, parsed);
  scaler = restored;
}

void LossScaleOptimizer::save(const std::string& path) const {
  save_checkpoint(detail_access::engine(*inner_), path, {{kLossScaleKey, LossScaleCheckpoint::to_json(*this)}});
}

void LossScaleOptimizer::load(const std::string& path) { load(path, LoadOptions{}); }

void LossScaleOptimizer::load(const std::string& path, const LoadOptions& options) {
  const OpenedCheckpoint c = open_checkpoint(path);
  detail::StepEngine& engine = detail_access::engine(*inner_);
  const ParsedOptimizer parsed = parse_optimizer(c, engine, options.convert_state);
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
