// Checks a benchmark's results before anything is timed: fused against unfused, or "the step did something".
#include "verify.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <string_view>

#include "parallel.hpp"

namespace stepfuse::bench {
namespace {

// Distance from |x| to the next representable value of `t` above it.
double storage_ulp(DType t, double x) {
  const float ax = static_cast<float>(std::fabs(x));
  const int mant_bits = t == DType::f32 ? 23 : t == DType::bf16 ? 7 : 10;
  const int min_exp = t == DType::f16 ? -14 : -126;  // smallest normal exponent
  int e = 0;
  std::frexp(ax, &e);  // ax = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0, std::max(e - 1, min_exp) - mant_bits);
}

double grad_rel_tol(DType g) {
  switch (g) {
    case DType::f32: return 1e-5;
    // 8 units of roundoff of f16: clipped gradients of a large model sit near f16's smallest
    // normal (6.1e-5), where the unfused baseline's in-place writes lose a few more bits.
    case DType::f16: return std::ldexp(1.0, -8);
    case DType::bf16: return std::ldexp(1.0, -7);  // 2 units of roundoff of bf16
  }
  return 1e-5;
}

// Per-thread tally, merged at the end.
struct Tally {
  std::string_view a_name, b_name;  // labels of a and b in `worst`
  std::int64_t checked = 0, bad = 0, identical = 0, apart = 0;
  double worst_ratio = 0;
  std::string worst;

  void check(double a, double b, double tol, const ModelBuffers& buf, std::size_t t, std::int64_t i,
             std::string_view what, double initial) {
    ++checked;
    identical += std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b);
    const double diff = std::fabs(a - b);
    const double ratio = diff <= tol ? diff / tol : (std::isnan(diff) ? INFINITY : diff / tol);
    if (!(diff <= tol)) ++bad;
    if (ratio > worst_ratio || (std::isnan(diff) && worst.empty())) {
      worst_ratio = ratio;
      describe(a, b, tol, buf, t, i, what, initial);
    }
  }

  // Bit for bit: a and b are fp32 values (or 16-bit ones) widened exactly, so their
  // doubles' bits differ exactly when the stored bits do. worst_ratio tracks the largest
  // |a - b| here (a NaN on one side only is infinitely far).
  void check_bits(double a, double b, const ModelBuffers& buf, std::size_t t, std::int64_t i, std::string_view what,
                  double initial) {
    ++checked;
    if (std::bit_cast<std::uint64_t>(a) == std::bit_cast<std::uint64_t>(b)) {
      ++identical;
      return;
    }
    ++bad;
    const double diff = std::isnan(a - b) ? INFINITY : std::fabs(a - b);
    if (diff > worst_ratio || worst.empty()) {
      worst_ratio = diff;
      describe(a, b, 0.0, buf, t, i, what, initial);
    }
  }

  // Two bf16 values, bits a and b, each the fp32 result of the same update rounded down or
  // up (stochastically and to nearest): a finite, and a equal to b or one bf16 step from it
  // (counted in `identical`, and for weights one step apart in `apart`). The first value that is neither is
  // described in `worst`. `what`: "weight", or the bf16 state stream's name.
  void check_rounded(std::uint16_t a, std::uint16_t b, const ModelBuffers& buf, std::size_t t, std::int64_t i,
                     double initial, std::string_view what = "weight") {
    ++checked;
    const bool finite = (a & 0x7F80u) != 0x7F80u;
    const bool same_sign = ((a ^ b) & 0x8000u) == 0 || ((a | b) & 0x7FFFu) == 0;  // (-0 and +0 are one step)
    const int steps = std::abs(static_cast<int>(a & 0x7FFFu) - static_cast<int>(b & 0x7FFFu));
    if (finite && same_sign && steps <= 1) {
      identical += a == b;
      if (what == "weight") apart += a != b;
      return;
    }
    ++bad;
    if (worst.empty()) describe(bf16_to_f32(a), bf16_to_f32(b), 0.0, buf, t, i, what, initial);
  }

  void describe(double a, double b, double tol, const ModelBuffers& buf, std::size_t t, std::int64_t i,
                std::string_view what, double initial) {
    char line[512];
    std::snprintf(line, sizeof line, "%s[%lld] %.*s: %.*s %.9g, %.*s %.9g (initial %.9g), |diff| %.3g, tol %.3g",
                  buf.name(t).c_str(), static_cast<long long>(i), static_cast<int>(what.size()), what.data(),
                  static_cast<int>(a_name.size()), a_name.data(), a, static_cast<int>(b_name.size()), b_name.data(), b,
                  initial, std::fabs(a - b), tol);
    worst = line;
  }
};

// A state stream of one tensor as stored (OptimizerOptions::state_format): fp32 values, bf16
// bits, or q8 codes with an fp32 absmax per block of 256 elements.
struct Stored {
  StateFormat format = StateFormat::f32;
  std::span<const float> f32;             // format f32: the values (state())
  std::span<const std::byte> bytes;       // bf16 and q8: state_storage()
  std::span<const float> absmax;          // q8: state_absmax()
  static constexpr std::int64_t kBlock = 256;

  std::uint16_t bf16_bits(std::int64_t i) const {  // format bf16: element i's bit pattern
    std::uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, sizeof h);
    return h;
  }
  // Element i as a double whose bits differ exactly when the stored bits do: the fp32 value,
  // the bf16 value widened, or the q8 code.
  double bits_value(std::int64_t i) const {
    switch (format) {
      case StateFormat::f32: return f32[static_cast<std::size_t>(i)];
      case StateFormat::bf16: return bf16_to_f32(bf16_bits(i));
      case StateFormat::q8:
        return static_cast<double>(std::to_integer<std::uint8_t>(bytes[static_cast<std::size_t>(i)]));
    }
    return 0;
  }
};
Stored stored_state(const Optimizer& opt, std::size_t t, std::string_view name) {
  Stored s;
  s.format = opt.state_format(t, name);
  if (s.format == StateFormat::f32) s.f32 = opt.state(t, name);
  else s.bytes = opt.state_storage(t, name), s.absmax = opt.state_absmax(t, name);
  return s;
}
std::size_t stored_size(const Stored& s) {
  return s.format == StateFormat::f32    ? s.f32.size()
         : s.format == StateFormat::bf16 ? s.bytes.size() / 2
                                         : s.bytes.size();
}

// The masters, compensations and state streams of two optimizers over the same tensor
// list, gathered up front so that the parallel loops only read plain memory.
struct Spans {
  std::vector<std::span<const float>> am, bm;               // masters, per tensor
  std::vector<std::span<const std::uint16_t>> ac, bc;       // bf16 compensations (bits), per tensor
  std::vector<std::vector<std::span<const float>>> as, bs;  // f32 state, per stream, per tensor (else empty)
  std::vector<std::vector<Stored>> ast, bst;                // the state as stored, per stream, per tensor
  bool all_f32 = true;                                      // every stream of every tensor stored as f32
  std::vector<std::string> code_names, absmax_names;        // "<stream> (q8 code)", ..., per stream
};

// Fills `sp` for `names`; returns "" or what does not match in size or format.
std::string gather_spans(const Optimizer& a, const Optimizer& b, const ModelBuffers& buf,
                         const std::vector<std::string_view>& names, Spans& sp) {
  const std::size_t nt = buf.num_tensors();
  sp.am.resize(nt);
  sp.bm.resize(nt);
  sp.ac.resize(nt);
  sp.bc.resize(nt);
  sp.as.assign(names.size(), {});
  sp.bs.assign(names.size(), {});
  sp.ast.assign(names.size(), {});
  sp.bst.assign(names.size(), {});
  sp.code_names.clear();
  sp.absmax_names.clear();
  for (std::string_view n : names) {
    sp.code_names.push_back(std::string(n) + " (q8 code)");
    sp.absmax_names.push_back(std::string(n) + " (q8 absmax of its block)");
  }
  for (std::size_t t = 0; t < nt; ++t) {
    sp.am[t] = a.master(t);
    sp.bm[t] = b.master(t);
    if (sp.am[t].size() != sp.bm[t].size()) return "master copies differ in size";
    sp.ac[t] = a.compensation(t);
    sp.bc[t] = b.compensation(t);
    if (sp.ac[t].size() != sp.bc[t].size()) return "compensations differ in size";
    for (std::size_t s = 0; s < names.size(); ++s) {
      sp.ast[s].push_back(stored_state(a, t, names[s]));
      sp.bst[s].push_back(stored_state(b, t, names[s]));
      const Stored &x = sp.ast[s][t], &y = sp.bst[s][t];
      if (x.format != y.format)
        return "state '" + std::string(names[s]) + "' of " + buf.name(t) + " is stored as " +
               std::string(state_format_name(x.format)) + " by one optimizer and as " +
               std::string(state_format_name(y.format)) + " by the other";
      sp.all_f32 = sp.all_f32 && x.format == StateFormat::f32;
      sp.as[s].push_back(x.f32);
      sp.bs[s].push_back(y.f32);
      if (stored_size(x) != stored_size(y) || stored_size(x) != static_cast<std::size_t>(buf.numel(t)) ||
          x.absmax.size() != y.absmax.size())
        return "state '" + std::string(names[s]) + "' has the wrong size";
    }
  }
  return "";
}

// Element i of tensor t of every state stream, bit for bit as stored: the fp32 value, the bf16
// bits, or the q8 code, and at the first element of each q8 block its absmax.
// bf16_rounded: the two steps round bf16 state differently (stochastically and to nearest):
// a bf16 value must be the other's or the one next to it.
void check_state_bits(Tally& tl, const Spans& sp, const std::vector<std::string_view>& names, const ModelBuffers& buf,
                      std::size_t t, std::int64_t i, bool bf16_rounded = false) {
  for (std::size_t s = 0; s < names.size(); ++s) {
    const Stored &x = sp.ast[s][t], &y = sp.bst[s][t];
    switch (x.format) {
      case StateFormat::f32:
        tl.check_bits(x.f32[static_cast<std::size_t>(i)], y.f32[static_cast<std::size_t>(i)], buf, t, i, names[s], 0.0);
        break;
      case StateFormat::bf16:
        if (bf16_rounded) tl.check_rounded(x.bf16_bits(i), y.bf16_bits(i), buf, t, i, 0.0, names[s]);
        else tl.check_bits(x.bits_value(i), y.bits_value(i), buf, t, i, names[s], 0.0);
        break;
      case StateFormat::q8: {
        tl.check_bits(x.bits_value(i), y.bits_value(i), buf, t, i, sp.code_names[s], 0.0);
        if (i % Stored::kBlock == 0) {
          const auto b = static_cast<std::size_t>(i / Stored::kBlock);
          tl.check_bits(x.absmax[b], y.absmax[b], buf, t, i, sp.absmax_names[s], 0.0);
        }
        break;
      }
    }
  }
}

// The per-thread tallies added into `rep` (worst: the largest worst_ratio); returns the
// gradient elements written, summed.
std::int64_t merge(const std::vector<Tally>& tallies, const std::vector<std::int64_t>& grads_written,
                   VerifyReport& rep) {
  std::int64_t written = 0;
  for (std::size_t k = 0; k < tallies.size(); ++k) {
    const Tally& tl = tallies[k];
    rep.values_checked += tl.checked;
    rep.mismatches += tl.bad;
    rep.identical += tl.identical;
    rep.rounded_apart += tl.apart;
    written += grads_written[k];
    if (tl.worst_ratio > rep.worst_ratio || (rep.worst.empty() && !tl.worst.empty())) {
      rep.worst_ratio = tl.worst_ratio;
      rep.worst = tl.worst;
    }
  }
  return written;
}

// Walks every element of the two lists (`ab` and the other, same layout) with `threads`
// threads: check(tally, t, i, initial weight) compares what the caller compares, one Tally
// per thread; then counts the gradients of `ab` that differ from what was filled (the step
// wrote them). Adds the tallies into `rep`, and a problem when a gradient was written.
template <class Check>
void compare_elements(const ModelBuffers& ab, double loss_scale, int threads, std::string_view a_name,
                      std::string_view b_name, VerifyReport& rep, Check&& check) {
  Tally blank;
  blank.a_name = a_name, blank.b_name = b_name;
  std::vector<Tally> tallies(static_cast<std::size_t>(std::max(threads, 1)), blank);
  std::vector<std::int64_t> grads_written(tallies.size(), 0);
  parallel_for(ab.total_numel(), threads, [&](int th, std::int64_t lo, std::int64_t hi) {
    ab.for_each_piece(lo, hi, [&](std::size_t t, std::int64_t b, std::int64_t e) {
      const TensorView ag = ab.grad(t);
      const std::int64_t base = ab.offset(t);
      for (std::int64_t i = b; i < e; ++i) {
        check(tallies[th], t, i, ab.initial_weight(base + i));
        const float g = load_as_f32(ag.data, ab.grad_dtype(), i), g0 = ab.initial_grad(loss_scale, base + i);
        if (std::bit_cast<std::uint32_t>(g) != std::bit_cast<std::uint32_t>(g0)) ++grads_written[th];
      }
    });
  });
  if (const std::int64_t written = merge(tallies, grads_written, rep); written > 0)
    rep.problems.push_back("the " + std::string(a_name) + " step wrote " + std::to_string(written) +
                           " gradient elements (it must not write gradients)");
}

// What compare_bitwise and compare_rounding check before any element: both steps applied,
// found_inf, the grad norm, clip coefficient and per-tensor gradient norms as bits, the step
// counts and state streams, and that both optimizers hold the benchmark's tensor list.
// Adds a problem to `rep` for each that fails.
void check_steps_bitwise(const Optimizer& a, const ModelBuffers& ab, const StepResult& ra, const Optimizer& b,
                         const ModelBuffers& bb, const StepResult& rb, std::string_view a_name,
                         std::string_view b_name, VerifyReport& rep) {
  const std::string an(a_name), bn(b_name);
  auto problem = [&](const std::string& s) { rep.problems.push_back(s); };
  auto same_bits = [](double x, double y) {
    return std::bit_cast<std::uint64_t>(x) == std::bit_cast<std::uint64_t>(y);
  };
  auto differ = [&](const char* what, double x, double y) {
    char s[200];
    std::snprintf(s, sizeof s, "%s differ: %s %.17g, %s %.17g", what, an.c_str(), x, bn.c_str(), y);
    problem(s);
  };
  if (!ra.applied || !rb.applied)
    problem("a step was skipped (" + an + " applied=" + (ra.applied ? "yes" : "no") + ", " + bn +
            " applied=" + (rb.applied ? "yes" : "no") + ") on finite gradients");
  if (ra.found_inf != rb.found_inf) problem("found_inf differs between " + an + " and " + bn);
  if (!same_bits(ra.grad_norm, rb.grad_norm)) differ("gradient norms", ra.grad_norm, rb.grad_norm);
  if (!same_bits(ra.clip_coef, rb.clip_coef)) differ("clip coefficients", ra.clip_coef, rb.clip_coef);
  const std::vector<double>&tna = a.last_tensor_grad_norms(), &tnb = b.last_tensor_grad_norms();
  if (tna.size() != tnb.size()) {
    problem("the per-tensor gradient norms differ in count");
  } else {
    for (std::size_t t = 0; t < tna.size(); ++t)
      if (!same_bits(tna[t], tnb[t])) {
        differ(("per-tensor gradient norms of " + ab.name(t)).c_str(), tna[t], tnb[t]);
        break;
      }
  }
  if (a.step_count() != b.step_count()) problem("step counts differ");
  if (a.state_names() != b.state_names()) problem("the optimizers have different state streams");
  if (a.num_params() != ab.num_tensors() || b.num_params() != bb.num_tensors() || ab.num_tensors() != bb.num_tensors())
    problem("the optimizers do not hold the benchmark's tensor list");
}

}  // namespace

VerifyReport compare_one_step(const Optimizer& fused, const ModelBuffers& fb, const StepResult& rf,
                              const Optimizer& unfused, const ModelBuffers& ub, const StepResult& ru,
                              double loss_scale, int threads, std::string_view fused_name,
                              std::string_view unfused_name) {
  const std::string fn(fused_name), un(unfused_name);
  VerifyReport rep;
  rep.rel_tol = grad_rel_tol(fb.grad_dtype());
  const double rel = rep.rel_tol;
  auto problem = [&](const std::string& s) { rep.problems.push_back(s); };

  if (!rf.applied || !ru.applied)
    problem("a step was skipped (" + fn + " applied=" + (rf.applied ? "yes" : "no") + ", " + un +
            " applied=" + (ru.applied ? "yes" : "no") + ") on finite gradients");
  if (rf.found_inf != ru.found_inf) problem("found_inf differs between " + fn + " and " + un);
  auto close = [&](double a, double b) { return std::fabs(a - b) <= rel * std::max(std::fabs(a), std::fabs(b)); };
  // A NaN norm is one the step did not compute (the unfused baseline runs no norm pass
  // without clipping): compare the norms where both steps computed one.
  if (!std::isnan(rf.grad_norm) && !std::isnan(ru.grad_norm) && !close(rf.grad_norm, ru.grad_norm)) {
    char s[200];
    std::snprintf(s, sizeof s, "gradient norms differ: %s %.9g, %s %.9g", fn.c_str(), rf.grad_norm, un.c_str(),
                  ru.grad_norm);
    problem(s);
  }
  if (!close(rf.clip_coef, ru.clip_coef)) {
    char s[200];
    std::snprintf(s, sizeof s, "clip coefficients differ: %s %.9g, %s %.9g", fn.c_str(), rf.clip_coef, un.c_str(),
                  ru.clip_coef);
    problem(s);
  }
  if (fused.step_count() != unfused.step_count()) problem("step counts differ");
  const auto names = fused.state_names();
  if (names != unfused.state_names()) problem("the optimizers have different state streams");
  if (fused.num_params() != fb.num_tensors() || unfused.num_params() != ub.num_tensors() ||
      fb.num_tensors() != ub.num_tensors())
    problem("the optimizers do not hold the benchmark's tensor list");
  if (!rep.problems.empty()) return rep;

  Spans sp;
  if (std::string p = gather_spans(fused, unfused, fb, names, sp); !p.empty()) return problem(p), rep;
  if (!sp.all_f32)
    return problem("the state is stored as bf16 or q8 (OptimizerOptions::state_format): compare such steps bit for "
                   "bit (compare_bitwise), not within fp32 rounding"),
           rep;
  const auto &fm = sp.am, &um = sp.bm;
  const auto &fc = sp.ac, &uc = sp.bc;
  const auto &fs = sp.as, &us = sp.bs;

  const DType wt = fb.weight_dtype();
  const double weight_ulps = wt == DType::f32 ? 4.0 : 1.0;
  const auto check = [&](Tally& tl, std::size_t t, std::int64_t i, double p0) {
    const double a = load_as_f32(fb.weight(t).data, wt, i), u = load_as_f32(ub.weight(t).data, wt, i);
    tl.check(a, u, rel * std::fabs(u - p0) + weight_ulps * storage_ulp(wt, std::max(std::fabs(a), std::fabs(u))), fb,
             t, i, "weight", p0);
    if (!fm[t].empty()) {
      const double ma = fm[t][i], mu = um[t][i];
      tl.check(ma, mu, rel * std::fabs(mu - p0) + 4.0 * storage_ulp(DType::f32, std::max(std::fabs(ma), std::fabs(mu))),
               fb, t, i, "master", p0);
    }
    // A compensated bf16 weight: the parameter is weight + compensation (an fp32 add, as the
    // step reads it), compared as a master is. Each side is its fp32 parameter split into two
    // bf16 values, within half a unit of its compensation's last place: one unit more of slack.
    // (Compensations alone are not compared: a weight rounded the other way moves its
    // compensation by a weight's unit, and weight + compensation stays put.)
    if (!fc[t].empty()) {
      const float ca = bf16_to_f32(fc[t][i]), cu = bf16_to_f32(uc[t][i]);
      const double pa = static_cast<float>(a) + ca, pu = static_cast<float>(u) + cu;
      tl.check(pa, pu,
               rel * std::fabs(pu - p0) + storage_ulp(DType::bf16, std::max(std::fabs(ca), std::fabs(cu))) +
                   4.0 * storage_ulp(DType::f32, std::max(std::fabs(pa), std::fabs(pu))),
               fb, t, i, "weight + compensation", p0);
    }
    for (std::size_t s = 0; s < names.size(); ++s) {
      const double sa = fs[s][t][i], su = us[s][t][i];
      const double mx = std::max(std::fabs(sa), std::fabs(su));
      tl.check(sa, su, 2.0 * rel * mx + 4.0 * storage_ulp(DType::f32, mx) + 1e-37, fb, t, i, names[s], 0.0);
    }
  };
  compare_elements(fb, loss_scale, threads, fused_name, unfused_name, rep, check);
  return rep;
}

VerifyReport compare_bitwise(const Optimizer& a, const ModelBuffers& ab, const StepResult& ra, const Optimizer& b,
                             const ModelBuffers& bb, const StepResult& rb, double loss_scale, int threads,
                             std::string_view a_name, std::string_view b_name) {
  VerifyReport rep;
  check_steps_bitwise(a, ab, ra, b, bb, rb, a_name, b_name, rep);
  if (!rep.problems.empty()) return rep;

  const auto names = a.state_names();
  Spans sp;
  if (std::string p = gather_spans(a, b, ab, names, sp); !p.empty()) return rep.problems.push_back(p), rep;
  const DType wt = ab.weight_dtype();
  const auto check = [&](Tally& tl, std::size_t t, std::int64_t i, double p0) {
    tl.check_bits(load_as_f32(ab.weight(t).data, wt, i), load_as_f32(bb.weight(t).data, wt, i), ab, t, i, "weight", p0);
    if (!sp.am[t].empty()) tl.check_bits(sp.am[t][i], sp.bm[t][i], ab, t, i, "master", p0);
    if (!sp.ac[t].empty())
      tl.check_bits(bf16_to_f32(sp.ac[t][i]), bf16_to_f32(sp.bc[t][i]), ab, t, i, "compensation", p0);
    check_state_bits(tl, sp, names, ab, t, i);
  };
  compare_elements(ab, loss_scale, threads, a_name, b_name, rep, check);
  rep.worst_ratio = 0;  // the largest |difference| is in `worst`; there is no tolerance to be a fraction of
  return rep;
}

VerifyReport compare_rounding(const Optimizer& sr, const ModelBuffers& sr_buf, const StepResult& rs,
                              const Optimizer& rn, const ModelBuffers& rn_buf, const StepResult& rr,
                              double loss_scale, int threads, std::string_view sr_name, std::string_view rn_name) {
  VerifyReport rep;
  check_steps_bitwise(sr, sr_buf, rs, rn, rn_buf, rr, sr_name, rn_name, rep);
  if (sr_buf.weight_dtype() != DType::bf16 || rn_buf.weight_dtype() != DType::bf16)
    rep.problems.push_back("the weights are not bf16 (stochastic rounding rounds bf16 weights)");
  if (!rep.problems.empty()) return rep;

  const auto names = sr.state_names();
  Spans sp;
  if (std::string p = gather_spans(sr, rn, sr_buf, names, sp); !p.empty()) return rep.problems.push_back(p), rep;
  const auto check = [&](Tally& tl, std::size_t t, std::int64_t i, double p0) {
    tl.check_rounded(static_cast<const std::uint16_t*>(sr_buf.weight(t).data)[i],
                     static_cast<const std::uint16_t*>(rn_buf.weight(t).data)[i], sr_buf, t, i, p0);
    // (bf16 state rounds stochastically too, unless stochastic_state_rounding is off: then bitwise)
    check_state_bits(tl, sp, names, sr_buf, t, i, /*bf16_rounded=*/sr.options().stochastic_state_rounding);
  };
  compare_elements(sr_buf, loss_scale, threads, sr_name, rn_name, rep, check);
  rep.worst_ratio = 0;  // `worst` describes a value that differs; there is no tolerance to be a fraction of
  return rep;
}

std::string check_step_effect(const ModelBuffers& b, int threads) {
  std::vector<std::int64_t> nonfinite(static_cast<std::size_t>(std::max(threads, 1)), 0),
      unchanged(nonfinite.size(), 0);
  parallel_for(b.total_numel(), threads, [&](int th, std::int64_t lo, std::int64_t hi) {
    b.for_each_piece(lo, hi, [&](std::size_t t, std::int64_t s, std::int64_t e) {
      const TensorView w = b.weight(t);
      for (std::int64_t i = s; i < e; ++i) {
        const float x = load_as_f32(w.data, w.dtype, i);
        nonfinite[th] += !std::isfinite(x);
        unchanged[th] += x == b.initial_weight(b.offset(t) + i);
      }
    });
  });
  std::int64_t bad = 0, same = 0;
  for (std::size_t k = 0; k < nonfinite.size(); ++k) bad += nonfinite[k], same += unchanged[k];
  if (bad > 0) return std::to_string(bad) + " weights are not finite after one step";
  if (2 * same > b.total_numel())
    return std::to_string(same) + " of " + std::to_string(b.total_numel()) + " weights did not change in one step";
  return "";
}

}  // namespace stepfuse::bench
