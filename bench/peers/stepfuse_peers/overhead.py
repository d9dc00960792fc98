"""The --overhead mode: a plain AdamW step (no loss scale, no clipping) of stepfuse and torch fused
AdamW on the preset's tensors ("many") and on one tensor of the same total size ("flat"), interleaved;
the difference of the medians is the per-step fixed cost."""

import sys

from .config import HYPER
from .console import progress
from .report import report_overhead
from .stepfuse_peer import adamw_config, state_copies
from .timing import time_configs
from .verify import compare_step

OVERHEAD_PEERS = ("stepfuse", "torch-fused")


def make_start(args, torch, lists):
    """{layout: (weights, gradients)}: the starting point of every configuration of that layout,
    weights ~ U(-0.1, 0.1), gradients ~ U(-1e-3, 1e-3), from --seed."""
    gen = torch.Generator().manual_seed(args.seed)
    start = {}
    for layout, sizes in lists.items():
        w0 = [torch.empty(c).uniform_(-0.1, 0.1, generator=gen) for c in sizes]
        g0 = [torch.empty(c).uniform_(-1e-3, 1e-3, generator=gen) for c in sizes]
        start[layout] = (w0, g0)
    return start


def make_configs(args, sf, torch, lists, start):
    """(configs, states): configs lists (peer, layout, step function) for each peer and layout, on
    its own copies of `start`; states[(peer, layout)] = (weights, stepfuse.Optimizer or torch optimizer)."""
    configs = []
    states = {}
    progress("building the optimizers")
    for peer in OVERHEAD_PEERS:
        for layout in lists:
            w0, g0 = start[layout]
            ws = [torch.nn.Parameter(w.clone()) for w in w0]
            gs = [g.clone() for g in g0]
            for w, g in zip(ws, gs):
                w.grad = g
            if peer == "stepfuse":
                opt = sf.Optimizer(adamw_config(sf), [(w.detach(), g) for w, g in zip(ws, gs)],
                                   num_threads=args.threads)
                step = opt.step
                states[(peer, layout)] = (ws, opt)
            else:
                opt = torch.optim.AdamW(ws, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
                                        weight_decay=HYPER["weight_decay"], fused=True)
                step = opt.step
                states[(peer, layout)] = (ws, opt)
            configs.append((peer, layout, step))
    return configs, states


def verify_configs(torch, lists, start, configs, states):
    """{layout: verification figures}: the first step of each (stepfuse, torch fused) pair from the
    same start, compared as in the peers mode; None (after saying so on stderr) if a pair disagrees."""
    progress("verifying one step of each against each other")
    verify = {}
    for peer, layout, step in configs:
        step()
    for layout in lists:
        w0 = start[layout][0]
        ws_sf, sf_opt = states[("stepfuse", layout)]
        ws_t, opt = states[("torch-fused", layout)]
        sf_states = state_copies(sf_opt, len(ws_sf), torch)
        ref = [[a.detach() - b for a, b in zip(ws_sf, w0)], sf_states["exp_avg"], sf_states["exp_avg_sq"]]
        d = compare_step([a.detach() - b for a, b in zip(ws_t, w0)], [opt.state[w]["exp_avg"] for w in ws_t],
                         [opt.state[w]["exp_avg_sq"] for w in ws_t], ref)
        verify[layout] = d
        if not d["ok"]:
            print(f"peers: VERIFICATION FAILED ({layout}): torch fused AdamW and stepfuse disagree: {d}",
                  file=sys.stderr)
            return None
    return verify


def run_overhead(args, sf, torch, shapes, shapes_source, versions, t_start):
    """Builds, verifies, times and reports the --overhead configurations; the exit code (2 if
    stepfuse and torch fused AdamW disagree)."""
    n = sum(c for _, c in shapes)
    lists = {"many": [c for _, c in shapes], "flat": [n]}
    start = make_start(args, torch, lists)
    configs, states = make_configs(args, sf, torch, lists, start)
    verify = verify_configs(torch, lists, start, configs, states)
    if verify is None:
        return 2
    del start
    threads_sf = states[("stepfuse", "many")][1].num_threads
    samples = time_configs(args, configs)
    report_overhead(args, sf, shapes, shapes_source, versions, t_start, configs, verify, samples, threads_sf)
    return 0
