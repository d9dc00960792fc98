#!/usr/bin/env python3
"""torch_cuda_step.py: PyTorch's mixed-precision optimizer step on a GPU, timed with CUDA
events: the baseline scripts/gpu_check.sh puts beside `stepfuse-bench --backend cuda`.

The same tensor list (a shapes file: `stepfuse-bench --preset P --print-shapes`) and the same
configuration: 16-bit weights and gradients with fp32 master weights (or fp32 weights, which
are then their own masters), AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 1e-2),
clipping of the global L2 norm, and a GradScaler. One step, as a training loop with fp32
masters runs it after backward() has written the 16-bit gradients:

    master.grad <- model.grad            (torch._foreach_copy_: widen to fp32)
    scaler.unscale_(opt)                 (one fused foreach kernel: unscale + inf/NaN check)
    clip_grad_norm_(masters, clip, foreach=True)
    scaler.step(opt)                     (AdamW(fused=True): reads found_inf on the device)
    scaler.update()
    model.weight <- master               (torch._foreach_copy_: round to 16 bits)

Each step is timed between two CUDA events on the current stream; the report is the median
of --steps steps after --warmup untimed ones. Prints one JSON object on stdout; exit code 0,
or 2 when no GPU is usable (the JSON then says why).
"""

import argparse
import json
import math
import statistics
import sys
import time

SUFFIX = {"k": 10**3, "M": 10**6, "G": 10**9}


def read_shapes(path):
    """Element counts of a shapes file: '[NAME] COUNT' per line, '#' comments, k/M/G suffixes."""
    sizes = []
    with open(path) as f:
        for line in f:
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            count = words[-1]
            scale = SUFFIX.get(count[-1], 1)
            sizes.append(int(count[:-1] if scale != 1 else count) * scale)
    return sizes


def quantiles(xs):
    s = sorted(xs)

    def q(f):
        pos = f * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"median": q(0.5), "min": s[0], "p25": q(0.25), "p75": q(0.75), "max": s[-1], "count": len(s)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", required=True, help="tensor list: a stepfuse-bench shapes file")
    ap.add_argument("--weights", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--grads", choices=["bf16", "f16", "f32"], default="bf16")
    ap.add_argument("--clip", type=float, default=1.0, help="max global L2 norm of the unscaled gradients")
    ap.add_argument("--loss-scale", type=float, default=1024.0, help="GradScaler's init_scale")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same step on the CPU, timed with a wall clock (to check this script without a GPU)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    out = {"tool": "torch_cuda_step", "shapes_file": args.shapes}
    try:
        import torch
    except ImportError as e:
        out["error"] = f"no torch: {e}"
        print(json.dumps(out, indent=2))
        return 2
    out["torch"] = torch.__version__
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        out["error"] = "torch.cuda.is_available() is False"
        print(json.dumps(out, indent=2))
        return 2

    dtypes = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
    wdt, gdt = dtypes[args.weights], dtypes[args.grads]
    dev = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    sizes = read_shapes(args.shapes)
    S = args.loss_scale
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)

    # The model's weights and the gradients backward() left, both as stored (16-bit).
    model = [torch.empty(n, dtype=torch.float32, device=dev).uniform_(-0.1, 0.1, generator=gen).to(wdt) for n in sizes]
    grads = [(torch.empty(n, dtype=torch.float32, device=dev).uniform_(-1.0, 1.0, generator=gen) * (S * 1e-3)).to(gdt)
             for n in sizes]
    keep_masters = wdt != torch.float32
    params = [torch.nn.Parameter(w.float() if keep_masters else w) for w in model]
    for p in params:
        p.grad = torch.zeros_like(p)
    master_grads = [p.grad for p in params]
    master_data = [p.detach() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, fused=True)
    scaler = torch.amp.GradScaler(args.device, init_scale=S)
    # A training loop calls scaler.scale(loss) before backward() (part of the forward/backward
    # pass, not of the step); the first call creates the scale on the device.
    scaler.scale(torch.ones((), device=dev))

    def step():
        # The gradients as fp32 master gradients (unscale_ then rewrites them in place, so
        # this also restores them for the next step, as backward() would).
        torch._foreach_copy_(master_grads, grads)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, args.clip, foreach=True)
        scaler.step(opt)
        scaler.update()
        if keep_masters:
            torch._foreach_copy_(model, master_data)

    before = [w.clone() for w in model[:4]]
    for _ in range(args.warmup):
        step()
    if on_gpu:
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        for i in range(args.steps):
            starts[i].record()
            step()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        samples = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)

    # The step did what it should: every step applied (the scale never backed off), the
    # weights moved and stayed finite.
    finite = all(bool(torch.isfinite(w.float()).all()) for w in model)
    moved = any(not torch.equal(a, b) for a, b in zip(before, model[:4]) if a.numel() > 0)
    out.update({
        "device": torch.cuda.get_device_name(dev) if on_gpu else "cpu",
        "cuda": torch.version.cuda,
        "tensors": len(sizes),
        "params": sum(sizes),
        "weights": args.weights,
        "grads": args.grads,
        "master_weights": keep_masters,
        "clip": args.clip,
        "loss_scale": S,
        "optimizer": "AdamW(fused=True)",
        "step": ("foreach_copy grads->fp32, GradScaler.unscale_, clip_grad_norm_(foreach=True), "
                 "scaler.step(AdamW fused), scaler.update" + (", foreach_copy masters->weights" if keep_masters else "")),
        "steps": args.steps,
        "warmup": args.warmup,
        "ms": quantiles(samples),
        "samples_ms": samples,
        "final_scale": scaler.get_scale(),
        "weights_finite": finite,
        "weights_moved": moved,
        "mean_ms": statistics.fmean(samples),
    })
    print(json.dumps(out, indent=2))
    return 0 if finite and moved and scaler.get_scale() >= S else 1


if __name__ == "__main__":
    sys.exit(main())
