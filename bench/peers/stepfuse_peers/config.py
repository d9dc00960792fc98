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

# The comparisons the report spells out, (numerator, denominator, what it says): each is the
# numerator's median step time over the denominator's, and the median of the per-round ratios.
RATIOS = [
    ("torch-fused", "stepfuse.torch",
     "torch fused AdamW + torch.amp.GradScaler + clip_grad_norm_ vs stepfuse.torch.AdamW + stepfuse.torch.GradScaler"),
    ("stepfuse.torch", "stepfuse", "stepfuse.torch vs the C++ binding (the Python layer's cost)"),
    ("stepfuse.torch-fresh", "stepfuse.torch", "new .grad tensors every step vs the same ones (set_grads' cost)"),
]


def step_bytes(weight_bytes=4, grad_bytes=4, state_streams=2, reduce_pass=True):
    """Bytes per parameter a step must move: mirrors bench/step_bytes.cpp for fp32 weights
    (no masters). Reduce pass: read the gradient. Update pass: read the gradient, read and
    write the weight and every fp32 state stream. Must match step_bytes() there."""
    reduce = grad_bytes if reduce_pass else 0
    update = grad_bytes + 2 * weight_bytes + 8 * state_streams
    return reduce, update
