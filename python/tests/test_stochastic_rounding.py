"""Stochastic rounding of bfloat16 weights kept without fp32 masters (master_weights=False,
stochastic_rounding=True, seed=...), through the binding (stepfuse.Optimizer) and the
stepfuse.torch optimizers, on the CPU.

The rounding (docs/low-precision.md, jit/stochastic_round.h): element e of the model at
step t of its group (1-based) takes the 16 bits r of half e & 1 (the low half for even e) of
word (e >> 1) & 3 of Philox4x32-10(counter = {lo(e >> 3), hi(e >> 3), lo(t), hi(t)},
key = {lo(seed), hi(seed)}), and the bf16 result is (bits(x) + r) >> 16.
"""

import copy

import numpy as np
import pytest

import stepfuse

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

BF16_ULP_1 = 2.0**-7  # the spacing of bfloat16 in [1, 2)
SEED = 0x1234_5678_9ABC_DEF0  # both 32-bit halves of the key matter


# ---- a reference of the definition, in NumPy ------------------------------------------------

_MASK = np.uint64(0xFFFFFFFF)


def philox4x32_10(c, key):
    """Philox4x32-10 of counters c (four uint64 arrays holding 32-bit words) under key (two ints)."""
    c0, c1, c2, c3 = (np.asarray(x, dtype=np.uint64) for x in c)
    k0, k1 = np.uint64(key[0] & 0xFFFFFFFF), np.uint64(key[1] & 0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK
        k0 = (k0 + np.uint64(0x9E3779B9)) & _MASK
        k1 = (k1 + np.uint64(0xBB67AE85)) & _MASK
    return c0, c1, c2, c3


def rounding_bits(seed, step, n):
    """The 16 random bits of model elements 0..n-1 at step `step` under `seed`."""
    e = np.arange(n, dtype=np.uint64)
    block = e >> np.uint64(3)
    words = philox4x32_10((block & _MASK, block >> np.uint64(32), np.full(n, step & 0xFFFFFFFF, np.uint64),
                           np.full(n, step >> 32, np.uint64)), (seed & 0xFFFFFFFF, seed >> 32))
    word = np.choose(((e >> np.uint64(1)) & np.uint64(3)).astype(np.int64), words)
    return np.where(e & np.uint64(1), word >> np.uint64(16), word & np.uint64(0xFFFF))


def round_stochastic(x, bits16):
    """fp32 x (finite) to bf16 bits, stochastically with the 16-bit values `bits16`."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + bits16) >> np.uint64(16)).astype(np.uint16)


def bf16_bits(t):
    return t.detach().view(torch.int16).numpy().view(np.uint16)


def test_reference_philox_matches_random123():
    """The NumPy reference against Random123's known answers (as the C++ tests check the library's)."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, expected in cases:
        out = philox4x32_10([np.array([x], np.uint64) for x in counter], key)
        assert tuple(int(w[0]) for w in out) == expected


# ---- the binding -----------------------------------------------------------------------------

def sgd_tiny_updates(n, steps, *, lr, seed=SEED, fusion="fused", **options):
    """bf16 weights at 1.0 (and an f32 tensor beside them), SGD with gradient -1: each step
    adds lr to every weight. Returns the bf16 weights and the f32 weights."""
    w = torch.ones(n, dtype=torch.bfloat16)
    g = torch.full((n,), -1.0, dtype=torch.bfloat16)
    w32 = torch.ones(64, dtype=torch.float32)
    g32 = torch.full((64,), -1.0, dtype=torch.float32)
    options.setdefault("master_weights", False)
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=lr), [(w, g), (w32, g32)], seed=seed, fusion=fusion, **options)
    for _ in range(steps):
        opt.step()
    assert opt.step_count == steps
    return w, w32


def test_binding_tiny_updates_move_the_mean_only_when_rounding_stochastically():
    """Updates of 1/20 of a bf16 ulp for 50 steps: round-to-nearest never moves a weight at
    1.0; stochastic rounding moves each one up by K ulps, K ~ Binomial(50, p) with p the
    update's fraction of an ulp (~0.05: each step rounds 1 + k ulp + 0.05 ulp up with that
    probability), so the mean moves by 50 * 0.05 = 2.5 ulps. Over n = 8192 weights the
    mean of K has standard deviation sqrt(50 * 0.05 * 0.95 / 8192) = 0.017 ulp: 0.1 ulp is
    6 of them (the test is deterministic for its seed; the bound says any seed passes)."""
    n, steps, lr = 8192, 50, BF16_ULP_1 / 20
    nearest, nearest32 = sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=False)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    sr, sr32 = sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True)
    k = (sr.float() - 1.0) / BF16_ULP_1
    assert bool((k == k.round()).all()) and float(k.min()) >= 0 and float(k.max()) <= steps
    assert abs(float(k.mean()) - steps * 0.05) < 0.1, float(k.mean())
    assert 0 < float((k == 0).float().mean()) < 0.2  # Binomial(50, 0.05) is 0 with probability 0.077
    # f32 weights in the list are stored exactly, rounding or not.
    assert torch.equal(sr32, nearest32)
    assert float(sr32[0]) == pytest.approx(1.0 + steps * lr, abs=steps * 2.0**-24)  # fp32 sums, to nearest


def test_binding_rounds_as_the_definition():
    """Bitwise the reference above (Philox keyed by a seed above 2**32, element index, step),
    for five steps that add exactly 2**-12 (1/32 of an ulp) to weights in [1, 2)."""
    n, steps, lr = 4099, 5, 2.0**-12  # not a multiple of 8: the last Philox block is partial
    w, _ = sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True)
    expected = np.ones(n, dtype=np.float32)
    for t in range(1, steps + 1):
        x = expected + np.float32(lr)  # exact in fp32
        bits = round_stochastic(x, rounding_bits(SEED, t, n))
        expected = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    assert np.array_equal(bf16_bits(w), (expected.view(np.uint32) >> np.uint32(16)).astype(np.uint16))
    assert float(w.float().mean()) > 1.0  # some rounded up (expected: 5/32 of an ulp on average)


def test_binding_reproducible_keyed_by_seed_and_alike_across_paths():
    """Two runs with one seed are bitwise equal, whatever the path (fused, the interpreter,
    the unfused baseline, one thread or two); another seed (or one differing only in its
    upper 32 bits) differs."""
    n, steps, lr = 8192, 20, BF16_ULP_1 / 20
    ref, _ = sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True)
    assert torch.equal(ref, sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True)[0])
    for fusion in ("interpreted", "unfused"):
        assert torch.equal(ref, sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True, fusion=fusion)[0]), fusion
    assert torch.equal(ref, sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True, num_threads=2)[0])
    for seed in (SEED + 1, SEED & 0xFFFFFFFF, 0):
        assert not torch.equal(ref, sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True, seed=seed)[0]), seed


def test_binding_from_groups_takes_the_options():
    n, steps, lr = 4096, 10, BF16_ULP_1 / 20
    ref, _ = sgd_tiny_updates(n, steps, lr=lr, stochastic_rounding=True)
    w = torch.ones(n, dtype=torch.bfloat16)
    g = torch.full((n,), -1.0, dtype=torch.bfloat16)
    w32, g32 = torch.ones(64), torch.full((64,), -1.0)
    opt = stepfuse.Optimizer.from_groups([([(w, g)], stepfuse.SGD(lr=lr)), ([(w32, g32)], stepfuse.SGD(lr=lr))],
                                         master_weights=False, stochastic_rounding=True, seed=SEED)
    for _ in range(steps):
        opt.step()
    assert torch.equal(w, ref)


def test_binding_checkpoint_continues_bitwise(tmp_path):
    """save() holds the step count: an optimizer loading it (same seed) continues with the
    saved run's random bits, bitwise."""
    gen = torch.Generator().manual_seed(5)
    w0 = (1.0 + torch.rand(3000, generator=gen)).to(torch.bfloat16)
    grads = [torch.randn(3000, generator=gen).to(torch.bfloat16) for _ in range(8)]
    opts = dict(master_weights=False, stochastic_rounding=True, seed=11)

    def run(w, g, opt, steps):
        for s in steps:
            g.copy_(grads[s])
            opt.step()

    w_a, g_a = w0.clone(), torch.zeros_like(w0)
    a = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-4), [(w_a, g_a)], **opts)
    run(w_a, g_a, a, range(4))
    path = str(tmp_path / "sr.safetensors")
    a.save(path)
    w_b, g_b = w_a.clone(), torch.zeros_like(w0)
    run(w_a, g_a, a, range(4, 8))
    b = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-4), [(w_b, g_b)], **opts)
    b.load(path)
    assert b.step_count == 4
    run(w_b, g_b, b, range(4, 8))
    assert torch.equal(w_b, w_a)


def test_binding_refuses_what_it_cannot_round():
    bf = (torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16))
    f32 = (torch.ones(8), torch.zeros(8))
    f16 = (torch.ones(8, dtype=torch.float16), torch.zeros(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="stochastic_rounding is set with master_weights = true"):
        stepfuse.Optimizer(stepfuse.SGD(), [bf], stochastic_rounding=True)  # masters by default
    with pytest.raises(ValueError, match="stochastic_rounding.*f16 weights"):
        stepfuse.Optimizer(stepfuse.SGD(), [bf, f16], master_weights=False, stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic_rounding is set but no param has bf16 weights"):
        stepfuse.Optimizer(stepfuse.SGD(), [f32], master_weights=False, stochastic_rounding=True)
    # (the weights first: master_weights=False would not help these)
    with pytest.raises(ValueError, match="stochastic_rounding is set but no param has bf16 weights"):
        stepfuse.Optimizer(stepfuse.SGD(), [f32], stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic_rounding is set with master_weights = true"):
        stepfuse.Optimizer.from_groups([([bf], stepfuse.SGD())], stochastic_rounding=True)
    # f32 weights beside bf16 ones are fine; the seed alone changes nothing.
    stepfuse.Optimizer(stepfuse.SGD(), [bf, f32], master_weights=False, stochastic_rounding=True).step()
    stepfuse.Optimizer(stepfuse.SGD(), [f32], seed=5).step()


def test_binding_seed_must_be_a_64_bit_unsigned_int():
    bf = (torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16))
    make = lambda seed: stepfuse.Optimizer(stepfuse.SGD(), [bf], master_weights=False,  # noqa: E731
                                           stochastic_rounding=True, seed=seed)
    for ok in (0, 2**64 - 1, np.uint64(2**63), np.int64(7), True):
        make(ok)
    with pytest.raises(ValueError, match=r"seed = -1 is negative \(must be an int in \[0, 2\*\*64\)\)"):
        make(-1)
    with pytest.raises(OverflowError, match=r"seed = 18446744073709551616 does not fit in 64 bits"):
        make(2**64)
    with pytest.raises(TypeError, match=r"seed must be an int in \[0, 2\*\*64\), not float"):
        make(1.0)
    with pytest.raises(TypeError, match="seed must be an int"):
        make("3")


def test_binding_signature_and_doc_name_the_options():
    doc = stepfuse.Optimizer.__doc__
    assert "stochastic_rounding=False, seed=0" in doc
    assert "stochastic_rounding: with master_weights=False" in doc and "seed: the stochastic rounding" in doc
    assert "seed=0, stochastic_state_rounding=True" in doc and "stochastic_state_rounding: with stochastic_rounding" in doc
    for fn in (stepfuse.Optimizer.__init__, stepfuse.Optimizer.from_groups):
        assert ("stochastic_rounding: bool = False, seed: int = 0, stochastic_state_rounding: bool = True"
                in fn.__doc__.splitlines()[0])


# ---- stepfuse.torch --------------------------------------------------------------------------

ALL = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
       "Lion", "LAMB"]
SHAPES = [(33, 17), (64,), (129, 130)]


def bf16_params(util, shapes=SHAPES):
    return util.make_params(shapes, dtype=torch.bfloat16)


def train(util, opt, params, steps, start=0, scale=1.0):
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, util.make_grads(params, step, scale=scale))
        opt.step()


def test_torch_adamw_reproducible_and_the_bindings_rounding(util):
    """stepfuse.torch.AdamW(master_weights=False, stochastic_rounding=True, seed=3) is the
    binding's step with those options, bitwise (so the seed reaches the engine); the same
    seed twice is bitwise equal, another seed and round-to-nearest differ."""
    kw = dict(lr=1e-3, weight_decay=0.01)

    def run(steps=6, **options):
        params = bf16_params(util)
        train(util, sft.AdamW(params, **kw, **options), params, steps)
        return params

    ref = run(master_weights=False, stochastic_rounding=True, seed=3)
    util.assert_params_equal(run(master_weights=False, stochastic_rounding=True, seed=3), ref)
    assert not all(torch.equal(a, b) for a, b in zip(run(master_weights=False, stochastic_rounding=True, seed=4), ref))
    assert not all(torch.equal(a, b) for a, b in zip(run(master_weights=False), ref))
    # The binding, over the same params in the same order, with the same gradients.
    params = bf16_params(util)
    grads = [torch.zeros_like(p) for p in params]
    opt = stepfuse.Optimizer(stepfuse.AdamW(**kw), [(p.detach(), g) for p, g in zip(params, grads)],
                             master_weights=False, stochastic_rounding=True, seed=3)
    for step in range(6):
        for g, new in zip(grads, util.make_grads(params, step)):
            g.copy_(new)
        opt.step()
    util.assert_params_equal(params, ref)


@pytest.mark.parametrize("name", ALL)
def test_every_torch_optimizer_takes_the_options(util, name):
    """Every stepfuse.torch optimizer (each takes master_weights) takes stochastic_rounding and
    seed, keeps them as attributes (and through a deep copy), and steps reproducibly."""
    def run():
        params = bf16_params(util, [(5, 7), (300,)])
        opt = getattr(sft, name)(params, master_weights=False, stochastic_rounding=True, seed=9)
        train(util, opt, params, 3)
        return opt, params

    opt, params = run()
    assert (opt.stochastic_rounding, opt.seed) == (True, 9)
    util.assert_params_equal(run()[1], params)
    clone = copy.deepcopy(opt)
    assert (clone.stochastic_rounding, clone.seed, clone.master_weights) == (True, 9, False)
    defaults = getattr(sft, name)(bf16_params(util))
    assert (defaults.stochastic_rounding, defaults.seed) == (False, 0)


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_torch_under_a_grad_scaler_a_skipped_step_draws_no_bits(util, scaler_kind):
    """Under a GradScaler (torch's, or stepfuse.torch's fused step) with power-of-two scales
    (unscaling is exact): a run with a non-finite step, skipped, ends bitwise where the run
    without that step ends: a skipped step writes nothing and takes no step's random bits."""
    cls = torch.amp.GradScaler if scaler_kind == "torch" else sft.GradScaler

    def run(bad_step):
        params = bf16_params(util)
        opt = sft.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True, seed=3)
        scaler = cls("cpu", init_scale=2.0**10, growth_interval=1000)
        for step in range(6):
            scale = float(scaler.scale(torch.ones(())))
            opt.zero_grad(set_to_none=True)
            grads = util.make_grads(params, step, scale=scale)
            if step == bad_step:
                grads[1].view(-1)[3] = float("inf")
            util.set_grads(params, grads)
            before = util.snapshot(params)
            scaler.step(opt)
            scaler.update()
            if step == bad_step:
                util.assert_params_equal(params, before, where=f"skipped step {step}:")
        return params, scaler

    clean, clean_scaler = run(bad_step=None)
    skipped, skipped_scaler = run(bad_step=2)
    assert skipped_scaler.get_scale() == clean_scaler.get_scale() / 2
    # The skipped run applied steps 0, 1, 3, 4, 5 with the gradients of those steps; the
    # clean run applied 0..5. Replay the clean run without step 2 for the reference.
    params = bf16_params(util)
    opt = sft.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True, seed=3)
    for step in (0, 1, 3, 4, 5):
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, util.make_grads(params, step))
        opt.step()
    util.assert_params_equal(skipped, params)
    assert not all(torch.equal(a, b) for a, b in zip(clean, params))


def test_torch_state_dict_restores_the_run_bitwise(util):
    """A run restored from a state_dict (same seed) continues bitwise as the uninterrupted run:
    the bits are counted by each group's step, which the state dict carries."""
    params = bf16_params(util)
    opt = sft.AdamW(params, lr=1e-3, master_weights=False, stochastic_rounding=True, seed=3)
    train(util, opt, params, 3)
    saved = util.save_load(opt.state_dict())
    weights = util.snapshot(params)
    train(util, opt, params, 3, start=3)  # the uninterrupted run

    resumed = util.clone_params(weights)
    o = sft.AdamW(resumed, lr=1e-3, master_weights=False, stochastic_rounding=True, seed=3)
    o.load_state_dict(saved)
    train(util, o, resumed, 3, start=3)
    assert float(o.state_dict()["state"][0]["step"]) == 6
    util.assert_params_equal(resumed, params)


def test_torch_mixed_model_and_steps_with_only_float32_grads(util):
    """bf16 matrices beside f32 vectors: the f32 params step exactly as without rounding, and a
    step whose only gradients are f32 params' (nothing to round) runs."""
    def run(**options):
        params = [*bf16_params(util, [(40, 30)]), *util.make_params([(30,)])]
        opt = sft.AdamW(params, lr=1e-3, master_weights=False, **options)
        train(util, opt, params, 2)
        opt.zero_grad(set_to_none=True)
        params[1].grad = torch.ones(30)  # the f32 param alone
        opt.step()
        return params

    sr, nearest = run(stochastic_rounding=True, seed=1), run()
    assert torch.equal(sr[1], nearest[1])
    assert not torch.equal(sr[0], nearest[0])


def test_torch_errors():
    bf = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]
    for kw in (dict(), dict(master_weights=True)):  # masters by default
        with pytest.raises(ValueError, match="stochastic_rounding=True needs master_weights=False"):
            sft.AdamW(bf, stochastic_rounding=True, **kw)
    with pytest.raises(ValueError, match="stochastic_rounding=True but no param is bfloat16"):
        sft.AdamW([torch.nn.Parameter(torch.ones(8))], master_weights=False, stochastic_rounding=True)
    f16 = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16 but stochastic_rounding=True"):
        sft.SGD(bf + [f16], master_weights=False, stochastic_rounding=True)
    opt = sft.SGD(bf, master_weights=False, stochastic_rounding=True)
    with pytest.raises(ValueError, match="float16 but stochastic_rounding=True"):
        opt.add_param_group({"params": [f16]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="Invalid seed: -1 is negative"):
        sft.AdamW(bf, master_weights=False, stochastic_rounding=True, seed=-1)
    with pytest.raises(OverflowError, match="does not fit in 64 bits"):
        sft.AdamW(bf, master_weights=False, stochastic_rounding=True, seed=2**64)
    with pytest.raises(TypeError, match="Invalid seed: 0.5"):
        sft.Lion(bf, master_weights=False, stochastic_rounding=True, seed=0.5)
    assert sft.AdamW(bf, master_weights=False, stochastic_rounding=True, seed=2**64 - 1).seed == 2**64 - 1
    # float32 params with a seed alone (no rounding asked for) are fine.
    assert sft.AdamW([torch.nn.Parameter(torch.ones(8))], seed=4).seed == 4
