// Model-shaped tensor lists for the benchmarks: named presets, flat:N, and the user's own lists (shapes files).
#include "presets.hpp"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <stdexcept>

namespace stepfuse::bench {
namespace {

// A tensor of the given dims (numel their product).
TensorShape shaped(std::string name, std::vector<std::int64_t> dims) {
  std::int64_t n = 1;
  for (const std::int64_t d : dims) n *= d;
  return {std::move(name), n, std::move(dims)};
}

// GPT-2 small (HF transformers GPT2LMHeadModel.named_parameters(), lm_head tied to wte):
// 148 tensors, 124,439,808 parameters. Linear weights are Conv1D [in, out]; biases and
// layer norms are 1-D (98 tensors, 121,344 parameters).
std::vector<TensorShape> gpt2_124m() {
  constexpr std::int64_t d = 768, vocab = 50257, ctx = 1024, layers = 12;
  std::vector<TensorShape> t;
  t.push_back(shaped("transformer.wte.weight", {vocab, d}));
  t.push_back(shaped("transformer.wpe.weight", {ctx, d}));
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string h = "transformer.h." + std::to_string(l) + ".";
    t.push_back(shaped(h + "ln_1.weight", {d}));
    t.push_back(shaped(h + "ln_1.bias", {d}));
    t.push_back(shaped(h + "attn.c_attn.weight", {d, 3 * d}));
    t.push_back(shaped(h + "attn.c_attn.bias", {3 * d}));
    t.push_back(shaped(h + "attn.c_proj.weight", {d, d}));
    t.push_back(shaped(h + "attn.c_proj.bias", {d}));
    t.push_back(shaped(h + "ln_2.weight", {d}));
    t.push_back(shaped(h + "ln_2.bias", {d}));
    t.push_back(shaped(h + "mlp.c_fc.weight", {d, 4 * d}));
    t.push_back(shaped(h + "mlp.c_fc.bias", {4 * d}));
    t.push_back(shaped(h + "mlp.c_proj.weight", {4 * d, d}));
    t.push_back(shaped(h + "mlp.c_proj.bias", {d}));
  }
  t.push_back(shaped("transformer.ln_f.weight", {d}));
  t.push_back(shaped("transformer.ln_f.bias", {d}));
  return t;
}

// torchvision ResNet-50 (torchvision.models.resnet50().named_parameters(), in that order):
// 161 tensors, 25,557,032 parameters. Convolutions have no bias; each BatchNorm2d has a
// weight and a bias (its running statistics are buffers, not parameters). Bottleneck
// blocks (expansion 4) in stages of 3, 4, 6, 3; the first block of each stage has a
// downsample branch (1x1 conv + BatchNorm).
std::vector<TensorShape> resnet50() {
  std::vector<TensorShape> t;
  // Conv2d weight [out, in, k, k].
  auto conv = [&](const std::string& name, std::int64_t out, std::int64_t in, std::int64_t k) {
    t.push_back(shaped(name + ".weight", {out, in, k, k}));
  };
  auto bn = [&](const std::string& name, std::int64_t c) {
    t.push_back(shaped(name + ".weight", {c}));
    t.push_back(shaped(name + ".bias", {c}));
  };
  constexpr std::int64_t kExpansion = 4;
  conv("conv1", 64, 3, 7);
  bn("bn1", 64);
  std::int64_t in = 64;
  const std::int64_t planes[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  for (int s = 0; s < 4; ++s) {
    const std::int64_t p = planes[s], out = p * kExpansion;
    for (std::int64_t b = 0; b < blocks[s]; ++b) {
      const std::string h = "layer" + std::to_string(s + 1) + "." + std::to_string(b) + ".";
      conv(h + "conv1", p, in, 1);
      bn(h + "bn1", p);
      conv(h + "conv2", p, p, 3);
      bn(h + "bn2", p);
      conv(h + "conv3", out, p, 1);
      bn(h + "bn3", out);
      if (b == 0) {
        conv(h + "downsample.0", out, in, 1);
        bn(h + "downsample.1", out);
      }
      in = out;
    }
  }
  t.push_back(shaped("fc.weight", {1000, in}));  // Linear [1000, 2048]
  t.push_back(shaped("fc.bias", {1000}));
  return t;
}

// One decoder layer of LLaMA-7B (HF LlamaDecoderLayer): 9 tensors, 202,383,360 parameters.
std::vector<TensorShape> llama7b_layer() {
  constexpr std::int64_t d = 4096, ff = 11008;
  return {
      shaped("self_attn.q_proj.weight", {d, d}),   shaped("self_attn.k_proj.weight", {d, d}),
      shaped("self_attn.v_proj.weight", {d, d}),   shaped("self_attn.o_proj.weight", {d, d}),
      shaped("mlp.gate_proj.weight", {ff, d}),     shaped("mlp.up_proj.weight", {ff, d}),
      shaped("mlp.down_proj.weight", {d, ff}),     shaped("input_layernorm.weight", {d}),
      shaped("post_attention_layernorm.weight", {d}),
  };
}

// 10,000 1-D tensors of 1-4 K elements, sizes from a fixed sequence (the same every run),
// deliberately not multiples of the vector width.
std::vector<TensorShape> many_small() {
  std::vector<TensorShape> t;
  t.reserve(10000);
  std::uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 10000; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    std::string name = "t";  // (not "t" + to_string: GCC 12 -O3 warns falsely, -Wrestrict, PR 105329)
    name += std::to_string(i);
    t.push_back(shaped(std::move(name), {1024 + static_cast<std::int64_t>(x % 3073)}));
  }
  return t;
}

// The named presets. The counts are what --help states; make_preset checks every list it
// builds against them, so a wrong shape above cannot go unnoticed.
struct NamedPreset {
  const char* name;
  const char* what;  // the description, before the counts
  const char* note;  // after the counts ("" for none)
  std::vector<TensorShape> (*build)();
  std::size_t tensors;
  std::int64_t params;
};
const NamedPreset kNamed[] = {
    {"gpt2-124m", "GPT-2 small", "", gpt2_124m, 148, 124'439'808},
    {"resnet50", "torchvision ResNet-50", "", resnet50, 161, 25'557'032},
    {"llama7b-layer", "one LLaMA-7B decoder layer", "", llama7b_layer, 9, 202'383'360},
    {"many-small", "1-4 K elements per tensor", " (per-tensor overhead)", many_small, 10'000, 25'727'076},
};

std::string with_commas(std::int64_t n) {
  const std::string digits = std::to_string(n);
  std::string s;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) s += ',';
    s += digits[i];
  }
  return s;
}

std::string describe(const NamedPreset& p) {
  return std::string(p.what) + ": " + with_commas(static_cast<std::int64_t>(p.tensors)) + " tensors, " +
         with_commas(p.params) + " parameters" + p.note;
}

// An element count >= 0 with an optional k/M/G suffix (powers of 1000); false for anything
// else, including a count that does not fit in int64.
bool parse_count(std::string_view text, std::int64_t* out) {
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
  if (ec != std::errc() || ptr != end || n < 0 || n > std::numeric_limits<std::int64_t>::max() / mult) return false;
  *out = n * mult;
  return true;
}

}  // namespace

std::int64_t Preset::total_numel() const {
  return std::accumulate(tensors.begin(), tensors.end(), std::int64_t{0},
                         [](std::int64_t s, const TensorShape& t) { return s + t.numel; });
}

std::vector<std::pair<std::string, std::string>> preset_catalog() {
  std::vector<std::pair<std::string, std::string>> c;
  for (const NamedPreset& p : kNamed) c.emplace_back(p.name, describe(p));
  c.emplace_back("flat:N", "one tensor of N elements (k/M/G suffixes allowed)");
  return c;
}

Preset make_preset(std::string_view spec) {
  Preset p;
  p.name = std::string(spec);
  for (const NamedPreset& np : kNamed) {
    if (spec != np.name) continue;
    p.tensors = np.build();
    p.description = describe(np);
    if (p.tensors.size() != np.tensors || p.total_numel() != np.params)
      throw std::logic_error("preset '" + p.name + "' has " + std::to_string(p.tensors.size()) + " tensors and " +
                             std::to_string(p.total_numel()) + " parameters, but its description says " +
                             std::to_string(np.tensors) + " and " + std::to_string(np.params));
    return p;
  }
  std::int64_t n = 0;
  if (spec.starts_with("flat:")) {
    if (!parse_count(spec.substr(5), &n) || n == 0)
      throw std::invalid_argument("preset '" + p.name + "': flat:N needs a positive element count N (e.g. flat:100M)");
    p.tensors = {shaped("flat", {n})};
    p.description = "one tensor of " + std::to_string(n) + " elements";
    return p;
  }
  std::string names;
  for (const auto& [name, d] : preset_catalog()) names += (names.empty() ? "" : ", ") + name;
  throw std::invalid_argument("unknown preset '" + p.name + "' (expected one of: " + names + ")");
}

Preset load_shapes_file(const std::string& path) {
  auto fail = [&](const std::string& what) { throw std::invalid_argument(path + ": " + what); };
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("is a directory, not a shapes file");
  std::ifstream in(path);
  if (!in) fail(std::string("cannot open: ") + std::strerror(errno));

  Preset p;
  p.name = path;
  std::map<std::string, int, std::less<>> line_of;  // name -> the line that named it
  std::int64_t total = 0;
  std::string line;
  for (int line_no = 1; std::getline(in, line); ++line_no) {
    auto at_line = [&](const std::string& what) { fail("line " + std::to_string(line_no) + ": " + what); };
    std::string_view rest(line);
    if (const auto hash = rest.find('#'); hash != std::string_view::npos) rest = rest.substr(0, hash);
    std::vector<std::string_view> words;
    constexpr std::string_view kSpace = " \t\r\v\f";  // \r: files written on Windows
    for (std::size_t b = rest.find_first_not_of(kSpace); b != std::string_view::npos;
         b = rest.find_first_not_of(kSpace, b)) {
      const std::size_t e = std::min(rest.find_first_of(kSpace, b), rest.size());
      words.push_back(rest.substr(b, e - b));
      b = e;
    }
    if (words.empty()) continue;
    if (words.size() > 2)
      at_line("expected '[NAME] COUNT', found " + std::to_string(words.size()) + " words");
    const std::string_view count_text = words.back();
    std::string name = "t";  // (appended, not "t" + to_string: see many_small)
    if (words.size() == 2) name = words[0]; else name += std::to_string(p.tensors.size());
    const std::string for_tensor = words.size() == 2 ? " for tensor '" + name + "'" : std::string();
    std::int64_t n = 0;
    std::vector<std::int64_t> dims;
    // An 'x' before the last character makes it dims ("12x" stays a bad count, as it always was).
    if (const std::size_t x = count_text.find('x'); x == std::string_view::npos || x + 1 == count_text.size()) {
      if (!parse_count(count_text, &n))
        at_line("'" + std::string(count_text) + "' is not an element count" + for_tensor +
                " (expected a whole number >= 0, optionally with a k/M/G suffix: 38597376, 4096, 10M; or dims: "
                "50257x768)");
    } else {  // D0xD1[x...]: the dims of a tensor of rank 2 or more
      n = 1;
      for (std::size_t b = 0;;) {
        const std::size_t e = std::min(count_text.find('x', b), count_text.size());
        std::int64_t d = 0;
        if (!parse_count(count_text.substr(b, e - b), &d))
          at_line("'" + std::string(count_text) + "' is not a shape" + for_tensor +
                  " (expected dims joined by 'x', each a whole number >= 0: 50257x768, 64x3x7x7)");
        if (d > 0 && n > std::numeric_limits<std::int64_t>::max() / d)
          at_line("the element count of '" + std::string(count_text) + "' overflows int64");
        n *= d;
        dims.push_back(d);
        if (e == count_text.size()) break;
        b = e + 1;
      }
    }
    if (n > std::numeric_limits<std::int64_t>::max() - total) at_line("the total element count overflows int64");
    if (const auto [it, fresh] = line_of.emplace(name, line_no); !fresh)
      at_line("tensor name '" + name + "' is already used on line " + std::to_string(it->second) +
              (words.size() == 1 ? " (a tensor without a name is named t<index>)" : ""));
    total += n;
    p.tensors.push_back({std::move(name), n, std::move(dims)});
  }
  if (in.bad()) fail(std::string("read error: ") + std::strerror(errno));
  if (p.tensors.empty()) fail("no tensors (expected one '[NAME] COUNT' per line)");
  if (total == 0) fail("every tensor is empty (the list must hold at least one element)");
  p.description = "tensor list from " + path + ": " + with_commas(static_cast<std::int64_t>(p.tensors.size())) +
                  " tensors, " + with_commas(total) + " parameters";
  return p;
}

std::string format_shapes(const std::vector<TensorShape>& tensors, bool dims) {
  std::string s;
  for (const TensorShape& t : tensors) {
    s += t.name + " ";
    if (dims && t.is_matrix()) {
      for (std::size_t k = 0; k < t.dims.size(); ++k) {
        if (k > 0) s += 'x';
        s += std::to_string(t.dims[k]);
      }
    } else {
      s += std::to_string(t.numel);
    }
    s += "\n";
  }
  return s;
}

}  // namespace stepfuse::bench
