"""Smoke tests of the core binding (stepfuse._stepfuse), on the CPU.

NumPy always; torch where it is installed (the torch tests skip themselves otherwise).
"""

import math
import pickle

import numpy as np
import pytest

import stepfuse
from stepfuse import _stepfuse


# ---- module ----------------------------------------------------------------------------

def test_version_matches_the_library():
    assert stepfuse.__version__ == stepfuse.version()
    assert stepfuse.__version__.count(".") == 2
    assert isinstance(stepfuse.cpu_target(), str) and stepfuse.cpu_target()
    assert isinstance(stepfuse.llvm_version(), str)
    ok, reason = stepfuse.cuda_available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok or reason


def test_package_reexports_the_extension():
    for name in ["Optimizer", "GradScaler", "LossScaleOptimizer", "UpdateProgram", "ProgramBuilder",
                 "StepResult", "ScalarRule", "ScalarDef", "StreamRole", "DType", "AdamW", "LAMB"]:
        assert getattr(stepfuse, name) is getattr(_stepfuse, name)
        assert name in stepfuse.__all__


def test_importing_stepfuse_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, stepfuse; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- configs ---------------------------------------------------------------------------

CONFIGS = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Lion", "NAdam", "RAdam", "Adamax",
           "Adadelta", "Rprop", "ASGD", "LAMB"]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_defaults_repr_eq_pickle(name):
    cls = getattr(stepfuse, name)
    c = cls()
    assert repr(c).startswith(name + "(lr=")
    assert c == cls() and c != cls(lr=123.0)
    assert eval(repr(c), vars(stepfuse)) == c
    assert pickle.loads(pickle.dumps(c)) == c
    c.lr = 0.5
    assert c.lr == 0.5 and c != cls()
    assert c.to_dict()["lr"] == 0.5


def test_config_fields_and_errors():
    a = stepfuse.AdamW()
    assert (a.lr, a.beta1, a.beta2, a.eps, a.weight_decay, a.amsgrad, a.maximize) == (
        1e-3, 0.9, 0.999, 1e-8, 1e-2, False, False)
    assert stepfuse.AdamW(0.1, 0.8).beta1 == 0.8  # positional, in field order
    assert stepfuse.SGD(lr=1, nesterov=True, momentum=0.9).nesterov is True
    with pytest.raises(TypeError, match="unexpected keyword argument 'betas'"):
        stepfuse.AdamW(betas=(0.9, 0.99))
    with pytest.raises(TypeError, match="amsgrad must be a bool"):
        stepfuse.AdamW(amsgrad=1)
    with pytest.raises(TypeError, match="lr must be a float"):
        stepfuse.AdamW(lr="x")
    with pytest.raises(TypeError, match="multiple values"):
        stepfuse.AdamW(0.1, lr=0.2)


# ---- NumPy -----------------------------------------------------------------------------

def numpy_adamw_reference(w, grads, lr, b1, b2, eps, wd):
    """torch.optim.AdamW's update, in float64."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v) / math.sqrt(1 - b2**t) + eps
        w = w - lr / (1 - b1**t) * m / denom
    return w, m, v


def test_numpy_adamw_in_place_and_state_views():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((7, 5)).astype(np.float32)
    g = np.zeros_like(w)
    w0 = w.copy()
    opt = stepfuse.Optimizer(stepfuse.AdamW(lr=0.01), [(w, g)])
    assert opt.device == "cpu" and opt.num_params == 1 and opt.num_groups == 1
    assert opt.state_names() == ["exp_avg", "exp_avg_sq"]
    grads = [rng.standard_normal(w.shape).astype(np.float32) for _ in range(4)]
    for gs in grads:
        g[...] = gs  # in place: the optimizer reads this buffer
        opt.step()
    assert opt.step_count == 4
    ref_w, ref_m, ref_v = numpy_adamw_reference(w0, grads, 0.01, 0.9, 0.999, 1e-8, 1e-2)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    m = opt.state(0, "exp_avg")
    assert m.shape == w.shape and m.dtype == np.float32
    np.testing.assert_allclose(m, ref_m, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(opt.state(0, "exp_avg_sq"), ref_v, rtol=1e-5, atol=1e-9)
    assert opt.master(0) is None  # float32 weights have no master
    # The view is writable, zero-copy, and keeps the optimizer alive.
    m[...] = 0
    assert not opt.state(0, "exp_avg").any()
    del opt
    m[...] = 1  # still valid memory
    assert m.sum() == m.size


def test_step_scaled_and_clipping():
    w = np.ones(10, np.float32)
    g = np.full(10, 8.0, np.float32)
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=1.0), [(w, g)], max_grad_norm=1.0)
    r = opt.step_scaled(4.0)  # unscaled grads are 2.0 each: norm 2*sqrt(10)
    assert isinstance(r, stepfuse.StepResult)
    assert r.applied and not r.found_inf and not r.pending
    assert r.grad_norm == pytest.approx(2 * math.sqrt(10))
    assert r.clip_coef == pytest.approx(1 / (2 * math.sqrt(10)), rel=1e-5)
    np.testing.assert_allclose(w, 1 - 2 * r.clip_coef, rtol=1e-6)
    assert "applied=True" in repr(r)
    assert opt.last_grad_norm == pytest.approx(r.grad_norm)
    assert opt.last_tensor_grad_norms() == [pytest.approx(r.grad_norm)]
    g[3] = np.inf
    before = w.copy()
    r = opt.step_scaled(4.0)
    assert not r.applied and r.found_inf
    np.testing.assert_array_equal(w, before)
    assert opt.step_count == 1 and opt.last_result.found_inf


def test_errors_become_python_exceptions():
    w = np.zeros(4, np.float32)
    g = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match=r"params\[0\]\.weight has dtype float64"):
        stepfuse.Optimizer(stepfuse.SGD(), [(np.zeros(4), g)])
    with pytest.raises(TypeError, match=r"params\[0\]\.grad has dtype int32"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, np.zeros(4, np.int32))])
    with pytest.raises(ValueError, match=r"not contiguous.*\.contiguous\(\)"):
        stepfuse.Optimizer(stepfuse.SGD(), [(np.zeros((4, 4), np.float32)[:, ::2], np.zeros(8, np.float32))])
    with pytest.raises(TypeError, match="expected a writable tensor"):
        stepfuse.Optimizer(stepfuse.SGD(), [([1.0, 2.0], g)])
    with pytest.raises(TypeError, match="is None"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, None)])
    with pytest.raises(TypeError, match="config must be an optimizer config"):
        stepfuse.Optimizer("adamw", [(w, g)])
    # stepfuse::Error(invalid_argument) -> ValueError, with the library's message.
    with pytest.raises(ValueError, match="lr"):
        stepfuse.Optimizer(stepfuse.SGD(lr=-1.0), [(w, g)])
    with pytest.raises(ValueError):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, np.zeros(5, np.float32))])
    with pytest.raises(ValueError, match="fusion 'fast' is not one of 'fused', 'unfused', 'interpreted'"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, g)], fusion="fast")
    with pytest.raises(ValueError, match="cpu_backend 'gpu' is not one of None, 'auto', 'highway', 'llvm'"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, g)], cpu_backend="gpu")
    with pytest.raises(ValueError, match="device 'tpu'"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, g)], device="tpu")
    with pytest.raises(ValueError, match="cuda:0"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, g)], device="cuda:0")
    opt = stepfuse.Optimizer(stepfuse.SGD(), [(w, g)])
    with pytest.raises(ValueError, match="out of range"):
        opt.state(3, "momentum_buffer")
    with pytest.raises(ValueError):
        opt.state(0, "nope")
    # invalid_state -> RuntimeError: a built-in has no scalars to set.
    with pytest.raises(RuntimeError):
        opt.set_scalar("lr", 0.1)
    # io_error -> RuntimeError
    with pytest.raises(RuntimeError):
        opt.load("/nonexistent/dir/ckpt.safetensors")


def test_read_only_array_is_rejected():
    w = np.zeros(4, np.float32)
    w.setflags(write=False)
    with pytest.raises(TypeError, match="writable"):
        stepfuse.Optimizer(stepfuse.SGD(), [(w, np.zeros(4, np.float32))])


def test_size_one_dims_may_have_any_stride():
    base = np.zeros((4, 3), np.float32)
    col = base[:, :1]  # shape (4, 1), strides (3, 1) elements: not dense
    with pytest.raises(ValueError, match="not contiguous"):
        stepfuse.Optimizer(stepfuse.SGD(), [(col, np.zeros((4, 1), np.float32))])
    row = base[1:2, :]  # shape (1, 3), a size-1 dim with stride 3: contiguous
    stepfuse.Optimizer(stepfuse.SGD(), [(row, np.zeros((1, 3), np.float32))]).step()


def test_groups_hyperparameters_and_set_grads():
    ws = [np.ones(3, np.float32), np.ones(5, np.float32), np.ones(2, np.float32)]
    gs = [np.ones_like(w) for w in ws]
    opt = stepfuse.Optimizer.from_groups(
        [([(ws[0], gs[0]), (ws[1], gs[1])], stepfuse.SGD(lr=0.1)), ([(ws[2], gs[2])], stepfuse.SGD(lr=0.5))])
    assert opt.num_groups == 2 and opt.num_params == 3
    assert [opt.group_of(i) for i in range(3)] == [0, 0, 1]
    assert opt.lr(1) == 0.5 and opt.config(1) == stepfuse.SGD(lr=0.5)
    opt.step()
    np.testing.assert_allclose(ws[0], 0.9)
    np.testing.assert_allclose(ws[2], 0.5)
    opt.set_lr(0.25)
    assert opt.lr(0) == opt.lr(1) == 0.25
    opt.set_lr(0.0, group=1)
    opt.set_config(stepfuse.SGD(lr=0.0), group=0)
    assert opt.config() == stepfuse.SGD(lr=0.0)
    # New gradient buffers: the optimizer reads those from now on.
    new = [np.full_like(w, 2.0) for w in ws]
    opt.set_lr(1.0)
    opt.set_grads(new)
    assert all(p[1] is n for p, n in zip(opt.params(), new))
    opt.step()
    np.testing.assert_allclose(ws[1], 0.9 - 2.0)
    with pytest.raises(ValueError):
        opt.set_grads(new[:2])  # one per param
    with pytest.raises(ValueError):
        opt.set_grads([new[0], new[0], np.zeros(7, np.float32)])
    assert opt.params()[0][1] is new[0]  # unchanged after the errors
    assert opt.group_step_count(1) == 2
    opt.set_group_step_count(1, 10)
    assert opt.group_step_count(1) == 10
    w3, g3 = np.ones(4, np.float32), np.ones(4, np.float32)
    opt.add_param_group([(w3, g3)], stepfuse.SGD(lr=0.5))
    assert opt.num_groups == 3 and opt.group_step_count(2) == 0
    opt.step()
    np.testing.assert_allclose(w3, 0.5)
    assert "SGD" in repr(opt) and "3 groups" in repr(opt)
    with pytest.raises(ValueError, match="same optimizer kind"):
        stepfuse.Optimizer.from_groups([([(ws[0], gs[0])], stepfuse.SGD()), ([(ws[1], gs[1])], stepfuse.Adam())])


def test_checkpoint_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(32).astype(np.float32)
    g = rng.standard_normal(32).astype(np.float32)
    opt = stepfuse.Optimizer(stepfuse.Adam(lr=0.01), [(w, g)])
    scaler = stepfuse.GradScaler("cpu", init_scale=8.0)
    scaler.step(opt)
    scaler.update()
    path = tmp_path / "opt.safetensors"
    opt.save(path, scaler)
    w2 = w.copy()
    opt2 = stepfuse.Optimizer(stepfuse.Adam(lr=0.5), [(w2, g.copy())])
    scaler2 = stepfuse.GradScaler("cpu")
    opt2.load(str(path), scaler2)
    assert opt2.step_count == 1 and opt2.lr() == 0.01
    assert scaler2.get_scale() == scaler.get_scale()
    np.testing.assert_array_equal(opt2.state(0, "exp_avg"), opt.state(0, "exp_avg"))
    opt.step()
    opt2.step()
    np.testing.assert_array_equal(w, w2)


# ---- scalers ---------------------------------------------------------------------------

def test_grad_scaler():
    w = np.ones(4, np.float32)
    g = np.full(4, 64.0, np.float32)
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=1.0), [(w, g)])
    s = stepfuse.GradScaler("cpu", init_scale=64.0, growth_interval=1)
    assert s.is_enabled() and s.get_scale() == 64.0 and s.scale(2.0) == 128.0
    assert s.step(opt) is True
    assert s.last_step_result.applied
    np.testing.assert_allclose(w, 0.0)
    s.update()
    assert s.get_scale() == 128.0
    sd = s.state_dict()
    assert sd == {"scale": 128.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1,
                  "_growth_tracker": 0}
    assert isinstance(sd["growth_interval"], int)
    g[0] = np.nan
    assert s.step(opt) is False
    s.update()
    assert s.get_scale() == 64.0
    s2 = stepfuse.GradScaler("cpu")
    s2.load_state_dict(sd)
    assert s2.get_scale() == 128.0 and s2.get_growth_interval() == 1
    with pytest.raises(ValueError):
        stepfuse.GradScaler("cpu", growth_factor=0.5)
    with pytest.raises(RuntimeError):
        s.update()  # nothing stepped since the last update
    t = np.ones(3, np.float32)
    s.scale_(t)
    np.testing.assert_allclose(t, 64.0)
    off = stepfuse.GradScaler("cpu", enabled=False)
    assert off.get_scale() == 1.0 and off.state_dict() == {} and "enabled=False" in repr(off)


def test_grad_scaler_keeps_optimizers_alive():
    import gc

    s = stepfuse.GradScaler("cpu")
    w, g = np.ones(4, np.float32), np.zeros(4, np.float32)
    opt = stepfuse.Optimizer(stepfuse.SGD(), [(w, g)])
    s.step(opt)
    del opt
    gc.collect()
    s.update()  # refers to the optimizer stepped: still alive


def test_loss_scale_optimizer():
    w = np.ones(4, np.float32)
    g = np.zeros(4, np.float32)
    opt = stepfuse.Optimizer(stepfuse.Adam(lr=0.1), [(w, g)])
    lso = stepfuse.LossScaleOptimizer(opt, dynamic_growth_steps=2)
    assert lso.loss_scale == 32768.0 and lso.dynamic and lso.dynamic_growth_steps == 2
    assert lso.inner_optimizer is opt
    assert lso.get_scaled_loss(2.0) == 65536.0

    def backward(scale):
        g[...] = 0.5 * scale

    assert lso.minimize(backward) is True
    assert lso.iterations == 1 and lso.dynamic_counter == 1 and lso.last_result.applied
    g[...] = lso.loss_scale * 0.5
    lso.get_unscaled_gradients([g])
    np.testing.assert_allclose(g, 0.5)
    assert lso.apply_gradients() is True
    assert lso.loss_scale == 65536.0  # grew after 2 finite steps
    assert lso.get_hyper("learning_rate") == pytest.approx(0.1)
    lso.set_hyper("beta_1", 0.8)
    assert opt.config().beta1 == 0.8
    lso.lr = 0.01
    assert opt.lr() == 0.01 and lso.lr == 0.01
    assert "learning_rate" in lso.hyper_names()
    with pytest.raises(ValueError):
        lso.get_hyper("epsilon")

    def failing(scale):
        raise KeyError("from backward")

    with pytest.raises(KeyError, match="from backward"):
        lso.minimize(failing)
    del opt
    assert lso.inner_optimizer.num_params == 1  # kept alive


# ---- update programs -------------------------------------------------------------------

def lion_soft_sign(lr=0.01, beta1=0.9, beta2=0.99, weight_decay=0.1, tau=0.02):
    """examples/lion_soft_sign.hpp, built from Python."""
    b = stepfuse.ProgramBuilder("lion_soft_sign")
    grad = b.stream("grad", stepfuse.StreamRole.grad)
    param = b.stream("param", stepfuse.StreamRole.param)
    exp_avg = b.stream("exp_avg", stepfuse.StreamRole.state)
    raw = b.load(grad)
    g = b.mul(raw, b.scalar("gscale"))
    m = b.load(exp_avg)
    c = b.add(b.mul(b.scalar("beta1"), m), b.mul(b.scalar("one_minus_beta1"), g))
    t = b.scalar("tau")
    u = b.select(b.lt(t, b.abs(c)), b.sign(c), b.div(c, t))
    p = b.mul(b.load(param), b.scalar("decay"))
    b.store(param, b.sub(p, b.mul(b.scalar("lr"), u)))
    b.store(exp_avg, b.add(b.mul(b.scalar("beta2"), m), b.mul(b.scalar("one_minus_beta2"), g)))
    U = stepfuse.UpdateProgram
    return U(b.build(), [U.gscale("gscale"), U.fixed("beta1", beta1), U.fixed("one_minus_beta1", 1 - beta1),
                         U.fixed("tau", tau), U.fixed("decay", 1 - lr * weight_decay), U.fixed("lr", lr),
                         U.fixed("beta2", beta2), U.fixed("one_minus_beta2", 1 - beta2)])


def test_custom_program_runs():
    prog = lion_soft_sign()
    assert prog.name == "lion_soft_sign" and "scalars" in prog.text and str(prog) == prog.text
    assert prog.scalar("lr") == stepfuse.UpdateProgram.fixed("lr", 0.01)
    assert prog.program.stream_names == ["grad", "param", "exp_avg"]
    rng = np.random.default_rng(2)
    w = rng.standard_normal(100).astype(np.float32)
    g = rng.standard_normal(100).astype(np.float32)
    w0, g0 = w.astype(np.float64), g.astype(np.float64)
    opt = stepfuse.Optimizer(prog, [(w, g)])
    assert opt.is_custom and opt.scalar("tau") == 0.02 and opt.lr() == 0.01
    opt.step()
    c = 0.1 * g0
    u = np.where(0.02 < np.abs(c), np.sign(c), c / 0.02)
    np.testing.assert_allclose(w, w0 * (1 - 0.01 * 0.1) - 0.01 * u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(opt.state(0, "exp_avg"), 0.01 * g0, rtol=1e-5, atol=1e-7)
    opt.set_scalar("tau", 0.05)
    assert opt.scalar("tau") == 0.05
    opt.set_lr(0.02)
    assert opt.update_program().scalar("lr").rule.a == 0.02
    with pytest.raises(RuntimeError):
        opt.config()


def test_builder_errors_and_builtin_programs():
    b = stepfuse.ProgramBuilder("bad")
    b.stream("grad", stepfuse.StreamRole.grad)
    b.stream("param", stepfuse.StreamRole.param)
    with pytest.raises(ValueError, match="never stores the param"):
        b.build()
    other = stepfuse.ProgramBuilder("other")
    s = other.stream("grad", stepfuse.StreamRole.grad)
    with pytest.raises(ValueError, match="another ProgramBuilder"):
        b.load(s)
    prog = stepfuse.UpdateProgram.from_config(stepfuse.AdamW())
    assert prog.name and "scalars" in prog.text
    assert [d.name for d in prog.scalars]
    r = stepfuse.ScalarRule(stepfuse.ScalarRule.Kind.div_one_minus_pow, a=0.1, b=0.9)
    assert r.eval(1) == pytest.approx(1.0)
    d = stepfuse.UpdateProgram.bias_correction1_step_size("step_size", 0.1, 0.9)
    assert d.rule == r and "div_one_minus_pow" in repr(d)


# ---- torch -----------------------------------------------------------------------------

def test_torch_adamw_matches_torch_optim():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    shapes = [(31, 17), (64,), (3,)]
    ref = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    for p in ours:
        p.grad = torch.zeros_like(p)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    opt = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-2, weight_decay=0.1), [(p, p.grad) for p in ours])
    for step in range(5):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        for p, g in zip(ours, grads):
            p.grad.copy_(g)
        ref_opt.step()
        opt.step()
        for a, e in zip(ours, ref):
            torch.testing.assert_close(a.detach(), e.detach(), rtol=1e-5, atol=1e-6)
    for i, p in enumerate(ref):
        st = ref_opt.state[p]
        torch.testing.assert_close(torch.from_numpy(opt.state(i, "exp_avg")), st["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.from_numpy(opt.state(i, "exp_avg_sq")), st["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)


def test_torch_parameters_stand_for_their_pairs_and_bf16():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    w.grad = torch.randn(64, dtype=torch.bfloat16)
    w0 = w.detach().float().clone()
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=0.1), [w])
    assert opt.params()[0][0] is w
    opt.step()
    master = opt.master(0)
    assert master is not None and master.dtype == np.float32 and master.shape == (64,)
    expected = w0 - 0.1 * w.grad.float()
    torch.testing.assert_close(torch.from_numpy(master.copy()), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(w.detach(), expected.to(torch.bfloat16))
    # Writable: a restored master is what the next step starts from.
    assert master.flags.writeable
    master[...] = 1.0
    w.grad.zero_()
    opt.step()
    assert torch.equal(w.detach(), torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype float64"):
        stepfuse.Optimizer(stepfuse.SGD(), [(torch.zeros(3, dtype=torch.float64), torch.zeros(3))])
    with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
        t = torch.zeros(4, 4)
        stepfuse.Optimizer(stepfuse.SGD(), [(t.t(), torch.zeros(4, 4))])
    f16 = torch.zeros(8, dtype=torch.float16)
    stepfuse.Optimizer(stepfuse.Adam(), [(f16, torch.zeros(8, dtype=torch.float16))], master_weights=False).step()


def test_torch_tensors_outlive_python_references():
    torch = pytest.importorskip("torch")
    import gc

    opt = stepfuse.Optimizer(stepfuse.SGD(lr=1.0), [(torch.ones(1000), torch.ones(1000))])
    gc.collect()
    opt.step()
    w, g = opt.params()[0]
    assert torch.equal(w, torch.zeros(1000))


def test_set_grad_pointers_and_release_grads():
    """set_grad_pointers re-points the gradients by address (as set_grads does, bitwise),
    keeping no reference to them; release_grads drops the references the constructor
    took; a wrong count or a null pointer is a ValueError that changes nothing."""
    rng = np.random.default_rng(3)
    sizes = (5000, 3, 40000)
    w1 = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    w2 = [w.copy() for w in w1]
    g_old = [np.zeros(n, np.float32) for n in sizes]
    a = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-2), list(zip(w1, g_old)), num_threads=1)
    b = stepfuse.Optimizer(stepfuse.AdamW(lr=1e-2), list(zip(w2, [g.copy() for g in g_old])), num_threads=1)
    a.release_grads()
    assert all(g is None for _, g in a.params())
    for step in range(3):
        fresh = [rng.standard_normal(n).astype(np.float32) for n in sizes]
        a.set_grad_pointers([g.ctypes.data for g in fresh])
        b.set_grads([g.copy() for g in fresh])
        a.step()
        b.step()
    for x, y in zip(w1, w2):
        assert np.array_equal(x, y)
    with pytest.raises(ValueError, match="2 pointers for 3 params"):
        a.set_grad_pointers([fresh[0].ctypes.data, fresh[1].ctypes.data])
    with pytest.raises(ValueError, match="null"):
        a.set_grad_pointers([0, fresh[1].ctypes.data, fresh[2].ctypes.data])
    before = [w.copy() for w in w1]
    a.step()  # still the last valid pointers
    assert not all(np.array_equal(x, y) for x, y in zip(w1, before))
