#!/usr/bin/env python3
"""Generate the golden GradScaler traces in tests/golden/scaler_traces/ with PyTorch's own
torch.amp.GradScaler(device="cpu").

How to run (from the repository root):

    python3 -m venv .venv && .venv/bin/pip install torch numpy     # once
    .venv/bin/python tests/golden/make_golden_scaler.py             # writes scaler_traces/*.json
    .venv/bin/python tests/golden/make_golden_scaler.py --check     # regenerate in memory, diff

Needs torch >= 2.3 (torch.amp.GradScaler with device="cpu"; older releases only have
torch.cuda.amp.GradScaler), e.g. from PyPI as above, plus numpy. Debian's python3-torch
(1.13), which is enough for make_golden.py, is too old for this script. The helpers that
write the numbers (fmt, fmt_array, fmt_scalar), build the optimizer, clip, write an applied
step and the whole trace, and the command line are imported from make_golden.py next to
this file, so both sets of traces are made and written the same way.
The output is deterministic (fixed seeds, single-threaded torch, foreach=False for the
optimizers and clip_grad_norm_), so rerunning with the same torch version reproduces the
files byte for byte; the version that made a trace is recorded in it.

What one trace is: the AMP training loop that tests/grad_scaler_golden_test.cpp replays
through stepfuse::GradScaler and stepfuse::Optimizer, run with torch itself, in fp32:

    scaler = torch.amp.GradScaler("cpu", init_scale, growth_factor, backoff_factor,
                                  growth_interval)
    for every step:
        S = scaler.get_scale()                       # recorded as "scale"
        p.grad = scaler.scale(g_true) for each param # fp32 g_true * S: the "scaled" grads
        (some steps: inf/-inf/NaN written into the scaled grads; with a huge scale some
         scaled grads also overflow to inf by themselves)
        scaler.unscale_(opt)                         # g * fp32(1 / double(S)) (asserted
                                                     # bit for bit), found_inf
        if max_grad_norm: torch.nn.utils.clip_grad_norm_(params, max_grad_norm, norm_type)
        scaler.step(opt)                             # opt.step() unless found_inf
        scaler.update()                              # backoff / growth of the scale

The unscaled "true" gradients are random values rounded to 3 decimals, scaled per step by
a magnitude factor so that clipping is active on some steps and not on others. The
scaler's growth_interval is small (2-4) and its factors are varied (including ones such as
backoff 0.3 or 0.9, where fp32 * double rounds differently from fp32 * fp32, to pin down
how the scale is updated: torch computes in double and rounds to fp32), so the scale grows
and backs off several times per trace; the script asserts at least one growth and one
backoff per trace. One trace starts at 2**126 with growth_factor 4: there the scaled
gradients overflow by themselves, and a growth past the fp32 range is not kept (the scale
stays, the growth tracker restarts), as torch does.

Trace format (JSON object):
    format          1
    name            file stem
    torch_version   the torch that made it
    scaler          torch.amp.GradScaler constructor arguments: init_scale, growth_factor,
                    backoff_factor (numbers), growth_interval (integer); device is "cpu"
    optimizer       "SGD" | "Adam" | "AdamW" | "Adagrad" | "RMSprop"
    hyperparameters torch.optim constructor arguments with torch's names ("betas" is a
                    [beta1, beta2] pair; stepfuse::optim calls them beta1/beta2)
    max_grad_norm   number or null (no clipping)
    norm_type       2 or "inf"
    shapes          flattened size of each parameter tensor
    state_names     optimizer state tensors torch keeps (besides "step")
    initial_params  one array per tensor
    steps           list of:
        scale       scaler.get_scale() at the start of the step: the scale the gradients
                    were multiplied by (an fp32 value, written as an exact double)
        grads       scaled fp32 gradients handed to the step (one array per tensor);
                    non-finite values are the strings "inf", "-inf", "nan"
        skipped     true if unscale_ found inf/NaN (opt.step() was not called)
        step_count, grad_norm, clip_coef, params, state
                    as in make_golden.py's traces
        scaler_state scaler.state_dict() after update(): scale, growth_factor,
                    backoff_factor (numbers), growth_interval, _growth_tracker (integers)

Every fp32 array element is written as its shortest decimal that round-trips through a
double: float32(float(text)) == value, bit for bit (checked before writing). Scalars (the
scale, the scaler's factors, hyperparameters) are written as Python's repr of the double,
which round-trips exactly; the scale is always an fp32 value.
"""

import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_golden import (applied_step_lines, check_or_write, clip_or_norm, fmt_array,  # noqa: E402
                         fmt_scalar, new_params_and_optimizer, optimizer_fields, parse_args,
                         trace_text)

OUT_DIR = os.path.join(HERE, "scaler_traces")

# Per-step multipliers of the gradient magnitude (cycled): with max_grad_norm chosen near
# the typical norm, some steps are clipped and some are not.
FACTORS = [1.0, 0.3, 2.0, 0.5, 1.5, 0.2, 1.0, 0.7, 3.0, 0.4]

# name, optimizer, hyperparameters, max_grad_norm, norm_type,
# scaler (init_scale, growth_factor, backoff_factor, growth_interval), shapes, number of
# steps, {step index (0-based): [(tensor index, non-finite value), ...]}
TRACES = [
    ("sgd_momentum_clip2", "SGD",
     dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
     5.0, 2, (65536.0, 2.0, 0.5, 2), [1, 7, 33, 300], 14,
     {2: [(3, "inf")], 5: [(0, "nan")], 6: [(1, "-inf")], 10: [(2, "inf"), (3, "nan")]}),
    ("sgd_nesterov_backoff09", "SGD",
     dict(lr=0.02, momentum=0.8, nesterov=True),
     None, 2, (16777216.0, 1.5, 0.9, 2), [1, 7, 33, 90], 12,
     {1: [(2, "nan")], 4: [(0, "-inf")], 9: [(3, "inf")]}),
    ("adam_clipinf_backoff03", "Adam",
     dict(lr=2e-3, betas=(0.8, 0.95)),
     1.0, "inf", (1000.0, 1.7, 0.3, 3), [1, 7, 33, 100], 14,
     {0: [(1, "inf")], 4: [(3, "-inf")], 8: [(0, "nan")], 12: [(2, "inf")]}),
    ("adamw_amsgrad_clip2_overflow", "AdamW",
     dict(lr=5e-3, betas=(0.9, 0.99), weight_decay=0.05, amsgrad=True),
     3.0, 2, (2.0 ** 126, 4.0, 0.5, 2), [1, 7, 33, 64], 16,
     {3: [(1, "nan")], 11: [(0, "inf")]}),
    ("adamw_plain_growth3", "AdamW",
     dict(lr=1e-3),
     None, 2, (3.0, 3.0, 0.9, 2), [1, 7, 33, 100], 12,
     {2: [(3, "nan")], 3: [(1, "inf")], 8: [(2, "-inf")]}),
    ("adagrad_clip2_interval4", "Adagrad",
     dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1, weight_decay=0.01),
     4.0, 2, (12345.0, 2.5, 0.25, 4), [1, 7, 33, 120], 16,
     {0: [(0, "inf")], 6: [(3, "nan")], 11: [(2, "-inf")], 12: [(1, "inf")]}),
    ("rmsprop_centered_momentum_clipinf", "RMSprop",
     dict(lr=0.005, alpha=0.9, eps=1e-6, momentum=0.5, centered=True),
     1.0, "inf", (256.0, 2.0, 0.3, 3), [1, 7, 33, 80], 14,
     {1: [(3, "inf")], 5: [(0, "-inf")], 9: [(2, "nan")]}),
]


def scaler_state_text(sd):
    assert sorted(sd) == ["_growth_tracker", "backoff_factor", "growth_factor",
                          "growth_interval", "scale"], sorted(sd)
    return '{"scale": %s, "growth_factor": %s, "backoff_factor": %s, ' \
           '"growth_interval": %d, "_growth_tracker": %d}' % (
               fmt_scalar(sd["scale"]), fmt_scalar(sd["growth_factor"]),
               fmt_scalar(sd["backoff_factor"]), int(sd["growth_interval"]),
               int(sd["_growth_tracker"]))


def make_trace(name, opt_name, hp, max_norm, norm_type, scaler_args, shapes, nsteps, inject,
               seed):
    """Returns (text, stats)."""
    rng = np.random.RandomState(seed)
    norm_type_f = math.inf if norm_type == "inf" else float(norm_type)
    init_scale, growth_factor, backoff_factor, growth_interval = scaler_args

    init, params, opt = new_params_and_optimizer(rng, opt_name, hp, shapes)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor,
                                  growth_interval=growth_interval)

    stats = dict(steps=nsteps, skips=0, growths=0, backoffs=0, rejected_growths=0,
                 natural_overflows=0, fp32_update_differs=0)
    applied = 0
    state_names = None
    step_texts = []
    for k in range(nsteps):
        factor = FACTORS[k % len(FACTORS)]
        scale = scaler.get_scale()
        assert np.float32(scale) == scale, scale  # the scale is an fp32 value

        # The backward pass of scaler.scale(loss): gradients come out multiplied by S.
        true_grads = [torch.tensor(np.float32(np.round(rng.randn(n) * factor, 3)))
                      for n in shapes]
        grads = [scaler.scale(g) for g in true_grads]
        assert all(g.dtype == torch.float32 for g in grads)
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            stats["natural_overflows"] += 1
        for t, value in inject.get(k, []):
            i = rng.randint(shapes[t])
            grads[t][i] = float(value)
        grads_text = [fmt_array(g.numpy()) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g.clone()

        tracker_before = scaler._get_growth_tracker()
        scaler.unscale_(opt)
        # unscale_ multiplies by the fp32 reciprocal computed in double (the test relies on it)
        inv = np.float32(1.0 / np.float64(scale))
        for p, g in zip(params, grads):
            want = g.numpy() * inv
            assert want.dtype == np.float32
            assert p.grad.numpy().tobytes() == want.tobytes(), (name, k)
        skipped = not all(bool(torch.isfinite(p.grad).all()) for p in params)
        found_inf = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        assert bool(sum(v.item() for v in found_inf.values())) == skipped
        total, coef = clip_or_norm(params, max_norm, norm_type_f, foreach=False)
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        if skipped:
            assert all(torch.equal(b, p.detach()) for b, p in zip(before, params))
        scaler.update()
        new_scale = scaler.get_scale()
        sd = scaler.state_dict()

        # What update() did, checked against the rule (and counted for the summary).
        if skipped:
            stats["skips"] += 1
            stats["backoffs"] += 1
            want = np.float32(np.float64(np.float32(scale)) * backoff_factor)
            assert new_scale == want and sd["_growth_tracker"] == 0, (name, k, new_scale, want)
            if np.float32(np.float32(scale) * np.float32(backoff_factor)) != want:
                stats["fp32_update_differs"] += 1
        elif tracker_before + 1 == growth_interval:
            assert sd["_growth_tracker"] == 0
            with np.errstate(over="ignore"):
                want = np.float32(np.float64(np.float32(scale)) * growth_factor)
            if np.isfinite(want):
                stats["growths"] += 1
                assert new_scale == want, (name, k, new_scale, want)
                if np.float32(np.float32(scale) * np.float32(growth_factor)) != want:
                    stats["fp32_update_differs"] += 1
            else:
                stats["rejected_growths"] += 1
                assert new_scale == scale
        else:
            assert new_scale == scale and sd["_growth_tracker"] == tracker_before + 1
        assert (k in inject) <= skipped, (name, k, "an injected step was applied")

        lines = ["    {"]
        lines.append('      "scale": %s,' % fmt_scalar(scale))
        lines.append('      "grads": [')
        lines.append(",\n".join("        " + t for t in grads_text))
        lines.append("      ],")
        if skipped:
            lines.append('      "skipped": true,')
            lines.append('      "step_count": %d,' % applied)
        else:
            applied += 1
            state_names, step_lines = applied_step_lines(opt, params, state_names, applied,
                                                         total, coef, more=True)
            lines.extend(step_lines)
        lines.append('      "scaler_state": %s' % scaler_state_text(sd))
        lines.append("    }")
        step_texts.append("\n".join(lines))

    assert stats["growths"] >= 1, name + ": the scale never grew"
    assert stats["backoffs"] >= 1, name + ": the scale never backed off"
    fields = ['  "scaler": {"init_scale": %s, "growth_factor": %s, "backoff_factor": %s, '
              '"growth_interval": %d},' % (fmt_scalar(init_scale), fmt_scalar(growth_factor),
                                           fmt_scalar(backoff_factor), growth_interval)]
    fields += optimizer_fields(opt_name, hp, max_norm, norm_type)
    return trace_text(name, fields, shapes, state_names, init, step_texts), stats


def main():
    args = parse_args(__doc__, OUT_DIR)
    if not args.check:
        os.makedirs(args.out, exist_ok=True)
    differ = 0
    total = 0
    totals = dict(natural_overflows=0, rejected_growths=0, fp32_update_differs=0)
    for idx, (name, opt_name, hp, max_norm, norm_type, scaler_args, shapes, nsteps, inject) in \
            enumerate(TRACES):
        text, st = make_trace(name, opt_name, hp, max_norm, norm_type, scaler_args, shapes, nsteps,
                              inject, seed=2000 + idx)
        for key in totals:
            totals[key] += st[key]
        path = os.path.join(args.out, name + ".json")
        total += len(text)
        summary = "%s: %s, clip %s, %d steps, %d skipped, %d growths, %d backoffs" % (
            name, opt_name, "none" if max_norm is None else "%s (norm %s)" % (max_norm, norm_type),
            st["steps"], st["skips"], st["growths"], st["backoffs"])
        differ += check_or_write(path, text, args.check)
        if not args.check:
            summary += " (%d bytes)" % len(text)
        print(summary)
    # The traces must exercise the corner cases the docstring promises.
    assert totals["natural_overflows"] >= 1, "no step overflowed by itself"
    assert totals["rejected_growths"] >= 1, "no growth past the fp32 range"
    assert totals["fp32_update_differs"] >= 1, "no scale update where fp32 math would differ"
    print("%d traces, %d bytes in all (torch %s); %d natural overflows, %d growths not kept, "
          "%d scale updates where fp32 * fp32 would round differently" % (
              len(TRACES), total, torch.__version__, totals["natural_overflows"],
              totals["rejected_growths"], totals["fp32_update_differs"]))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
