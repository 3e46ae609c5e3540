"""What the torchrun tests (test_parallel.py, test_sequence_parallel.py) run in place of
`-m training`: the command line itself (training.__main__.main with the given arguments), through
the seams it offers for tests (its hooks, modes and model arguments), configured by the
environment:

  TRAINING_TEST_PLAN       JSON {"model": {...}, "char_lm": {...}, "mqar": {...}}: plans.MODEL and
                           the --quick plan's settings with these changes (tiny models, so that a
                           run takes seconds);
  TRAINING_TEST_OUT        the --out directory: every write under it (a file opened for writing,
                           a directory made, a file renamed or removed, seen by Python's audit
                           hooks) is counted, printed at exit as "WRITES rank=R count=N", and
                           refused on ranks other than 0;
  TRAINING_TEST_INTERRUPT  k: a KeyboardInterrupt at the start of step k of every run, on every
                           rank (as Ctrl-C would), before that step computes anything;
  TRAINING_TEST_REFUSE     "rank:k,...": on that rank, the backward of the k-th training forward
                           of an attention layer (counted over the whole process) raises the
                           linrope.NonFiniteError a kernel raises for a non-finite gradient, in
                           the middle of the backward, and prints "REFUSED rank=R forward=k".

After each run every rank prints "STATE rank=R key=K <sha256 of its parameters and buffers>", so
the test can check that the ranks hold the same model (FAVOR+'s W is fixed by its buffer
feature_seed), and "INPUTS rank=R key=K <sha256 of every training forward's tokens, in order>",
so that it can check which share of each batch the rank computed."""
import atexit
import copy
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import linrope  # noqa: E402
from training import plans  # noqa: E402
from training.__main__ import main  # noqa: E402
from training.train import RunHooks  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
WRITING_EVENTS = ("os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate")


def watch_writes(out):
    out = os.path.realpath(out) + os.sep
    writes = []

    def inside(path):
        return isinstance(path, (str, bytes, os.PathLike)) and \
            (os.path.realpath(os.fsdecode(path)) + os.sep).startswith(out)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") if mode is not None else \
                bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        elif event in WRITING_EVENTS:
            path, writing = args[0], True
        else:
            return
        if writing and inside(path):
            writes.append((event, path))
            if RANK != 0:
                raise PermissionError("rank %d wrote %s (%s)" % (RANK, path, event))

    sys.addaudithook(hook)
    atexit.register(lambda: print("WRITES rank=%d count=%d" % (RANK, len(writes)), flush=True))


def tiny_plan(changes):
    """plans.MODES and plans.MODEL with the changes (TRAINING_TEST_PLAN) made to --quick's."""
    modes = copy.deepcopy(plans.MODES)
    for task in plans.TASKS:
        modes["quick"][task].update(changes.get(task, {}))
    return dict(modes=modes, model=dict(plans.MODEL, **changes.get("model", {})))


class Refuse(torch.autograd.Function):
    """The identity, whose backward raises as a kernel refusing a non-finite gradient does."""

    @staticmethod
    def forward(ctx, x, forward):
        ctx.forward = forward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        print("REFUSED rank=%d forward=%d" % (RANK, ctx.forward), flush=True)
        raise linrope.NonFiniteError("linear_attention backward: non-finite values in grad_out "
                                     "(a test's)")


class Instrumented(RunHooks):
    """The faults and digests above, on every run of this process, through PyTorch's public
    module hooks on the run's model."""

    def __init__(self, interrupt_at=None, refuse=()):
        self.interrupt_at, self.refuse = interrupt_at, set(refuse)
        self.attention_forwards = 0  # over the process
        self.inputs = {}             # id(run) -> sha256 of its training forwards' tokens

    def started(self, run):
        digest = self.inputs[id(run)] = hashlib.sha256()

        def before_forward(model, inputs):
            if model.training:
                if run.step == self.interrupt_at:
                    raise KeyboardInterrupt
                digest.update(inputs[0].numpy().tobytes())
        run.model.register_forward_pre_hook(before_forward)
        for block in run.model.blocks:
            block.attention.register_forward_hook(self._refusing)

    def _refusing(self, layer, inputs, output):
        if not layer.training:
            return output
        self.attention_forwards += 1
        if self.attention_forwards in self.refuse:
            return Refuse.apply(output, self.attention_forwards)
        return output

    def finished(self, run):
        state = hashlib.sha256()
        for name, tensor in sorted(run.model.state_dict().items()):
            state.update(name.encode() + tensor.numpy().tobytes())
        key = run.config.key()
        print("STATE rank=%d key=%s %s" % (RANK, key, state.hexdigest()), flush=True)
        print("INPUTS rank=%d key=%s %s" % (RANK, key, self.inputs.pop(id(run)).hexdigest()),
              flush=True)


if __name__ == "__main__":
    if "TRAINING_TEST_OUT" in os.environ:
        watch_writes(os.environ["TRAINING_TEST_OUT"])
    seams = tiny_plan(json.loads(os.environ.get("TRAINING_TEST_PLAN", "{}")))
    pairs = [item.split(":") for item in os.environ.get("TRAINING_TEST_REFUSE", "").split(",")
             if item]
    interrupt = os.environ.get("TRAINING_TEST_INTERRUPT")
    hooks = Instrumented(int(interrupt) if interrupt else None,
                         {int(k) for rank, k in pairs if int(rank) == RANK})
    sys.exit(main(hooks=hooks, **seams))
