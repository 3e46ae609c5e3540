"""Data and sequence parallelism: the processes that train one run together.

Under torchrun (`/usr/bin/python3 -m torch.distributed.run --nproc_per_node N -m training ...`)
every process (a rank) builds the same model from the same seed (FAVOR+'s W included: it is drawn
from the seed and redrawn after the same count of training forwards on every rank), draws the
same global batch from (seed, step) and computes on its share of it; DistributedDataParallel on
gloo averages the gradients during backward, so every rank applies the same update and the
parameters stay the same everywhere. The training loop (train.py) adds one small exchange per
step -- the ranks' losses, failures and denominator statistics -- so that the records and every
decision (a divergence ends the run) are the same on every rank. Rank 0 alone evaluates and
writes; a checkpoint reaches the other ranks through rank 0 (no shared file system is needed).

`Ranks.share` is the one place that decides which part of the global batch a rank computes:

  * data parallel (the default): a contiguous block of the batch's sequences, whole;
  * sequence parallel (`--sequence-parallel`, Ranks.sequence): every sequence of the batch, each
    cut along its length into contiguous slices, one per rank. The attention layers then run
    with sequence_parallel on (linrope.torch.MultiheadAttention), over `sequence_group`: each
    layer's causal linear attention continues from the states of the earlier ranks' slices
    (linrope.torch.distributed), so the ranks together compute the whole sequences.

The loss weighting in train.py (the share's scored tokens against the batch's) holds for either.

Outside torchrun, SINGLE stands for the one process: no torch.distributed call is made and the
numbers are bitwise those the trainer gave before data parallelism existed."""
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from linrope.torch import MultiheadAttention
# The autograd Function whose backward all-reduces a sequence parallel layer's state gradients.
from linrope.torch.distributed import _GatherStates

# torchrun sets these in every worker; all four, so that one stray variable is not taken for it.
TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")


def under_torchrun(environ=None):
    environ = os.environ if environ is None else environ
    return all(name in environ for name in TORCHRUN_VARIABLES)


def _all_reduce(sent, bucket):
    """DDP's default averaging all-reduce of a gradient bucket, noting that it was sent."""
    sent.add(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


def _note_exchange(calls, world):
    """A forward hook on an attention layer: notes the elements of the all-reduce that a
    sequence parallel call's backward will make (linrope.torch.distributed's docstring: the
    gradients of every rank's S and z, P x B H m (d_v + 1) values of q's dtype)."""
    def hook(layer, inputs, output):
        if layer.training and layer.sequence_parallel:
            calls.append((world * len(inputs[0]) * layer.num_heads *
                          layer.feature_map.output_dim * (layer.head_dim + 1), inputs[0].dtype))
    return hook


def _state_exchanges(loss):
    """The nodes of loss's autograd graph that all-reduce, in backward, the gradients of an
    attention layer's gathered states (linrope.torch.distributed: one per sequence parallel
    call)."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node) is _GatherStates._backward_cls:
            found.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


class _DataParallel(torch.nn.parallel.DistributedDataParallel):
    """DistributedDataParallel that remembers which gradient buckets the current backward has sent
    to the all-reduce (through the default averaging hook), so that a rank whose backward raises
    can send the rest itself: the other ranks wait for them, bucket after bucket in index order
    (the order in which the reducer sends them), and would wait for ever.

    Sequence parallel (sequence_group given), the attention layers' backward all-reduces on
    that group are followed the same way: which have run (a hook on their autograd nodes), and
    how large each is (noted in the forward), so that a rank whose backward raises before it
    joined them all joins the rest with NaN first -- the other ranks block in them, in the
    order of the layers from the last -- and then sends its buckets."""

    def __init__(self, model, sequence_group=None):
        # broadcast_buffers=False: the only buffers, the attention's feature_seed and
        # training_forwards, are equal on every rank by construction (same seed, one training
        # forward per step everywhere), so the per-step traffic is the gradients' all-reduce
        # alone. The construction itself copies rank 0's parameters and buffers to every rank.
        super().__init__(model, broadcast_buffers=False)
        self.sent = set()
        # The set as the hook's state, not a bound method: the reducer holds the hook, and a
        # hook holding this module would make a cycle through C++ that Python never frees.
        self.register_comm_hook(self.sent, _all_reduce)
        self.sequence_group, self.calls, self.exchanged = sequence_group, [], []
        if sequence_group is not None:
            world = dist.get_world_size(sequence_group)
            for layer in model.modules():
                if isinstance(layer, MultiheadAttention):
                    layer.register_forward_hook(_note_exchange(self.calls, world))

    def forward(self, *inputs, **kwargs):
        self.calls.clear()
        return super().forward(*inputs, **kwargs)

    def backward(self, loss):
        self.sent.clear()
        self.exchanged.clear()
        if self.sequence_group is not None:
            nodes = _state_exchanges(loss)
            if len(nodes) != len(self.calls):  # the same graph, so the same verdict, everywhere
                raise RuntimeError("the backward holds %d attention state exchanges for %d "
                                   "sequence parallel calls" % (len(nodes), len(self.calls)))
            exchanged = self.exchanged  # not self: the graph's nodes would hold this module
            for node in nodes:  # the node's post-hook: after its all-reduce
                node.register_hook(lambda *_: exchanged.append(None))
        try:
            loss.backward()
        except Exception:
            if self.sequence_group is not None:
                for count, dtype in self.calls[::-1][len(self.exchanged):]:
                    dist.all_reduce(torch.full((count,), math.nan, dtype=dtype),
                                    group=self.sequence_group)
            # DDP's join hook matches a whole backward the same way (reducer's buckets, in order).
            for bucket in self.reducer._get_zeros_like_grad_buckets():
                if bucket.index() not in self.sent:
                    dist.all_reduce(bucket.buffer().fill_(math.nan))
            raise


class Ranks:
    """rank of world_size processes; distributed when a gloo process group joins them (under
    torchrun, even with one process: the runs are then trained in this process, in turn).
    sequence: sequence parallel (each rank a slice of every sequence) instead of data parallel;
    sequence_group: the process group of the attention layers' exchanges then (all the ranks, a
    group of their own: see from_environment)."""

    def __init__(self, rank=0, world_size=1, distributed=False, sequence=False,
                 sequence_group=None):
        self.rank, self.world_size, self.distributed = rank, world_size, distributed
        self.sequence, self.sequence_group = sequence, sequence_group

    @property
    def main(self):
        """Rank 0: the one that evaluates, prints progress and writes files."""
        return self.rank == 0

    @property
    def mode(self):
        """"sequence" or "data" parallel when distributed, else None (as recorded)."""
        if not self.distributed:
            return None
        return "sequence" if self.sequence else "data"

    def share(self, inputs, targets):
        """This rank's contiguous share of a global batch [B, n], such that the ranks' shares
        together are exactly the single process's batch. Data parallel: rows rank * B/W to
        (rank + 1) * B/W (B must divide by W). Sequence parallel: every row, positions
        floor(rank * n / W) to floor((rank + 1) * n / W) -- n/W each, rounded down or up when W
        does not divide n (n >= W: no slice is empty)."""
        if self.sequence:
            length = inputs.shape[1]
            if length < self.world_size:
                raise ValueError("a sequence of %d positions does not split over %d processes" %
                                 (length, self.world_size))
            columns = slice(self.rank * length // self.world_size,
                            (self.rank + 1) * length // self.world_size)
            return inputs[:, columns], targets[:, columns]
        if len(inputs) % self.world_size:
            raise ValueError("a batch of %d sequences does not split over %d processes" %
                             (len(inputs), self.world_size))
        size = len(inputs) // self.world_size
        rows = slice(self.rank * size, (self.rank + 1) * size)
        return inputs[rows], targets[rows]

    def wrap(self, model):
        """The module to train: DistributedDataParallel over model when distributed (a collective:
        every rank constructs it at the same point), model itself otherwise. Sequence parallel,
        model's attention layers are also switched to it, over sequence_group (model.Decoder.
        sequence_parallel; an attribute, not state: checkpoints are the same in every mode)."""
        if self.sequence:
            model.sequence_parallel(self.sequence_group)
        if not self.distributed:
            return model
        return _DataParallel(model, self.sequence_group if self.sequence else None)

    def backward(self, trained, loss):
        """loss.backward() -- with the gradients' all-reduce when distributed. If it raises on
        this rank (a kernel refusing a non-finite gradient), the buckets this rank had not sent
        yet are sent filled with NaN before the error is raised again: the other ranks finish
        their backward with NaN gradients and end the run at the same step ("gradient norm nan"),
        where they would otherwise wait for this rank for ever."""
        if self.distributed:
            trained.backward(loss)
        else:
            loss.backward()

    def gather(self, value):
        """Every rank's value (any picklable object), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def broadcast(self, value):
        """Rank 0's value on every rank (what the other ranks pass is ignored)."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self):
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = Ranks()


def from_environment(sequence=False):
    """The ranks of this process: joins torchrun's gloo process group when launched by torchrun
    (it waits until every rank has arrived), SINGLE otherwise. sequence: sequence parallel, with
    a second group of all the ranks for the attention layers' state exchanges. A group of their
    own, so that those blocking all_gathers and all_reduces never queue among DDP's bucket
    all-reduces (asynchronous, launched from autograd hooks as the gradients become ready) on
    one group, whose operations every rank must issue in one order: how the two interleave is
    then of no consequence. Made once, right after joining, on every rank in the same order
    (dist.new_group is itself a collective)."""
    if not under_torchrun():
        if sequence:
            raise ValueError("sequence parallelism needs torchrun")
        return SINGLE
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size()))) if sequence else None
    return Ranks(dist.get_rank(), dist.get_world_size(), distributed=True, sequence=sequence,
                 sequence_group=group)


def combine_stats(per_rank):
    """The denominator statistics of the whole batch from each rank's, per layer: the smallest
    minimum and the summed counts (None for softmax layers). One rank's are returned as they are."""
    if len(per_rank) == 1:
        return per_rank[0]
    combined = []
    for layer in zip(*per_rank):
        if layer[0] is None:
            combined.append(None)
            continue
        combined.append(dict(min=min(s["min"] for s in layer),
                             **{key: sum(s[key] for s in layer)
                                for key in ("nonpositive", "below_threshold", "count")}))
    return combined
