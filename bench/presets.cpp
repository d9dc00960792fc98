// Model-shaped tensor lists for the benchmarks: named presets and flat:N.
#include "presets.hpp"

#include <charconv>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace stepfuse::bench {
namespace {

// GPT-2 small (HF transformers GPT2LMHeadModel.named_parameters(), lm_head tied to wte):
// 148 tensors, 124,439,808 parameters. Linear weights are Conv1D [in, out].
std::vector<TensorShape> gpt2_124m() {
  constexpr std::int64_t d = 768, vocab = 50257, ctx = 1024, layers = 12;
  std::vector<TensorShape> t;
  t.push_back({"transformer.wte.weight", vocab * d});
  t.push_back({"transformer.wpe.weight", ctx * d});
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    t.push_back({h + "ln_1.weight", d});
    t.push_back({h + "ln_1.bias", d});
    t.push_back({h + "attn.c_attn.weight", d * 3 * d});
    t.push_back({h + "attn.c_attn.bias", 3 * d});
    t.push_back({h + "attn.c_proj.weight", d * d});
    t.push_back({h + "attn.c_proj.bias", d});
    t.push_back({h + "ln_2.weight", d});
    t.push_back({h + "ln_2.bias", d});
    t.push_back({h + "mlp.c_fc.weight", d * 4 * d});
    t.push_back({h + "mlp.c_fc.bias", 4 * d});
    t.push_back({h + "mlp.c_proj.weight", 4 * d * d});
    t.push_back({h + "mlp.c_proj.bias", d});
  }
  t.push_back({"transformer.ln_f.weight", d});
  t.push_back({"transformer.ln_f.bias", d});
  return t;
}

// One decoder layer of LLaMA-7B (HF LlamaDecoderLayer): 9 tensors, 202,383,360 parameters.
std::vector<TensorShape> llama7b_layer() {
  constexpr std::int64_t d = 4096, ff = 11008;
  return {
      {"self_attn.q_proj.weight", d * d},   {"self_attn.k_proj.weight", d * d},
      {"self_attn.v_proj.weight", d * d},   {"self_attn.o_proj.weight", d * d},
      {"mlp.gate_proj.weight", ff * d},     {"mlp.up_proj.weight", ff * d},
      {"mlp.down_proj.weight", d * ff},     {"input_layernorm.weight", d},
      {"post_attention_layernorm.weight", d},
  };
}

// 10,000 tensors of 1-4 K elements, sizes from a fixed sequence (the same every run),
// deliberately not multiples of the vector width.
std::vector<TensorShape> many_small() {
  std::vector<TensorShape> t;
  t.reserve(10000);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 10000; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    std::string name = "t";  // (not "t" + to_string: GCC 12 -O3 warns falsely, -Wrestrict, PR 105329)
    name += std::to_string(i);
    t.push_back({std::move(name), 1024 + static_cast<std::int64_t>(x % 3073)});
  }
  return t;
}

std::int64_t parse_count(std::string_view spec, std::string_view text) {
  std::int64_t n = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, n);
  std::int64_t mult = 1;
  if (ec == std::errc() && ptr + 1 == end) {
    switch (*ptr) {
      case 'k': case 'K': mult = 1000; ++ptr; break;
      case 'M': case 'm': mult = 1000 * 1000; ++ptr; break;
      case 'G': case 'g': mult = 1000 * 1000 * 1000; ++ptr; break;
      default: break;
    }
  }
  if (ec != std::errc() || ptr != end || n <= 0 || n > std::numeric_limits<std::int64_t>::max() / mult)
    throw std::invalid_argument("preset '" + std::string(spec) +
                                "': flat:N needs a positive element count N (e.g. flat:100M)");
  return n * mult;
}

}  // namespace

std::int64_t Preset::total_numel() const {
  return std::accumulate(tensors.begin(), tensors.end(), std::int64_t{0},
                         [](std::int64_t s, const TensorShape& t) { return s + t.numel; });
}

std::vector<std::pair<std::string, std::string>> preset_catalog() {
  return {
      {"gpt2-124m", "GPT-2 small: 148 tensors, 124,439,808 parameters"},
      {"llama7b-layer", "one LLaMA-7B decoder layer: 9 tensors, 202,383,360 parameters"},
      {"many-small", "10,000 tensors of 1-4 K elements (per-tensor overhead)"},
      {"flat:N", "one tensor of N elements (k/M/G suffixes allowed)"},
  };
}

Preset make_preset(std::string_view spec) {
  Preset p;
  p.name = std::string(spec);
  if (spec == "gpt2-124m") {
    p.tensors = gpt2_124m();
  } else if (spec == "llama7b-layer") {
    p.tensors = llama7b_layer();
  } else if (spec == "many-small") {
    p.tensors = many_small();
  } else if (spec.starts_with("flat:")) {
    p.tensors = {{"flat", parse_count(spec, spec.substr(5))}};
  } else {
    std::string names;
    for (const auto& [n, d] : preset_catalog()) names += (names.empty() ? "" : ", ") + n;
    throw std::invalid_argument("unknown preset '" + std::string(spec) + "' (expected one of: " + names + ")");
  }
  for (const auto& [n, d] : preset_catalog())
    if (n == spec) p.description = d;
  if (p.description.empty())
    p.description = "one tensor of " + std::to_string(p.total_numel()) + " elements";
  return p;
}

}  // namespace stepfuse::bench
