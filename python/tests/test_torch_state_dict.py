"""state_dict() and load_state_dict() in torch's own format: a checkpoint of a
torch.optim optimizer continues in stepfuse.torch's and the reverse (also through
torch.save / torch.load), with training going on as if nothing had moved; the dicts have
torch's structure."""

import copy

import pytest

torch = pytest.importorskip("torch")
import stepfuse.torch as sft  # noqa: E402

BEFORE, AFTER = 10, 15  # steps before the checkpoint, and after it

CASES = [
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, amsgrad=True)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    ("Adagrad", dict(lr=0.05, lr_decay=1e-2)),
    ("RMSprop", dict(lr=1e-3, centered=True, momentum=0.9)),
    ("NAdam", dict(lr=1e-2)),
    ("RAdam", dict(lr=1e-2)),
    ("Adamax", dict(lr=1e-2)),
    ("Adadelta", dict()),
    ("Rprop", dict()),
    ("ASGD", dict(lr=1e-2, t0=5)),
]


def case_id(case):
    name, kwargs = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


def groups(params, **second):
    """Two groups, so the group hyperparameters and the param indices are exercised."""
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, **second}]


# A checkpoint as a deep copy, or through torch.save / torch.load. (Not the live dict:
# torch's state_dict() holds the optimizer's own state tensors, and torch's
# load_state_dict() keeps tensors that need no conversion, so two torch optimizers
# loaded from one live dict would share their state.)
CHECKPOINT = [False, True]
CHECKPOINT_IDS = ["deepcopy", "torch.save"]


def checkpoint(util, sd, through_file):
    return util.save_load(sd) if through_file else copy.deepcopy(sd)


@pytest.mark.parametrize("through_file", CHECKPOINT, ids=CHECKPOINT_IDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_torch_checkpoint_continues_in_stepfuse(util, case, through_file):
    """Train with torch.optim, load its state_dict into stepfuse.torch's optimizer over a copy
    of the weights (built with other hyperparameters: the checkpoint's must win), then
    continue both: the same weights at every step."""
    name, kwargs = case
    ref = util.make_params()
    topt = getattr(torch.optim, name)(groups(ref), **kwargs)
    for step in range(BEFORE):
        topt.zero_grad(set_to_none=True)
        util.set_grads(ref, util.make_grads(ref, step))
        topt.step()
    sd = checkpoint(util, topt.state_dict(), through_file)
    ours = util.clone_params(ref)
    sopt = getattr(sft, name)(groups(ours), **{**kwargs, "lr": 0.5})
    sopt.load_state_dict(sd)
    util.assert_groups_match(sopt, topt)
    util.assert_state_close(sopt, topt)
    util.train_both(topt, sopt, ref, ours, AFTER, start=BEFORE, where="after loading:")
    util.assert_state_close(sopt, topt)


@pytest.mark.parametrize("through_file", CHECKPOINT, ids=CHECKPOINT_IDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_stepfuse_checkpoint_continues_in_torch(util, case, through_file):
    """The reverse: train with stepfuse.torch (and torch alongside), load our state_dict
    into a fresh torch.optim optimizer, continue both."""
    name, kwargs = case
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(groups(ref), **kwargs)
    sopt = getattr(sft, name)(groups(ours), **kwargs)
    util.train_both(topt, sopt, ref, ours, BEFORE)
    sd = checkpoint(util, sopt.state_dict(), through_file)
    # torch resumes from our checkpoint over a copy of our weights; all three go on
    resumed = util.clone_params(ours)
    topt2 = getattr(torch.optim, name)(groups(resumed), **{**kwargs, "lr": 0.5})
    topt2.load_state_dict(sd)
    util.assert_groups_match(topt2, topt)
    for step in range(BEFORE, BEFORE + AFTER):
        grads = util.make_grads(ref, step)
        for opt, params in ((topt, ref), (sopt, ours), (topt2, resumed)):
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, grads)
            opt.step()
        util.assert_params_close(resumed, ours, where=f"step {step}: torch resumed from ours:")
        util.assert_params_close(ours, ref, where=f"step {step}: ours against torch's uninterrupted run:")
    util.assert_state_close(topt2, topt)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_structure_is_torchs(util, case):
    """The same "state" and "param_groups" layout as torch's: param indices, keys per
    param, tensor dtypes and shapes (the step a 0-dim float32 tensor, as torch's), group
    keys and values."""
    name, kwargs = case
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt = getattr(torch.optim, name)(groups(ref, weight_decay=0.0), **kwargs)
    sopt = getattr(sft, name)(groups(ours, weight_decay=0.0), **kwargs)
    util.train_both(topt, sopt, ref, ours, 3)
    tsd, ssd = topt.state_dict(), sopt.state_dict()
    assert set(ssd) == set(tsd) == {"state", "param_groups"}
    assert sorted(ssd["state"]) == sorted(tsd["state"])
    for i in tsd["state"]:
        assert set(ssd["state"][i]) == set(tsd["state"][i]), f"state[{i}]"
        for k, v in tsd["state"][i].items():
            s = ssd["state"][i][k]
            assert type(s) is type(v), f"state[{i}][{k!r}]: {type(s).__name__}, torch's {type(v).__name__}"
            if torch.is_tensor(v):
                assert (s.dtype, s.shape, s.device) == (v.dtype, v.shape, v.device), f"state[{i}][{k!r}]"
    assert len(ssd["param_groups"]) == len(tsd["param_groups"])
    for gs, gt in zip(ssd["param_groups"], tsd["param_groups"]):
        assert gs["params"] == gt["params"]
        assert set(gs) == set(gt), (f"param group keys: ours lacks {sorted(set(gt) - set(gs))}, "
                                    f"has besides torch's {sorted(set(gs) - set(gt))}")
        for k in gt:
            assert gs[k] == gt[k], f"param_groups[{k!r}]: {gs[k]!r}, torch's {gt[k]!r}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_load_then_save_is_identity(util, case):
    """load_state_dict(sd) then state_dict() gives sd back, bitwise."""
    name, kwargs = case
    ref = util.make_params()
    topt = getattr(torch.optim, name)(groups(ref), **kwargs)
    for step in range(4):
        util.set_grads(ref, util.make_grads(ref, step))
        topt.step()
    sd = util.save_load(topt.state_dict())
    sopt = getattr(sft, name)(groups(util.clone_params(ref)), **kwargs)
    sopt.load_state_dict(sd)
    util.assert_state_equal(sopt.state_dict()["state"], sd["state"])


@pytest.mark.parametrize("how", ["deepcopy", "live dict"])
def test_rollback_into_the_same_optimizer(util, how):
    """state_dict() at step 5 (a deep copy, or the live dict torch returns, whose tensors
    keep changing), 5 more steps, load_state_dict() of it into the same optimizer, then 5
    more: the same as torch doing the same."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = torch.optim.AdamW(ref, lr=1e-2), sft.AdamW(ours, lr=1e-2)
    util.train_both(topt, sopt, ref, ours, 5)
    tsd, ssd = topt.state_dict(), sopt.state_dict()
    if how == "deepcopy":
        tsd, ssd = copy.deepcopy(tsd), copy.deepcopy(ssd)
    util.train_both(topt, sopt, ref, ours, 5, start=5)
    topt.load_state_dict(tsd)
    sopt.load_state_dict(ssd)
    util.assert_state_close(sopt, topt)
    util.train_both(topt, sopt, ref, ours, 5, start=10)
    util.assert_state_close(sopt, topt)


def test_state_dict_before_any_step(util):
    """An optimizer that has not stepped has torch's (empty) state; loading an empty state
    into one that has stepped restarts it as torch's does."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = torch.optim.AdamW(ref, lr=1e-2), sft.AdamW(ours, lr=1e-2)
    util.assert_state_equal(sopt.state_dict(), topt.state_dict())
    empty = util.save_load(topt.state_dict())
    util.train_both(topt, sopt, ref, ours, 5)
    topt.load_state_dict(empty)
    sopt.load_state_dict(empty)
    util.train_both(topt, sopt, ref, ours, 10, start=5)
    util.assert_state_close(sopt, topt)


def test_params_without_grad_in_checkpoint(util):
    """A checkpoint where one param never had a gradient (no state) and one has a smaller
    step count than the others, moved both ways."""
    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = torch.optim.Adam(ref, lr=1e-2), sft.Adam(ours, lr=1e-2)
    for step in range(8):
        util.step_both(topt, sopt, ref, ours, step, skip={3} if step < 4 else {1, 3})
    util.assert_state_close(sopt, topt)
    # torch's checkpoint into a fresh stepfuse optimizer, continue both
    ours2 = util.clone_params(ref)
    sopt2 = sft.Adam(ours2, lr=1e-2)
    sopt2.load_state_dict(util.save_load(topt.state_dict()))
    util.train_both(topt, sopt2, ref, ours2, 6, start=8)
    util.assert_state_close(sopt2, topt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_params_checkpoint(util, dtype):
    """bf16/f16 weights with fp32 masters: our state_dict saved and loaded into a fresh
    optimizer over the same weights continues bitwise as the original does."""
    ours = util.make_params(dtype=dtype)
    opt = sft.AdamW(ours, lr=1e-3)
    for step in range(5):
        util.set_grads(ours, util.make_grads(ours, step))
        opt.step()
    sd = util.save_load(opt.state_dict())
    ours2 = util.clone_params(ours)
    opt2 = sft.AdamW(ours2, lr=1e-3)
    opt2.load_state_dict(sd)
    util.step_equal(opt, opt2, ours, ours2, range(5, 15))


def test_mismatched_checkpoint_is_refused(util):
    """A state_dict for other groups or other sizes: the ValueError torch's load_state_dict
    raises, and nothing changes."""
    ref = util.make_params()
    topt = torch.optim.AdamW(groups(ref), lr=1e-2)
    util.set_grads(ref, util.make_grads(ref, 0))
    topt.step()
    sd = topt.state_dict()
    ours = util.make_params()
    sopt = sft.AdamW(ours, lr=1e-2)  # one group where the checkpoint has two
    before = util.state_snapshot(sopt)
    with pytest.raises(ValueError):
        torch.optim.AdamW(util.make_params(), lr=1e-2).load_state_dict(sd)
    with pytest.raises(ValueError):
        sopt.load_state_dict(sd)
    util.assert_state_equal(sopt, before)
    sopt2 = sft.AdamW(groups(util.make_params()[:3]), lr=1e-2)  # a group of another size
    with pytest.raises(ValueError):
        sopt2.load_state_dict(sd)


def test_deepcopy_and_pickle_continue_identically(util):
    """copy.deepcopy and torch.save/torch.load of the optimizer itself (torch pickles its
    defaults, state and param_groups): the copy keeps max_grad_norm and the state, and
    steps bitwise as the original does."""
    import copy
    import io

    ours = util.make_params()
    opt = sft.AdamW(ours, lr=1e-2, max_grad_norm=0.5)
    for step in range(3):
        util.set_grads(ours, util.make_grads(ours, step))
        opt.step()
    dup = copy.deepcopy(opt)
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (dup, loaded):
        assert other.max_grad_norm == 0.5
        params = other.param_groups[0]["params"]
        assert all(p is not q for p, q in zip(params, ours))
    for step in range(3, 6):
        grads = util.make_grads(ours, step)
        for opt_, params in ((opt, ours), (dup, dup.param_groups[0]["params"]),
                             (loaded, loaded.param_groups[0]["params"])):
            util.set_grads(params, grads)
            opt_.step()
        util.assert_params_equal(dup.param_groups[0]["params"], ours, where=f"deepcopy, step {step}:")
        util.assert_params_equal(loaded.param_groups[0]["params"], ours, where=f"pickle, step {step}:")


@pytest.mark.parametrize("direction", ["torch to stepfuse", "stepfuse to torch"])
def test_asgd_checkpoint_after_an_lr_change(util, direction):
    """ASGD's next step uses the eta its last step computed from that step's lr (state "eta"),
    not the lr a scheduler set since: a checkpoint taken after the scheduler moved the lr
    continues as the uninterrupted run, in both directions (param 0 skips a step, so its eta
    differs from the others')."""
    kwargs = dict(lr=0.05, lambd=0.1)
    before, after = 6, 8

    def train(opt, sched, params, steps):
        for step in steps:
            opt.zero_grad(set_to_none=True)
            util.set_grads(params, util.make_grads(params, step), skip=(0,) if step == 2 else ())
            opt.step()
            sched.step()

    ref = util.make_params()
    first = util.clone_params(ref)
    topt = torch.optim.ASGD(ref, **kwargs)
    tsched = torch.optim.lr_scheduler.ExponentialLR(topt, 0.8)
    train(topt, tsched, ref, range(before + after))
    saver, loader = (torch.optim, sft) if direction == "torch to stepfuse" else (sft, torch.optim)
    opt = saver.ASGD(first, **kwargs)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.8)
    train(opt, sched, first, range(before))
    sd, sched_sd = copy.deepcopy(opt.state_dict()), sched.state_dict()
    resumed = util.clone_params(first)
    opt2 = loader.ASGD(resumed, **kwargs)
    sched2 = torch.optim.lr_scheduler.ExponentialLR(opt2, 0.8)
    opt2.load_state_dict(sd)
    sched2.load_state_dict(sched_sd)
    train(opt2, sched2, resumed, range(before, before + after))
    util.assert_params_close(resumed, ref, rtol=1e-5, atol=1e-6)
    util.assert_state_close(opt2, topt)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_asgd_copy_continues(util, how):
    """copy.deepcopy and pickling of ASGD (whose per-param eta lrs are not pickled: they come
    back from the state's "eta"), after a scheduler moved the lr: the copy steps as torch's."""
    import pickle

    ref = util.make_params()
    ours = util.clone_params(ref)
    topt, sopt = torch.optim.ASGD(ref, lr=0.05, lambd=0.1), sft.ASGD(ours, lr=0.05, lambd=0.1)
    for step in range(4):
        util.step_both(topt, sopt, ref, ours, step, skip=(0,) if step == 1 else ())
        for opt in (topt, sopt):
            opt.param_groups[0]["lr"] *= 0.7
    dup = copy.deepcopy(sopt) if how == "deepcopy" else pickle.loads(pickle.dumps(sopt))
    params = dup.param_groups[0]["params"]
    util.train_both(topt, dup, ref, params, 6, start=4)
    util.assert_state_close(dup, topt)
