// train_mlp: trains a small MLP with f16 weights and f16 gradients, dynamic loss scaling
// (stepfuse::GradScaler) and a fused AdamW step with gradient clipping — the training
// loop of torch.amp, on the CPU, in one file.
//
//   stepfuse-train-mlp [--steps N] [--threads N] [--lr X] [--weights f16|bf16]
//                      [--masters on|off|compensated] [--rounding nearest|stochastic]
//                      [--state f32|bf16|q8] [--help]
//
// The weight options compare ways of keeping low-precision weights: with fp32 masters
// (the default), without them (each update rounded to the weights' format), bf16
// without masters rounded stochastically (OptimizerOptions::stochastic_rounding), and
// bf16 with a bf16 compensation beside each weight instead of a master
// (OptimizerOptions::compensated_weights: 2 bytes per parameter instead of 4). --state
// stores AdamW's two moments as bf16 or as 8-bit blockwise-quantized codes
// (OptimizerOptions::state_format; q8 only for tensors of at least min_q8_numel = 4096
// elements, here the first layer's 64x256 weights: the rest keep f32 state).
//
// The task: classify 64-dimensional Gaussian inputs into the 10 classes that a fixed,
// random "teacher" network assigns them. Every number comes from a fixed seed, so two
// runs print the same losses. The forward and backward passes are plain single-threaded
// fp32 loops; the part stepfuse does is the optimizer step (unscale, inf/NaN check, clip,
// AdamW update, in one read of the gradients and one fused pass).
//
// Why loss scaling: the gradients are stored in f16, whose smallest normal value is
// 6.1e-5. Many gradient elements are smaller than that and would lose their precision or
// flush to zero. Scaling the loss by S (a power of two) scales every gradient by S, which
// moves them into f16's range; the optimizer divides by S again in fp32. If S is too
// large, some scaled gradient exceeds f16's largest value (65504) and becomes inf: the
// GradScaler then skips that step (nothing is written) and halves S. After
// growth_interval good steps in a row it doubles S, to keep S as large as f16 allows.
//
// Exit status: 0 if training reduced the loss, 1 if it did not (or stepfuse rejected an
// input), 2 for a bad command line.

#include <stepfuse/stepfuse.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace {

// The model: 64 inputs -> 256 hidden units (tanh) -> 10 logits, softmax cross-entropy.
constexpr int kInputs = 64;
constexpr int kHidden = 256;
constexpr int kClasses = 10;
constexpr int kBatch = 128;         // samples per training step, drawn fresh every step
constexpr int kEvalSamples = 2048;  // a fixed held-out set: the loss reported at start and end

// Training setup (see train() for how each is used).
constexpr int kDefaultSteps = 1000;
constexpr double kLearningRate = 3e-3;
// clip_grad_norm_(params, 1.0): a safety net against a bad batch. This model's gradient
// norms stay below 1 once the scale has settled, so here it rarely clips, if ever.
constexpr double kMaxGradNorm = 1.0;
// PyTorch's default initial scale is 65536 (2^16). This model's gradients are small
// enough that 2^16 never overflows, so start at 2^24 to show what happens when the
// initial scale is too large: the first steps overflow, are skipped, and back off.
constexpr double kInitScale = 16777216.0;
constexpr std::int64_t kGrowthInterval = 50;  // PyTorch's default is 2000; short runs need less
// The run fails (exit 1) unless the held-out loss ends below this fraction of its start.
constexpr double kRequiredLossRatio = 0.75;

// f16 storage: stepfuse's own conversions (round to nearest even, the same as its
// kernels use); your framework's half type works just as well.
using stepfuse::float_to_f16;

// ---------------------------------------------------------------------------------------
// The model's parameters, as the optimizer sees them: f16 (or bf16) weights and f16
// gradients in caller-owned buffers. stepfuse keeps views of them, and by default it also
// keeps fp32 master copies (OptimizerOptions::master_weights): it updates the masters and
// writes the rounded result back into these 16-bit buffers. (With --masters compensated it
// keeps a bf16 compensation per weight instead: the rest that rounding the weight lost.)

struct Tensor {
  stepfuse::DType type;              // of the weights: f16 or bf16
  std::vector<std::uint16_t> value;  // the weights' bits
  std::vector<std::uint16_t> grad;   // f16 bits, written by forward_backward()

  Tensor(std::size_t n, stepfuse::DType weights) : type(weights), value(n), grad(n) {}
  stepfuse::Param param() {
    const auto n = static_cast<std::int64_t>(value.size());
    return {stepfuse::TensorView{value.data(), n, type}, stepfuse::TensorView{grad.data(), n, stepfuse::DType::f16}};
  }
};

struct Mlp {
  Tensor w1, b1, w2, b2;  // w1 [kHidden][kInputs] and w2 [kClasses][kHidden], as torch.nn.Linear stores them

  explicit Mlp(stepfuse::DType weights)
      : w1(kHidden * kInputs, weights), b1(kHidden, weights), w2(kClasses * kHidden, weights), b2(kClasses, weights) {}
  std::vector<stepfuse::Param> params() { return {w1.param(), b1.param(), w2.param(), b2.param()}; }
};

// torch.nn.Linear's initialization: uniform in +-1/sqrt(fan_in), for weights and biases.
void init_layer(Tensor& weight, Tensor& bias, int fan_in, std::mt19937& rng) {
  const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  std::uniform_real_distribution<float> uniform(-bound, bound);
  const auto store = [&](float x) {
    return weight.type == stepfuse::DType::bf16 ? stepfuse::float_to_bf16(x) : float_to_f16(x);
  };
  for (auto& w : weight.value) w = store(uniform(rng));
  for (auto& b : bias.value) b = store(uniform(rng));
}

// The fp32 copy of the f16 weights that the forward and backward passes compute with
// (what autocast does: low-precision storage, fp32 arithmetic).
struct Weights {
  std::vector<float> w1, b1, w2, b2;
};

std::vector<float> widen(const Tensor& t) {
  std::vector<float> out(t.value.size());
  stepfuse::to_float({const_cast<std::uint16_t*>(t.value.data()), static_cast<std::int64_t>(t.value.size()), t.type},
                     out);
  return out;
}

Weights to_f32(const Mlp& net) { return {widen(net.w1), widen(net.b1), widen(net.w2), widen(net.b2)}; }

// ---------------------------------------------------------------------------------------
// Synthetic data: x ~ N(0, 1), labelled by a fixed random teacher 64 -> 32 (tanh) -> 10.

struct Teacher {
  static constexpr int kTeacherHidden = 32;
  std::vector<float> w1, w2;  // [32][64], [10][32]

  explicit Teacher(std::mt19937& rng) : w1(kTeacherHidden * kInputs), w2(kClasses * kTeacherHidden) {
    // Unit-variance pre-activations: the tanh units work in their nonlinear range, so the
    // labels are a nonlinear function of x that a linear model cannot fit.
    std::normal_distribution<float> n1(0.0f, 1.0f / std::sqrt(float{kInputs}));
    std::normal_distribution<float> n2(0.0f, 1.0f / std::sqrt(float{kTeacherHidden}));
    for (auto& w : w1) w = n1(rng);
    for (auto& w : w2) w = n2(rng);
  }

  int label(const float* x) const {
    float h[kTeacherHidden];
    for (int j = 0; j < kTeacherHidden; ++j) {
      float sum = 0;
      for (int i = 0; i < kInputs; ++i) sum += w1[j * kInputs + i] * x[i];
      h[j] = std::tanh(sum);
    }
    int best = 0;
    float best_logit = -INFINITY;
    for (int k = 0; k < kClasses; ++k) {
      float logit = 0;
      for (int j = 0; j < kTeacherHidden; ++j) logit += w2[k * kTeacherHidden + j] * h[j];
      if (logit > best_logit) {
        best_logit = logit;
        best = k;
      }
    }
    return best;
  }
};

struct Batch {
  std::vector<float> x;  // [size][kInputs]
  std::vector<int> y;    // [size], class labels
  int size() const { return static_cast<int>(y.size()); }
};

Batch make_batch(int size, const Teacher& teacher, std::mt19937& rng) {
  Batch batch{std::vector<float>(static_cast<std::size_t>(size) * kInputs), std::vector<int>(size)};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : batch.x) v = normal(rng);
  for (int n = 0; n < size; ++n) batch.y[n] = teacher.label(&batch.x[n * kInputs]);
  return batch;
}

// ---------------------------------------------------------------------------------------
// Forward and backward passes, in fp32.

float dot(const float* a, const float* b, int n) {
  float sum = 0;
  for (int i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One sample's forward pass: hidden activations h[kHidden] and logits[kClasses].
// Returns the sample's cross-entropy loss, and leaves softmax(logits) in probs.
float forward(const Weights& w, const float* x, int label, float* h, float* probs) {
  for (int j = 0; j < kHidden; ++j) h[j] = std::tanh(dot(&w.w1[j * kInputs], x, kInputs) + w.b1[j]);
  float logits[kClasses];
  for (int k = 0; k < kClasses; ++k) logits[k] = dot(&w.w2[k * kHidden], h, kHidden) + w.b2[k];
  const float max_logit = *std::max_element(logits, logits + kClasses);
  float sum = 0;
  for (int k = 0; k < kClasses; ++k) sum += probs[k] = std::exp(logits[k] - max_logit);
  for (int k = 0; k < kClasses; ++k) probs[k] /= sum;
  return std::log(sum) - (logits[label] - max_logit);  // -log softmax(logits)[label]
}

// Forward and backward of the mean cross-entropy over a batch. The backward pass starts
// from d(S * loss)/d(loss) = S, as scaler.scale(loss).backward() does in PyTorch, so every
// gradient comes out multiplied by the loss scale S. The gradients are accumulated in fp32
// and rounded to f16 when stored into the optimizer's gradient buffers: where S times a
// gradient exceeds 65504 it becomes inf — the overflow the GradScaler detects.
// Returns the (unscaled) mean loss.
double forward_backward(Mlp& net, const Batch& batch, float loss_scale) {
  const Weights w = to_f32(net);
  std::vector<float> g_w1(w.w1.size()), g_b1(w.b1.size()), g_w2(w.w2.size()), g_b2(w.b2.size());
  const float d_sample_loss = loss_scale / static_cast<float>(batch.size());  // d(S * mean)/d(loss_n)

  double loss = 0;
  float h[kHidden], probs[kClasses], d_h[kHidden];
  for (int n = 0; n < batch.size(); ++n) {
    const float* x = &batch.x[n * kInputs];
    loss += forward(w, x, batch.y[n], h, probs);

    // Softmax cross-entropy: d loss / d logits = softmax(logits) - onehot(label).
    float d_logits[kClasses];
    for (int k = 0; k < kClasses; ++k) d_logits[k] = d_sample_loss * (probs[k] - (k == batch.y[n] ? 1.0f : 0.0f));

    // Second layer: logits = W2 h + b2.
    std::fill(d_h, d_h + kHidden, 0.0f);
    for (int k = 0; k < kClasses; ++k) {
      g_b2[k] += d_logits[k];
      for (int j = 0; j < kHidden; ++j) {
        g_w2[k * kHidden + j] += d_logits[k] * h[j];
        d_h[j] += w.w2[k * kHidden + j] * d_logits[k];
      }
    }
    // First layer: h = tanh(W1 x + b1), and tanh' = 1 - tanh^2.
    for (int j = 0; j < kHidden; ++j) {
      const float d_pre = d_h[j] * (1.0f - h[j] * h[j]);
      g_b1[j] += d_pre;
      for (int i = 0; i < kInputs; ++i) g_w1[j * kInputs + i] += d_pre * x[i];
    }
  }

  // Store the scaled gradients as f16: this is where a too-large S overflows.
  auto store = [](const std::vector<float>& g, Tensor& t) {
    stepfuse::from_float(g, {t.grad.data(), static_cast<std::int64_t>(t.grad.size()), stepfuse::DType::f16});
  };
  store(g_w1, net.w1), store(g_b1, net.b1), store(g_w2, net.w2), store(g_b2, net.b2);
  return loss / batch.size();
}

struct Evaluation {
  double loss;
  double accuracy;
};

// The mean loss and accuracy over a fixed data set (forward only).
Evaluation evaluate(const Mlp& net, const Batch& data) {
  const Weights w = to_f32(net);
  float h[kHidden], probs[kClasses];
  double loss = 0;
  int correct = 0;
  for (int n = 0; n < data.size(); ++n) {
    loss += forward(w, &data.x[n * kInputs], data.y[n], h, probs);
    correct += std::max_element(probs, probs + kClasses) - probs == data.y[n];
  }
  return {loss / data.size(), static_cast<double>(correct) / data.size()};
}

// ---------------------------------------------------------------------------------------
// Command line.

struct Args {
  int steps = kDefaultSteps;
  int threads = 0;  // 0: stepfuse's default (STEPFUSE_NUM_THREADS, else every core)
  double lr = kLearningRate;
  std::string weights = "f16";      // f16 or bf16
  std::string masters = "on";       // fp32 masters: on, off, or compensated (bf16 compensations instead)
  std::string rounding = "nearest";  // nearest or stochastic (bf16 weights without masters)
  std::string state = "f32";         // the optimizer state's storage: f32, bf16 or q8
};

// A whole decimal number >= min_value, handed on to CLI11 in plain digits (CLI11 alone
// reads "010" as octal and "0x10" as hex).
CLI::Validator whole_number(int min_value) {
  return CLI::Validator(
      [min_value](std::string& text) {
        int value = 0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error != std::errc{} || end != text.data() + text.size() || value < min_value)
          return "wants an integer >= " + std::to_string(min_value) + ", not '" + text + "'";
        text = std::to_string(value);
        return std::string();
      },
      "", "");
}

// Fills `args`; returns -1 to go on, else the exit status (0 after --help, 2 on an error).
int parse_args(int argc, char** argv, Args& args) {
  CLI::App app{"Trains a 64-256-10 MLP (f16 or bf16 weights, f16 gradients) with GradScaler and a fused, clipped AdamW step "
               "on synthetic data.",
               "stepfuse-train-mlp"};
  app.add_option("--steps", args.steps, "training steps (at least 1)")->transform(whole_number(1))->capture_default_str();
  app.add_option("--threads", args.threads,
                 "threads for the optimizer step (0: STEPFUSE_NUM_THREADS, else every core)")
      ->transform(whole_number(0))
      ->capture_default_str();
  app.add_option("--lr", args.lr, "AdamW's learning rate")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--weights", args.weights, "the weights' storage: f16 or bf16 (the gradients stay f16)")
      ->check(CLI::IsMember({"f16", "bf16"}))
      ->capture_default_str();
  app.add_option("--masters", args.masters,
                 "fp32 master weights in the optimizer: on, off, or compensated (bf16 weights: a bf16 compensation "
                 "beside each weight instead, 2 bytes per parameter rather than 4; "
                 "OptimizerOptions::compensated_weights)")
      ->check(CLI::IsMember({"on", "off", "compensated"}))
      ->capture_default_str();
  app.add_option("--rounding", args.rounding,
                 "how updated weights are stored without masters: nearest (even) or stochastic (bf16 weights, "
                 "--masters off; OptimizerOptions::stochastic_rounding, seed 1)")
      ->check(CLI::IsMember({"nearest", "stochastic"}))
      ->capture_default_str();
  app.add_option("--state", args.state,
                 "how AdamW's moments are stored between steps: f32, bf16 (2 bytes each) or q8 (8-bit blockwise "
                 "quantization, 1 byte each + 4 per 256, for tensors of at least 4096 elements; smaller ones keep "
                 "f32); OptimizerOptions::state_format")
      ->check(CLI::IsMember({"f32", "bf16", "q8"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help: the help on stdout, 0; else the error and a pointer to --help on stderr.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (args.masters == "compensated" && args.weights != "bf16") {
    std::fprintf(stderr, "stepfuse-train-mlp: --masters compensated keeps a bf16 compensation beside bf16 weights: "
                         "pass --weights bf16 (f16 weights keep fp32 masters: --masters on)\n");
    return 2;
  }
  if (args.masters == "compensated" && args.rounding == "stochastic") {
    std::fprintf(stderr, "stepfuse-train-mlp: --masters compensated and --rounding stochastic exclude each other "
                         "(the compensation keeps what rounding to nearest loses): pass one of them\n");
    return 2;
  }
  if (args.rounding == "stochastic" && (args.weights != "bf16" || args.masters != "off")) {
    std::fprintf(stderr, "stepfuse-train-mlp: --rounding stochastic rounds bf16 weights kept without masters: "
                         "pass --weights bf16 --masters off\n");
    return 2;
  }
  return -1;
}

// Trains the model; returns the exit status (0: the loss fell as it should, 1: it did not).
int train(const Args& args) {
  // Data and model, from fixed seeds.
  std::mt19937 rng(20240601);
  const Teacher teacher(rng);
  const Batch eval_set = make_batch(kEvalSamples, teacher, rng);
  const stepfuse::DType weights = args.weights == "bf16" ? stepfuse::DType::bf16 : stepfuse::DType::f16;
  Mlp net(weights);
  init_layer(net.w1, net.b1, kInputs, rng);
  init_layer(net.w2, net.b2, kHidden, rng);

  // The optimizer: AdamW over the four 16-bit tensors, with fp32 masters (the default) and
  // clip_grad_norm_(params, 1.0) folded into the step. Construction validates the
  // tensors, allocates the optimizer state and the masters, and plans the work; a step
  // allocates nothing.
  stepfuse::OptimizerOptions options;
  options.max_grad_norm = kMaxGradNorm;
  options.num_threads = args.threads;
  options.master_weights = args.masters == "on";
  options.compensated_weights = args.masters == "compensated";
  options.stochastic_rounding = args.rounding == "stochastic";
  options.seed = 1;
  options.state_format = args.state == "q8"     ? stepfuse::StateFormat::q8
                         : args.state == "bf16" ? stepfuse::StateFormat::bf16
                                                : stepfuse::StateFormat::f32;
  const stepfuse::optim::AdamW adamw{.lr = args.lr};  // PyTorch's defaults otherwise
  stepfuse::Optimizer opt(adamw, net.params(), options);

  // Dynamic loss scaling with PyTorch's GradScaler rules. "cpu": the scale lives on the CPU.
  stepfuse::GradScaler scaler("cpu", kInitScale, /*growth_factor=*/2.0, /*backoff_factor=*/0.5, kGrowthInterval);

  std::printf("stepfuse %s (%s): train a %d-%d-%d MLP (tanh, softmax cross-entropy), batch %d\n", stepfuse::version(),
              stepfuse::cpu_target(), kInputs, kHidden, kClasses, kBatch);
  std::printf("  weights %s (%s), gradients f16, compute fp32\n", args.weights.c_str(),
              options.master_weights        ? "fp32 masters in the optimizer"
              : options.compensated_weights ? "no masters: a bf16 compensation per weight in the optimizer"
              : options.stochastic_rounding ? "no masters: updates rounded stochastically"
                                            : "no masters: updates rounded to nearest");
  // The state as stored: the bytes of every stream (and q8's absmaxes) over every tensor.
  double state_bytes = 0;
  std::int64_t numel = 0;
  for (std::size_t p = 0; p < opt.num_params(); ++p) {
    numel += opt.params()[p].weight.numel;
    for (std::string_view s : opt.state_names())
      state_bytes += static_cast<double>(opt.state_storage(p, s).size() + opt.state_absmax(p, s).size_bytes());
  }
  std::printf("  AdamW state %s: %.2f bytes per parameter (f32: 8)%s\n", args.state.c_str(),
              numel > 0 ? state_bytes / static_cast<double>(numel) : 0.0,
              args.state == "q8" ? "; q8 for tensors of at least 4096 elements, f32 for the others" : "");
  std::printf("  AdamW lr %g, weight decay %g, clip grad norm %g; GradScaler init scale %.0f, growth interval %lld\n",
              adamw.lr, adamw.weight_decay, kMaxGradNorm, kInitScale, static_cast<long long>(kGrowthInterval));
  std::printf("  %d steps; optimizer step on %d threads, forward/backward on 1\n\n", args.steps, opt.num_threads());

  const Evaluation initial = evaluate(net, eval_set);
  std::printf("held-out loss %.4f, accuracy %.1f%% before training\n\n", initial.loss, 100 * initial.accuracy);
  std::printf("%6s  %10s  %10s  %8s  %9s\n", "step", "train loss", "scale", "skipped", "grad norm");

  using Clock = std::chrono::steady_clock;
  Clock::duration optimizer_time{};
  const Clock::time_point start = Clock::now();
  const int print_every = std::max(1, args.steps / 20);
  int skipped = 0;
  int clipped = 0;      // applied steps whose gradient norm was above kMaxGradNorm
  double loss_sum = 0;  // train loss since the last printed line
  int loss_count = 0;

  for (int step = 1; step <= args.steps; ++step) {
    const Batch batch = make_batch(kBatch, teacher, rng);
    const double scale = scaler.get_scale();  // S for this step

    // 1. Forward, and backward of scaler.scale(loss): f16 gradients, multiplied by S.
    //    scaler.scale(1.0) is d(scaler.scale(loss))/d(loss) = S, the backward pass's seed.
    const double loss = forward_backward(net, batch, static_cast<float>(scaler.scale(1.0)));

    const Clock::time_point optimizer_start = Clock::now();
    // 2. Unscale, check for inf/NaN, clip to max_grad_norm, AdamW update: one fused step.
    //    If any scaled gradient overflowed, nothing is written and it returns false.
    const bool applied = scaler.step(opt);
    // 3. Halve S after a skipped step; double it after kGrowthInterval applied steps in a row.
    scaler.update();
    optimizer_time += Clock::now() - optimizer_start;

    skipped += applied ? 0 : 1;
    clipped += applied && scaler.last_step_result().clip_coef < 1.0 ? 1 : 0;
    loss_sum += loss, ++loss_count;
    // Print every skipped step while the scale is still backing off from its initial value,
    // then every print_every steps.
    const bool backing_off = !applied && skipped == step;
    if (backing_off || step % print_every == 0 || step == args.steps) {
      // grad_norm is the norm of the unscaled gradients before clipping; inf on a skipped step.
      std::printf("%6d  %10.4f  %10.0f  %8d  %9.4f%s\n", step, loss_sum / loss_count, scale, skipped,
                  scaler.last_step_result().grad_norm, applied ? "" : "  (overflow: skipped, scale halved)");
      loss_sum = 0, loss_count = 0;
    }
  }

  const double total_s = std::chrono::duration<double>(Clock::now() - start).count();
  const double optimizer_s = std::chrono::duration<double>(optimizer_time).count();
  const Evaluation final = evaluate(net, eval_set);
  std::printf("\nheld-out loss %.4f -> %.4f, accuracy %.1f%% -> %.1f%%\n", initial.loss, final.loss,
              100 * initial.accuracy, 100 * final.accuracy);
  std::printf(
      "steps: %d, applied %lld (%d of them clipped), skipped %d (inf/NaN in the scaled f16 gradients);"
      " final scale %.0f\n",
      args.steps, static_cast<long long>(opt.step_count()), clipped, skipped, scaler.get_scale());
  std::printf("time: %.2f s; optimizer step (scaler.step + update) %.4f s = %.2f%%, %.1f us per step\n", total_s,
              optimizer_s, 100 * optimizer_s / total_s, 1e6 * optimizer_s / args.steps);

  if (!(final.loss < kRequiredLossRatio * initial.loss)) {
    std::fprintf(stderr, "stepfuse-train-mlp: FAILED: the held-out loss did not fall below %.2f x its start\n",
                 kRequiredLossRatio);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const int status = parse_args(argc, argv, args); status >= 0) return status;
  try {
    return train(args);
  } catch (const stepfuse::Error& e) {
    // Bad input to stepfuse (a tensor, a hyperparameter, a thread count): thrown before
    // anything is written. Overflowing gradients are not errors; step() reports them.
    const std::string_view code = stepfuse::error_code_name(e.code());
    std::fprintf(stderr, "stepfuse-train-mlp: %.*s: %s\n", static_cast<int>(code.size()), code.data(), e.what());
    return 1;
  }
}
