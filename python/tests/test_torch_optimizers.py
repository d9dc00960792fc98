"""stepfuse.torch's optimizers against torch.optim's (and Lion and LAMB against float64
references written from their formulas): the weights after every step and the state,
for the main flag variants, param groups, add_param_group, lr schedulers, hand-set
hyperparameters, the fused gradient clipping, f16/bf16 weights with fp32 masters, params
without gradients and step(closure)."""

import copy
import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

TORCH_OPTIMIZERS = [
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax",
    "Adadelta", "Rprop", "ASGD",
]
STEPS = 30

# (optimizer, kwargs): every optimizer with its defaults and its main flags.
CASES = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=1e-2, maximize=True)),
    ("Adam", dict()),
    ("Adam", dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("AdamW", dict()),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    ("Adagrad", dict()),
    ("Adagrad", dict(lr=0.05, lr_decay=1e-2, initial_accumulator_value=0.1, weight_decay=1e-2)),
    ("Adagrad", dict(lr=0.05, eps=1e-6, maximize=True)),
    ("RMSprop", dict()),
    ("RMSprop", dict(lr=1e-3, centered=True, momentum=0.9)),
    ("RMSprop", dict(lr=1e-3, centered=True, weight_decay=1e-2)),
    ("RMSprop", dict(lr=1e-3, alpha=0.9, momentum=0.5, weight_decay=1e-2, maximize=True)),
    ("NAdam", dict()),
    ("NAdam", dict(lr=1e-2, weight_decay=1e-2, momentum_decay=8e-3)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    ("RAdam", dict()),
    ("RAdam", dict(lr=1e-2, weight_decay=1e-2)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True)),
    ("Adamax", dict()),
    ("Adamax", dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=1e-2, maximize=True)),
    ("Adadelta", dict()),
    ("Adadelta", dict(lr=0.5, rho=0.5, eps=1e-5, weight_decay=1e-2, maximize=True)),
    ("Rprop", dict()),
    ("Rprop", dict(lr=1e-3, etas=(0.3, 1.5), step_sizes=(1e-4, 1e-2), maximize=True)),
    ("ASGD", dict()),
    ("ASGD", dict(lr=1e-2, lambd=1e-2, alpha=0.5, t0=5, weight_decay=1e-2, maximize=True)),
]


def case_id(case):
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


def pair(name, kwargs, params_or_groups_ref, params_or_groups_ours):
    return (getattr(torch.optim, name)(params_or_groups_ref, **kwargs),
            getattr(sft, name)(params_or_groups_ours, **kwargs))


# ---- every optimizer against torch's own ---------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_torch(util, case):
    name, kwargs = case
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, ref, ours)
    assert isinstance(sopt, torch.optim.Optimizer)
    util.train_both(topt, sopt, ref, ours, STEPS, where=case_id(case))
    util.assert_state_close(sopt, topt)
    util.assert_groups_match(sopt, topt)


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_signature_and_defaults_are_torchs(util, name):
    """The same constructor arguments (names, positional order, defaults) as torch's, plus
    max_grad_norm=None, norm_type=2.0 and master_weights=True; the same group defaults."""
    tsig = inspect.signature(getattr(torch.optim, name).__init__).parameters
    ssig = inspect.signature(getattr(sft, name).__init__).parameters
    positional = [k for k, p in tsig.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    ours_positional = [k for k, p in ssig.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert ours_positional[: len(positional)] == positional
    for k, p in tsig.items():
        assert k in ssig, f"{name} has no argument {k!r}"
        assert ssig[k].default == p.default, f"{name}({k}=...) default {ssig[k].default!r}, torch's {p.default!r}"
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in ssig.values())
    for k, default in (("max_grad_norm", None), ("norm_type", 2.0), ("master_weights", True)):
        # named with its default, or taken through **kwargs
        assert k in ssig or takes_kwargs, f"{name} has no argument {k!r}"
        if k in ssig:
            assert ssig[k].default == default, f"{name}({k}=...) default {ssig[k].default!r}, expected {default!r}"
    ref, ours = util.make_params(), util.make_params()
    topt = getattr(torch.optim, name)(ref)
    sopt = getattr(sft, name)(ours, max_grad_norm=None, norm_type=2.0, master_weights=True)
    for k, v in topt.defaults.items():
        assert k in sopt.defaults, f"{name}.defaults has no {k!r}"
        assert sopt.defaults[k] == v, f"{name}.defaults[{k!r}] = {sopt.defaults[k]!r}, torch's {v!r}"
    util.assert_groups_match(sopt, topt)


def test_positional_arguments_as_torch(util):
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = torch.optim.SGD(ref, 0.05, 0.9, 0.0, 1e-2, True)
    sopt = sft.SGD(ours, 0.05, 0.9, 0.0, 1e-2, True)
    util.assert_groups_match(sopt, topt)
    util.train_both(topt, sopt, ref, ours, 5)


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_torchs_implementation_flags_are_accepted(util, name):
    """foreach, fused, capturable and differentiable (where torch has them) are accepted
    with their inert values and kept in the groups as torch keeps them."""
    tsig = inspect.signature(getattr(torch.optim, name).__init__).parameters
    flags = {k: v for k, v in (("foreach", False), ("capturable", False), ("differentiable", False)) if k in tsig}
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, flags, ref, ours)
    util.assert_groups_match(sopt, topt)
    util.train_both(topt, sopt, ref, ours, 3)


def test_empty_and_scalar_params(util):
    """A 0-element and a 0-dim parameter beside ordinary ones."""
    ref = util.make_params([(0,), (), (5, 0), (40,)])
    ours = util.clone_params(ref)
    topt, sopt = pair("AdamW", dict(lr=1e-2), ref, ours)
    util.train_both(topt, sopt, ref, ours, 5)
    util.assert_state_close(sopt, topt)


# ---- Lion and LAMB against float64 references ----------------------------------------------

class LionReference:
    """Lion (Chen et al. 2023), in float64: with g = -grad under maximize,
    p *= 1 - lr*wd; c = b1*m + (1-b1)*g; p -= lr*sign(c); m = b2*m + (1-b2)*g
    (jit/builtin/lion.hpp). Params without a gradient are skipped."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        self.p = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.lr, self.betas, self.wd, self.maximize = lr, betas, weight_decay, maximize

    def step(self, grads):
        b1, b2 = self.betas
        for p, m, g in zip(self.p, self.m, grads):
            if g is None:
                continue
            g = g.double()
            if self.maximize:
                g = -g
            p.mul_(1.0 - self.lr * self.wd)
            c = b1 * m + (1.0 - b1) * g
            p.sub_(self.lr * torch.sign(c))
            m.mul_(b2).add_((1.0 - b2) * g)


class LambReference:
    """LAMB as NVIDIA Apex's FusedLAMB (adam_w_mode, bias correction, grad averaging), in
    float64, per param with its own step count t (jit/builtin/lamb.hpp):
    m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
    u = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd*p;
    ratio = ||p|| / ||u|| when wd != 0 and neither norm is 0, else 1; p -= lr*ratio*u.
    With max_grad_norm, the gradients are first clipped as torch's clip_grad_norm_ clips
    them (over every param that has a gradient)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=None):
        self.p = [p.detach().double().clone() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.t = [0] * len(self.p)
        self.lr, self.betas, self.eps, self.wd, self.max_grad_norm = lr, betas, eps, weight_decay, max_grad_norm
        self.last_grad_norm = None

    def step(self, grads):
        b1, b2 = self.betas
        grads = [None if g is None else g.double() for g in grads]
        if self.max_grad_norm is not None:
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads if g is not None))
            self.last_grad_norm = norm
            coef = min(self.max_grad_norm / (norm + 1e-6), 1.0)
            grads = [None if g is None else g * coef for g in grads]
        for i, g in enumerate(grads):
            if g is None:
                continue
            p, m, v = self.p[i], self.m[i], self.v[i]
            self.t[i] += 1
            t = self.t[i]
            m.mul_(b1).add_((1.0 - b1) * g)
            v.mul_(b2).add_((1.0 - b2) * g * g)
            u = (m / (1.0 - b1**t)) / (torch.sqrt(v / (1.0 - b2**t)) + self.eps) + self.wd * p
            ratio = 1.0
            if self.wd != 0.0:
                pn, un = float(p.norm()), float(u.norm())
                if pn != 0.0 and un != 0.0:
                    ratio = pn / un
            p.sub_(self.lr * ratio * u)


def check_against_reference(util, opt, ours, ref, steps, *, skip_at=lambda step: (), lr_at=None, where="", **tol):
    """Steps `opt` over params `ours` and the float64 reference on the same gradients,
    comparing after every step (fp32 against float64: the default fp32 tolerances,
    unless given)."""
    for step in range(steps):
        if lr_at is not None and lr_at(step) is not None:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            ref.lr = lr_at(step)
        opt.zero_grad(set_to_none=True)
        grads = util.make_grads(ours, step)
        skip = skip_at(step)
        util.set_grads(ours, grads, skip)
        opt.step()
        ref.step([None if i in skip else g for i, g in enumerate(grads)])
        for i, (p, r) in enumerate(zip(ours, ref.p)):
            torch.testing.assert_close(p.detach(), r.float(), msg=lambda m, i=i: f"{where} step {step} param {i}: {m}", **tol)


LION_CASES = [
    dict(),
    dict(lr=1e-3, betas=(0.8, 0.95), weight_decay=0.1),
    dict(lr=1e-3, weight_decay=0.5, maximize=True),
]


@pytest.mark.parametrize("kwargs", LION_CASES, ids=lambda kw: "Lion" + "".join(f"-{k}={v}" for k, v in kw.items()))
def test_lion_matches_reference(util, kwargs):
    ours = util.make_params()
    ref = LionReference(ours, **kwargs)
    opt = sft.Lion(ours, **kwargs)
    check_against_reference(util, opt, ours, ref, STEPS, where="Lion")
    for i, p in enumerate(ours):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.m[i].float())


def test_lion_defaults(util):
    opt = sft.Lion(util.make_params())
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["weight_decay"], g["maximize"]) == (1e-4, (0.9, 0.99), 0.0, False)


LAMB_CASES = [
    dict(),
    dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1),
    dict(lr=1e-2, weight_decay=0.0),
    dict(lr=1e-2, max_grad_norm=1.0),
]


@pytest.mark.parametrize("kwargs", LAMB_CASES, ids=lambda kw: "LAMB" + "".join(f"-{k}={v}" for k, v in kw.items()))
def test_lamb_matches_reference(util, kwargs):
    # A zero tensor (a freshly initialized bias: its norm is 0, so its trust ratio is 1).
    ours = util.make_params()
    with torch.no_grad():
        ours[2].zero_()
    ref = LambReference(ours, **kwargs)
    opt = sft.LAMB(ours, **kwargs)
    check_against_reference(util, opt, ours, ref, STEPS, where="LAMB")
    for i, p in enumerate(ours):
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.m[i].float())
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.v[i].float())
    if "max_grad_norm" in kwargs:
        torch.testing.assert_close(opt.last_grad_norm, torch.tensor(ref.last_grad_norm, dtype=torch.float32))


def test_lamb_defaults(util):
    opt = sft.LAMB(util.make_params())
    g = opt.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-6, 0.01)


@pytest.mark.parametrize("name", ["Lion", "LAMB"])
def test_lion_lamb_lr_change_and_params_without_grad(util, name):
    """A hand-set lr from step 10 on, param 1 without a gradient at steps 5 to 12 and
    param 3 never with one: skipped params keep their weights, and get their own step
    counts (LAMB's bias corrections) as in torch."""
    ours = util.make_params()
    kwargs = dict(lr=1e-3, weight_decay=0.1)
    ref = (LionReference if name == "Lion" else LambReference)(ours, **kwargs)
    opt = getattr(sft, name)(ours, **kwargs)
    check_against_reference(util, opt, ours, ref, 20,
                            skip_at=lambda s: {1, 3} if 5 <= s <= 12 else {3},
                            lr_at=lambda s: 3e-3 if s == 10 else None, where=name)
    assert len(opt.state[ours[3]]) == 0


# ---- param groups, add_param_group, schedulers, hand-set hyperparameters -----------------------

def two_groups(params):
    """A decayed group, and a no-decay group with its own lr."""
    return [
        {"params": [params[1], params[3]]},
        {"params": [params[0], params[2]], "weight_decay": 0.0, "lr": 3e-3},
    ]


@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    ("RMSprop", dict(lr=1e-3, weight_decay=1e-2, centered=True)),
])
def test_param_groups(util, name, kwargs):
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, two_groups(ref), two_groups(ours))
    util.assert_groups_match(sopt, topt)
    util.train_both(topt, sopt, ref, ours, STEPS)
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("Adagrad", dict(lr=0.05, lr_decay=1e-2)),
])
def test_add_param_group_mid_training(util, name, kwargs):
    """After 10 steps a second group joins (another lr, no weight decay): its state starts
    fresh, its step count from 0, the first group's continues."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, ref[:2], ours[:2])
    util.train_both(topt, sopt, ref, ours, 10)
    extra = {"lr": 3e-3, "weight_decay": 0.0}
    topt.add_param_group({"params": ref[2:], **extra})
    sopt.add_param_group({"params": ours[2:], **extra})
    util.assert_groups_match(sopt, topt)
    util.train_both(topt, sopt, ref, ours, 20, start=10)
    util.assert_state_close(sopt, topt)


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 0.02], total_steps=STEPS + 1),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1.0 + epoch)),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1)),
])
def test_lr_scheduler_every_step(util, sched, name, kwargs):
    """A scheduler stepping after every optimizer step (OneCycleLR also cycles SGD's
    momentum and Adam's and NAdam's beta1 in the groups, and NAdam's mu_product takes each
    step's own): the same lrs, the same weights, the same state."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, two_groups(ref), two_groups(ours))
    tsched, ssched = SCHEDULERS[sched](topt), SCHEDULERS[sched](sopt)
    for step in range(STEPS):
        util.step_both(topt, sopt, ref, ours, step, where=sched)
        tsched.step()
        ssched.step()
        assert ssched.get_last_lr() == tsched.get_last_lr()
        util.assert_groups_match(sopt, topt)
    util.assert_state_close(sopt, topt)


def test_nadam_state_saved_under_a_beta1_schedule_continues(util):
    """A torch NAdam state saved in the middle of OneCycleLR (beta1 changed at every step, so
    its mu_product is no closed form of the current beta1) loads into stepfuse.torch's NAdam
    and continues as torch's does; and the other way round."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair("NAdam", dict(lr=1e-2), two_groups(ref), two_groups(ours))
    tsched, ssched = SCHEDULERS["OneCycleLR"](topt), SCHEDULERS["OneCycleLR"](sopt)
    for step in range(6):
        util.step_both(topt, sopt, ref, ours, step)
        tsched.step()
        ssched.step()
    # torch's state into a fresh stepfuse optimizer (on the same weights), and ours into torch.
    ours2 = util.clone_params(ref)
    ref2 = util.clone_params(ours)
    sopt2 = sft.NAdam(two_groups(ours2), lr=1e-2)
    topt2 = torch.optim.NAdam(two_groups(ref2), lr=1e-2)
    # (deep copies: a loaded state dict's tensors are the saving optimizer's own, in torch too)
    sopt2.load_state_dict(copy.deepcopy(topt.state_dict()))
    topt2.load_state_dict(copy.deepcopy(sopt.state_dict()))
    util.assert_state_close(sopt2, topt)
    for step in range(6, 12):
        for opt in (topt, sopt2, topt2):
            for g in opt.param_groups:
                g["betas"] = (0.85 + 0.02 * (step % 4), g["betas"][1])
        util.step_both(topt, sopt2, ref, ours2, step, where="torch's state in stepfuse")
        grads = util.make_grads(ref2, step)
        topt2.zero_grad(set_to_none=True)
        util.set_grads(ref2, grads)
        topt2.step()
        util.assert_params_close(ref2, ref, where=f"step {step}: stepfuse's state in torch:")
    util.assert_state_close(sopt2, topt)


def test_nadam_mu_product_right_after_a_beta1_change(util):
    """betas changed by hand after some steps: state_dict() before the next step still holds
    the product of the steps taken (with the old beta1), and a step that re-plans (a param
    without a gradient) continues from it, as torch's does."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair("NAdam", dict(lr=1e-2), two_groups(ref), two_groups(ours))
    for step in range(3):
        util.step_both(topt, sopt, ref, ours, step)
    for opt in (topt, sopt):
        for g in opt.param_groups:
            g["betas"] = (0.5, 0.999)
    util.assert_state_close(sopt, topt)
    for step in range(3, 7):
        util.step_both(topt, sopt, ref, ours, step, skip=(0,) if step == 3 else ())
        util.assert_state_close(sopt, topt)


def test_nadam_params_that_skipped_different_steps_keep_their_own_mu_product(util):
    """beta1 changed between steps in which the params did not all have gradients: each
    param's mu_product is the product of the mu_t of its own steps, as in torch, also once
    their step counts meet again (an engine group carries one product: such params get
    groups of their own)."""
    ref = util.make_params(shapes=[(40,), (30,)])
    ours = util.clone_params(ref)
    topt, sopt = pair("NAdam", dict(lr=0.1), ref, ours)
    # (params without a gradient, beta1) per step
    plan = [((), 0.9), ((1,), 0.5), ((0,), 0.9), ((), 0.9), ((), 0.7), ((1,), 0.9), ((0,), 0.8), ((), 0.9)]
    for step, (skip, beta1) in enumerate(plan):
        for opt in (topt, sopt):
            opt.param_groups[0]["betas"] = (beta1, 0.999)
        util.step_both(topt, sopt, ref, ours, step, skip=skip)
        for i in range(2):
            if ours[i] in sopt.state:
                torch.testing.assert_close(sopt.state[ours[i]]["mu_product"], topt.state[ref[i]]["mu_product"],
                                           rtol=3e-7, atol=0, msg=lambda m, i=i: f"step {step}, param {i}: {m}")
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("name,kwargs,change", [
    ("NAdam", dict(betas=[0.9, 0.999]), lambda g, step: g.__setitem__("betas", [0.5 + 0.05 * step, 0.99])),
    ("Rprop", dict(etas=[0.5, 1.2]), lambda g, step: g["etas"].__setitem__(1, 1.1 + 0.1 * step)),
    ("Adamax", dict(betas=[0.9, 0.999]), lambda g, step: g["betas"].__setitem__(0, 0.8 - 0.05 * step)),
    ("SGD", dict(momentum=0.5), lambda g, step: g.__setitem__("lr", np.float32(0.01 * (step + 1)))),
    ("AdamW", {}, lambda g, step: g.__setitem__("weight_decay", np.float64(0.1 * step))),
], ids=["NAdam-list-replaced", "Rprop-list-mutated", "Adamax-list-mutated", "SGD-np.float32", "AdamW-np.float64"])
def test_hyperparameters_as_lists_and_numpy_scalars_take_effect(util, name, kwargs, change):
    """A hyperparameter given as a list (replaced, or changed in place) or set to a NumPy
    scalar between steps: the next step uses its new value, as torch's does."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, ref, ours)
    util.train_both(topt, sopt, ref, ours, 6,
                    on_step=lambda step: [change(opt.param_groups[0], step) for opt in (topt, sopt)])
    util.assert_state_close(sopt, topt)


def test_state_saved_for_params_of_other_shapes_is_an_error(util):
    """A state dict saved for params of other shapes (given in another order, say): torch's
    next step fails on it; ours is a RuntimeError naming both shapes, and nothing is
    stepped."""
    a = util.make_params(shapes=[(3,), (5,)])
    src = sft.Adam(a, lr=0.1)
    for step in range(2):
        util.set_grads(a, util.make_grads(a, step))
        src.step()
    b = util.make_params(shapes=[(5,), (3,)], seed=3)
    opt = sft.Adam(b, lr=0.1)
    opt.load_state_dict(src.state_dict())
    util.set_grads(b, util.make_grads(b, 0))
    before = util.snapshot(b)
    with pytest.raises(RuntimeError, match=r"shape \(5,\) has shape \(3,\)"):
        opt.step()
    util.assert_params_equal(b, before)


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_hand_set_hyperparameters_take_effect_at_next_step(util, name):
    """group["lr"] (and weight_decay, where the optimizer has it) written between steps,
    for one group only: the next step uses them, as torch's does (ASGD's eta, Adagrad's
    decayed lr, ... included)."""
    tsig = inspect.signature(getattr(torch.optim, name).__init__).parameters
    kwargs = {"weight_decay": 1e-2} if "weight_decay" in tsig else {}
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, two_groups(ref), two_groups(ours))

    def change(step):
        for opt in (topt, sopt):
            if step == 8:
                opt.param_groups[0]["lr"] *= 0.3
            if step == 15 and "weight_decay" in kwargs:
                opt.param_groups[1]["weight_decay"] = 5e-2
            if step == 20:
                opt.param_groups[1]["lr"] = 2.5 * opt.param_groups[1]["lr"]

    util.train_both(topt, sopt, ref, ours, 25, on_step=change, where=name)
    util.assert_state_close(sopt, topt)
    util.assert_groups_match(sopt, topt)


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_flags_changed_mid_training(util, name):
    """maximize switched on for one group between steps (and, for SGD, momentum switched on
    with nesterov, which changes the update program): torch reads the group at every step,
    and so must we."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, {}, two_groups(ref), two_groups(ours))

    def change(step):
        for opt in (topt, sopt):
            if step == 7:
                opt.param_groups[1]["maximize"] = True
            if step == 12 and name == "SGD":
                opt.param_groups[0]["momentum"] = 0.9
                opt.param_groups[0]["nesterov"] = True

    util.train_both(topt, sopt, ref, ours, 20, on_step=change, where=name)
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("name,kwargs,key,values", [
    ("SGD", dict(momentum=0.9), "momentum", [0.9, 0.0, 0.0, 0.5]),
    ("SGD", dict(momentum=0.9, dampening=0.3), "momentum", [0.9, 0.0, 0.7]),
    ("RMSprop", dict(momentum=0.9), "momentum", [0.9, 0.0, 0.5]),
    ("RMSprop", dict(centered=True), "centered", [True, False, True]),
    ("Adam", dict(amsgrad=True), "amsgrad", [True, False, True]),
], ids=["SGD-momentum", "SGD-dampening", "RMSprop-momentum", "RMSprop-centered", "Adam-amsgrad"])
def test_a_buffer_outlives_its_flag_switched_off(util, name, kwargs, key, values):
    """A flag switched off and on again (momentum to 0 and back, centered, amsgrad): torch
    leaves the buffer the flag uses in the state meanwhile and goes on from it; so must we
    (a re-plan for another update program must not drop it)."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, dict(lr=1e-2, **kwargs), ref, ours)
    step = 0
    for value in values:
        for opt in (topt, sopt):
            opt.param_groups[0][key] = value
        for _ in range(3):
            util.step_both(topt, sopt, ref, ours, step, where=f"{key}={value}:")
            step += 1
        util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("name,kwargs", [("AdamW", dict(weight_decay=0.1)), ("SGD", dict(momentum=0.9))])
def test_tensor_lr_changed_in_place(util, name, kwargs):
    """lr given as a 0-dim tensor (torch accepts one) and changed in place with fill_()."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    tlr, slr = torch.tensor(1e-2), torch.tensor(1e-2)
    topt = getattr(torch.optim, name)(ref, lr=tlr, **kwargs)
    sopt = getattr(sft, name)(ours, lr=slr, **kwargs)

    def change(step):
        if step == 6:
            tlr.fill_(3e-3)
            slr.fill_(3e-3)

    util.train_both(topt, sopt, ref, ours, 12, on_step=change)
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("name,kwargs", [("Adam", dict(lr=1e-2)), ("AdamW", dict(lr=1e-2, amsgrad=True))])
def test_tensor_betas_changed_in_place(util, name, kwargs):
    """betas given as two 0-dim tensors (torch accepts them) and changed in place: the next
    step uses the new values (the lr stays a float, so nothing else changes the group)."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    tbetas, sbetas = (torch.tensor(0.9), torch.tensor(0.999)), (torch.tensor(0.9), torch.tensor(0.999))
    topt = getattr(torch.optim, name)(ref, betas=tbetas, **kwargs)
    sopt = getattr(sft, name)(ours, betas=sbetas, **kwargs)

    def change(step):
        if step in (4, 9):
            for b1, b2 in (tbetas, sbetas):
                b1.mul_(0.8)
                b2.mul_(0.99)

    util.train_both(topt, sopt, ref, ours, 14, on_step=change)
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("sched", ["StepLR", "LambdaLR", "CosineAnnealingLR"])
def test_asgd_eta_per_param_under_a_scheduler(util, sched):
    """torch's ASGD keeps each param's eta, computed at that param's own last step from the
    lr of that step: a param without a gradient at some steps while a scheduler moves the lr
    keeps its own eta, and state[p]["eta"] is the one the next step uses (not one from the
    lr the scheduler has set since)."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    kwargs = dict(lr=0.05, lambd=0.1, t0=4)
    topt, sopt = pair("ASGD", kwargs, ref, ours)
    tsched, ssched = SCHEDULERS[sched](topt), SCHEDULERS[sched](sopt)
    for step in range(20):
        skip = (0,) if step in (3, 5, 11) else (2,) if step == 7 else ()
        util.step_both(topt, sopt, ref, ours, step, skip=skip, where=sched)
        tsched.step()
        ssched.step()
        util.assert_state_close(sopt, topt)


# ---- fused clipping ------------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", dict(lr=1e-2)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("Adagrad", dict(lr=0.05)),
])
def test_fused_clip_matches_clip_grad_norm(util, name, kwargs, norm_type):
    """max_grad_norm=1.0 against torch.nn.utils.clip_grad_norm_ over every group's params
    followed by torch's step; every third step the gradients are small enough not to be
    clipped. last_grad_norm is what clip_grad_norm_ returned: a 0-dim float32 tensor."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(two_groups(ref), **kwargs)
    sopt = getattr(sft, name)(two_groups(ours), max_grad_norm=1.0, norm_type=norm_type, **kwargs)
    for step in range(STEPS):
        scale = 1e-3 if step % 3 == 0 else 1.0
        grads = util.make_grads(ref, step, scale=scale)
        topt.zero_grad(set_to_none=True)
        sopt.zero_grad(set_to_none=True)
        util.set_grads(ref, grads)
        util.set_grads(ours, grads)
        total = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type)
        assert (float(total) < 1.0) == (step % 3 == 0)  # the test clips where it means to
        topt.step()
        sopt.step()
        norm = sopt.last_grad_norm
        assert torch.is_tensor(norm) and norm.dim() == 0 and norm.dtype == torch.float32
        torch.testing.assert_close(norm, total, msg=lambda m: f"step {step}: last_grad_norm: {m}")
        util.assert_params_close(ours, ref, where=f"step {step}:")
        for p, g in zip(ours, grads):
            assert torch.equal(p.grad, g), "the fused clip wrote the gradients"
    util.assert_state_close(sopt, topt)


def test_fused_clip_skips_params_without_grad(util):
    """The norm is over the params that have a gradient, as clip_grad_norm_'s."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2)
    sopt = sft.AdamW(ours, lr=1e-2, max_grad_norm=1.0)
    for step in range(10):
        grads = util.make_grads(ref, step)
        skip = {1} if step % 2 else set()
        util.set_grads(ref, grads, skip)
        util.set_grads(ours, grads, skip)
        total = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        topt.step()
        sopt.step()
        torch.testing.assert_close(sopt.last_grad_norm, total)
        util.assert_params_close(ours, ref, where=f"step {step}:")


# ---- f16/bf16 weights with fp32 masters ------------------------------------------------------

LOW_PRECISION = [torch.bfloat16, torch.float16]
# The state key our fp32 master copy of an f16/bf16 param may have (torch has none).
MASTER_KEYS = ("master_param",)


def _write_weight(params, how, values):
    """Writes `values` into params[0] from outside the optimizer, as a user would."""
    p = params[0]
    with torch.no_grad():
        if how == "copy_":  # model.load_state_dict does this
            p.copy_(values)
        elif how == "zero_":
            p.zero_()
        else:  # new storage
            p.data = values.clone()


@pytest.mark.parametrize("how", ["copy_", "zero_", "data="])
@pytest.mark.parametrize("mode", ["masters", "compensated"])
def test_low_precision_weights_written_from_outside(util, mode, how):
    """bf16 weights with an fp32 master (or a compensation), written between steps from
    outside the optimizer (a reloaded model, a pruning mask, p.data = ...): as for torch,
    the next step goes on from the written weight. Its master becomes the weight (its
    compensation 0); the rest of the state is kept. The reference is a second optimizer
    loaded with that state and stepping the written weights: bitwise the same."""
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    if mode == "compensated":
        kwargs.update(master_weights=False, compensated_weights=True)
    ours = util.make_params(dtype=torch.bfloat16)
    opt = sft.AdamW(ours, **kwargs)
    for step in range(3):
        util.set_grads(ours, util.make_grads(ours, step))
        opt.step()
    written = (torch.randn(ours[0].shape) * 0.1).to(torch.bfloat16)
    _write_weight(ours, how, written)
    if how == "zero_":
        written = torch.zeros_like(written)
    state = copy.deepcopy(opt.state_dict())
    key = "master_param" if mode == "masters" else "compensation"
    assert key in state["state"][0]
    state["state"][0][key] = written.float() if mode == "masters" else torch.zeros_like(written)
    twin = util.clone_params(ours)
    topt = sft.AdamW(twin, **kwargs)
    topt.load_state_dict(state)
    util.step_equal(opt, topt, ours, twin, range(3, 6))
    util.assert_state_equal(opt.state_dict()["state"], topt.state_dict()["state"])
    # The resume order model.load_state_dict(...) then opt.load_state_dict(...): the loaded
    # masters (compensations) are kept, not replaced by the written weights.
    _write_weight(ours, "copy_", twin[0].detach())
    opt.load_state_dict(topt.state_dict())
    grads = util.make_grads(ours, 6)
    util.set_grads(ours, grads)
    util.set_grads(twin, grads)
    opt.step()
    topt.step()
    util.assert_params_equal(ours, twin, where="after the load:")
    util.assert_state_equal(opt.state_dict()["state"], topt.state_dict()["state"])


@pytest.mark.parametrize("case", ["saved after the write", "param without a gradient at the last step",
                                  "written after a load", "a skipped step between write and save"])
@pytest.mark.parametrize("mode", ["masters", "compensated"])
def test_low_precision_weight_writes_are_never_lost(util, mode, case):
    """A bf16 weight written from outside (here: filled with 1.0) is where the next step goes
    on in every order of events: written and then saved (the checkpoint's master is the
    written weight), written while the param had no gradient, written after the optimizer
    loaded a state dict, written before a step the scaler skipped. The step after it moves
    the weight by about lr, from 1.0."""
    lr = 1e-2
    kwargs = dict(lr=lr, weight_decay=0.0)
    if mode == "compensated":
        kwargs.update(master_weights=False, compensated_weights=True)
    params = util.make_params(shapes=[(64,), (32,)], dtype=torch.bfloat16)
    opt = sft.AdamW(params, **kwargs)
    for step in range(4):
        util.set_grads(params, util.make_grads(params, step))
        opt.step()
    a, b = params
    if case == "param without a gradient at the last step":
        util.set_grads(params, util.make_grads(params, 4), skip={1})
        opt.step()
    if case == "written after a load":
        saved = util.save_load(opt.state_dict())
        opt = sft.AdamW(params, **kwargs)
        opt.load_state_dict(saved)
    with torch.no_grad():
        b.fill_(1.0)
    if case == "a skipped step between write and save":
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))
        util.set_grads(params, util.make_grads(params, 5))
        a.grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
    if case in ("saved after the write", "a skipped step between write and save"):
        saved = util.save_load(opt.state_dict())
        params = util.clone_params(params)
        a, b = params
        opt = sft.AdamW(params, **kwargs)
        opt.load_state_dict(saved)
    # What the step will go on from: a master equal to the written weight, no compensation.
    st = opt.state_dict()["state"][1]
    if mode == "masters":
        assert torch.equal(st["master_param"], torch.ones(32)), case
    else:
        assert not st["compensation"].any(), case
    util.set_grads(params, util.make_grads(params, 6))
    opt.step()
    moved = (b.detach().float() - 1.0).abs().max().item()
    assert moved <= 2 * lr, f"{case}: the weight is {moved} from the 1.0 written (a step moves it by about lr)"


def test_a_mask_written_every_step_keeps_the_other_masters(util):
    """bf16 weights with fp32 masters and a pruning mask applied after every step
    (`p.mul_(mask)` under no_grad): the masked elements take the written 0, and the others
    keep their fp32 masters, updates below half a bf16 ulp included. The reference is
    torch's AdamW on an fp32 copy, masked the same way: ours is it rounded to bf16."""
    ours = util.make_params(dtype=torch.bfloat16)
    ref = util.clone_params(ours, dtype=torch.float32)
    masks = [(torch.rand(p.shape, generator=torch.Generator().manual_seed(i)) > 0.3) for i, p in enumerate(ours)]
    topt, sopt = torch.optim.AdamW(ref, lr=1e-4), sft.AdamW(ours, lr=1e-4)
    for step in range(20):
        grads = util.make_grads(ours, step)
        util.set_grads(ours, grads)
        util.set_grads(ref, [g.float() for g in grads])
        topt.step()
        sopt.step()
        with torch.no_grad():
            for params in (ours, ref):
                for p, m in zip(params, masks):
                    p.mul_(m)
        util.assert_rounded_from(ours, ref, where=f"step {step}:")


def test_a_copied_optimizer_takes_weights_written_after_the_copy(util):
    """copy.deepcopy of an optimizer with fp32 masters, then a weight written into the
    copy's params: the copy's next step goes on from the written weight."""
    ours = util.make_params(shapes=[(64,)], dtype=torch.bfloat16)
    opt = sft.AdamW(ours, lr=1e-2)
    for step in range(3):
        util.set_grads(ours, util.make_grads(ours, step))
        opt.step()
    twin = copy.deepcopy(opt)
    p = twin.param_groups[0]["params"][0]
    with torch.no_grad():
        p.fill_(1.0)
    p.grad = util.make_grads(ours, 3)[0]
    twin.step()
    assert (p.detach().float() - 1.0).abs().max().item() <= 2e-2


def test_resume_loading_the_optimizer_before_the_model_keeps_the_masters(util):
    """Resuming with opt.load_state_dict() before the model's weights are loaded: the loaded
    weights are the loaded masters rounded, so the masters are kept and the run goes on
    bitwise as the uninterrupted one."""
    ours = util.make_params(dtype=torch.bfloat16)
    opt = sft.AdamW(ours, lr=1e-3)
    for step in range(3):
        util.set_grads(ours, util.make_grads(ours, step))
        opt.step()
    saved_weights = util.snapshot(ours)
    saved = util.save_load(opt.state_dict())
    resumed = util.make_params(dtype=torch.bfloat16, seed=5)
    ropt = sft.AdamW(resumed, lr=1e-3)
    ropt.load_state_dict(saved)
    with torch.no_grad():
        for p, w in zip(resumed, saved_weights):
            p.copy_(w)
    util.step_equal(opt, ropt, ours, resumed, range(3, 6))


def test_compiled_step(util):
    """opt.step() inside a torch.compile'd function, from the first step on (the step is the
    library's: torch.compile runs it rather than tracing it), as torch's own."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = torch.optim.AdamW(ref, lr=1e-2), sft.AdamW(ours, lr=1e-2)
    tstep = torch.compile(lambda: topt.step(), backend="eager")
    sstep = torch.compile(lambda: sopt.step(), backend="eager")
    for step in range(3):
        grads = util.make_grads(ref, step)
        util.set_grads(ref, grads, skip={1} if step == 1 else ())
        util.set_grads(ours, grads, skip={1} if step == 1 else ())
        tstep()
        sstep()
        util.assert_params_close(ours, ref, where=f"step {step}:")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("name,kwargs", [
    ("AdamW", dict(lr=1e-3, weight_decay=0.1)),
    ("SGD", dict(lr=1e-3, momentum=0.9)),
    ("Adagrad", dict(lr=1e-3)),
])
def test_low_precision_params_with_fp32_masters(util, dtype, name, kwargs):
    """f16/bf16 weights and gradients, master_weights=True (the default): the reference is
    torch's optimizer stepping an fp32 copy of the weights on the fp32 values of the same
    gradients; ours must be that fp32 copy rounded to the weights' format. The updates are
    mostly below half an ulp of the narrow format, so without fp32 masters the weights
    would not follow."""
    ours = util.make_params(dtype=dtype)
    ref = util.clone_params(ours, dtype=torch.float32)
    topt = getattr(torch.optim, name)(ref, **kwargs)
    sopt = getattr(sft, name)(ours, **kwargs)
    for step in range(STEPS):
        grads = util.make_grads(ours, step)  # in the weights' format
        util.set_grads(ours, grads)
        util.set_grads(ref, [g.float() for g in grads])
        topt.step()
        sopt.step()
        for p in ours:
            assert p.dtype == dtype
        util.assert_rounded_from(ours, ref, where=f"step {step}:")
    # the state is fp32, as torch's for the fp32 copy; fp32 masters in the state, if there,
    # are the reference's weights
    util.assert_state_close(sopt, topt, extra_keys=MASTER_KEYS)
    state = sopt.state_dict()["state"]
    for i, r in enumerate(ref):
        for k in set(MASTER_KEYS) & set(state[i]):
            torch.testing.assert_close(state[i][k], r.detach(), msg=lambda m: f"state[{i}][{k!r}]: {m}")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_low_precision_params_without_masters(util, dtype):
    """master_weights=False: each step computes in fp32 from the stored f16/bf16 weights and
    rounds the result back; the state stays fp32. Checked one step at a time: the
    reference starts every step from our stored weights."""
    ours = util.make_params(dtype=dtype)
    ref = util.clone_params(ours, dtype=torch.float32)
    topt = torch.optim.AdamW(ref, lr=1e-2)
    sopt = sft.AdamW(ours, lr=1e-2, master_weights=False)
    for step in range(STEPS):
        grads = util.make_grads(ours, step)
        util.set_grads(ours, grads)
        util.set_grads(ref, [g.float() for g in grads])
        topt.step()
        sopt.step()
        util.assert_rounded_from(ours, ref, where=f"step {step}:")
        with torch.no_grad():
            for r, p in zip(ref, ours):
                r.copy_(p.float())
    util.assert_state_close(sopt, topt)  # no master copies


def test_mixed_dtypes_in_one_optimizer(util):
    """bf16 and f16 matrices beside fp32 vectors in one optimizer (two groups): the fp32
    params follow torch's run exactly as in the fp32 tests, the 16-bit ones are torch's
    fp32 run rounded."""
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float16]
    base = util.make_params()
    ours = [torch.nn.Parameter(p.detach().to(d)) for p, d in zip(base, dtypes)]
    ref = util.clone_params(ours, dtype=torch.float32)
    topt, sopt = pair("AdamW", dict(lr=1e-3, weight_decay=0.1), two_groups(ref), two_groups(ours))
    for step in range(STEPS):
        grads = util.make_grads(ours, step)
        util.set_grads(ours, grads)
        util.set_grads(ref, [g.float() for g in grads])
        topt.step()
        sopt.step()
        util.assert_params_close([ours[0], ours[2]], [ref[0], ref[2]], where=f"step {step}:")
        util.assert_rounded_from([ours[1], ours[3]], [ref[1], ref[3]], where=f"step {step}:")
    util.assert_state_close(sopt, topt, extra_keys=MASTER_KEYS)


# ---- params without gradients -------------------------------------------------------------

@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_params_without_grad_are_skipped(util, name):
    """Param 3 never has a gradient (never moves, gets no state); param 1 has none at steps
    6 to 13 (its weights and state stay bitwise as they were, its step count stops) and
    then gets one again: torch's behaviour throughout. (torch's Adagrad makes every
    param's state at construction: test_adagrad_state_from_construction checks that.)"""
    kwargs = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair(name, kwargs, ref, ours)
    frozen_w = frozen_state = None
    for step in range(24):
        skip = {1, 3} if 6 <= step <= 13 else {3}
        util.step_both(topt, sopt, ref, ours, step, skip=skip, where=name)
        assert torch.equal(ours[3], ref[3].detach())
        if step == 6:
            frozen_w = ours[1].detach().clone()
            frozen_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in sopt.state[ours[1]].items()}
        if 6 <= step <= 13:
            assert torch.equal(ours[1], frozen_w), f"step {step}: a param without a gradient moved"
            for k, v in frozen_state.items():
                now = sopt.state[ours[1]][k]
                assert torch.equal(now, v) if torch.is_tensor(v) else now == v, f"step {step}: state {k!r} changed"
    ssd, tsd = sopt.state_dict()["state"], topt.state_dict()["state"]
    if name == "Adagrad":
        ssd, tsd = ({i: v for i, v in sd.items() if i != 3} for sd in (ssd, tsd))
    util.assert_state_close(ssd, tsd)


def test_rprop_nan_gradient_moves_nothing_as_torch():
    """torch.sign(NaN) is 0: a NaN gradient element leaves its weight and step size as they
    were in torch's Rprop (and is kept as prev, which the next step's sign reads as 0)."""
    ref = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.25]))
    ours = torch.nn.Parameter(ref.detach().clone())
    topt, sopt = torch.optim.Rprop([ref], lr=0.01), sft.Rprop([ours], lr=0.01)
    nan = float("nan")
    for grad in ([1.0, 1.0, -1.0, 1.0], [nan, 1.0, nan, -1.0], [1.0, 1.0, 1.0, -1.0], [1.0, -1.0, 1.0, nan]):
        for p, opt in ((ref, topt), (ours, sopt)):
            p.grad = torch.tensor(grad)
            opt.step()
        torch.testing.assert_close(ours.detach(), ref.detach(), equal_nan=False)
        for key in ("prev", "step_size"):
            torch.testing.assert_close(sopt.state[ours][key], topt.state[ref][key], equal_nan=True)


def test_adagrad_initial_accumulator_value_is_the_constructors(util):
    """torch's Adagrad fills every "sum" with the constructor's initial_accumulator_value: a
    group's own value is not read, at construction nor for a group added later."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    groups = lambda ps: [{"params": [ps[0]], "initial_accumulator_value": 2.0}, {"params": [ps[1]]}]
    topt = torch.optim.Adagrad(groups(ref), lr=0.1, initial_accumulator_value=0.5)
    sopt = sft.Adagrad(groups(ours), lr=0.1, initial_accumulator_value=0.5)
    util.assert_state_equal(sopt.state_dict()["state"], topt.state_dict()["state"])
    util.train_both(topt, sopt, ref, ours, 2, skip={2, 3})
    for opt, ps in ((topt, ref), (sopt, ours)):
        opt.add_param_group({"params": [ps[2], ps[3]], "initial_accumulator_value": 3.0})
    util.train_both(topt, sopt, ref, ours, 3, start=2)
    util.assert_state_close(sopt, topt)


def test_adagrad_state_from_construction(util):
    """torch's Adagrad makes every param's state (step 0, sum = initial_accumulator_value)
    in its constructor, so its state_dict has it before any step and for params that never
    get a gradient."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    kwargs = dict(lr=0.05, initial_accumulator_value=0.1)
    topt, sopt = pair("Adagrad", kwargs, ref, ours)
    util.assert_state_equal(sopt.state_dict()["state"], topt.state_dict()["state"])
    for step in range(3):
        util.step_both(topt, sopt, ref, ours, step, skip={2})
    util.assert_state_close(sopt, topt)


# ---- step(closure), zero_grad ---------------------------------------------------------------

def test_step_with_closure_returns_its_loss(util):
    """step(closure) calls the closure with grad enabled (even under no_grad), steps on
    the gradients it computed and returns its loss, as torch's does; step() returns None."""
    x = torch.randn(8, 64)
    ref = util.make_params([(64, 4), (4,)])
    ours = util.clone_params(ref)
    topt, sopt = pair("AdamW", dict(lr=1e-2), ref, ours)

    def closure_for(opt, params):
        seen = {}

        def closure():
            seen["grad_enabled"] = torch.is_grad_enabled()
            opt.zero_grad()
            loss = ((x @ params[0] + params[1]) ** 2).mean()
            loss.backward()
            seen["loss"] = loss
            return loss

        return closure, seen

    for step in range(5):
        tclosure, tseen = closure_for(topt, ref)
        sclosure, sseen = closure_for(sopt, ours)
        with torch.no_grad():
            tloss = topt.step(tclosure)
            sloss = sopt.step(sclosure)
        assert sseen["grad_enabled"] and tseen["grad_enabled"]
        assert sloss is sseen["loss"]
        torch.testing.assert_close(sloss, tloss)
        util.assert_params_close(ours, ref, where=f"closure step {step}:")
    util.set_grads(ours, util.make_grads(ours, 0))
    assert sopt.step() is None


def test_zero_grad(util):
    ours = util.make_params()
    opt = sft.SGD(ours, lr=0.1)
    util.set_grads(ours, util.make_grads(ours, 0))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in ours)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)


def test_param_storage_replaced_between_steps(util):
    """p.data = <another tensor> between steps (same values, new storage): torch steps the
    param's current storage, so the new one must get the updates."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair("AdamW", dict(lr=1e-2), ref, ours)
    util.train_both(topt, sopt, ref, ours, 3)
    for params in (ref, ours):
        params[1].data = params[1].data.clone()
    util.train_both(topt, sopt, ref, ours, 5, start=3)
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("layout", ["reused in place", "views of one flat buffer"])
def test_grad_buffers(util, layout):
    """Gradients that are not fresh tensors: the same .grad tensors overwritten in place
    every step (zero_grad(set_to_none=False), then accumulation), or views into one flat
    buffer (as DDP's gradient buckets), rewritten in place every step."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair("AdamW", dict(lr=1e-2), ref, ours)
    flat = torch.zeros(sum(p.numel() for p in ours))
    views, offset = [], 0
    for p in ours:
        views.append(flat[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    for p, v in zip(ours, views):
        p.grad = v if layout != "reused in place" else torch.zeros_like(p)
    held = [p.grad for p in ours]
    for step in range(10):
        sopt.zero_grad(set_to_none=False)
        grads = util.make_grads(ref, step)
        util.set_grads(ref, grads)
        for p, g in zip(ours, grads):
            p.grad.add_(g)
        topt.step()
        sopt.step()
        assert all(p.grad is h for p, h in zip(ours, held))
        util.assert_params_close(ours, ref, where=f"{layout} step {step}:")
    util.assert_state_close(sopt, topt)


def test_step_without_any_grad_does_nothing(util):
    """No param has a gradient: step() returns None and changes nothing, before the first
    real step and after some."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = pair("AdamW", dict(lr=1e-2), ref, ours)
    before = util.snapshot(ours)
    assert sopt.step() is None
    util.assert_params_equal(ours, before)
    util.assert_state_equal(sopt, topt)
    util.train_both(topt, sopt, ref, ours, 3)
    sopt.zero_grad()
    topt.zero_grad()
    before, before_state = util.snapshot(ours), util.state_snapshot(sopt)
    assert sopt.step() is None
    util.assert_params_equal(ours, before)
    util.assert_state_equal(sopt, before_state)
    util.train_both(topt, sopt, ref, ours, 3, start=3)


def test_zero_grad_frees_the_gradients_at_once():
    """After zero_grad(set_to_none=True) nothing keeps the old gradients alive: the engine
    holds no reference to them (only their addresses until the next step re-points it)."""
    import weakref

    params = [torch.randn(1000, requires_grad=True) for _ in range(3)]
    opt = sft.AdamW(params, lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(1000)
        opt.step()
        refs = [weakref.ref(p.grad) for p in params]
        opt.zero_grad(set_to_none=True)
        assert all(r() is None for r in refs)
