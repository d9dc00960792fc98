"""What every peer is: the Peer interface the verification and the timing drive, and SkipPeer.

A peer sets itself up (optimizer, state), takes one full step per step() call (returning
only when the step's results are in memory), reports its weights and AdamW state for the
verification, and says whether the step it just took was applied (checked outside the
timed region). prepare() and finish() run just before and just after every step(), outside
the timed region: what a training loop does between two steps that is not the step (the
fresh-gradients peer assigns new .grad tensors there)."""


class Peer:
    name = ""
    what = ""                 # one line: what a timed step contains
    reads_torch_grads = True  # reads the shared torch gradients
    writes_torch_grads = False  # unscales/clips them in place (they are restored before the next reader)
    required = False          # stepfuse itself: its failing ends the run (exit code 2) instead of a row saying why

    def setup(self):
        pass

    def prepare(self):
        pass

    def step(self):
        raise NotImplementedError

    def finish(self):
        pass

    def check_applied(self):
        pass

    def result(self):
        """(weights, exp_avg, exp_avg_sq): lists of torch tensors (or numpy arrays), one per tensor."""
        raise NotImplementedError

    def extra(self):
        return {}


class SkipPeer(Exception):
    """A peer that does not apply to this run (the message says why)."""
