"""The timing: warm-up and timed rounds in which every peer (or configuration) steps once, in an
order that changes from round to round so that drift in the machine affects all alike and no peer
always comes right after the same one; before each step, the process waits until it is idle."""

import time
import traceback

from .console import first_lines, progress


def williams_orders(n):
    """Orders of range(n), one per round, in which every index comes directly after every other
    one equally often over the cycle, and is first equally often: a Williams design (n orders for
    even n, 2n for odd n). What a peer leaves behind (threads still busy, memory being freed,
    caches) then weighs on every other peer alike, not on the one that always follows it."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows + [r[::-1] for r in rows] if n % 2 else rows


def interleaved_rounds(items, warmup, steps):
    """Yields (timed, order) for each of warmup + steps rounds: whether the round is timed, and
    `items` in the round's order of williams_orders(len(items)) (len(items) is read each round:
    peers that failed have been removed from it)."""
    for it in range(warmup + steps):
        timed = it >= warmup
        progress(("timing %d/%d" % (it - warmup + 1, steps)) if timed
                 else ("warm-up %d/%d" % (it + 1, warmup)))
        orders = williams_orders(len(items))
        yield timed, [items[i] for i in orders[it % len(orders)]]
    progress("")


def wait_until_idle(gap, limit=2.0):
    """Sleeps `gap` seconds, then again while the process used more than a tenth of a CPU over the
    last sleep (threads of the step before still at work: OpenMP or XLA workers spinning, buffers
    being freed), for at most `limit` seconds; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        c0 = time.process_time()
        time.sleep(gap)
        busy = time.process_time() - c0
        waited = time.perf_counter() - t0
        if busy < 0.1 * gap or waited >= limit:
            return waited


def time_peers(args, ctx, active, status):
    """{peer name: [seconds per timed step]}: the verified peers `active`, interleaved; before each
    step, untimed: the peer's prepare(), the cache eviction, then at least --gap-ms idle
    (wait_until_idle; status[name]["idle_wait_ms"] has the waits). A peer other than stepfuse that
    fails is removed from `active` and its status says why; stepfuse (a required peer) failing raises."""
    samples = {p.name: [] for p in active}
    waits = {p.name: [] for p in active}
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
                waited = wait_until_idle(gap)
                t0 = time.perf_counter()
                p.step()
                t = time.perf_counter() - t0
                p.finish()
                if p.writes_torch_grads:
                    ctx.grads_dirty = True
                p.check_applied()
                if timed:
                    samples[p.name].append(t)
                    waits[p.name].append(waited)
            except Exception as e:
                if p.required:
                    raise
                status[p.name].update(status="failed", error="during timing: " + first_lines(e),
                                      traceback=traceback.format_exc())
                active.remove(p)
    for name, w in waits.items():
        status[name]["idle_wait_ms"] = [x * 1e3 for x in w]
    return samples


def time_configs(args, configs):
    """{(peer, layout): [seconds per timed step]} for --overhead's (peer, layout, step function)
    configurations, interleaved, at least --gap-ms idle before each step (wait_until_idle)."""
    samples = {(p, l): [] for p, l, _ in configs}
    gap = args.gap_ms / 1000.0
    for timed, order in interleaved_rounds(configs, args.warmup, args.steps):
        for peer, layout, step in order:
            wait_until_idle(gap)
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            if timed:
                samples[(peer, layout)].append(t)
    return samples
