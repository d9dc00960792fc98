"""The verification: each peer's one-step result against stepfuse's (VERIFY_TOL, VERIFY_FLOOR,
NORM_TOL in config.py say what is compared and how closely)."""

import gc
import traceback

from .config import NORM_TOL, VERIFY_FLOOR, VERIFY_TOL
from .console import first_lines, progress
from .peer import SkipPeer


def rel_diff(peer, ref, elementwise=True):
    """The worst tensor's max_i |peer_i - ref_i| / max(|ref_i|, VERIFY_FLOOR * max|ref|)
    (elementwise), or max_i |peer_i - ref_i| / max|ref| (not elementwise)."""
    worst = 0.0
    for a, b in zip(peer, ref):
        a = a.reshape(-1).float()
        b = b.reshape(-1).float()
        if a.numel() != b.numel():
            return float("inf")
        if a.numel() == 0:
            continue
        top = float(b.abs().max())
        if elementwise:
            floor = max(top * VERIFY_FLOOR, 1e-30)
            worst = max(worst, float(((a - b).abs() / b.abs().clamp(min=floor)).max()))
        else:
            worst = max(worst, float((a - b).abs().max()) / max(top, 1e-30))
    return worst


def compare_step(dw, m, v, ref):
    """Verification figures of one peer's step against stepfuse's (ref = (dw, m, v)); see VERIFY_TOL."""
    num = sum(float(a.double().reshape(-1).dot(b.double().reshape(-1))) for a, b in zip(m, ref[1]))
    den = sum(float(b.double().reshape(-1).dot(b.double().reshape(-1))) for b in ref[1])
    r = num / den if den > 0 else 1.0
    d = dict(clip_coef=r - 1.0, weight_update=rel_diff(dw, ref[0], elementwise=False),
             exp_avg=rel_diff([a / r for a in m], ref[1]), exp_avg_sq=rel_diff([a / (r * r) for a in v], ref[2]))
    d["ok"] = (abs(d["clip_coef"]) <= NORM_TOL and d["weight_update"] <= VERIFY_TOL + abs(d["clip_coef"])
               and d["exp_avg"] <= VERIFY_TOL and d["exp_avg_sq"] <= VERIFY_TOL)
    return d


def verify_peers(ctx, peers, status):
    """One step of each peer from the same start, stepfuse's (the first peer) the reference; a peer
    that fails, disagrees or does not apply gets its status and is left out. Returns the peers to
    time, and leaves the weights back at the start without the verification's snapshot."""
    torch = ctx.torch
    ref = None
    active = []
    for p in peers:
        progress(f"verifying {p.name} (one step from the starting point)")
        try:
            ctx.restore_weights()
            ctx.restore_grads()
            p.setup()
            p.prepare()
            p.step()
            p.finish()
            p.check_applied()
            w, m, v = p.result()
            if p.name == "stepfuse":
                ref = ([a - b for a, b in zip(w, ctx.weights0)], m, v)
                status[p.name]["first_step"] = p.last_result()
                status[p.name]["verify"] = {"reference": True}
            else:
                d = compare_step([torch.as_tensor(a) - b for a, b in zip(w, ctx.weights0)], m, v, ref)
                status[p.name]["verify"] = d
                if not d["ok"]:
                    raise RuntimeError("one-step result differs from stepfuse's beyond fp32 rounding: " +
                                       ", ".join(f"{k} {v:.2e}" for k, v in d.items() if k != "ok"))
            del w, m, v
            if p.writes_torch_grads:
                ctx.grads_dirty = True
            active.append(p)
        except SkipPeer as e:
            status[p.name] = {"status": "skipped", "error": str(e)}
        except Exception as e:  # a peer failing is a result, reported in the table
            if p.required:
                raise
            status[p.name].update(status="failed", error=first_lines(e), traceback=traceback.format_exc())
    del ref
    ctx.restore_weights()
    ctx.weights0 = None  # the verification's snapshot is not needed any more
    gc.collect()
    return active
