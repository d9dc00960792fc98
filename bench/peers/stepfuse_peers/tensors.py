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


class Context:
    """The shared tensors: the weights and gradients every torch peer and stepfuse step on, their
    pristine copies, and whether the gradients need restoring before the next peer reads them."""

    def __init__(self, args, shim, torch):
        self.args, self.shim, self.torch = args, shim, torch
        self.expected_scale = args.loss_scale
        self.versions = {}
        self.grads_dirty = False

    def allocate(self, shapes):
        """Weights ~ U(-0.1, 0.1), gradients ~ U(-1e-3, 1e-3) * S, fp32, one tensor each;
        a pristine copy of both (the verification's starting point and the restore source)."""
        torch = self.torch
        gen = torch.Generator().manual_seed(self.args.seed)
        self.weights, self.grads = [], []
        for _, n in shapes:
            w = torch.nn.Parameter(torch.empty(n, dtype=torch.float32).uniform_(-0.1, 0.1, generator=gen))
            g = torch.empty(n, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen).mul_(self.args.loss_scale)
            w.grad = g
            self.weights.append(w)
            self.grads.append(g)
        self.weights0 = [w.detach().clone() for w in self.weights]
        self.grads_backup = [g.clone() for g in self.grads]

    def restore_grads(self):
        self.torch._foreach_copy_(self.grads, self.grads_backup)
        self.grads_dirty = False

    def restore_weights(self):
        with self.torch.no_grad():
            self.torch._foreach_copy_(self.weights, self.weights0)
