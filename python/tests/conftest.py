"""Shared helpers for the stepfuse.torch tests (test_torch_*.py).

The tests compare stepfuse.torch with PyTorch itself: the same starting weights are
copied for torch.optim's optimizer and for ours, both get the same fresh gradients at
every step (as autograd gives them after ``zero_grad(set_to_none=True)``), and the
weights and state are compared. The helpers live here and reach the tests through the
``util`` fixture (this module), so the test files import nothing from the test folder.

Without torch every helper is unavailable and the torch test files skip themselves
(``pytest.importorskip("torch")``); the other tests are unaffected.
"""

import copy
import io
import math
import sys

import pytest

try:
    import torch
except ImportError:  # the torch tests skip themselves
    torch = None

# The tensors most tests train: a tiny one, a matrix, a vector, and one over
# 16384 elements (so a tensor spans several of the library's chunks).
SHAPES = [(3,), (31, 17), (64,), (129, 130)]

# torch.optim's optimizers that stepfuse.torch replaces, and the two it adds.
TORCH_OPTIMIZERS = [
    "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax",
    "Adadelta", "Rprop", "ASGD",
]
EXTRA_OPTIMIZERS = ["Lion", "LAMB"]


@pytest.fixture
def util():
    """This module: the helpers below."""
    return sys.modules[__name__]


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same global RNG state."""
    if torch is not None:
        torch.manual_seed(0)


# ---- tensors ---------------------------------------------------------------------------

def make_params(shapes=SHAPES, dtype=None, seed=0, device="cpu"):
    """Fresh leaf parameters with seeded N(0, 1) values (made in fp32, then converted)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype or torch.float32))
        for s in shapes
    ]


def clone_params(params, dtype=None):
    """Independent parameters with the same values (optionally converted)."""
    return [torch.nn.Parameter(p.detach().clone().to(dtype=dtype or p.dtype)) for p in params]


def make_grads(params, step, seed=1, scale=1.0, dtype=None):
    """The gradients of step `step`: seeded N(0, scale^2), one per param, in the param's
    dtype (or `dtype`) and on its device. The same (step, seed) always gives the same values."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen) * scale
        out.append(g.to(device=p.device, dtype=dtype or p.dtype))
    return out


def set_grads(params, grads, skip=()):
    """p.grad = a fresh copy of its gradient (None for the indices in `skip`)."""
    for i, (p, g) in enumerate(zip(params, grads)):
        p.grad = None if i in skip or g is None else g.detach().clone()


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def state_snapshot(opt):
    """A deep copy of opt.state_dict() (tensors cloned)."""
    return copy.deepcopy(opt.state_dict())


def save_load(obj):
    """obj through torch.save and torch.load (weights_only, torch's default) in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- comparisons -----------------------------------------------------------------------

def assert_params_close(actual, expected, where="", **tol):
    """Each actual param is close to the expected one (torch.testing.assert_close,
    default tolerances unless given)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.detach(), e.detach(), msg=lambda m, i=i: f"{where} param {i}: {m}", **tol)


def assert_params_equal(actual, expected, where=""):
    """Bitwise equal (torch.equal): for what must be untouched."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert torch.equal(a.detach(), e.detach()), f"{where} param {i} changed"


def _compare_values(a, e, path, tensors_equal, tol):
    if torch.is_tensor(e):
        assert torch.is_tensor(a), f"{path}: {type(a).__name__}, expected a tensor"
        assert a.dtype == e.dtype and a.shape == e.shape, (
            f"{path}: {a.dtype} {tuple(a.shape)}, expected {e.dtype} {tuple(e.shape)}")
        if tensors_equal:
            assert torch.equal(a.cpu(), e.cpu()), f"{path}: changed"
        else:
            torch.testing.assert_close(a.cpu(), e.cpu(), msg=lambda m: f"{path}: {m}", **tol)
    elif isinstance(e, dict):
        assert isinstance(a, dict), f"{path}: {type(a).__name__}, expected a dict"
        assert set(a) == set(e), f"{path}: keys {sorted(map(str, a))}, expected {sorted(map(str, e))}"
        for k in e:
            _compare_values(a[k], e[k], f"{path}[{k!r}]", tensors_equal, tol)
    elif isinstance(e, (list, tuple)):
        assert isinstance(a, (list, tuple)) and len(a) == len(e), f"{path}: {a!r}, expected {e!r}"
        for k, (x, y) in enumerate(zip(a, e)):
            _compare_values(x, y, f"{path}[{k}]", tensors_equal, tol)
    elif isinstance(e, float) and isinstance(a, float) and math.isnan(e):
        assert math.isnan(a), f"{path}: {a!r}, expected nan"
    else:
        assert a == e, f"{path}: {a!r}, expected {e!r}"


def assert_state_close(actual, expected, extra_keys=(), **tol):
    """Two optimizers' state_dict()["state"] (or the state dicts themselves) hold the same
    params, the same keys per param (the actual state may also hold `extra_keys`),
    tensors of the same dtype and shape, close values (the step counts compare exactly:
    they are whole numbers)."""
    a = actual if isinstance(actual, dict) else actual.state_dict()
    e = expected if isinstance(expected, dict) else expected.state_dict()
    a, e = a.get("state", a), e.get("state", e)
    assert set(a) == set(e), f"state: params {sorted(a)}, expected {sorted(e)}"
    for i in e:
        keys = set(a[i]) - (set(extra_keys) - set(e[i]))
        assert keys == set(e[i]), f"state[{i}]: keys {sorted(a[i])}, expected {sorted(e[i])}"
        for k in e[i]:
            if k == "step":
                _compare_values(a[i][k], e[i][k], f"state[{i}]['step']", True, {})
            else:
                _compare_values(a[i][k], e[i][k], f"state[{i}][{k!r}]", False, tol)


def assert_state_equal(actual, expected):
    """Two state dicts (or optimizers' state_dict()) are identical: same structure, bitwise
    equal tensors, equal values."""
    a = actual if isinstance(actual, dict) else actual.state_dict()
    e = expected if isinstance(expected, dict) else expected.state_dict()
    _compare_values(a, e, "state_dict", True, {})


def assert_state_untouched(opt, before, where=""):
    """opt's state is bitwise what `before` (a state_snapshot) holds. A param that had no
    state may have got some (torch's fused optimizers, too, make state before deciding to
    skip) only if nothing was written into it: step 0, every buffer one constant."""
    after = opt.state_dict()["state"]
    for i, st in before["state"].items():
        assert i in after, f"{where}: the state of param {i} disappeared"
        _compare_values(after[i], st, f"{where} state[{i}]", True, {})
    for i in set(after) - set(before["state"]):
        for k, v in after[i].items():
            if k == "step":
                assert float(v) == 0, f"{where}: param {i}'s step advanced on a refused or skipped step"
            elif torch.is_tensor(v) and v.numel() > 0:
                assert bool((v == v.reshape(-1)[0]).all()), f"{where}: state[{i}][{k!r}] written on a refused or skipped step"
    if before.get("param_groups") is not None:
        _compare_values(opt.state_dict()["param_groups"], before["param_groups"], f"{where} param_groups", True, {})


def assert_groups_match(actual_opt, expected_opt, ignore=()):
    """Same number of groups, same params per group, and every hyperparameter torch's
    group has equal in ours (ours may hold more keys)."""
    assert len(actual_opt.param_groups) == len(expected_opt.param_groups)
    for gi, (ga, ge) in enumerate(zip(actual_opt.param_groups, expected_opt.param_groups)):
        assert len(ga["params"]) == len(ge["params"]), f"group {gi}: number of params"
        for k, v in ge.items():
            if k == "params" or k in ignore:
                continue
            assert k in ga, f"group {gi}: no {k!r}"
            _compare_values(ga[k], v, f"group {gi}[{k!r}]", True, {})


def ulp(x, dtype):
    """The spacing of `dtype` at |x| (elementwise, in fp32)."""
    info = torch.finfo(dtype)
    x = x.detach().float().abs()
    exponent = torch.floor(torch.log2(torch.clamp(x, min=info.tiny)))
    return torch.exp2(exponent) * info.eps


def assert_rounded_from(actual, expected_fp32, where="", max_mismatch_fraction=0.01):
    """`actual` (f16/bf16) is expected_fp32 rounded to actual's dtype, except where the
    fp32 values ours and torch computed (in a different operation order, so a few fp32
    ulps of the operands apart) straddle a rounding boundary of the narrow format: there
    the two may be one unit in the last place apart (or 1e-6 apart, for results near 0
    that come from a cancellation of operands of order 1: their fp32 noise exceeds the
    narrow format's ulp there), and such elements must be rare."""
    for i, (a, e) in enumerate(zip(actual, expected_fp32)):
        a = a.detach()
        rounded = e.detach().to(a.dtype)
        differ = a != rounded
        if not bool(differ.any()):
            continue
        gap = (a.float() - rounded.float()).abs()[differ]
        allowed = ulp(rounded.float(), a.dtype)[differ] + 1e-6
        assert bool((gap <= allowed).all()), (
            f"{where} param {i}: {int(differ.sum())} elements differ from the rounded reference, "
            f"some by more than one ulp (largest gap {float(gap.max()):.3g})")
        frac = float(differ.float().mean())
        assert frac <= max_mismatch_fraction, (
            f"{where} param {i}: {frac:.2%} of the elements are one ulp off the rounded reference")


# ---- training loops --------------------------------------------------------------------

def step_both(ref_opt, ours_opt, ref, ours, step, *, seed=1, scale=1.0, skip=(), check=True, where="", **tol):
    """One step of both optimizers on the same fresh gradients (after zero_grad), then
    compares the params. Checks that our step did not write the gradients."""
    ref_opt.zero_grad(set_to_none=True)
    ours_opt.zero_grad(set_to_none=True)
    grads = make_grads(ref, step, seed=seed, scale=scale)
    set_grads(ref, grads, skip)
    set_grads(ours, grads, skip)
    ref_opt.step()
    ours_opt.step()
    for i, p in enumerate(ours):
        if p.grad is not None:
            assert torch.equal(p.grad, grads[i].to(p.grad.dtype)), f"step {step}: our step wrote param {i}'s gradient"
    if check:
        assert_params_close(ours, ref, where=f"{where} step {step}:", **tol)


def step_equal(opt, twin_opt, params, twin, steps, where=""):
    """For each step in `steps`: both optimizers on the same fresh gradients, then their
    params bitwise equal (twin's compared to params')."""
    for step in steps:
        grads = make_grads(params, step)
        set_grads(params, grads)
        set_grads(twin, grads)
        opt.step()
        twin_opt.step()
        assert_params_equal(twin, params, where=f"{where} step {step}:")


def train_both(ref_opt, ours_opt, ref, ours, steps, start=0, *, on_step=None, **kw):
    """`steps` steps of step_both (step indices start..start+steps-1); on_step(step) runs
    before each one (to change hyperparameters, say)."""
    for step in range(start, start + steps):
        if on_step is not None:
            on_step(step)
        step_both(ref_opt, ours_opt, ref, ours, step, **kw)
