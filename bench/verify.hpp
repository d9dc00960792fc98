// Checks a benchmark's results before anything is timed: fused against unfused, or "the step did something".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model_buffers.hpp"
#include "stepfuse/optimizer.hpp"

namespace stepfuse::bench {

struct VerifyReport {
  bool ok() const { return problems.empty() && mismatches == 0; }
  double rel_tol = 0;                 // relative tolerance on the update (see compare_one_step)
  std::int64_t values_checked = 0;    // weights, masters, compensations, state values compared
  std::int64_t identical = 0;         // values bitwise equal
  std::int64_t mismatches = 0;        // values outside the tolerance
  std::int64_t rounded_apart = 0;     // compare_rounding: weights stored as the other bf16 neighbour
  double worst_ratio = 0;             // max |fused - unfused| / tolerance over all values
  std::string worst;                  // the value with worst_ratio, described
  std::vector<std::string> problems;  // step-level disagreements (skipped step, norm, grads written)
};

// Compares two optimizers that each took exactly one step_scaled(loss_scale) from
// identical inputs (`fb`/`ub` filled the same way, fresh optimizers): the step results, the
// gradient norms, every weight, master and state value (for compensated bf16 weights,
// weight + compensation as a master, with one more unit of the compensation's last place),
// and that the checked step (`fused`) left its gradients untouched. `fused` may be any
// mode checked against the reference `unfused` (interpreted against unfused, say); the
// names only label the messages. Values agree when
//   |fused - unfused| <= rel * |unfused - initial| + k ulp(max(|fused|, |unfused|))
// (k = 4 in fp32, 1 in a 16-bit weight format; states use 2 * rel * |value|; f32 state only:
// state stored as bf16 or q8 is a problem, compare such steps with compare_bitwise), where rel is
// 1e-5 for fp32 gradients (docs/architecture.md §8) and the gradient format's rounding for 16-bit ones:
// the unfused baseline writes the unscaled, clipped gradients back in their own dtype, as
// eager PyTorch does. Reads everything with `threads` threads; allocates nothing large.
VerifyReport compare_one_step(const Optimizer& fused, const ModelBuffers& fb, const StepResult& rf,
                              const Optimizer& unfused, const ModelBuffers& ub, const StepResult& ru,
                              double loss_scale, int threads, std::string_view fused_name = "fused",
                              std::string_view unfused_name = "unfused");

// Compares two optimizers that must compute the same step bit for bit (one fused step on
// two CPU backends, or a fused and an unfused step storing bf16 or q8 state), each after
// exactly one step_scaled(loss_scale) from identical inputs: the step results (grad norm and
// clip coefficient as bits), the per-tensor gradient norms, every weight (as stored), master,
// compensation and state value as stored (OptimizerOptions::state_format: fp32 values, bf16
// bits, or q8 codes and each block's absmax, which then count as values too; both optimizers
// must store each stream alike), and that `a` left its gradients untouched. rel_tol and
// worst_ratio are 0; mismatches counts values whose bits differ and worst describes the one
// that differs most. Reads with `threads` threads; allocates nothing large.
VerifyReport compare_bitwise(const Optimizer& a, const ModelBuffers& ab, const StepResult& ra, const Optimizer& b,
                             const ModelBuffers& bb, const StepResult& rb, double loss_scale, int threads,
                             std::string_view a_name, std::string_view b_name);

// Compares a step that rounds bf16 weights stochastically (`sr`) with the same step rounding
// them to nearest even (`rn`), each after exactly one step_scaled(loss_scale) from identical
// inputs (bf16 weights without masters). The two compute the same fp32 values and differ
// only in which of the two bf16 values around each updated weight they store, so: the step
// results, per-tensor gradient norms and every state value bitwise equal (as
// compare_bitwise), and every weight of `sr` finite and either `rn`'s or the bf16 value
// next to it (their bits, sign apart, differ by at most 1); rounded_apart counts the latter.
// mismatches counts the weights and values that break this and worst describes one of them.
// rel_tol and worst_ratio are 0. Reads with `threads` threads; allocates nothing large.
VerifyReport compare_rounding(const Optimizer& sr, const ModelBuffers& sr_buf, const StepResult& rs,
                              const Optimizer& rn, const ModelBuffers& rn_buf, const StepResult& rr,
                              double loss_scale, int threads, std::string_view sr_name, std::string_view rn_name);

// For benchmarks that time one mode: after one step from fill_weights() values, every weight
// is finite and most moved. Returns "" when so, else what is wrong.
std::string check_step_effect(const ModelBuffers& b, int threads);

}  // namespace stepfuse::bench
