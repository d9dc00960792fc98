"""The step every peer performs, the verification's tolerances and the byte model: constants the
other modules share (bench/peers/peers.py's docstring says what the tool does)."""

import os

# bench/peers/stepfuse_peers/config.py -> the repository root.
REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

# The step every peer performs.
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
MAX_NORM = 1.0
GROWTH_FACTOR, BACKOFF_FACTOR, GROWTH_INTERVAL = 2.0, 0.5, 2000  # torch.amp.GradScaler's defaults

# Verification of each peer's one-step result against stepfuse's:
#  - clip coefficient: the factor r by which the peer's clipped gradients differ from
#    stepfuse's, fitted from exp_avg = (1 - beta1) * clipped grad (least squares over every
#    element); |r - 1| <= NORM_TOL. It is separate because PyTorch's CPU norm kernels
#    accumulate in fp32: on GPT-2's 38.6 M-element embedding gradient their norm is ~2e-3
#    off the exact one (torch.sum is exact there, stepfuse and XLA are within ~1e-7).
#  - exp_avg / r and exp_avg_sq / r^2: max_i |peer_i - stepfuse_i| / max(|stepfuse_i|,
#    VERIFY_FLOOR * max|stepfuse|), the worst tensor; <= VERIFY_TOL.
#  - the weight update w1 - w0: max |peer - stepfuse| / max |stepfuse|, the worst tensor
#    (normwise: the update is a difference of two weights, whose rounding is the weights'
#    ulp); <= VERIFY_TOL + |r - 1| (through eps, the first AdamW update moves by at most
#    |r - 1| relative when the clip coefficient does).
# fp32 rounding (operation order, optax's clip without torch's +1e-6) stays well below
# these; a wrong lr, beta, bias correction or clip does not.
VERIFY_TOL = 1e-4
VERIFY_FLOOR = 1e-3
NORM_TOL = 1e-2

ALL_PEERS = ["stepfuse", "stepfuse.torch", "stepfuse.torch-fresh", "torch-fused", "torch-foreach", "torch-compile",
             "jax-optax"]

# --dtype bf16: the low-precision peers (lowp_peers.py), bf16 weights and bf16 gradients. The
# first is the ratios' denominator and always runs; the stepfuse rows are stepfuse itself (their
# failing is exit code 2): its three ways of keeping bf16 weights with fp32 state, then with
# compressed state (state_format: -q8 block-wise 8-bit, -bf16s bf16; -bf16n bf16 rounded to nearest
# beside stochastically rounded weights, stochastic_state_rounding=False, as torchao's AdamW does).
LOWP_PEERS = ["stepfuse.torch-masters", "stepfuse.torch-sr", "stepfuse.torch-compensated", "stepfuse.torch-sr-q8",
              "stepfuse.torch-sr-bf16s", "stepfuse.torch-sr-bf16n", "stepfuse.torch-masters-q8", "torchao-adamw-sr",
              "torchao-adamw8bit-sr", "bnb-adamw8bit"]
LOWP_REF = LOWP_PEERS[0]

# Verification of each low-precision peer (lowp_verify.py) against a reference step computed in
# fp64 from the same bf16 weights and gradients (kept as fp32: 2^-16 of a bf16 ulp):
#  - applied: every peer must apply the step (the gradients are finite), and its clip
#    coefficient, fitted from exp_avg as in the fp32 mode, must be within NORM_TOL of the
#    reference's: the norm and skip decision. The fit is over the tensors whose exp_avg the row
#    stores in fp32 or bf16, where it has any (rounding to the nearest 8-bit code biases it by
#    ~1e-4, which dividing by it would carry into the fp32 tensors' figures).
#  - exp_avg / r, exp_avg_sq / r^2 against the reference, the worst element: relative to
#    max(|ref_i|, VERIFY_FLOOR * max|ref|) where the state is fp32 or bf16; relative to the
#    absmax of the reference's 256-element block where it is 8-bit (each block is stored as
#    codes into a 256-entry code book times the block's absmax). The tolerance is the row's:
#      stepfuse rows: VERIFY_TOL (fp32 state, computed in fp32 from the stored bf16 gradients);
#        with bf16 state (-bf16s): LOWP_BF16_STATE_TOL, VERIFY_TOL + 3 * 2^-8. The fp32 state of
#        the step is rounded once to the nearest bf16 (8 significant bits: within half an ulp, 2^-8
#        of the value); the clip factor r is then fitted from those rounded exp_avg values, a
#        weighted mean of their roundings, so it is off by up to 2^-8 too (2.9e-4 on gpt2-124m,
#        seed 0), and dividing exp_avg_sq by r^2 carries that twice: 2^-8 + 2 * 2^-8. A step
#        computes the update from the fp32 values before storing them, so the weights' tolerance
#        stays VERIFY_TOL's. q8 state (-q8) is 8-bit state, below;
#      torch-path rows: LOWP_GRAD_TOL, a relative error of 2^-6. A bf16 value is within 2^-8
#        of what it rounds; the clipped gradient that torch's in-place unscale_ and
#        clip_grad_norm_ write back into the bf16 .grad, squared for exp_avg_sq, and a
#        bf16-stored state add up to at most three such roundings;
#      8-bit state: the row's tolerance (LOWP_GRAD_TOL for the torch-path rows, VERIFY_TOL for
#        stepfuse's q8) plus the largest step between two codes of the peer's code books (read
#        from its state, or for stepfuse decoded by the library from the codes 0..255; the
#        dynamic map of bitsandbytes, torchao and stepfuse's q8: 0.9/64 of the absmax in its top
#        decade, twice the worst rounding to the nearest code). Tensors a row keeps in fp32 or
#        bf16 below its 8-bit threshold (4096 elements) have the row's fp32 or bf16 tolerance.
#  - weights w1 (bf16) against the reference's w1, elementwise: |w1 - ref| <= one bf16 ulp of
#    ref for a row that rounds stochastically (it lands on either neighbour of the exact value),
#    half of one for a row that rounds to nearest, + lr * the row's gradient tolerance (its
#    state tolerance but for stepfuse's bf16 state, which is rounded after the update; the first
#    AdamW update, lr * g / (|g| + eps), moves by at most the gradient's relative error where |g|
#    is near eps). The figure reported is the worst element's |w1 - ref| over that bound.
#  - the update's fit: sum(dw * dt) / sum(dt^2) - 1 over every element, dw = w1 - w0 and dt =
#    what the row's rounding gives on average minus w0: the exact weight (stochastic rounding
#    is unbiased), or the exact weight rounded to nearest (whose bias is real: AdamW's first
#    update is about lr for every weight, 2.05 bf16 ulps of a weight in [2^-4, 2^-3), which
#    rounds to 2). Within LOWP_FIT_TOL + LOWP_FIT_SIGMAS standard deviations of the fit that
#    stochastic rounding alone leaves (variance at most ulp^2 / 4 per element: negligible on a
#    model, it matters on a list of a few thousand parameters). A wrong lr, bias correction or
#    weight decay moves it.
#  - the decay: -sum((w1 - target) * w0) / sum(w0^2) / (lr * wd), target as for the fit: the
#    row's weight decay over the reference's, - 1. The first step decays a weight by lr * wd =
#    1e-5 of itself, 1/40 of a bf16 ulp, which no single weight shows: only this average over
#    every weight does. Within LOWP_DECAY_TOL + LOWP_FIT_SIGMAS standard deviations as above.
#  - the parameter a row keeps beside its bf16 weight (fp32 master; weight + bf16
#    compensation): within LOWP_PARAM_TOL of a bf16 ulp of the larger of the reference's w1
#    and w0, elementwise (both carry at least 16 significant bits; the compensation's rounding
#    is 2^-10 ulp at most; where the update cancels the weight, the fp32 arithmetic's error is
#    the operands', not the small result's).
LOWP_GRAD_TOL = 2.0 ** -6
LOWP_BF16_STATE_TOL = VERIFY_TOL + 3 * 2.0 ** -8
LOWP_FIT_TOL = 1e-2
LOWP_FIT_SIGMAS = 5.0
LOWP_DECAY_TOL = 0.5
LOWP_PARAM_TOL = 2.0 ** -8

# The comparisons the report spells out, (numerator, denominator, what it says): each is the
# numerator's median step time over the denominator's, and the median of the per-round ratios.
RATIOS = [
    ("torch-fused", "stepfuse.torch",
     "torch fused AdamW + torch.amp.GradScaler + clip_grad_norm_ vs stepfuse.torch.AdamW + stepfuse.torch.GradScaler"),
    ("stepfuse.torch", "stepfuse", "stepfuse.torch vs the C++ binding (the Python layer's cost)"),
    ("stepfuse.torch-fresh", "stepfuse.torch", "new .grad tensors every step vs the same ones (set_grads' cost)"),
]

# --dtype bf16's comparisons, as RATIOS: each stepfuse way of keeping bf16 weights against fp32
# masters; stepfuse's compressed state against its fp32 state with the same weights; and each other
# peer against the stepfuse rows that store its weights alike (the bf16 weight alone: stochastic
# rounding; bitsandbytes rounds to nearest, which stepfuse does only with masters or compensations),
# with fp32 state and with state stored as the peer stores it (bf16; 8-bit in 256-element blocks:
# stepfuse.torch-sr-q8, the fewest bytes).
LOWP_RATIOS = [
    ("stepfuse.torch-sr", "stepfuse.torch-masters", "stepfuse.torch: no masters, stochastic rounding vs fp32 masters"),
    ("stepfuse.torch-compensated", "stepfuse.torch-masters",
     "stepfuse.torch: no masters, bf16 compensations vs fp32 masters"),
    ("stepfuse.torch-sr-q8", "stepfuse.torch-sr",
     "stepfuse.torch: q8 state vs fp32 state, both stochastic rounding, no masters"),
    ("stepfuse.torch-sr-bf16s", "stepfuse.torch-sr",
     "stepfuse.torch: bf16 state vs fp32 state, both stochastic rounding, no masters"),
    ("stepfuse.torch-sr-bf16n", "stepfuse.torch-sr",
     "stepfuse.torch: bf16 state rounded to nearest vs fp32 state, both stochastic rounding, no masters"),
    ("stepfuse.torch-masters-q8", "stepfuse.torch-masters",
     "stepfuse.torch: q8 state vs fp32 state, both fp32 masters"),
    ("torchao-adamw-sr", "stepfuse.torch-sr",
     "torchao AdamW (bf16 state) vs stepfuse.torch (fp32 state), both stochastic rounding, no masters"),
    ("torchao-adamw-sr", "stepfuse.torch-sr-bf16s",
     "torchao AdamW vs stepfuse.torch, both bf16 state, stochastic rounding, no masters"),
    ("torchao-adamw-sr", "stepfuse.torch-sr-bf16n",
     "torchao AdamW vs stepfuse.torch, both bf16 state rounded to nearest, stochastic rounding of the weights, "
     "no masters"),
    ("torchao-adamw8bit-sr", "stepfuse.torch-sr",
     "torchao AdamW8bit vs stepfuse.torch (fp32 state), both stochastic rounding, no masters"),
    ("torchao-adamw8bit-sr", "stepfuse.torch-sr-q8",
     "torchao AdamW8bit vs stepfuse.torch (q8 state), both 8-bit state in 256-element blocks, stochastic rounding, "
     "no masters"),
    ("bnb-adamw8bit", "stepfuse.torch-sr", "bitsandbytes AdamW8bit vs stepfuse.torch (fp32 state), both no masters"),
    ("bnb-adamw8bit", "stepfuse.torch-sr-q8",
     "bitsandbytes AdamW8bit vs stepfuse.torch (q8 state), both 8-bit state in 256-element blocks, no masters "
     "(bitsandbytes rounds to nearest, stepfuse stochastically)"),
]


def lowp_step_bytes(grad_bytes, param_read, param_write, state_bytes):
    """(reduce, update) bytes per parameter of a low-precision row, from what it stores: the reduce
    pass reads the gradient; the update pass reads the gradient, reads and writes the parameter as
    stored (bf16 weight; weight + bf16 compensation; or read the fp32 master and write it and the
    bf16 weight), and reads and writes each state stream as stored (fp32, bf16, or 8-bit codes +
    one fp32 absmax per 256). The stepfuse rows with fp32 state give bench/step_bytes.cpp's figures (24,
    28, 30 B/param with bf16 gradients); with q8 state about 12 (stochastic rounding) and 18 (masters),
    with bf16 state 16 (stochastic rounding)."""
    return grad_bytes, grad_bytes + param_read + param_write + 2 * state_bytes


def step_bytes(weight_bytes=4, grad_bytes=4, state_streams=2, reduce_pass=True):
    """Bytes per parameter a step must move: mirrors bench/step_bytes.cpp for fp32 weights
    (no masters). Reduce pass: read the gradient. Update pass: read the gradient, read and
    write the weight and every fp32 state stream. Must match step_bytes() there."""
    reduce = grad_bytes if reduce_pass else 0
    update = grad_bytes + 2 * weight_bytes + 8 * state_streams
    return reduce, update
