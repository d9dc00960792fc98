"""The JAX peer: jax.jit of jmp loss scaling + optax.chain(clip_by_global_norm, adamw), on its own
copies of the arrays; with an inline copy of what it uses of jmp when jmp is not installed."""

import os
import time

from .config import GROWTH_FACTOR, GROWTH_INTERVAL, HYPER, MAX_NORM
from .peer import Peer


class JaxPeer(Peer):
    name = "jax-optax"
    what = "jax.jit of jmp loss scaling + optax.chain(clip_by_global_norm, adamw)"  # refined in setup()
    reads_torch_grads = False

    def __init__(self, ctx):
        self.ctx = ctx
        self.compile_s = None

    def setup(self):
        import jax
        import jax.numpy as jnp
        import optax
        try:
            import jmp
            self.jmp_version = getattr(jmp, "__version__", "installed")
        except ImportError:
            jmp = _InlineJmp(jax, jnp)
            self.jmp_version = None
        self.jax, self.jnp = jax, jnp
        # XLA takes minutes to compile this step for a GPT-2-sized list on a small machine;
        # keep the executable for the next run (the key covers the program, flags and version).
        jax.config.update("jax_compilation_cache_dir", os.path.join(self.ctx.args.build_dir, "peers-jax-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        self.what = ("jax.jit(donate params and state) of: " + ("jmp" if self.jmp_version else "jmp-equivalent") +
                     " DynamicLossScale unscale + all_finite + adjust, optax.chain(clip_by_global_norm(1.0), "
                     "adamw(...)), apply_updates, select_tree(finite, new, old); own copies of the arrays")
        self.ctx.versions["jmp"] = self.jmp_version or "not installed (inline equivalent)"
        tx = optax.chain(optax.clip_by_global_norm(MAX_NORM),
                         optax.adamw(learning_rate=HYPER["lr"], b1=HYPER["beta1"], b2=HYPER["beta2"],
                                     eps=HYPER["eps"], weight_decay=HYPER["weight_decay"]))

        def train_step(params, opt_state, loss_scale, grads):
            grads = loss_scale.unscale(grads)
            finite = jmp.all_finite(grads)
            loss_scale = loss_scale.adjust(finite)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params = jmp.select_tree(finite, new_params, params)
            opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
            return params, opt_state, loss_scale

        # Own copies (jnp.array copies): the params are donated, so they must not alias torch memory.
        self.params = [jnp.array(w.detach().numpy(), copy=True) for w in self.ctx.weights0]
        self.grads = [jnp.array(g.numpy(), copy=True) for g in self.ctx.grads_backup]
        self.opt_state = tx.init(self.params)
        self.loss_scale = jmp.DynamicLossScale(jnp.asarray(self.ctx.args.loss_scale, jnp.float32),
                                               period=GROWTH_INTERVAL, factor=int(GROWTH_FACTOR))
        self.fn = jax.jit(train_step, donate_argnums=(0, 1))
        self.optax = optax
        self.first_call = True

    def step(self):
        if self.first_call:
            t0 = time.perf_counter()
        self.params, self.opt_state, self.loss_scale = self.fn(self.params, self.opt_state, self.loss_scale,
                                                               self.grads)
        # Dispatch is asynchronous: the step is over when its outputs are.
        self.jax.block_until_ready((self.params, self.opt_state, self.loss_scale))
        if self.first_call:
            self.compile_s = time.perf_counter() - t0
            self.first_call = False

    def check_applied(self):
        if float(self.loss_scale.loss_scale) < self.ctx.expected_scale:
            raise RuntimeError("jax-optax skipped a step although every gradient is finite")

    def result(self):
        import numpy as np
        leaves = self.jax.tree_util.tree_leaves(self.opt_state,
                                                is_leaf=lambda x: isinstance(x, self.optax.ScaleByAdamState))
        adam = [x for x in leaves if isinstance(x, self.optax.ScaleByAdamState)]
        if len(adam) != 1:
            raise RuntimeError("could not find optax's ScaleByAdamState in the optimizer state")
        torch = self.ctx.torch
        conv = lambda xs: [torch.from_numpy(np.array(x)) for x in xs]  # noqa: E731
        return conv(self.params), conv(adam[0].mu), conv(adam[0].nu)

    def extra(self):
        return dict(compile_and_first_step_s=self.compile_s, xla_flags=os.environ.get("XLA_FLAGS", ""))


class _InlineJmp:
    """What the jax peer uses of jmp (DeepMind's mixed-precision library, jmp 0.0.4), for
    when it is not installed: DynamicLossScale, all_finite, select_tree, the same math."""

    def __init__(self, jax, jnp):
        import dataclasses
        import functools

        self.all_finite = lambda tree: jnp.stack(
            [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]).all()
        self.select_tree = lambda pred, a, b: jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)

        @jax.tree_util.register_pytree_node_class
        @dataclasses.dataclass(frozen=True)
        class DynamicLossScale:
            loss_scale: object
            counter: object = None
            period: int = 2000
            factor: int = 2

            def __post_init__(self):
                if self.counter is None:
                    object.__setattr__(self, "counter", jnp.zeros([], jnp.int32))

            def unscale(self, tree):
                inv = 1 / self.loss_scale
                return jax.tree_util.tree_map(lambda x: x * inv, tree)

            def adjust(self, finite):
                grown = self.loss_scale * self.factor
                scale = jax.lax.select(
                    finite,
                    jax.lax.select(self.counter == self.period - 1,
                                   jax.lax.select(jnp.isfinite(grown), grown, self.loss_scale), self.loss_scale),
                    jnp.maximum(jnp.ones([], jnp.float32), self.loss_scale / self.factor))
                counter = ((self.counter + 1) % self.period) * finite
                return DynamicLossScale(scale, counter, self.period, self.factor)

            def tree_flatten(self):
                return (self.loss_scale, self.counter), (self.period, self.factor)

            @classmethod
            def tree_unflatten(cls, meta, data):
                return cls(data[0], data[1], meta[0], meta[1])

        self.DynamicLossScale = DynamicLossScale
