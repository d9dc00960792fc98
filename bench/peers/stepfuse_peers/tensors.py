"""The tensor lists: stepfuse-bench's presets (read from its --print-shapes) and the shared torch
tensors every torch peer and stepfuse step on."""

import os
import subprocess


def load_shapes(args):
    """([(name, numel)], source): the tensor list of --preset (or --shapes FILE), as
    `stepfuse-bench ... --print-shapes` prints it ('NAME COUNT' per line), so the peers
    time exactly stepfuse-bench's lists."""
    if not os.path.exists(args.bench):
        raise RuntimeError(f"{args.bench} not found: build it first (bench/peers/run.sh does), or pass --bench")
    select = ["--shapes", args.shapes] if args.shapes else ["--preset", args.preset]
    cmd = ["stepfuse-bench", *select, "--print-shapes"]
    r = subprocess.run([args.bench, *cmd[1:]], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {r.returncode}): " + (r.stderr or r.stdout).strip())
    shapes = []
    for line in r.stdout.splitlines():
        f = line.split("#", 1)[0].split()
        if len(f) == 2 and f[1].isdigit():
            shapes.append((f[0], int(f[1])))
        elif f:
            raise RuntimeError(f"{' '.join(cmd)}: unexpected line '{line}' (expected 'NAME COUNT')")
    if not shapes:
        raise RuntimeError(f"{' '.join(cmd)} printed no tensors")
    return shapes, " ".join(cmd)


def last_level_cache_bytes(default=32 << 20):
    """The largest CPU cache (Linux sysfs; `default` where it cannot be read)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in os.listdir(base):
            try:
                with open(os.path.join(base, index, "size")) as f:
                    text = f.read().strip().upper()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            digits = text.rstrip("KMG")
            if digits.isdigit():
                best = max(best, int(digits) * mult)
    except OSError:
        pass
    return best or default


class Context:
    """The shared tensors: the weights and gradients every torch peer and stepfuse step on, their
    pristine copies, and whether the gradients need restoring before the next peer reads them."""

    def __init__(self, args, sf, torch):
        self.args, self.sf, self.torch = args, sf, torch
        self.expected_scale = args.loss_scale
        self.versions = {}
        self.grads_dirty = False

    def allocate(self, shapes):
        """Weights ~ U(-0.1, 0.1), gradients ~ U(-1e-3, 1e-3) * S, one tensor each, in --dtype (fp32;
        bf16: the same fp32 draws rounded to nearest); a pristine copy of both (the verification's
        starting point and the restore source)."""
        torch = self.torch
        dtype = torch.bfloat16 if self.args.dtype == "bf16" else torch.float32
        gen = torch.Generator().manual_seed(self.args.seed)
        self.weights, self.grads = [], []
        for _, n in shapes:
            w = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-0.1, 0.1, generator=gen).to(dtype))
            g = torch.empty(n, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen).mul_(self.args.loss_scale)
            g = g.to(dtype)
            w.grad = g
            self.weights.append(w)
            self.grads.append(g)
        self.weights0 = [w.detach().clone() for w in self.weights]
        self.grads_backup = [g.clone() for g in self.grads]

    def evict_caches(self):
        """Reads and writes a scratch buffer of 4x the last-level cache: run before every timed step
        (untimed), so that no peer starts with part of its data in cache because of what ran just
        before it (the restore of the gradients, the fresh-gradients peer's copy)."""
        if getattr(self, "scratch", None) is None:
            self.scratch_bytes = 4 * last_level_cache_bytes()
            self.scratch = self.torch.zeros(self.scratch_bytes // 4, dtype=self.torch.float32)
        self.scratch.add_(1.0)

    def restore_grads(self):
        self.torch._foreach_copy_(self.grads, self.grads_backup)
        self.grads_dirty = False

    def restore_weights(self):
        with self.torch.no_grad():
            self.torch._foreach_copy_(self.weights, self.weights0)
