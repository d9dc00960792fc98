// ShardedOptimizer (ZeRO-2) with N in-process ranks, each with its own full copy of
// the weights and its own gradients: after every step every rank's weights are
// bitwise those of a one-process Optimizer stepped on the averaged gradients
// (summed in fp32 in rank order — the test communicator's order — and divided by
// N), with the same StepResult; the owned state and masters are the one-process
// optimizer's. Also: an inf on one rank skips the step everywhere, GradScaler,
// the bf16 wire, the partition, the bytes per step, and the collective errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "local_communicator.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using testing::expect_every_rank_throws;
using testing::LocalGroup;

// bf16 <-> fp32 inline (the test's hot loops; no NaN here): round to nearest even,
// as float_to_bf16 does for every non-NaN value.
std::uint16_t to_bf16(float x) {
  const auto u = std::bit_cast<std::uint32_t>(x);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

// One copy of the model's tensors (each its own dtype).
class Tensors {
 public:
  Tensors(const std::vector<std::int64_t>& sizes, const std::vector<DType>& dtypes) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      store_.emplace_back((static_cast<std::size_t>(sizes[t]) * dtype_size(dtypes[t]) + 7) / 8 + 1, 0);
      views_.push_back({store_.back().data(), sizes[t], dtypes[t]});
    }
  }
  const TensorView& operator[](std::size_t t) const { return views_[t]; }
  std::size_t size() const { return views_.size(); }
  void set(std::size_t t, std::int64_t j, float x) const {
    const TensorView& v = views_[t];
    if (v.dtype == DType::f32) static_cast<float*>(v.data)[j] = x;
    else static_cast<std::uint16_t*>(v.data)[j] = v.dtype == DType::bf16 ? to_bf16(x) : float_to_f16(x);
  }
  float get(std::size_t t, std::int64_t j) const {
    const TensorView& v = views_[t];
    if (v.dtype == DType::f32) return static_cast<const float*>(v.data)[j];
    const std::uint16_t b = static_cast<const std::uint16_t*>(v.data)[j];
    return v.dtype == DType::bf16 ? from_bf16(b) : f16_to_float(b);
  }
  void restore(const std::vector<unsigned char>& bytes) const {
    std::size_t at = 0;
    for (const TensorView& v : views_) {
      const std::size_t n = static_cast<std::size_t>(v.numel) * dtype_size(v.dtype);
      if (n) std::memcpy(v.data, bytes.data() + at, n);
      at += n;
    }
  }
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> out;
    for (const TensorView& v : views_) {
      const auto* p = static_cast<const unsigned char*>(v.data);
      out.insert(out.end(), p, p + static_cast<std::size_t>(v.numel) * dtype_size(v.dtype));
    }
    return out;
  }

 private:
  std::vector<std::vector<std::uint64_t>> store_;
  std::vector<TensorView> views_;
};

float round_to(DType t, float x) {
  return t == DType::f32 ? x : t == DType::bf16 ? from_bf16(to_bf16(x)) : f16_to_float(float_to_f16(x));
}

// A Communicator over another that sums f16/bf16 (which the in-process one does not):
// through an all_gather, in rank order, each add in fp32 rounded once (as MPI's
// operation does). It also records each collective's per-rank block, in bytes.
class Counting final : public Communicator {
 public:
  explicit Counting(std::shared_ptr<Communicator> base) : base_(std::move(base)) {}
  int rank() const override { return base_->rank(); }
  int size() const override { return base_->size(); }
  std::string_view name() const override { return "counting"; }
  void all_gather(const void* send, void* recv, std::size_t count, CommType type) override {
    all_gathers.push_back(count * comm_type_size(type));
    base_->all_gather(send, recv, count, type);
  }
  void all_reduce(void* data, std::size_t count, CommType type, ReduceOp op) override {
    all_reduces.push_back(count * comm_type_size(type));
    base_->all_reduce(data, count, type, op);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, CommType type, ReduceOp op) override {
    reduce_scatters.push_back(count * comm_type_size(type));
    if (type != CommType::f16 && type != CommType::bf16) return base_->reduce_scatter(send, recv, count, type, op);
    const DType d = type == CommType::f16 ? DType::f16 : DType::bf16;
    const auto n = static_cast<std::size_t>(size());
    std::vector<std::uint16_t> all(n * n * count);
    base_->all_gather(send, all.data(), n * count, type);
    auto* out = static_cast<std::uint16_t*>(recv);
    const auto mine = static_cast<std::size_t>(rank()) * count;
    for (std::size_t i = 0; i < count; ++i) {
      float acc = widen(d, all[mine + i]);
      for (std::size_t k = 1; k < n; ++k) acc = round_to(d, acc + widen(d, all[k * n * count + mine + i]));
      out[i] = d == DType::bf16 ? to_bf16(acc) : float_to_f16(acc);
    }
  }
  std::vector<std::size_t> all_gathers, all_reduces, reduce_scatters;

 private:
  static float widen(DType d, std::uint16_t b) { return d == DType::bf16 ? from_bf16(b) : f16_to_float(b); }
  std::shared_ptr<Communicator> base_;
};

// A gradient element of rank `rank`, from (step, rank, tensor, element) alone:
// uniform in (-1, 1), times 2^-8, 1 or 2^8 by tensor.
float grad_value(int step, int rank, std::size_t tensor, std::int64_t j) {
  std::uint64_t x = (static_cast<std::uint64_t>(step) << 52) ^ (static_cast<std::uint64_t>(rank) << 46) ^
                    (static_cast<std::uint64_t>(tensor) << 40) ^ static_cast<std::uint64_t>(j);
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  return static_cast<float>((static_cast<double>(x >> 11) * 0x1p-53 * 2.0 - 1.0) *
                            std::ldexp(1.0, 8 * (static_cast<int>(tensor % 3) - 1)));
}

// A model: tensors, their dtypes, and groups (each up to a tensor index, with a config).
struct Case {
  std::vector<std::int64_t> sizes = {40000, 100, 0, 16384, 50000, 7, 33000};
  std::vector<DType> weight, grad;  // per tensor (empty: all f32)
  std::vector<std::pair<std::size_t, OptimizerConfig>> groups = {{7, optim::AdamW{.lr = 1e-2}}};
  std::optional<double> max_grad_norm;
  double norm_type = 2.0;
  bool masters = true;
  bool compensated = false;  // compensated_weights (needs masters = false)
  bool scaled = false;  // step_scaled(S) (grads scaled by S), else step()
  double S = 1024.0;
  bool scaler = false;  // step(GradScaler&): grads scaled by the scaler's scale
  int inf_step = -1, inf_rank = 0;
  std::size_t inf_tensor = 0;
  ShardedOptions sharded;
  int steps = 4;

  DType w(std::size_t t) const { return weight.empty() ? DType::f32 : weight[t]; }
  DType g(std::size_t t) const { return grad.empty() ? DType::f32 : grad[t]; }
  std::vector<DType> weights() const {
    std::vector<DType> v;
    for (std::size_t t = 0; t < sizes.size(); ++t) v.push_back(w(t));
    return v;
  }
  std::vector<DType> grads() const {
    std::vector<DType> v;
    for (std::size_t t = 0; t < sizes.size(); ++t) v.push_back(g(t));
    return v;
  }
  OptimizerOptions options() const {
    OptimizerOptions o;
    o.max_grad_norm = max_grad_norm;
    o.norm_type = norm_type;
    o.cpu_backend = CpuBackend::highway;
    o.num_threads = 1;
    o.master_weights = masters;
    o.compensated_weights = compensated;
    return o;
  }
  void init_weights(const Tensors& w) const {
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::int64_t j = 0; j < sizes[t]; ++j) w.set(t, j, static_cast<float>(std::sin(0.37 * static_cast<double>(j) + static_cast<double>(t))));
  }
  // Rank r's gradients of step k (scaled by `scale`), rounded to their dtype.
  float local_grad(int k, int r, std::size_t t, std::int64_t j, double scale) const {
    if (k == inf_step && r == inf_rank && t == inf_tensor && j == 3) return INFINITY;
    return round_to(g(t), static_cast<float>(grad_value(k, r, t, j) * scale));
  }
  void fill(const Tensors& g, int k, int r, double scale) const {
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::int64_t j = 0; j < sizes[t]; ++j) g.set(t, j, local_grad(k, r, t, j, scale));
  }
  // The average the ShardedOptimizer computes: summed in rank order (in the wire's
  // type, each add rounded), then divided by R in fp32.
  void fill_average(const Tensors& g, int k, int ranks, double scale) const {
    const DType wire = ranks == 1 ? DType::f32
                       : sharded.grad_type == CommType::bf16 ? DType::bf16
                       : sharded.grad_type == CommType::f16  ? DType::f16
                                                              : DType::f32;
    for (std::size_t t = 0; t < sizes.size(); ++t)
      for (std::int64_t j = 0; j < sizes[t]; ++j) {
        float acc = round_to(wire, local_grad(k, 0, t, j, scale));
        for (int r = 1; r < ranks; ++r) acc = round_to(wire, acc + round_to(wire, local_grad(k, r, t, j, scale)));
        g.set(t, j, acc / static_cast<float>(ranks));
      }
  }
  std::vector<ParamGroup> param_groups(const Tensors& w, const Tensors& g) const {
    std::vector<ParamGroup> out;
    std::size_t t = 0;
    for (const auto& [end, config] : groups) {
      ParamGroup pg;
      pg.config = config;
      for (; t < end; ++t) pg.params.push_back({w[t], g[t]});
      out.push_back(std::move(pg));
    }
    return out;
  }
};

struct Trace {
  std::vector<StepResult> results;               // per step
  std::vector<std::vector<unsigned char>> weights;  // per step, after it
  std::vector<float> scales;                     // GradScaler: per step, after update()
};

void expect_same_result(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.applied, b.applied) << what;
  EXPECT_EQ(a.found_inf, b.found_inf) << what;
  EXPECT_TRUE(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)) == 0 || (std::isnan(a.grad_norm) && std::isnan(b.grad_norm)))
      << what << ": grad_norm " << a.grad_norm << " vs " << b.grad_norm;
  EXPECT_EQ(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof(double)), 0) << what << ": clip_coef " << a.clip_coef << " vs " << b.clip_coef;
}

// The one-process Optimizer on the averaged gradients (f32); returns its trace and
// leaves it in `out` for the state checks.
Trace one_process(const Case& c, int ranks, std::unique_ptr<Optimizer>& out, std::unique_ptr<Tensors>& w,
                  std::unique_ptr<Tensors>& g) {
  w = std::make_unique<Tensors>(c.sizes, c.weights());
  g = std::make_unique<Tensors>(c.sizes, std::vector<DType>(c.sizes.size(), DType::f32));
  c.init_weights(*w);
  out = std::make_unique<Optimizer>(c.param_groups(*w, *g), c.options());
  GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
  Trace trace;
  for (int k = 0; k < c.steps; ++k) {
    const double scale = c.scaler ? scaler.get_scale() : c.scaled ? c.S : 1.0;
    c.fill_average(*g, k, ranks, scale);
    if (c.scaler) {
      scaler.step(*out);
      trace.results.push_back(scaler.last_step_result());
      scaler.update();
      trace.scales.push_back(static_cast<float>(scaler.get_scale()));
    } else if (c.scaled) {
      trace.results.push_back(out->step_scaled(c.S));
    } else {
      out->step();
      trace.results.push_back(out->last_result());
    }
    trace.weights.push_back(w->bytes());
  }
  return trace;
}

// What a rank owns at the end: per shard() param with a model tensor, its slice, state,
// master and compensation.
struct Owned {
  TensorSlice slice;
  std::int64_t numel;
  std::vector<std::vector<float>> state;
  std::vector<float> master;
  std::vector<std::uint16_t> compensation;
};

struct RankRun {
  Trace trace;
  std::vector<Owned> owned;
  std::vector<std::string> state_names;
  ShardedOptimizer::Range range;
  ShardedOptimizer::Traffic traffic;
  std::vector<std::size_t> reduce_scatters, all_gathers;
};

std::vector<RankRun> sharded_run(const Case& c, int ranks) {
  std::vector<RankRun> runs(static_cast<std::size_t>(ranks));
  LocalGroup group(ranks);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& base) {
    auto comm = std::make_shared<Counting>(base);
    Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
    c.init_weights(w);
    ShardedOptimizer opt(c.param_groups(w, g), comm, c.options(), c.sharded);
    GradScaler scaler("cpu", 1024.0, 2.0, 0.5, 2);
    RankRun& run = runs[static_cast<std::size_t>(r)];
    comm->all_gathers.clear();
    comm->reduce_scatters.clear();
    for (int k = 0; k < c.steps; ++k) {
      const double scale = c.scaler ? scaler.get_scale() : c.scaled ? c.S : 1.0;
      c.fill(g, k, r, scale);
      if (c.scaler) {
        opt.step(scaler);
        run.trace.results.push_back(scaler.last_step_result());
        scaler.update();
        run.trace.scales.push_back(static_cast<float>(scaler.get_scale()));
      } else if (c.scaled) {
        run.trace.results.push_back(opt.step_scaled(c.S));
      } else {
        run.trace.results.push_back(opt.step());
      }
      run.trace.weights.push_back(w.bytes());
    }
    const Optimizer& s = opt.shard();
    for (std::string_view n : s.state_names()) run.state_names.emplace_back(n);
    for (std::size_t i = 0; i < s.num_params(); ++i) {
      const TensorSlice sl = opt.shard_slices()[i];
      if (sl.tensor >= static_cast<std::int64_t>(opt.num_tensors())) {
        EXPECT_EQ(s.params()[i].weight.numel, 0) << "rank " << r;
        continue;
      }
      Owned o{sl, s.params()[i].weight.numel, {}, {}, {}};
      for (std::string_view n : s.state_names()) {
        const auto st = s.state(i, n);
        o.state.emplace_back(st.begin(), st.end());
      }
      const auto m = s.master(i);
      o.master.assign(m.begin(), m.end());
      const auto comp = s.compensation(i);
      o.compensation.assign(comp.begin(), comp.end());
      run.owned.push_back(std::move(o));
    }
    run.range = opt.range();
    run.traffic = opt.traffic();
    run.reduce_scatters = comm->reduce_scatters;
    run.all_gathers = comm->all_gathers;
  });
  for (int r = 0; r < ranks; ++r) {
    if (!errors[static_cast<std::size_t>(r)]) continue;
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " threw: " << e.what();
    }
  }
  return runs;
}

// Every rank after every step: the one-process weights and result, bit for bit;
// at the end, each owned slice's state and master are the one-process ones.
void expect_matches_one_process(const Case& c, int ranks, const std::string& what) {
  std::unique_ptr<Optimizer> ref;
  std::unique_ptr<Tensors> rw, rg;
  const Trace want = one_process(c, ranks, ref, rw, rg);
  // The data makes every step but the inf's apply (else the comparison would be idle).
  for (std::size_t k = 0; k < want.results.size(); ++k)
    EXPECT_EQ(want.results[k].applied, static_cast<int>(k) != c.inf_step) << what << ", step " << k;
  const std::vector<RankRun> runs = sharded_run(c, ranks);
  for (int r = 0; r < ranks; ++r) {
    const RankRun& run = runs[static_cast<std::size_t>(r)];
    const std::string at = what + ", " + std::to_string(ranks) + " ranks, rank " + std::to_string(r);
    ASSERT_EQ(run.trace.results.size(), want.results.size()) << at;
    for (std::size_t k = 0; k < want.results.size(); ++k) {
      expect_same_result(run.trace.results[k], want.results[k], at + ", step " + std::to_string(k));
      EXPECT_TRUE(run.trace.weights[k] == want.weights[k]) << at << ", step " << k << ": weights differ";
    }
    EXPECT_EQ(run.trace.scales, want.scales) << at;
    // The owned state and masters, against the one-process optimizer's.
    std::vector<std::string> names;
    for (std::string_view n : ref->state_names()) names.emplace_back(n);
    EXPECT_EQ(run.state_names, names) << at;
    std::int64_t owned = 0;
    for (const Owned& o : run.owned) {
      const auto t = static_cast<std::size_t>(o.slice.tensor);
      owned += o.numel;
      for (std::size_t s = 0; s < names.size() && s < o.state.size(); ++s) {
        const auto full = ref->state(t, names[s]);
        if (full.empty()) {
          EXPECT_TRUE(o.state[s].empty()) << at;
          continue;
        }
        EXPECT_EQ(std::memcmp(o.state[s].data(), full.data() + o.slice.offset, static_cast<std::size_t>(o.numel) * 4), 0)
            << at << ": state " << names[s] << " of tensor " << t;
      }
      const auto m = ref->master(t);
      ASSERT_EQ(o.master.empty(), m.empty()) << at;
      if (!m.empty()) {
        EXPECT_EQ(std::memcmp(o.master.data(), m.data() + o.slice.offset, static_cast<std::size_t>(o.numel) * 4), 0)
            << at << ": master of tensor " << t;
      }
      const auto comp = ref->compensation(t);
      ASSERT_EQ(o.compensation.empty(), comp.empty()) << at;
      if (!comp.empty()) {
        EXPECT_EQ(std::memcmp(o.compensation.data(), comp.data() + o.slice.offset, static_cast<std::size_t>(o.numel) * 2), 0)
            << at << ": compensation of tensor " << t;
      }
    }
    EXPECT_EQ(owned, run.range.size()) << at;
  }
}

const DType f32 = DType::f32, bf16 = DType::bf16, f16 = DType::f16;

TEST(ShardedOptimizer, F32PlainStepsAreTheOneProcessStepOnTheAverage) {
  Case c;  // AdamW, f32, step(): no reduce pass, no clipping
  for (int ranks = 1; ranks <= 3; ++ranks) expect_matches_one_process(c, ranks, "f32 plain");
}

TEST(ShardedOptimizer, Bf16WithMastersGroupsClippingAndAnInfOnOneRank) {
  Case c;
  // Matrices in bf16 with weight decay; the last group (f32 weights, f16 and f32
  // grads) without it, and another lr.
  c.sizes = {40000, 100, 0, 16384, 50000, 33000, 7};
  c.weight = {bf16, bf16, bf16, bf16, bf16, f32, f32};
  c.grad = {bf16, bf16, bf16, bf16, bf16, f32, f16};
  c.groups = {{5, optim::AdamW{.lr = 1e-2, .weight_decay = 0.1}}, {7, optim::AdamW{.lr = 3e-3, .weight_decay = 0}}};
  c.max_grad_norm = 0.5;
  c.scaled = true;
  c.inf_step = 2;
  for (int ranks = 1; ranks <= 3; ++ranks) {
    c.inf_rank = ranks - 1;
    c.inf_tensor = 3;
    expect_matches_one_process(c, ranks, "bf16 + masters, L2 clipping");
  }
  // The inf skipped step 2 on every rank: the weights after it are those after step 1.
  std::unique_ptr<Optimizer> ref;
  std::unique_ptr<Tensors> rw, rg;
  const Trace t = one_process(c, 3, ref, rw, rg);
  EXPECT_FALSE(t.results[2].applied);
  EXPECT_TRUE(t.results[2].found_inf);
  EXPECT_TRUE(t.weights[2] == t.weights[1]);
}

TEST(ShardedOptimizer, InfNormClippingAndOtherOptimizers) {
  Case c;
  c.max_grad_norm = 0.01;
  c.norm_type = INFINITY;
  c.scaled = true;
  c.groups = {{7, optim::Adam{.lr = 1e-2}}};
  expect_matches_one_process(c, 3, "Adam, inf-norm clipping");
  c.groups = {{7, optim::SGD{.lr = 1e-2, .momentum = 0.9, .nesterov = true}}};
  c.weight = {bf16, bf16, bf16, bf16, bf16, bf16, bf16};
  c.grad = c.weight;
  expect_matches_one_process(c, 2, "SGD nesterov, bf16");
  // LAMB's trust ratio needs whole tensors: the partition never cuts them.
  c.groups = {{7, optim::LAMB{.lr = 1e-2}}};
  c.weight.clear();
  c.grad.clear();
  expect_matches_one_process(c, 3, "LAMB");
}

TEST(ShardedOptimizer, Bf16WithoutMasters) {
  Case c;  // the owners update their bf16 weights directly
  c.weight = {bf16, bf16, bf16, bf16, bf16, bf16, bf16};
  c.grad = c.weight;
  c.masters = false;
  c.scaled = true;
  c.max_grad_norm = 0.5;
  for (int ranks : {2, 3}) expect_matches_one_process(c, ranks, "bf16 without masters");
}

TEST(ShardedOptimizer, Bf16WithCompensations) {
  Case c;  // the owners keep the compensations of their slices; the weights are gathered
  c.weight = {bf16, bf16, bf16, bf16, bf16, f32, bf16};
  c.grad = c.weight;
  c.masters = false;
  c.compensated = true;
  c.scaled = true;
  c.max_grad_norm = 0.5;
  for (int ranks : {1, 2, 3}) expect_matches_one_process(c, ranks, "bf16 with compensations");
}

TEST(ShardedOptimizer, RunToRunIdentical) {
  Case c;
  c.weight = {bf16, bf16, bf16, bf16, bf16, bf16, bf16};
  c.grad = c.weight;
  c.scaled = true;
  c.max_grad_norm = 0.5;
  const auto a = sharded_run(c, 3), b = sharded_run(c, 3);
  for (std::size_t r = 0; r < 3; ++r) {
    EXPECT_TRUE(a[r].trace.weights == b[r].trace.weights) << "rank " << r;
    EXPECT_TRUE(a[r].trace.weights == a[0].trace.weights) << "rank " << r << " differs from rank 0";
    for (std::size_t k = 0; k < a[r].trace.results.size(); ++k)
      expect_same_result(a[r].trace.results[k], b[r].trace.results[k], "rank " + std::to_string(r));
  }
}

TEST(ShardedOptimizer, GradScalerDrivesTheStep) {
  Case c;
  c.weight = {bf16, bf16, bf16, bf16, bf16, bf16, bf16};
  c.grad = c.weight;
  c.scaler = true;
  c.max_grad_norm = 0.5;
  c.steps = 6;
  c.inf_step = 3;
  c.inf_tensor = 6;
  for (int ranks : {1, 2, 3}) {
    c.inf_rank = ranks - 1;
    expect_matches_one_process(c, ranks, "GradScaler");
  }
  std::unique_ptr<Optimizer> ref;
  std::unique_ptr<Tensors> rw, rg;
  c.inf_rank = 1;
  EXPECT_EQ(one_process(c, 2, ref, rw, rg).scales, (std::vector<float>{1024, 2048, 2048, 1024, 1024, 2048}))
      << "grow every 2 good steps, back off at the inf";
}

TEST(ShardedOptimizer, Bf16AndF16Wires) {
  Case c;
  c.weight = {bf16, bf16, bf16, bf16, bf16, bf16, bf16};
  c.grad = {bf16, bf16, bf16, f32, bf16, bf16, f16};  // f32 and f16 grads are rounded to the wire's type
  c.scaled = true;
  c.max_grad_norm = 0.5;
  c.sharded.grad_type = CommType::bf16;
  for (int ranks : {2, 3}) expect_matches_one_process(c, ranks, "bf16 wire");
  c.sharded.grad_type = CommType::f16;
  c.S = 1.0;
  expect_matches_one_process(c, 3, "f16 wire");
}

// The partition: contiguous ranges that cover the model, cut at chunk or tensor
// boundaries, balanced; more ranks than chunks leaves some ranks without any.
TEST(ShardedOptimizer, Partition) {
  const auto ranges_of = [](const Case& c, int ranks) {
    std::vector<ShardedOptimizer::Range> out(static_cast<std::size_t>(ranks));
    LocalGroup group(ranks);
    const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
      Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
      ShardedOptimizer opt(c.param_groups(w, g), comm, c.options());
      out[static_cast<std::size_t>(r)] = opt.range();
      EXPECT_EQ(opt.ranges().size(), static_cast<std::size_t>(ranks));
      EXPECT_EQ(opt.ranges()[static_cast<std::size_t>(r)].begin, opt.range().begin);
    });
    for (const auto& e : errors) EXPECT_FALSE(e);
    return out;
  };
  Case c;  // 139491 elements
  for (int ranks = 1; ranks <= 4; ++ranks) {
    const auto rs = ranges_of(c, ranks);
    std::vector<std::int64_t> starts = {0};
    for (std::size_t t = 0; t < c.sizes.size(); ++t) starts.push_back(starts.back() + c.sizes[t]);
    EXPECT_EQ(rs.front().begin, 0);
    EXPECT_EQ(rs.back().end, starts.back());
    for (std::size_t r = 0; r < rs.size(); ++r) {
      if (r > 0) {
        EXPECT_EQ(rs[r].begin, rs[r - 1].end);
      }
      // Each cut at a tensor boundary or a multiple of 16384 within a tensor.
      const std::int64_t cut = rs[r].begin;
      bool ok = false;
      for (std::size_t t = 0; t + 1 < starts.size(); ++t)
        ok |= cut >= starts[t] && cut <= starts[t + 1] && (cut - starts[t]) % kShardAlign == 0;
      EXPECT_TRUE(ok) << ranks << " ranks: cut at " << cut;
      // Balanced within a chunk (or the largest tensor that cannot be cut, none here).
      EXPECT_LE(std::abs(rs[r].size() - starts.back() / ranks), kShardAlign) << ranks << " ranks, rank " << r;
    }
  }
  // LAMB: whole tensors only.
  Case lamb;
  lamb.groups = {{7, optim::LAMB{}}};
  const auto lr = ranges_of(lamb, 3);
  EXPECT_EQ(lr[0].end, 40000 + 100);  // after tensor 1 (nearest tensor boundary to 46497)
  EXPECT_EQ(lr[1].end, 40000 + 100 + 16384 + 50000);
  // Two tiny tensors on three ranks: one rank owns nothing, and the steps still match.
  Case tiny;
  tiny.sizes = {100, 7};
  tiny.groups = {{1, optim::AdamW{.lr = 1e-2}}, {2, optim::AdamW{.lr = 3e-3, .weight_decay = 0}}};
  tiny.scaled = true;
  tiny.max_grad_norm = 0.5;
  const auto tr = ranges_of(tiny, 3);
  int empty = 0;
  for (const auto& r : tr) empty += r.size() == 0;
  EXPECT_GE(empty, 1);
  expect_matches_one_process(tiny, 3, "tiny model");
}

// Bytes per step: what the ranks pass to the collectives (per-rank blocks), and the
// ring-algorithm bytes per parameter against DeepSpeed ZeRO-2's.
TEST(ShardedOptimizer, BytesPerStep) {
  Case c;
  c.sizes = {1 << 18, 3 << 16, 4096, 1 << 17};  // 593920 elements
  c.weight = {bf16, bf16, f32, bf16};
  c.grad = {bf16, bf16, f32, bf16};
  c.groups = {{4, optim::AdamW{}}};
  c.scaled = true;
  c.steps = 1;
  std::ostringstream table;
  table << "bytes sent per parameter per step by each rank (ring algorithms), bf16 weights and grads:\n"
        << "  R  stepfuse f32 grads (RS + AG + partials)   stepfuse bf16 grads   ZeRO-2 (RS bf16 + AG bf16)   "
           "DeepSpeed default (bucket all-reduce bf16 + AG)\n";
  for (int ranks : {2, 3}) {
    for (CommType wire : {CommType::f32, CommType::bf16}) {
      c.sharded.grad_type = wire;
      const auto runs = sharded_run(c, ranks);
      std::int64_t n = 0;
      for (std::int64_t s : c.sizes) n += s;
      std::int64_t count = 0;
      for (const RankRun& run : runs) count = std::max(count, run.range.size());
      for (std::size_t r = 0; r < runs.size(); ++r) {
        const RankRun& run = runs[r];
        const std::size_t others = static_cast<std::size_t>(ranks - 1);
        // One reduce_scatter per step, of the largest range in the wire's type.
        ASSERT_EQ(run.reduce_scatters.size(), 1u);
        EXPECT_EQ(run.reduce_scatters[0], static_cast<std::size_t>(count) * comm_type_size(wire));
        EXPECT_EQ(run.traffic.grad_reduce_scatter, others * run.reduce_scatters[0]);
        // All_gathers per step: the step's partials, then the weights (bf16 and f32 bytes).
        ASSERT_EQ(run.all_gathers.size(), 2u);
        EXPECT_EQ(run.traffic.step_partials, others * run.all_gathers[0]);
        EXPECT_EQ(run.traffic.weight_all_gather, others * run.all_gathers[1]);
      }
      const ShardedOptimizer::Traffic& t = runs[0].traffic;
      const double per = static_cast<double>(t.total()) / static_cast<double>(n);
      if (wire == CommType::f32) {
        // The largest range is within a chunk of n / R: within 5% here.
        EXPECT_NEAR(static_cast<double>(t.grad_reduce_scatter) / static_cast<double>(n), 4.0 * (ranks - 1) / ranks,
                    0.05 * 4.0 * (ranks - 1) / ranks);
        EXPECT_LT(static_cast<double>(t.step_partials) / static_cast<double>(n), 0.001);
      }
      if (wire == CommType::f32) table << "  " << ranks << "  " << std::setprecision(4) << per;
      else
        table << "   " << per << "   " << 4.0 * (ranks - 1) / ranks << "   " << 6.0 * (ranks - 1) / ranks << "\n";
    }
  }
  std::cout << table.str();
}

// Runs fn on `ranks` ranks; expects every rank to throw an Error with `code` whose
// message contains `text` (rank `own`: `own_text`).
TEST(ShardedOptimizer, ModelsThatDifferAreRefusedOnEveryRank) {
  const auto build = [](const Case& mine, int r, const Case& other, const std::shared_ptr<Communicator>& comm,
                        ShardedOptions so = {}) {
    const Case& c = r == 1 ? other : mine;
    Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
    ShardedOptimizer opt(c.param_groups(w, g), comm, c.options(), so);
  };
  Case a;
  Case sizes = a;
  sizes.sizes[4] = 50001;
  expect_every_rank_throws(3, [&](int r, const auto& comm) { build(a, r, sizes, comm); }, ErrorCode::invalid_argument,
                           "rank 1's model differs from rank 0's: rank 0 has 1 group, 7 tensors, 139491 elements, "
                           "rank 1 1 group, 7 tensors, 139492 elements");
  Case dtypes = a;
  dtypes.weight = {f32, f32, f32, bf16, f32, f32, f32};
  expect_every_rank_throws(3, [&](int r, const auto& comm) { build(a, r, dtypes, comm); }, ErrorCode::invalid_argument,
                           "the tensors' sizes or dtypes, or the groups they are in, differ");
  Case lr = a;
  lr.groups = {{7, optim::AdamW{.lr = 2e-2}}};
  expect_every_rank_throws(2, [&](int r, const auto& comm) { build(a, r, lr, comm); }, ErrorCode::invalid_argument,
                           "the groups' configs (hyperparameters) differ");
  Case options = a;
  options.max_grad_norm = 1.0;
  expect_every_rank_throws(2, [&](int r, const auto& comm) { build(a, r, options, comm); }, ErrorCode::invalid_argument,
                           "OptimizerOptions::max_grad_norm (rank 0: none, rank 1: 1) differs between ranks");
  expect_every_rank_throws(
      2,
      [&](int r, const auto& comm) {
        ShardedOptions so;
        if (r == 1) so.grad_type = CommType::bf16;
        build(a, r, a, comm, so);
      },
      ErrorCode::invalid_argument, "ShardedOptions::grad_type differs (rank 0: f32, rank 1: bf16)");
}

TEST(ShardedOptimizer, ARankThatRefusesItsModelMakesEveryRankThrow) {
  Case c;
  expect_every_rank_throws(
      3,
      [&](int r, const std::shared_ptr<Communicator>& comm) {
        Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
        std::vector<ParamGroup> groups = c.param_groups(w, g);
        if (r == 1) groups[0].params[3].grad.data = nullptr;
        ShardedOptimizer opt(std::move(groups), comm, c.options());
      },
      ErrorCode::invalid_argument, "rank 1 of 3 refused its model, so no rank builds one", 1,
      "params[3].grad.data is null with numel = 16384");
  // Checks that every rank fails alike.
  const auto every = [&](const std::function<void(std::vector<ParamGroup>&, OptimizerOptions&, ShardedOptions&)>& change,
                         ErrorCode code, const std::string& text) {
    expect_every_rank_throws(
        2,
        [&](int, const std::shared_ptr<Communicator>& comm) {
          Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
          std::vector<ParamGroup> groups = c.param_groups(w, g);
          OptimizerOptions o = c.options();
          ShardedOptions so;
          change(groups, o, so);
          ShardedOptimizer opt(std::move(groups), comm, o, so);
        },
        code, text);
  };
  every([](auto&, auto& o, auto&) { o.slices = {{0, 0}}; }, ErrorCode::invalid_argument, "OptimizerOptions::slices is set");
  every([](auto&, auto&, auto& so) { so.grad_type = CommType::i32; }, ErrorCode::invalid_argument,
        "ShardedOptions::grad_type = i32");
  every([](auto& g, auto&, auto&) { g[0].params[4].grad.data = g[0].params[4].weight.data; }, ErrorCode::invalid_argument,
        "params[4].grad shares memory with params[4].weight");
  every([](auto& g, auto&, auto&) { g[0].params[1].grad.numel = 99; }, ErrorCode::invalid_argument,
        "params[1].weight.numel = 100 but .grad.numel = 99");
  every([](auto& g, auto&, auto&) { g[0].config = optim::AdamW{.lr = -1}; }, ErrorCode::invalid_argument, "config: ");
  every([](auto&, auto& o, auto&) { o.norm_type = 3.0; }, ErrorCode::invalid_argument, "norm_type = 3");
  // The communicator in the options: the constructor's argument is the one.
  LocalGroup one(1);
  Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
  OptimizerOptions o = c.options();
  o.communicator = one.communicator(0);
  EXPECT_THROW(ShardedOptimizer(c.param_groups(w, g), one.communicator(0), o), Error);
  EXPECT_THROW(ShardedOptimizer(c.param_groups(w, g), nullptr, c.options()), Error);
}

TEST(ShardedOptimizer, ARankThatRefusesAStepMakesEveryRankThrowAndNothingIsWritten) {
  Case c;
  c.scaled = true;
  LocalGroup group(3);
  std::vector<std::string> messages(3);
  std::vector<bool> same(3), moved(3);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
    c.init_weights(w);
    ShardedOptimizer opt(c.param_groups(w, g), comm, c.options());
    c.fill(g, 0, r, c.S);
    const auto before = w.bytes();
    try {
      opt.step_scaled(r == 2 ? NAN : c.S);
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(r)] = e.what();
    }
    same[static_cast<std::size_t>(r)] = w.bytes() == before && opt.shard().step_count() == 0;
    opt.step_scaled(c.S);  // still in step: the next one runs everywhere
    moved[static_cast<std::size_t>(r)] = w.bytes() != before;
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_FALSE(errors[static_cast<std::size_t>(r)]) << "rank " << r;
    EXPECT_TRUE(same[static_cast<std::size_t>(r)]) << "rank " << r;
    EXPECT_TRUE(moved[static_cast<std::size_t>(r)]) << "rank " << r;
  }
  EXPECT_NE(messages[2].find("loss_scale = nan"), std::string::npos) << messages[2];
  EXPECT_NE(messages[0].find("rank 2 refused its input to this step"), std::string::npos) << messages[0];
}


// Checkpoints: every rank's shard().save(), resumed by shard().load() of its own
// file or by load_shards() of all of them; the next step is bitwise the one-process
// step. Saved by `save_ranks`, resumed on `load_ranks`.
void expect_resumes(const Case& base, int save_ranks, int load_ranks, bool own_file, const std::string& what) {
  Case c = base;
  c.steps = 2;
  const std::string dir = ::testing::TempDir();
  std::vector<std::string> files;
  for (int r = 0; r < save_ranks; ++r) files.push_back(dir + "sharded_optimizer_test.rank" + std::to_string(r) + ".safetensors");
  std::unique_ptr<Optimizer> ref;
  std::unique_ptr<Tensors> rw, rg;
  const std::vector<unsigned char> saved = one_process(c, save_ranks, ref, rw, rg).weights.back();
  {
    LocalGroup group(save_ranks);
    const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
      Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
      c.init_weights(w);
      ShardedOptimizer opt(c.param_groups(w, g), comm, c.options());
      for (int k = 0; k < c.steps; ++k) {
        c.fill(g, k, r, c.S);
        opt.step_scaled(c.S);
      }
      EXPECT_TRUE(w.bytes() == saved) << what << ": rank " << r;
      opt.shard().save(files[static_cast<std::size_t>(r)]);
    });
    for (const auto& e : errors) EXPECT_FALSE(e) << what;
  }
  // The reference: two steps on save_ranks' averages, then one on load_ranks'.
  c.fill_average(*rg, 2, load_ranks, c.S);
  const StepResult want = ref->step_scaled(c.S);
  EXPECT_TRUE(want.applied) << what;
  const std::vector<unsigned char> want_w = rw->bytes();
  std::vector<StepResult> got(static_cast<std::size_t>(load_ranks));
  std::vector<std::vector<unsigned char>> got_w(static_cast<std::size_t>(load_ranks));
  LocalGroup group(load_ranks);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
    w.restore(saved);
    ShardedOptimizer opt(c.param_groups(w, g), comm, c.options());
    if (own_file) opt.shard().load(files[static_cast<std::size_t>(r)]);
    else opt.shard().load_shards(files);
    EXPECT_EQ(opt.shard().step_count(), 2) << what;
    c.fill(g, 2, r, c.S);
    got[static_cast<std::size_t>(r)] = opt.step_scaled(c.S);
    got_w[static_cast<std::size_t>(r)] = w.bytes();
  });
  for (int r = 0; r < load_ranks; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const std::string at = what + ": " + std::to_string(save_ranks) + " -> " + std::to_string(load_ranks) + " ranks, rank " + std::to_string(r);
    if (errors[ur]) {
      try {
        std::rethrow_exception(errors[ur]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << at << ": " << e.what();
      }
      continue;
    }
    expect_same_result(got[ur], want, at);
    EXPECT_TRUE(got_w[ur] == want_w) << at << ": weights differ";
  }
}

TEST(ShardedOptimizer, CheckpointsResume) {
  Case c;
  c.sizes = {100, 40000, 7, 0, 33000};
  c.weight = {bf16, bf16, f32, f32, bf16};
  c.grad = {bf16, bf16, f32, f32, bf16};
  c.scaled = true;
  c.max_grad_norm = 0.5;
  // One group: every rank owns a part, and the files re-shard onto any number of ranks.
  c.groups = {{5, optim::AdamW{.lr = 1e-2}}};
  expect_resumes(c, 3, 3, true, "one group, load()");
  for (int ranks : {3, 2, 1}) expect_resumes(c, 3, ranks, false, "one group, load_shards()");
  expect_resumes(c, 1, 2, false, "one group, load_shards()");
  // Three groups: on three ranks, rank 0 owns nothing of the last two and rank 2
  // nothing of the first (their places held by the groups' empty params); on two, each
  // rank owns part of two groups; on one, all. The files re-shard onto any number.
  c.groups = {{2, optim::AdamW{.lr = 1e-2}}, {3, optim::AdamW{.lr = 3e-3, .weight_decay = 0}}, {5, optim::AdamW{.lr = 1e-2}}};
  expect_resumes(c, 3, 3, true, "three groups, load()");
  for (int ranks : {3, 2, 1}) expect_resumes(c, 3, ranks, false, "three groups, load_shards()");
  expect_resumes(c, 1, 3, false, "three groups, load_shards()");
  expect_resumes(c, 2, 3, false, "three groups, load_shards()");
}

// Every rank's shard ends each group with one empty param of tensor num_tensors() + g,
// whatever it owns of the group.
TEST(ShardedOptimizer, EveryGroupEndsWithItsPlace) {
  Case c;
  c.sizes = {100, 40000, 7, 0, 33000};
  c.weight = {f32, f32, f32, f32, f32};
  c.grad = c.weight;
  c.groups = {{2, optim::AdamW{.lr = 1e-2}}, {3, optim::AdamW{.lr = 3e-3}}, {5, optim::AdamW{.lr = 1e-2}}};
  LocalGroup group(3);
  const auto errors = group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
    Tensors w(c.sizes, c.weights()), g(c.sizes, c.grads());
    ShardedOptimizer opt(c.param_groups(w, g), comm, c.options());
    const Optimizer& inner = opt.shard();
    const std::span<const TensorSlice> slices = opt.shard_slices();
    ASSERT_EQ(inner.num_groups(), 3u);
    ASSERT_EQ(slices.size(), inner.params().size());
    std::size_t end = 0;  // of the group, in params()
    for (std::size_t k = 0; k < 3; ++k) {
      const std::size_t begin = end;
      end += inner.group_params(k).size();
      ASSERT_LT(begin, end) << "rank " << r << " group " << k;
      EXPECT_EQ(slices[end - 1].tensor, static_cast<std::int64_t>(opt.num_tensors() + k)) << "rank " << r << " group " << k;
      EXPECT_EQ(inner.group_params(k).back().weight.numel, 0) << "rank " << r << " group " << k;
      for (std::size_t i = begin; i + 1 < end; ++i)
        EXPECT_LT(slices[i].tensor, static_cast<std::int64_t>(opt.num_tensors())) << "rank " << r << " group " << k;
    }
  });
  for (const auto& e : errors) EXPECT_FALSE(e);
}

}  // namespace
}  // namespace stepfuse
