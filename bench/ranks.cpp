// stepfuse-bench --ranks N: the sharded step across N MPI processes.
//
// Each rank takes its part of the tensor list (--preset or --shapes): the model's
// elements, in tensor order, cut into N contiguous ranges of about the same size, each
// cut at a 16,384-element chunk boundary inside a tensor or at a tensor boundary
// (--shard slices, the default: a tensor may be split, its slices go in
// OptimizerOptions::slices), or at tensor boundaries only (--shard whole, and always for
// a two-phase program such as LAMB's, whose tensors the step cannot split). On its part
// each rank builds two optimizers over the same buffers: the sharded one (with a
// communicator of the N ranks) and a local one (no communicator: the same shard's step
// as if it were the whole model). The communicator is the MPI one wrapped in a counter
// that measures, per call, the bytes and the time of exactly what the step sends.
//
// Before timing: one step of each; every rank's sharded StepResult (norm, clip
// coefficient, applied, found_inf) must be bitwise the same, and the sharded norm must
// be what the ranks' local norms make together (L2: sqrt of the sum of their squares,
// within 1e-10 relative, as the sums are grouped differently; inf: their max, exactly;
// on one rank: the local norm, bitwise). A disagreement is exit code 2 on every rank.
//
// Timing: --warmup, then --steps iterations of [the local step and the sharded step (in
// alternating order), a bare all_gather of the step's own count and type, and a bare
// 128-byte all_reduce (16 int64 sums: the payload of the alternative design, an exact
// fixed-point norm all-reduced)], each preceded by an MPI_Barrier so that one rank's
// lateness in one item does not land in the next; every rank times all of it. Rank 0
// gathers every rank's medians and prints them with the slowest rank's (the max over
// ranks of each median: the slowest rank sets the pace of a sharded step).
//
// Errors: what can fail on one rank alone (buffers, the local optimizer, the JSON file)
// is agreed on by every rank before the next collective, so that every rank exits with
// the same code and the lowest failing rank prints why; an unexpected error in the timed
// loop aborts the job (MPI_Abort), since the other ranks are waiting in a collective.
#include "ranks.hpp"

#include "cli_support.hpp"
#include "jit/program_analysis.hpp"

#if STEPFUSE_BENCH_MPI

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "default_configs.hpp"
#include "model_buffers.hpp"
#include "presets.hpp"
#include "stats.hpp"
#include "stepfuse/mpi.hpp"
#include "stepfuse/stepfuse.hpp"

#endif

namespace stepfuse::bench::tool {

#if !STEPFUSE_BENCH_MPI

bool ranks_supported() { return false; }

int run_ranks(const Args& /*a*/, int /*argc*/, char** /*argv*/) {
  throw UsageError(
      "--ranks: this stepfuse-bench was built without MPI (CMake found no MPI, or STEPFUSE_WITH_MPI=OFF), so it "
      "cannot run the sharded step across processes; install Open MPI (scripts/install_deps.sh installs "
      "libopenmpi-dev and openmpi-bin), then reconfigure and rebuild");
}

#else

namespace sf = stepfuse;
namespace sb = stepfuse::bench;
using json = nlohmann::ordered_json;

bool ranks_supported() { return true; }

namespace {

// Set in the environment of the ranks this program launches: a rank that sees it but no
// MPI launcher's variables was started by something that is not an MPI launcher.
constexpr const char* kLaunchedVar = "STEPFUSE_BENCH_RANKS_LAUNCHED";
// Bare collectives per iteration, each timed on its own.
constexpr int kBareReps = 5;
// The alternative design's payload: an exact fixed-point norm (and flags) all-reduced.
constexpr std::size_t kAllReduceBytes = 128;

// ---- The case: arguments and the cut (the launcher checks these too, before mpiexec) ------

struct Piece {
  std::size_t tensor = 0;            // index into RanksCase::tensors
  std::int64_t begin = 0, end = 0;   // elements of that tensor
};

struct RanksCase {
  int ranks = 1;
  bool whole = false;  // --shard whole
  // Cut at tensor boundaries only: --shard whole, or a two-phase program (LAMB's per-tensor
  // trust ratio), whose tensors the sharded step cannot split.
  bool tensor_cuts = false;
  bool two_phase = false;
  sb::Preset preset;
  bool from_file = false;
  std::vector<sb::TensorShape> tensors;  // the preset's, without empty ones (no rank holds those)
  std::size_t empty_tensors = 0;
  std::vector<std::int64_t> offsets;     // tensors.size() + 1 prefix sums
  std::vector<std::int64_t> cuts;        // ranks + 1: rank r holds global elements [cuts[r], cuts[r + 1])
  sf::OptimizerConfig config;
  sf::DType weights = sf::DType::f32, grads = sf::DType::f32;
  sf::OptimizerOptions options;          // without communicator and slices
  sf::Fusion fusion = sf::Fusion::fused;
  sf::CpuBackend cpu_backend = sf::CpuBackend::highway;
  sf::StateFormat state = sf::StateFormat::f32;  // --state: one format
  double loss_scale = 1024;

  std::int64_t total() const { return offsets.back(); }
  // Rank r's pieces, in tensor order.
  std::vector<Piece> pieces(int r) const {
    std::vector<Piece> out;
    const std::int64_t lo = cuts[static_cast<std::size_t>(r)], hi = cuts[static_cast<std::size_t>(r) + 1];
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::int64_t b = std::max(lo, offsets[t]), e = std::min(hi, offsets[t + 1]);
      if (b < e) out.push_back({t, b - offsets[t], e - offsets[t]});
    }
    return out;
  }
  // The values rank r's pieces put in the step's collective (runtime/shard.cpp): one for
  // a whole model tensor, one per chunk for a slice of a split one.
  std::int64_t values(int r) const {
    std::int64_t v = 0;
    for (const Piece& p : pieces(r)) {
      const bool whole_tensor = p.begin == 0 && p.end == tensors[p.tensor].numel;
      v += whole_tensor ? 1 : (p.end - p.begin + sf::kShardAlign - 1) / sf::kShardAlign;
    }
    return v;
  }
};

// The cut points of the model's elements into `ranks` non-empty ranges of about the same
// size: at tensor boundaries, and (unless whole) at chunk boundaries inside a tensor.
std::vector<std::int64_t> cut_model(const std::vector<std::int64_t>& off, int ranks, bool whole) {
  const std::int64_t total = off.back();
  // The tensor holding global element g < total.
  auto tensor_of = [&](std::int64_t g) {
    return static_cast<std::size_t>(std::upper_bound(off.begin(), off.end(), g) - off.begin() - 1);
  };
  // The largest place to cut at or below g, and the smallest above g (g < total).
  auto at_or_below = [&](std::int64_t g) {
    const std::size_t t = tensor_of(g);
    return whole ? off[t] : off[t] + (g - off[t]) / sf::kShardAlign * sf::kShardAlign;
  };
  auto above = [&](std::int64_t g) {
    const std::size_t t = tensor_of(g);
    return whole ? off[t + 1] : std::min(off[t] + ((g - off[t]) / sf::kShardAlign + 1) * sf::kShardAlign, off[t + 1]);
  };
  std::vector<std::int64_t> cuts(static_cast<std::size_t>(ranks) + 1, 0);
  cuts.back() = total;
  for (int k = 1; k < ranks; ++k) {
    const auto target = static_cast<std::int64_t>(static_cast<__int128>(total) * k / ranks);
    const std::int64_t lo = at_or_below(target), hi = lo == target ? lo : above(lo);
    std::int64_t cut = target - lo <= hi - target ? lo : hi;
    const std::int64_t prev = cuts[static_cast<std::size_t>(k) - 1];
    if (cut <= prev) cut = prev < total ? above(prev) : total;
    if (cut >= total) return {};
    cuts[static_cast<std::size_t>(k)] = cut;
  }
  return cuts;
}

// Every check the arguments allow without MPI (usage errors), and the cut.
RanksCase resolve_ranks_case(const Args& a) {
  RanksCase c;
  c.ranks = a.ranks;
  if (a.shard != "slices" && a.shard != "whole")
    throw UsageError("--shard: unknown mode '" + a.shard + "' (expected slices or whole)");
  c.whole = a.shard == "whole";
  if (a.print_shapes) throw UsageError("--print-shapes: prints the tensor list and exits; leave --ranks out");
  if (a.backend != "cpu")
    throw UsageError("--ranks: the sharded step runs on the CPU so far (leave --backend " + a.backend + " out)");
  if (a.groups != "off") throw UsageError("--ranks: times one param group (leave --groups out)");
  if (std::find(a.rounding.begin(), a.rounding.end(), "stochastic") != a.rounding.end())
    throw UsageError("--rounding stochastic: --ranks does not time the sharded step with stochastic rounding yet "
                     "(leave --rounding out, or leave --ranks out to time it on one process)");
  if (a.fusion_given) {
    if (a.fusion.size() != 1)
      throw UsageError("--ranks: times one --fusion mode (fused, unfused or interpreted), not a list");
    const std::string& f = a.fusion[0];
    if (f != "fused" && f != "unfused" && f != "interpreted")
      throw UsageError("--fusion: unknown mode '" + f + "' (expected fused, unfused or interpreted)");
    c.fusion = f == "fused" ? sf::Fusion::fused : f == "unfused" ? sf::Fusion::unfused : sf::Fusion::interpreted;
  }
  if (a.cpu_backend_given) {
    if (a.cpu_backends.size() != 1 || (a.cpu_backends[0] != "highway" && a.cpu_backends[0] != "llvm"))
      throw UsageError("--ranks: --cpu-backend takes one CPU backend here (highway or llvm)");
    if (c.fusion != sf::Fusion::fused)
      throw UsageError("--cpu-backend: chooses the code of the fused step, and --fusion is not fused");
    c.cpu_backend = a.cpu_backends[0] == "llvm" ? sf::CpuBackend::llvm : sf::CpuBackend::highway;
    if (c.cpu_backend == sf::CpuBackend::llvm && !have_llvm())
      throw UsageError("--cpu-backend llvm: this stepfuse was built without LLVM; pass --cpu-backend highway");
  }
  if (a.state_given) {
    if (a.state.size() != 1)
      throw UsageError("--ranks: times one --state format (f32, bf16 or q8), not a list");
    const std::string& f = a.state[0];
    if (f != "f32" && f != "bf16" && f != "q8")
      throw UsageError("--state: unknown state format '" + f + "' (expected f32, bf16 or q8)");
    c.state = f == "q8" ? sf::StateFormat::q8 : f == "bf16" ? sf::StateFormat::bf16 : sf::StateFormat::f32;
  }
  c.from_file = !a.shapes_path.empty();
  try {
    c.preset = c.from_file ? sb::load_shapes_file(a.shapes_path) : sb::make_preset(a.preset);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string(c.from_file ? "--shapes: " : "--preset: ") + e.what());
  }
  std::optional<sf::OptimizerConfig> config = sb::default_config_named(a.optimizer);
  if (!config) throw UsageError("--optimizer: unknown optimizer '" + a.optimizer + "'");
  c.config = *config;
  c.weights = parse_dtype("--weights", a.weights);
  c.grads = parse_dtype("--grads", a.grads);
  check_loss_scale_and_clip(a, c.grads);
  c.loss_scale = a.loss_scale;

  c.offsets.push_back(0);
  for (const sb::TensorShape& t : c.preset.tensors) {
    if (t.numel == 0) {
      ++c.empty_tensors;
      continue;
    }
    c.tensors.push_back(t);
    c.offsets.push_back(c.offsets.back() + t.numel);
  }
  if (c.tensors.empty()) throw UsageError("--ranks: the tensor list has no element to shard");
  c.two_phase = jit::is_two_phase(sf::UpdateProgram::from_config(c.config).program());
  c.tensor_cuts = c.whole || c.two_phase;
  c.cuts = cut_model(c.offsets, c.ranks, c.tensor_cuts);
  if (c.cuts.empty()) {
    std::int64_t places = static_cast<std::int64_t>(c.tensors.size());
    if (!c.tensor_cuts) {
      places = 0;
      for (const auto& t : c.tensors) places += (t.numel + sf::kShardAlign - 1) / sf::kShardAlign;
    }
    throw UsageError(format("--ranks %d: the model has %lld %s, too few to give each of %d ranks a part", c.ranks,
                            static_cast<long long>(places),
                            c.whole       ? "tensor(s) (--shard whole cuts at tensor boundaries only)"
                            : c.two_phase ? "tensor(s) (a two-phase program's tensors are never cut)"
                                          : "16,384-element chunk(s) (a tensor is cut at chunk boundaries only)",
                            c.ranks) +
                     "; use fewer ranks or a larger model");
  }

  sf::OptimizerOptions& o = c.options;
  if (a.clip > 0) o.max_grad_norm = a.clip;
  o.norm_type = a.norm_type == "inf" ? INFINITY : 2.0;
  o.master_weights = !a.no_masters;
  o.fusion = c.fusion;
  o.cpu_backend = c.cpu_backend;  // explicit: STEPFUSE_CPU_BACKEND changes nothing
  o.state_format = c.state;       // the sharded and the local step alike (min_q8_numel: per param, the library's)
  return c;
}

// ---- The launcher ----------------------------------------------------------------------------

bool under_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

std::string self_path(const char* argv0) {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n > 0) return std::string(buf, static_cast<std::size_t>(n));
  return argv0;
}

// Replaces this process with mpiexec running this program on N ranks; returns only when
// that cannot start (a usage error saying so).
int relaunch(const Args& a, int argc, char** argv) {
  if (std::getenv(kLaunchedVar) != nullptr)
    throw std::runtime_error("--ranks: started by mpiexec, but none of OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK is "
                             "set: that mpiexec is not the MPI this stepfuse-bench was built with; run it yourself "
                             "under the right one (mpiexec -n N stepfuse-bench --ranks N ...)");
  // The mpiexec CMake found (when it is still there), else the one on PATH.
  std::string mpiexec = STEPFUSE_BENCH_MPIEXEC;
  const bool built_with = !mpiexec.empty() && access(mpiexec.c_str(), X_OK) == 0;
  if (!built_with) mpiexec = "mpiexec";
  std::vector<std::string> args = {mpiexec, built_with ? STEPFUSE_BENCH_MPIEXEC_NUMPROC_FLAG : "-n",
                                   std::to_string(a.ranks)};
  // Open MPI refuses more ranks than it counts cores (slots) without it; harmless otherwise.
  if (built_with && STEPFUSE_BENCH_MPIEXEC_OPEN_MPI) args.push_back("--oversubscribe");
  args.push_back(self_path(argv[0]));
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  // Open MPI's mpirun refuses to run as root (containers, CI) without both; set only when unset.
  if (geteuid() == 0) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  }
  setenv(kLaunchedVar, "1", 1);
  std::vector<char*> cargs;
  for (auto& s : args) cargs.push_back(s.data());
  cargs.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  execvp(cargs[0], cargs.data());
  const int err = errno;
  unsetenv(kLaunchedVar);
  throw UsageError("--ranks " + std::to_string(a.ranks) + ": cannot run '" + mpiexec + "': " + std::strerror(err) +
                   " (install openmpi-bin: scripts/install_deps.sh; or run it under your MPI launcher yourself: "
                   "mpiexec -n " + std::to_string(a.ranks) + " stepfuse-bench --ranks " + std::to_string(a.ranks) +
                   " ...)");
}

// ---- Under MPI -------------------------------------------------------------------------------

// What the step's communicator does, per call: the MPI one, counted and timed.
class CountingCommunicator final : public sf::Communicator {
 public:
  struct Tally {
    int calls = 0;
    std::size_t sent = 0;      // bytes this rank contributed
    std::size_t received = 0;  // bytes that came from the other ranks
    double seconds = 0;
    std::string ops;           // "all_gather", comma-separated in call order
    std::size_t last_count = 0;
    sf::CommType last_type = sf::CommType::u8;
  };
  explicit CountingCommunicator(std::shared_ptr<sf::Communicator> inner) : inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  sf::Device device() const override { return inner_->device(); }
  std::string_view name() const override { return inner_->name(); }

  void all_gather(const void* send, void* recv, std::size_t count, sf::CommType type) override {
    const auto t0 = std::chrono::steady_clock::now();
    inner_->all_gather(send, recv, count, type);
    const std::size_t b = count * sf::comm_type_size(type);
    record("all_gather", count, type, b, b * static_cast<std::size_t>(size() - 1), seconds_since(t0));
  }
  // all_reduce and reduce_scatter count their payload both ways (what a rank gives and
  // gets; how many bytes cross the wire depends on the MPI library's algorithm).
  void all_reduce(void* data, std::size_t count, sf::CommType type, sf::ReduceOp op) override {
    const auto t0 = std::chrono::steady_clock::now();
    inner_->all_reduce(data, count, type, op);
    const std::size_t b = count * sf::comm_type_size(type);
    record("all_reduce", count, type, b, b, seconds_since(t0));
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, sf::CommType type, sf::ReduceOp op) override {
    const auto t0 = std::chrono::steady_clock::now();
    inner_->reduce_scatter(send, recv, count, type, op);
    const std::size_t b = count * sf::comm_type_size(type) * static_cast<std::size_t>(size());
    record("reduce_scatter", count, type, b, b / static_cast<std::size_t>(size()), seconds_since(t0));
  }

  // What was counted since the last take(), and a fresh count.
  Tally take() { return std::exchange(tally_, Tally{}); }

 private:
  void record(const char* op, std::size_t count, sf::CommType type, std::size_t sent, std::size_t received, double s) {
    ++tally_.calls;
    tally_.sent += sent;
    tally_.received += received;
    tally_.seconds += s;
    if (!tally_.ops.empty()) tally_.ops += ',';
    tally_.ops += op;
    tally_.last_count = count;
    tally_.last_type = type;
  }
  std::shared_ptr<sf::Communicator> inner_;
  Tally tally_;
};

// A failure that every rank agreed on (agreed() below): `code` is the exit code of every
// rank, `first` the lowest rank that failed, which prints `error` (its own exception).
struct RankFailure {
  int code;
  int first;
  std::exception_ptr error;  // null on ranks that did not fail
};

int exit_code_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const UsageError&) {
    return kExitUsage;
  } catch (const VerifyError&) {
    return kExitVerify;
  } catch (...) {
    return kExitError;
  }
}

// Runs fn on this rank, then tells every rank whether it failed anywhere (two
// MPI_Allreduce): throws RankFailure on every rank when so. Every rank must call it at the
// same point.
template <class Fn>
void agreed(int rank, Fn&& fn) {
  std::exception_ptr e;
  try {
    fn();
  } catch (...) {
    e = std::current_exception();
  }
  int mine[2] = {e ? exit_code_of(e) : 0, e ? -rank : -INT_MAX};  // max of -rank: the lowest failing rank
  int all[2] = {0, 0};
  MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (all[0] != 0) throw RankFailure{all[0], -all[1], e};
}

// A configuration the library rejects is a usage error (the same rule as the main path).
template <class Make>
sf::Optimizer make_optimizer(Make&& make) {
  try {
    return make();
  } catch (const sf::Error& e) {
    if (e.code() == sf::ErrorCode::invalid_argument || e.code() == sf::ErrorCode::unsupported)
      throw UsageError(std::string("the library rejects this configuration: ") + e.what());
    throw;
  }
}

void check_applied(const sf::StepResult& r, const char* what, int iteration) {
  if (!r.applied)
    throw VerifyError(std::string("the ") + what + " step " + std::to_string(iteration) +
                      " was skipped (found_inf=" + (r.found_inf ? "true" : "false") +
                      ") although every gradient is finite");
}

std::string mpi_library() {
  char buf[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  MPI_Get_library_version(buf, &len);
  std::string s(buf, static_cast<std::size_t>(std::max(0, len)));
  const std::size_t cut = s.find_first_of(",\n");
  if (cut != std::string::npos) s.resize(cut);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\0')) s.pop_back();
  return s;
}

void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

// One rank's figures, gathered on rank 0 (doubles, in this order).
struct RankFigures {
  double elements = 0, params = 0, values = 0, threads = 0;
  double local_s = 0, sharded_s = 0, collective_s = 0, gather_s = 0, reduce_s = 0, overhead_paired = 0;
  static constexpr int kCount = 10;
  void to(double* d) const {
    const double v[kCount] = {elements, params, values, threads, local_s, sharded_s, collective_s, gather_s, reduce_s,
                              overhead_paired};
    std::copy(v, v + kCount, d);
  }
  static RankFigures from(const double* d) {
    return {d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9]};
  }
};

struct Verified {
  sf::StepResult sharded;
  std::vector<double> local_norms;  // per rank
  double combined = 0;              // what the local norms make together
  double rel_diff = 0;
};

// The step's collective, as counted during the verification step.
struct StepCollective {
  int calls = 0;
  std::string ops;
  std::size_t count = 0;
  sf::CommType type = sf::CommType::f64;
  std::size_t sent = 0, received = 0;
};

std::string norm_label(const Args& a) { return a.norm_type == "inf" ? "inf" : "L2"; }

json summary_json(const sb::Summary& s, double scale) {
  return json{{"median", s.median * scale}, {"min", s.min * scale}, {"p25", s.p25 * scale},
              {"p75", s.p75 * scale},       {"max", s.max * scale}, {"count", s.count}};
}

// Rank 0's report: the table and the JSON.
void report(const Args& a, const RanksCase& c, const std::vector<RankFigures>& all, const Verified& ver,
            const StepCollective& sc, const sb::Summary mine[5], const std::string& mpi_lib, int ranks_per_node,
            std::ofstream& json_out) {
  const int R = c.ranks;
  RankFigures mx;
  double min_el = all[0].elements, max_el = all[0].elements;
  for (const RankFigures& f : all) {
    mx.local_s = std::max(mx.local_s, f.local_s);
    mx.sharded_s = std::max(mx.sharded_s, f.sharded_s);
    mx.collective_s = std::max(mx.collective_s, f.collective_s);
    mx.gather_s = std::max(mx.gather_s, f.gather_s);
    mx.reduce_s = std::max(mx.reduce_s, f.reduce_s);
    mx.overhead_paired = std::max(mx.overhead_paired, f.overhead_paired);
    min_el = std::min(min_el, f.elements);
    max_el = std::max(max_el, f.elements);
  }
  const double overhead = (mx.sharded_s - mx.local_s) / mx.local_s;
  std::int64_t max_values = 0;
  for (int r = 0; r < R; ++r) max_values = std::max(max_values, c.values(r));
  const std::size_t expected_bytes = static_cast<std::size_t>(max_values + 2) * sizeof(double);
  const std::string type_name(sf::comm_type_name(sc.type));
  const std::size_t call_bytes = sc.count * sf::comm_type_size(sc.type);  // the last call's, per rank
  const std::string what =
      c.from_file ? "shapes file " + a.shapes_path : "preset " + c.preset.name;

  std::string out;
  out += format("stepfuse-bench --ranks %d: the sharded step across %d MPI process%s (%s), %d per node\n", R, R,
                R == 1 ? "" : "es", mpi_lib.c_str(), ranks_per_node);
  out += format("%s: %zu tensor%s, %s parameters%s; shard: %s\n", what.c_str(), c.tensors.size(),
                c.tensors.size() == 1 ? "" : "s", with_commas(c.total()).c_str(),
                c.empty_tensors ? format(" (%zu empty tensors left out)", c.empty_tensors).c_str() : "",
                c.whole       ? "whole tensors (cut at tensor boundaries)"
                : c.two_phase ? "slices, cut at tensor boundaries only (a two-phase program's tensors are never split)"
                              : "slices (cut at 16,384-element chunk boundaries)");
  out += format("%s, %s weights, %s grads%s%s, clip %s (%s norm), loss scale %g, %s step (%s), %d thread%s per rank\n",
                std::string(sf::optimizer_name(c.config)).c_str(), a.weights.c_str(), a.grads.c_str(),
                !a.no_masters && c.weights != sf::DType::f32 ? " + fp32 masters" : "",
                c.state != sf::StateFormat::f32
                    ? format(", %s state", std::string(sf::state_format_name(c.state)).c_str()).c_str()
                    : "",
                a.clip > 0 ? format("%g", a.clip).c_str() : "off", norm_label(a).c_str(), a.loss_scale,
                mode_name(c.fusion), std::string(sf::cpu_backend_name(c.cpu_backend)).c_str(),
                static_cast<int>(all[0].threads), all[0].threads == 1 ? "" : "s");
  out += format("verified before timing: every rank's sharded step has grad norm %.17g, clip coefficient %.17g "
                "(bitwise the same on every rank)",
                ver.sharded.grad_norm, ver.sharded.clip_coef);
  if (R == 1)
    out += ", bitwise the local step's\n";
  else
    out += format(", which the ranks' local norms make together (%s; relative difference %.1e)\n",
                  a.norm_type == "inf" ? "their max, exactly" : "sqrt of the sum of their squares", ver.rel_diff);
  out += format("\nmedians of %d steps after %d warm-up, per rank (max: the slowest rank's median of each column)\n",
                a.steps, a.warmup);
  out += format("  %4s  %13s  %9s  %10s  %8s  %13s  %13s  %13s\n", "rank", "elements", "local ms", "sharded ms",
                "overhead", "in-step coll.", "all_gather", "all_reduce");
  out += format("  %4s  %13s  %9s  %10s  %8s  %13s  %13s  %13s\n", "", "", "", "", "", "us",
                format("%zu B us", call_bytes).c_str(), format("%zu B us", kAllReduceBytes).c_str());
  for (int r = 0; r < R; ++r) {
    const RankFigures& f = all[static_cast<std::size_t>(r)];
    out += format("  %4d  %13s  %9.3f  %10.3f  %+7.2f%%  %13.1f  %13.1f  %13.1f\n", r,
                  with_commas(static_cast<std::int64_t>(f.elements)).c_str(), f.local_s * 1e3, f.sharded_s * 1e3,
                  100.0 * (f.sharded_s - f.local_s) / f.local_s, f.collective_s * 1e6, f.gather_s * 1e6,
                  f.reduce_s * 1e6);
  }
  if (R > 1)
    out += format("  %4s  %13s  %9.3f  %10.3f  %+7.2f%%  %13.1f  %13.1f  %13.1f\n", "max", "", mx.local_s * 1e3,
                  mx.sharded_s * 1e3, 100.0 * overhead, mx.collective_s * 1e6, mx.gather_s * 1e6, mx.reduce_s * 1e6);
  out += format("  elements per rank: min %s, max %s; overhead = (sharded - local) / local; from each iteration's "
                "own pair of steps: median %+.2f%% (the largest over ranks)\n",
                with_commas(static_cast<std::int64_t>(min_el)).c_str(),
                with_commas(static_cast<std::int64_t>(max_el)).c_str(), 100.0 * mx.overhead_paired);
  out += format("\nthe step's collective: %d call%s per step (%s): %zu %s per rank%s = %s B sent and %s B received "
                "(from the %d other rank%s) per rank and step\n",
                sc.calls, sc.calls == 1 ? "" : "s", sc.ops.c_str(), sc.count, type_name.c_str(),
                sc.calls == 1 ? "" : " in the last call",
                with_commas(static_cast<std::int64_t>(sc.sent)).c_str(),
                with_commas(static_cast<std::int64_t>(sc.received)).c_str(), R - 1, R - 1 == 1 ? "" : "s");
  std::string values;
  for (int r = 0; r < R; ++r) values += (r ? ", " : "") + with_commas(c.values(r));
  out += format("  values each rank puts in (a whole tensor: 1; a slice of a split tensor: 1 per 16,384-element "
                "chunk): %s; + 2 flags, padded to the largest rank's: %s B per call expected from the layout%s\n",
                values.c_str(), with_commas(static_cast<std::int64_t>(expected_bytes)).c_str(),
                expected_bytes == call_bytes ? " (as counted)"
                                             : format(" (counted: %zu B in the last call)", call_bytes).c_str());
  out += format("  in-step coll.: the step's own collective, timed inside the step (with any wait for the slowest "
                "rank's reduce pass); all_gather: a bare one of the same "
                "%zu %s; all_reduce: a bare %zu-byte one (16 int64 sums, the payload of an exact fixed-point norm "
                "all-reduced instead)\n",
                sc.count, type_name.c_str(), kAllReduceBytes);
  if (!a.json_only) std::fputs(out.c_str(), stdout);

  if (!json_out.is_open() && !a.json_only) return;
  json j;
  j["tool"] = "stepfuse-bench";
  j["version"] = sf::version();
  j["mode"] = "ranks";
  j["mpi"] = mpi_lib;
  j["config"] = {{"ranks", R},
                 {"ranks_per_node", ranks_per_node},
                 {"shard", c.whole ? "whole" : "slices"},
                 {"preset", c.from_file ? json(nullptr) : json(c.preset.name)},
                 {"shapes_file", c.from_file ? json(a.shapes_path) : json(nullptr)},
                 {"tensors", c.tensors.size()},
                 {"params", c.total()},
                 {"optimizer", std::string(sf::optimizer_name(c.config))},
                 {"weights", a.weights},
                 {"grads", a.grads},
                 {"master_weights", !a.no_masters && c.weights != sf::DType::f32},
                 {"state", std::string(sf::state_format_name(c.state))},
                 {"clip", a.clip},
                 {"norm_type", a.norm_type == "inf" ? "inf" : "2"},
                 {"loss_scale", c.loss_scale},
                 {"fusion", mode_name(c.fusion)},
                 {"cpu_backend", std::string(sf::cpu_backend_name(c.cpu_backend))},
                 {"threads_per_rank", static_cast<int>(all[0].threads)},
                 {"steps", a.steps},
                 {"warmup", a.warmup}};
  json per_rank_values = json::array();
  for (int r = 0; r < R; ++r) per_rank_values.push_back(c.values(r));
  j["collective"] = {{"calls_per_step", sc.calls},
                     {"ops", sc.ops},
                     {"type", type_name},
                     {"count_per_rank", sc.count},
                     {"bytes_per_call_per_rank", call_bytes},
                     {"bytes_sent_per_rank", sc.sent},
                     {"bytes_received_per_rank", sc.received},
                     {"values_per_rank", per_rank_values},
                     {"bytes_per_call_expected_from_layout", expected_bytes}};
  j["verification"] = {{"grad_norm", ver.sharded.grad_norm},
                       {"clip_coef", ver.sharded.clip_coef},
                       {"ranks_agree", true},
                       {"local_norms", ver.local_norms},
                       {"local_norms_combined", ver.combined},
                       {"relative_difference", ver.rel_diff}};
  j["max_over_ranks"] = {{"elements_min", static_cast<std::int64_t>(min_el)},
                         {"elements_max", static_cast<std::int64_t>(max_el)},
                         {"local_step_ms", mx.local_s * 1e3},
                         {"sharded_step_ms", mx.sharded_s * 1e3},
                         {"overhead", overhead},
                         {"overhead_per_iteration_median", mx.overhead_paired},
                         {"in_step_collective_us", mx.collective_s * 1e6},
                         {"all_gather_us", mx.gather_s * 1e6},
                         {"all_reduce_128B_us", mx.reduce_s * 1e6}};
  json ranks = json::array();
  for (int r = 0; r < R; ++r) {
    const RankFigures& f = all[static_cast<std::size_t>(r)];
    ranks.push_back({{"rank", r},
                     {"elements", static_cast<std::int64_t>(f.elements)},
                     {"params", static_cast<std::int64_t>(f.params)},
                     {"values", static_cast<std::int64_t>(f.values)},
                     {"local_step_ms", f.local_s * 1e3},
                     {"sharded_step_ms", f.sharded_s * 1e3},
                     {"overhead", (f.sharded_s - f.local_s) / f.local_s},
                     {"overhead_per_iteration_median", f.overhead_paired},
                     {"in_step_collective_us", f.collective_s * 1e6},
                     {"all_gather_us", f.gather_s * 1e6},
                     {"all_reduce_128B_us", f.reduce_s * 1e6}});
  }
  j["per_rank"] = ranks;
  j["rank0"] = {{"local_step_ms", summary_json(mine[0], 1e3)},
                {"sharded_step_ms", summary_json(mine[1], 1e3)},
                {"in_step_collective_us", summary_json(mine[2], 1e6)},
                {"all_gather_us", summary_json(mine[3], 1e6)},
                {"all_reduce_128B_us", summary_json(mine[4], 1e6)}};
  write_json_report(j.dump(2) + "\n", json_out, a.json_path, a.json_only);
}

// Every rank: the benchmark. Returns the exit code; failures agreed on are RankFailure.
int run_rank(const Args& a, const RanksCase& c, int rank, int ranks_per_node) {
  const int R = c.ranks;
  const double S = c.loss_scale;
  const std::vector<Piece> pieces = c.pieces(rank);

  std::ofstream json_out;
  std::unique_ptr<sb::ModelBuffers> buf;
  std::optional<sf::Optimizer> local;
  std::vector<sf::TensorSlice> slices;
  int threads = a.threads > 0 ? a.threads
                              : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks_per_node);
  agreed(rank, [&] {
    if (rank == 0 && !a.json_path.empty()) {
      json_out.open(a.json_path);
      if (!json_out) throw UsageError("--json: cannot write '" + a.json_path + "'");
    }
    std::vector<sb::TensorShape> shapes;
    for (const Piece& p : pieces) {
      const sb::TensorShape& t = c.tensors[p.tensor];
      const bool whole_tensor = p.begin == 0 && p.end == t.numel;
      shapes.emplace_back(
          whole_tensor ? t.name : t.name + "[" + std::to_string(p.begin) + ":" + std::to_string(p.end) + "]",
          p.end - p.begin);
      slices.push_back({static_cast<std::int64_t>(p.tensor), p.begin});
    }
    buf = std::make_unique<sb::ModelBuffers>(shapes, c.weights, c.grads);
    buf->fill_weights(threads);
    buf->fill_grads(S, threads);
    sf::OptimizerOptions o = c.options;
    o.num_threads = threads;
    local.emplace(make_optimizer([&] { return sf::Optimizer(c.config, buf->params(), o); }));
  });
  threads = local->num_threads();

  // The sharded optimizer: its construction is collective and fails on every rank alike.
  auto counting = std::make_shared<CountingCommunicator>(sf::mpi_communicator(MPI_COMM_WORLD));
  std::optional<sf::Optimizer> sharded;
  agreed(rank, [&] {
    sf::OptimizerOptions o = c.options;
    o.num_threads = threads;
    o.communicator = counting;
    if (!c.whole) o.slices = slices;  // whole: every param is a model tensor, in rank order
    sharded.emplace(make_optimizer([&] { return sf::Optimizer(c.config, buf->params(), o); }));
  });
  counting->take();  // construction's exchanges are not the step's

  // ---- Verification: one step of each; every rank must see the same sharded result.
  Verified ver;
  StepCollective sc;
  sf::StepResult lr;
  agreed(rank, [&] {  // the local step first: it may fail on one rank alone
    lr = local->step_scaled(S);
    check_applied(lr, "local", 0);
  });
  agreed(rank, [&] {  // collective, and what it decides is the same on every rank
    ver.sharded = sharded->step_scaled(S);
    const CountingCommunicator::Tally t = counting->take();
    sc = {t.calls, t.ops, t.last_count, t.last_type, t.sent, t.received};
    check_applied(ver.sharded, "sharded", 0);
    const double mine[5] = {ver.sharded.grad_norm, ver.sharded.clip_coef, ver.sharded.applied ? 1.0 : 0.0,
                            ver.sharded.found_inf ? 1.0 : 0.0, lr.grad_norm};
    std::vector<double> every(5 * static_cast<std::size_t>(R));
    MPI_Allgather(mine, 5, MPI_DOUBLE, every.data(), 5, MPI_DOUBLE, MPI_COMM_WORLD);
    std::string problem;
    for (int r = 0; r < R; ++r) {
      const double* e = &every[5 * static_cast<std::size_t>(r)];
      ver.local_norms.push_back(e[4]);
      if (problem.empty() && std::memcmp(e, every.data(), 4 * sizeof(double)) != 0)
        problem = format("rank %d's sharded step has grad norm %.17g, clip coefficient %.17g, applied %g, found_inf "
                         "%g; rank 0's %.17g, %.17g, %g, %g",
                         r, e[0], e[1], e[2], e[3], every[0], every[1], every[2], every[3]);
    }
    const bool inf = a.norm_type == "inf";
    double acc = 0;
    for (double n : ver.local_norms) acc = inf ? std::max(acc, n) : acc + n * n;
    ver.combined = inf ? acc : std::sqrt(acc);
    const double s = ver.sharded.grad_norm;
    ver.rel_diff = s == ver.combined ? 0.0 : std::abs(s - ver.combined) / std::abs(s);
    if (problem.empty()) {
      if (R == 1 && std::memcmp(&s, &ver.local_norms[0], sizeof(double)) != 0)
        problem = format("on one rank the sharded step's grad norm %.17g is not bitwise the local step's %.17g", s,
                         ver.local_norms[0]);
      else if (inf && s != ver.combined)
        problem = format("the sharded step's inf-norm %.17g is not the max of the ranks' local norms, %.17g", s,
                         ver.combined);
      else if (!(ver.rel_diff <= 1e-10))
        problem = format("the sharded step's grad norm %.17g differs from sqrt(sum of the ranks' local norms squared) "
                         "%.17g by %.2e relative",
                         s, ver.combined, ver.rel_diff);
    }
    if (!problem.empty()) throw VerifyError(problem);
  });

  // ---- Timing.
  std::vector<std::byte> gather_send(sc.count * sf::comm_type_size(sc.type), std::byte{1});
  std::vector<std::byte> gather_recv(gather_send.size() * static_cast<std::size_t>(R));
  std::vector<std::int64_t> reduce_buf(kAllReduceBytes / sizeof(std::int64_t), 1);
  std::shared_ptr<sf::Communicator> bare = sf::mpi_communicator(MPI_COMM_WORLD);
  std::vector<double> local_s, sharded_s, coll_s, gather_s, reduce_s, paired;
  for (int it = 0; it < a.warmup + a.steps; ++it) {
    const bool timed = it >= a.warmup;
    double t_local = 0, t_sharded = 0;
    for (int k = 0; k < 2; ++k) {
      const bool is_sharded = (k == 0) == (it % 2 == 1);  // local first on even iterations
      barrier();
      const auto t0 = std::chrono::steady_clock::now();
      const sf::StepResult r = (is_sharded ? *sharded : *local).step_scaled(S);
      const double t = seconds_since(t0);
      check_applied(r, is_sharded ? "sharded" : "local", it);
      if (is_sharded) {
        t_sharded = t;
        const CountingCommunicator::Tally tally = counting->take();
        if (timed) coll_s.push_back(tally.seconds);
      } else {
        t_local = t;
      }
    }
    if (timed) {
      local_s.push_back(t_local);
      sharded_s.push_back(t_sharded);
      paired.push_back(t_sharded / t_local - 1.0);
    }
    for (int rep = 0; rep < kBareReps; ++rep) {
      barrier();
      auto t0 = std::chrono::steady_clock::now();
      bare->all_gather(gather_send.data(), gather_recv.data(), sc.count, sc.type);
      if (timed) gather_s.push_back(seconds_since(t0));
      barrier();
      t0 = std::chrono::steady_clock::now();
      bare->all_reduce(reduce_buf.data(), reduce_buf.size(), sf::CommType::i64, sf::ReduceOp::sum);
      if (timed) reduce_s.push_back(seconds_since(t0));
    }
  }

  const sb::Summary mine[5] = {sb::summarize(local_s), sb::summarize(sharded_s), sb::summarize(coll_s),
                               sb::summarize(gather_s), sb::summarize(reduce_s)};
  RankFigures f;
  for (const Piece& p : pieces) f.elements += static_cast<double>(p.end - p.begin);
  f.params = static_cast<double>(pieces.size());
  f.values = static_cast<double>(c.values(rank));
  f.threads = threads;
  f.local_s = mine[0].median;
  f.sharded_s = mine[1].median;
  f.collective_s = mine[2].median;
  f.gather_s = mine[3].median;
  f.reduce_s = mine[4].median;
  f.overhead_paired = sb::summarize(paired).median;
  double send[RankFigures::kCount];
  f.to(send);
  std::vector<double> gathered(rank == 0 ? static_cast<std::size_t>(R) * RankFigures::kCount : 0);
  MPI_Gather(send, RankFigures::kCount, MPI_DOUBLE, gathered.data(), RankFigures::kCount, MPI_DOUBLE, 0,
             MPI_COMM_WORLD);
  agreed(rank, [&] {
    if (rank != 0) return;
    std::vector<RankFigures> all;
    for (int r = 0; r < R; ++r)
      all.push_back(RankFigures::from(&gathered[static_cast<std::size_t>(r) * RankFigures::kCount]));
    report(a, c, all, ver, sc, mine, mpi_library(), ranks_per_node, json_out);
  });
  return kExitOk;
}

// Under an MPI launcher: MPI_Init, the world size check, every rank's run, MPI_Finalize.
int run_under_mpi(const Args& a) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized && MPI_Init(nullptr, nullptr) != MPI_SUCCESS)
    throw std::runtime_error("--ranks: MPI_Init failed");
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int ranks_per_node = 1;
  MPI_Comm_size(node, &ranks_per_node);
  MPI_Comm_free(&node);

  int code = kExitOk;
  try {
    std::optional<RanksCase> c;
    agreed(rank, [&] {
      if (size != a.ranks)
        throw UsageError(format("--ranks %d: running on %d MPI process%s (mpiexec -n %d): pass the same N to both, "
                                "or run stepfuse-bench --ranks N outside mpiexec (it starts mpiexec itself)",
                                a.ranks, size, size == 1 ? "" : "es", size));
      c.emplace(resolve_ranks_case(a));
    });
    code = run_rank(a, *c, rank, ranks_per_node);
  } catch (const RankFailure& f) {
    if (rank == f.first && f.error) {
      try {
        std::rethrow_exception(f.error);
      } catch (const std::exception& e) {
        const std::string who = f.first == 0 ? "" : format("rank %d: ", f.first);
        std::fprintf(stderr, "stepfuse-bench: %s%s%s\n", f.code == kExitVerify ? "VERIFICATION FAILED: " : "",
                     who.c_str(), e.what());
      } catch (...) {
        std::fprintf(stderr, "stepfuse-bench: rank %d: unknown error\n", f.first);
      }
    }
    code = f.code;
  } catch (const std::exception& e) {
    // Outside an agreed phase: the other ranks may be waiting in a collective.
    std::fprintf(stderr, "stepfuse-bench: rank %d of %d: %s%s (aborting the job)\n", rank, size,
                 dynamic_cast<const VerifyError*>(&e) ? "VERIFICATION FAILED: " : "", e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, dynamic_cast<const VerifyError*>(&e) ? kExitVerify : kExitError);
  }
  std::fflush(stdout);
  MPI_Finalize();
  return code;
}

}  // namespace

int run_ranks(const Args& a, int argc, char** argv) {
  if (under_mpi_launcher()) return run_under_mpi(a);
  resolve_ranks_case(a);  // usage errors once, here, rather than from every rank
  if (!a.json_path.empty()) {  // rank 0 writes it; appending creates it without truncating
    std::ofstream probe(a.json_path, std::ios::app);
    if (!probe) throw UsageError("--json: cannot write '" + a.json_path + "'");
  }
  return relaunch(a, argc, argv);
}

#endif  // STEPFUSE_BENCH_MPI

}  // namespace stepfuse::bench::tool
