"""The reports: the tables on stdout and the JSON file (--json) of the peers mode and of --overhead,
and the machine description both carry. scripts/plot_bench.py reads the peers mode's JSON."""

import json
import os
import platform
import sys
import time

from .config import (BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, HYPER, MAX_NORM, NORM_TOL, RATIOS,
                     VERIFY_FLOOR, VERIFY_TOL, step_bytes)
from .console import commas
from .stats import quantile, scaled_summary, summarize


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_info():
    info = dict(cpu=cpu_model(), logical_cpus=os.cpu_count(), platform=platform.platform())
    if hasattr(os, "sched_getaffinity"):
        info["cpus_allowed"] = len(os.sched_getaffinity(0))
    return info


def write_json(path, j):
    with open(path, "w") as f:
        json.dump(j, f, indent=2)
        f.write("\n")


def report_peers(args, sf, shapes, shapes_source, ctx, peers, status, samples, t_start):
    """The peers mode's report on stdout (what was run, the verification, the timing, what each step
    contains) and with --json the same as JSON; adds the timing figures to status."""
    n = sum(c for _, c in shapes)
    red, upd = step_bytes()
    per_param = red + upd
    step_total = per_param * n
    print_peers_setup(args, sf, shapes, shapes_source, ctx, status, n, red, upd)
    print()
    print_peers_verification(peers, status)
    print()
    print_peers_timing(args, ctx, peers, status, samples, step_total)
    ratios = peer_ratios(status, samples)
    if ratios:
        print()
        print_peers_ratios(ratios)
    print()
    print_peers_steps(peers, status)
    print(f"total run time {time.perf_counter() - t_start:.1f} s")

    if args.json:
        j = dict(tool="bench/peers/peers.py", mode="peers", preset=args.preset, shapes_file=args.shapes,
                 shapes_source=shapes_source,
                 tensors=len(shapes), params=n, dtype=args.dtype, threads=args.threads, steps=args.steps,
                 warmup=args.warmup, gap_ms=args.gap_ms, loss_scale=args.loss_scale, seed=args.seed,
                 step=dict(max_grad_norm=MAX_NORM, optimizer="AdamW", **HYPER, growth_factor=GROWTH_FACTOR,
                           backoff_factor=BACKOFF_FACTOR, growth_interval=GROWTH_INTERVAL),
                 step_bytes=dict(reduce_per_param=red, update_per_param=upd, per_param=per_param, per_step=step_total),
                 grads_restore="outside the timed region (torch eager peers write the gradients)",
                 omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                 cache_eviction_bytes=getattr(ctx, "scratch_bytes", None), ratios=ratios,
                 verify=dict(tolerance=VERIFY_TOL, floor=VERIFY_FLOOR, clip_coef_tolerance=NORM_TOL,
                             clip_coef="peer's clip coefficient / stepfuse's - 1, least-squares fit of exp_avg",
                             states="exp_avg / r, exp_avg_sq / r^2 (r = 1 + clip_coef): max_i |peer_i - stepfuse_i| "
                                    "/ max(|stepfuse_i|, floor * max|stepfuse|), worst tensor",
                             weight_update="max |peer - stepfuse| / max |stepfuse|, worst tensor; tolerance "
                                           "tolerance + |clip_coef|"),
                 versions=ctx.versions, machine=machine_info(), stepfuse_cpu_target=sf.cpu_target(),
                 argv=sys.argv[1:], peers={p.name: status[p.name] for p in peers})
        write_json(args.json, j)


def print_peers_setup(args, sf, shapes, shapes_source, ctx, status, n, red, upd):
    """What was run: the tensor list, the step, its bytes (reduce + update per parameter), versions,
    CPU, threads."""
    per_param = red + upd
    step_total = per_param * n
    print(f"stepfuse peers · {args.list_name}: {len(shapes)} tensors, {commas(n)} parameters "
          f"(tensor list from {shapes_source}) · fp32 weights and gradients · {args.threads} thread"
          f"{'s' if args.threads != 1 else ''} per peer")
    print(f"the step: unscale by 1/S (S = {args.loss_scale:g}), inf/NaN check (skip), clip global L2 norm to "
          f"{MAX_NORM:g}, AdamW(lr {HYPER['lr']:g}, betas {HYPER['beta1']:g}/{HYPER['beta2']:g}, eps "
          f"{HYPER['eps']:g}, weight decay {HYPER['weight_decay']:g}), GradScaler update")
    print(f"bytes the step must move (bench/step_bytes.cpp): reduce {red} + update {upd} = {per_param} B/param = "
          f"{step_total * 1e-9:.3f} GB per step, the same figure for every peer")
    print("versions: " + " · ".join(f"{k} {v}" for k, v in ctx.versions.items()))
    print(f"CPU: {cpu_model()} · {os.cpu_count()} logical CPUs · stepfuse kernels {sf.cpu_target()}")
    sf_threads = status["stepfuse"].get("threads")
    sft_threads = [str(status[k]["threads"]) for k in ("stepfuse.torch", "stepfuse.torch-fresh")
                   if status.get(k, {}).get("threads") is not None]
    print(f"threads: torch.set_num_threads({args.threads}) (eager and compiled; OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}); stepfuse num_threads {args.threads} (uses {sf_threads})"
          + (f"; stepfuse.torch: torch.get_num_threads() (uses {', '.join(sft_threads)})" if sft_threads else "")
          + (f"; XLA_FLAGS='{os.environ.get('XLA_FLAGS', '')}' (XLA's CPU client sizes its pool from the CPUs the "
             "process may use, which these flags may not bind)" if "jax-optax" in args.peer_list else ""))


W = 20  # the peer column: the longest name, stepfuse.torch-fresh


def print_peers_verification(peers, status):
    """The verification table: each peer's figures against stepfuse's (verify.py)."""
    fr = status["stepfuse"].get("first_step", {})
    print("verified before timing: one step of each peer from the same weights, gradients and zero state, against "
          f"stepfuse's (grad norm {fr.get('grad_norm', float('nan')):.6g}, clip coef "
          f"{fr.get('clip_coef', float('nan')):.6g}):")
    print(f"  clip coef: peer's / stepfuse's - 1, fitted from exp_avg (tolerance {NORM_TOL:g}); exp_avg, exp_avg_sq: "
          f"with that factor divided out, max_i |peer_i - sf_i| / max(|sf_i|, {VERIFY_FLOOR:g} max|sf|)")
    print(f"  (tolerance {VERIFY_TOL:g}); weight update w1 - w0: max|peer - sf| / max|sf| (tolerance {VERIFY_TOL:g} "
          "+ |clip coef|); the worst tensor of each")
    print(f"  {'peer':<{W}} {'clip coef':>10} {'exp_avg':>10} {'exp_avg_sq':>10} {'w update':>10}")
    for p in peers:
        v = status[p.name].get("verify")
        if p.name == "stepfuse":
            print(f"  {'stepfuse':<{W}} {'(the reference)':>10}")
        elif v is not None and "weight_update" in v:
            print(f"  {p.name:<{W}} {v['clip_coef']:>10.1e} {v['exp_avg']:>10.1e} {v['exp_avg_sq']:>10.1e} "
                  f"{v['weight_update']:>10.1e}{'' if v['ok'] else '  MISMATCH: not timed'}")
        else:
            print(f"  {p.name:<{W}} {'-':>10} {'-':>10} {'-':>10} {'-':>10}  ({status[p.name]['status']})")


def print_timing_preamble(args, ctx, peers, status):
    """How the steps were timed: rounds, order, idle waits, what happens between steps."""
    waits = sorted((w, p.name) for p in peers for w in status[p.name].get("idle_wait_ms", []))
    timed = [p for p in peers if status[p.name].get("status") == "ok"]
    print(f"{args.steps} timed steps per peer after {args.warmup} warm-up rounds, interleaved (each round in another "
          f"order of a Williams design: every peer directly follows every other equally often over "
          f"{2 * len(timed) if len(timed) % 2 else len(timed)} rounds);")
    if waits:
        print(f"before each step at least {args.gap_ms:g} ms idle, longer until the process used < 10% of a CPU over "
              f"{args.gap_ms:g} ms (waits: median {quantile([w for w, _ in waits], 0.5):.0f} ms, max "
              f"{waits[-1][0]:.0f} ms, before {waits[-1][1]});")
    print("gradients that PyTorch's eager path unscales and clips in place are restored between steps, OUTSIDE the "
          f"timed region; before each step a {getattr(ctx, 'scratch_bytes', 0) >> 20} MB scratch buffer is read and "
          "written (4x the last-level cache), so that no step starts with data left in cache by the one before")


def print_peers_timing(args, ctx, peers, status, samples, step_total):
    """The timing table, each peer's median over stepfuse's; stores the figures in status[name] for
    the JSON."""
    ref = summarize(samples["stepfuse"])
    print_timing_preamble(args, ctx, peers, status)
    print(f"  {'peer':<{W}} {'median ms':>10} {'min':>9} {'IQR':>9} {'GB/s':>8} {'peer/stepfuse':>14}")
    for p in peers:
        st = status[p.name]
        s = summarize(samples.get(p.name, []))
        if st["status"] != "ok" or s is None:
            print(f"  {p.name:<{W}} {st['status']}: {st.get('error', '')}")
            continue
        gbs = step_total / s["median"] * 1e-9
        ratio = s["median"] / ref["median"]
        st["ms"] = scaled_summary(s, 1e3)
        st["samples_ms"] = [x * 1e3 for x in samples[p.name]]
        st["gbs"] = gbs
        st["time_over_stepfuse"] = ratio
        print(f"  {p.name:<{W}} {s['median'] * 1e3:>10.2f} {s['min'] * 1e3:>9.2f} {(s['p75'] - s['p25']) * 1e3:>9.2f} "
              f"{gbs:>8.1f} {ratio:>13.2f}x")
    print("  (peer/stepfuse: the peer's median step time over stepfuse's; 2.00x = the peer takes twice as long. "
          "GB/s: the bytes above / median time)")


def peer_ratios(status, samples, ratios=RATIOS):
    """The comparisons of `ratios` (config.RATIOS, LOWP_RATIOS) whose two peers were both timed: for
    each, the median over median and the median (and range) of the per-round ratios (both peers step
    once per round, so a round's ratio sees one state of the machine)."""
    out = []
    for num, den, what in ratios:
        a, b = samples.get(num, []), samples.get(den, [])
        if status.get(num, {}).get("status") != "ok" or status.get(den, {}).get("status") != "ok" or not a or not b:
            continue
        per_round = sorted(x / y for x, y in zip(a, b))
        out.append(dict(numerator=num, denominator=den, what=what,
                        median_over_median=summarize(a)["median"] / summarize(b)["median"],
                        per_round_median=quantile(per_round, 0.5), per_round_min=per_round[0],
                        per_round_max=per_round[-1], rounds=len(per_round)))
    return out


def print_peers_ratios(ratios):
    print("comparisons (time of the first / time of the second: median over median; per-round: the median of the "
          "ratios of the two steps taken in the same round, with their range):")
    for r in ratios:
        print(f"  {r['what']}")
        print(f"    {r['numerator']} / {r['denominator']}: {r['median_over_median']:.3f}x (per-round "
              f"{r['per_round_median']:.3f}x, range {r['per_round_min']:.3f}-{r['per_round_max']:.3f}, "
              f"{r['rounds']} rounds)")


def print_peers_steps(peers, status, width=W):
    """What each peer's timed step contains, with its untimed compile time where it has one."""
    print("what each timed step contains:")
    for p in peers:
        extra = ""
        cs = status[p.name].get("compile_and_first_step_s")
        if cs is not None:
            extra = f" [compile + first step: {cs:.1f} s, untimed]"
        fs = status[p.name].get("first_step_s")
        if fs is not None:
            extra = f" [first step (the verification's): {fs:.1f} s, untimed]"
        print(f"  {p.name:<{width}} {status[p.name].get('what', p.what)}{extra}")


def report_overhead(args, sf, shapes, shapes_source, versions, t_start, configs, verify, samples, threads_sf):
    """--overhead's report on stdout (what was run, the verification, each configuration's time, the
    fixed overhead per step and per tensor) and with --json the same as JSON."""
    n = sum(c for _, c in shapes)
    _, upd = step_bytes(reduce_pass=False)
    print(f"stepfuse peers --overhead · per-step fixed cost: {args.list_name} ({len(shapes)} tensors, "
          f"{commas(n)} parameters, from {shapes_source}) vs flat (1 tensor of {commas(n)}) · {args.threads} thread"
          f"{'s' if args.threads != 1 else ''} (stepfuse uses {threads_sf}) · OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"the step: plain AdamW (lr {HYPER['lr']:g}, betas {HYPER['beta1']:g}/{HYPER['beta2']:g}, eps "
          f"{HYPER['eps']:g}, wd {HYPER['weight_decay']:g}), no loss scale, no clipping: stepfuse Optimizer::step() "
          f"and torch.optim.AdamW(fused=True).step(); {upd} B/param")
    print("versions: " + " · ".join(f"{k} {v}" for k, v in versions.items()))
    print(f"CPU: {cpu_model()} · {os.cpu_count()} logical CPUs · stepfuse kernels {sf.cpu_target()}")
    print("verified before timing: one step of torch fused AdamW against stepfuse's from the same start (figures "
          "as in the peers mode): " +
          "; ".join(f"{layout}: exp_avg {d['exp_avg']:.1e}, exp_avg_sq {d['exp_avg_sq']:.1e}, weight update "
                    f"{d['weight_update']:.1e}" for layout, d in verify.items()))
    print()
    print(f"{args.steps} timed steps per configuration after {args.warmup} warm-up rounds, interleaved (Williams "
          f"design), at least {args.gap_ms:g} ms idle before each:")
    print(f"  {'peer':<12} {'layout':<7} {'median ms':>10} {'min':>9} {'IQR':>9} {'GB/s':>8}")
    summ = {}
    for peer, layout, _ in configs:
        s = summarize(samples[(peer, layout)])
        summ[(peer, layout)] = s
        gbs = upd * n / s["median"] * 1e-9
        print(f"  {peer:<12} {layout:<7} {s['median'] * 1e3:>10.2f} {s['min'] * 1e3:>9.2f} "
              f"{(s['p75'] - s['p25']) * 1e3:>9.2f} {gbs:>8.1f}")
    print()
    print(f"fixed overhead = median(many) - median(flat), per step and per tensor ({len(shapes)} tensors):")
    print(f"  {'peer':<12} {'us/step':>10} {'us/tensor':>10}   (paired: median over rounds of many - flat)")
    result = {}
    for peer in ("stepfuse", "torch-fused"):
        d = summ[(peer, "many")]["median"] - summ[(peer, "flat")]["median"]
        paired = sorted(a - b for a, b in zip(samples[(peer, "many")], samples[(peer, "flat")]))
        pm = quantile(paired, 0.5)
        result[peer] = dict(us_per_step=d * 1e6, us_per_tensor=d * 1e6 / len(shapes), paired_us_per_step=pm * 1e6,
                            paired_us_per_tensor=pm * 1e6 / len(shapes))
        print(f"  {peer:<12} {d * 1e6:>10.0f} {d * 1e6 / len(shapes):>10.3f}   (paired {pm * 1e6:.0f} us/step, "
              f"{pm * 1e6 / len(shapes):.3f} us/tensor)")
    print(f"total run time {time.perf_counter() - t_start:.1f} s")
    if args.json:
        j = dict(tool="bench/peers/peers.py", mode="overhead", preset=args.preset, shapes_file=args.shapes,
                 shapes_source=shapes_source,
                 tensors=len(shapes), params=n, dtype=args.dtype, threads=args.threads, stepfuse_threads=threads_sf,
                 steps=args.steps, warmup=args.warmup, gap_ms=args.gap_ms, seed=args.seed,
                 omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                 step=dict(optimizer="AdamW", **HYPER, loss_scale=None, max_grad_norm=None),
                 step_bytes=dict(per_param=upd, per_step=upd * n), versions=versions, machine=machine_info(),
                 stepfuse_cpu_target=sf.cpu_target(), argv=sys.argv[1:], verify=verify,
                 configs={f"{p}/{l}": dict(peer=p, layout=l, ms=scaled_summary(summ[(p, l)], 1e3),
                                           samples_ms=[x * 1e3 for x in samples[(p, l)]],
                                           gbs=upd * n / summ[(p, l)]["median"] * 1e-9) for p, l, _ in configs},
                 overhead=result)
        write_json(args.json, j)
