"""Bad input to stepfuse.torch: the hyperparameters torch.optim refuses are refused with
torch's ValueError (and the values it accepts are accepted), params of a dtype the
library does not support are a TypeError, gradients that do not match their param are
a clear error, and nothing at all is written when anything is refused."""

import pytest

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

# (optimizer, kwargs) that torch.optim's optimizer of that name refuses with ValueError;
# Lion and LAMB: the same conditions on the same names (lr, eps, weight_decay >= 0, betas
# in [0, 1)).
BAD_HYPERPARAMETERS = [
    *[(name, dict(lr=-1e-3)) for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
        "Lion", "LAMB")],
    ("SGD", dict(momentum=-0.1)),
    ("SGD", dict(weight_decay=-1e-2)),
    ("SGD", dict(nesterov=True)),  # nesterov without momentum
    ("SGD", dict(nesterov=True, momentum=0.9, dampening=0.1)),  # nesterov with dampening
    ("Adam", dict(eps=-1e-8)),
    ("Adam", dict(betas=(-0.1, 0.999))),
    ("Adam", dict(betas=(1.0, 0.999))),
    ("Adam", dict(betas=(0.9, 1.0))),
    ("Adam", dict(betas=(0.9, -1e-3))),
    ("Adam", dict(weight_decay=-0.1)),
    ("AdamW", dict(eps=-1e-8)),
    ("AdamW", dict(betas=(1.5, 0.999))),
    ("AdamW", dict(betas=(0.9, 1.0))),
    ("AdamW", dict(weight_decay=-1e-2)),
    ("Adagrad", dict(lr_decay=-1e-2)),
    ("Adagrad", dict(weight_decay=-1e-2)),
    ("Adagrad", dict(initial_accumulator_value=-0.1)),
    ("Adagrad", dict(eps=-1e-10)),
    ("RMSprop", dict(eps=-1e-8)),
    ("RMSprop", dict(momentum=-0.5)),
    ("RMSprop", dict(weight_decay=-1e-2)),
    ("RMSprop", dict(alpha=-0.9)),
    ("NAdam", dict(eps=-1e-8)),
    ("NAdam", dict(betas=(1.0, 0.999))),
    ("NAdam", dict(betas=(0.9, 1.0))),
    ("NAdam", dict(weight_decay=-1e-2)),
    ("NAdam", dict(momentum_decay=-4e-3)),
    ("RAdam", dict(eps=-1e-8)),
    ("RAdam", dict(betas=(-0.5, 0.999))),
    ("RAdam", dict(betas=(0.9, 1.0))),
    ("RAdam", dict(weight_decay=-1e-2)),
    ("Adamax", dict(eps=-1e-8)),
    ("Adamax", dict(betas=(1.0, 0.999))),
    ("Adamax", dict(betas=(0.9, 1.2))),
    ("Adamax", dict(weight_decay=-1e-2)),
    ("Adadelta", dict(rho=-0.1)),
    ("Adadelta", dict(rho=1.1)),
    ("Adadelta", dict(eps=-1e-6)),
    ("Adadelta", dict(weight_decay=-1e-2)),
    ("Rprop", dict(etas=(1.2, 0.5))),
    ("Rprop", dict(etas=(0.0, 1.2))),
    ("Rprop", dict(etas=(0.5, 1.0))),
    ("Rprop", dict(etas=(1.0, 1.2))),
    ("ASGD", dict(lambd=-1e-4)),
    ("ASGD", dict(alpha=-0.75)),
    ("ASGD", dict(weight_decay=-1e-2)),
    ("Lion", dict(betas=(1.0, 0.99))),
    ("Lion", dict(betas=(0.9, -0.1))),
    ("Lion", dict(weight_decay=-0.1)),
    ("LAMB", dict(eps=-1e-6)),
    ("LAMB", dict(betas=(0.9, 1.0))),
    ("LAMB", dict(betas=(-0.1, 0.999))),
    ("LAMB", dict(weight_decay=-0.01)),
]

# Edge values torch.optim accepts: so must we.
ACCEPTED_EDGES = [
    *[(name, dict(lr=0.0)) for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
        "Lion", "LAMB")],
    ("SGD", dict(momentum=0.9, dampening=1.0)),
    ("Adam", dict(betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)),
    ("AdamW", dict(betas=(0.0, 0.0), weight_decay=0.0)),
    ("Adagrad", dict(lr_decay=0.0, initial_accumulator_value=0.0, eps=0.0)),
    ("RMSprop", dict(alpha=0.0, momentum=0.0, eps=0.0)),
    ("Adadelta", dict(rho=0.0)),
    ("Adadelta", dict(rho=1.0)),
    ("NAdam", dict(momentum_decay=0.0)),
    ("ASGD", dict(lambd=0.0, alpha=0.0, t0=0.0)),
    ("Lion", dict(betas=(0.0, 0.0), weight_decay=0.0)),
    ("LAMB", dict(betas=(0.0, 0.0), eps=0.0, weight_decay=0.0)),
]


def case_id(case):
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("case", BAD_HYPERPARAMETERS, ids=case_id)
def test_bad_hyperparameter_is_torchs_value_error(util, case):
    name, kwargs = case
    if hasattr(torch.optim, name):
        with pytest.raises(ValueError):
            getattr(torch.optim, name)(util.make_params(), **kwargs)
    with pytest.raises(ValueError):
        getattr(sft, name)(util.make_params(), **kwargs)


@pytest.mark.parametrize("case", ACCEPTED_EDGES, ids=case_id)
def test_edge_values_torch_accepts(util, case):
    name, kwargs = case
    if hasattr(torch.optim, name):
        getattr(torch.optim, name)(util.make_params(), **kwargs)
    getattr(sft, name)(util.make_params(), **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.complex64], ids=str)
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion"])
def test_unsupported_param_dtype_is_type_error(util, name, dtype):
    """Only float32, float16 and bfloat16 weights: anything else is a TypeError (at
    construction, or at the latest at the first step, without writing anything)."""
    good = util.make_params()
    bad = torch.zeros(5, dtype=dtype)
    if bad.is_floating_point() or bad.is_complex():
        bad = torch.nn.Parameter(bad)
    before = util.snapshot(good)
    with pytest.raises(TypeError):
        opt = getattr(sft, name)([*good, bad])
        util.set_grads(good, util.make_grads(good, 0))
        if bad.requires_grad:
            bad.grad = torch.ones_like(bad)
        opt.step()
    util.assert_params_equal(good, before)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=str)
def test_unsupported_dtype_in_add_param_group(util, dtype):
    params = util.make_params()
    ref = util.clone_params(params)
    opt, topt = sft.AdamW(params, lr=1e-2), torch.optim.AdamW(ref, lr=1e-2)
    util.train_both(topt, opt, ref, params, 3)
    bad = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1
    util.train_both(topt, opt, ref, params, 3, start=3)


def test_params_torch_refuses(util):
    """The checks of torch.optim.Optimizer itself: a bare tensor for params (TypeError), an
    empty list, a param in two groups, a non-leaf tensor (ValueError)."""
    p = util.make_params()
    with pytest.raises(TypeError):
        sft.AdamW(p[0])
    with pytest.raises(ValueError):
        sft.AdamW([])
    with pytest.raises(ValueError):
        sft.AdamW([{"params": p[:2]}, {"params": p[1:]}])
    opt = sft.AdamW(p[:2])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [p[1]]})
    with pytest.raises(ValueError):
        sft.AdamW([p[0] * 2])


def test_add_param_group_refuses_a_set_as_torch(util):
    """A set of params in add_param_group is torch's TypeError (a set has no stable order),
    and the group is not added."""
    p = util.make_params()
    topt, sopt = torch.optim.SGD(p[:1]), sft.SGD(util.clone_params(p[:1]))
    with pytest.raises(TypeError) as expected:
        topt.add_param_group({"params": {p[1]}})
    with pytest.raises(TypeError) as info:
        sopt.add_param_group({"params": {p[2]}})
    assert str(info.value) == str(expected.value)
    assert len(sopt.param_groups) == 1


def test_named_params_are_checked_as_their_tensors(util):
    """Named params ((name, tensor) pairs, as torch takes them): torch's param_names, and the
    dtype checks of the tensors."""
    named = [("a", util.make_params()[0]), ("b", util.make_params()[1])]
    opt = sft.AdamW(named)
    assert opt.param_groups[0]["param_names"] == ["a", "b"]
    with pytest.raises(TypeError):
        sft.AdamW([("c", torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)))])


def trained_pair(util, steps=3):
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = torch.optim.AdamW(ref, lr=1e-2), sft.AdamW(ours, lr=1e-2)
    util.train_both(topt, sopt, ref, ours, steps)
    return ref, ours, topt, sopt


def refused_step(util, ours, sopt, grads, errors):
    """The step is refused with one of `errors`, and neither a weight nor the state changed."""
    before_w, before_state = util.snapshot(ours), util.state_snapshot(sopt)
    with pytest.raises(errors) as info:
        sopt.step()
    assert str(info.value), "the error says nothing"
    util.assert_params_equal(ours, before_w, where="refused step:")
    util.assert_state_untouched(sopt, before_state, "refused step")
    return info


MISMATCH_ERRORS = (TypeError, ValueError, RuntimeError)


@pytest.mark.parametrize("when", ["first step", "after training", "with a new set of grads"])
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_grad_dtype_mismatch(util, grad_dtype, when):
    """A gradient whose dtype differs from its param's (torch refuses to assign one; .data
    gets it there) is a clear error, and nothing is written, the other params included:
    at the very first step, after some training, and at a step where another param has
    no gradient (so the set of params to step differs from the last step's). After the
    gradient is fixed, training continues as torch's."""
    ref, ours, topt, sopt = trained_pair(util, steps=0 if when == "first step" else 3)
    start = 0 if when == "first step" else 3
    grads = util.make_grads(ours, start)
    util.set_grads(ours, grads, skip={0} if when == "with a new set of grads" else ())
    ours[2].grad.data = grads[2].to(grad_dtype)
    info = refused_step(util, ours, sopt, grads, MISMATCH_ERRORS)
    assert "dtype" in str(info.value) or str(grad_dtype).split(".")[-1] in str(info.value)
    util.train_both(topt, sopt, ref, ours, 3, start=start)


@pytest.mark.parametrize("shape", ["more", "fewer", "transposed"])
def test_grad_shape_mismatch(util, shape):
    """A gradient of another size, or of the same size and another shape."""
    ref, ours, topt, sopt = trained_pair(util)
    grads = util.make_grads(ours, 3)
    util.set_grads(ours, grads)
    p = ours[1]  # 31 x 17
    bad = {
        "more": torch.randn(p.numel() + 1),
        "fewer": torch.randn(p.numel() - 1),
        "transposed": torch.randn(17, 31),
    }[shape]
    p.grad.data = bad
    refused_step(util, ours, sopt, grads, MISMATCH_ERRORS)
    util.train_both(topt, sopt, ref, ours, 3, start=3)


def test_non_contiguous_grad(util):
    """A non-contiguous gradient (a transposed view): either the step is torch's (the
    gradient made contiguous), or it is refused clearly without writing anything."""
    ref, ours, topt, sopt = trained_pair(util)
    grads = util.make_grads(ours, 3)
    util.set_grads(ref, grads)
    util.set_grads(ours, grads)
    ours[1].grad = grads[1].t().contiguous().t()  # the same values, column-major
    assert not ours[1].grad.is_contiguous()
    before_w, before_state = util.snapshot(ours), util.state_snapshot(sopt)
    try:
        sopt.step()
    except MISMATCH_ERRORS as e:
        assert str(e)
        util.assert_params_equal(ours, before_w)
        util.assert_state_untouched(sopt, before_state, "refused step")
        return
    topt.step()
    util.assert_params_close(ours, ref)
    util.assert_state_close(sopt, topt)
    util.train_both(topt, sopt, ref, ours, 3, start=4)


def test_non_contiguous_param(util):
    """A non-contiguous param (a transposed leaf): trained as torch trains it (the
    caller's tensor holds the new weights), or refused clearly (at construction or at the
    first step) without writing anything."""
    base = [torch.randn(17, 31), torch.randn(40)]
    ref = [torch.nn.Parameter(base[0].clone().t()), torch.nn.Parameter(base[1].clone())]
    ours = [torch.nn.Parameter(base[0].clone().t()), torch.nn.Parameter(base[1].clone())]
    assert not ours[0].is_contiguous()
    before = util.snapshot(ours)
    try:
        sopt = sft.AdamW(ours, lr=1e-2)
        util.set_grads(ours, util.make_grads(ours, 0))
        sopt.step()
    except MISMATCH_ERRORS as e:
        assert str(e)
        util.assert_params_equal(ours, before)
        return
    topt = torch.optim.AdamW(ref, lr=1e-2)
    util.set_grads(ref, util.make_grads(ref, 0))
    topt.step()
    util.assert_params_close(ours, ref)
    util.train_both(topt, sopt, ref, ours, 5, start=1)


def test_refused_group_leaves_a_working_optimizer(util):
    """After a refused add_param_group (a param already in a group), the optimizer trains
    on exactly as torch's."""
    ref, ours, topt, sopt = trained_pair(util)
    with pytest.raises(ValueError):
        sopt.add_param_group({"params": [ours[0]]})
    with pytest.raises(ValueError):
        topt.add_param_group({"params": [ref[0]]})
    assert len(sopt.param_groups) == 1
    util.train_both(topt, sopt, ref, ours, 3, start=3)
