"""The low-precision mode's verification (--dtype bf16): each peer's one-step result against a reference
step computed in fp64 from the same bf16 weights and gradients. There is no exact answer to match
here: stochastic rounding lands on either neighbour of the exact weight, 8-bit state is within a
code-book step of the exact moment. So each figure has a stated tolerance (config.py, LOWP_*), and
the reference is the exact step rather than one of the peers."""

import gc
import math
import traceback

from .config import (HYPER, LOWP_DECAY_TOL, LOWP_FIT_SIGMAS, LOWP_FIT_TOL, LOWP_PARAM_TOL, MAX_NORM, NORM_TOL,
                     VERIFY_FLOOR)
from .console import first_lines, progress
from .peer import SkipPeer


def reference_step(ctx):
    """dict(w1, m, v: fp32 tensors per param, grad_norm, clip_coef, applied): the step in fp64 from
    the pristine bf16 weights and gradients (weights0, grads_backup): unscale by 1/S, all finite,
    global L2 norm, clip = min(1, max_norm / (norm + 1e-6)), AdamW's first step from zero state."""
    torch = ctx.torch
    inv_s = 1.0 / ctx.args.loss_scale
    lr, b1, b2, eps, wd = (HYPER[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    applied = all(bool(torch.isfinite(g).all()) for g in ctx.grads_backup)
    if not applied:
        raise RuntimeError("the reference step: a gradient is not finite (the inputs are drawn finite: a bug here)")
    norm = math.sqrt(sum(float((g.double() * inv_s).square().sum()) for g in ctx.grads_backup))
    clip = min(1.0, MAX_NORM / (norm + 1e-6))
    ref = dict(w1=[], m=[], v=[], grad_norm=norm, clip_coef=clip, applied=applied)
    for w0, g in zip(ctx.weights0, ctx.grads_backup):
        gc_ = g.double() * (inv_s * clip)
        m = gc_ * (1 - b1)
        v = gc_.square() * (1 - b2)
        denom = v.sqrt() / math.sqrt(1 - b2) + eps
        w1 = w0.double() * (1 - lr * wd) - (lr / (1 - b1)) * m / denom
        ref["w1"].append(w1.float())
        ref["m"].append(m.float())
        ref["v"].append(v.float())
        del gc_, m, v, denom, w1
    return ref


def bf16_ulp(x):
    """The spacing of bf16 values around each element of x (fp64): 2^(floor(log2|x|) - 7), at least
    the smallest subnormal's."""
    _, e = x.frexp()  # x = f * 2^e, 0.5 <= |f| < 1
    return (e - 8).to(x.dtype).exp2().clamp(min=2.0 ** -133)


def block_absmax(ref, block):
    """Each element's block absmax of ref (blocks of `block` elements, the last one possibly short)."""
    n = ref.numel()
    a = ref.new_zeros(n + (-n) % block)
    a[:n] = ref.abs()
    return a.view(-1, block).amax(dim=1).repeat_interleave(block)[:n]


def state_figure(peer_t, ref_t, block):
    """max_i |peer_i - ref_i| / max(|ref_i|, VERIFY_FLOOR * max|ref|), or with `block` (8-bit state)
    / the absmax of ref_i's block."""
    a = peer_t.reshape(-1).double()
    b = ref_t.reshape(-1).double()
    if a.numel() != b.numel():
        return float("inf")
    if b.numel() == 0:
        return 0.0
    if block:
        den = block_absmax(b, block)
    else:
        den = b.abs().clamp(min=float(b.abs().max()) * VERIFY_FLOOR)
    return float(((a - b).abs() / den.clamp(min=1e-30)).max())


def compare_lowp(res, ref, weights0, grad_tol, rounding, state_tol=None):
    """The verification figures of one peer (res: its lowp_result(); grad_tol: the relative error its
    gradients may carry; rounding: how it rounds its bf16 weights, "stochastic" or "nearest"; state_tol:
    the tolerance of its fp32 or bf16 state, grad_tol unless given) against the reference; see config.py."""
    dot = lambda a, b: float(a.double().reshape(-1).dot(b.double().reshape(-1)))  # noqa: E731
    # The clip coefficient is fitted from the tensors whose exp_avg the row stores in fp32 or bf16 where it has
    # any: rounding to the nearest 8-bit code is not unbiased, it moves the fit by ~1e-4 (more than stepfuse's
    # fp32 tolerance for the small tensors divided by it); from the 8-bit ones only where there is nothing else.
    pairs = ([(a, b) for a, b, block in zip(res["exp_avg"], ref["m"], res["blocks"]) if not block]
             or list(zip(res["exp_avg"], ref["m"])))
    num = sum(dot(a, b) for a, b in pairs)
    den = sum(dot(b, b) for _, b in pairs)
    r = num / den if den > 0 else 1.0
    code_step = res.get("code_step") or 0.0
    tol8 = grad_tol + code_step
    if state_tol is None:
        state_tol = grad_tol
    d = dict(clip_coef=r - 1.0, exp_avg=0.0, exp_avg_sq=0.0, exp_avg_8bit=None, exp_avg_sq_8bit=None,
             state_tol=state_tol, state_tol_8bit=tol8 if code_step else None, rounding=rounding, weights=0.0,
             update_fit=None, update_fit_tol=None, decay=None, decay_tol=None, param=None)
    for key, rk, k in (("exp_avg", "m", 1), ("exp_avg_sq", "v", 2)):
        for a, b, block in zip(res[key], ref[rk], res["blocks"]):
            f = state_figure(a / r ** k, b, block)
            slot = key + "_8bit" if block else key
            d[slot] = max(d[slot] or 0.0, f)
    # Weights: within one ulp of the exact weight (stochastic rounding: either neighbour) or half of
    # one (to nearest), + lr * grad_tol. The fit compares the update with what the rounding gives on
    # average: the exact update (stochastic), or the exact weight rounded to nearest.
    lr = HYPER["lr"]
    ulps = 1.0 if rounding == "stochastic" else 0.5
    fit_num = fit_den = fit_var = decay_num = decay_den = decay_var = 0.0
    for w1, r1, w0 in zip(res["weights"], ref["w1"], weights0):
        bf16 = w1.dtype
        w1, r1, w0 = w1.reshape(-1).double(), r1.reshape(-1).double(), w0.reshape(-1).double()
        if w1.numel() != r1.numel():
            d["weights"] = float("inf")
            continue
        if w1.numel() == 0:
            continue
        ulp = bf16_ulp(r1)
        d["weights"] = max(d["weights"], float(((w1 - r1).abs() / (ulps * ulp + lr * grad_tol)).max()))
        target = r1 if rounding == "stochastic" else r1.to(bf16).double()
        dw, dt = w1 - w0, target - w0
        fit_num += float(dw.dot(dt))
        fit_den += float(dt.dot(dt))
        fit_var += float((dt * ulp).square().sum()) / 4  # stochastic rounding's variance: at most ulp^2 / 4
        # The decay: w1 - target = -lr (wd' - wd) w0 for a row that decays by wd' instead of wd.
        decay_num -= float((w1 - target).dot(w0))
        decay_den += float(w0.dot(w0))
        decay_var += float((w0 * ulp).square().sum()) / 4
        del ulp, target, dw, dt
    if fit_den > 0:
        d["update_fit"] = fit_num / fit_den - 1.0
        d["update_fit_tol"] = LOWP_FIT_TOL + LOWP_FIT_SIGMAS * math.sqrt(fit_var) / fit_den
    lr_wd = lr * HYPER["weight_decay"]
    if decay_den > 0 and lr_wd > 0:
        d["decay"] = decay_num / decay_den / lr_wd
        d["decay_tol"] = LOWP_DECAY_TOL + LOWP_FIT_SIGMAS * math.sqrt(decay_var) / decay_den / lr_wd
    if res.get("param") is not None:
        # In ulps of the larger of the weight before and after: where the update cancels the
        # weight, the fp32 arithmetic's error is the operands', not the small result's.
        d["param"] = 0.0
        for p, r1, w0 in zip(res["param"], ref["w1"], weights0):
            p, r1, w0 = p.reshape(-1).double(), r1.reshape(-1).double(), w0.reshape(-1).double()
            if p.numel():
                d["param"] = max(d["param"], float(((p - r1).abs() / bf16_ulp(r1.abs().maximum(w0.abs()))).max()))
    d["ok"] = (abs(d["clip_coef"]) <= NORM_TOL and d["exp_avg"] <= state_tol and d["exp_avg_sq"] <= state_tol
               and (d["exp_avg_8bit"] or 0.0) <= tol8 and (d["exp_avg_sq_8bit"] or 0.0) <= tol8
               and d["weights"] <= 1.0 and (d["update_fit"] is None or abs(d["update_fit"]) <= d["update_fit_tol"])
               and (d["decay"] is None or abs(d["decay"]) <= d["decay_tol"])
               and (d["param"] is None or d["param"] <= LOWP_PARAM_TOL))
    return d


def verify_lowp_peers(ctx, peers, status):
    """One step of each peer from the same start, against reference_step(); a peer that fails, disagrees
    or does not apply gets its status and is left out (a stepfuse row failing raises). Stores the
    reference's norm and clip in ctx.lowp_reference and each peer's storage() in its status. Returns
    the peers to time, the weights back at the start."""
    progress("computing the fp64 reference step")
    ref = reference_step(ctx)
    ctx.lowp_reference = {k: ref[k] for k in ("grad_norm", "clip_coef", "applied")}
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
            res = p.lowp_result()
            d = compare_lowp(res, ref, ctx.weights0, p.grad_tol, p.rounding, getattr(p, "state_tol", None))
            del res
            status[p.name]["verify"] = d
            status[p.name]["storage"] = p.storage()
            if not d["ok"]:
                raise RuntimeError("one-step result differs from the fp64 reference beyond its tolerance: " +
                                   ", ".join(f"{k} {v:.2e}" for k, v in d.items() if isinstance(v, float)))
            if p.writes_torch_grads:
                ctx.grads_dirty = True
            active.append(p)
        except SkipPeer as e:
            status[p.name] = {"status": "skipped", "error": str(e)}
        except Exception as e:  # a peer failing is a result, reported in the table
            if p.required:
                raise RuntimeError(f"{p.name} failed its verification: {first_lines(e)}") from e
            status[p.name].update(status="failed", error=first_lines(e), traceback=traceback.format_exc())
        gc.collect()
    del ref
    ctx.restore_weights()
    ctx.weights0 = None
    gc.collect()
    return active
