"""The timing: warm-up and timed rounds in which every peer (or configuration) steps once,
round-robin, the first one rotating each round, so that drift in the machine affects all alike."""

import time
import traceback

from .console import first_lines, progress


def interleaved_rounds(items, warmup, steps):
    """Yields (timed, order) for each of warmup + steps rounds: whether the round is timed, and
    `items` rotated by the round number (len(items) is read each round: peers that failed have
    been removed from it)."""
    for it in range(warmup + steps):
        timed = it >= warmup
        progress(("timing %d/%d" % (it - warmup + 1, steps)) if timed
                 else ("warm-up %d/%d" % (it + 1, warmup)))
        k = it % len(items)
        yield timed, items[k:] + items[:k]
    progress("")


def time_peers(args, ctx, active, status):
    """{peer name: [seconds per timed step]}: the verified peers `active`, interleaved, --gap-ms idle
    before each step (after the peer's untimed prepare() and the cache eviction). A peer other than stepfuse that fails is
    removed from `active` and its status says why; stepfuse failing raises."""
    samples = {p.name: [] for p in active}
    gap = args.gap_ms / 1000.0
    for timed, order in interleaved_rounds(active, args.warmup, args.steps):
        for p in order:
            if p not in active:
                continue
            try:
                if p.reads_torch_grads and ctx.grads_dirty:
                    ctx.restore_grads()  # untimed: PyTorch's eager path unscaled and clipped them in place
                p.prepare()
                ctx.evict_caches()
                time.sleep(gap)
                t0 = time.perf_counter()
                p.step()
                t = time.perf_counter() - t0
                p.finish()
                if p.writes_torch_grads:
                    ctx.grads_dirty = True
                p.check_applied()
                if timed:
                    samples[p.name].append(t)
            except Exception as e:
                if p.name == "stepfuse":
                    raise
                status[p.name].update(status="failed", error="during timing: " + first_lines(e),
                                      traceback=traceback.format_exc())
                active.remove(p)
    return samples


def time_configs(args, configs):
    """{(peer, layout): [seconds per timed step]} for --overhead's (peer, layout, step function)
    configurations, interleaved, --gap-ms idle before each step."""
    samples = {(p, l): [] for p, l, _ in configs}
    gap = args.gap_ms / 1000.0
    for timed, order in interleaved_rounds(configs, args.warmup, args.steps):
        for peer, layout, step in order:
            time.sleep(gap)
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            if timed:
                samples[(peer, layout)].append(t)
    return samples
