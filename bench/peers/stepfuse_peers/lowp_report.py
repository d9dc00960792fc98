"""The low-precision mode's report (--dtype bf16): the tables on stdout and the JSON file (--json), as
report.py's for the fp32 mode, with the verification against the fp64 reference and each row's own
bytes per parameter (what it stores: lowp_peers.py's storage(), config.lowp_step_bytes)."""

import math
import os
import sys
import time

from .config import (BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, HYPER, LOWP_BF16_STATE_TOL, LOWP_DECAY_TOL,
                     LOWP_FIT_SIGMAS, LOWP_FIT_TOL, LOWP_GRAD_TOL, LOWP_PARAM_TOL, LOWP_RATIOS, LOWP_REF, MAX_NORM,
                     NORM_TOL, VERIFY_FLOOR, VERIFY_TOL, lowp_step_bytes)
from .console import commas
from .report import (W, cpu_model, machine_info, peer_ratios, print_peers_ratios, print_peers_steps,
                     print_timing_preamble, write_json)
from .stats import scaled_summary, summarize

GRAD_BYTES = 2  # bf16 gradients


def row_bytes(status_row):
    """(reduce, update) bytes per parameter of a verified row, from its storage; None if it has none."""
    st = status_row.get("storage")
    if not st:
        return None
    return lowp_step_bytes(GRAD_BYTES, st["param_read"], st["param_write"], st["state"])


def report_lowp(args, sf, shapes, shapes_source, ctx, peers, status, samples, t_start):
    """--dtype bf16's report on stdout (what was run, the verification, the timing, what each step
    contains) and with --json the same as JSON; adds the timing figures to status."""
    n = sum(c for _, c in shapes)
    width = max([W] + [len(p.name) for p in peers])
    print_lowp_setup(args, sf, shapes, shapes_source, ctx, status, n)
    print()
    print_lowp_verification(ctx, peers, status, width)
    print()
    print_lowp_timing(args, ctx, peers, status, samples, n, width)
    ratios = peer_ratios(status, samples, LOWP_RATIOS)
    if ratios:
        print()
        print_peers_ratios(ratios)
    print()
    print_peers_steps(peers, status, width)
    print(f"total run time {time.perf_counter() - t_start:.1f} s")

    if args.json:
        j = dict(tool="bench/peers/peers.py", mode="peers", preset=args.preset, shapes_file=args.shapes,
                 shapes_source=shapes_source, tensors=len(shapes), params=n, dtype=args.dtype, threads=args.threads,
                 steps=args.steps, warmup=args.warmup, gap_ms=args.gap_ms, loss_scale=args.loss_scale, seed=args.seed,
                 step=dict(max_grad_norm=MAX_NORM, optimizer="AdamW", **HYPER, growth_factor=GROWTH_FACTOR,
                           backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL),
                 reference_peer=LOWP_REF,
                 step_bytes="per row (peers.NAME.step_bytes): reduce = read the bf16 gradient; update = read the "
                            "gradient, read and write the parameter and each state stream as stored",
                 grads_restore="outside the timed region (the torch-path peers write the gradients)",
                 omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                 cache_eviction_bytes=getattr(ctx, "scratch_bytes", None), ratios=ratios,
                 verify=dict(reference="one AdamW step computed in fp64 from the same bf16 weights and gradients",
                             reference_step=getattr(ctx, "lowp_reference", None),
                             clip_coef_tolerance=NORM_TOL, state_floor=VERIFY_FLOOR,
                             state_tolerance_stepfuse=VERIFY_TOL,
                             state_tolerance_stepfuse_bf16_state=LOWP_BF16_STATE_TOL,
                             state_tolerance_torch_path=LOWP_GRAD_TOL,
                             state_tolerance_8bit="the row's tolerance + the largest step of its code books",
                             weights="max |w1 - ref| / (k bf16 ulp(ref) + lr * the row's gradient tolerance) <= 1, "
                                     "k = 1 stochastic rounding, 1/2 to nearest",
                             update_fit="sum(dw dt) / sum(dt^2) - 1, dt = exact update (stochastic) or exact weight "
                                        "rounded to nearest - w0",
                             update_fit_tolerance=f"{LOWP_FIT_TOL} + {LOWP_FIT_SIGMAS} sigma of stochastic rounding",
                             decay="-sum((w1 - target) w0) / sum(w0^2) / (lr wd): the row's weight decay / the "
                                   "reference's - 1",
                             decay_tolerance=f"{LOWP_DECAY_TOL} + {LOWP_FIT_SIGMAS} sigma of stochastic rounding",
                             param_tolerance_ulp=LOWP_PARAM_TOL),
                 versions=ctx.versions, machine=machine_info(), stepfuse_cpu_target=sf.cpu_target(),
                 argv=sys.argv[1:], peers={p.name: status[p.name] for p in peers})
        write_json(args.json, j)


def print_lowp_setup(args, sf, shapes, shapes_source, ctx, status, n):
    print(f"stepfuse peers · {args.list_name}: {len(shapes)} tensors, {commas(n)} parameters "
          f"(tensor list from {shapes_source}) · bf16 weights and gradients (--dtype bf16: the low-precision "
          "peers) · "
          f"{args.threads} thread{'s' if args.threads != 1 else ''} per peer")
    print(f"the step: unscale by 1/S (S = {args.loss_scale:g}), inf/NaN check (skip), clip global L2 norm to "
          f"{MAX_NORM:g}, AdamW(lr {HYPER['lr']:g}, betas {HYPER['beta1']:g}/{HYPER['beta2']:g}, eps "
          f"{HYPER['eps']:g}, weight decay {HYPER['weight_decay']:g}), GradScaler update")
    print("bytes per parameter: each row's own, from what it stores (B/param below): the reduce pass reads the bf16 "
          "gradient; the update pass reads it, and reads and writes the parameter (bf16 weight; + bf16 compensation; "
          "or the fp32 master read and written, the weight written) and each state stream as stored (fp32, bf16, or "
          "8-bit codes + an fp32 absmax per 256)")
    print("versions: " + " · ".join(f"{k} {v}" for k, v in ctx.versions.items()))
    print(f"CPU: {cpu_model()} · {os.cpu_count()} logical CPUs · stepfuse kernels {sf.cpu_target()}")
    sft = [f"{k} {status[k]['threads']}" for k in status
           if k.startswith("stepfuse.torch-") and status[k].get("threads") is not None]
    print(f"threads: torch.set_num_threads({args.threads}) (torch's eager ops, torchao's compiled updates, "
          f"bitsandbytes; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}); stepfuse.torch: "
          f"torch.get_num_threads()" + (f" (uses {', '.join(sft)})" if sft else ""))


def fmt(x, spec=">10.1e"):
    """x formatted by spec, or '-' right-aligned in its width where there is no figure."""
    return format(x, spec) if x is not None else format("-", spec.split(".")[0])


def pow2(x):
    return f"2^{int(math.log2(x))}"


def print_lowp_verification(ctx, peers, status, width):
    r = getattr(ctx, "lowp_reference", None) or {}
    print("verified before timing: one step of each peer from the same bf16 weights, gradients and zero state, against "
          f"a reference step computed in fp64 (grad norm {r.get('grad_norm', float('nan')):.6g}, clip coef "
          f"{r.get('clip_coef', float('nan')):.6g}, applied: every gradient finite; each peer must apply it too):")
    print(f"  clip coef: peer's / reference's - 1, fitted from exp_avg (tolerance {NORM_TOL:g}); exp_avg, exp_avg_sq: "
          f"with that factor divided out, max_i |peer_i - ref_i| / max(|ref_i|, {VERIFY_FLOOR:g} max|ref|); for 8-bit")
    print("  state (8b: m, v) / the absmax of ref_i's 256-element block instead. tol: the row's state tolerance, "
          f"{VERIFY_TOL:g} for stepfuse (fp32 state from the stored gradients; {VERIFY_TOL:g} + 3 2^-8 = "
          f"{LOWP_BF16_STATE_TOL:.2e} with")
    print("  bf16 state, -bf16s: one rounding to bf16, and the clip coef fitted from it, once in exp_avg, twice in "
          f"exp_avg_sq), {pow2(LOWP_GRAD_TOL)} for the torch-path rows (bf16 roundings of the clipped .grad")
    print(f"  and of bf16 state); 8b tol: the row's gradient tolerance (stepfuse {VERIFY_TOL:g}, torch path "
          f"{pow2(LOWP_GRAD_TOL)}) + the largest step of the row's code books (stepfuse's q8: read back")
    print("  from the library). weights: max_i |w1_i - ref_i| / (k bf16 ulp(ref_i) + lr tol'), tol' the row's gradient "
          "tolerance, k = 1 for stochastic rounding (either neighbour), 1/2")
    print("  for rounding to nearest; must be <= 1. w fit: sum(dw dt) / sum(dt^2) - 1, dt: the exact update "
          "(stochastic) or the exact weight rounded to nearest - w0;")
    print(f"  within {LOWP_FIT_TOL:g} + {LOWP_FIT_SIGMAS:g} sigma of stochastic rounding's own spread. decay: the "
          f"row's weight decay / the reference's - 1, fitted from w1 - (that target) against w0 (tolerance")
    print(f"  {LOWP_DECAY_TOL:g} + {LOWP_FIT_SIGMAS:g} sigma: one step decays by 1/40 of a bf16 ulp, seen only on "
          "average). param: the fp32 master, or weight + compensation: max_i |p_i - ref_i| in bf16 ulps of")
    print(f"  max(|ref_i|, |w0_i|) (tolerance {pow2(LOWP_PARAM_TOL)})")
    print(f"  {'peer':<{width}} {'clip coef':>10} {'exp_avg':>9} {'exp_avg_sq':>10} {'tol':>8} {'8b: m':>8} "
          f"{'8b: v':>8} {'8b tol':>8} {'weights':>8} {'w fit':>9} {'decay':>8} {'param':>8}")
    for p in peers:
        v = status[p.name].get("verify")
        if v is None:
            print(f"  {p.name:<{width}} ({status[p.name]['status']}: see the timing table)")
            continue
        print(f"  {p.name:<{width}} {fmt(v['clip_coef'])} {fmt(v['exp_avg'], '>9.1e')} {fmt(v['exp_avg_sq'])} "
              f"{fmt(v['state_tol'], '>8.1e')} {fmt(v['exp_avg_8bit'], '>8.1e')} {fmt(v['exp_avg_sq_8bit'], '>8.1e')} "
              f"{fmt(v['state_tol_8bit'], '>8.1e')} {fmt(v['weights'], '>8.3f')} {fmt(v['update_fit'], '>9.1e')} "
              f"{fmt(v['decay'], '>8.3f')} {fmt(v['param'], '>8.1e')}{'' if v['ok'] else '  MISMATCH: not timed'}")


def print_lowp_timing(args, ctx, peers, status, samples, n, width):
    """The timing table: each row's median, its bytes per parameter and GB/s for them, and its median
    over stepfuse.torch-masters'; stores the figures in status[name] for the JSON."""
    ref = summarize(samples.get(LOWP_REF, []))
    print_timing_preamble(args, ctx, peers, status)
    print(f"  {'peer':<{width}} {'median ms':>10} {'min':>9} {'IQR':>9} {'B/param':>8} {'GB/s':>8} "
          f"{'peer/masters':>13}")
    for p in peers:
        st = status[p.name]
        s = summarize(samples.get(p.name, []))
        if st["status"] != "ok" or s is None:
            print(f"  {p.name:<{width}} {st['status']}: {st.get('error', '')}")
            continue
        red, upd = row_bytes(st)
        per_param = red + upd
        gbs = per_param * n / s["median"] * 1e-9
        ratio = s["median"] / ref["median"]
        st["ms"] = scaled_summary(s, 1e3)
        st["samples_ms"] = [x * 1e3 for x in samples[p.name]]
        st["step_bytes"] = dict(reduce_per_param=red, update_per_param=upd, per_param=per_param,
                                per_step=per_param * n)
        st["gbs"] = gbs
        st["time_over_reference"] = ratio
        print(f"  {p.name:<{width}} {s['median'] * 1e3:>10.2f} {s['min'] * 1e3:>9.2f} "
              f"{(s['p75'] - s['p25']) * 1e3:>9.2f} {per_param:>8.2f} {gbs:>8.1f} {ratio:>12.2f}x")
    print(f"  (peer/masters: the peer's median step time over {LOWP_REF}'s; 2.00x = the peer takes twice as long. "
          "GB/s: the row's B/param x parameters / median time)")
