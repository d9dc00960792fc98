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
write the numbers (fmt, fmt_array, fmt_scalar) and the optimizer table are imported from
make_golden.py next to this file, so both sets of traces are written the same way.
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
        step_count  optimizer steps applied so far (torch's state "step"), after this step
        grad_norm   (applied steps only) total norm (norm_type) of the unscaled gradients
                    before clipping, as clip_grad_norm_ computes it in fp32
        clip_coef   (applied steps with max_grad_norm only) the clamped coefficient
                    clip_grad_norm_ multiplied the gradients by
        params, state (applied steps only) params and every state tensor after the step;
                    a skipped step leaves both exactly as they were after the previous step
        scaler_state scaler.state_dict() after update(): scale, growth_factor,
                    backoff_factor (numbers), growth_interval, _growth_tracker (integers)

Every fp32 array element is written as its shortest decimal that round-trips through a
double: float32(float(text)) == value, bit for bit (checked before writing). Scalars (the
scale, the scaler's factors, hyperparameters) are written as Python's repr of the double,
which round-trips exactly; the scale is always an fp32 value.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_golden import OPTIMIZERS, fmt, fmt_array, fmt_scalar, total_norm_like_clip  # noqa: E402

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

    init = [np.float32(np.round(rng.randn(n), 3)) for n in shapes]
    params = [torch.nn.Parameter(torch.tensor(p.copy(), dtype=torch.float32)) for p in init]
    opt = OPTIMIZERS[opt_name](params, foreach=False, **hp)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor,
                                  growth_interval=growth_interval)

    out = []
    out.append("{")
    out.append('  "format": 1,')
    out.append('  "name": %s,' % json.dumps(name))
    out.append('  "torch_version": %s,' % json.dumps(torch.__version__))
    out.append('  "scaler": {"init_scale": %s, "growth_factor": %s, "backoff_factor": %s, '
               '"growth_interval": %d},' % (fmt_scalar(init_scale), fmt_scalar(growth_factor),
                                            fmt_scalar(backoff_factor), growth_interval))
    out.append('  "optimizer": %s,' % json.dumps(opt_name))
    out.append('  "hyperparameters": {%s},' % ", ".join(
        "%s: %s" % (json.dumps(k), fmt_scalar(v)) for k, v in hp.items()))
    out.append('  "max_grad_norm": %s,' % ("null" if max_norm is None else fmt_scalar(max_norm)))
    out.append('  "norm_type": %s,' % ('"inf"' if norm_type == "inf" else str(int(norm_type))))
    out.append('  "shapes": %s,' % json.dumps(shapes))
    state_names_slot = len(out)
    out.append(None)  # filled once the state names are known
    out.append('  "initial_params": [')
    out.append(",\n".join("    " + fmt_array(p) for p in init))
    out.append("  ],")
    out.append('  "steps": [')

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
        total = coef = None
        if max_norm is not None:
            total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type_f, foreach=False)
            # the coefficient clip_grad_norm_ applied (recomputed exactly as it does)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        else:
            total = total_norm_like_clip([p.grad for p in params], norm_type_f)
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
            names = [key for key, v in opt.state[params[0]].items()
                     if key != "step" and isinstance(v, torch.Tensor)]
            if state_names is None:
                state_names = names
            assert names == state_names, (names, state_names)
            for p in params:
                st = opt.state[p]
                if "step" in st:
                    assert int(st["step"]) == applied, (st["step"], applied)

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
            lines.append("      },")
        lines.append('      "scaler_state": %s' % scaler_state_text(sd))
        lines.append("    }")
        step_texts.append("\n".join(lines))

    assert state_names is not None, name + ": no step was applied"
    assert stats["growths"] >= 1, name + ": the scale never grew"
    assert stats["backoffs"] >= 1, name + ": the scale never backed off"
    out[state_names_slot] = '  "state_names": %s,' % json.dumps(state_names)
    out.append(",\n".join(step_texts))
    out.append("  ]")
    out.append("}")
    text = "\n".join(out) + "\n"
    json.loads(text)  # well-formed
    return text, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the files in tests/golden/scaler_traces instead of writing")
    ap.add_argument("--out", default=OUT_DIR, help="output directory (default: %(default)s)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
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
        if args.check:
            old = open(path).read() if os.path.exists(path) else None
            if old != text:
                print("differs:", path)
                differ += 1
        else:
            with open(path, "w") as f:
                f.write(text)
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
