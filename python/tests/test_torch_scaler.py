"""Loss scaling: stepfuse.torch's optimizers under torch.amp.GradScaler, and
stepfuse.torch.GradScaler, against torch.amp.GradScaler driving torch.optim's optimizer.
Gradients carry the current loss scale, some steps get an inf or a NaN: on those steps
nothing may be written, and the scale, its growth and the scaler's state_dict must follow
torch's at every step."""

import inspect

import pytest

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

STEPS = 30
INIT_SCALE = 2.0**12  # a power of two: unscaling is exact, for torch and for us
GROWTH_INTERVAL = 4
# step -> (value, param, flat index): non-finite gradients. Step 0 has no state yet; 5
# and 6 back off twice in a row; the good runs in between are long enough to grow.
BAD = {0: (float("inf"), 3, 7), 5: (float("nan"), 0, 1), 6: (float("-inf"), 1, 0), 17: (float("nan"), 3, 16000)}

OPTIMIZERS = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("RMSprop", dict(lr=1e-3, centered=True)),
    ("Adagrad", dict(lr=0.05)),
]
# (whose scaler, whose optimizer) under test; the reference is always torch's with torch's.
COMBOS = [("torch", "stepfuse"), ("stepfuse", "stepfuse"), ("stepfuse", "torch")]


def make_scaler(kind, **kw):
    cls = torch.amp.GradScaler if kind == "torch" else sft.GradScaler
    return cls("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, **kw)


def current_scale(scaler):
    """The loss scale of this iteration, through scaler.scale() as a training loop's
    scaler.scale(loss) would (which also makes the scaler ready for step())."""
    return float(scaler.scale(torch.ones(())))


def scaled_grads(util, params, step, scale, bad=BAD):
    grads = util.make_grads(params, step, scale=scale)
    if step in bad:
        value, i, j = bad[step]
        grads[i].view(-1)[j] = value
    return grads


@pytest.mark.parametrize("scaler_kind,opt_kind", COMBOS)
@pytest.mark.parametrize("name,kwargs", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_scaler_step_matches_torch(util, scaler_kind, opt_kind, name, kwargs):
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(ref, **kwargs)
    oopt = getattr(sft if opt_kind == "stepfuse" else torch.optim, name)(ours, **kwargs)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    scales = []
    for step in range(STEPS):
        scale = current_scale(tscaler)
        assert current_scale(oscaler) == scale, f"step {step}"
        scales.append(scale)
        grads = scaled_grads(util, ref, step, scale)
        for opt, params in ((topt, ref), (oopt, ours)):
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, grads)
        before_w, before_state = util.snapshot(ours), util.state_snapshot(oopt)
        tscaler.step(topt)
        oscaler.step(oopt)
        tscaler.update()
        oscaler.update()
        if step in BAD:
            util.assert_params_equal(ours, before_w, where=f"skipped step {step}:")
            util.assert_state_untouched(oopt, before_state, f"skipped step {step}")
        util.assert_params_close(ours, ref, where=f"step {step}:")
        assert oscaler.get_scale() == tscaler.get_scale(), f"step {step}"
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"
    # the run saw the scale back off and grow
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    util.assert_state_close(oopt, topt)


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_scaler_with_params_without_grad(util, scaler_kind):
    """Under a scaler, params without a gradient at some steps (one of them with an inf
    step in between) are skipped as torch skips them."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, oopt = torch.optim.Adam(ref, lr=1e-2), sft.Adam(ours, lr=1e-2)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    for step in range(STEPS):
        scale = current_scale(tscaler)
        assert current_scale(oscaler) == scale, f"step {step}"
        grads = scaled_grads(util, ref, step, scale)
        skip = {2} if 3 <= step <= 9 else set()
        for opt, params in ((topt, ref), (oopt, ours)):
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, grads, skip)
        tscaler.step(topt)
        oscaler.step(oopt)
        tscaler.update()
        oscaler.update()
        util.assert_params_close(ours, ref, where=f"step {step}:")
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"
    util.assert_state_close(oopt, topt)


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_one_scaler_two_optimizers(util, scaler_kind):
    """One scaler for two optimizers, as torch allows: each optimizer skips on its own
    gradients' inf/NaN (the other one steps), and update() backs off if either had one."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    t1, t2 = torch.optim.AdamW(ref[:2], lr=1e-2), torch.optim.SGD(ref[2:], lr=0.05, momentum=0.9)
    o1, o2 = sft.AdamW(ours[:2], lr=1e-2), sft.SGD(ours[2:], lr=0.05, momentum=0.9)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    bad = {4: (float("inf"), 3, 5), 9: (float("nan"), 0, 2)}  # one in each optimizer's params
    for step in range(16):
        scale = current_scale(tscaler)
        assert current_scale(oscaler) == scale, f"step {step}"
        grads = scaled_grads(util, ref, step, scale, bad=bad)
        util.set_grads(ref, grads)
        util.set_grads(ours, grads)
        before = util.snapshot(ours)
        for scaler, opts in ((tscaler, (t1, t2)), (oscaler, (o1, o2))):
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        if step == 4:
            util.assert_params_equal(ours[2:], before[2:], where="the optimizer with the inf:")
        if step == 9:
            util.assert_params_equal(ours[:2], before[:2], where="the optimizer with the NaN:")
        util.assert_params_close(ours, ref, where=f"step {step}:")
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_unscale_clip_step_path(util, scaler_kind):
    """scaler.unscale_(opt); clip_grad_norm_(params, 1.0); scaler.step(opt); update():
    the gradients are unscaled in place, clipped by the caller, and the step does not
    unscale them again."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2)
    oopt = sft.AdamW(ours, lr=1e-2)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    for step in range(STEPS):
        grads = scaled_grads(util, ref, step, current_scale(tscaler))
        assert current_scale(oscaler) == current_scale(tscaler), f"step {step}"
        norms = []
        for opt, params, scaler in ((topt, ref, tscaler), (oopt, ours, oscaler)):
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, grads)
            scaler.unscale_(opt)
            norms.append(torch.nn.utils.clip_grad_norm_(params, 1.0))
            scaler.step(opt)
            scaler.update()
        torch.testing.assert_close(norms[1], norms[0], equal_nan=True)
        util.assert_params_close(ours, ref, where=f"step {step}:")
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"
    util.assert_state_close(oopt, topt)


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
@pytest.mark.parametrize("name,kwargs", OPTIMIZERS[:2], ids=[n for n, _ in OPTIMIZERS[:2]])
def test_fused_clip_under_scaler(util, scaler_kind, name, kwargs):
    """max_grad_norm=1.0 inside the scaled step equals torch's unscale_ + clip_grad_norm_ +
    step; last_grad_norm is clip_grad_norm_'s result on the applied steps."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(ref, **kwargs)
    oopt = getattr(sft, name)(ours, max_grad_norm=1.0, **kwargs)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    for step in range(STEPS):
        grads = scaled_grads(util, ref, step, current_scale(tscaler))
        assert current_scale(oscaler) == current_scale(tscaler), f"step {step}"
        for opt, params in ((topt, ref), (oopt, ours)):
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, grads)
        before_w = util.snapshot(ours)
        tscaler.unscale_(topt)
        total = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        tscaler.step(topt)
        oscaler.step(oopt)
        tscaler.update()
        oscaler.update()
        if step in BAD:
            util.assert_params_equal(ours, before_w, where=f"skipped step {step}:")
        else:
            torch.testing.assert_close(oopt.last_grad_norm, total, msg=lambda m: f"step {step}: last_grad_norm: {m}")
        util.assert_params_close(ours, ref, where=f"step {step}:")
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"
    util.assert_state_close(oopt, topt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_weights_and_grads_under_scaler(util, dtype):
    """f16/bf16 weights with f16/bf16 scaled gradients (fp32 masters, the default) under
    stepfuse.torch.GradScaler: the weights are torch's fp32 run (on the fp32 values of the
    same gradients, torch's scaler) rounded to their format; skipped steps write nothing."""
    ours = util.make_params(dtype=dtype)
    ref = util.clone_params(ours, dtype=torch.float32)
    topt = torch.optim.AdamW(ref, lr=1e-3)
    oopt = sft.AdamW(ours, lr=1e-3)
    tscaler, oscaler = make_scaler("torch"), make_scaler("stepfuse")
    for step in range(STEPS):
        grads = scaled_grads(util, ours, step, current_scale(tscaler))  # in the weights' format
        assert current_scale(oscaler) == current_scale(tscaler), f"step {step}"
        util.set_grads(ours, grads)
        util.set_grads(ref, [g.float() for g in grads])
        before_w = util.snapshot(ours)
        tscaler.step(topt)
        oscaler.step(oopt)
        tscaler.update()
        oscaler.update()
        if step in BAD:
            util.assert_params_equal(ours, before_w, where=f"skipped step {step}:")
        util.assert_rounded_from(ours, ref, where=f"step {step}:")
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"


def test_grad_scale_and_found_inf_attributes(util):
    """The protocol torch.amp.GradScaler uses with optimizers that declare
    _step_supports_amp_scaling: opt.grad_scale (the scale to divide by) and opt.found_inf
    (skip when nonzero), set by hand here, against torch's fused AdamW, which honours the
    same attributes."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    oopt = sft.AdamW(ours, lr=1e-2)
    for step in range(12):
        grads = util.make_grads(ref, step, scale=8.0)
        for opt, params in ((topt, ref), (oopt, ours)):
            util.set_grads(params, grads)
            opt.grad_scale = torch.tensor(8.0)
            opt.found_inf = torch.tensor(1.0 if step in (0, 5) else 0.0)
        before_w = util.snapshot(ours)
        topt.step()
        oopt.step()
        for opt in (topt, oopt):
            del opt.grad_scale, opt.found_inf
        if step in (0, 5):
            util.assert_params_equal(ours, before_w, where=f"found_inf step {step}:")
        util.assert_params_close(ours, ref, where=f"step {step}:")
    util.assert_state_close(oopt, topt)


@pytest.mark.parametrize("name", [
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
    "Lion", "LAMB",
])
def test_every_optimizer_declares_amp_scaling(util, name):
    opt = getattr(sft, name)(util.make_params())
    assert getattr(opt, "_step_supports_amp_scaling", False) is True


def test_grad_scaler_is_torchs(util):
    """A subclass of torch.amp.GradScaler with the same constructor and state_dict; a
    state_dict moves between the two both ways."""
    assert issubclass(sft.GradScaler, torch.amp.GradScaler)
    tsig = inspect.signature(torch.amp.GradScaler.__init__).parameters
    osig = inspect.signature(sft.GradScaler.__init__).parameters
    for k, p in tsig.items():
        assert k in osig and osig[k].default == p.default, k
    kw = dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    t, o = torch.amp.GradScaler("cpu", **kw), sft.GradScaler("cpu", **kw)
    assert o.state_dict() == t.state_dict()
    assert o.get_scale() == t.get_scale() == 1024.0
    t.load_state_dict({**t.state_dict(), "scale": 512.0, "_growth_tracker": 3})
    o.load_state_dict(util.save_load(t.state_dict()))
    assert o.state_dict() == t.state_dict() and o.get_scale() == 512.0
    t2 = torch.amp.GradScaler("cpu")
    t2.load_state_dict(o.state_dict())
    assert t2.state_dict() == o.state_dict()


def test_disabled_scaler_steps_plainly(util):
    """enabled=False: step() is a plain step, as torch's."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, oopt = torch.optim.AdamW(ref, lr=1e-2), sft.AdamW(ours, lr=1e-2)
    tscaler = torch.amp.GradScaler("cpu", enabled=False)
    oscaler = sft.GradScaler("cpu", enabled=False)
    for step in range(5):
        grads = util.make_grads(ref, step)
        util.set_grads(ref, grads)
        util.set_grads(ours, grads)
        tscaler.step(topt)
        oscaler.step(oopt)
        tscaler.update()
        oscaler.update()
        util.assert_params_close(ours, ref, where=f"step {step}:")


def test_last_grad_norm_is_inf_on_a_step_torchs_scaler_skips():
    """Under torch.amp.GradScaler, a step the scaler skips (found_inf) reports an infinite
    last_grad_norm, as a step the fused scaler skips does; a finite step reports the norm
    of the unscaled gradients, as clip_grad_norm_ returns it."""
    p = torch.randn(100, requires_grad=True)
    opt = sft.AdamW([p], max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.tensor(1.0))
    g = torch.randn(100)
    p.grad = g * 4.0
    scaler.step(opt)
    scaler.update()
    torch.testing.assert_close(opt.last_grad_norm, torch.linalg.vector_norm(g))
    p.grad = torch.full((100,), float("inf"))
    before = p.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.isinf(opt.last_grad_norm)
    assert torch.equal(p.detach(), before)


def _one_param_setup(module, scaler_cls, opt_name="AdamW", scale=8.0, **kw):
    """One param, one optimizer of `module`, a scaler of `scaler_cls` at `scale` with the
    param's gradient scaled by it."""
    p = torch.nn.Parameter(torch.tensor([0.5, -0.25, 1.5]))
    opt = getattr(module, opt_name)([p], lr=0.1, **kw)
    scaler = scaler_cls("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))
    p.grad = torch.tensor([0.3, -1.2, 0.7]) * scale
    return p, opt, scaler


def test_fused_scaler_step_goes_through_optimizer_step():
    """stepfuse.torch.GradScaler.step runs the optimizer's step() as torch's scaler does:
    its pre and post hooks, the global optimizer hooks, an LR scheduler's count of
    optimizer steps (no "lr_scheduler.step() before optimizer.step()" warning) and a
    wrapper put on opt.step all see the fused step; step() forwards positional arguments
    and returns what the optimizer's step() returns."""
    import types
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook

    p, opt, scaler = _one_param_setup(sft, sft.GradScaler)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    handle = register_optimizer_step_post_hook(lambda *a: calls.append("global"))
    try:
        inner = opt.step

        def wrapper(self, *args, **kwargs):
            calls.append("wrapper")
            return inner(*args, **kwargs)

        opt.step = types.MethodType(wrapper, opt)  # (a method: the scheduler wraps it in turn)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)  # (wraps opt.step in turn)
        before = p.detach().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert scaler.step(opt) is None
            scaler.update()
            sched.step()
        assert calls == ["wrapper", "pre", "post", "global"]
        assert not torch.equal(p.detach(), before)
        assert opt.param_groups[0]["lr"] == 0.05
        # A positional closure goes to the optimizer's step, whose value step() returns.
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(3)
        assert scaler.step(opt, lambda: 7.0) == 7.0
        scaler.update()
    finally:
        handle.remove()


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_scaler_step_without_any_gradient_raises_as_torch(scaler_kind):
    """An optimizer none of whose params has a gradient records no inf check: torch's
    scaler raises AssertionError at step() (torch.optim) or at update() (an optimizer
    that checks its gradients itself, as stepfuse.torch's); stepfuse's scaler raises at
    step(), as torch's does for torch.optim."""
    results = {}
    for kind in ("reference", "ours"):
        module = torch.optim if kind == "reference" else sft
        scaler_cls = torch.amp.GradScaler if kind == "reference" else (
            torch.amp.GradScaler if scaler_kind == "torch" else sft.GradScaler)
        p, opt, scaler = _one_param_setup(module, scaler_cls)
        p.grad = None
        with pytest.raises(AssertionError, match="No inf checks were recorded") as info:
            scaler.step(opt)
            scaler.update()
        results[kind] = (str(info.value), scaler.get_scale(), p.detach().clone())
    assert results["ours"][1:2] == results["reference"][1:2]
    assert torch.equal(results["ours"][2], results["reference"][2])


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
@pytest.mark.parametrize("name,kwargs", [("SGD", dict(momentum=0.9, dampening=0.5)), ("AdamW", {}),
                                         ("NAdam", {}), ("ASGD", {}), ("RMSprop", dict(momentum=0.5))],
                         ids=["SGD", "AdamW", "NAdam", "ASGD", "RMSprop"])
def test_a_skipped_first_step_creates_no_state(util, scaler_kind, name, kwargs):
    """As torch: a param has no optimizer state until a step is applied to it, so a first
    step the scaler skips leaves state_dict()["state"] empty, and the steps after it (also
    across a state_dict round trip, which re-plans) match torch's. SGD with dampening
    takes its first applied step's gradient undamped: a zero momentum buffer made at the
    skipped step would have damped it."""
    ref = util.make_params(shapes=[(3, 5), (7,)])
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(ref, lr=0.05, **kwargs)
    oopt = getattr(sft, name)(ours, lr=0.05, **kwargs)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    for step in range(4):
        scale = current_scale(tscaler)
        assert current_scale(oscaler) == scale
        grads = util.make_grads(ref, step, scale=scale)
        if step == 0:
            grads[1][2] = float("inf")
        for opt, params in ((topt, ref), (oopt, ours)):
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, grads)
        tscaler.step(topt)
        oscaler.step(oopt)
        tscaler.update()
        oscaler.update()
        if step == 0:
            assert topt.state_dict()["state"] == {}
            assert oopt.state_dict()["state"] == {}
            assert len(oopt.state) == 0
            oopt.load_state_dict(oopt.state_dict())
        util.assert_params_close(ours, ref, where=f"step {step}:")
    util.assert_state_close(oopt, topt)


@pytest.mark.parametrize("name", ["NAdam", "ASGD"])
def test_derived_state_is_current_after_each_step(util, name):
    """NAdam's mu_product and ASGD's eta and mu in opt.state[p] are current after every
    step, changed in place as torch changes its tensors (not only when state_dict() is
    called)."""
    ref = util.make_params(shapes=[(4, 6)])
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(ref, lr=0.1, **({"t0": 2} if name == "ASGD" else {}))
    oopt = getattr(sft, name)(ours, lr=0.1, **({"t0": 2} if name == "ASGD" else {}))
    keys = ("mu_product",) if name == "NAdam" else ("eta", "mu")
    held = None
    for step in range(6):
        util.step_both(topt, oopt, ref, ours, step)
        st = oopt.state[ours[0]]
        if held is None:
            held = {k: st[k] for k in keys}  # the tensors as a user would keep them
        for k in keys:
            assert torch.equal(st[k], topt.state[ref[0]][k]), f"step {step}: {k}"
            assert torch.equal(held[k], topt.state[ref[0]][k]), f"step {step}: {k} (held)"


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_a_scale_backed_off_to_zero_skips_every_step(scaler_kind):
    """A scale that backed off to 0 (150 non-finite steps in a row from 1.0: the fp32
    scale underflows) skips every later step: nothing written, no error, and the scale
    follows torch's scaler's (it stays 0). (torch's own optimizers step on the NaN
    gradients unscaling by 1/0 gives, since torch checks the gradients before it.)"""
    torch.manual_seed(0)
    ours = [torch.randn(5, requires_grad=True)]
    start = ours[0].detach().clone()
    opt = sft.AdamW(ours, lr=0.1)
    cls = torch.amp.GradScaler if scaler_kind == "torch" else sft.GradScaler
    tscaler, oscaler = torch.amp.GradScaler("cpu", init_scale=1.0), cls("cpu", init_scale=1.0)
    for step in range(153):
        for scaler in (tscaler, oscaler):
            scale = float(scaler.scale(torch.ones(())))
            if scaler is oscaler:
                ours[0].grad = torch.full((5,), float("inf") if step < 150 else 0.5 * scale)
                scaler.step(opt)
            else:
                scaler._per_optimizer_states[0]["found_inf_per_device"] = {
                    torch.device("cpu"): torch.tensor(float(step < 150))}
                scaler._per_optimizer_states[0]["stage"] = torch.amp.grad_scaler.OptState.STEPPED
            scaler.update()
        assert oscaler.get_scale() == tscaler.get_scale(), f"step {step}"
        assert torch.equal(ours[0], start), f"step {step}"
    assert oscaler.get_scale() == 0.0 and not opt.state.get(ours[0])
    assert float(opt.last_grad_norm) == float("inf")
