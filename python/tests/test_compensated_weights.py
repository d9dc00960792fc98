"""Compensated bfloat16 weights kept without fp32 masters (master_weights=False,
compensated_weights=True), through the binding (stepfuse.Optimizer) and the stepfuse.torch
optimizers, on the CPU.

The definition (include/stepfuse/optimizer.hpp, OptimizerOptions::compensated_weights): beside
each bf16 weight w the optimizer keeps a bf16 compensation c; the parameter is x = w + c (in
fp32). A step updates x in fp32 and writes back w = bf16(x), the nearest, and c = bf16(x - w),
the nearest to the rest (x - w is exact in fp32). So a run is an fp32 run whose parameters are
replaced by bf16(x) + bf16(x - bf16(x)) after every step, and `split` below is its reference.
"""

import copy

import numpy as np
import pytest

import stepfuse

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

BF16_ULP_1 = 2.0**-7  # the spacing of bfloat16 in [1, 2)


def split(x):
    """fp32 x to (weight, compensation): the nearest bfloat16 and the nearest bfloat16 to the rest."""
    hi = x.to(torch.bfloat16)
    return hi, (x - hi.float()).to(torch.bfloat16)


def joined(hi, lo):
    """The fp32 parameter a (weight, compensation) pair stands for."""
    return hi.float() + lo.float()


def bf16_bits(t):
    return t.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def compensation_of(opt, i):
    """The binding's compensation of param i, as a bfloat16 tensor (a copy)."""
    c = opt.compensation(i)
    return torch.from_numpy(c.copy()).view(torch.bfloat16)


def assert_bits_equal(actual, expected, what):
    assert actual.dtype == expected.dtype == torch.bfloat16, what
    assert actual.shape == expected.shape, what
    if not torch.equal(actual.view(torch.int16), expected.view(torch.int16)):
        diff = int((actual.view(torch.int16) != expected.view(torch.int16)).sum())
        pytest.fail(f"{what}: {diff} of {actual.numel()} elements differ")


# ---- the binding -----------------------------------------------------------------------------

def sgd_tiny_updates(n, steps, *, lr, **options):
    """bf16 weights at 1.0 (and an f32 tensor beside them), SGD with gradient -1: each step
    adds lr to every parameter. Returns the optimizer, the bf16 weights and the f32 weights."""
    w = torch.ones(n, dtype=torch.bfloat16)
    g = torch.full((n,), -1.0, dtype=torch.bfloat16)
    w32 = torch.ones(64, dtype=torch.float32)
    g32 = torch.full((64,), -1.0, dtype=torch.float32)
    options.setdefault("master_weights", False)
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=lr), [(w, g), (w32, g32)], **options)
    for _ in range(steps):
        opt.step()
    assert opt.step_count == steps
    return opt, w, w32


def test_binding_tiny_updates_accumulate_only_when_compensated():
    """Updates of 1/20 of a bf16 ulp for 50 steps on weights at 1.0: without masters and
    without compensation the weights never move (each update is below half an ulp); with
    compensation the parameter w + c moves by 50/20 = 2.5 ulps (within 0.1 ulp: rounding the
    compensation, at most half an ulp, to bf16 costs at most 2**-9 of it, 2**-10 ulp, a step)."""
    n, steps, lr = 4096, 50, BF16_ULP_1 / 20
    _, nearest, nearest32 = sgd_tiny_updates(n, steps, lr=lr)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    opt, w, w32 = sgd_tiny_updates(n, steps, lr=lr, compensated_weights=True)
    moved = (joined(w, compensation_of(opt, 0)) - 1.0) / BF16_ULP_1
    assert float((moved - steps / 20).abs().max()) < 0.1, moved
    # The weight itself is the nearest bf16 to the parameter: 1 + 2 or 1 + 3 ulps (2.5 is a tie).
    assert set(((w.float() - 1.0) / BF16_ULP_1).unique().tolist()) <= {2.0, 3.0}
    # f32 weights in the list are stored exactly, compensated or not, and have no compensation.
    assert torch.equal(w32, nearest32)
    assert opt.compensation(1) is None


def test_binding_compensation_is_the_definition():
    """AdamW over bf16 weights for a few steps: bitwise the fp32 run of the binding itself
    (float32 weights, the same gradients in fp32) with each parameter split into its nearest
    bf16 and the nearest bf16 to the rest after every step."""
    gen = torch.Generator().manual_seed(3)
    n, steps = 5003, 8
    x = (torch.randn(n, generator=gen) * 0.5).to(torch.bfloat16).float()
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    w, g = x.to(torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    x32, g32 = x.clone(), torch.zeros(n)
    cfg = stepfuse.AdamW(lr=1e-3, weight_decay=0.1)
    opt = stepfuse.Optimizer(cfg, [(w, g)], master_weights=False, compensated_weights=True)
    ref = stepfuse.Optimizer(cfg, [(x32, g32)])
    assert opt.compensation(0).dtype == np.uint16 and opt.compensation(0).shape == (n,)
    assert not opt.compensation(0).any()  # zero before the first step: the parameter is the weight
    for s in range(steps):
        g.copy_(grads[s])
        g32.copy_(grads[s].float())
        opt.step()
        ref.step()
        hi, lo = split(x32)
        x32.copy_(joined(hi, lo))
        assert_bits_equal(w, hi, f"step {s}: weights")
        assert_bits_equal(compensation_of(opt, 0), lo, f"step {s}: compensations")
        for name in ("exp_avg", "exp_avg_sq"):
            assert np.array_equal(opt.state(0, name), ref.state(0, name)), (s, name)


def test_binding_compensation_view():
    """compensation(i): a writable zero-copy uint16 view of the bits in the weight's shape,
    None for f32 weights and without the option; an edit is the parameter the next step reads."""
    w = torch.ones(6, 5, dtype=torch.bfloat16)
    g = torch.zeros(6, 5, dtype=torch.bfloat16)
    w32, g32 = torch.ones(3), torch.zeros(3)
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=1.0), [(w, g), (w32, g32)], master_weights=False,
                             compensated_weights=True)
    c = opt.compensation(0)
    assert c.dtype == np.uint16 and c.shape == (6, 5) and c.flags.writeable
    assert opt.compensation(1) is None and opt.master(0) is None
    # An edit is the parameter the next step reads: c = -2**-8 makes w + c = 1 - 2**-8, a
    # bf16 number (the spacing below 1 is 2**-8), which a step with zero gradients writes back
    # as the weight, with a zero compensation.
    c[...] = bf16_bits(torch.full((6, 5), -(2.0**-8), dtype=torch.bfloat16))
    opt.step()
    assert torch.equal(w, torch.full((6, 5), 1.0 - 2.0**-8, dtype=torch.bfloat16))
    assert not opt.compensation(0).any()
    off = stepfuse.Optimizer(stepfuse.SGD(), [(w.clone(), g.clone())], master_weights=False)
    assert off.compensation(0) is None
    with pytest.raises((IndexError, ValueError)):
        opt.compensation(2)


def test_binding_from_groups_takes_the_option():
    n, steps, lr = 4096, 10, BF16_ULP_1 / 20
    ref_opt, ref, _ = sgd_tiny_updates(n, steps, lr=lr, compensated_weights=True)
    w = torch.ones(n, dtype=torch.bfloat16)
    g = torch.full((n,), -1.0, dtype=torch.bfloat16)
    w32, g32 = torch.ones(64), torch.full((64,), -1.0)
    opt = stepfuse.Optimizer.from_groups([([(w, g)], stepfuse.SGD(lr=lr)), ([(w32, g32)], stepfuse.SGD(lr=lr))],
                                         master_weights=False, compensated_weights=True)
    for _ in range(steps):
        opt.step()
    assert torch.equal(w, ref)
    assert np.array_equal(opt.compensation(0), ref_opt.compensation(0))
    assert opt.compensation(0).any()


def test_binding_checkpoint_continues_bitwise(tmp_path):
    """save() holds the compensations: an optimizer loading it continues bitwise."""
    gen = torch.Generator().manual_seed(5)
    w0 = (1.0 + torch.rand(3000, generator=gen)).to(torch.bfloat16)
    grads = [torch.randn(3000, generator=gen).to(torch.bfloat16) for _ in range(8)]
    opts = dict(master_weights=False, compensated_weights=True)

    def run(g, opt, steps):
        for s in steps:
            g.copy_(grads[s])
            opt.step()

    w_a, g_a = w0.clone(), torch.zeros_like(w0)
    a = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-4), [(w_a, g_a)], **opts)
    run(g_a, a, range(4))
    path = str(tmp_path / "comp.safetensors")
    a.save(path)
    saved = a.compensation(0).copy()
    assert saved.any()
    w_b, g_b = w_a.clone(), torch.zeros_like(w0)
    run(g_a, a, range(4, 8))
    b = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-4), [(w_b, g_b)], **opts)
    b.load(path)
    assert b.step_count == 4
    assert np.array_equal(b.compensation(0), saved)
    run(g_b, b, range(4, 8))
    assert torch.equal(w_b, w_a)
    assert np.array_equal(b.compensation(0), a.compensation(0))


def test_binding_refuses_what_it_cannot_compensate():
    bf = (torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16))
    f32 = (torch.ones(8), torch.zeros(8))
    f16 = (torch.ones(8, dtype=torch.float16), torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="compensated_weights is set with master_weights = true"):
        stepfuse.Optimizer(stepfuse.SGD(), [bf], compensated_weights=True)  # masters by default
    with pytest.raises(ValueError, match="compensated_weights is set with stochastic_rounding = true"):
        stepfuse.Optimizer(stepfuse.SGD(), [bf], master_weights=False, compensated_weights=True,
                           stochastic_rounding=True)
    with pytest.raises(ValueError, match="compensated_weights.*f16 weights"):
        stepfuse.Optimizer(stepfuse.SGD(), [bf, f16], master_weights=False, compensated_weights=True)
    with pytest.raises(ValueError, match="compensated_weights is set but no param has bf16 weights"):
        stepfuse.Optimizer(stepfuse.SGD(), [f32], master_weights=False, compensated_weights=True)
    with pytest.raises(ValueError, match="compensated_weights is set but no param has bf16 weights"):
        stepfuse.Optimizer(stepfuse.SGD(), [f32], compensated_weights=True)
    with pytest.raises(ValueError, match="compensated_weights is set with master_weights = true"):
        stepfuse.Optimizer.from_groups([([bf], stepfuse.SGD())], compensated_weights=True)
    # f32 weights beside bf16 ones are fine.
    stepfuse.Optimizer(stepfuse.SGD(), [bf, f32], master_weights=False, compensated_weights=True).step()


def test_binding_signature_and_doc_name_the_option():
    doc = stepfuse.Optimizer.__doc__
    assert "compensated_weights=False" in doc
    assert "compensated_weights: with master_weights=False" in doc
    for fn in (stepfuse.Optimizer.__init__, stepfuse.Optimizer.from_groups):
        assert "stochastic_state_rounding: bool = True, compensated_weights: bool = False" in fn.__doc__.splitlines()[0]
    assert "uint16" in stepfuse.Optimizer.compensation.__doc__


# ---- stepfuse.torch --------------------------------------------------------------------------

ALL = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
       "Lion", "LAMB"]
SHAPES = [(33, 17), (64,), (129, 130)]


def bf16_params(util, shapes=SHAPES):
    return util.make_params(shapes, dtype=torch.bfloat16)


def train(util, opt, params, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, util.make_grads(params, step))
        opt.step()


def compensations(opt, params):
    return [opt.state[p]["compensation"].detach().clone() for p in params]


def split_run(util, params, make_opt, steps):
    """The reference: `make_opt` over fp32 copies of the bf16 params, stepped on the fp32
    values of the same gradients, each param split after every step. Yields (step, the
    optimizer, weights, compensations) after every step."""
    x = util.clone_params(params, dtype=torch.float32)
    opt = make_opt(x)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        util.set_grads(x, [g.float() for g in util.make_grads(params, step)])
        opt.step()
        his, los = [], []
        with torch.no_grad():
            for p in x:
                hi, lo = split(p.detach())
                p.copy_(joined(hi, lo))
                his.append(hi)
                los.append(lo)
        yield step, opt, his, los


def test_torch_adamw_is_the_split_fp32_run(util):
    """stepfuse.torch.AdamW(master_weights=False, compensated_weights=True) over bf16 params, 20
    steps: after every step the weights are bitwise bf16(x) and the compensations bf16(x -
    bf16(x)) of the fp32 parameters x of stepfuse.torch.AdamW over fp32 params on the same
    gradients (in fp32), each x replaced by that split after every step; the state is that
    run's, bitwise."""
    kw = dict(lr=1e-3, weight_decay=0.01)
    params = bf16_params(util)
    opt = sft.AdamW(params, master_weights=False, compensated_weights=True, **kw)
    for step, ref, his, los in split_run(util, params, lambda x: sft.AdamW(x, **kw), 20):
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, util.make_grads(params, step))
        opt.step()
        for i, p in enumerate(params):
            assert_bits_equal(p.detach(), his[i], f"step {step}: param {i}")
            assert_bits_equal(opt.state[p]["compensation"], los[i], f"step {step}: param {i}'s compensation")
    ours, theirs = opt.state_dict()["state"], ref.state_dict()["state"]
    for i in theirs:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[i][k], theirs[i][k]), (i, k)


def test_torch_adamw_follows_torch(util):
    """The same run against torch.optim.AdamW (foreach=False) over fp32 params, its x split
    after every step. torch orders AdamW's fp32 operations its own way: its x and ours are a
    few fp32 ulps apart after a step, so their compensations (bf16: 8 bits below the weight's
    last) now and then round to neighbours, an ulp of the compensation apart (1/512 of the
    weight's ulp, or less), and the runs go on from parameters that far apart. So: the weights
    are torch's but for a rare one an ulp off (at a tie), and the parameters w + c agree within
    1/16 of a bf16 ulp of the largest value an element held in the run (its |x| moves by about
    lr a step)."""
    kw = dict(lr=1e-3, weight_decay=0.01)
    steps = 20
    params = bf16_params(util)
    opt = sft.AdamW(params, master_weights=False, compensated_weights=True, **kw)
    torch_opt = lambda x: torch.optim.AdamW(x, foreach=False, **kw)  # noqa: E731
    for step, _, his, los in split_run(util, params, torch_opt, steps):
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, util.make_grads(params, step))
        opt.step()
        theirs = [joined(hi, lo) for hi, lo in zip(his, los)]
        util.assert_rounded_from(params, [hi.float() for hi in his], where=f"step {step}:")
        for i, p in enumerate(params):
            ours = joined(p.detach(), opt.state[p]["compensation"])
            allowed = util.ulp(theirs[i].abs() + steps * kw["lr"], torch.bfloat16) / 16
            gap = (ours - theirs[i]).abs()
            assert bool((gap <= allowed).all()), (
                f"step {step}: param {i}: w + c is {float((gap / allowed).max()) / 16:.3g} bf16 ulps from torch's")


def test_torch_tiny_updates_accumulate_only_when_compensated(util):
    """stepfuse.torch.SGD, lr * grad = 1/20 of a bf16 ulp on params at 1.0 for 50 steps: plain
    bf16 without masters never moves; compensated, the parameter moves by 2.5 ulps (within
    0.1 ulp)."""
    steps, lr = 50, BF16_ULP_1 / 20

    def run(**options):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = sft.SGD([p], lr=lr, master_weights=False, **options)
        for _ in range(steps):
            p.grad = torch.full_like(p, -1.0)
            opt.step()
        return opt, p

    _, plain = run()
    assert torch.equal(plain.detach(), torch.ones(4096, dtype=torch.bfloat16))
    opt, p = run(compensated_weights=True)
    moved = (joined(p.detach(), opt.state[p]["compensation"]) - 1.0) / BF16_ULP_1
    assert float((moved - 2.5).abs().max()) < 0.1, moved


@pytest.mark.parametrize("name", ALL)
def test_every_torch_optimizer_takes_the_option(util, name):
    """Every stepfuse.torch optimizer takes compensated_weights, keeps it as an attribute (and
    through a deep copy), keeps a bf16 compensation per bf16 param in its state, and steps
    reproducibly."""
    def run():
        params = bf16_params(util, [(5, 7), (300,)])
        opt = getattr(sft, name)(params, master_weights=False, compensated_weights=True)
        train(util, opt, params, 3)
        return opt, params

    opt, params = run()
    assert opt.compensated_weights is True
    again, params_again = run()
    util.assert_params_equal(params_again, params)
    for p, q in zip(params, params_again):
        c = opt.state[p]["compensation"]
        assert c.dtype == torch.bfloat16 and c.shape == p.shape and "master_param" not in opt.state[p]
        assert_bits_equal(again.state[q]["compensation"], c, name)
    clone = copy.deepcopy(opt)
    assert (clone.compensated_weights, clone.master_weights) == (True, False)
    defaults = getattr(sft, name)(bf16_params(util))
    assert defaults.compensated_weights is False


def test_torch_state_dict_round_trips_bitwise(util):
    """state_dict() carries each bf16 param's compensation ("compensation", bfloat16, the
    param's shape); through torch.save/torch.load and load_state_dict into a new optimizer, the
    run continues bitwise as the uninterrupted run."""
    params = bf16_params(util)
    opt = sft.AdamW(params, lr=1e-3, master_weights=False, compensated_weights=True)
    train(util, opt, params, 3)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        c = sd["state"][i]["compensation"]
        assert c.dtype == torch.bfloat16 and c.shape == p.shape
        assert bool((c != 0).any())
    saved = util.save_load(sd)
    weights = util.snapshot(params)
    train(util, opt, params, 3, start=3)  # the uninterrupted run

    resumed = util.clone_params(weights)
    o = sft.AdamW(resumed, lr=1e-3, master_weights=False, compensated_weights=True)
    o.load_state_dict(saved)
    util.assert_state_equal(o.state_dict(), saved)  # before any step: what was loaded, bitwise
    train(util, o, resumed, 3, start=3)
    util.assert_params_equal(resumed, params)
    util.assert_state_equal(o.state_dict(), opt.state_dict())


def test_torch_state_dict_without_compensations_starts_from_zero(util):
    """A state dict without compensations (saved by an optimizer without them) loaded into a
    compensated one: each compensation starts at zero (the parameter is the weight), as a
    missing fp32 master starts from the weight."""
    params = bf16_params(util)
    opt = sft.AdamW(params, lr=1e-3, master_weights=False)
    train(util, opt, params, 3)
    saved = util.save_load(opt.state_dict())
    assert all("compensation" not in st for st in saved["state"].values())
    weights = util.snapshot(params)

    def resume(sd):
        resumed = util.clone_params(weights)
        o = sft.AdamW(resumed, lr=1e-3, master_weights=False, compensated_weights=True)
        o.load_state_dict(sd)
        train(util, o, resumed, 2, start=3)
        return o, resumed

    zeros = copy.deepcopy(saved)
    for i, p in enumerate(weights):
        zeros["state"][i]["compensation"] = torch.zeros_like(p)
    o, resumed = resume(saved)
    o_zeros, resumed_zeros = resume(zeros)
    util.assert_params_equal(resumed, resumed_zeros)
    util.assert_state_equal(o.state_dict(), o_zeros.state_dict())
    # And the other way: an optimizer without compensations drops the saved ones (as one
    # without masters drops saved masters), stepping from the weights alone.
    with_comp = sft.AdamW(util.clone_params(weights), lr=1e-3, master_weights=False, compensated_weights=True)
    train(util, with_comp, with_comp.param_groups[0]["params"], 1, start=3)
    plain = sft.AdamW(util.clone_params(weights), lr=1e-3, master_weights=False)
    plain.load_state_dict(util.save_load(with_comp.state_dict()))
    train(util, plain, plain.param_groups[0]["params"], 1, start=4)
    assert all("compensation" not in st for st in plain.state_dict()["state"].values())


def test_torch_mixed_model_and_steps_with_only_float32_grads(util):
    """bf16 matrices beside f32 vectors: the f32 params step exactly as without compensation, a
    step whose only gradients are f32 params' (nothing to compensate) runs, and the bf16
    params' compensations are kept through it: the run is the split fp32 run with the same
    gradients, bitwise."""
    kw = dict(lr=1e-3)
    shapes = [(40, 30), (30,)]

    def grads(params, step):
        gs = util.make_grads(params, step)
        return [None, gs[1]] if step == 2 else gs

    params = [*bf16_params(util, shapes[:1]), *util.make_params(shapes[1:])]
    opt = sft.AdamW(params, master_weights=False, compensated_weights=True, **kw)
    x = util.clone_params(params, dtype=torch.float32)
    ref = sft.AdamW(x, **kw)
    plain_params = util.clone_params(params)
    plain = sft.AdamW(plain_params, master_weights=False, **kw)
    for step in range(5):
        for o, ps, cast in ((opt, params, None), (ref, x, torch.float32), (plain, plain_params, None)):
            o.zero_grad(set_to_none=True)
            gs = grads(params, step)
            util.set_grads(ps, [g if g is None or cast is None else g.to(cast) for g in gs])
            o.step()
        if step != 2:  # (x[0] did not step: its split stays, as the optimizer's does)
            with torch.no_grad():
                hi, lo = split(x[0].detach())
                x[0].copy_(joined(hi, lo))
        assert_bits_equal(params[0].detach(), hi, f"step {step}: weights")
        assert_bits_equal(opt.state[params[0]]["compensation"], lo, f"step {step}: compensations")
        assert torch.equal(params[1], x[1]) and torch.equal(params[1], plain_params[1]), step
        assert "compensation" not in opt.state[params[1]]
    assert not torch.equal(params[0], plain_params[0])


def test_torch_errors():
    bf = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]
    for kw in (dict(), dict(master_weights=True)):  # masters by default
        with pytest.raises(ValueError, match="compensated_weights=True needs master_weights=False"):
            sft.AdamW(bf, compensated_weights=True, **kw)
    with pytest.raises(ValueError, match="compensated_weights=True and stochastic_rounding=True together"):
        sft.AdamW(bf, master_weights=False, compensated_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="compensated_weights=True but no param is bfloat16"):
        sft.AdamW([torch.nn.Parameter(torch.ones(8))], master_weights=False, compensated_weights=True)
    f16 = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16 but compensated_weights=True"):
        sft.SGD(bf + [f16], master_weights=False, compensated_weights=True)
    opt = sft.SGD(bf, master_weights=False, compensated_weights=True)
    with pytest.raises(ValueError, match="float16 but compensated_weights=True"):
        opt.add_param_group({"params": [f16]})
    assert len(opt.param_groups) == 1
    # float32 params beside bfloat16 ones are fine.
    sft.SGD(bf + [torch.nn.Parameter(torch.ones(8))], master_weights=False, compensated_weights=True)
