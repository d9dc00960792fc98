// Sharded checkpoints (Optimizer::save on a sharded optimizer, Optimizer::load_shards)
// with in-process ranks (tests/local_communicator.hpp): a run sharded over 3 ranks
// (whole tensors or slices) saves one file per rank; the set loads into 2 ranks cut
// otherwise, 3 ranks cut otherwise, or one unsharded optimizer, and the resumed run
// is bitwise the uninterrupted one-process run (weights, state, masters, results).
// A set that is incomplete, has a gap or an overlap, is of another kind, or that one
// rank cannot read makes every rank throw, and no rank changes anything.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <ostream>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint_support.hpp"
#include "local_communicator.hpp"
#include "sharded_support.hpp"
#include "reference/test_data.hpp"
#include "runtime/safetensors.hpp"
#include "stepfuse/stepfuse.hpp"

namespace stepfuse {
namespace {

using namespace sharded_test;  // NOLINT: the shared model, its gradients and slices
using testing::LocalGroup;

// The loss scale of every step; the gradients are sharded_support.hpp's, times it.
constexpr double kScale = 1024.0;
const GradSource kGrads{.S = kScale};

Piece whole(std::size_t t) { return {t, 0, kSizes[t]}; }

// 3 ranks, whole tensors: the model's tensors in runs.
const Partition kWhole3 = {{whole(0), whole(1)}, {whole(2), whole(3)}, {whole(4), whole(5)}};
// 3 ranks, slices: tensors 0 and 3 split, each rank's list in an order unlike the model's.
const Partition kSliced3 = {{{3, 16384, 16384}, whole(5), {0, 0, 16384}},
                            {{0, 16384, 40000 - 16384}, {3, 32768, 50000 - 32768}, whole(2), whole(4)},
                            {{3, 0, 16384}, whole(1)}};
// Cuts X and Y (3 ranks) differ only in where tensors 0 and 3 are split.
const Partition kCutX = {{{0, 0, 16384}, whole(1), whole(2)},
                         {{0, 16384, 40000 - 16384}, {3, 0, 32768}},
                         {{3, 32768, 50000 - 32768}, whole(4), whole(5)}};
const Partition kCutY = {{{0, 0, 32768}, whole(1), whole(2)},
                         {{0, 32768, 40000 - 32768}, {3, 0, 16384}},
                         {{3, 16384, 50000 - 16384}, whole(4), whole(5)}};
// 2 ranks, slices, cut unlike any of the above.
const Partition kSliced2 = {{{0, 0, 32768}, {3, 32768, 50000 - 32768}, whole(4), whole(2)},
                            {{3, 0, 32768}, {0, 32768, 40000 - 32768}, whole(1), whole(5)}};
// 3 ranks, slices, cut unlike the saves.
const Partition kSliced3b = {{whole(1), {3, 0, 16384}, whole(2)},
                             {{3, 16384, 50000 - 16384}, {0, 0, 16384}},
                             {{0, 16384, 40000 - 16384}, whole(4), whole(5)}};

bool is_whole(const Partition& parts) {
  for (const auto& rank : parts)
    for (const Piece& p : rank)
      if (p.numel != kSizes[p.tensor]) return false;
  return true;
}

// What runs: the optimizer, its dtypes, and (grouped) two param groups, tensors 0-2
// and tensors 3-5, with their own weight decay.
struct RunSetup {
  const char* name;
  OptimizerConfig config;
  DType weight, grad;
  bool masters;
  bool grouped = false;
  bool custom = false;  // the config's program as a custom update program
  bool compensated = false;  // OptimizerOptions::compensated_weights (bf16 weights, no masters)
};
void PrintTo(const RunSetup& s, std::ostream* os) { *os << s.name; }

OptimizerConfig with_weight_decay(OptimizerConfig c, double wd) {
  std::visit(
      [&](auto& x) {
        if constexpr (requires { x.weight_decay; }) x.weight_decay = wd;
      },
      c);
  return c;
}

OptimizerOptions base_options(const RunSetup& s) {
  OptimizerOptions o;
  o.max_grad_norm = 0.5;  // results carry a norm and a clip coefficient
  o.cpu_backend = CpuBackend::highway;
  o.num_threads = 1;
  o.master_weights = s.masters;
  o.compensated_weights = s.compensated;
  return o;
}

// An optimizer over `pieces` of `m` (its params in `order`: group after group when
// grouped), sharded over `comm` (slices unless `whole_tensors`), or unsharded without one.
Optimizer build(const RunSetup& s, const Model& m, const std::vector<Piece>& pieces, const std::shared_ptr<Communicator>& comm,
                bool whole_tensors, std::vector<Piece>& order) {
  OptimizerOptions o = base_options(s);
  o.communicator = comm;
  std::vector<ParamGroup> groups;
  for (int g = 0; g < (s.grouped ? 2 : 1); ++g) {
    ParamGroup group{{}, s.grouped ? with_weight_decay(s.config, g == 0 ? 0.1 : 0.0) : s.config};
    for (const Piece& p : pieces) {
      if (s.grouped && (p.tensor >= 3) != (g == 1)) continue;
      group.params.push_back({slice_of(m.w[p.tensor], p.offset, p.numel), slice_of(m.g[p.tensor], p.offset, p.numel)});
      order.push_back(p);
      if (comm && !whole_tensors) o.slices.push_back({static_cast<std::int64_t>(p.tensor), p.offset});
    }
    if (!group.params.empty()) groups.push_back(std::move(group));
  }
  if (s.custom) return Optimizer(UpdateProgram::from_config(s.config), std::move(groups[0].params), o);
  return Optimizer(std::move(groups), o);
}

std::vector<float> state_of(const Optimizer& o, std::size_t param, std::int64_t offset, std::int64_t numel) {
  std::vector<float> out;
  for (std::string_view name : o.state_names()) {
    const std::span<const float> s = o.state(param, name).subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(numel));
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}
std::vector<float> master_of(const Optimizer& o, std::size_t param, std::int64_t offset, std::int64_t numel) {
  const std::span<const float> m = o.master(param);
  if (m.empty()) return {};
  return {m.begin() + offset, m.begin() + offset + numel};
}
std::vector<std::uint16_t> compensation_of(const Optimizer& o, std::size_t param, std::int64_t offset, std::int64_t numel) {
  const std::span<const std::uint16_t> c = o.compensation(param);
  if (c.empty()) return {};
  return {c.begin() + offset, c.begin() + offset + numel};
}

void rethrow_failures(const std::vector<std::exception_ptr>& errors, const std::string& what) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      FAIL() << what << ": rank " << r << " threw: " << e.what();
    }
  }
}

constexpr int kBefore = 3, kAfter = 3;

// The uninterrupted one-process run.
struct Reference {
  Reference(const RunSetup& s) : m(s.weight, s.grad) {
    std::vector<Piece> order;
    opt.emplace(build(s, m, whole_model(), nullptr, true, order));
    for (int k = 0; k < kBefore + kAfter; ++k) {
      fill_grads(m, kGrads, k, whole_model());
      const StepResult r = opt->step_scaled(kScale);
      if (k >= kBefore) results.push_back(r);
    }
  }
  Model m;
  std::optional<Optimizer> opt;
  std::vector<StepResult> results;  // of the steps after the checkpoint
};

// Trains kBefore steps sharded over `parts`, saves one file per rank; returns the
// weights (the model's, which the caller saves with it) and the files' paths.
std::vector<std::string> train_and_save(const RunSetup& s, const Partition& parts, const ckpt_test::TempDir& dir,
                                        const std::string& prefix, std::vector<std::vector<unsigned char>>* weights,
                                        GradScaler* scaler_state = nullptr) {
  Model m(s.weight, s.grad);
  const int ranks = static_cast<int>(parts.size());
  std::vector<std::string> paths;
  for (int r = 0; r < ranks; ++r) paths.push_back(dir.file(prefix + ".rank" + std::to_string(r) + ".safetensors"));
  LocalGroup group(ranks);
  rethrow_failures(group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
                     std::vector<Piece> order;
                     Optimizer opt = build(s, m, parts[static_cast<std::size_t>(r)], comm, is_whole(parts), order);
                     GradScaler scaler("cpu", kScale, 2.0, 0.5, 2);
                     for (int k = 0; k < kBefore; ++k) {
                       fill_grads(m, kGrads, k, order);
                       if (scaler_state != nullptr) {
                         scaler.step(opt);
                         scaler.update();
                       } else {
                         opt.step_scaled(kScale);
                       }
                     }
                     if (scaler_state != nullptr) {
                       opt.save(paths[static_cast<std::size_t>(r)], scaler);
                       if (r == 0) *scaler_state = scaler;
                     } else {
                       opt.save(paths[static_cast<std::size_t>(r)]);
                     }
                   }),
                   "save " + prefix);
  if (weights != nullptr) *weights = m.w.snapshot();
  return paths;
}

void expect_same_result(const StepResult& a, const StepResult& b, const std::string& what) {
  EXPECT_EQ(a.applied, b.applied) << what;
  EXPECT_EQ(a.found_inf, b.found_inf) << what;
  EXPECT_EQ(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof(double)), 0) << what << ": grad_norm " << a.grad_norm << " vs " << b.grad_norm;
  EXPECT_EQ(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof(double)), 0) << what << ": clip_coef " << a.clip_coef << " vs " << b.clip_coef;
}

// Loads `paths` into optimizers cut as `parts` (an empty Partition: one unsharded
// optimizer), over a model holding `weights`, trains kAfter steps, and expects the
// one-process run's results, weights, state and masters (or compensations) bitwise.
void expect_resumes_bitwise(const RunSetup& s, const Reference& ref, const std::vector<std::string>& paths,
                            const std::vector<std::vector<unsigned char>>& weights, const Partition& parts,
                            const std::string& what) {
  SCOPED_TRACE(what);
  Model m(s.weight, s.grad);
  m.w.restore(weights);
  const bool unsharded = parts.empty();
  const Partition cut = unsharded ? Partition{whole_model()} : parts;
  const int ranks = static_cast<int>(cut.size());
  std::vector<std::vector<StepResult>> results(static_cast<std::size_t>(ranks));
  std::vector<std::vector<Piece>> orders(static_cast<std::size_t>(ranks));
  std::vector<std::vector<std::vector<float>>> states(static_cast<std::size_t>(ranks)), masters(static_cast<std::size_t>(ranks));
  std::vector<std::vector<std::vector<std::uint16_t>>> compensations(static_cast<std::size_t>(ranks));
  std::vector<std::int64_t> steps(static_cast<std::size_t>(ranks));
  const auto run = [&](int r, const std::shared_ptr<Communicator>& comm) {
    const auto rr = static_cast<std::size_t>(r);
    std::vector<Piece>& order = orders[rr];
    Optimizer opt = build(s, m, cut[rr], comm, !unsharded && is_whole(cut), order);
    opt.load_shards(paths);
    steps[rr] = opt.step_count();
    for (int k = kBefore; k < kBefore + kAfter; ++k) {
      fill_grads(m, kGrads, k, order);
      results[rr].push_back(opt.step_scaled(kScale));
    }
    for (std::size_t i = 0; i < order.size(); ++i) {
      states[rr].push_back(state_of(opt, i, 0, order[i].numel));
      masters[rr].push_back(master_of(opt, i, 0, order[i].numel));
      compensations[rr].push_back(compensation_of(opt, i, 0, order[i].numel));
    }
  };
  if (unsharded) {
    run(0, nullptr);
  } else {
    LocalGroup group(ranks);
    rethrow_failures(group.run(run), what);
    // Two at construction, one in load_shards, one per (clipped) step.
    EXPECT_EQ(group.collectives(), 2 + 1 + kAfter) << "collectives";
  }
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(m.w.snapshot(), ref.m.w.snapshot()) << "weights";
  // The one-process reference's params are the model's tensors in order.
  for (int r = 0; r < ranks; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    EXPECT_EQ(steps[rr], kBefore) << "rank " << r << " step_count after load_shards";
    for (int k = 0; k < kAfter; ++k)
      expect_same_result(results[rr][static_cast<std::size_t>(k)], ref.results[static_cast<std::size_t>(k)],
                         "rank " + std::to_string(r) + ", step " + std::to_string(kBefore + k));
    for (std::size_t i = 0; i < orders[rr].size(); ++i) {
      const Piece& p = orders[rr][i];
      EXPECT_EQ(states[rr][i], state_of(*ref.opt, p.tensor, p.offset, p.numel)) << "rank " << r << " param " << i << " state";
      EXPECT_EQ(masters[rr][i], master_of(*ref.opt, p.tensor, p.offset, p.numel)) << "rank " << r << " param " << i << " master";
      EXPECT_EQ(compensations[rr][i], compensation_of(*ref.opt, p.tensor, p.offset, p.numel))
          << "rank " << r << " param " << i << " compensation";
    }
  }
}

const RunSetup kSetups[] = {
    {"AdamW_bf16_masters", optim::AdamW{.lr = 1e-2, .weight_decay = 1e-2}, DType::bf16, DType::bf16, true},
    {"SGD_momentum", optim::SGD{.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-3, .nesterov = true}, DType::f32, DType::f32,
     false},
    {"AdamW_groups", optim::AdamW{.lr = 1e-2}, DType::bf16, DType::bf16, true, /*grouped=*/true},
    {"custom_Adam", optim::Adam{.lr = 1e-2, .amsgrad = true}, DType::f16, DType::f32, true, false, /*custom=*/true},
    {"AdamW_bf16_compensated", optim::AdamW{.lr = 1e-3, .weight_decay = 1e-2}, DType::bf16, DType::bf16, false, false, false,
     /*compensated=*/true},
};

class ShardedCheckpoint : public ::testing::TestWithParam<RunSetup> {};

TEST_P(ShardedCheckpoint, ResumesBitwiseOnAnyCut) {
  const RunSetup& s = GetParam();
  const Reference ref(s);
  if (s.compensated) {  // else compensations that never left 0 would compare equal however they were loaded
    bool nonzero = false;
    for (std::size_t t = 0; t < kSizes.size(); ++t)
      for (std::uint16_t c : ref.opt->compensation(t)) nonzero |= c != 0;
    ASSERT_TRUE(nonzero) << "every compensation of the reference run is 0";
  }
  ckpt_test::TempDir dir;
  for (const auto& [name, saved_cut] : {std::pair{"whole3", kWhole3}, std::pair{"sliced3", kSliced3}}) {
    std::vector<std::vector<unsigned char>> weights;
    const std::vector<std::string> paths = train_and_save(s, saved_cut, dir, name, &weights);
    if (::testing::Test::HasFatalFailure()) return;
    const std::string from = std::string("saved ") + name;
    expect_resumes_bitwise(s, ref, paths, weights, kSliced2, from + ", loaded on 2 ranks (slices)");
    expect_resumes_bitwise(s, ref, paths, weights, {}, from + ", loaded unsharded");
    expect_resumes_bitwise(s, ref, paths, weights, kSliced3b, from + ", loaded on 3 ranks cut otherwise");
    expect_resumes_bitwise(s, ref, {paths[2], paths[0], paths[1]}, weights, kWhole3, from + ", loaded on 3 ranks (whole), files in another order");
  }
  // An unsharded save is a set of one file: it loads sharded too.
  std::vector<std::vector<unsigned char>> weights;
  const std::vector<std::string> one = train_and_save(s, {whole_model()}, dir, "one", &weights);
  expect_resumes_bitwise(s, ref, one, weights, kSliced2, "saved by 1 rank, loaded on 2 ranks (slices)");
  {
    Model m(s.weight, s.grad);
    std::vector<Piece> order;
    Optimizer opt = build(s, m, whole_model(), nullptr, true, order);
    for (int k = 0; k < kBefore; ++k) {
      fill_grads(m, kGrads, k, order);
      opt.step_scaled(kScale);
    }
    opt.save(dir.file("unsharded.safetensors"));
    expect_resumes_bitwise(s, ref, {dir.file("unsharded.safetensors")}, m.w.snapshot(), kSliced3b,
                           "saved unsharded, loaded on 3 ranks (slices)");
    expect_resumes_bitwise(s, ref, {dir.file("unsharded.safetensors")}, m.w.snapshot(), {},
                           "saved unsharded, loaded unsharded");
  }
}

INSTANTIATE_TEST_SUITE_P(Setups, ShardedCheckpoint, ::testing::ValuesIn(kSetups),
                         [](const ::testing::TestParamInfo<RunSetup>& info) { return std::string(info.param.name); });

TEST(ShardedCheckpoint, ShardFilesSayWhereEachParamLies) {
  const RunSetup s = kSetups[0];
  ckpt_test::TempDir dir;
  const std::vector<std::string> paths = train_and_save(s, kSliced3, dir, "s", nullptr);
  // Rank 1's file: its params in its own order, each with its place in the model.
  const detail::SafetensorsFile f{detail::MappedFile(paths[1])};
  ASSERT_NE(f.meta("shard"), nullptr);
  EXPECT_EQ(*f.meta("shard"), R"({"rank":1,"ranks":3,"tensors":6})");
  EXPECT_EQ(*f.meta("format_version"), "3");
  const auto entry = [](std::int64_t numel, int tensor, std::int64_t offset, std::int64_t tensor_numel) {
    return R"({"numel":)" + std::to_string(numel) +
           R"(,"weight_dtype":"bf16","grad_dtype":"bf16","master":true,"compensation":false,"tensor":)" +
           std::to_string(tensor) + R"(,"offset":)" + std::to_string(offset) + R"(,"tensor_numel":)" +
           std::to_string(tensor_numel) + "}";
  };
  EXPECT_EQ(*f.meta("group.0.params"), "[" + entry(23616, 0, 16384, 40000) + "," + entry(17232, 3, 32768, 50000) + "," +
                                           entry(16384, 2, 0, 16384) + "," + entry(7, 4, 0, 7) + "]");
  EXPECT_NE(f.find("group.0.param.1.exp_avg"), nullptr);
  // An unsharded save is as before: no "shard" entry, no places.
  Model m(s.weight, s.grad);
  std::vector<Piece> order;
  build(s, m, whole_model(), nullptr, true, order).save(dir.file("u.safetensors"));
  const detail::SafetensorsFile u{detail::MappedFile(dir.file("u.safetensors"))};
  EXPECT_EQ(u.meta("shard"), nullptr);
  EXPECT_EQ(u.meta("group.0.params")->find("tensor"), std::string::npos);
}

// What a rank's optimizer holds, for "nothing changed".
struct Held {
  std::vector<std::vector<float>> state, master;
  std::vector<std::vector<std::uint16_t>> compensation;
  std::int64_t steps = 0;
  double lr = 0;
  bool operator==(const Held&) const = default;
};
Held held(const Optimizer& o) {
  Held h;
  for (std::size_t i = 0; i < o.num_params(); ++i) {
    h.state.push_back(state_of(o, i, 0, o.params()[i].weight.numel));
    h.master.push_back(master_of(o, i, 0, o.params()[i].weight.numel));
    h.compensation.push_back(compensation_of(o, i, 0, o.params()[i].weight.numel));
  }
  h.steps = o.step_count();
  h.lr = o.lr();
  return h;
}

// Every rank of `cut` builds `s` (trained one step), calls load_shards with its own
// list (lists(r)); expects every rank to throw `code` with `text` in its message
// (rank `own` its own error, with own_text), and nothing changed on any rank.
void expect_refused_everywhere(const RunSetup& s, const Partition& cut, const std::function<std::vector<std::string>(int)>& lists,
                               ErrorCode code, const std::string& text, int own = -1, const std::string& own_text = "") {
  SCOPED_TRACE(text);
  Model m(s.weight, s.grad);
  const int ranks = static_cast<int>(cut.size());
  std::vector<std::string> messages(static_cast<std::size_t>(ranks));
  std::vector<std::optional<ErrorCode>> codes(static_cast<std::size_t>(ranks));
  std::vector<bool> unchanged(static_cast<std::size_t>(ranks), false);
  LocalGroup group(ranks);
  rethrow_failures(group.run([&](int r, const std::shared_ptr<Communicator>& comm) {
                     const auto rr = static_cast<std::size_t>(r);
                     std::vector<Piece> order;
                     Optimizer opt = build(s, m, cut[rr], comm, is_whole(cut), order);
                     opt.set_lr(0.125);
                     fill_grads(m, kGrads, 7, order);
                     opt.step_scaled(kScale);
                     const Held before = held(opt);
                     try {
                       opt.load_shards(lists(r));
                     } catch (const Error& e) {
                       codes[rr] = e.code();
                       messages[rr] = e.what();
                     }
                     unchanged[rr] = held(opt) == before;
                     opt.step_scaled(kScale);  // the ranks are still in step
                   }),
                   text);
  for (int r = 0; r < ranks; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    ASSERT_TRUE(codes[rr]) << "rank " << r << " did not throw";
    EXPECT_EQ(*codes[rr], code) << "rank " << r << ": " << messages[rr];
    const std::string& want = r == own ? own_text : text;
    EXPECT_NE(messages[rr].find(want), std::string::npos) << "rank " << r << ": " << messages[rr];
    EXPECT_TRUE(unchanged[rr]) << "rank " << r << " changed";
  }
}

TEST(ShardedCheckpoint, ASetThatDoesNotFitMakesEveryRankThrowAndNothingChanges) {
  const RunSetup s = kSetups[1];  // SGD with momentum
  ckpt_test::TempDir dir;
  const std::vector<std::string> x = train_and_save(s, kCutX, dir, "x", nullptr);
  const std::vector<std::string> y = train_and_save(s, kCutY, dir, "y", nullptr);
  const auto all = [](std::vector<std::string> list) { return [list](int) { return list; }; };

  expect_refused_everywhere(s, kSliced2, all({x[0], x[2]}), ErrorCode::invalid_argument,
                            "the files are shards of a checkpoint saved by 3 ranks, but none is rank 1's");
  expect_refused_everywhere(s, kSliced2, all({x[0], x[1], x[1]}), ErrorCode::invalid_argument, "are both rank 1's shard");
  expect_refused_everywhere(s, kSliced2, all({x[0], y[1], x[2]}), ErrorCode::invalid_argument,
                            "model tensor 0: elements [16384, 32768) are in none of the files (before them: '" + x[0] +
                                "' (group 0 param 0, elements [0, 16384)); after them: '" + y[1] +
                                "' (group 0 param 0, elements [32768, 40000)))");
  expect_refused_everywhere(s, kSliced2, all({y[0], x[1], x[2]}), ErrorCode::invalid_argument,
                            "model tensor 0: elements [16384, 32768) are in two files: '" + y[0] +
                                "' (group 0 param 0, elements [0, 32768)) and '" + x[1] +
                                "' (group 0 param 0, elements [16384, 40000))");
  // Another optimizer kind.
  RunSetup adamw = s;
  adamw.config = optim::AdamW{};
  expect_refused_everywhere(adamw, kSliced2, all(x), ErrorCode::invalid_argument,
                            "checkpoint '" + x[0] + "' does not fit this optimizer: it holds the state of SGD, this one is AdamW");
  // Another program variant (momentum off): the pieces this rank takes say so.
  RunSetup plain = s;
  plain.config = optim::SGD{.lr = 0.05};
  expect_refused_everywhere(plain, kSliced2, all(x), ErrorCode::invalid_argument, "saved from update program 'sgd_nesterov', this one runs 'sgd'");
  // Masters where the files have none.
  RunSetup bf16 = s;
  bf16.weight = bf16.grad = DType::bf16;
  bf16.masters = true;
  expect_refused_everywhere(bf16, kSliced2, all(x), ErrorCode::invalid_argument, "saved with weight/grad dtypes f32/f32, here bf16/bf16");
  // One rank's list has a path that does not exist: that rank throws its io_error,
  // the others an Error naming it.
  const std::string missing = dir.file("no-such-file.safetensors");
  expect_refused_everywhere(
      s, kSliced2, [&](int r) { return r == 1 ? std::vector<std::string>{x[0], missing, x[2]} : x; }, ErrorCode::io_error,
      "load_shards: rank 1 of 2 could not take its part of the checkpoint, so no rank changed anything: ", 1, missing);
  // The ranks' lists differ (the same files in another order on one rank).
  expect_refused_everywhere(
      s, kSliced3b, [&](int r) { return r == 2 ? std::vector<std::string>{x[1], x[0], x[2]} : x; }, ErrorCode::invalid_argument,
      "rank 2 was given another list of files than rank 0");
}

// Compensations where the files have fp32 masters, and the reverse: every rank throws
// naming the option, and nothing changes.
TEST(ShardedCheckpoint, CompensationsMustMatchTheFiles) {
  const RunSetup compensated = kSetups[4], masters = kSetups[0];
  ASSERT_TRUE(compensated.compensated);
  ckpt_test::TempDir dir;
  const std::vector<std::string> c = train_and_save(compensated, kSliced3, dir, "c", nullptr);
  const std::vector<std::string> m = train_and_save(masters, kSliced3, dir, "m", nullptr);
  const auto all = [](std::vector<std::string> list) { return [list](int) { return list; }; };
  expect_refused_everywhere(masters, kSliced2, all(c), ErrorCode::invalid_argument,
                            "saved with a bf16 compensation, this optimizer keeps an fp32 master instead "
                            "(OptimizerOptions::master_weights and compensated_weights differ)");
  expect_refused_everywhere(compensated, kSliced2, all(m), ErrorCode::invalid_argument,
                            "saved with an fp32 master, this optimizer keeps a bf16 compensation instead "
                            "(OptimizerOptions::master_weights and compensated_weights differ)");
  RunSetup plain = masters;
  plain.masters = false;
  expect_refused_everywhere(plain, kSliced2, all(c), ErrorCode::invalid_argument,
                            "saved with a bf16 compensation, this optimizer keeps none (OptimizerOptions::compensated_weights differs)");
}

TEST(ShardedCheckpoint, TheFilesMustBeThisModels) {
  const RunSetup s = kSetups[1];
  ckpt_test::TempDir dir;
  const std::vector<std::string> x = train_and_save(s, kCutX, dir, "x", nullptr);
  // Unsharded over the model without its last tensor: model tensor 5 is not this model's.
  Model m(s.weight, s.grad);
  std::vector<Piece> order, five(whole_model());
  five.pop_back();
  Optimizer opt = build(s, m, five, nullptr, true, order);
  std::string message;
  EXPECT_EQ(ckpt_test::code_of([&] { opt.load_shards(x); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("model tensor 5 (33000 elements, in '" + x[2] + "') is not one of this model's 5 tensors (an unsharded optimizer's params are model tensors 0 to 4, in order)"),
            std::string::npos)
      << message;
  // Over tensors of other sizes: tensors 1 and 4 swapped.
  std::vector<Piece> swapped(whole_model());
  std::swap(swapped[1], swapped[4]);
  order.clear();
  Optimizer other = build(s, m, swapped, nullptr, true, order);
  EXPECT_EQ(ckpt_test::code_of([&] { other.load_shards(x); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("model tensor 1 has 100 elements in the files ('" + x[0] + "'), 7 here"), std::string::npos) << message;
  EXPECT_EQ(ckpt_test::code_of([&] { other.load_shards({}); }, &message), ErrorCode::invalid_argument);
}

// A param that takes its elements from two files whose groups disagree on NAdam's carried
// mu_product (group.0.mu_product_offset) is refused, naming both.
TEST(ShardedCheckpoint, TheFilesMustAgreeOnTheCarriedProduct) {
  const RunSetup s = kSetups[1];
  ckpt_test::TempDir dir;
  const std::vector<std::string> x = train_and_save(s, kCutX, dir, "x", nullptr);
  ckpt_test::rewrite_metadata(x[1], [](auto& m) { m["group.0.mu_product_offset"] = "-0.5"; });
  Model m(s.weight, s.grad);
  std::vector<Piece> order;
  Optimizer opt = build(s, m, whole_model(), nullptr, true, order);
  std::string message;
  EXPECT_EQ(ckpt_test::code_of([&] { opt.load_shards(x); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("whose NAdam mu_product differs (mu_product_offset 0 and -0.5)"), std::string::npos) << message;
}

TEST(ShardedCheckpoint, GradScalerStateComesFromTheFiles) {
  const RunSetup s = kSetups[0];
  ckpt_test::TempDir dir;
  GradScaler saved("cpu");
  const std::vector<std::string> paths = train_and_save(s, kWhole3, dir, "g", nullptr, &saved);
  const std::vector<std::string> plain = train_and_save(s, kWhole3, dir, "p", nullptr);
  Model m(s.weight, s.grad);
  std::vector<Piece> order;
  Optimizer opt = build(s, m, whole_model(), nullptr, true, order);
  GradScaler scaler("cpu", 8.0);
  opt.load_shards(paths, scaler);
  EXPECT_EQ(scaler.state_dict(), saved.state_dict());
  EXPECT_EQ(opt.step_count(), kBefore);
  // Files saved without a scaler: an Error, nothing changes.
  GradScaler fresh("cpu", 8.0);
  std::string message;
  EXPECT_EQ(ckpt_test::code_of([&] { opt.load_shards(plain, fresh); }, &message), ErrorCode::invalid_argument);
  EXPECT_NE(message.find("has no GradScaler state"), std::string::npos) << message;
  EXPECT_EQ(fresh.get_scale(), 8.0);
}

TEST(ShardedCheckpoint, LoadOfOneShardFileChecksWhereItsParamsLie) {
  const RunSetup s = kSetups[1];
  ckpt_test::TempDir dir;
  // Rank 0's two params have 16384 elements each: tensor 2 and the first chunk of tensor 0.
  const Partition saved = {{whole(2), {0, 0, 16384}}, {{0, 16384, 40000 - 16384}, whole(1), whole(3), whole(4), whole(5)}};
  const std::vector<std::string> paths = train_and_save(s, saved, dir, "l", nullptr);
  // The same cut: load() of each rank's own file works.
  Model m(s.weight, s.grad);
  LocalGroup same(2);
  rethrow_failures(same.run([&](int r, const std::shared_ptr<Communicator>& comm) {
                     std::vector<Piece> order;
                     Optimizer opt = build(s, m, saved[static_cast<std::size_t>(r)], comm, false, order);
                     opt.load(paths[static_cast<std::size_t>(r)]);
                     EXPECT_EQ(opt.step_count(), kBefore);
                   }),
                   "same cut");
  // Rank 0's params swapped: the same sizes, other places.
  const Partition swapped = {{{0, 0, 16384}, whole(2)}, saved[1]};
  LocalGroup other(2);
  std::string message;
  rethrow_failures(other.run([&](int r, const std::shared_ptr<Communicator>& comm) {
                     std::vector<Piece> order;
                     Optimizer opt = build(s, m, swapped[static_cast<std::size_t>(r)], comm, false, order);
                     if (r == 0) {
                       EXPECT_EQ(ckpt_test::code_of([&] { opt.load(paths[0]); }, &message), ErrorCode::invalid_argument);
                     }
                   }),
                   "swapped");
  EXPECT_NE(message.find("params[0]: saved as elements [0, 16384) of model tensor 2, here elements [0, 16384) of model "
                         "tensor 0 (the ranks cut the model differently"),
            std::string::npos)
      << message;
}

}  // namespace
}  // namespace stepfuse
