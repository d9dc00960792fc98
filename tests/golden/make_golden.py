#!/usr/bin/env python3
"""Generate the golden optimizer-step traces in tests/golden/traces/ with PyTorch itself.

How to run (from the repository root):

    /usr/bin/python3 tests/golden/make_golden.py            # writes tests/golden/traces/*.json
    /usr/bin/python3 tests/golden/make_golden.py --check    # regenerate in memory, diff against the files

Needs PyTorch: Debian's `python3-torch` (apt-get install python3-torch) or `torch` from
PyPI, plus numpy (a dependency of both). On Debian use /usr/bin/python3: a pyenv/venv
`python3` earlier on PATH may lack torch.

Two sets of traces, each made by its own torch, and each (re)generated or checked only
by a torch of its major version, so that regenerating one set never rewrites the other:
  TRACES         SGD, Adam, AdamW, Adagrad, RMSprop: made with Debian's torch 1.13
                 (python3-torch); a torch 1.x selects them.
  TORCH2_TRACES  NAdam, RAdam, Adamax, Adadelta, Rprop, ASGD: made with torch 2.15.0 from
                 PyPI (`python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch numpy`,
                 then run this script with /tmp/venv/bin/python); a torch 2.x selects them
                 (NAdam's and RAdam's decoupled_weight_decay need torch >= 2.1).
  GROUP_TRACES   param groups, written to tests/golden/group_traces/ (replayed by
                 tests/golden_groups_test.cpp): AdamW over two groups (the matrices with
                 weight_decay 0.1 and lr 1e-3; the 1-D tensors with weight_decay 0, lr 3e-3 and
                 amsgrad), both lrs set every step by a LambdaLR schedule (linear warmup, then
                 a cosine), one clip_grad_norm_ over every group's params; made with torch
                 2.15.0 from PyPI with the TORCH2_TRACES, and by a torch 2.x only.
The output is deterministic (fixed seeds, single-threaded torch, foreach=False), so
rerunning with the same torch version reproduces the files byte for byte.

What one trace is: the mixed-precision step that tests/golden_test.cpp replays through
stepfuse::Optimizer::step_scaled(S), done the PyTorch way, in fp32, for every step:

    inv = torch.full((), 1.0 / S, dtype=torch.float32)   # reciprocal in double, rounded to float
    unscaled = g * inv                                   # g: the scaled fp32 gradients in the trace
    found_inf = not all finite(unscaled)
    if found_inf: skip (params and state untouched; opt.step() is not called)
    else:
        if max_grad_norm: torch.nn.utils.clip_grad_norm_(params, max_grad_norm, norm_type)
        opt.step()

Trace format (JSON object):
    format          1
    name            file stem
    torch_version   the torch that made it
    optimizer       "SGD" | "Adam" | "AdamW" | "Adagrad" | "RMSprop" | "NAdam" | "RAdam" |
                    "Adamax" | "Adadelta" | "Rprop" | "ASGD"
    hyperparameters torch.optim constructor arguments with torch's names ("betas" is a
                    [beta1, beta2] pair; stepfuse::optim calls them beta1/beta2; Rprop's
                    "etas" and "step_sizes" are [eta_minus, eta_plus] and
                    [step_size_min, step_size_max])
    max_grad_norm   number or null (no clipping)
    norm_type       2 or "inf"
    loss_scale      S
    shapes          flattened size of each parameter tensor
    state_names     optimizer state tensors torch keeps per element (besides "step" and the
                    0-dim scalar states NAdam's mu_product and ASGD's eta and mu, which
                    stepfuse computes from the step count)
    initial_params  one array per tensor
    steps           list of:
        grads       scaled fp32 gradients handed to the step (one array per tensor);
                    non-finite values are the strings "inf", "-inf", "nan"
        skipped     true if the unscaled gradients were not all finite
        step_count  optimizer steps applied so far (torch's state "step"), after this step
        grad_norm   (applied steps only) total norm (norm_type) of the unscaled gradients
                    before clipping, as clip_grad_norm_ computes it in fp32
        clip_coef   (applied steps with max_grad_norm only) the clamped coefficient
                    clip_grad_norm_ multiplied the gradients by
        params, state (applied steps only) params and every state tensor after the step;
                    a skipped step leaves both exactly as they were after the previous step

GROUP_TRACES add two keys (a reader of the others never meets them): a top-level "groups",
one entry per torch param group in order, {"params": [tensor indices, consecutive and in
order], "hyperparameters": {the group's own, over the top-level "hyperparameters", which are
the constructor's defaults}}, and in every step "lrs", each group's lr for that step (the
schedule's, a double written by repr), set before the step. "state" lists every state any
group keeps; a tensor whose group keeps no such state (max_exp_avg_sq without amsgrad) has
null there. "step_count" is every group's (they all start at the first step).

Every float is an fp32 value written as its shortest decimal that round-trips through a
double: float32(float(text)) == value, bit for bit (checked before writing).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "traces")

# Per-step multipliers of the gradient magnitude: with max_grad_norm chosen near the
# typical norm, some steps are clipped and some are not (and AMSGrad's max matters when
# the gradients shrink).
DEFAULT_FACTORS = [1.0, 0.3, 2.0, 0.5, 1.5, 0.2, 1.0, 0.7]

# name, optimizer, hyperparameters, max_grad_norm, norm_type, loss_scale, shapes,
# number of steps, {step index (0-based): non-finite value to inject}
TRACES = [
    ("sgd_plain", "SGD", dict(lr=0.1), None, 2, 1024.0,
     [1, 7, 33, 77], 6, {2: "inf"}),
    ("sgd_momentum_dampening_clip2", "SGD", dict(lr=0.05, momentum=0.9, dampening=0.1),
     5.0, 2, 65536.0, [1, 7, 33, 300], 7, {0: "inf", 4: "nan"}),
    ("sgd_nesterov_wd_clipinf", "SGD",
     dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
     1.0, "inf", 1000.0, [1, 7, 33, 77], 6, {}),
    ("sgd_weight_decay_clip2", "SGD", dict(lr=0.1, weight_decay=0.05),
     3.0, 2, 256.0, [3, 16, 65], 6, {3: "-inf"}),
    ("sgd_maximize_momentum", "SGD", dict(lr=0.02, momentum=0.5, maximize=True),
     None, 2, 3.0, [1, 7, 33, 77], 6, {1: "nan"}),
    ("adam_plain_clip2", "Adam", dict(lr=1e-3), 8.0, 2, 65536.0,
     [1, 7, 33, 150], 7, {2: "inf"}),
    ("adam_amsgrad_clipinf", "Adam", dict(lr=2e-3, betas=(0.8, 0.95), amsgrad=True),
     2.0, "inf", 512.0, [1, 7, 33, 77], 7, {4: "nan"}),
    ("adam_weight_decay", "Adam", dict(lr=1e-2, eps=1e-6, weight_decay=0.1),
     None, 2, 128.0, [1, 7, 33, 77], 6, {4: "inf"}),
    ("adam_maximize_clip2", "Adam", dict(lr=3e-3, maximize=True), 4.0, 2, 2048.0,
     [2, 9, 40], 6, {}),
    ("adamw_plain_clip2", "AdamW", dict(lr=1e-3), 6.0, 2, 65536.0,
     [1, 7, 33, 77], 7, {1: "inf"}),
    ("adamw_amsgrad_clipinf", "AdamW",
     dict(lr=5e-3, betas=(0.9, 0.99), weight_decay=0.05, amsgrad=True),
     1.5, "inf", 1000.0, [1, 7, 33, 77], 7, {5: "-inf"}),
    ("adagrad_clip2", "Adagrad",
     dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
     4.0, 2, 1024.0, [1, 7, 33, 77], 7, {2: "nan"}),
    ("adagrad_plain", "Adagrad", dict(lr=0.01), None, 2, 1.0,
     [1, 7, 33, 77], 6, {}),
    ("adagrad_maximize_clipinf", "Adagrad", dict(lr=0.02, lr_decay=0.1, maximize=True),
     1.0, "inf", 4096.0, [5, 31, 64], 6, {0: "inf"}),
    ("rmsprop_plain_clip2", "RMSprop", dict(lr=0.01), 5.0, 2, 4096.0,
     [1, 7, 33, 77], 7, {3: "inf"}),
    ("rmsprop_centered_clipinf", "RMSprop", dict(lr=0.005, centered=True),
     1.0, "inf", 256.0, [1, 7, 33, 77], 6, {}),
    ("rmsprop_momentum_wd", "RMSprop", dict(lr=0.01, momentum=0.9, weight_decay=0.01),
     None, 2, 65536.0, [1, 7, 33, 77], 6, {1: "nan"}),
    ("rmsprop_centered_momentum_clip2", "RMSprop",
     dict(lr=0.002, alpha=0.9, eps=1e-6, momentum=0.5, centered=True, maximize=True),
     3.0, 2, 1024.0, [1, 7, 33, 100], 7, {5: "inf"}),
]

# The traces made with torch 2 (see the docstring), in the format of TRACES. RAdam
# rectifies from step 6 (rho_t > 5), so its traces run 10 steps; Rprop's change sign
# from step to step and rprop_etas_clamps_clip2 hits both step-size clamps; ASGD's small
# t0 makes it average (mu < 1) after a few steps, its default t0 only copies.
TORCH2_TRACES = [
    ("nadam_plain_clip2", "NAdam", dict(lr=2e-3), 8.0, 2, 65536.0,
     [1, 7, 33, 150], 7, {2: "inf"}),
    ("nadam_wd_maximize_clipinf", "NAdam",
     dict(lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05, momentum_decay=0.01, maximize=True),
     2.0, "inf", 512.0, [1, 7, 33, 77], 7, {4: "nan"}),
    ("nadam_decoupled_wd", "NAdam",
     dict(lr=1e-2, eps=1e-6, weight_decay=0.1, decoupled_weight_decay=True),
     None, 2, 128.0, [1, 7, 33, 77], 6, {3: "-inf"}),
    ("radam_plain_clip2", "RAdam", dict(lr=1e-3), 8.0, 2, 65536.0,
     [1, 7, 33, 150], 10, {2: "inf"}),
    ("radam_wd_clipinf", "RAdam", dict(lr=5e-3, betas=(0.9, 0.9), weight_decay=0.05),
     1.5, "inf", 1000.0, [1, 7, 33, 77], 10, {7: "nan"}),
    ("radam_decoupled_wd_maximize", "RAdam",
     dict(lr=2e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, decoupled_weight_decay=True,
          maximize=True),
     None, 2, 256.0, [3, 16, 65], 10, {}),
    ("adamax_clip2", "Adamax", dict(lr=2e-3), 4.0, 2, 1024.0,
     [1, 7, 33, 77], 7, {1: "inf"}),
    ("adamax_wd_maximize_clipinf", "Adamax",
     dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, maximize=True),
     1.0, "inf", 4096.0, [5, 31, 64], 6, {}),
    ("adadelta_plain", "Adadelta", dict(), None, 2, 1024.0,
     [1, 7, 33, 77], 7, {3: "inf"}),
    ("adadelta_wd_maximize_clip2", "Adadelta",
     dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=0.01, maximize=True),
     3.0, 2, 65536.0, [1, 7, 33, 100], 7, {5: "nan"}),
    ("rprop_plain", "Rprop", dict(lr=0.01), None, 2, 256.0,
     [1, 7, 33, 77], 10, {4: "inf"}),
    ("rprop_etas_clamps_clip2", "Rprop",
     dict(lr=0.02, etas=(0.3, 1.5), step_sizes=(0.01, 0.03)),
     5.0, 2, 1024.0, [1, 7, 33, 77], 10, {}),
    ("rprop_maximize_clipinf", "Rprop", dict(lr=0.005, maximize=True),
     1.0, "inf", 512.0, [5, 31, 64], 8, {2: "nan"}),
    ("asgd_small_t0_clip2", "ASGD", dict(lr=0.05, lambd=0.01, alpha=0.75, t0=2),
     4.0, 2, 1024.0, [1, 7, 33, 77], 8, {1: "inf"}),
    ("asgd_wd_maximize_clipinf", "ASGD",
     dict(lr=0.02, lambd=0.1, alpha=0.5, t0=0, weight_decay=0.05, maximize=True),
     1.0, "inf", 65536.0, [1, 7, 33, 77], 7, {}),
    ("asgd_default", "ASGD", dict(lr=0.01), None, 2, 128.0,
     [3, 16, 65], 6, {2: "-inf"}),
]

OPTIMIZERS = {
    "SGD": torch.optim.SGD,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "Adagrad": torch.optim.Adagrad,
    "RMSprop": torch.optim.RMSprop,
    "NAdam": torch.optim.NAdam,
    "RAdam": torch.optim.RAdam,
    "Adamax": torch.optim.Adamax,
    "Adadelta": torch.optim.Adadelta,
    "Rprop": torch.optim.Rprop,
    "ASGD": torch.optim.ASGD,
}


def fmt(x):
    """Shortest decimal text of an fp32 value that round-trips through a double."""
    x = np.float32(x)
    if np.isnan(x):
        return '"nan"'
    if np.isinf(x):
        return '"inf"' if x > 0 else '"-inf"'
    s = np.format_float_positional(x, unique=True, trim="0") if 1e-4 <= abs(x) < 1e7 or x == 0 \
        else np.format_float_scientific(x, unique=True, trim="0")
    # numpy writes "1." / "1.e-08"; JSON needs a digit after the point.
    s = s.replace(".e", ".0e")
    if s.endswith("."):
        s += "0"
    back = np.float32(float(s))
    assert back.tobytes() == x.tobytes(), (s, repr(x))
    return s


def fmt_array(a):
    return "[" + ",".join(fmt(v) for v in np.asarray(a, dtype=np.float32).ravel()) + "]"


def fmt_scalar(v):
    """A hyperparameter or other double-valued scalar: Python's repr round-trips doubles."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(fmt_scalar(x) for x in v) + "]"
    return repr(float(v))


def total_norm_like_clip(grads, norm_type):
    """clip_grad_norm_'s total norm (torch 1.13), without touching the gradients."""
    if norm_type == math.inf:
        norms = [g.detach().abs().max() for g in grads]
        return norms[0] if len(norms) == 1 else torch.max(torch.stack(norms))
    return torch.norm(torch.stack([torch.norm(g.detach(), norm_type) for g in grads]), norm_type)


# The pieces below are shared with make_golden_scaler.py, so that both sets of traces are
# made and written the same way.

def new_params_and_optimizer(rng, opt_name, hp, shapes):
    """Random initial parameters (rounded to 3 decimals) and the torch optimizer over them."""
    init = [np.float32(np.round(rng.randn(n), 3)) for n in shapes]
    params = [torch.nn.Parameter(torch.tensor(p.copy(), dtype=torch.float32)) for p in init]
    opt = OPTIMIZERS[opt_name](params, foreach=False, **hp)
    return init, params, opt


def optimizer_fields(opt_name, hp, max_norm, norm_type):
    """The trace's lines "optimizer", "hyperparameters", "max_grad_norm", "norm_type"."""
    return [
        '  "optimizer": %s,' % json.dumps(opt_name),
        '  "hyperparameters": {%s},' % ", ".join(
            "%s: %s" % (json.dumps(k), fmt_scalar(v)) for k, v in hp.items()),
        '  "max_grad_norm": %s,' % ("null" if max_norm is None else fmt_scalar(max_norm)),
        '  "norm_type": %s,' % ('"inf"' if norm_type == "inf" else str(int(norm_type))),
    ]


def clip_or_norm(params, max_norm, norm_type_f, **clip_args):
    """clip_grad_norm_ (with clip_args) when max_norm is set, else the norm alone.
    Returns (total norm, the clip coefficient or None)."""
    if max_norm is not None:
        total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type_f, **clip_args)
        # the coefficient clip_grad_norm_ applied (recomputed exactly as it does)
        return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total_norm_like_clip([p.grad for p in params], norm_type_f), None


def applied_step_lines(opt, params, state_names, applied, total, coef, more=False):
    """The lines of an applied step from "skipped" to "state" (followed by a comma when
    `more` entries follow). Checks that the optimizer keeps the same state tensors as on
    earlier steps (state_names; None before the first applied step) and that torch's
    "step" is `applied`. Returns (state_names, lines)."""
    names = [key for key, v in opt.state[params[0]].items()
             if key != "step" and isinstance(v, torch.Tensor) and v.dim() > 0]
    if state_names is None:
        state_names = names
    assert names == state_names, (names, state_names)
    for p in params:
        st = opt.state[p]
        if "step" in st:
            assert int(st["step"]) == applied, (st["step"], applied)

    lines = []
    lines.append('      "skipped": false,')
    lines.append('      "step_count": %d,' % applied)
    lines.append('      "grad_norm": %s,' % fmt(total.item()))
    if coef is not None:
        lines.append('      "clip_coef": %s,' % fmt(coef.item()))
    lines.append('      "params": [')
    lines.append(",\n".join("        " + fmt_array(p.detach().numpy()) for p in params))
    lines.append("      ],")
    lines.append('      "state": {')
    st_lines = []
    for sn in state_names:
        arrays = ",\n".join("          " + fmt_array(opt.state[p][sn].numpy())
                            for p in params)
        st_lines.append('        %s: [\n%s\n        ]' % (json.dumps(sn), arrays))
    lines.append(",\n".join(st_lines))
    lines.append("      }," if more else "      }")
    return state_names, lines


def trace_text(name, fields, shapes, state_names, init, step_texts):
    """A whole trace: format, name, torch_version, the top-level lines `fields`, shapes,
    state_names, initial_params and the steps; checked to be well-formed JSON."""
    assert state_names is not None, name + ": no step was applied"
    out = []
    out.append("{")
    out.append('  "format": 1,')
    out.append('  "name": %s,' % json.dumps(name))
    out.append('  "torch_version": %s,' % json.dumps(torch.__version__))
    out.extend(fields)
    out.append('  "shapes": %s,' % json.dumps(shapes))
    out.append('  "state_names": %s,' % json.dumps(state_names))
    out.append('  "initial_params": [')
    out.append(",\n".join("    " + fmt_array(p) for p in init))
    out.append("  ],")
    out.append('  "steps": [')
    out.append(",\n".join(step_texts))
    out.append("  ]")
    out.append("}")
    text = "\n".join(out) + "\n"
    json.loads(text)  # well-formed
    return text


def parse_args(doc, out_dir):
    """The command line both scripts take (--check, --out); also makes torch deterministic."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in tests/golden/%s instead of writing"
                    % os.path.basename(out_dir))
    ap.add_argument("--out", default=out_dir, help="output directory (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return args


def check_or_write(path, text, check):
    """With check, compares the file at path with text (True, reported, if it differs);
    else writes text there (False)."""
    if check:
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            print("differs:", path)
            return True
    else:
        with open(path, "w") as f:
            f.write(text)
    return False


def make_trace(name, opt_name, hp, max_norm, norm_type, scale, shapes, nsteps, inject, seed):
    rng = np.random.RandomState(seed)
    norm_type_f = math.inf if norm_type == "inf" else float(norm_type)

    init, params, opt = new_params_and_optimizer(rng, opt_name, hp, shapes)

    applied = 0
    state_names = None
    step_texts = []
    for k in range(nsteps):
        factor = DEFAULT_FACTORS[k % len(DEFAULT_FACTORS)]
        grads = []
        for n in shapes:
            true_grad = np.float32(np.round(rng.randn(n) * factor, 3))
            grads.append(np.float32(true_grad * np.float32(scale)))
        if k in inject:
            t = rng.randint(len(shapes))
            i = rng.randint(shapes[t])
            grads[t][i] = np.float32(float(inject[k]))

        for p, g in zip(params, grads):
            p.grad = torch.tensor(g.copy(), dtype=torch.float32)
        inv = torch.full((), 1.0 / scale, dtype=torch.float32)
        for p in params:
            p.grad.mul_(inv)
        found_inf = not all(bool(torch.isfinite(p.grad).all()) for p in params)

        lines = ["    {"]
        lines.append('      "grads": [')
        lines.append(",\n".join("        " + fmt_array(g) for g in grads))
        lines.append("      ],")
        if found_inf:
            assert k in inject
            lines.append('      "skipped": true,')
            lines.append('      "step_count": %d' % applied)
        else:
            assert k not in inject
            total, coef = clip_or_norm(params, max_norm, norm_type_f)
            opt.step()
            applied += 1
            state_names, step_lines = applied_step_lines(opt, params, state_names, applied,
                                                         total, coef)
            lines.extend(step_lines)
        lines.append("    }")
        step_texts.append("\n".join(lines))

    fields = optimizer_fields(opt_name, hp, max_norm, norm_type)
    fields.append('  "loss_scale": %s,' % fmt_scalar(scale))
    return trace_text(name, fields, shapes, state_names, init, step_texts)


# ---- Param groups (torch 2 only; see the docstring) -------------------------------------------

GROUP_OUT_NAME = "group_traces"  # beside the traces directory

# name, optimizer, constructor defaults, [(tensor indices, the group's own hyperparameters)],
# max_grad_norm, norm_type, loss_scale, shapes (the matrices flattened, then the 1-D tensors:
# group order), number of steps, {step index (0-based): non-finite value to inject},
# (warmup steps, the cosine's final factor): group g's lr at step k is its base lr times
# schedule_factor(k). max_grad_norm clips every applied step but one.
GROUP_TRACES = [
    ("adamw_two_groups_schedule_clip2", "AdamW", dict(lr=1e-3, weight_decay=0.1),
     [([0, 1, 2], dict()), ([3, 4, 5, 6], dict(lr=3e-3, weight_decay=0.0, amsgrad=True))],
     3.5, 2, 1024.0, [6 * 8, 8 * 12, 5 * 3, 8, 12, 7, 1], 10, {4: "inf"}, (3, 0.1)),
]


def schedule_factor(k, nsteps, warmup, final):
    """Linear warmup over `warmup` steps, then a cosine from 1 down to `final` at the last step."""
    if k < warmup:
        return (k + 1) / warmup
    t = (k - warmup + 1) / (nsteps - warmup)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t))


def make_group_trace(name, opt_name, hp, groups, max_norm, norm_type, scale, shapes, nsteps, inject,
                     sched, seed):
    """A GROUP_TRACES entry's trace: make_trace's steps with param groups, each group's lr
    from a LambdaLR schedule stepped every iteration (skipped or not, as a training loop
    does), "lrs" in every step and "groups" in the header."""
    rng = np.random.RandomState(seed)
    norm_type_f = math.inf if norm_type == "inf" else float(norm_type)
    init = [np.float32(np.round(rng.randn(n), 3)) for n in shapes]
    params = [torch.nn.Parameter(torch.tensor(p.copy(), dtype=torch.float32)) for p in init]
    assert [i for idx, _ in groups for i in idx] == list(range(len(shapes))), "tensors in group order"
    opt = OPTIMIZERS[opt_name]([dict(params=[params[i] for i in idx], **own) for idx, own in groups],
                               foreach=False, **hp)
    warmup, final = sched
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: schedule_factor(k, nsteps, warmup, final))

    applied = 0
    state_names = []  # every state any group keeps, in first-seen order
    step_texts = []
    for k in range(nsteps):
        lrs = [g["lr"] for g in opt.param_groups]
        factor = DEFAULT_FACTORS[k % len(DEFAULT_FACTORS)]
        grads = []
        for n in shapes:
            true_grad = np.float32(np.round(rng.randn(n) * factor, 3))
            grads.append(np.float32(true_grad * np.float32(scale)))
        if k in inject:
            t = rng.randint(len(shapes))
            i = rng.randint(shapes[t])
            grads[t][i] = np.float32(float(inject[k]))
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g.copy(), dtype=torch.float32)
        inv = torch.full((), 1.0 / scale, dtype=torch.float32)
        for p in params:
            p.grad.mul_(inv)
        found_inf = not all(bool(torch.isfinite(p.grad).all()) for p in params)

        lines = ["    {"]
        lines.append('      "lrs": [%s],' % ", ".join(fmt_scalar(lr) for lr in lrs))
        lines.append('      "grads": [')
        lines.append(",\n".join("        " + fmt_array(g) for g in grads))
        lines.append("      ],")
        if found_inf:
            assert k in inject
            lines.append('      "skipped": true,')
            lines.append('      "step_count": %d' % applied)
        else:
            assert k not in inject
            total, coef = clip_or_norm(params, max_norm, norm_type_f)
            opt.step()
            applied += 1
            for p in params:
                assert int(opt.state[p]["step"]) == applied
                for key, v in opt.state[p].items():
                    if key != "step" and isinstance(v, torch.Tensor) and v.dim() > 0 \
                            and key not in state_names:
                        state_names.append(key)
            lines.append('      "skipped": false,')
            lines.append('      "step_count": %d,' % applied)
            lines.append('      "grad_norm": %s,' % fmt(total.item()))
            if coef is not None:
                lines.append('      "clip_coef": %s,' % fmt(coef.item()))
            lines.append('      "params": [')
            lines.append(",\n".join("        " + fmt_array(p.detach().numpy()) for p in params))
            lines.append("      ],")
            lines.append('      "state": {')
            lines.append(",\n".join(
                '        %s: [\n%s\n        ]' % (json.dumps(sn), ",\n".join(
                    "          " + (fmt_array(opt.state[p][sn].numpy()) if sn in opt.state[p] else "null")
                    for p in params))
                for sn in state_names))
            lines.append("      }")
        lines.append("    }")
        step_texts.append("\n".join(lines))
        schedule.step()

    fields = optimizer_fields(opt_name, hp, max_norm, norm_type)
    fields.append('  "loss_scale": %s,' % fmt_scalar(scale))
    fields.append('  "groups": [\n%s\n  ],' % ",\n".join(
        '    {"params": %s, "hyperparameters": {%s}}' % (json.dumps(idx), ", ".join(
            "%s: %s" % (json.dumps(key), fmt_scalar(v)) for key, v in own.items()))
        for idx, own in groups))
    return trace_text(name, fields, shapes, state_names, init, step_texts)


def write_group_traces(out_dir, check):
    """GROUP_TRACES (a torch 2.x only) into out_dir; returns (files that differ, bytes)."""
    os.makedirs(out_dir, exist_ok=True)
    differ = total = 0
    for idx, (name, *spec) in enumerate(GROUP_TRACES):
        text = make_group_trace(name, *spec, seed=3000 + idx)
        path = os.path.join(out_dir, name + ".json")
        total += len(text)
        differ += check_or_write(path, text, check)
        if not check:
            print("wrote %s (%d bytes)" % (path, len(text)))
    return differ, total


def trace_set():
    """The traces this torch makes (see the docstring), and the first seed of the set."""
    major = int(torch.__version__.split(".")[0])
    return (TRACES, 1000) if major < 2 else (TORCH2_TRACES, 2000)


def main():
    args = parse_args(__doc__, OUT_DIR)
    os.makedirs(args.out, exist_ok=True)
    differ = 0
    total = 0
    traces, first_seed = trace_set()
    for idx, (name, opt_name, hp, max_norm, norm_type, scale, shapes, nsteps, inject) in \
            enumerate(traces):
        text = make_trace(name, opt_name, hp, max_norm, norm_type, scale, shapes, nsteps, inject,
                          seed=first_seed + idx)
        path = os.path.join(args.out, name + ".json")
        total += len(text)
        differ += check_or_write(path, text, args.check)
        if not args.check:
            print("wrote %s (%d bytes)" % (path, len(text)))
    print("%d traces, %d bytes in all (torch %s)" % (len(traces), total, torch.__version__))
    if traces is TORCH2_TRACES:
        group_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), GROUP_OUT_NAME)
        gdiffer, gtotal = write_group_traces(group_dir, args.check)
        differ += gdiffer
        print("%d param-group traces, %d bytes in all" % (len(GROUP_TRACES), gtotal))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
