"""The sharded step across processes from Python: stepfuse.Communicator (a C++
communicator implemented in Python), stepfuse.torch.distributed.ProcessGroupCommunicator
over torch.distributed (gloo), and the stepfuse.torch optimizers' communicator=.

The two-process tests start this file as a script, once per rank (python
test_torch_distributed.py CASE RANK WORLD INIT_METHOD): each rank holds its own part of
a small model's params (rank 0 the first K tensors, rank 1 the rest; some tensors span
several 16384-element chunks), computes every step's gradients for the whole model from
a seed, and checks its params bitwise against a one-process stepfuse.torch optimizer over
all of them, built in the same process. Every check runs in the workers; the test fails
with their output when one exits non-zero, and a hung collective ends in gloo's timeout
(or the test's, which kills the workers).
"""

import copy
import datetime
import math
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stepfuse  # noqa: E402
import stepfuse.torch as sft  # noqa: E402

dist = torch.distributed
GLOO = dist.is_available() and dist.is_gloo_available()
needs_gloo = pytest.mark.skipif(not GLOO, reason="torch.distributed with the gloo backend is not available")

WORLD = 2
# The model: tensors over 16384 elements (several chunks) and small ones, two bf16.
SHAPES = [(40000,), (5,), (129, 130), (16385,), (7, 3), (64, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
K = 3  # rank 0 holds SHAPES[:K], rank 1 the rest

# ---- in-process: the binding ------------------------------------------------------------


class LocalCommunicator(stepfuse.Communicator):
    """One rank: every collective is a copy. Records its calls; raises when told to."""

    def __init__(self, fail_at=None):
        super().__init__()
        self.calls = []
        self.fail_at = fail_at  # raise at this collective call (0-based), or None

    def rank(self):
        return 0

    def size(self):
        return 1

    def name(self):
        return "local"

    def _record(self, kind, *arrays):
        self.calls.append((kind, threading.get_ident(), [(a.dtype, a.flags.writeable, a.size) for a in arrays]))
        if self.fail_at is not None and len(self.calls) > self.fail_at:
            raise ValueError(f"{kind} failed on purpose")

    def all_gather(self, send, recv):
        self._record("all_gather", send, recv)
        recv[:] = send

    def all_reduce(self, data, op):
        self._record("all_reduce", data)

    def reduce_scatter(self, send, recv, op):
        self._record("reduce_scatter", send, recv)
        recv[:] = send


NUMPY_TYPES = [np.uint8, np.int32, np.int64, np.float16, np.uint16, np.float32, np.float64]


def test_enums_and_tensor_slice():
    assert [t.name for t in stepfuse.CommType] == ["u8", "i32", "i64", "f16", "bf16", "f32", "f64"]
    assert [op.name for op in stepfuse.ReduceOp] == ["sum", "max", "min"]
    s = stepfuse.TensorSlice(3, offset=2 * stepfuse.SHARD_ALIGN)
    assert (s.tensor, s.offset) == (3, 32768)
    assert s == stepfuse.TensorSlice(tensor=3, offset=32768) and not s == stepfuse.TensorSlice(3)
    assert repr(s) == "TensorSlice(tensor=3, offset=32768)"
    assert stepfuse.SHARD_ALIGN == 16384


def test_communicator_through_the_cpp_interface():
    """Called through the C++ interface (as the step calls it), a Python communicator gets
    zero-copy NumPy arrays of the buffers' dtype, send read-only, on the calling thread."""
    c = LocalCommunicator()
    assert (c.rank(), c.size(), c.name()) == (0, 1, "local")
    assert repr(c) == "Communicator(local, rank=0, size=1)"
    for dt in NUMPY_TYPES:
        send = np.arange(6).astype(dt)
        recv = np.zeros(6, dtype=dt)
        stepfuse.Communicator.all_gather(c, send, recv)
        assert np.array_equal(recv, send)
        stepfuse.Communicator.all_reduce(c, recv, stepfuse.ReduceOp.max)
        out = np.zeros(6, dtype=dt)
        stepfuse.Communicator.reduce_scatter(c, send, out, stepfuse.ReduceOp.sum)
        assert np.array_equal(out, send)
    # bfloat16 from a DLPack exporter that has it (torch) arrives as uint16, its bits.
    t = torch.arange(4, dtype=torch.bfloat16)
    r = torch.zeros(4, dtype=torch.bfloat16)
    stepfuse.Communicator.all_gather(c, t, r)
    assert torch.equal(r, t)
    assert c.calls[-1][2] == [(np.dtype(np.uint16), False, 4), (np.dtype(np.uint16), True, 4)]
    kinds = [(k, [a[0] for a in arrays]) for k, _, arrays in c.calls[:3]]
    assert kinds == [("all_gather", [np.dtype(np.uint8)] * 2), ("all_reduce", [np.dtype(np.uint8)]),
                     ("reduce_scatter", [np.dtype(np.uint8)] * 2)]
    assert all(tid == threading.get_ident() for _, tid, _ in c.calls)
    assert all(not arrays[0][1] for k, _, arrays in c.calls if k != "all_reduce")  # send is read-only
    # What the interface refuses.
    with pytest.raises(TypeError, match="uint8, int32"):
        stepfuse.Communicator.all_reduce(c, np.zeros(3, np.int16), stepfuse.ReduceOp.sum)
    with pytest.raises(TypeError, match="send has type i32 but recv has f32"):
        stepfuse.Communicator.all_gather(c, np.zeros(3, np.int32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="recv has 4 elements"):
        stepfuse.Communicator.all_gather(c, np.zeros(3, np.int32), np.zeros(4, np.int32))
    with pytest.raises(TypeError):  # not contiguous: never a silent copy to write into
        stepfuse.Communicator.all_reduce(c, np.zeros(6, np.float32)[::2], stepfuse.ReduceOp.sum)


def test_missing_method_and_exception_propagate():
    class Partial(stepfuse.Communicator):
        def __init__(self):
            super().__init__()

    with pytest.raises(RuntimeError, match="all_reduce"):
        stepfuse.Communicator.all_reduce(Partial(), np.zeros(2, np.float32), stepfuse.ReduceOp.sum)
    c = LocalCommunicator(fail_at=0)
    with pytest.raises(ValueError, match="all_reduce failed on purpose"):
        stepfuse.Communicator.all_reduce(c, np.zeros(2, np.float32), stepfuse.ReduceOp.sum)


def test_exception_in_a_collective_leaves_nothing_written():
    """A Python exception raised by the communicator during a step (the GIL released)
    comes out of step() as itself, with its message, and nothing has been written; the
    optimizer still works afterwards. Each of a step's collectives in turn fails."""
    weights = [torch.randn(s) for s in [(20000,), (7,)]]
    grads = [torch.randn(w.shape) for w in weights]
    c = LocalCommunicator()
    opt = stepfuse.Optimizer(stepfuse.AdamW(lr=0.1), list(zip(weights, grads)), max_grad_norm=0.5, communicator=c)
    made = len(c.calls)  # construction's
    opt.step()
    n = len(c.calls) - made
    assert n > 0, "a clipped sharded step makes collectives"
    assert all(tid == threading.get_ident() for _, tid, _ in c.calls), "collectives run on the caller's thread"
    for fail_at in range(n):
        before = [w.clone() for w in weights]
        state = [opt.state(0, "exp_avg").copy(), opt.state(1, "exp_avg_sq").copy()]
        count = opt.step_count
        c.fail_at = len(c.calls) + fail_at  # its fail_at-th collective of the next step
        with pytest.raises(ValueError, match="failed on purpose"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(weights, before)), f"collective {fail_at}"
        assert np.array_equal(opt.state(0, "exp_avg"), state[0]), f"collective {fail_at}"
        assert np.array_equal(opt.state(1, "exp_avg_sq"), state[1]), f"collective {fail_at}"
        assert opt.step_count == count
        c.fail_at = None
        opt.step()  # and the optimizer still works
        assert opt.step_count == count + 1


def test_exception_at_construction():
    c = LocalCommunicator(fail_at=0)
    w, g = torch.randn(10), torch.randn(10)
    with pytest.raises(ValueError, match="failed on purpose"):
        opt = stepfuse.Optimizer(stepfuse.SGD(lr=0.1), [(w, g)], max_grad_norm=1.0, communicator=c)
        opt.step()  # if construction made no collective, the step does


def test_optimizer_keywords():
    c = LocalCommunicator()
    w, g = torch.randn(10), torch.randn(10)
    opt = stepfuse.Optimizer(stepfuse.SGD(lr=0.1), [(w, g)], communicator=c, slices=[stepfuse.TensorSlice(0, 0)],
                             max_grad_norm=1.0)
    opt.step()
    opt2 = stepfuse.Optimizer.from_groups([([(w.clone(), g)], stepfuse.SGD(lr=0.1))], communicator=c,
                                          max_grad_norm=1.0, slices=None)
    opt2.step()
    with pytest.raises(TypeError):
        stepfuse.Optimizer(stepfuse.SGD(lr=0.1), [(w, g)], communicator=object())
    del opt, opt2
    assert sys.getrefcount(c) == 2  # the optimizers let go of it


def test_torch_optimizer_with_a_stepfuse_communicator():
    """stepfuse.torch with any stepfuse.Communicator (one rank here): the step goes
    through it; the optimizer refuses to be pickled or copied, and a bad communicator."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(20000,), (3,)]]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    c = LocalCommunicator()
    opt = sft.AdamW(params, lr=1e-2, max_grad_norm=1.0, communicator=c)
    topt = sft.AdamW(ref, lr=1e-2, max_grad_norm=1.0)
    assert opt.communicator is c
    for step in range(3):
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        topt.step()
        assert torch.equal(opt.last_grad_norm, topt.last_grad_norm)
        assert all(torch.equal(p, q) for p, q in zip(params, ref))
    assert c.calls
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="cannot be pickled or copied"):
        pickle.dumps(opt)
    with pytest.raises(TypeError, match="communicator must be"):
        sft.SGD(params, lr=0.1, communicator="world")
    sd = opt.state_dict()  # per rank, as ever
    fresh = sft.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2, max_grad_norm=1.0,
                      communicator=c)
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["state"].keys() == sd["state"].keys()


# ---- two processes over gloo ---------------------------------------------------------------


CASES = ["collectives", "steps", "scalers", "errors", "engine", "rounding", "compensation", "state_formats",
         "written", "load_errors"]


def _launch(cases, timeout=300.0):
    """Runs `cases` in order on WORLD ranks (this file as a script, one process per rank:
    importing torch dominates, so one launch serves every test); returns each rank's
    output. A rank whose case fails prints it and exits at once, so the other's
    collective fails rather than waits; the launch is killed after `timeout` seconds."""
    # Highway kernels: no background LLVM compiles competing for the CPU (every backend
    # gives the same bits).
    env = dict(os.environ, OMP_NUM_THREADS="1", STEPFUSE_NUM_THREADS="1", STEPFUSE_CPU_BACKEND="highway",
               PYTHONWARNINGS="default")
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), ",".join(cases), str(r), str(WORLD),
                                   init], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
                 for r in range(WORLD)]
        deadline = time.monotonic() + timeout
        outs = []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outs = [p.communicate()[0] + f"\n(killed after {timeout:.0f} s)" for p in procs]
    return outs


@pytest.fixture(scope="module")
def gloo_run():
    return _launch(CASES)


def _check_case(outs, case):
    if not all(f"CASE {case} ok" in out for out in outs):
        pytest.fail(f"{case} did not pass on every rank:\n" +
                    "\n".join(f"--- rank {r}:\n{out}" for r, out in enumerate(outs)))


@needs_gloo
def test_collectives_over_gloo(gloo_run):
    """ProcessGroupCommunicator's collectives, every dtype and op, called from Python and
    through the C++ interface, with and without the fallbacks for backends lacking
    all_gather_into_tensor and reduce_scatter_tensor."""
    _check_case(gloo_run, "collectives")


@needs_gloo
def test_adamw_and_sgd_clip_globally(gloo_run):
    """AdamW and SGD (Nesterov momentum, inf-norm) with max_grad_norm: each rank's shard
    bitwise the one-process step's, the same global norm; a re-plan on one rank only is
    a re-plan on both; state_dict per rank; deepcopy refused."""
    _check_case(gloo_run, "steps")


@needs_gloo
def test_grad_scalers_skip_together(gloo_run):
    """stepfuse.torch.GradScaler (fused, and after unscale_) and torch.amp.GradScaler: an
    inf in one rank's gradients skips the step on both; the fused scaler backs off on
    both; torch's backs off only where it saw the inf, with a warning, and the next step
    is refused on both."""
    _check_case(gloo_run, "scalers")


@needs_gloo
def test_errors_raise_on_every_rank(gloo_run):
    """A construction, gradient or engine construction refused on one rank raises on
    every rank (no rank waits); gradients on one rank only; recovery afterwards."""
    _check_case(gloo_run, "errors")


@needs_gloo
def test_engine_slices_and_scaled_steps(gloo_run):
    """stepfuse.Optimizer with a ProcessGroupCommunicator: a tensor split between the
    ranks (slices=) and loss-scaled steps skipped together."""
    _check_case(gloo_run, "engine")


@needs_gloo
def test_stochastic_rounding_sharded(gloo_run):
    """stochastic_rounding=True, seed=...: each rank's shard bitwise the one-process step's
    (the rounding counts elements in the whole model), also when one rank's shard holds
    float32 params alone."""
    _check_case(gloo_run, "rounding")


@needs_gloo
def test_compensated_weights_sharded(gloo_run):
    """compensated_weights=True: each rank's shard, weights and compensations, bitwise the
    one-process step's, also when one rank's shard holds float32 params alone."""
    _check_case(gloo_run, "compensation")


@needs_gloo
def test_state_formats_sharded(gloo_run):
    """state_format='q8' with exp_avg_sq in bf16: each rank's shard, weights and state as
    stored (q8 codes and scales, bf16 values; f32 below min_q8_numel), bitwise the
    one-process step's; a state dict round trip per rank continues bitwise."""
    _check_case(gloo_run, "state_formats")


@needs_gloo
def test_written_weights_sharded(gloo_run):
    """A bf16 weight written from outside between steps (a mask on part of it, a whole
    zero_()) with fp32 masters or compensated weights: each rank's master or compensation
    takes the write, and its shard goes on bitwise as the one-process step's."""
    _check_case(gloo_run, "written")


@needs_gloo
def test_a_loaded_state_refused_on_one_rank_raises_on_every_rank(gloo_run):
    """A state dict loaded on one rank that the plan refuses (no 'step', a stream that is
    not a tensor): every rank raises at the step, none waits in a collective."""
    _check_case(gloo_run, "load_errors")


# ---- the workers -------------------------------------------------------------------------


def _model():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen).to(dt) for s, dt in zip(SHAPES, DTYPES)]


def _grads(step, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen) * scale).to(dt) for s, dt in zip(SHAPES, DTYPES)]


def _mine(rank, items):
    return list(items[:K] if rank == 0 else items[K:])


def _leaves(tensors):
    return [t.clone().requires_grad_() for t in tensors]


def _set(params, grads, skip=()):
    for i, (p, g) in enumerate(zip(params, grads)):
        p.grad = None if i in skip else g.clone()


def _check_equal(rank, what, ours, ref_opt, ref_params, opt):
    """Our shard's params and state bitwise equal to the one-process optimizer's."""
    mine_ref = _mine(rank, ref_params)
    for i, (p, q) in enumerate(zip(ours, mine_ref)):
        assert torch.equal(p, q), f"rank {rank}, {what}: param {i} differs by {(p.float() - q.float()).abs().max()}"
        for key, v in ref_opt.state.get(q, {}).items():
            w = opt.state[p][key]
            assert torch.equal(w, v), f"rank {rank}, {what}: state[{i}][{key!r}] differs"


def _adamw_twins(rank, comm, kw):
    """The whole model under a one-process AdamW, and this rank's part under a sharded one."""
    full = _leaves(_model())
    ours = _leaves(_mine(rank, _model()))
    return full, ours, sft.AdamW(full, **kw), sft.AdamW(ours, communicator=comm, **kw)


def _step_twins(rank, step, full, ours, ref, opt):
    """One step of both on step `step`'s gradients (this rank's part of them for ours)."""
    grads = _grads(step)
    _set(full, grads)
    _set(ours, _mine(rank, grads))
    ref.step()
    opt.step()


def _case_collectives(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    assert (comm.rank(), comm.size(), comm.name()) == (rank, world, "torch.distributed(gloo)")
    assert repr(comm) == f"ProcessGroupCommunicator(torch.distributed(gloo), rank={rank}, size={world})"

    def arr(values, dt):
        if dt is np.uint16:  # bfloat16's bits
            return torch.tensor(values, dtype=torch.bfloat16).view(torch.uint16).numpy().copy()
        return np.asarray(values).astype(dt)

    def val(a):
        return torch.from_numpy(a).view(torch.bfloat16).double().numpy() if a.dtype == np.uint16 else a.astype(float)

    n = 5
    sends = [[1 + 10 * r + i for i in range(n)] for r in range(world)]  # exact in every type
    wide = [[3 * i + r * (i % 3) for i in range(n * world)] for r in range(world)]
    for via_cpp in (False, True):
        for fallback in (False, True):
            comm._gather_fallback = comm._scatter_fallback = fallback
            for dt in NUMPY_TYPES:
                what = f"{np.dtype(dt)} via_cpp={via_cpp} fallback={fallback}"
                api = stepfuse.Communicator if via_cpp else type(comm)
                send = arr(sends[rank], dt)
                recv = arr([0] * (n * world), dt)
                api.all_gather(comm, send, recv)
                assert np.array_equal(val(recv), np.concatenate(sends).astype(float)), what
                for op, f in ((stepfuse.ReduceOp.sum, np.sum), (stepfuse.ReduceOp.max, np.max),
                              (stepfuse.ReduceOp.min, np.min)):
                    data = arr(wide[rank], dt)
                    api.all_reduce(comm, data, op)
                    expected = f(np.asarray(wide, dtype=float), axis=0)
                    assert np.array_equal(val(data), expected), f"all_reduce {op} {what}"
                    send = arr(wide[rank], dt)
                    kept = send.copy()
                    out = arr([0] * n, dt)
                    api.reduce_scatter(comm, send, out, op)
                    assert np.array_equal(val(out), expected[rank * n:(rank + 1) * n]), f"reduce_scatter {op} {what}"
                    assert np.array_equal(send, kept), f"reduce_scatter wrote its send buffer: {what}"
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(comm)


def _case_steps(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    world_group = dist.group.WORLD
    makers = {
        "AdamW": lambda ps, **kw: sft.AdamW(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, num_threads=1, **kw),
        "SGD": lambda ps, **kw: sft.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, max_grad_norm=0.5,
                                        norm_type=math.inf, num_threads=1, **kw),
    }
    for name, make in makers.items():
        full = _leaves(_model())
        ours = _leaves(_mine(rank, _model()))
        ref = make(full)
        opt = make(ours, communicator=world_group)  # a ProcessGroup: wrapped
        assert isinstance(opt.communicator, ProcessGroupCommunicator)
        for step in range(6):
            # Step 2: one of rank 1's params has no gradient (rank 0's set is unchanged):
            # both ranks re-plan at that step, and again at step 3.
            skip = {len(SHAPES) - 1} if step == 2 else set()
            grads = _grads(step)
            _set(full, grads, skip)
            _set(ours, _mine(rank, grads), {i - (K if rank else 0) for i in skip})
            ref.step()
            opt.step()
            assert torch.equal(opt.last_grad_norm, ref.last_grad_norm), \
                f"{name} step {step}: norm {opt.last_grad_norm} vs {ref.last_grad_norm}"
            assert math.isfinite(float(opt.last_grad_norm))
            _check_equal(rank, f"{name} step {step}", ours, ref, full, opt)
        # state_dict is the rank's own shard; loaded into a fresh sharded optimizer, it
        # continues as the original.
        sd = copy.deepcopy(opt.state_dict())  # (its tensors are the live state's, as torch's)
        assert len(sd["state"]) == len(ours)
        twin_params = _leaves([p.detach() for p in ours])
        twin = make(twin_params, communicator=ProcessGroupCommunicator())
        twin.load_state_dict(sd)
        grads = _mine(rank, _grads(99))
        _set(ours, grads)
        _set(twin_params, grads)
        opt.step()
        twin.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, twin_params)), f"{name}: the loaded twin differs"
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.deepcopy(opt)


def _case_scalers(rank, world):
    inf_step = 2
    # (stepfuse.torch.GradScaler with unscale_: torch's path, found_inf combined over the ranks)
    for scaler_cls, unscale in ((torch.amp.GradScaler, False), (sft.GradScaler, False), (sft.GradScaler, True)):
        name = scaler_cls.__module__ + "." + scaler_cls.__name__ + (" after unscale_" if unscale else "")
        full = _leaves(_model())
        ours = _leaves(_mine(rank, _model()))
        ref = sft.AdamW(full, lr=1e-2, max_grad_norm=1.0, num_threads=1)
        opt = sft.AdamW(ours, lr=1e-2, max_grad_norm=1.0, num_threads=1, communicator=dist.group.WORLD)
        s_ref = scaler_cls("cpu", init_scale=2.0 ** 12, growth_interval=2)
        s = scaler_cls("cpu", init_scale=2.0 ** 12, growth_interval=2)
        for step in range(6):
            s.scale(torch.ones(())), s_ref.scale(torch.ones(()))  # (what sets up a scaler: scale(loss))
            scale, ref_scale = s.get_scale(), s_ref.get_scale()
            _set(full, _grads(step, ref_scale))
            _set(ours, _mine(rank, _grads(step, scale)))
            if step == inf_step:  # an inf in one of rank 1's gradients only
                full[K + 1].grad.view(-1)[3] = math.inf
                if rank == 1:
                    ours[1].grad.view(-1)[3] = math.inf
            before = [p.detach().clone() for p in ours]
            if unscale:
                s_ref.unscale_(ref)
                s.unscale_(opt)
            s_ref.step(ref)
            if scaler_cls is torch.amp.GradScaler and step == inf_step + 1:
                # The ranks' torch.amp.GradScaler scales now differ (below): refused on both.
                with pytest.raises(RuntimeError, match="different loss scales"):
                    s.step(opt)
                assert all(torch.equal(p, q) for p, q in zip(ours, before))
                break
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                s.step(opt)
            if scaler_cls is sft.GradScaler:
                assert not caught, f"{name} step {step}: {[str(w.message) for w in caught]}"
            s_ref.update()
            s.update()
            what = f"{name} step {step}"
            assert torch.equal(opt.last_grad_norm, ref.last_grad_norm), \
                f"{what}: norm {opt.last_grad_norm} vs {ref.last_grad_norm}"
            _check_equal(rank, what, ours, ref, full, opt)
            if step == inf_step:
                assert math.isinf(float(opt.last_grad_norm)), what
                assert all(torch.equal(p, q) for p, q in zip(ours, before)), f"{what}: a skipped step wrote"
                if scaler_cls is sft.GradScaler or rank == 1:
                    assert s.get_scale() == scale / 2 == s_ref.get_scale(), f"{what}: no back-off"
                else:
                    # torch.amp.GradScaler on rank 0 saw no inf in its own gradients: its scale
                    # does not back off, and the step warns.
                    assert s.get_scale() == scale, what
                    assert any("torch.amp.GradScaler on rank 0" in str(w.message) for w in caught), what
            elif scaler_cls is sft.GradScaler or rank == 1:
                assert s.get_scale() == s_ref.get_scale(), f"{what}: scale {s.get_scale()} vs {s_ref.get_scale()}"


def _case_errors(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()

    def outcome(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    # A param refused at construction on rank 1 only: both raise (rank 0 names rank 1).
    params = _leaves([torch.zeros(3)]) if rank == 0 else [torch.zeros(3, dtype=torch.float64, requires_grad=True)]
    e = outcome(lambda: sft.AdamW(params, communicator=comm))
    if rank == 1:
        assert isinstance(e, TypeError), repr(e)
    else:
        assert isinstance(e, RuntimeError) and "rank(s) [1]" in str(e), repr(e)
    # A hyperparameter refused on rank 0 only.
    e = outcome(lambda: sft.SGD(_leaves([torch.zeros(3)]), lr=-1.0 if rank == 0 else 0.1, communicator=comm))
    if rank == 0:
        assert isinstance(e, ValueError), repr(e)
    else:
        assert isinstance(e, RuntimeError) and "rank(s) [0]" in str(e), repr(e)

    full = _leaves(_model())
    ours = _leaves(_mine(rank, _model()))
    ref = sft.AdamW(full, lr=1e-2, max_grad_norm=1.0, num_threads=1)
    opt = sft.AdamW(ours, lr=1e-2, max_grad_norm=1.0, num_threads=1, communicator=comm)
    for step in range(2):
        _set(full, _grads(step))
        _set(ours, _mine(rank, _grads(step)))
        ref.step()
        opt.step()
    # A gradient refused on rank 1 only: both raise, nothing written anywhere.
    before = [p.detach().clone() for p in ours]
    grads = _grads(2)
    _set(ours, _mine(rank, grads))
    if rank == 1:
        ours[0].grad.data = ours[0].grad.to(torch.float64)
    e = outcome(opt.step)
    if rank == 1:
        assert isinstance(e, (TypeError, ValueError, RuntimeError)) and "dtype" in str(e), repr(e)
    else:
        assert isinstance(e, RuntimeError) and "rank(s) [1]" in str(e), repr(e)
    assert all(torch.equal(p, q) for p, q in zip(ours, before))
    # Rank 0 without any gradient while rank 1 has some: both raise.
    _set(ours, _mine(rank, grads), skip=set(range(len(ours))) if rank == 0 else set())
    e = outcome(opt.step)
    assert isinstance(e, RuntimeError) and "rank(s) [0] have no param with a gradient" in str(e), repr(e)
    # No gradient anywhere: no step, as unsharded.
    _set(ours, grads, skip=set(range(len(ours))))
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, before))
    # Fixed: training continues as the one-process optimizer's.
    for step in range(2, 4):
        _set(full, _grads(step))
        _set(ours, _mine(rank, _grads(step)))
        ref.step()
        opt.step()
        _check_equal(rank, f"after the errors, step {step}", ours, ref, full, opt)
    # The engine's own construction is collective too: a param of mismatched sizes on
    # rank 1 only (refused by the library, not by the binding).
    w = torch.zeros(100)
    g = torch.zeros(100 if rank == 0 else 99)
    e = outcome(lambda: stepfuse.Optimizer(stepfuse.SGD(lr=0.1), [(w, g)], communicator=comm))
    assert isinstance(e, (ValueError, RuntimeError)), repr(e)
    if rank == 0:
        assert "1" in str(e), repr(e)


def _case_engine(rank, world):
    """stepfuse.Optimizer directly: one tensor split between the ranks at SHARD_ALIGN
    (slices=), and loss-scaled steps whose inf on rank 1 skips the step on both."""
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    a = stepfuse.SHARD_ALIGN
    gen = torch.Generator().manual_seed(5)
    model = [torch.randn(2 * a + 100, generator=gen), torch.randn(300, generator=gen)]
    full_w = [t.clone() for t in model]
    full_g = [torch.zeros_like(t) for t in model]
    if rank == 0:
        ours_w, slices = [model[0][:a].clone()], [stepfuse.TensorSlice(0, 0)]
    else:
        ours_w, slices = [model[0][a:].clone(), model[1].clone()], [stepfuse.TensorSlice(0, a),
                                                                      stepfuse.TensorSlice(1, 0)]
    ours_g = [torch.zeros_like(t) for t in ours_w]
    cfg = stepfuse.AdamW(lr=1e-2, weight_decay=0.1)
    ref = stepfuse.Optimizer(cfg, list(zip(full_w, full_g)), max_grad_norm=1.0, num_threads=1)
    opt = stepfuse.Optimizer(cfg, list(zip(ours_w, ours_g)), max_grad_norm=1.0, num_threads=1,
                             communicator=comm, slices=slices)

    def fill(step, scale):
        gen = torch.Generator().manual_seed(50 + step)
        grads = [torch.randn(t.shape, generator=gen) * scale for t in model]
        for g, src in zip(full_g, grads):
            g.copy_(src)
        mine = [grads[0][:a]] if rank == 0 else [grads[0][a:], grads[1]]
        for g, src in zip(ours_g, mine):
            g.copy_(src)

    def mine_of(ts):
        return [ts[0][:a]] if rank == 0 else [ts[0][a:], ts[1]]

    for step in range(5):
        scale = 1024.0
        fill(step, scale)
        if step == 3:  # an inf in rank 1's shard of tensor 0
            full_g[0][a + 7] = math.inf
            if rank == 1:
                ours_g[0][7] = math.inf
        before = [w.clone() for w in ours_w]
        r_ref = ref.step_scaled(scale)
        r = opt.step_scaled(scale)
        assert (r.applied, r.found_inf) == (r_ref.applied, r_ref.found_inf), f"step {step}: {r} vs {r_ref}"
        assert r.grad_norm == r_ref.grad_norm or (math.isnan(r.grad_norm) and math.isnan(r_ref.grad_norm)), \
            f"step {step}: {r} vs {r_ref}"
        assert r.clip_coef == r_ref.clip_coef, f"step {step}: {r} vs {r_ref}"
        if step == 3:
            assert not r.applied and r.found_inf
            assert all(torch.equal(w, b) for w, b in zip(ours_w, before))
        for i, (w, v) in enumerate(zip(ours_w, mine_of(full_w))):
            assert torch.equal(w, v), f"rank {rank} step {step}: weight {i} differs"
    assert opt.step_count == ref.step_count == 4



def _case_rounding(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    kw = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, num_threads=1, master_weights=False,
              stochastic_rounding=True, seed=2**40 + 7)
    # Cut after K: each rank holds a bf16 tensor; after 5: rank 1 holds the last (f32) alone.
    for cut in (K, len(SHAPES) - 1):
        def mine(items):
            return list(items[:cut] if rank == 0 else items[cut:])

        full = _leaves(_model())
        ours = _leaves(mine(_model()))
        ref = sft.AdamW(full, **kw)
        opt = sft.AdamW(ours, communicator=comm, **kw)
        for step in range(4):
            grads = _grads(step)
            _set(full, grads)
            _set(ours, mine(grads))
            ref.step()
            opt.step()
            for i, (p, q) in enumerate(zip(ours, mine(full))):
                assert torch.equal(p, q), f"rank {rank}, cut {cut}, step {step}: param {i} differs"


def _case_compensation(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    kw = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, num_threads=1, master_weights=False,
              compensated_weights=True)
    # Cut after K: each rank holds a bf16 tensor; after 5: rank 1 holds the last (f32) alone.
    for cut in (K, len(SHAPES) - 1):
        def mine(items):
            return list(items[:cut] if rank == 0 else items[cut:])

        full = _leaves(_model())
        ours = _leaves(mine(_model()))
        ref = sft.AdamW(full, **kw)
        opt = sft.AdamW(ours, communicator=comm, **kw)
        for step in range(4):
            grads = _grads(step)
            _set(full, grads)
            _set(ours, mine(grads))
            ref.step()
            opt.step()
            for i, (p, q) in enumerate(zip(ours, mine(full))):
                assert torch.equal(p, q), f"rank {rank}, cut {cut}, step {step}: param {i} differs"
                if q.dtype == torch.bfloat16:
                    c, d = opt.state[p]["compensation"], ref.state[q]["compensation"]
                    assert torch.equal(c.view(torch.int16), d.view(torch.int16)), \
                        f"rank {rank}, cut {cut}, step {step}: param {i}'s compensation differs"
                else:
                    assert "compensation" not in opt.state[p]


def _case_state_formats(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    kw = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, num_threads=1, state_format="q8",
              state_formats={"exp_avg_sq": "bf16"})
    full, ours, ref, opt = _adamw_twins(rank, comm, kw)
    for step in range(4):
        _step_twins(rank, step, full, ours, ref, opt)
        _check_equal(rank, f"step {step}", ours, ref, full, opt)
    big = [p for p in ours if p.numel() >= 4096][0]
    assert opt.state[big]["exp_avg"].dtype == torch.uint8 and "exp_avg_absmax" in opt.state[big]
    assert opt.state[big]["exp_avg_sq"].dtype == torch.bfloat16
    # A state dict round trip per rank continues bitwise.
    sd = copy.deepcopy(opt.state_dict())
    again = _leaves([p.detach() for p in ours])
    resumed = sft.AdamW(again, communicator=comm, **kw)
    resumed.load_state_dict(sd)
    grads = _grads(4)
    for ps, o in ((ours, opt), (again, resumed)):
        _set(ps, _mine(rank, grads))
        o.step()
    for i, (p, q) in enumerate(zip(ours, again)):
        assert torch.equal(p, q), f"rank {rank}: resumed param {i} differs"


def _case_written(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    for extra in (dict(), dict(master_weights=False, compensated_weights=True)):
        kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, num_threads=1, **extra)
        full, ours, ref, opt = _adamw_twins(rank, comm, kw)
        for step in range(5):
            _step_twins(rank, step, full, ours, ref, opt)
            with torch.no_grad():
                for ps in (full, ours):
                    for i, p in enumerate(ps):
                        if p.dtype != torch.bfloat16:
                            continue
                        if step == 1:  # half of each bf16 weight masked to 0
                            p.view(-1)[: p.numel() // 2] = 0
                        elif step == 3:
                            p.zero_()
            _check_equal(rank, f"{extra} step {step}", ours, ref, full, opt)
        # The writes reached the masters: the one-process step's weights moved off 0 by
        # steps of about lr, not back to where the masters had them.
        for p in ours:
            if p.dtype == torch.bfloat16:
                assert float(p.float().abs().max()) < 0.05, f"rank {rank}: a written weight went back to its master"


def _case_load_errors(rank, world):
    from stepfuse.torch.distributed import ProcessGroupCommunicator
    comm = ProcessGroupCommunicator()
    for edit, error in ((lambda st: st.pop("step"), KeyError), (lambda st: st.__setitem__("exp_avg", 0.5), TypeError)):
        ours = _leaves(_mine(rank, _model()))
        opt = sft.AdamW(ours, communicator=comm, max_grad_norm=1.0, num_threads=1)
        _set(ours, _mine(rank, _grads(0)))
        opt.step()
        sd = copy.deepcopy(opt.state_dict())
        if rank == 0:
            edit(sd["state"][0])
        opt.load_state_dict(sd)
        _set(ours, _mine(rank, _grads(1)))
        with pytest.raises(error if rank == 0 else RuntimeError):
            opt.step()


if __name__ == "__main__":
    import traceback

    cases, rank, world, init = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    for case in cases:
        try:
            globals()["_case_" + case](rank, world)
        except BaseException:  # noqa: BLE001
            print(f"CASE {case} FAILED on rank {rank}:\n{traceback.format_exc()}", flush=True)
            os._exit(1)  # at once: the other ranks' collectives fail instead of waiting
        print(f"CASE {case} ok", flush=True)
    dist.destroy_process_group()
