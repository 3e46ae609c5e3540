"""What test_parallel.py runs under torchrun in place of `-m training`: the command line itself
(training.__main__.main with the given arguments), instrumented through the environment:

  TRAINING_TEST_PLAN       JSON {"model": {...}, "char_lm": {...}, "mqar": {...}} merged into
                           plans.MODEL and the --quick plan (tiny models, so a run takes seconds);
  TRAINING_TEST_OUT        the --out directory: every write under it (a file opened for writing,
                           a directory made, a file renamed or removed, seen by Python's audit
                           hooks) is counted, printed at exit as "WRITES rank=R count=N", and
                           refused on ranks other than 0;
  TRAINING_TEST_INTERRUPT  k: a KeyboardInterrupt at the start of step k of every run, on every
                           rank (as Ctrl-C would), before that step computes anything;
  TRAINING_TEST_REFUSE     "rank:k,...": on that rank, the backward of the k-th training forward
                           of an attention layer (counted over the whole process) raises the
                           ValueError linrope's kernels raise for a non-finite gradient, in the
                           middle of the backward; the rank prints "REFUSED rank=R sent=S
                           buckets=B exchanged=E calls=C" (S of B gradient buckets sent before
                           it; sequence parallel, E of the C attention layers' state all-reduces
                           run before it, 0 of 0 otherwise) -- and so does any other rank whose
                           backward raises (a NaN state gradient reaching its kernels);
  TRAINING_TEST_BUCKET     bytes: DistributedDataParallel's bucket size (first bucket included),
                           small to have several buckets in a tiny model.

After each run every rank prints "STATE rank=R key=K <sha256 of its parameters and buffers>", so
the test can check that the ranks hold the same model (FAVOR+'s W is fixed by its buffer
feature_seed), and "INPUTS rank=R key=K <sha256 of every training forward's tokens, in order>",
so that it can check which share of each batch the rank computed."""
import atexit
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from linrope.torch import MultiheadAttention  # noqa: E402
from training import model, parallel, plans, train  # noqa: E402
from training.__main__ import main  # noqa: E402

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


def use_plan(plan):
    plans.MODEL.update(plan.get("model", {}))
    for task in plans.TASKS:
        plans.MODES["quick"][task].update(plan.get(task, {}))


def interrupt_at(k):
    real = train.learning_rate

    def learning_rate(config, step):
        if step == k:
            raise KeyboardInterrupt
        return real(config, step)
    train.learning_rate = learning_rate


class Refuse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("linear_attention backward: non-finite values in grad_out (a test's)")


def refuse(calls):
    count = [0]

    def hook(module, inputs, output):
        if not (isinstance(module, MultiheadAttention) and module.training):
            return output
        count[0] += 1
        return Refuse.apply(output) if count[0] in calls else output
    torch.nn.modules.module.register_module_forward_hook(hook)

    real = parallel._DataParallel.backward

    def backward(ddp, loss):
        try:
            real(ddp, loss)
        except ValueError:
            print("REFUSED rank=%d sent=%d buckets=%d exchanged=%d calls=%d" % (
                RANK, len(ddp.sent), len(ddp.reducer._get_zeros_like_grad_buckets()),
                len(ddp.exchanged), len(ddp.calls)), flush=True)
            raise
    parallel._DataParallel.backward = backward


def small_buckets(size):
    dist._DEFAULT_FIRST_BUCKET_BYTES = size
    real = torch.nn.parallel.DistributedDataParallel.__init__

    def init(ddp, module, **kwargs):
        real(ddp, module, bucket_cap_mb=size / 2 ** 20, **kwargs)
    torch.nn.parallel.DistributedDataParallel.__init__ = init


def print_states():
    real_forward, real_train = model.Decoder.forward, train.Run.train
    inputs = {}  # id(Decoder) -> sha256 of the tokens of its training forwards

    def forward(decoder, tokens):
        if decoder.training:
            inputs.setdefault(id(decoder), hashlib.sha256()).update(tokens.numpy().tobytes())
        return real_forward(decoder, tokens)

    def trained(run, *args, **kwargs):
        summary = real_train(run, *args, **kwargs)
        state = hashlib.sha256()
        for name, tensor in sorted(run.model.state_dict().items()):
            state.update(name.encode() + tensor.numpy().tobytes())
        key = run.config.key()
        print("STATE rank=%d key=%s %s" % (RANK, key, state.hexdigest()), flush=True)
        # Popped: the next run's model may be allocated where this one was, with the same id.
        print("INPUTS rank=%d key=%s %s" % (RANK, key, inputs.pop(id(run.model)).hexdigest()),
              flush=True)
        return summary
    model.Decoder.forward, train.Run.train = forward, trained


if __name__ == "__main__":
    if "TRAINING_TEST_OUT" in os.environ:
        watch_writes(os.environ["TRAINING_TEST_OUT"])
    if "TRAINING_TEST_PLAN" in os.environ:
        use_plan(json.loads(os.environ["TRAINING_TEST_PLAN"]))
    if "TRAINING_TEST_INTERRUPT" in os.environ:
        interrupt_at(int(os.environ["TRAINING_TEST_INTERRUPT"]))
    if "TRAINING_TEST_REFUSE" in os.environ:
        pairs = [item.split(":") for item in os.environ["TRAINING_TEST_REFUSE"].split(",")]
        refuse({int(k) for rank, k in pairs if int(rank) == RANK})
    if "TRAINING_TEST_BUCKET" in os.environ:
        small_buckets(int(os.environ["TRAINING_TEST_BUCKET"]))
    print_states()
    sys.exit(main())
