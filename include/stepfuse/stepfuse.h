/* stepfuse C ABI: the fused optimizer step, GradScaler and LossScaleOptimizer for C and
 * foreign-language runtimes (C99; also compiles as C++). The C++ API is stepfuse.hpp.
 *
 * Conventions (every function below follows them):
 *
 * - Errors. A function that can fail returns sf_status: SF_OK, or the code of the
 *   failure, and then sf_last_error() returns the message. A bad argument or a call
 *   at the wrong time changes nothing (the C++ API validates before it writes). The
 *   message is per thread and stays until the next failing call on the same thread
 *   (successful calls do not clear it, as errno). Results come back through out
 *   pointers, which are written only on SF_OK (sf_optimizer_program_text's size and
 *   truncated copy excepted). A NULL handle or out pointer is SF_INVALID_ARGUMENT
 *   with a message naming the function and the argument; only the *_destroy
 *   functions and arguments documented as optional accept NULL. No C++ exception
 *   ever leaves this interface.
 *
 * - Versioned structs. The configuration, options, result and state structs start
 *   with `uint32_t struct_size`, so they can grow in later versions, and each has an
 *   *_init function that sets it (and, for inputs, PyTorch's defaults): call it,
 *   then change fields. For output structs, setting struct_size = sizeof(the struct)
 *   also does. Each sf_X_init is a macro that passes the caller's sizeof(sf_X) to
 *   the function sf_X_init_size, which writes that many bytes and no more: a program
 *   built against this header keeps working with a later library whose structs grew
 *   (its own struct's fields are set, and struct_size to its size). The functions
 *   named sf_X_init remain, for programs built before the macros and for callers that
 *   cannot use them: they write the struct's size as of this release, and keep doing
 *   so as the structs grow. A size this library does not know (a caller compiled against another
 *   version's header, or an uninitialized struct) is SF_INVALID_ARGUMENT, saying
 *   which size it expected. sf_tensor_view, sf_param and sf_device are fixed.
 *
 * - Memory. Weights and gradients are caller-owned (sf_tensor_view) and must stay
 *   valid, at the same addresses, for the optimizer's lifetime. Handles are created by
 *   *_create and released by *_destroy. Pointers returned into a handle (state,
 *   masters, names, norms) stay valid as documented at each function.
 *
 * - Threads. One handle must not be used by two threads at once; different handles
 *   may. sf_last_error() and the version/status queries are thread-safe.
 */
#ifndef STEPFUSE_STEPFUSE_H_
#define STEPFUSE_STEPFUSE_H_

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Must match include/stepfuse/version.hpp and the CMake project version
 * (runtime/c_api.cpp static_asserts the first; tests/c_api checks the second). The
 * definitions are token for token those of version.hpp, so both headers can be
 * included together. */
#define STEPFUSE_VERSION_MAJOR 0
#define STEPFUSE_VERSION_MINOR 1
#define STEPFUSE_VERSION_PATCH 0
#define STEPFUSE_VERSION (STEPFUSE_VERSION_MAJOR * 10000 + STEPFUSE_VERSION_MINOR * 100 + STEPFUSE_VERSION_PATCH)

/* Marks the exported functions, so the library can be built with -fvisibility=hidden. */
#ifndef STEPFUSE_API
#if defined(__GNUC__) || defined(__clang__)
#define STEPFUSE_API __attribute__((visibility("default")))
#else
#define STEPFUSE_API
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version, status, errors -------------------------------------------------- */

/* "MAJOR.MINOR.PATCH" of the library actually linked (static storage). */
STEPFUSE_API const char* sf_version(void);
/* STEPFUSE_VERSION of the library actually linked. */
STEPFUSE_API int sf_version_number(void);
/* The Highway target the CPU kernels dispatch to on this machine, e.g. "AVX2". */
STEPFUSE_API const char* sf_cpu_target(void);
/* The LLVM version of the CPU JIT backend ("14.0.6"), or "" when this build has none. */
STEPFUSE_API const char* sf_llvm_version(void);

/* One to one with stepfuse::ErrorCode, plus out of memory (std::bad_alloc) and
 * internal (any other exception: a bug in stepfuse). */
typedef enum sf_status {
  SF_OK = 0,
  SF_INVALID_ARGUMENT, /* a bad value passed by the caller; the message names it */
  SF_INVALID_STATE,    /* a call that is not allowed at this point */
  SF_UNSUPPORTED,      /* a valid request this build or machine cannot serve */
  SF_COMPILE_FAILED,   /* a generated kernel did not compile (log and source in the message) */
  SF_DEVICE_ERROR,     /* the accelerator or its driver reported an error */
  SF_IO_ERROR,         /* a file could not be read or written */
  SF_OUT_OF_MEMORY,
  SF_INTERNAL
} sf_status;

/* "SF_OK", "SF_INVALID_ARGUMENT", ...; "SF_UNKNOWN_STATUS" for other values. */
STEPFUSE_API const char* sf_status_name(sf_status status);
/* The message of the last failed call on this thread ("" if none has failed), as the
 * C++ API words it ("stepfuse: ..."). Valid until the next failing call on this
 * thread. Never NULL. */
STEPFUSE_API const char* sf_last_error(void);

/* ---- Tensors, devices ------------------------------------------------------------ */

/* Storage formats; all arithmetic is fp32. */
typedef enum sf_dtype { SF_F32 = 0, SF_F16 = 1, SF_BF16 = 2 } sf_dtype;

typedef enum sf_device_kind { SF_DEVICE_CPU = 0, SF_DEVICE_CUDA = 1 } sf_device_kind;
typedef struct sf_device {
  sf_device_kind kind;
  int index; /* GPU ordinal for SF_DEVICE_CUDA; 0 for the CPU */
} sf_device;

/* A contiguous, caller-owned tensor (data may be NULL when numel is 0). On a GPU
 * optimizer, data is device memory of its GPU. */
typedef struct sf_tensor_view {
  void* data;
  int64_t numel;
  sf_dtype dtype;
} sf_tensor_view;

/* One parameter: its weights and the gradient of the loss with respect to them. */
typedef struct sf_param {
  sf_tensor_view weight;
  sf_tensor_view grad;
} sf_param;

/* Conversions bit for bit as the kernels do them (round to nearest even, inf and NaN
 * preserved): for filling f16/bf16 gradients and reading f16/bf16 weights. */
STEPFUSE_API uint16_t sf_float_to_f16(float value);
STEPFUSE_API float sf_f16_to_float(uint16_t bits);
STEPFUSE_API uint16_t sf_float_to_bf16(float value);
STEPFUSE_API float sf_bf16_to_float(uint16_t bits);
/* dst[i] = src[i] widened; SF_INVALID_ARGUMENT unless src.numel == dst_numel. */
STEPFUSE_API sf_status sf_to_float(sf_tensor_view src, float* dst, int64_t dst_numel);
/* dst[i] = src[i] rounded to dst's dtype; SF_INVALID_ARGUMENT unless dst.numel == src_numel. */
STEPFUSE_API sf_status sf_from_float(const float* src, int64_t src_numel, sf_tensor_view dst);

/* ---- CUDA availability, warnings ----------------------------------------------- */

/* Whether the CUDA backend can run here (a driver, NVRTC and a device). When not, and
 * reason is not NULL, writes why (as much as fits in cap bytes, NUL-terminated;
 * "" when available). Loads the driver and NVRTC on the first call; cheap after. */
STEPFUSE_API bool sf_cuda_available(char* reason, size_t cap);
/* Whether NVRTC alone is usable (code generation and compilation, no kernels run). */
STEPFUSE_API bool sf_nvrtc_available(char* reason, size_t cap);

/* Warnings: things the library works around but the caller should know about (a
 * GradScaler asked for "cuda" where no GPU is usable, say), each sent once per process
 * per cause. `message` is valid during the call only. The handler and `user` are
 * process-wide (one for all threads; a later call replaces them) and may be called
 * from any thread that uses the library. NULL restores the default handler, which
 * writes "stepfuse: warning: <message>" to stderr. */
typedef void (*sf_warning_handler)(const char* message, void* user);
STEPFUSE_API void sf_set_warning_handler(sf_warning_handler handler, void* user);

/* ---- Optimizer configuration ----------------------------------------------------- */

typedef enum sf_optimizer_kind {
  SF_SGD = 0,
  SF_ADAM = 1,
  SF_ADAMW = 2,
  SF_ADAGRAD = 3,
  SF_RMSPROP = 4,
  SF_LION = 5,
  SF_NADAM = 6,
  SF_RADAM = 7,
  SF_ADAMAX = 8,
  SF_ADADELTA = 9,
  SF_RPROP = 10,
  SF_ASGD = 11,
  SF_LAMB = 12,
  /* Not a kind: one more than the last kind of this header. A new kind goes on a line
   * above it; the library fails to build if this count and its optimizers disagree. */
  SF_NUM_OPTIMIZER_KINDS
} sf_optimizer_kind;

/* "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Lion", "NAdam", "RAdam", "Adamax",
 * "Adadelta", "Rprop", "ASGD", "LAMB"; NULL for other values. */
STEPFUSE_API const char* sf_optimizer_kind_name(sf_optimizer_kind kind);

/* How an optimizer state stream is stored between steps (stepfuse::StateFormat;
 * docs/low-precision.md). The update always computes in fp32: a stored stream is decoded
 * when a step loads it and encoded when it stores it, in the same single pass. */
typedef enum sf_state_format {
  SF_STATE_F32 = 0,  /* 4 bytes per element, exact */
  SF_STATE_BF16 = 1, /* 2 bytes per element (bf16 bit patterns), rounded to nearest even (stochastically
                      * for a tensor whose bf16 weights round stochastically, unless
                      * sf_optimizer_options.stochastic_state_rounding is false) */
  /* Block-wise 8-bit dynamic quantization, as bitsandbytes': per block of
   * SF_STATE_Q8_BLOCK elements one fp32 absmax and one byte (a code) per element, the
   * nearest of 256 codes (a signed code, or an unsigned one for non-negative streams). */
  SF_STATE_Q8 = 2
} sf_state_format;
/* The elements per q8 block: a q8 stream of numel elements has ceil(numel / 256) absmaxes. */
#define SF_STATE_Q8_BLOCK 256

/* The hyperparameters of every kind, with PyTorch's names (torch.optim.*; Lion as in
 * its paper). Each kind reads only its own fields:
 *   SGD:     lr, momentum, dampening, weight_decay, nesterov, maximize
 *   Adam(W): lr, beta1, beta2, eps, weight_decay, amsgrad, maximize
 *   Adagrad: lr, lr_decay, weight_decay, initial_accumulator_value, eps, maximize
 *   RMSprop: lr, alpha, eps, weight_decay, momentum, centered, maximize
 *   Lion:    lr, beta1, beta2, weight_decay, maximize
 *   NAdam:   lr, beta1, beta2, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize
 *   RAdam:   lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize
 *   Adamax:  lr, beta1, beta2, eps, weight_decay, maximize
 *   Adadelta: lr, rho, eps, weight_decay, maximize
 *   Rprop:   lr, eta_minus, eta_plus, step_size_min, step_size_max, maximize
 *            (PyTorch's etas and step_sizes pairs)
 *   ASGD:    lr, lambd, alpha, t0, weight_decay, maximize
 *   LAMB:    lr, beta1, beta2, eps, weight_decay, maximize (NVIDIA Apex's FusedLAMB)
 * The fields of other kinds must be 0 / false (as sf_optimizer_config_init leaves
 * them): a non-zero one is SF_INVALID_ARGUMENT, as an unknown keyword is in PyTorch. */
typedef struct sf_optimizer_config {
  uint32_t struct_size; /* sizeof(sf_optimizer_config); set by sf_optimizer_config_init */
  sf_optimizer_kind kind;
  double lr;
  double beta1, beta2;
  double eps;
  double weight_decay;
  double momentum, dampening;
  double alpha;
  double lr_decay, initial_accumulator_value;
  bool amsgrad, nesterov, centered, maximize;
  /* NAdam, RAdam, Adadelta, Rprop, ASGD (see above) */
  double momentum_decay;
  double rho;
  double eta_minus, eta_plus, step_size_min, step_size_max;
  double lambd, t0;
  bool decoupled_weight_decay;
  /* ---- Since 0.1 with per-group state formats (a struct_size of SF_OPTIMIZER_CONFIG_SIZE_V1,
   * from an older stepfuse.h, is read and written without these: they keep their defaults). */
  /* The group's own state storage, instead of sf_optimizer_options.state_format, when
   * has_state_format is set: every state stream of the group's params is stored as
   * state_format, except the streams sf_optimizer_options.state_formats names (q8 for
   * the matrices' group, bf16 for the embeddings', say). Read when the group is created
   * (sf_optimizer_create, sf_optimizer_create_groups, sf_optimizer_add_param_group). The
   * getters set has_state_format when the group was given its own format, and
   * state_format to the format its streams take either way (sf_optimizer_get_config:
   * group 0's). A config given to a setter must leave has_state_format false or name
   * the format the group's streams take (group 0's, for sf_optimizer_set_config, so
   * that what sf_optimizer_get_config gave can be set back): storage is chosen once;
   * to change it, save a checkpoint and load it into a new optimizer with
   * sf_load_options.convert_state.
   * Default SF_STATE_F32, false. */
  sf_state_format state_format;
  bool has_state_format;
} sf_optimizer_config;
/* The fields of the struct of an older stepfuse.h end here; a struct_size of these, or of
 * the older struct's sizeof (these rounded up to the struct's alignment), is read and
 * written as that struct: its fields only. */
#define SF_OPTIMIZER_CONFIG_SIZE_V1 offsetof(sf_optimizer_config, state_format)

/* Sets struct_size, kind, and PyTorch's defaults for that kind (e.g. AdamW: lr 1e-3,
 * betas 0.9/0.999, eps 1e-8, weight_decay 1e-2); other fields 0. An unknown kind is
 * kept, for sf_optimizer_create to reject. Writes nothing if config is NULL. */
STEPFUSE_API void sf_optimizer_config_init(sf_optimizer_config* config, sf_optimizer_kind kind);
STEPFUSE_API void sf_optimizer_config_init_size(sf_optimizer_config* config, sf_optimizer_kind kind,
    size_t struct_size);
#define sf_optimizer_config_init(config, kind) \
  sf_optimizer_config_init_size((config), (kind), sizeof(sf_optimizer_config))

typedef enum sf_fusion {
  SF_FUSION_FUSED = 0,      /* one reduce pass + one update pass per step */
  SF_FUSION_UNFUSED = 1,    /* the eager baseline, one pass per operation (CPU only) */
  SF_FUSION_INTERPRETED = 2 /* fused, with the update program interpreted (CPU only) */
} sf_fusion;

/* The code that runs a fused step on the CPU (the C++ CpuBackend). Every choice gives
 * bitwise the same results, unless llvm_contract is set. */
typedef enum sf_cpu_backend {
  SF_CPU_BACKEND_DEFAULT = 0, /* STEPFUSE_CPU_BACKEND (auto, highway, llvm), else AUTO */
  SF_CPU_BACKEND_AUTO = 1,    /* LLVM code once compiled (in the background), Highway meanwhile */
  SF_CPU_BACKEND_HIGHWAY = 2, /* Highway SIMD kernels (the interpreter for custom programs) */
  SF_CPU_BACKEND_LLVM = 3     /* LLVM code, compiled at creation; SF_UNSUPPORTED without LLVM */
} sf_cpu_backend;

/* The norm clipping and the reported gradient norm use. */
typedef enum sf_norm_type { SF_NORM_L2 = 0, SF_NORM_INF = 1 } sf_norm_type;


/* One per-stream override of sf_optimizer_options.state_format. */
typedef struct sf_stream_format {
  const char* stream;     /* a state stream's name, as sf_optimizer_state_name gives them ("exp_avg") */
  sf_state_format format;
} sf_stream_format;

typedef struct sf_optimizer_options {
  uint32_t struct_size; /* sizeof(sf_optimizer_options); set by sf_optimizer_options_init */
  /* Where weights, gradients and state live; with CUDA every sf_param points to
   * device memory of that GPU. Default: the CPU. */
  sf_device device;
  /* CUDA: the stream (CUstream / cudaStream_t) steps are enqueued on; NULL is the
   * default stream. Must be NULL for the CPU. */
  void* cuda_stream;
  /* clip_grad_norm_(max_grad_norm) on the unscaled gradients, inside the step. */
  bool has_max_grad_norm;
  double max_grad_norm;
  sf_norm_type norm_type; /* default SF_NORM_L2 */
  bool master_weights;    /* fp32 masters for f16/bf16 weights; default true */
  sf_fusion fusion;       /* default SF_FUSION_FUSED */
  /* CPU threads; 0 (default) = STEPFUSE_NUM_THREADS, else the machine's cores.
   * Results are bitwise identical for every thread count. */
  int num_threads;
  /* Compute the gradient norm on plain steps too (one more read of the gradients). */
  bool track_grad_norm;
  /* ---- Since 0.1 with the LLVM backend (a struct_size of SF_OPTIMIZER_OPTIONS_SIZE_V1,
   * from an older stepfuse.h, is read without these: they keep their defaults). */
  sf_cpu_backend cpu_backend; /* CPU, SF_FUSION_FUSED; default SF_CPU_BACKEND_DEFAULT */
  /* LLVM: fuse the update's multiply-add pairs into FMAs (results then equal Highway's
   * within fp32 rounding, not bit for bit). Default false. */
  bool llvm_contract;
  /* ---- Since 0.1 with stochastic rounding (a struct_size of SF_OPTIMIZER_OPTIONS_SIZE_V2,
   * from an older stepfuse.h, is read without these: they keep their defaults). */
  /* bf16 weights without masters (master_weights = false): round each updated weight to
   * bf16 stochastically (Philox4x32-10 keyed by seed; bitwise the same on every backend and
   * thread count; docs/low-precision.md). Default false. */
  bool stochastic_rounding;
  uint64_t seed; /* the random stream of stochastic_rounding; default 0 */
  /* ---- Since 0.1 with compensated weights (a struct_size of SF_OPTIMIZER_OPTIONS_SIZE_V3,
   * from an older stepfuse.h, is read without these: they keep their defaults). */
  /* bf16 weights without masters (master_weights = false): keep a bf16 compensation beside
   * each bf16 weight, the part of the parameter that rounding it to bf16 lost (2 bytes per
   * parameter instead of an fp32 master's 4; docs/low-precision.md). Default false. */
  bool compensated_weights;
  /* ---- Since 0.1 with state formats (a struct_size of SF_OPTIMIZER_OPTIONS_SIZE_V4, from
   * an older stepfuse.h, is read without these: they keep their defaults). */
  /* How every state stream is stored (docs/low-precision.md), except the streams named in
   * state_formats. A stream the program keeps in full precision (ASGD's "ax";
   * SF_STATE_VALUES_FULL_PRECISION) stays f32 under this blanket format, and a blanket
   * format that no state stream of the optimizer can take is SF_INVALID_ARGUMENT. Default
   * SF_STATE_F32. */
  sf_state_format state_format;
  /* Per-stream formats, num_state_formats entries (state_formats may be NULL when it is
   * 0; copied by create): each names a state stream of the optimizer at most once. An
   * unknown name, a name given twice, or a full-precision stream asked for bf16 or q8 is
   * SF_INVALID_ARGUMENT. Default NULL, 0. */
  const sf_stream_format* state_formats;
  size_t num_state_formats;
  /* q8 applies to tensors of at least this many elements; smaller ones keep f32
   * (bitsandbytes' min_8bit_size). >= 0; default 4096. */
  int64_t min_q8_numel;
  /* ---- Since 0.1 with the state's rounding (a struct_size of SF_OPTIMIZER_OPTIONS_SIZE_V5,
   * from an older stepfuse.h, is read without it: it keeps its default). */
  /* With stochastic_rounding: the bf16 state of the stochastically rounded weights rounds
   * stochastically too (true), or to nearest even (false: no random bits drawn for it, as
   * torchao's bf16 state; a second moment moving by less than half a bf16 ulp a step then
   * stalls). Default true. */
  bool stochastic_state_rounding;
} sf_optimizer_options;
/* The fields of the struct of an older stepfuse.h end here; a struct_size of these, or of
 * the older struct's sizeof (these rounded up to the struct's alignment), is read and
 * written as that struct: its fields only. */
#define SF_OPTIMIZER_OPTIONS_SIZE_V1 offsetof(sf_optimizer_options, cpu_backend)
#define SF_OPTIMIZER_OPTIONS_SIZE_V2 offsetof(sf_optimizer_options, stochastic_rounding)
#define SF_OPTIMIZER_OPTIONS_SIZE_V3 offsetof(sf_optimizer_options, compensated_weights)
#define SF_OPTIMIZER_OPTIONS_SIZE_V4 offsetof(sf_optimizer_options, state_format)
#define SF_OPTIMIZER_OPTIONS_SIZE_V5 offsetof(sf_optimizer_options, stochastic_state_rounding)

/* Sets struct_size and the defaults above. Writes nothing if options is NULL. */
STEPFUSE_API void sf_optimizer_options_init(sf_optimizer_options* options);
STEPFUSE_API void sf_optimizer_options_init_size(sf_optimizer_options* options, size_t struct_size);
#define sf_optimizer_options_init(options) sf_optimizer_options_init_size((options), sizeof(sf_optimizer_options))

/* What one step did. An output struct: sf_step_result_init() it before the call. */
typedef struct sf_step_result {
  uint32_t struct_size; /* sizeof(sf_step_result); set by sf_step_result_init */
  bool applied;         /* false: non-finite gradients, nothing was written */
  bool found_inf;       /* some gradient element was inf or NaN */
  /* CUDA: the step is enqueued and decided on the device; the other fields are not
   * known yet. sf_optimizer_last_result() waits and tells. */
  bool pending;
  double grad_norm; /* norm of the unscaled gradients; NaN when not computed */
  double clip_coef; /* multiplier clipping applied to the unscaled gradients (1: none) */
} sf_step_result;

/* Zeroes the struct and sets struct_size. Writes nothing if result is NULL. */
STEPFUSE_API void sf_step_result_init(sf_step_result* result);
STEPFUSE_API void sf_step_result_init_size(sf_step_result* result, size_t struct_size);
#define sf_step_result_init(result) sf_step_result_init_size((result), sizeof(sf_step_result))

/* ---- Optimizer ---------------------------------------------------------------- */

typedef struct sf_optimizer sf_optimizer;

/* Validates everything (config, params, options), allocates the optimizer state and
 * fp32 masters, plans the work. Copies the config, the options and the param array
 * (not the tensors: those must stay valid and in place until sf_optimizer_destroy).
 * options may be NULL (the defaults). Errors: SF_INVALID_ARGUMENT (a bad
 * hyperparameter or param, named in the message), SF_UNSUPPORTED (a device this build
 * or machine cannot use), SF_OUT_OF_MEMORY. On error *out is left as it was. */
STEPFUSE_API sf_status sf_optimizer_create(const sf_optimizer_config* config, const sf_param* params,
                                           size_t num_params, const sf_optimizer_options* options,
                                           sf_optimizer** out);
/* Frees the optimizer's state and masters (not the caller's tensors). NULL is a no-op.
 * Destroy any sf_loss_scale_optimizer wrapping it first, and do not destroy it between
 * a GradScaler's step and update. */
STEPFUSE_API void sf_optimizer_destroy(sf_optimizer* opt);

/* One step on gradients that are already unscaled (plain, non-AMP use). Reads grads,
 * writes weights, state and masters; allocates nothing. With max_grad_norm, clips
 * first and skips on non-finite gradients. On a GPU: enqueued, does not wait. */
STEPFUSE_API sf_status sf_optimizer_step(sf_optimizer* opt);
/* One step on gradients scaled by loss_scale (finite and above 2^-128: its fp32
 * reciprocal is finite; else SF_INVALID_ARGUMENT): unscale, inf/NaN check,
 * clip, update in one reduce and one update pass; on non-finite gradients nothing is
 * written and the step count does not advance. result (may be NULL) gets what the
 * step did (pending on a GPU). */
STEPFUSE_API sf_status sf_optimizer_step_scaled(sf_optimizer* opt, double loss_scale, sf_step_result* result);
/* What the last step did (on a GPU: waits for it). */
STEPFUSE_API sf_status sf_optimizer_last_result(const sf_optimizer* opt, sf_step_result* result);

/* The hyperparameters (out->struct_size must be set, e.g. by sf_optimizer_config_init;
 * every field is overwritten): group 0's, its state format included. */
STEPFUSE_API sf_status sf_optimizer_get_config(const sf_optimizer* opt, sf_optimizer_config* out);
/* New hyperparameters of the same kind, in effect at the next step, no recompilation.
 * Changing what changes the program (amsgrad, nesterov, centered, momentum on/off) or
 * the kind is SF_INVALID_ARGUMENT: create a new optimizer for that. */
STEPFUSE_API sf_status sf_optimizer_set_config(sf_optimizer* opt, const sf_optimizer_config* config);
/* The options the optimizer was created with (out->struct_size must be set, e.g. by
 * sf_optimizer_options_init; every field is overwritten). state_formats then points
 * into the optimizer (the names too), valid until it is destroyed; NULL when
 * num_state_formats is 0. */
STEPFUSE_API sf_status sf_optimizer_get_options(const sf_optimizer* opt, sf_optimizer_options* out);
/* set_lr sets every param group's lr; get_lr reads group 0's. */
STEPFUSE_API sf_status sf_optimizer_set_lr(sf_optimizer* opt, double lr);
STEPFUSE_API sf_status sf_optimizer_get_lr(const sf_optimizer* opt, double* lr);

/* Param groups, as torch.optim's: tensors with their own hyperparameters. Every
 * group of one optimizer has the same kind; any hyperparameter or flag may differ
 * (weight_decay 0 for biases and norms, another lr for embeddings, amsgrad for
 * some). One step still has one reduce pass, one global gradient norm over every
 * group (max_grad_norm clips it), one skip decision and one update pass. Params are
 * numbered group after group (sf_optimizer_state and the per-tensor norms use that
 * numbering). sf_optimizer_create is one group. */
typedef struct sf_param_group {
  const sf_param* params;              /* num_params params (not NULL when num_params > 0) */
  size_t num_params;                   /* > 0 */
  const sf_optimizer_config* config;   /* not NULL; struct_size set */
} sf_param_group;
/* As sf_optimizer_create, with groups. Errors name the group ("groups[1].config:
 * ..."); the same tensor in two groups, or twice in one, is SF_INVALID_ARGUMENT naming
 * both places. */
STEPFUSE_API sf_status sf_optimizer_create_groups(const sf_param_group* groups, size_t num_groups,
                                                  const sf_optimizer_options* options, sf_optimizer** out);
STEPFUSE_API sf_status sf_optimizer_num_groups(const sf_optimizer* opt, size_t* count);
/* A group's hyperparameters; a group index out of range is SF_INVALID_ARGUMENT. */
STEPFUSE_API sf_status sf_optimizer_get_group_config(const sf_optimizer* opt, size_t group, sf_optimizer_config* out);
STEPFUSE_API sf_status sf_optimizer_set_group_config(sf_optimizer* opt, size_t group,
                                                     const sf_optimizer_config* config);
STEPFUSE_API sf_status sf_optimizer_get_group_lr(const sf_optimizer* opt, size_t group, double* lr);
STEPFUSE_API sf_status sf_optimizer_set_group_lr(sf_optimizer* opt, size_t group, double lr);
/* Appends a group (torch's add_param_group): its params follow the existing ones, with
 * fresh state and a step count of their own starting at 0; the existing groups keep
 * their state. Call it between steps. On error nothing changes. */
STEPFUSE_API sf_status sf_optimizer_add_param_group(sf_optimizer* opt, const sf_param_group* group);
/* The group of param `param` (in the group-after-group numbering). */
STEPFUSE_API sf_status sf_optimizer_group_of(const sf_optimizer* opt, size_t param, size_t* group);
/* The steps a group has applied (the optimizer's, less those before it was added). On a
 * GPU: waits. */
STEPFUSE_API sf_status sf_optimizer_group_step_count(const sf_optimizer* opt, size_t group, int64_t* count);
/* Sets a group's step count (what bias corrections and schedules see), as when restoring
 * a framework's checkpoint that keeps steps itself (PyTorch's state[p]["step"]). count >= 0,
 * else SF_INVALID_ARGUMENT; nothing else changes. */
STEPFUSE_API sf_status sf_optimizer_set_group_step_count(sf_optimizer* opt, size_t group, int64_t count);
/* NAdam: a group's mu_product after its steps so far, as PyTorch keeps it (state
 * "mu_product", fp32): the product of every applied step's mu_t = beta1 * (1 - 0.5 *
 * 0.96^(t * momentum_decay)) under the beta1 and momentum_decay that step ran with (a
 * config set between steps changes them for later steps only, as in PyTorch). Another
 * optimizer is SF_INVALID_STATE. On a GPU: waits. */
STEPFUSE_API sf_status sf_optimizer_nadam_mu_product(const sf_optimizer* opt, size_t group, double* mu_product);
/* NAdam: the group's later steps multiply onto mu_product (in [0, 1], else
 * SF_INVALID_ARGUMENT) as the product so far, as when restoring PyTorch's state. */
STEPFUSE_API sf_status sf_optimizer_set_nadam_mu_product(sf_optimizer* opt, size_t group, double mu_product);
/* Steps applied (skipped steps do not count). On a GPU: waits. */
STEPFUSE_API sf_status sf_optimizer_step_count(const sf_optimizer* opt, int64_t* count);
/* Norm of the unscaled gradients of the last step; +inf when they were not finite,
 * NaN when the step computed none. On a GPU: waits. */
STEPFUSE_API sf_status sf_optimizer_last_grad_norm(const sf_optimizer* opt, double* norm);
/* Per-tensor norms of the unscaled gradients from the last reduce pass: *norms points
 * into the optimizer, *count entries, valid until its next step or destroy. */
STEPFUSE_API sf_status sf_optimizer_last_tensor_grad_norms(const sf_optimizer* opt, const double** norms,
                                                           size_t* count);
STEPFUSE_API sf_status sf_optimizer_num_params(const sf_optimizer* opt, size_t* count);
STEPFUSE_API sf_status sf_optimizer_num_threads(const sf_optimizer* opt, int* threads);
/* What runs the next step's update (static storage): "llvm", "highway", "interpreter",
 * "unfused" or "cuda" (Optimizer::backend()). */
STEPFUSE_API sf_status sf_optimizer_backend(const sf_optimizer* opt, const char** name);

/* Optimizer state by name: sf_optimizer_state_names() gives how many state tensors
 * each param has, sf_optimizer_state_name() the index-th name (e.g. "exp_avg"; static
 * for the optimizer's lifetime). */
STEPFUSE_API sf_status sf_optimizer_state_names(const sf_optimizer* opt, size_t* count);
STEPFUSE_API sf_status sf_optimizer_state_name(const sf_optimizer* opt, size_t index, const char** name);
/* The fp32 state tensor `name` of param `param`: *data (host memory, also for a GPU
 * optimizer: a copy fetched from the device, waiting for it) with *numel elements,
 * valid until the next step or destroy. An unknown name or param index is
 * SF_INVALID_ARGUMENT (the message lists the state names); a stream stored as bf16 or
 * q8 (sf_optimizer_options.state_format) is SF_INVALID_STATE: read it with
 * sf_optimizer_state_values, or as stored with sf_optimizer_state_storage. */
STEPFUSE_API sf_status sf_optimizer_state(const sf_optimizer* opt, size_t param, const char* name,
                                          const float** data, int64_t* numel);
/* As sf_optimizer_state, writable; changes take effect at the next step. */
STEPFUSE_API sf_status sf_optimizer_mutable_state(sf_optimizer* opt, size_t param, const char* name, float** data,
                                                  int64_t* numel);
/* How state stream `name` of param `param` is stored (the options' choice; q8 falls back
 * to f32 for tensors below min_q8_numel). Errors as sf_optimizer_state's, without the
 * format one. */
STEPFUSE_API sf_status sf_optimizer_state_format(const sf_optimizer* opt, size_t param, const char* name,
                                                 sf_state_format* format);
/* Any format: copies the values the next step loads into values[0 .. numel - 1], decoded
 * to fp32 (exact for f32 and bf16, code * absmax for q8). numel must be the param's
 * element count, else SF_INVALID_ARGUMENT. */
STEPFUSE_API sf_status sf_optimizer_state_values(const sf_optimizer* opt, size_t param, const char* name,
                                                 float* values, int64_t numel);
/* Any format: writes numel fp32 values (the param's element count) into the stream as a
 * step stores them (rounded to bf16, or quantized block by block); they take effect at
 * the next step. On an error nothing is written. */
STEPFUSE_API sf_status sf_optimizer_set_state_values(sf_optimizer* opt, size_t param, const char* name,
                                                     const float* values, int64_t numel);
/* The stream's bytes as stored: fp32 values, bf16 bit patterns (uint16_t) or q8 codes (one
 * byte per element), *bytes = numel * 4, 2 or 1; host memory, valid as sf_optimizer_state's
 * pointer. Any format (f32 too). */
STEPFUSE_API sf_status sf_optimizer_state_storage(const sf_optimizer* opt, size_t param, const char* name,
                                                  const void** data, size_t* bytes);
/* As sf_optimizer_state_storage, writable (restoring state saved in its format); changes
 * take effect at the next step. */
STEPFUSE_API sf_status sf_optimizer_mutable_state_storage(sf_optimizer* opt, size_t param, const char* name,
                                                          void** data, size_t* bytes);
/* A q8 stream's fp32 absmax per block of SF_STATE_Q8_BLOCK elements: *count =
 * ceil(numel / 256) (the last block may be partial), valid as sf_optimizer_state's pointer.
 * *data = NULL and *count = 0 for a stream stored as f32 or bf16. */
STEPFUSE_API sf_status sf_optimizer_state_absmax(const sf_optimizer* opt, size_t param, const char* name,
                                                 const float** data, size_t* count);
/* As sf_optimizer_state_absmax, writable; changes take effect at the next step. */
STEPFUSE_API sf_status sf_optimizer_mutable_state_absmax(sf_optimizer* opt, size_t param, const char* name,
                                                         float** data, size_t* count);
/* The fp32 master copy of an f16/bf16 param (host memory, as state); *data = NULL and
 * *numel = 0 when the weights are f32 or masters are off. */
STEPFUSE_API sf_status sf_optimizer_master(const sf_optimizer* opt, size_t param, const float** data,
                                           int64_t* numel);
/* The bf16 compensation of a bf16 param (compensated_weights), as bf16 bit patterns in
 * host memory, as state: the parameter is weight + compensation. *data = NULL and
 * *numel = 0 for f32 weights or without compensated weights. */
STEPFUSE_API sf_status sf_optimizer_compensation(const sf_optimizer* opt, size_t param, const uint16_t** data,
                                                 int64_t* numel);
/* The update program as text, into a caller buffer. *needed (may be NULL) gets the
 * size including the terminating NUL. buf = NULL with cap = 0 only asks the size
 * (SF_OK). A buffer smaller than needed gets as much as fits, NUL-terminated, and the
 * call returns SF_INVALID_ARGUMENT. */
STEPFUSE_API sf_status sf_optimizer_program_text(const sf_optimizer* opt, char* buf, size_t cap, size_t* needed);

typedef struct sf_grad_scaler sf_grad_scaler;

/* Checkpoints: writes the hyperparameters, step count, every state tensor and the fp32
 * masters (with scaler not NULL: its state too) to path atomically (temporary file,
 * then rename), with a format version and a checksum. The weights are the caller's. */
STEPFUSE_API sf_status sf_optimizer_save(const sf_optimizer* opt, const char* path, const sf_grad_scaler* scaler);
/* Restores a file written by sf_optimizer_save for an optimizer of the same kind,
 * program, sizes and dtypes (with scaler not NULL: the scaler too; the file must hold
 * a scaler's state). A missing, truncated or corrupt file is SF_IO_ERROR, a mismatch
 * SF_INVALID_ARGUMENT; both leave the optimizer and scaler as they were. */
STEPFUSE_API sf_status sf_optimizer_load(sf_optimizer* opt, const char* path, sf_grad_scaler* scaler);

/* How sf_optimizer_load_ex treats a checkpoint (stepfuse::LoadOptions). */
typedef struct sf_load_options {
  uint32_t struct_size; /* sizeof(sf_load_options); set by sf_load_options_init */
  /* A state stream saved in another format (f32, bf16, q8) than this optimizer stores it
   * (sf_optimizer_options.state_format differs): converted (decoded to fp32, then encoded
   * as a step stores it) when true; else SF_INVALID_ARGUMENT naming the param, the stream
   * and both formats. Streams saved in this optimizer's format load bit for bit either
   * way. Default false. */
  bool convert_state;
} sf_load_options;

/* Sets struct_size and the defaults above. Writes nothing if options is NULL. */
STEPFUSE_API void sf_load_options_init(sf_load_options* options);
STEPFUSE_API void sf_load_options_init_size(sf_load_options* options, size_t struct_size);
#define sf_load_options_init(options) sf_load_options_init_size((options), sizeof(sf_load_options))
/* As sf_optimizer_load, with options (NULL: the defaults, which is sf_optimizer_load). */
STEPFUSE_API sf_status sf_optimizer_load_ex(sf_optimizer* opt, const char* path, sf_grad_scaler* scaler,
                                            const sf_load_options* options);

/* ---- GradScaler (torch.amp.GradScaler) ------------------------------------------- */

typedef struct sf_grad_scaler_options {
  uint32_t struct_size; /* sizeof(sf_grad_scaler_options); set by sf_grad_scaler_options_init */
  /* "cuda" (default) or "cpu": where the scale lives. "cuda" without a usable GPU
   * keeps it on the CPU and warns once per process. Copied by create. */
  const char* device;
  double init_scale;       /* 65536 */
  double growth_factor;    /* 2 */
  double backoff_factor;   /* 0.5 */
  int64_t growth_interval; /* 2000 */
  bool enabled;            /* true; false: step() is a plain step, the rest no-ops */
} sf_grad_scaler_options;

/* Sets struct_size and PyTorch's defaults above. Writes nothing if options is NULL. */
STEPFUSE_API void sf_grad_scaler_options_init(sf_grad_scaler_options* options);
STEPFUSE_API void sf_grad_scaler_options_init_size(sf_grad_scaler_options* options, size_t struct_size);
#define sf_grad_scaler_options_init(options) sf_grad_scaler_options_init_size((options), sizeof(sf_grad_scaler_options))
/* options may be NULL (the defaults). SF_INVALID_ARGUMENT for a device other than
 * "cuda"/"cpu", init_scale not finite and > 0, growth_factor not finite and > 1,
 * backoff_factor not in (0, 1), growth_interval < 1. Not thread-safe: one scaler per
 * training loop. */
STEPFUSE_API sf_status sf_grad_scaler_create(const sf_grad_scaler_options* options, sf_grad_scaler** out);
/* NULL is a no-op. */
STEPFUSE_API void sf_grad_scaler_destroy(sf_grad_scaler* scaler);

/* *scaled = loss * S (loss itself when disabled). */
STEPFUSE_API sf_status sf_grad_scaler_scale(const sf_grad_scaler* scaler, double loss, double* scaled);
/* Multiplies a tensor (or each of count tensors) in place by S, rounding to its dtype.
 * No-op when disabled. */
STEPFUSE_API sf_status sf_grad_scaler_scale_(const sf_grad_scaler* scaler, sf_tensor_view tensor);
STEPFUSE_API sf_status sf_grad_scaler_scale_views_(const sf_grad_scaler* scaler, const sf_tensor_view* tensors,
                                                   size_t count);
/* Divides opt's gradients in place by S and records whether any was inf/NaN. Twice
 * for one optimizer in an iteration, or after step, is SF_INVALID_STATE. */
STEPFUSE_API sf_status sf_grad_scaler_unscale_(sf_grad_scaler* scaler, sf_optimizer* opt);
/* The fused step (unscale unless unscale_ ran, check, clip, update); skipped, writing
 * nothing, on inf/NaN. *applied (may be NULL): whether it was applied (on a GPU:
 * true; the outcome is in sf_grad_scaler_last_step_result). A second step for one
 * optimizer before update is SF_INVALID_STATE. */
STEPFUSE_API sf_status sf_grad_scaler_step(sf_grad_scaler* scaler, sf_optimizer* opt, bool* applied);
/* What the last step did (an LR scheduler should not advance when !applied). */
STEPFUSE_API sf_status sf_grad_scaler_last_step_result(const sf_grad_scaler* scaler, sf_step_result* result);
/* Ends the iteration. new_scale NULL: backs off after a skipped step, grows after
 * growth_interval good ones in a row (SF_INVALID_STATE if no optimizer was stepped or
 * unscaled since the last update). new_scale not NULL: sets S to *new_scale (finite,
 * > 0). No-op when disabled. */
STEPFUSE_API sf_status sf_grad_scaler_update(sf_grad_scaler* scaler, const double* new_scale);

STEPFUSE_API sf_status sf_grad_scaler_get_scale(const sf_grad_scaler* scaler, double* scale); /* 1 when disabled */
STEPFUSE_API sf_status sf_grad_scaler_get_growth_factor(const sf_grad_scaler* scaler, double* factor);
STEPFUSE_API sf_status sf_grad_scaler_get_backoff_factor(const sf_grad_scaler* scaler, double* factor);
STEPFUSE_API sf_status sf_grad_scaler_get_growth_interval(const sf_grad_scaler* scaler, int64_t* interval);
STEPFUSE_API sf_status sf_grad_scaler_get_growth_tracker(const sf_grad_scaler* scaler, int64_t* tracker);
STEPFUSE_API sf_status sf_grad_scaler_is_enabled(const sf_grad_scaler* scaler, bool* enabled);
/* Validated as in create; nothing changes on an error. */
STEPFUSE_API sf_status sf_grad_scaler_set_growth_factor(sf_grad_scaler* scaler, double factor);
STEPFUSE_API sf_status sf_grad_scaler_set_backoff_factor(sf_grad_scaler* scaler, double factor);
STEPFUSE_API sf_status sf_grad_scaler_set_growth_interval(sf_grad_scaler* scaler, int64_t interval);
/* The device string as given ("cuda" or "cpu"; static for the scaler's lifetime), and
 * where the scale actually lives. */
STEPFUSE_API sf_status sf_grad_scaler_device(const sf_grad_scaler* scaler, const char** device);
STEPFUSE_API sf_status sf_grad_scaler_where_scale_lives(const sf_grad_scaler* scaler, sf_device* device);

/* state_dict() as a struct: PyTorch's five entries, or empty (a disabled scaler). */
typedef struct sf_grad_scaler_state {
  uint32_t struct_size; /* sizeof(sf_grad_scaler_state); set by sf_grad_scaler_state_init */
  bool empty;           /* saved from a disabled scaler: the other fields are 0 */
  double scale;
  double growth_factor;
  double backoff_factor;
  int64_t growth_interval;
  int64_t growth_tracker; /* "_growth_tracker" */
} sf_grad_scaler_state;

/* Zeroes the struct and sets struct_size. Writes nothing if state is NULL. */
STEPFUSE_API void sf_grad_scaler_state_init(sf_grad_scaler_state* state);
STEPFUSE_API void sf_grad_scaler_state_init_size(sf_grad_scaler_state* state, size_t struct_size);
#define sf_grad_scaler_state_init(state) sf_grad_scaler_state_init_size((state), sizeof(sf_grad_scaler_state))

/* Call after update. */
STEPFUSE_API sf_status sf_grad_scaler_state_dict(const sf_grad_scaler* scaler, sf_grad_scaler_state* state);
/* No-op when disabled. An empty state, or an invalid value, is SF_INVALID_ARGUMENT;
 * nothing changes on an error. */
STEPFUSE_API sf_status sf_grad_scaler_load_state_dict(sf_grad_scaler* scaler, const sf_grad_scaler_state* state);

/* ---- LossScaleOptimizer (tf.keras.mixed_precision.LossScaleOptimizer) ----------- */

typedef struct sf_loss_scale_optimizer sf_loss_scale_optimizer;

typedef struct sf_loss_scale_optimizer_options {
  uint32_t struct_size;         /* set by sf_loss_scale_optimizer_options_init */
  bool dynamic;                 /* true */
  double initial_scale;         /* 32768 (2^15) */
  int64_t dynamic_growth_steps; /* 2000 */
} sf_loss_scale_optimizer_options;

STEPFUSE_API void sf_loss_scale_optimizer_options_init(sf_loss_scale_optimizer_options* options);
STEPFUSE_API void sf_loss_scale_optimizer_options_init_size(sf_loss_scale_optimizer_options* options,
    size_t struct_size);
#define sf_loss_scale_optimizer_options_init(options) \
  sf_loss_scale_optimizer_options_init_size((options), sizeof(sf_loss_scale_optimizer_options))
/* Wraps `inner`, which it references and does NOT own: inner must outlive the
 * sf_loss_scale_optimizer (destroy this first). options may be NULL (the defaults).
 * SF_INVALID_ARGUMENT for initial_scale not finite and above 2^-128, dynamic_growth_steps < 1. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_create(sf_optimizer* inner,
                                                      const sf_loss_scale_optimizer_options* options,
                                                      sf_loss_scale_optimizer** out);
/* Does not destroy the inner optimizer. NULL is a no-op. */
STEPFUSE_API void sf_loss_scale_optimizer_destroy(sf_loss_scale_optimizer* lso);
/* The handle passed to create. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_inner(const sf_loss_scale_optimizer* lso, sf_optimizer** inner);

/* *scaled = loss * loss_scale. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_get_scaled_loss(const sf_loss_scale_optimizer* lso, double loss,
                                                               double* scaled);
/* Divides each of count tensors in place by the loss scale, rounding to its dtype. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_get_unscaled_gradients(const sf_loss_scale_optimizer* lso,
                                                                      const sf_tensor_view* grads, size_t count);
/* The inner optimizer's gradients are unscaled: checks them, applies the step or skips
 * it, updates the loss scale. *applied may be NULL. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_apply_gradients(sf_loss_scale_optimizer* lso, bool* applied);

/* Writes the gradients of loss * loss_scale into the inner optimizer's gradient
 * buffers. It must return 0 on success. To fail, return non-zero (keep any detail in
 * *user): minimize then steps nothing, leaves the loss scale as it was, and returns
 * SF_INVALID_STATE. It must not throw (a C++ callback catches its own exceptions) and
 * must not longjmp out. It may call other sf_ functions, but not on this lso. */
typedef int (*sf_backward_fn)(double loss_scale, void* user);
/* Calls backward(loss_scale, user), then the fused step (unscale, check, clip, update),
 * then updates the loss scale. *applied (may be NULL): whether the step was applied. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_minimize(sf_loss_scale_optimizer* lso, sf_backward_fn backward,
                                                        void* user, bool* applied);
/* What the last apply_gradients/minimize did. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_last_result(const sf_loss_scale_optimizer* lso,
                                                           sf_step_result* result);

STEPFUSE_API sf_status sf_loss_scale_optimizer_loss_scale(const sf_loss_scale_optimizer* lso, double* scale);
STEPFUSE_API sf_status sf_loss_scale_optimizer_dynamic(const sf_loss_scale_optimizer* lso, bool* dynamic);
STEPFUSE_API sf_status sf_loss_scale_optimizer_dynamic_counter(const sf_loss_scale_optimizer* lso, int64_t* counter);
STEPFUSE_API sf_status sf_loss_scale_optimizer_dynamic_growth_steps(const sf_loss_scale_optimizer* lso,
                                                                    int64_t* steps);
/* Hyperparameters under Keras's names, delegated to the inner optimizer:
 * "learning_rate" (alias "lr"); "beta_1", "beta_2" (Adam, AdamW, Lion, NAdam, Adamax);
 * "momentum" (SGD, RMSprop); "rho" (RMSprop's alpha, Adadelta's rho). Any other name (e.g. "epsilon") is
 * SF_INVALID_ARGUMENT. set_hyper validates as sf_optimizer_set_config does. */
STEPFUSE_API sf_status sf_loss_scale_optimizer_get_hyper(const sf_loss_scale_optimizer* lso, const char* name,
                                                         double* value);
STEPFUSE_API sf_status sf_loss_scale_optimizer_set_hyper(sf_loss_scale_optimizer* lso, const char* name,
                                                         double value);
/* Checkpoint of the inner optimizer with the loss-scale state (as sf_optimizer_save). */
STEPFUSE_API sf_status sf_loss_scale_optimizer_save(const sf_loss_scale_optimizer* lso, const char* path);
STEPFUSE_API sf_status sf_loss_scale_optimizer_load(sf_loss_scale_optimizer* lso, const char* path);

/* ---- Custom update programs (stepfuse/update_program.hpp; docs/update-programs.md) ----
 *
 * An update program is an optimizer's math as a straight-line list of elementwise fp32
 * ops over streams (the gradient, the parameter, optimizer state) and per-step scalars.
 * Build one op by op with an sf_program_builder, then sf_program_builder_build() it into
 * an immutable, validated sf_program, and create an optimizer running it with
 * sf_optimizer_create_custom(): unscaling, the inf/NaN check, clipping and the loss
 * scalers work as for the built-ins. Ops refer to earlier ops' values by the sf_value
 * ids the builder returns. */

typedef struct sf_program sf_program;
typedef struct sf_program_builder sf_program_builder;

/* An op's result: its instruction index. */
typedef uint32_t sf_value;

typedef enum sf_stream_role {
  SF_ROLE_GRAD = 0,  /* the gradient: loaded (widened to fp32, not yet unscaled), never stored */
  SF_ROLE_PARAM = 1, /* the parameter's fp32 value (the master copy when masters are kept) */
  SF_ROLE_STATE = 2  /* optimizer state, fp32, owned by the optimizer, starting at its init */
} sf_stream_role;

/* What a state stream's values allow in storage (sf_optimizer_options.state_format;
 * stepfuse::StateValues). Grad and param streams take SF_STATE_VALUES_ANY. */
typedef enum sf_state_values {
  SF_STATE_VALUES_ANY = 0,            /* signed values (first moments, momentum buffers) */
  SF_STATE_VALUES_NONNEGATIVE = 1,    /* never negative (second moments, sums of squares): q8
                                       * uses an unsigned code, twice the resolution */
  SF_STATE_VALUES_FULL_PRECISION = 2  /* needs fp32 (a running average of the weights, say):
                                       * stays f32 under a blanket state_format, and is
                                       * SF_INVALID_ARGUMENT when state_formats names it
                                       * with bf16 or q8 */
} sf_state_values;

/* How a scalar gets its value for applying step t (1-based); gscale is the step's
 * gradient multiplier (clip coefficient / loss scale). Evaluated in double, rounded
 * once to fp32; never compiled into a kernel. */
typedef enum sf_scalar_rule_kind {
  SF_SCALAR_FIXED = 0,              /* a: a hyperparameter (sf_optimizer_set_scalar changes it) */
  SF_SCALAR_GSCALE = 1,             /* a * gscale: the gradient multiplier (a = 1; -1 to maximize) */
  SF_SCALAR_FIRST_STEP = 2,         /* t == 1 ? a : b */
  SF_SCALAR_DIV_ONE_MINUS_POW = 3,  /* a / (1 - b^t): Adam's lr / bias_correction1 */
  SF_SCALAR_SQRT_ONE_MINUS_POW = 4, /* sqrt(1 - b^t): Adam's sqrt(bias_correction2) */
  SF_SCALAR_DIV_LINEAR = 5,         /* a / (1 + (t - 1) * b): Adagrad's lr decay */
  SF_SCALAR_ONE_MINUS_POW = 6,      /* 1 - b^t: RAdam's bias_correction1 */
  /* NAdam (lr a, beta1 b, momentum_decay c; mu_t = b (1 - 0.5 * 0.96^(t c)), P_t = mu_1 ... mu_t
   * rounded to fp32): */
  SF_SCALAR_NADAM_GRAD_COEF = 7,     /* -a (1 - mu_t) / (1 - P_t) */
  SF_SCALAR_NADAM_MOMENTUM_COEF = 8, /* -a mu_{t+1} / (1 - P_t mu_{t+1}) */
  SF_SCALAR_RADAM_RECT = 9,          /* RAdam's rectification (beta2 b); 0 while rho_t <= 5 */
  /* ASGD (lr a, lambd b, alpha c): */
  SF_SCALAR_ASGD_ETA = 10,           /* eta_t = a / (1 + b a (t - 1))^c */
  SF_SCALAR_ASGD_DECAY = 11,         /* 1 - b eta_t (eta_t rounded to fp32) */
  SF_SCALAR_ASGD_MU = 12             /* t == 1 ? 1 : 1 / max(1, t - 1 - a) (a = t0) */
} sf_scalar_rule_kind;

/* The value ops (load, store, const, scalar and convert have their own functions).
 * The values are stepfuse::Op's. */
typedef enum sf_op {
  SF_OP_ADD = 4,
  SF_OP_SUB = 5,
  SF_OP_MUL = 6,
  SF_OP_DIV = 7,
  SF_OP_FMA = 8,    /* a * b + c, one rounding */
  SF_OP_NEG = 9,
  SF_OP_ABS = 10,
  SF_OP_SQRT = 11,
  SF_OP_MAX = 12,   /* a < b ? b : a: a NaN a is kept, a NaN b is not; ties (-0, +0) give a */
  SF_OP_MIN = 13,   /* b < a ? b : a: the same NaN and tie rules */
  SF_OP_SIGN = 14,  /* -1, 0 or +1; NaN stays NaN; -0 gives +0 */
  SF_OP_SELECT = 15, /* a != 0 ? b : c */
  SF_OP_LT = 16,    /* a < b ? 1 : 0 */
  SF_OP_LE = 17,    /* a <= b ? 1 : 0 */
  SF_OP_EQ = 18     /* a == b ? 1 : 0 */
} sf_op;

/* A new, empty builder for a program called `name` (an identifier; copied). */
STEPFUSE_API sf_status sf_program_builder_create(const char* name, sf_program_builder** out);
/* NULL is a no-op. */
STEPFUSE_API void sf_program_builder_destroy(sf_program_builder* builder);
/* Declares a stream (name copied; init: a state stream's initial value, else 0) and
 * writes its index to *stream. */
STEPFUSE_API sf_status sf_program_builder_stream(sf_program_builder* builder, const char* name, sf_stream_role role,
                                                 float init, int* stream);
/* As sf_program_builder_stream, saying what the stream's values allow in storage (a grad
 * or param stream with another than SF_STATE_VALUES_ANY fails at build);
 * sf_program_builder_stream is this with values = SF_STATE_VALUES_ANY. */
STEPFUSE_API sf_status sf_program_builder_stream_ex(sf_program_builder* builder, const char* name,
                                                    sf_stream_role role, float init, sf_state_values values,
                                                    int* stream);
/* Declares the scalar `name` with its rule (or, declared before, requires the same
 * rule) and emits its value. */
STEPFUSE_API sf_status sf_program_builder_scalar(sf_program_builder* builder, const char* name,
                                                 sf_scalar_rule_kind rule, double a, double b, sf_value* out);
/* As sf_program_builder_scalar, with the rule's third parameter c (the NAdam and ASGD
 * rules); sf_program_builder_scalar is this with c = 0. */
STEPFUSE_API sf_status sf_program_builder_scalar3(sf_program_builder* builder, const char* name,
                                                  sf_scalar_rule_kind rule, double a, double b, double c,
                                                  sf_value* out);
/* v = stream[i] */
STEPFUSE_API sf_status sf_program_builder_load(sf_program_builder* builder, int stream, sf_value* out);
/* stream[i] = v (each stream at most once; never the gradient; the param stream exactly once). */
STEPFUSE_API sf_status sf_program_builder_store(sf_program_builder* builder, int stream, sf_value value);
/* v = x */
STEPFUSE_API sf_status sf_program_builder_constant(sf_program_builder* builder, float x, sf_value* out);
/* v = op(a[, b[, c]]): operands past the op's arity are ignored (pass 0). */
STEPFUSE_API sf_status sf_program_builder_op(sf_program_builder* builder, sf_op op, sf_value a, sf_value b, sf_value c,
                                             sf_value* out);
/* v = a rounded to `to` (round to nearest even) and widened back to fp32. */
STEPFUSE_API sf_status sf_program_builder_convert(sf_program_builder* builder, sf_value a, sf_dtype to, sf_value* out);
/* Two-phase programs (per-tensor reductions, e.g. LAMB's or LARS's trust ratio;
 * docs/update-programs.md): phase 1 runs per element and adds the squares of values
 * into a tensor's reduction slots; the sums are combined per tensor in the canonical
 * order; phase 2 runs per element and reads each tensor's norms. Values do not cross
 * the marker (phase 2 loads again: state stored in phase 1 reads as stored), and the
 * param stream is stored in phase 2. Slots are 0 .. SF_PROGRAM_MAX_NORM_SLOTS - 1. */
#define SF_PROGRAM_MAX_NORM_SLOTS 4
/* The phase marker: what comes before is phase 1, what comes after phase 2 (at most one). */
STEPFUSE_API sf_status sf_program_builder_phase(sf_program_builder* builder);
/* Phase 1: adds value * value to the tensor's sum of reduction slot `slot` (each slot once). */
STEPFUSE_API sf_status sf_program_builder_reduce_sumsq(sf_program_builder* builder, int slot, sf_value value);
/* Phase 2: v = sqrt(the tensor's sum of `slot`), summed in fp64, rounded to fp32 (the
 * same value for every element of a tensor). */
STEPFUSE_API sf_status sf_program_builder_tensor_norm(sf_program_builder* builder, int slot, sf_value* out);
/* Validates what was built and makes an immutable program (the builder is unchanged
 * and may go on). A malformed program is SF_INVALID_ARGUMENT whose message names the
 * op, its instruction index and the problem: an operand not defined yet, a load after
 * a store to the same stream, a store to the gradient, a stream stored twice, no
 * store of the param stream, not exactly one grad and one param stream, more than 128
 * instructions, 8 streams or 16 scalars, no scalar with the gscale rule, a bad rule
 * parameter, a name that is not an identifier; with two phases: a tensor_norm before
 * the marker or of a slot phase 1 does not reduce, a reduce_sumsq after it or of a
 * slot twice, a value of phase 1 used in phase 2, a param store in phase 1. */
STEPFUSE_API sf_status sf_program_builder_build(const sf_program_builder* builder, sf_program** out);
/* NULL is a no-op. An optimizer created from a program does not need it afterwards. */
STEPFUSE_API void sf_program_destroy(sf_program* program);
/* The program's listing and scalar rules as text (the size protocol of
 * sf_optimizer_program_text). */
STEPFUSE_API sf_status sf_program_text(const sf_program* program, char* buf, size_t cap, size_t* needed);

/* As sf_optimizer_create, running a custom program. sf_optimizer_get_config and
 * sf_optimizer_set_config are then SF_INVALID_STATE; sf_optimizer_get_lr/set_lr work
 * when the program has a scalar "lr" with the fixed rule. On the CPU the interpreter
 * runs the program inside the fused pipeline (SF_FUSION_FUSED and
 * SF_FUSION_INTERPRETED are the same); on a GPU, generated kernels. */
STEPFUSE_API sf_status sf_optimizer_create_custom(const sf_program* program, const sf_param* params, size_t num_params,
                                                  const sf_optimizer_options* options, sf_optimizer** out);
/* A fixed scalar's value; set takes effect at the next step, without recompiling.
 * SF_INVALID_ARGUMENT naming the scalar for an unknown name, a scalar whose rule is
 * not fixed, or a non-finite value; set on a built-in optimizer is SF_INVALID_STATE. */
STEPFUSE_API sf_status sf_optimizer_get_scalar(const sf_optimizer* opt, const char* name, double* value);
STEPFUSE_API sf_status sf_optimizer_set_scalar(sf_optimizer* opt, const char* name, double value);

/* ---- Emit: kernels for a compiler to link and launch itself (stepfuse/emit.hpp) ----
 *
 * The step kernels of a spec as CUDA C++ source, CUBIN or PTX (NVRTC; no GPU needed),
 * a JSON description of their ABI and the C header of the structs it names
 * (stepfuse/device_abi.h); and the tables of a concrete tensor list. For a CPU target
 * (LLVM backend): the LLVM IR text, an ELF object file, the ABI and a C header of
 * plain functions the caller runs per chunk. */

typedef enum sf_emit_target {
  SF_EMIT_CUBIN = 0, /* sm_XY machine code */
  SF_EMIT_PTX = 1,   /* compute_XY PTX, for the driver to compile for that or a newer GPU */
  SF_EMIT_CPU = 2    /* LLVM IR + ELF object for a CPU (cpu_* fields); without the LLVM backend SF_UNSUPPORTED */
} sf_emit_target;

/* One tensor's storage. */
typedef struct sf_emit_tensor {
  sf_dtype weight;
  sf_dtype grad;
  bool master; /* fp32 master weights beside f16/bf16 weights */
} sf_emit_tensor;

typedef struct sf_emit_request {
  uint32_t struct_size;              /* set by sf_emit_request_init */
  const sf_program* program;         /* a custom program, or NULL and: */
  const sf_optimizer_config* config; /* a built-in optimizer's config (has_state_format false) */
  const sf_emit_tensor* tensors;     /* one per tensor, in order */
  size_t num_tensors;
  bool flat;      /* consecutive views of one weight and one grad buffer (one storage) */
  bool aligned16; /* every base allows 4-element vector accesses */
  sf_norm_type norm_type;
  sf_emit_target target; /* default SF_EMIT_CUBIN */
  int sm;                /* compute capability major*10 + minor; default 90 */
  bool compile;          /* default true; false: source and ABI only (no NVRTC needed) */
  /* SF_EMIT_CPU only (added after the fields above: a request whose struct_size is
   * SF_EMIT_REQUEST_SIZE_V1, from an older stepfuse.h, is read without them). */
  const char* cpu_name;     /* LLVM CPU name ("x86-64-v3", "znver3"); NULL, "" or "native": this machine's */
  const char* cpu_triple;   /* LLVM target triple of this machine's architecture; NULL or "": this machine's */
  const char* cpu_features; /* LLVM features over the CPU's own ("-avx512f"); NULL or "": none */
} sf_emit_request;
/* The size of sf_emit_request before the cpu_* fields. */
#define SF_EMIT_REQUEST_SIZE_V1 offsetof(sf_emit_request, cpu_name)

/* Sets struct_size and the defaults (everything else 0/NULL). */
STEPFUSE_API void sf_emit_request_init(sf_emit_request* request);
STEPFUSE_API void sf_emit_request_init_size(sf_emit_request* request, size_t struct_size);
#define sf_emit_request_init(request) sf_emit_request_init_size((request), sizeof(sf_emit_request))

typedef struct sf_emitted_kernel sf_emitted_kernel;
typedef enum sf_emitted_part {
  SF_EMITTED_SOURCE = 0,      /* CUDA C++, kernels sf_reduce and sf_update; CPU: LLVM IR text (unoptimized) */
  SF_EMITTED_BINARY = 1,      /* CUBIN (binary: use the size), PTX, or CPU: ELF object; empty when not compiled */
  SF_EMITTED_ABI_JSON = 2,    /* the kernel ABI description (JSON) */
  SF_EMITTED_ABI_HEADER = 3,  /* the C header of the ABI's structs (stepfuse/device_abi.h) or CPU functions */
  SF_EMITTED_ARCH = 4,        /* "sm_90", "compute_90", or the CPU name */
  SF_EMITTED_KERNEL_NAMES = 5 /* the kernels' (CPU: functions') symbols, each followed by '\n' */
} sf_emitted_part;

/* Generates (and compiles) the kernels. SF_INVALID_ARGUMENT for a bad request (or a
 * CPU name LLVM does not know), SF_UNSUPPORTED for SF_EMIT_CPU without the LLVM
 * backend or a CUDA target without NVRTC, SF_COMPILE_FAILED with the log. */
STEPFUSE_API sf_status sf_emit(const sf_emit_request* request, sf_emitted_kernel** out);
STEPFUSE_API void sf_emitted_kernel_destroy(sf_emitted_kernel* kernel);
/* *data points into the kernel (NUL-terminated; *size excludes the NUL), valid until
 * it is destroyed. */
STEPFUSE_API sf_status sf_emitted_kernel_part(const sf_emitted_kernel* kernel, sf_emitted_part part, const char** data,
                                              size_t* size);

typedef struct sf_kernel_tables sf_kernel_tables;
/* The tables and launch shapes of a tensor list (numels[i]: tensor i's elements). The
 * arrays point into the handle, valid until it is destroyed; the tensor table's
 * pointers are NULL, for the caller to fill with device addresses. */
typedef struct sf_kernel_tables_info {
  uint32_t struct_size;      /* set by sf_kernel_tables_info_init */
  const void* tensors;       /* num_tensors sf_tensor (stepfuse/device_abi.h) */
  size_t num_tensors;
  const int64_t* master_offsets; /* num_tensors: offset in the master buffer, or -1 */
  const void* chunks;        /* num_chunks sf_span: sf_reduce's chunk table */
  size_t num_chunks;
  const void* blocks;        /* num_blocks sf_span: sf_update's block table (table layout) */
  size_t num_blocks;
  int64_t state_elems, master_elems, flat_numel;
  uint32_t reduce_grid, reduce_block, update_grid, update_block;
  size_t partials_bytes, tensor_sums_bytes, step_state_bytes;
} sf_kernel_tables_info;
STEPFUSE_API void sf_kernel_tables_info_init(sf_kernel_tables_info* info);
STEPFUSE_API void sf_kernel_tables_info_init_size(sf_kernel_tables_info* info, size_t struct_size);
#define sf_kernel_tables_info_init(info) sf_kernel_tables_info_init_size((info), sizeof(sf_kernel_tables_info))
/* The request's target and compile fields are not used. */
STEPFUSE_API sf_status sf_emit_tables(const sf_emit_request* request, const int64_t* numels, size_t count,
                                      sf_kernel_tables** out);
STEPFUSE_API sf_status sf_kernel_tables_get(const sf_kernel_tables* tables, sf_kernel_tables_info* info);
STEPFUSE_API void sf_kernel_tables_destroy(sf_kernel_tables* tables);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STEPFUSE_STEPFUSE_H_ */
