// The JSON writer (nlohmann::ordered_json) and the sections the CUDA and CPU ABI descriptions share.
#include "jit/abi_json.hpp"

#include <nlohmann/json.hpp>

#include <cassert>
#include <cmath>
#include <utility>
#include <vector>

#include "jit/program_analysis.hpp"
#include "jit/update_program_rules.hpp"
#include "stepfuse/version.hpp"

namespace stepfuse::jit {

struct JsonWriter::Impl {
  nlohmann::ordered_json root;
  // The open containers, innermost last. Pointers into the tree stay valid: only the
  // innermost container grows, and it is an element of the ones below it, which do
  // not change while it is open.
  std::vector<nlohmann::ordered_json*> open;

  nlohmann::ordered_json& add(std::string_view key, nlohmann::ordered_json value) {
    if (open.empty()) {  // the document itself
      assert(key.empty() && root.is_null());
      root = std::move(value);
      return root;
    }
    nlohmann::ordered_json& top = *open.back();
    if (top.is_array()) {
      assert(key.empty());
      top.push_back(std::move(value));
      return top.back();
    }
    assert(!key.empty() && !top.contains(std::string(key)));
    return top[std::string(key)] = std::move(value);
  }
};

JsonWriter::JsonWriter() : impl_(std::make_unique<Impl>()) {}
JsonWriter::~JsonWriter() = default;

JsonWriter& JsonWriter::begin_object(std::string_view key) {
  impl_->open.push_back(&impl_->add(key, nlohmann::ordered_json::object()));
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  assert(!impl_->open.empty() && impl_->open.back()->is_object());
  impl_->open.pop_back();
  return *this;
}

JsonWriter& JsonWriter::begin_array(std::string_view key) {
  impl_->open.push_back(&impl_->add(key, nlohmann::ordered_json::array()));
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  assert(!impl_->open.empty() && impl_->open.back()->is_array());
  impl_->open.pop_back();
  return *this;
}

JsonWriter& JsonWriter::str(std::string_view key, std::string_view v) {
  impl_->add(key, std::string(v));
  return *this;
}

JsonWriter& JsonWriter::num(std::string_view key, double v) {
  // nlohmann prints a double as the shortest text that reads back as it; not finite is
  // null, said explicitly rather than left to the printer.
  impl_->add(key, std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json());
  return *this;
}

JsonWriter& JsonWriter::integer(std::string_view key, long long v) {
  impl_->add(key, v);
  return *this;
}

JsonWriter& JsonWriter::boolean(std::string_view key, bool v) {
  impl_->add(key, v);
  return *this;
}

std::string JsonWriter::finish() const {
  assert(impl_->open.empty());
  return impl_->root.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

namespace {

std::string_view role_name(StreamRole r) {
  return r == StreamRole::grad ? "grad" : r == StreamRole::param ? "param" : "state";
}

}  // namespace

void begin_kernel_abi(JsonWriter& j) {
  j.begin_object().str("format", "stepfuse.kernel_abi").integer("format_version", kKernelAbiVersion);
  j.str("stepfuse_version", version());
}

void write_abi_program(JsonWriter& j, const UpdateProgram& program) {
  const Program& p = program.program();
  const StreamUse use = stream_use(p);
  j.begin_object("program").str("name", p.name).str("text", to_string(p)).begin_array("streams");
  for (int s = 0; s < p.num_streams; ++s)
    j.begin_object().integer("index", s).str("name", p.streams[s].name).str("role", role_name(p.streams[s].role))
        .num("init", p.streams[s].init).boolean("loaded", use.loads[s]).boolean("stored", use.stores[s]).end_object();
  j.end_array().begin_array("scalars");
  for (int s = 0; s < p.num_scalars; ++s) {
    const ScalarDef& d = program.scalars()[static_cast<std::size_t>(s)];
    j.begin_object().integer("index", s).str("name", d.name).str("rule", scalar_rule_name(d.rule.kind));
    j.integer("kind", static_cast<int>(d.rule.kind)).num("a", d.rule.a).num("b", d.rule.b).num("c", d.rule.c);
    j.str("value", rule_text(d.rule));
    j.end_object();
  }
  j.end_array().end_object();
  // Must match enum sf_rule_kind and sf_eval_rule (jit/step_scalars.h).
  j.begin_object("scalar_rule_kinds")
      .str("0", "SF_RULE_FIXED: a")
      .str("1", "SF_RULE_GSCALE: a * gscale (gscale = clip_coef / loss_scale)")
      .str("2", "SF_RULE_FIRST_STEP: step == 1 ? a : b")
      .str("3", "SF_RULE_DIV_ONE_MINUS_POW: a / (1 - b^step)")
      .str("4", "SF_RULE_SQRT_ONE_MINUS_POW: sqrt(1 - b^step)")
      .str("5", "SF_RULE_DIV_LINEAR: a / (1 + (step - 1) * b)")
      .str("6", "SF_RULE_ONE_MINUS_POW: 1 - b^step")
      .str("7", "SF_RULE_NADAM_GRAD_COEF: -a * (1 - mu_step) / (1 - P_step), mu_t = b * (1 - 0.5 * 0.96^(t * c)), "
                "P_t = exp(d) * mu_1 * ... * mu_t rounded to fp32 (sf_nadam_mu, sf_nadam_mu_product; d = 0 but after a "
                "change of b or c: sf_nadam_product_offset)")
      .str("8", "SF_RULE_NADAM_MOMENTUM_COEF: -a * mu_(step+1) / (1 - P_step * mu_(step+1))")
      .str("9", "SF_RULE_RADAM_RECT: rho_t > 5 ? sqrt((rho_t - 4) (rho_t - 2) rho_inf / ((rho_inf - 4) (rho_inf - 2) "
                "rho_t)) : 0, rho_inf = 2 / (1 - b) - 1, rho_t = rho_inf - 2 step b^step / (1 - b^step)")
      .str("10", "SF_RULE_ASGD_ETA: a / (1 + b * a * (step - 1))^c")
      .str("11", "SF_RULE_ASGD_DECAY: 1 - b * eta, eta = SF_RULE_ASGD_ETA's value rounded to fp32")
      .str("12", "SF_RULE_ASGD_MU: step == 1 ? 1 : 1 / max(1, step - 1 - a)")
      .str("evaluation", "in double with + - * / sqrt and bit manipulation only (powers by repeated squaring, "
                         "sf_powi; real powers, logarithms and exponentials in double-double, sf_pow, sf_log, sf_exp), "
                         "step = the 1-based index of the step being applied, then rounded once to fp32; sf_eval_rule "
                         "in the header, compiled without floating-point contraction")
      .end_object();
}

void write_type(JsonWriter& j, const char* name, std::size_t size, std::size_t align, const char* what,
                std::initializer_list<AbiField> fields) {
  j.begin_object(name).str("description", what).integer("size", static_cast<long long>(size));
  j.integer("align", static_cast<long long>(align)).begin_array("fields");
  for (const AbiField& f : fields)
    j.begin_object().str("name", f.name).str("type", f.type).integer("offset", static_cast<long long>(f.offset))
        .str("description", f.what).end_object();
  j.end_array().end_object();
}

void write_params(JsonWriter& j, std::span<const AbiParam> params) {
  j.begin_array("params");
  int k = 0;
  for (const AbiParam& p : params)
    j.begin_object().integer("index", k++).str("name", p.name).str("type", p.type).str("description", p.what).end_object();
  j.end_array();
}

void write_memory(JsonWriter& j, const char* key, std::initializer_list<AbiMemory> buffers) {
  j.begin_array(key);
  for (const AbiMemory& m : buffers)
    j.begin_object().str("name", m.name).str("type", m.type).str("count", m.count).str("initialize", m.initialize)
        .end_object();
  j.end_array();
}

}  // namespace stepfuse::jit
