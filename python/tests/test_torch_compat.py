"""stepfuse.torch against torch.optim where training code meets the optimizer's edges:
checkpoints saved by an older torch, load_state_dict pre-hooks, param group dicts kept by
the caller, Rprop's first step after a skipped one, state of the wrong shape, and
non-contiguous gradients written in place."""

import copy

import pytest

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

# Group keys torch added over its versions (torch 2.0's checkpoints lack some of them):
# a loaded group takes their defaults, as torch's own __setstate__ gives them.
NEWER_KEYS = ("maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")
NEWER_KEYS_OF = {"SGD": ("nesterov",), "Adam": ("amsgrad",), "AdamW": ("amsgrad",), "RMSprop": ("momentum", "centered")}


def _older(state_dict, removed):
    """state_dict as an older torch saved it: the group keys `removed` left out, scalar
    state as Python numbers."""
    sd = copy.deepcopy(state_dict)
    for g in sd["param_groups"]:
        for k in removed:
            g.pop(k, None)
    for st in sd["state"].values():
        for k in ("step", "eta", "mu", "mu_product"):
            if isinstance(st.get(k), torch.Tensor):
                st[k] = int(st[k].item()) if k == "step" else float(st[k].item())
    return sd


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax",
                                  "Adadelta", "Rprop", "ASGD"])
def test_checkpoint_of_an_older_torch_resumes_as_torchs(util, name):
    ref = util.make_params()
    ours = util.clone_params(ref)
    kwargs = dict(momentum=0.9) if name == "SGD" else {}
    saver = getattr(torch.optim, name)(util.clone_params(ref), **kwargs)
    for step in range(3):
        util.set_grads(saver.param_groups[0]["params"], util.make_grads(ref, step))
        saver.step()
    old = _older(saver.state_dict(), NEWER_KEYS + NEWER_KEYS_OF.get(name, ()))
    with torch.no_grad():
        for p, q, s in zip(ref, ours, saver.param_groups[0]["params"]):
            p.copy_(s)
            q.copy_(s)
    topt, oopt = getattr(torch.optim, name)(ref, **kwargs), getattr(sft, name)(ours, **kwargs)
    topt.load_state_dict(copy.deepcopy(old))
    oopt.load_state_dict(copy.deepcopy(old))
    util.assert_groups_match(oopt, topt)
    for st in oopt.state.values():
        for k in ("step", "eta", "mu", "mu_product"):
            if k in st:
                assert isinstance(st[k], torch.Tensor) and st[k].dtype == torch.float32, k
    # ASGD's eta follows the lr of each step: a schedule shows whether the loaded eta is used.
    tsched = torch.optim.lr_scheduler.ExponentialLR(topt, 0.5)
    osched = torch.optim.lr_scheduler.ExponentialLR(oopt, 0.5)
    for step in range(3, 6):
        util.step_both(topt, oopt, ref, ours, step, where=name)
        tsched.step()
        osched.step()


def test_adamw_loaded_from_an_adam_checkpoint_is_decoupled(util):
    params = util.make_params()
    adam = torch.optim.Adam(util.clone_params(params), weight_decay=0.1)
    adamw = sft.AdamW(params, weight_decay=0.1)
    adamw.load_state_dict(adam.state_dict())
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True
    assert adamw.state_dict()["param_groups"][0]["decoupled_weight_decay"] is True


@pytest.mark.parametrize("hook", ["drop_param", "drop_key", "halve"])
def test_load_pre_hooks_result_is_what_loads(util, hook):
    """A load_state_dict pre-hook's changes (a dropped param state, a dropped key, halved
    values) in the dict it returns are what the optimizer loads, also for a bfloat16 model (whose
    state torch casts, which the load then takes at full precision from the hook's dict)."""
    for dtype in (torch.float32, torch.bfloat16):
        ref = util.make_params(dtype=dtype)
        ours = util.clone_params(ref)
        topt, oopt = torch.optim.SGD(ref, lr=0.1, momentum=0.9), sft.SGD(ours, lr=0.1, momentum=0.9)
        util.train_both(topt, oopt, ref, ours, 2, atol=1e-2, rtol=1e-2)
        saved = copy.deepcopy(topt.state_dict())

        def pre_hook(opt, sd):
            sd = copy.deepcopy(sd)  # a new dict: the one passed to load_state_dict keeps everything
            if hook == "drop_param":
                del sd["state"][0]
            elif hook == "drop_key":
                del sd["state"][1]["momentum_buffer"]
            else:
                sd["state"][2]["momentum_buffer"].mul_(0.5)
            return sd

        for opt in (topt, oopt):
            opt.register_load_state_dict_pre_hook(pre_hook)
            opt.load_state_dict(copy.deepcopy(saved))
        assert sorted(k for p in ours for k in oopt.state.get(p, {})) == \
            sorted(k for p in ref for k in topt.state.get(p, {}))
        for p, q in zip(ours, ref):
            for k, v in topt.state.get(q, {}).items():
                assert torch.equal(oopt.state[p][k].to(v.dtype), v), (dtype, hook, k)
        if dtype == torch.float32:  # (bfloat16: our fp32 masters and torch's bf16 steps drift apart)
            util.train_both(topt, oopt, ref, ours, 2, start=2)


def test_param_group_dict_is_the_callers(util):
    """torch keeps the very dict add_param_group is given: an edit of it (an lr set on a
    group the caller kept) is an edit of the optimizer's group."""
    ref, ours = util.make_params(), None
    ours = util.clone_params(ref)
    tgroups = [{"params": ref[:2]}, {"params": ref[2:], "lr": 0.0}]
    ogroups = [{"params": ours[:2]}, {"params": ours[2:], "lr": 0.0}]
    topt, oopt = torch.optim.SGD(tgroups, lr=0.1), sft.SGD(ogroups, lr=0.1)
    assert oopt.param_groups[1] is ogroups[1] and topt.param_groups[1] is tgroups[1]
    util.step_both(topt, oopt, ref, ours, 0)
    tgroups[1]["lr"], ogroups[1]["lr"] = 0.05, 0.05  # "unfreeze the head"
    head = {"params": [torch.nn.Parameter(torch.ones(3))]}
    oopt.add_param_group(head)
    assert oopt.param_groups[-1] is head and head["lr"] == 0.1
    oopt.param_groups.pop()
    util.train_both(topt, oopt, ref, ours, 2, start=1)


@pytest.mark.parametrize("scaler_kind", ["torch", "stepfuse"])
def test_rprop_step_size_starts_at_the_lr_of_its_first_applied_step(util, scaler_kind):
    """A first step the scaler skips (inf), then a warmup's new lr: Rprop's step_size
    starts at the lr of the first applied step, as torch's."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, oopt = torch.optim.Rprop(ref, lr=1e-3), sft.Rprop(ours, lr=1e-3)
    cls = torch.amp.GradScaler if scaler_kind == "torch" else sft.GradScaler
    tscaler, oscaler = torch.amp.GradScaler("cpu", init_scale=8.0), cls("cpu", init_scale=8.0)
    for step in range(4):
        lr = 1e-3 * (step + 1)
        for opt, params, scaler in ((topt, ref, tscaler), (oopt, ours, oscaler)):
            opt.param_groups[0]["lr"] = lr
            scale = float(scaler.scale(torch.ones(())))
            util.set_grads(params, util.make_grads(params, step, scale=scale))
            if step == 0:
                params[0].grad[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        util.assert_params_close(ours, ref, where=f"step {step}:")
    for p, q in zip(ours, ref):
        torch.testing.assert_close(oopt.state[p]["step_size"], topt.state[q]["step_size"])


def test_state_of_another_shape_with_as_many_elements_is_refused(util):
    """A loaded state tensor must have its param's shape (torch's own step fails on one of
    another shape too): two params of shapes (8, 4) and (4, 8) given in the other order."""
    a, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4, 8))
    saver = sft.Adam([a, b])
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    saver.step()
    a2, b2 = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(8, 4))
    opt = sft.Adam([a2, b2])
    opt.load_state_dict(saver.state_dict())
    a2.grad, b2.grad = torch.randn_like(a2), torch.randn_like(b2)
    with pytest.raises(RuntimeError, match=r"shape \(4, 8\) has shape \(8, 4\)"):
        opt.step()


def test_a_non_contiguous_gradient_is_read_anew_every_step(util):
    """p.grad stays the caller's (non-contiguous) tensor, as torch leaves it; a gradient
    written into it in place every step is the one each step reads."""
    ref = [torch.nn.Parameter(torch.randn(6, 5))]
    ours = util.clone_params(ref)
    topt, oopt = torch.optim.SGD(ref, lr=0.1, momentum=0.9), sft.SGD(ours, lr=0.1, momentum=0.9)
    tbuf, obuf = torch.zeros(5, 6), torch.zeros(5, 6)
    ref[0].grad, ours[0].grad = tbuf.t(), obuf.t()
    for step in range(3):
        g = torch.randn(6, 5)
        tbuf.t().copy_(g)
        obuf.t().copy_(g)
        topt.step()
        oopt.step()
        assert ours[0].grad.data_ptr() == obuf.data_ptr()
        util.assert_params_close(ours, ref, where=f"step {step}:")


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax",
                                  "Adadelta", "Rprop", "ASGD"])
def test_an_inf_weight_stays_inf_without_weight_decay(util, name):
    """torch adds weight_decay * p to the gradient only when weight_decay != 0: at 0 an inf
    weight stays inf (0 * inf would be NaN) and the other weights step as usual."""
    ref = [torch.nn.Parameter(torch.tensor([float("inf"), -float("inf"), 1.0, 2.0]))]
    ours = util.clone_params(ref)
    kwargs = dict(weight_decay=0.0) if name != "Rprop" else {}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    topt, oopt = getattr(torch.optim, name)(ref, **kwargs), getattr(sft, name)(ours, **kwargs)
    for step in range(3):
        for params, opt in ((ref, topt), (ours, oopt)):
            params[0].grad = torch.tensor([0.0, 0.0, 1.0, -1.0 - step])
            opt.step()
        torch.testing.assert_close(ours[0], ref[0], equal_nan=True, msg=f"{name} step {step}")
        assert not torch.isnan(ours[0]).any()


def test_loaded_state_that_torch_refuses_or_casts(util):
    """A loaded state without 'step' (for an optimizer that counts steps) is a KeyError at
    the step, as torch's; a stream that is not a tensor a TypeError (torch: an error too);
    an integer stream is taken as its values, as torch casts it."""
    def loaded(edit):
        p = torch.nn.Parameter(torch.ones(4))
        saver = sft.Adam([torch.nn.Parameter(torch.ones(4))])
        saver.param_groups[0]["params"][0].grad = torch.ones(4)
        saver.step()
        sd = copy.deepcopy(saver.state_dict())
        edit(sd["state"][0])
        opt = sft.Adam([p])
        opt.load_state_dict(sd)
        p.grad = torch.ones(4)
        return opt, p

    opt, _ = loaded(lambda st: st.pop("step"))
    with pytest.raises(KeyError, match="no 'step'"):
        opt.step()
    opt, _ = loaded(lambda st: st.__setitem__("exp_avg", 0.5))
    with pytest.raises(TypeError, match="'exp_avg' of a param is a float"):
        opt.step()
    opt, p = loaded(lambda st: st.__setitem__("exp_avg", torch.tensor([1, 2, 3, 4])))
    saver = torch.optim.Adam([torch.nn.Parameter(torch.ones(4))])
    saver.param_groups[0]["params"][0].grad = torch.ones(4)
    saver.step()
    sd = copy.deepcopy(saver.state_dict())
    sd["state"][0]["exp_avg"] = torch.tensor([1, 2, 3, 4])
    ref = torch.nn.Parameter(torch.ones(4))
    topt = torch.optim.Adam([ref])
    topt.load_state_dict(sd)
    ref.grad = torch.ones(4)
    opt.step()
    topt.step()
    torch.testing.assert_close(p, ref)
    assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_adagrad_share_memory_says_it_cannot():
    opt = sft.Adagrad([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(NotImplementedError, match="share_memory"):
        opt.share_memory()


def test_load_post_hooks_see_the_state_as_loaded():
    """A load_state_dict post-hook's edits stand, also for a bfloat16 model (whose state is
    taken at full precision from the saved dict before the caller's post-hooks run)."""
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.nn.Parameter(torch.ones(2, dtype=dtype))]
        opt = sft.SGD(params, lr=0.1, momentum=0.9)
        params[0].grad = torch.tensor([6.0, 3.0], dtype=dtype)
        opt.step()
        saved = copy.deepcopy(opt.state_dict())
        opt.register_load_state_dict_post_hook(lambda o: o.state[params[0]]["momentum_buffer"].zero_())
        opt.load_state_dict(saved)
        assert torch.equal(opt.state[params[0]]["momentum_buffer"].float(), torch.zeros(2)), dtype


def test_tiny_and_bad_scales_under_the_scalers():
    """Scales in (0, 2^-128] skip the step under stepfuse.torch.GradScaler (found_inf: the
    scale backs off); a NaN scale is an error, as a negative one."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = sft.AdamW([p])
    for tiny in (2.0**-128, 2.0**-140):
        scaler = sft.GradScaler("cpu", init_scale=tiny)
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(4)
        scaler.step(opt)
        scaler.update()
        assert torch.equal(p, torch.ones(4)) and scaler.get_scale() == tiny / 2
    p.grad = torch.ones(4)
    for bad in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="loss_scale"):
            opt._step_scaled(bad)


def test_non_contiguous_gradient_copies_are_not_kept_past_the_step():
    p = torch.nn.Parameter(torch.ones(64, 32))
    opt = sft.SGD([p], lr=0.1)
    p.grad = torch.ones(32, 64).t()
    opt.step()
    assert not opt._flat_grads
