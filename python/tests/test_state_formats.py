"""Optimizer state stored as bf16 or q8 between steps (state_format, state_formats,
min_q8_numel, a group's state_format), through the binding (stepfuse.Optimizer) and the
stepfuse.torch optimizers.

What a step does with a stored stream (OptimizerOptions::state_format): it loads the stream
decoded to fp32, computes the update in fp32 as for f32 state, and stores the new value
encoded: bf16 rounded to nearest even, q8 block-wise (one fp32 absmax per block of 256
elements, each element the nearest of the 256 values of bitsandbytes' dynamic map times
that absmax; an unsigned map for a non-negative stream). So a bf16 or q8 run is the f32 run
whose state is encoded and decoded again after every step, bit for bit: the tests below
check it against references written here (the map built as bitsandbytes builds it, the
nearest code found with numpy), not against the library's own codec alone.
"""

import copy
import math

import numpy as np
import pytest

import stepfuse

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

BLOCK = 256
FORMATS = ["f32", "bf16", "q8"]


# ---- references --------------------------------------------------------------------------------

def dynamic_map(signed):
    """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): 256 fp32
    values, ascending, built as bitsandbytes builds them (fp32 linspace and means, scaled by
    powers of ten in double, rounded to fp32)."""
    data = []
    for i in range(7):
        items = 2**i + 1 if signed else 2 ** (i + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    assert len(data) == 256
    return np.array(data, dtype=np.float32)


MAPS = {True: dynamic_map(True), False: dynamic_map(False)}
THRESHOLDS = {s: ((m[:-1].astype(np.float64) + m[1:].astype(np.float64)) / 2).astype(np.float32)
              for s, m in MAPS.items()}


def q8_encode(x, signed):
    """(codes, absmax) of fp32 values, block by block: absmax = max |x| over the block, each
    value times 1/absmax (fp32) given the code of the nearest map value (a value on a
    midpoint takes the lower code)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    n = x.size
    blocks = -(-n // BLOCK)
    padded = np.zeros(blocks * BLOCK, dtype=np.float32)
    padded[:n] = x
    absmax = np.abs(padded.reshape(blocks, BLOCK)).max(axis=1).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(absmax > 0, np.float32(1) / absmax, np.float32(0)).astype(np.float32)
    normalized = (x * np.repeat(inv, BLOCK)[:n]).astype(np.float32)
    codes = np.searchsorted(THRESHOLDS[signed], normalized, side="left").astype(np.uint8)
    return codes, absmax


def q8_decode(codes, absmax, signed):
    n = codes.size
    return (MAPS[signed][codes.reshape(-1)] * np.repeat(absmax, BLOCK)[:n]).astype(np.float32)


def bf16_round(x):
    """fp32 values rounded to bf16 (nearest even) and widened back."""
    return torch.from_numpy(np.asarray(x, dtype=np.float32).copy()).to(torch.bfloat16).float().numpy()


SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False}


def encode_decode(fmt, values, signed):
    if fmt == "f32":
        return np.asarray(values, dtype=np.float32)
    if fmt == "bf16":
        return bf16_round(values)
    return q8_decode(*q8_encode(values, signed), signed)


def pair(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n)


def grads_of(n, steps, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(steps)]


# ---- the binding -------------------------------------------------------------------------------

def test_enums_and_names():
    assert [f.name for f in stepfuse.StateFormat] == ["f32", "bf16", "q8"]
    assert [v.name for v in stepfuse.StateValues] == ["any", "nonnegative", "full_precision"]
    w, g = pair(5000, 0)
    for given in ("q8", stepfuse.StateFormat.q8):
        opt = stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_format=given)
        assert opt.state_format(0, "exp_avg") is stepfuse.StateFormat.q8
    opt = stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)])
    assert opt.state_format(0, "exp_avg_sq") is stepfuse.StateFormat.f32
    with pytest.raises(ValueError, match="'q4' is not one of 'f32', 'bf16', 'q8'"):
        stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_format="q4")
    with pytest.raises(TypeError, match="state_format must be a StateFormat"):
        stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_format=8)
    with pytest.raises(ValueError, match=r"state_formats\['exp_avg'\] 'int8'"):
        stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_formats={"exp_avg": "int8"})
    with pytest.raises(TypeError, match="state_formats must be a dict"):
        stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_formats="q8")
    doc = stepfuse.Optimizer.__doc__
    assert "state_format='f32', state_formats=None, min_q8_numel=4096" in doc
    first = stepfuse.Optimizer.__init__.__doc__.splitlines()[0]
    assert "state_format: StateFormat | str = 'f32'" in first and "min_q8_numel: int = 4096" in first


def test_formats_per_stream_and_size():
    """The blanket format, per-stream overrides, q8 only from min_q8_numel elements; the stored
    bytes and scales have the format's sizes; state() refuses a stream not stored as f32."""
    big, small = pair(5000, 1), pair(300, 2)
    opt = stepfuse.Optimizer(stepfuse.AdamW(), [big, small], state_format="q8", state_formats={"exp_avg_sq": "bf16"})
    f = stepfuse.StateFormat
    assert [opt.state_format(0, "exp_avg"), opt.state_format(0, "exp_avg_sq")] == [f.q8, f.bf16]
    assert [opt.state_format(1, "exp_avg"), opt.state_format(1, "exp_avg_sq")] == [f.f32, f.bf16]  # 300 < 4096
    for i, n in ((0, 5000), (1, 300)):
        sizes = {"q8": n, "bf16": 2 * n, "f32": 4 * n}
        for name in ("exp_avg", "exp_avg_sq"):
            storage = opt.state_storage(i, name)
            assert storage.dtype == np.uint8 and storage.shape == (sizes[opt.state_format(i, name).name],)
            absmax = opt.state_absmax(i, name)
            assert absmax.dtype == np.float32
            assert absmax.shape == ((math.ceil(n / BLOCK),) if opt.state_format(i, name) == f.q8 else (0,))
    with pytest.raises(RuntimeError, match="stored as q8, not f32"):
        opt.state(0, "exp_avg")
    with pytest.raises(RuntimeError, match="stored as bf16, not f32"):
        opt.state(1, "exp_avg_sq")
    assert opt.state(1, "exp_avg").shape == (300,)
    every = stepfuse.Optimizer(stepfuse.AdamW(), [big, small], state_format="q8", min_q8_numel=0)
    assert every.state_format(1, "exp_avg") == f.q8
    with pytest.raises(ValueError, match="min_q8_numel = -1"):
        stepfuse.Optimizer(stepfuse.AdamW(), [big], state_format="q8", min_q8_numel=-1)


def test_refusals_name_the_stream():
    w, g = pair(5000, 3)
    for kw in (dict(state_format="q8"), dict(state_format="bf16")):
        with pytest.raises(ValueError, match="'ax'"):
            stepfuse.Optimizer(stepfuse.ASGD(), [(w, g)], **kw)
    with pytest.raises(ValueError, match=r"keeps 'ax' in full precision"):
        stepfuse.Optimizer(stepfuse.ASGD(), [(w, g)], state_formats={"ax": "q8"})
    with pytest.raises(ValueError, match=r"no state stream 'exp_avgs' \(its state streams: 'exp_avg', 'exp_avg_sq'\)"):
        stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_formats={"exp_avgs": "q8"})
    with pytest.raises(ValueError, match="a second time"):
        stepfuse.Optimizer(stepfuse.AdamW(), [(w, g)], state_formats=[("exp_avg", "q8"), ("exp_avg", "bf16")])
    # f32 for a full-precision stream is fine, and so is q8 for ASGD's streams that have none.
    stepfuse.Optimizer(stepfuse.ASGD(), [(w, g)], state_formats={"ax": "f32"}).step()


def test_group_formats():
    a, b, c = pair(5000, 4), pair(5000, 5), pair(5000, 6)
    opt = stepfuse.Optimizer.from_groups([([a], stepfuse.AdamW()), ([b], stepfuse.AdamW(), "bf16"),
                                          ([c], stepfuse.AdamW(), None)],
                                         state_format="q8", state_formats={"exp_avg_sq": "f32"})
    got = [(opt.state_format(i, "exp_avg").name, opt.state_format(i, "exp_avg_sq").name) for i in range(3)]
    assert got == [("q8", "f32"), ("bf16", "f32"), ("q8", "f32")]
    d = pair(5000, 7)
    opt.add_param_group([d], stepfuse.AdamW(), state_format=stepfuse.StateFormat.bf16)
    assert opt.state_format(3, "exp_avg").name == "bf16"
    opt.step()
    with pytest.raises(TypeError, match=r"must be a \(params, config\) pair or a \(params, config, state_format\)"):
        stepfuse.Optimizer.from_groups([([a], stepfuse.AdamW(), "q8", 1)])
    with pytest.raises(ValueError, match="groups\\[0\\] state_format 'x8'"):
        stepfuse.Optimizer.from_groups([([a], stepfuse.AdamW(), "x8")])


def run_binding(fmt, steps, n=5000, config=None, **options):
    """An optimizer over one tensor of n elements stepped on fixed gradients; its weight."""
    w, g = pair(n, 8)
    opt = stepfuse.Optimizer(config or stepfuse.AdamW(lr=1e-2, weight_decay=0.1, amsgrad=True), [(w, g)],
                             state_format=fmt, **options)
    for grad in grads_of(n, steps):
        g.copy_(grad)
        opt.step()
    return opt, w


@pytest.mark.parametrize("fmt", ["bf16", "q8"])
@pytest.mark.parametrize("name", ["AdamW", "LAMB"])
def test_step_is_the_f32_step_with_state_encoded(fmt, name):
    """AdamW (amsgrad) and LAMB (two phases: its trust ratio's norms and its update must
    see the same moments) for 10 steps over 5003 elements: the weights and state are, bit
    for bit, the f32 run's whose state is encoded and decoded after every step by the
    references above, and the stored bytes are the references' encoding (q8: codes and
    absmax)."""
    n, steps = 5003, 10
    if name == "AdamW":
        cfg = stepfuse.AdamW(lr=1e-2, weight_decay=0.1, amsgrad=True)
    else:
        cfg = stepfuse.LAMB(lr=1e-2, weight_decay=0.01)
    w, g = pair(n, 9)
    w32, g32 = w.clone(), g.clone()
    opt = stepfuse.Optimizer(cfg, [(w, g)], state_format=fmt)
    ref = stepfuse.Optimizer(cfg, [(w32, g32)])
    names = opt.state_names()
    assert names == (["exp_avg", "exp_avg_sq", "max_exp_avg_sq"] if name == "AdamW" else ["exp_avg", "exp_avg_sq"])
    for s, grad in enumerate(grads_of(n, steps)):
        g.copy_(grad)
        g32.copy_(grad)
        opt.step()
        ref.step()
        for name in names:
            exact = ref.state(0, name).copy()
            ref.state(0, name)[:] = encode_decode(fmt, exact, SIGNED[name])
            assert np.array_equal(opt.state_values(0, name), ref.state(0, name)), (s, name)
            if fmt == "q8":
                codes, absmax = q8_encode(exact, SIGNED[name])
                assert np.array_equal(opt.state_storage(0, name), codes), (s, name)
                assert np.array_equal(opt.state_absmax(0, name), absmax), (s, name)
            else:
                bits = torch.from_numpy(exact).to(torch.bfloat16).view(torch.uint8).numpy()
                assert np.array_equal(opt.state_storage(0, name), bits), (s, name)
        assert torch.equal(w, w32), s


def test_bf16_state_beside_stochastic_weights_rounds_as_asked():
    """bfloat16 weights rounded stochastically: their bf16 state rounds stochastically by
    default, and to nearest even with stochastic_state_rounding=False, where it is then, bit for
    bit, the f32-state run's state rounded to nearest after every step (the weights too)."""
    n, steps = 3001, 4
    cfg = stepfuse.AdamW(lr=1e-2, weight_decay=0.1)
    w32, g32 = pair(n, 5)
    w32, g32 = w32.to(torch.bfloat16), g32.to(torch.bfloat16)
    runs = {}
    for name, options in {"ref": dict(state_format="f32"),
                          "nearest": dict(state_format="bf16", stochastic_state_rounding=False),
                          "stochastic": dict(state_format="bf16")}.items():
        w, g = w32.clone(), g32.clone()
        runs[name] = (stepfuse.Optimizer(cfg, [(w, g)], master_weights=False, stochastic_rounding=True, seed=7,
                                         **options), w, g)
    ref, w_ref, _ = runs["ref"]
    differs = False
    for s, grad in enumerate(grads_of(n, steps)):
        for opt, _, g in runs.values():
            g.copy_(grad.to(torch.bfloat16))
            opt.step()
        for name in ("exp_avg", "exp_avg_sq"):
            ref.state(0, name)[:] = encode_decode("bf16", ref.state(0, name).copy(), SIGNED[name])
            assert np.array_equal(runs["nearest"][0].state_values(0, name), ref.state(0, name)), (s, name)
            differs = differs or not np.array_equal(runs["stochastic"][0].state_values(0, name), ref.state(0, name))
        assert torch.equal(runs["nearest"][1], w_ref), s
    assert differs, "stochastically rounded bf16 state never differed from the nearest one"
    with pytest.raises(TypeError):
        stepfuse.Optimizer(cfg, [(w32.clone(), g32.clone())], stochastic_state_rounding="no")


def test_torch_stochastic_state_rounding(util):
    """stepfuse.torch takes stochastic_state_rounding (default True), keeps it through a deep
    copy, and steps as the binding with it."""
    params = util.make_params([(70, 65), (300,)], dtype=torch.bfloat16)
    opt = sft.AdamW(params, lr=1e-2, master_weights=False, stochastic_rounding=True, seed=3, state_format="bf16",
                    stochastic_state_rounding=False)
    assert opt.stochastic_state_rounding is False
    assert sft.AdamW(util.make_params([(4,)]), lr=1e-2).stochastic_state_rounding is True
    clone = copy.deepcopy(opt)
    assert clone.stochastic_state_rounding is False
    twin = util.clone_params(params)
    other = sft.AdamW(twin, lr=1e-2, master_weights=False, stochastic_rounding=True, seed=3, state_format="bf16")
    train(util, opt, params, 3)
    train(util, other, twin, 3)
    # Nearest and stochastic state: the same first step, different state after it.
    assert not all(torch.equal(opt.state[a]["exp_avg_sq"], other.state[b]["exp_avg_sq"]) for a, b in zip(params, twin))
    grads = [torch.zeros_like(p) for p in params]
    copies = util.clone_params(util.make_params([(70, 65), (300,)], dtype=torch.bfloat16))
    engine = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-2), [(p.detach(), g) for p, g in zip(copies, grads)],
                                master_weights=False, stochastic_rounding=True, seed=3, state_format="bf16",
                                stochastic_state_rounding=False)
    for step in range(3):
        for g, new in zip(grads, util.make_grads(copies, step)):
            g.copy_(new)
        engine.step()
    util.assert_params_equal(copies, params)


def test_set_state_values_encodes_as_a_step():
    """set_state_values(state_values()) of a q8 run, done to an f32 run after every step, makes
    that run the q8 run bit for bit (a helper optimizer with q8 state as the encoder)."""
    n, steps = 4099, 8
    cfg = stepfuse.AdamW(lr=1e-2)
    w, g = pair(n, 10)
    w32, g32 = w.clone(), g.clone()
    hw, hg = pair(n, 10)
    opt = stepfuse.Optimizer(cfg, [(w, g)], state_format="q8")
    ref = stepfuse.Optimizer(cfg, [(w32, g32)])
    helper = stepfuse.Optimizer(cfg, [(hw, hg)], state_format="q8")
    for grad in grads_of(n, steps):
        g.copy_(grad)
        g32.copy_(grad)
        opt.step()
        ref.step()
        for name in ("exp_avg", "exp_avg_sq"):
            helper.set_state_values(0, name, ref.state(0, name))
            ref.set_state_values(0, name, helper.state_values(0, name))
            assert np.array_equal(helper.state_storage(0, name), opt.state_storage(0, name))
    assert torch.equal(w, w32)
    # Values from anything array-like of the right size, any shape; a wrong size is a ValueError.
    helper.set_state_values(0, "exp_avg", torch.ones(n, dtype=torch.float64, requires_grad=True))
    assert np.array_equal(helper.state_values(0, "exp_avg"), np.ones(n, dtype=np.float32))
    helper.set_state_values(0, "exp_avg", [0.5] * n)
    assert np.array_equal(helper.state_values(0, "exp_avg"), np.full(n, 0.5, dtype=np.float32))
    with pytest.raises(ValueError, match="3 values for state 'exp_avg' of param 0, which has 4099 elements"):
        helper.set_state_values(0, "exp_avg", np.zeros(3, dtype=np.float32))


def test_storage_views_restore_bit_for_bit():
    """state_storage() and state_absmax() are writable zero-copy views: copying another
    optimizer's bytes into them restores its state bit for bit (the next steps equal)."""
    a, wa = run_binding("q8", 3, state_formats={"exp_avg_sq": "bf16"})
    b, wb = run_binding("q8", 0, state_formats={"exp_avg_sq": "bf16"})
    wb.copy_(wa)
    b.set_group_step_count(0, 3)
    for name in a.state_names():
        b.state_storage(0, name)[:] = a.state_storage(0, name)
        b.state_absmax(0, name)[:] = a.state_absmax(0, name)
    for opt in (a, b):
        opt.params()[0][1].copy_(torch.ones(5000))
        opt.step()
    assert torch.equal(wa, wb)
    for name in a.state_names():
        assert np.array_equal(a.state_storage(0, name), b.state_storage(0, name))


@pytest.mark.parametrize("fmt", ["bf16", "q8"])
def test_bitwise_across_backends_and_threads(fmt):
    _, ref = run_binding(fmt, 6, n=70001, fusion="fused", num_threads=1)
    cases = [dict(fusion="fused", num_threads=2), dict(fusion="unfused", num_threads=1),
             dict(fusion="unfused", num_threads=3), dict(fusion="interpreted", num_threads=2)]
    if stepfuse.llvm_version():
        cases += [dict(fusion="fused", cpu_backend="highway", num_threads=2),
                  dict(fusion="fused", cpu_backend="llvm", num_threads=3)]
    for kw in cases:
        opt, w = run_binding(fmt, 6, n=70001, **kw)
        assert torch.equal(w, ref), kw


def test_checkpoints_convert_state(tmp_path):
    """save()/load(): a stream saved in this optimizer's format loads bit for bit; in another
    format it is a ValueError (nothing changes), unless convert_state=True: then it is decoded
    and encoded as a step stores it. load_shards() and load() with a scaler take convert_state
    too. (q8 into f32: test_checkpoint_q8_into_f32_decodes_with_the_streams_map.)"""
    q8, _ = run_binding("q8", 4)
    names = q8.state_names()
    path = str(tmp_path / "q8.safetensors")
    q8.save(path)

    same, _ = run_binding("q8", 0)
    same.load(path)
    assert same.step_count == 4
    for name in names:
        assert np.array_equal(same.state_storage(0, name), q8.state_storage(0, name))
        assert np.array_equal(same.state_absmax(0, name), q8.state_absmax(0, name))

    f32, _ = run_binding("f32", 0)
    with pytest.raises(ValueError, match="state 'exp_avg' was saved as q8, this optimizer stores it as f32"):
        f32.load(path)
    assert not f32.state(0, "exp_avg").any() and f32.step_count == 0  # nothing changed
    with pytest.raises(ValueError, match="saved as q8"):
        f32.load_shards([path])

    for load in ("load", "load_shards"):
        bf16, _ = run_binding("bf16", 0)
        getattr(bf16, load)(path if load == "load" else [path], convert_state=True)
        assert bf16.step_count == 4
        for name in names:
            assert np.array_equal(bf16.state_values(0, name), bf16_round(q8.state_values(0, name))), (load, name)

    # f32 and bf16 saved into q8: encoded as a step encodes (the reference's codes).
    for fmt in ("f32", "bf16"):
        saved, _ = run_binding(fmt, 4)
        p = str(tmp_path / f"{fmt}.safetensors")
        saved.save(p)
        back, _ = run_binding("q8", 0)
        with pytest.raises(ValueError, match=f"saved as {fmt}, this optimizer stores it as q8"):
            back.load(p)
        back.load(p, convert_state=True)
        for name in names:
            codes, absmax = q8_encode(saved.state_values(0, name), SIGNED[name])
            assert np.array_equal(back.state_storage(0, name), codes), (fmt, name)
            assert np.array_equal(back.state_absmax(0, name), absmax), (fmt, name)

    scaler = stepfuse.GradScaler("cpu", init_scale=1024.0)
    spath = str(tmp_path / "scaled.safetensors")
    q8.save(spath, scaler)
    other, _ = run_binding("bf16", 0)
    restored = stepfuse.GradScaler("cpu")
    other.load(spath, restored, convert_state=True)
    assert restored.get_scale() == 1024.0
    assert np.array_equal(other.state_values(0, "exp_avg"), bf16_round(q8.state_values(0, "exp_avg")))


def test_loss_scale_optimizer_checkpoint_converts_state(tmp_path):
    """A Keras-style LossScaleOptimizer's checkpoint (the inner optimizer's state and the loss
    scale) into one whose inner optimizer stores the state in another format: a ValueError that
    changes nothing, unless convert_state=True."""
    q8, _ = run_binding("q8", 3)
    lso = stepfuse.LossScaleOptimizer(q8, initial_scale=512.0, dynamic_growth_steps=7)
    path = str(tmp_path / "lso.safetensors")
    lso.save(path)
    f32, _ = run_binding("f32", 0)
    back = stepfuse.LossScaleOptimizer(f32, initial_scale=8.0, dynamic_growth_steps=7)
    with pytest.raises(ValueError, match="saved as q8, this optimizer stores it as f32"):
        back.load(path)
    assert back.loss_scale == 8.0 and f32.step_count == 0 and not f32.state(0, "exp_avg").any()
    back.load(path, convert_state=True)
    assert back.loss_scale == 512.0 and f32.step_count == 3
    for name in q8.state_names():
        assert np.array_equal(f32.state(0, name), q8.state_values(0, name)), name


def test_checkpoint_q8_into_f32_decodes_with_the_streams_map(tmp_path):
    """load(convert_state=True) and load_shards of a q8 checkpoint into an f32 optimizer: each
    stream is the q8 optimizer's values exactly, the non-negative ones (decoded with the
    unsigned map) included."""
    q8, _ = run_binding("q8", 4)
    path = str(tmp_path / "q8.safetensors")
    q8.save(path)
    for load in ("load", "load_shards"):
        f32, _ = run_binding("f32", 0)
        getattr(f32, load)(path if load == "load" else [path], convert_state=True)
        for name in q8.state_names():
            assert np.array_equal(f32.state(0, name), q8.state_values(0, name)), (load, name)


def test_program_builder_values():
    """A custom program's state streams declare their values: q8 uses the unsigned map for a
    non-negative stream, and a full-precision stream stays f32 under a blanket format."""
    b = stepfuse.ProgramBuilder("sq_avg_sgd")
    g = b.stream("grad", stepfuse.StreamRole.grad)
    p = b.stream("param", stepfuse.StreamRole.param)
    m = b.stream("m", values=stepfuse.StateValues.any)
    v = b.stream("v", values=stepfuse.StateValues.nonnegative)
    avg = b.stream("avg", stepfuse.StreamRole.state, 0.0, stepfuse.StateValues.full_precision)
    x = b.mul(b.load(g), b.scalar("gscale"))
    b.store(m, x)
    b.store(v, b.mul(x, x))
    b.store(avg, b.add(b.load(avg), b.load(p)))
    b.store(p, b.sub(b.load(p), b.mul(b.scalar("lr"), x)))
    program = b.build()
    A = stepfuse.StateValues
    assert program.stream_values == [A.any, A.any, A.any, A.nonnegative, A.full_precision]
    up = stepfuse.UpdateProgram(program, [stepfuse.UpdateProgram.gscale(), stepfuse.UpdateProgram.fixed("lr", 0.1)])
    n = 4096
    w, grad = pair(n, 12)
    grad.copy_(torch.randn(n))
    opt = stepfuse.Optimizer(up, [(w, grad)], state_format="q8")
    assert [opt.state_format(0, s).name for s in ("m", "v", "avg")] == ["q8", "q8", "f32"]
    opt.step()
    x = grad.numpy()
    assert np.array_equal(opt.state_storage(0, "m"), q8_encode(x, True)[0])
    assert np.array_equal(opt.state_storage(0, "v"), q8_encode(x * x, False)[0])
    with pytest.raises(ValueError, match="keeps 'avg' in full precision"):
        stepfuse.Optimizer(up, [(w, grad)], state_formats={"avg": "bf16"})
    bad = stepfuse.ProgramBuilder("bad")
    bad.stream("grad", stepfuse.StreamRole.grad, 0.0, stepfuse.StateValues.nonnegative)
    with pytest.raises(ValueError, match="StateValues other than any"):
        bad.build()


# ---- stepfuse.torch ----------------------------------------------------------------------------

ALL = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax", "Adadelta", "Rprop", "ASGD",
       "Lion", "LAMB"]
# Hyperparameters that give every optimizer state streams.
KWARGS = {"SGD": dict(momentum=0.9), "RMSprop": dict(momentum=0.9, centered=True)}
SHAPES = [(70, 65), (64,)]  # 4550 elements (q8 by default) and 64 (f32 below min_q8_numel)


def train(util, opt, params, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, util.make_grads(params, step))
        opt.step()


def stored_dtype(fmt):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "q8": torch.uint8}[fmt]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("fmt", [None, "f32", "bf16", "q8", stepfuse.StateFormat.q8],
                         ids=["None", "f32", "bf16", "q8", "StateFormat.q8"])
def test_every_torch_optimizer_takes_each_format(util, name, fmt):
    """Each optimizer with each format: constructs (ASGD, whose one stream is kept in full
    precision, refuses bf16 and q8 naming 'ax'), steps, keeps each stream in torch's state
    in its stored form (q8: uint8 codes and "<name>_absmax" scales; the small tensor f32), and
    a deep copy keeps the options."""
    cls = getattr(sft, name)
    params = util.make_params(SHAPES)
    fmt_name = fmt.name if isinstance(fmt, stepfuse.StateFormat) else (fmt or "f32")
    if name == "ASGD" and fmt_name != "f32":
        with pytest.raises(ValueError, match="'ax'"):
            cls(params, state_format=fmt, **KWARGS.get(name, {}))
        return
    opt = cls(params, state_format=fmt, **KWARGS.get(name, {}))
    assert opt.state_format == fmt_name and opt.state_formats == {} and opt.min_q8_numel == 4096
    train(util, opt, params, 3)
    for i, p in enumerate(params):
        st = opt.state[p]
        streams = [k for k in opt._state_keys(opt.param_groups[0])]
        assert streams, name
        for k in streams:
            expected = fmt_name if (i == 0 or fmt_name != "q8") else "f32"
            assert st[k].dtype == stored_dtype(expected) and st[k].shape == p.shape, (name, i, k, st[k].dtype)
            assert (k + "_absmax" in st) == (expected == "q8")
            if expected == "q8":
                assert st[k + "_absmax"].dtype == torch.float32
                assert st[k + "_absmax"].shape == (math.ceil(p.numel() / BLOCK),)
    clone = copy.deepcopy(opt)
    assert (clone.state_format, clone.state_formats, clone.min_q8_numel) == (fmt_name, {}, 4096)


def test_torch_option_errors(util):
    params = util.make_params(SHAPES)
    with pytest.raises(ValueError, match="Invalid state_format: 'int8'"):
        sft.AdamW(params, state_format="int8")
    with pytest.raises(TypeError, match="Invalid state_format"):
        sft.AdamW(params, state_format=8)
    with pytest.raises(ValueError, match=r"no state stream 'momentum_buffer' \(its state streams: 'exp_avg', "
                                         r"'exp_avg_sq'\)"):
        sft.AdamW(params, state_formats={"momentum_buffer": "q8"})
    with pytest.raises(ValueError, match="'max_exp_avg_sq'"):
        sft.Adam(params, state_formats={"max_exp_avg_sq": "bf16"})  # not without amsgrad
    sft.Adam(params, amsgrad=True, state_formats={"max_exp_avg_sq": "bf16"})
    with pytest.raises(ValueError, match="keeps 'ax' in full precision"):
        sft.ASGD(params, state_formats={"ax": "q8"})
    with pytest.raises(ValueError, match="Invalid min_q8_numel: -5"):
        sft.AdamW(params, state_format="q8", min_q8_numel=-5)
    with pytest.raises(ValueError, match='Invalid param group "state_format"'):
        sft.AdamW([{"params": params, "state_format": "fp8"}])
    # A stream only a later group's program has may be named (checked once every group is in).
    sft.Adam([{"params": params[:1]}, {"params": params[1:], "amsgrad": True}],
             state_formats={"max_exp_avg_sq": "q8"})
    # A group's format, as a name or a StateFormat (kept as its name).
    opt = sft.AdamW(params[:1], state_format="q8")
    opt.add_param_group({"params": params[1:], "state_format": stepfuse.StateFormat.bf16})
    assert opt.param_groups[1]["state_format"] == "bf16"
    # A group whose format no stream of its program can take is refused, and not kept.
    asgd = sft.ASGD(params[:1])
    with pytest.raises(ValueError, match="'ax' full precision"):
        asgd.add_param_group({"params": params[1:], "state_format": "q8"})
    assert len(asgd.param_groups) == 1


def test_torch_matches_the_binding(util):
    """stepfuse.torch.AdamW(state_format='q8', state_formats={'exp_avg_sq': 'bf16'}) steps as
    stepfuse.Optimizer with those options, bit for bit: weights and stored state."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    params = util.make_params(SHAPES)
    opt = sft.AdamW(params, state_format="q8", state_formats={"exp_avg_sq": "bf16"}, num_threads=1, **kw)
    ws = [p.detach().clone() for p in params]
    gs = [torch.zeros_like(w) for w in ws]
    ref = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-2, weight_decay=0.1), list(zip(ws, gs)), state_format="q8",
                             state_formats={"exp_avg_sq": "bf16"})
    for step in range(6):
        grads = util.make_grads(params, step)
        opt.zero_grad(set_to_none=True)
        util.set_grads(params, grads)
        opt.step()
        for g, grad in zip(gs, grads):
            g.copy_(grad)
        ref.step()
        for i, p in enumerate(params):
            assert torch.equal(p.detach(), ws[i]), (step, i)
            for name in ("exp_avg", "exp_avg_sq"):
                ours = opt.state[p][name].reshape(-1).view(torch.uint8).numpy()
                assert np.array_equal(ours, ref.state_storage(i, name)), (step, i, name)


def regression(make_opt, at=(20, 50, 200)):
    """A least-squares fit of a 64x64 linear layer (4096 weights: q8 by default) with AdamW;
    the loss after each number of steps in `at`."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 64, generator=gen)
    y = x @ (torch.randn(64, 64, generator=gen) / 8) + 0.1 * torch.randn(256, 64, generator=gen)
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.copy_(torch.randn(64, 64, generator=gen) * 0.05)
        model.bias.zero_()
    opt = make_opt(list(model.parameters()))
    losses = []
    for step in range(1, max(at) + 1):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step in at:
            losses.append(float(loss.detach()))
    return losses


def test_torch_close_to_torch_adamw():
    """A small regression: the loss with bf16 or q8 state is within 3% of torch.optim.AdamW's
    (f32 state) after 20, 50 and 200 steps."""
    ref = regression(lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert ref[-1] < 0.1 * ref[0]  # (0.105 after 20 steps, 0.0075 after 200)
    for fmt in ("bf16", "q8"):
        losses = regression(lambda p: sft.AdamW(p, lr=1e-2, state_format=fmt))
        for loss, r in zip(losses, ref):
            assert abs(loss - r) <= 0.03 * r, (fmt, losses, ref)


@pytest.mark.parametrize("fmt", ["bf16", "q8"])
def test_torch_state_dict_round_trips_bitwise(util, fmt):
    """state_dict() holds each stream as stored (bf16: bfloat16; q8: uint8 codes and float32
    scales); through torch.save/torch.load and load_state_dict into a new optimizer with the
    same format it loads bit for bit, and the run continues bitwise as the uninterrupted one."""
    kw = dict(lr=1e-2, amsgrad=True, state_format=fmt)
    params = util.make_params(SHAPES)
    opt = sft.AdamW(params, **kw)
    train(util, opt, params, 3)
    sd = opt.state_dict()
    big = sd["state"][0]
    for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert big[name].dtype == stored_dtype(fmt)
        if fmt == "q8":
            assert big[name + "_absmax"].dtype == torch.float32
    saved = util.save_load(sd)
    weights = util.snapshot(params)
    train(util, opt, params, 3, start=3)

    resumed = util.clone_params(weights)
    o = sft.AdamW(resumed, **kw)
    o.load_state_dict(saved)
    util.assert_state_equal(o.state_dict(), saved)
    train(util, o, resumed, 1, start=3)
    train(util, o, resumed, 2, start=4)
    util.assert_params_equal(resumed, params)
    util.assert_state_equal(o.state_dict(), opt.state_dict())


def test_torch_adamw_checkpoint_into_q8(util):
    """A torch.optim.AdamW state dict (f32 state) loads into stepfuse.torch.AdamW(state_format=
    'q8'): each stream is encoded (the reference's codes), and training continues."""
    params = util.make_params(SHAPES)
    topt = torch.optim.AdamW(params, lr=1e-2)
    train(util, topt, params, 5)
    saved = util.save_load(topt.state_dict())
    ours = util.clone_params(params)
    opt = sft.AdamW(ours, lr=1e-2, state_format="q8")
    opt.load_state_dict(saved)
    train(util, opt, ours, 1, start=5)
    # The loaded state was encoded before the step: one more step of the same run from torch's
    # f32 state encoded by the reference is what stepfuse's binding does to it.
    w, g = params[0].detach().clone(), torch.zeros_like(params[0])
    ref = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-2), [(w, g)], state_format="q8")
    ref.set_group_step_count(0, 5)
    for name in ("exp_avg", "exp_avg_sq"):
        codes, absmax = q8_encode(saved["state"][0][name].numpy(), SIGNED[name])
        ref.state_storage(0, name)[:] = codes
        ref.state_absmax(0, name)[:] = absmax
    g.copy_(util.make_grads(params, 5)[0])
    ref.step()
    assert torch.equal(ours[0].detach(), w)
    st = opt.state[ours[0]]
    assert st["exp_avg"].dtype == torch.uint8 and float(st["step"]) == 6
    # And it keeps training: close to torch's own run.
    train(util, topt, params, 6, start=5)
    train(util, opt, ours, 5, start=6)
    util.assert_params_close(ours, params, atol=2e-2, rtol=0)


def test_torch_q8_into_f32_and_back(util):
    """A q8 state dict loads into an f32 optimizer (decoded: the q8 engine's values, exactly)
    and into a bf16 one (decoded, then rounded); an f32 state dict into a q8 one (encoded)."""
    params = util.make_params(SHAPES)
    q8 = sft.AdamW(params, lr=1e-2, state_format="q8")
    train(util, q8, params, 4)
    decoded = [q8._engine.state_values(0, name).reshape(-1) for name in ("exp_avg", "exp_avg_sq")]
    saved = util.save_load(q8.state_dict())

    f32 = sft.AdamW(util.clone_params(params), lr=1e-2)
    f32.load_state_dict(saved)
    f32_params = f32.param_groups[0]["params"]
    for p in f32_params:
        p.grad = torch.zeros_like(p)
    f32._prepare()  # plans the engine: the state goes in
    st = f32.state[f32_params[0]]
    assert st["exp_avg"].dtype == torch.float32 and "exp_avg_absmax" not in st
    for name, values in zip(("exp_avg", "exp_avg_sq"), decoded):
        assert np.array_equal(st[name].reshape(-1).numpy(), values), name
    # The small tensor was f32 in the q8 optimizer too: taken as it is.
    assert torch.equal(f32.state[f32_params[1]]["exp_avg"], saved["state"][1]["exp_avg"])

    bf16 = sft.AdamW(util.clone_params(params), lr=1e-2, state_format="bf16")
    bf16.load_state_dict(saved)
    for p in bf16.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    bf16._prepare()
    st = bf16.state[bf16.param_groups[0]["params"][0]]
    assert st["exp_avg"].dtype == torch.bfloat16
    assert np.array_equal(st["exp_avg"].float().reshape(-1).numpy(), bf16_round(decoded[0]))

    back = sft.AdamW(util.clone_params(params), lr=1e-2, state_format="q8")
    back.load_state_dict(util.save_load(f32.state_dict()))
    for p in back.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    back._prepare()
    st = back.state[back.param_groups[0]["params"][0]]
    for name, values in zip(("exp_avg", "exp_avg_sq"), decoded):
        codes, absmax = q8_encode(values, SIGNED[name])
        assert np.array_equal(st[name].reshape(-1).numpy(), codes), name
        assert np.array_equal(st[name + "_absmax"].numpy(), absmax), name

    # q8 codes without their scales are refused, saying what is missing.
    broken = copy.deepcopy(saved)
    del broken["state"][0]["exp_avg_absmax"]
    o = sft.AdamW(util.clone_params(params), lr=1e-2, state_format="q8")
    o.load_state_dict(broken)
    with pytest.raises(ValueError, match="'exp_avg_absmax'"):
        train(util, o, o.param_groups[0]["params"], 1, start=4)


def test_torch_group_state_format(util):
    """A param group's "state_format" overrides the blanket format for its params; changing it
    between steps re-plans the engine and converts the state."""
    params = util.make_params([(70, 65), (80, 60)])
    opt = sft.AdamW([{"params": params[:1]}, {"params": params[1:], "state_format": "bf16"}], lr=1e-2,
                    state_format="q8")
    train(util, opt, params, 2)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.uint8
    assert opt.state[params[1]]["exp_avg"].dtype == torch.bfloat16
    assert opt.state_dict()["param_groups"][1]["state_format"] == "bf16"
    before = opt.state[params[1]]["exp_avg_sq"].float().clone()
    opt.param_groups[1]["state_format"] = "f32"
    for p in params:
        p.grad = torch.zeros_like(p)
    opt._prepare()
    st = opt.state[params[1]]
    assert st["exp_avg_sq"].dtype == torch.float32 and torch.equal(st["exp_avg_sq"], before)
    train(util, opt, params, 1, start=2)


def test_torch_pickle_keeps_the_options(util):
    params = util.make_params(SHAPES)
    opt = sft.AdamW(params, lr=1e-2, state_format="bf16", state_formats={"exp_avg": "q8"}, min_q8_numel=1024)
    train(util, opt, params, 2)
    clone = copy.deepcopy(opt)
    assert (clone.state_format, clone.state_formats, clone.min_q8_numel) == ("bf16", {"exp_avg": "q8"}, 1024)
    cparams = clone.param_groups[0]["params"]
    train(util, clone, cparams, 1, start=2)
    train(util, opt, params, 1, start=2)
    util.assert_params_equal(cparams, params)
    assert clone.state[cparams[0]]["exp_avg"].dtype == torch.uint8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_cuda_compressed_state_matches_the_cpu(util):
    """bf16 and q8 state on CUDA: the same steps give the CPU's weights and stored state bit
    for bit (bfloat16 values; q8 codes and absmaxes), with clipping; LAMB's two phases too."""
    cases = [(sft.AdamW, dict(max_grad_norm=1.0, state_format="bf16")),
             (sft.AdamW, dict(max_grad_norm=1.0, state_format="q8")),
             (sft.AdamW, dict(max_grad_norm=1.0, state_formats={"exp_avg": "q8"})),
             (sft.LAMB, dict(state_format="bf16")), (sft.LAMB, dict(state_format="q8"))]
    for cls, kw in cases:
        where = f"{cls.__name__} {kw}"
        cpu, gpu = util.make_params(SHAPES), util.make_params(SHAPES, device="cuda")
        opts = [cls(p, **kw) for p in (cpu, gpu)]
        for o, p in zip(opts, (cpu, gpu)):
            train(util, o, p, 3)
        util.assert_params_equal([p.cpu() for p in gpu], cpu, where)
        for c, g in zip(cpu, gpu):
            for key, value in opts[0].state[c].items():
                assert torch.equal(opts[1].state[g][key].cpu(), value), f"{where}: state {key}"


def test_a_named_stream_no_planned_program_has_waits_for_one():
    """state_formats names a stream only some programs have (Adam's max_exp_avg_sq, with
    amsgrad in one group): steps where no planned program has it (that group without
    gradients, or amsgrad switched off) run, and the stream is stored as named when a
    program has it again."""
    a, b = torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(5000))
    opt = sft.Adam([{"params": [a]}, {"params": [b], "amsgrad": True}], state_formats={"max_exp_avg_sq": "q8"})
    a.grad, b.grad = torch.randn(5000), torch.randn(5000)
    opt.step()
    assert opt.state[b]["max_exp_avg_sq"].dtype == torch.uint8
    b.grad = None
    opt.step()
    opt.param_groups[1]["amsgrad"] = False
    b.grad = torch.randn(5000)
    opt.step()
    opt.param_groups[1]["amsgrad"] = True
    opt.step()
    assert opt.state[b]["max_exp_avg_sq"].dtype == torch.uint8


def test_a_group_format_set_as_the_enum_saves_as_its_name(util):
    """param_groups[i]["state_format"] set by hand to a stepfuse.StateFormat: the group is
    stored as asked, and state_dict() holds the format's name, so the saved dict loads with
    torch.load(weights_only=True)."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = sft.AdamW([p])
    p.grad = torch.randn(5000)
    opt.step()
    opt.param_groups[0]["state_format"] = stepfuse.StateFormat.q8
    sd = opt.state_dict()
    assert sd["param_groups"][0]["state_format"] == "q8"
    util.save_load(sd)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.uint8
