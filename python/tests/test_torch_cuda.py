"""stepfuse.torch on CUDA: the core checks of the CPU tests on the GPU (AdamW against
torch's fused AdamW, both scalers with inf/NaN steps, bf16 weights with fp32 masters, the
fused clip), the step on torch.cuda.current_stream(), a torch.cuda.graph capture of
scaler.step(opt); scaler.update() replayed with new gradients and a new lr, and params
or gradients on the wrong device. Skipped without a GPU."""

import pytest

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 25
INIT_SCALE = 2.0**12
BAD = {0: (float("inf"), 3, 7), 5: (float("nan"), 0, 1), 6: (float("-inf"), 1, 0), 17: (float("nan"), 3, 16000)}


def cuda_params(util, dtype=None):
    return util.make_params(device="cuda", dtype=dtype)


def scaled_grads(util, params, step, scale, bad=BAD):
    grads = util.make_grads(params, step, scale=scale)
    if step in bad:
        value, i, j = bad[step]
        grads[i].view(-1)[j] = value
    return grads


def current_scale(scaler):
    return float(scaler.scale(torch.ones((), device="cuda")))


def make_scaler(kind):
    cls = torch.amp.GradScaler if kind == "torch" else sft.GradScaler
    return cls("cuda", init_scale=INIT_SCALE, growth_interval=4)


@pytest.mark.parametrize("kwargs", [dict(lr=1e-2, weight_decay=0.1), dict(lr=1e-2, amsgrad=True, maximize=True)],
                         ids=["AdamW", "AdamW-amsgrad-maximize"])
def test_adamw_matches_torch_fused(util, kwargs):
    ref = cuda_params(util)
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, fused=True, **kwargs)
    sopt = sft.AdamW(ours, **kwargs)
    util.train_both(topt, sopt, ref, ours, STEPS)
    torch.cuda.synchronize()
    util.assert_state_close(sopt, topt)
    assert all(p.device.type == "cuda" for p in ours)
    for st in sopt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                assert v.device.type == "cuda", f"state {k!r} is on {v.device}"


def test_sgd_momentum_matches_torch(util):
    ref = cuda_params(util)
    ours = util.clone_params(ref)
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    topt, sopt = torch.optim.SGD(ref, **kwargs), sft.SGD(ours, **kwargs)
    util.train_both(topt, sopt, ref, ours, STEPS)
    util.assert_state_close(sopt, topt)


def test_fused_clip(util):
    ref = cuda_params(util)
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    sopt = sft.AdamW(ours, lr=1e-2, max_grad_norm=1.0)
    for step in range(STEPS):
        grads = util.make_grads(ref, step, scale=1e-3 if step % 3 == 0 else 1.0)
        util.set_grads(ref, grads)
        util.set_grads(ours, grads)
        total = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        topt.step()
        sopt.step()
        torch.testing.assert_close(sopt.last_grad_norm.cpu(), total.cpu(), msg=lambda m: f"step {step}: {m}")
        util.assert_params_close(ours, ref, where=f"step {step}:")


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_scalers(util, scaler_kind):
    """Our AdamW under torch's GradScaler or ours, against torch's fused AdamW under torch's
    GradScaler: the same weights, the same scale and scaler state at every step, nothing
    written on the skipped steps."""
    ref = cuda_params(util)
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    sopt = sft.AdamW(ours, lr=1e-2)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    for step in range(STEPS):
        scale = current_scale(tscaler)
        assert current_scale(oscaler) == scale, f"step {step}"
        grads = scaled_grads(util, ref, step, scale)
        util.set_grads(ref, grads)
        util.set_grads(ours, grads)
        before = util.snapshot(ours)
        tscaler.step(topt)
        oscaler.step(sopt)
        tscaler.update()
        oscaler.update()
        if step in BAD:
            util.assert_params_equal(ours, before, where=f"skipped step {step}:")
        util.assert_params_close(ours, ref, where=f"step {step}:")
        assert oscaler.state_dict() == tscaler.state_dict(), f"step {step}"
    util.assert_state_close(sopt, topt)


def test_bf16_with_fp32_masters(util):
    ours = cuda_params(util, dtype=torch.bfloat16)
    ref = util.clone_params(ours, dtype=torch.float32)
    topt = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    sopt = sft.AdamW(ours, lr=1e-3)
    for step in range(STEPS):
        grads = util.make_grads(ours, step)
        util.set_grads(ours, grads)
        util.set_grads(ref, [g.float() for g in grads])
        topt.step()
        sopt.step()
        util.assert_rounded_from([p.cpu() for p in ours], [p.cpu() for p in ref], where=f"step {step}:")


def test_step_runs_on_the_current_stream(util):
    """The step is enqueued on torch.cuda.current_stream(): on a side stream, behind a long
    kernel and the copy of the new gradients, it must see those gradients."""
    ref = cuda_params(util)
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    sopt = sft.AdamW(ours, lr=1e-2)
    util.train_both(topt, sopt, ref, ours, 2)
    for p in ours:
        p.grad = torch.zeros_like(p)
    grads = util.make_grads(ref, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # well over 10 ms of GPU time on the side stream
        for p, g in zip(ours, grads):
            p.grad.copy_(g)
        sopt.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    util.set_grads(ref, grads)
    topt.step()
    util.assert_params_close(ours, ref)


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_cuda_graph_capture_of_scaled_step(util, scaler_kind):
    """scaler.step(opt); scaler.update() captured in a CUDA graph (capturable=True, the lr a
    CUDA tensor as torch's capturable optimizers take it), replayed with new gradients
    copied into the captured .grad tensors, infs and NaNs at some steps, and the lr tensor
    changed in place halfway: the same weights and loss scale as torch's fused AdamW run
    eagerly."""
    ref = cuda_params(util)
    ours = util.clone_params(ref)
    topt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    lr = torch.tensor(1e-2, device="cuda")
    sopt = sft.AdamW(ours, lr=lr, capturable=True)
    tscaler, oscaler = make_scaler("torch"), make_scaler(scaler_kind)
    for p in ours:
        p.grad = torch.zeros_like(p)

    def reference_step(step):
        grads = scaled_grads(util, ref, step, current_scale(tscaler))
        util.set_grads(ref, grads)
        tscaler.step(topt)
        tscaler.update()
        return grads

    # warm up eagerly on a side stream, as before any capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in range(3):
            assert current_scale(oscaler) == tscaler.get_scale()
            grads = reference_step(step)
            for p, g in zip(ours, grads):
                p.grad.copy_(g)
            oscaler.step(sopt)
            oscaler.update()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    util.assert_params_close(ours, ref, where="after the warm-up:")

    graph = torch.cuda.CUDAGraph()
    current_scale(oscaler)
    with torch.cuda.graph(graph):
        oscaler.step(sopt)
        oscaler.update()

    for step in range(3, STEPS):
        if step == 12:
            lr.fill_(3e-3)
            topt.param_groups[0]["lr"] = 3e-3
        assert oscaler.get_scale() == tscaler.get_scale(), f"step {step}"
        grads = reference_step(step)
        with torch.no_grad():
            for p, g in zip(ours, grads):
                p.grad.copy_(g)
        before = util.snapshot(ours)
        graph.replay()
        torch.cuda.synchronize()
        if step in BAD:
            util.assert_params_equal(ours, before, where=f"replayed skipped step {step}:")
        util.assert_params_close(ours, ref, where=f"replay of step {step}:")
        assert oscaler.get_scale() == tscaler.get_scale(), f"step {step}"


def test_param_on_another_device_is_value_error(util):
    """A CPU param among CUDA params: ValueError (at construction or at the latest at the
    first step, writing nothing)."""
    params = [*cuda_params(util)[:2], torch.nn.Parameter(torch.randn(10))]
    before = util.snapshot(params)
    with pytest.raises(ValueError):
        opt = sft.AdamW(params, lr=1e-2)
        util.set_grads(params, util.make_grads(params, 0))
        opt.step()
    util.assert_params_equal(params, before)


def test_grad_on_another_device(util):
    """A CUDA param with a CPU gradient (torch refuses to assign one; .data gets it there):
    a clear error naming the device, nothing written."""
    ours = cuda_params(util)
    opt = sft.AdamW(ours, lr=1e-2)
    util.set_grads(ours, util.make_grads(ours, 0))
    opt.step()
    util.set_grads(ours, util.make_grads(ours, 1))
    ours[1].grad.data = ours[1].grad.detach().cpu()
    before, before_state = util.snapshot(ours), util.state_snapshot(opt)
    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        opt.step()
    assert "device" in str(info.value) or "cpu" in str(info.value).lower()
    util.assert_params_equal(ours, before)
    util.assert_state_untouched(opt, before_state, "refused step")
