"""Data and sequence parallelism: the processes that train one run together.

Under torchrun (`/usr/bin/python3 -m torch.distributed.run --nproc_per_node N -m training ...`)
every process (a rank) builds the same model from the same seed (FAVOR+'s W included: it is drawn
from the seed and redrawn after the same count of training forwards on every rank), draws the
same global batch from (seed, step) and computes on its share of it. After its backward each rank
averages its gradients with the others' in one all-reduce (TrainingGroup.backward), so every rank
applies the same update and the parameters stay the same everywhere. The training loop
(train.py) adds one small exchange per step -- the ranks' losses, failures and denominator
statistics -- so that the records and every decision (a divergence ends the run) are the same on
every rank. Rank 0 alone evaluates and writes; a checkpoint reaches the other ranks through
rank 0 (no shared file system is needed).

What travels per step and rank, for P ranks and a model of N parameters (float32):
  * the gradients' all-reduce: 4 N bytes in, 4 N out (gloo's ring sends about 2 (P - 1) / P x
    4 N over the wire);
  * the step's exchange: each rank's pickled loss, failure and statistics to every rank
    (all_gather_object, ~260 bytes per rank for the default model);
  * sequence parallel, besides: each attention layer's state exchanges (the formula in
    linrope.torch.distributed's docstring: per layer and call, the forward all-gathers every
    rank's state, the backward all-reduces the P states' gradients).
TrainingGroup.traffic counts the first two, in bytes.

`TrainingGroup.share` is the one place that decides which part of the global batch a rank
computes:

  * data parallel (the default): a contiguous block of the batch's sequences, whole;
  * sequence parallel (`--sequence-parallel`, TrainingGroup.sequence): every sequence of the
    batch, each cut along its length into contiguous slices, one per rank. The attention layers
    then run with sequence_parallel on (linrope.torch.MultiheadAttention): each layer's causal
    linear attention continues from the states of the earlier ranks' slices
    (linrope.torch.distributed), so the ranks together compute the whole sequences.

The loss weighting in train.py (the share's scored tokens against the batch's) holds for either.

Outside torchrun, ONE_PROCESS stands for the one process: no torch.distributed call is made."""
import contextlib
import math
import os
import pickle

import torch
import torch.distributed as dist

# torchrun sets these in every worker; all four, so that one stray variable is not taken for it.
TORCHRUN_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")


def under_torchrun(environ=None):
    environ = os.environ if environ is None else environ
    return all(name in environ for name in TORCHRUN_VARIABLES)


def split_problem(length, processes):
    """None if a sequence of `length` positions splits over `processes` ranks with at least one
    position each (sequence parallel), else why not."""
    if length < processes:
        return "a sequence of %d positions does not split over %d processes" % (
            length, processes)
    return None


class _NoExchanges:
    """What TrainingGroup.recording yields when no attention layer exchanges states."""

    def join_pending(self):
        pass


class TrainingGroup:
    """This process's place among the processes training a run together: rank of world_size;
    distributed when a gloo process group joins them (under torchrun, even with one process: the
    runs are then trained in this process, in turn). sequence: sequence parallel (each rank a
    slice of every sequence) instead of data parallel.

    traffic: the bytes this rank has put into the gradients' all-reduce ("gradients") and into the
    per-step exchanges ("exchange", pickled), for training.ddp_cost."""

    def __init__(self, rank=0, world_size=1, distributed=False, sequence=False):
        self.rank, self.world_size, self.distributed = rank, world_size, distributed
        self.sequence = sequence
        self.traffic = dict(gradients=0, exchange=0)

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
            problem = split_problem(length, self.world_size)
            if problem:
                raise ValueError(problem)
            columns = slice(self.rank * length // self.world_size,
                            (self.rank + 1) * length // self.world_size)
            return inputs[:, columns], targets[:, columns]
        if len(inputs) % self.world_size:
            raise ValueError("a batch of %d sequences does not split over %d processes" %
                             (len(inputs), self.world_size))
        size = len(inputs) // self.world_size
        rows = slice(self.rank * size, (self.rank + 1) * size)
        return inputs[rows], targets[rows]

    def prepare(self, model):
        """Sequence parallel: model's attention layers switched to it, over the whole world
        (model.Decoder.sequence_parallel; an attribute, not state: checkpoints are the same in
        every mode). Otherwise model is left as it is."""
        if self.sequence:
            model.sequence_parallel()

    def recording(self):
        """The context the training forward runs in: sequence parallel and distributed, it records
        the attention layers' state exchanges (linrope.torch.distributed.record_exchanges), which
        backward() joins if the backward fails before them; otherwise one with none to join."""
        if self.sequence and self.distributed:
            from linrope.torch.distributed import record_exchanges
            return record_exchanges()
        return contextlib.nullcontext(_NoExchanges())

    def backward(self, loss, exchanges, parameters):
        """loss.backward(), then, when distributed, every parameter's gradient averaged over the
        ranks in one all-reduce of them all, flattened (4 bytes x parameters, float32). If the
        backward raises on this rank (a kernel refusing a non-finite gradient), the rank first
        joins the state exchanges it skipped (sequence parallel, `exchanges` from recording()),
        then sends NaN in the all-reduce, and raises again: the other ranks end their step with
        NaN gradients ("gradient norm nan") instead of waiting for ever. Every parameter of the
        model takes part in every step's loss, so every rank all-reduces the same N values."""
        parameters = list(parameters)
        try:
            loss.backward()
        except Exception:
            exchanges.join_pending()
            if self.distributed:
                self._average(parameters, failed=True)
            raise
        if self.distributed:
            self._average(parameters, failed=False)

    def _average(self, parameters, failed):
        flat = torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if failed or p.grad is None
                          else p.grad.reshape(-1) for p in parameters])
        if failed:
            flat.fill_(math.nan)
        self.traffic["gradients"] += flat.numel() * flat.element_size()
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for p in parameters:  # views of the one buffer: no copy
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def gather(self, value):
        """Every rank's value (any picklable object), in rank order, on every rank."""
        if not self.distributed:
            return [value]
        self.traffic["exchange"] += len(pickle.dumps(value))
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


ONE_PROCESS = TrainingGroup()


def from_environment(sequence=False):
    """The ranks of this process: joins torchrun's gloo process group when launched by torchrun
    (it waits until every rank has arrived), ONE_PROCESS otherwise. sequence: sequence parallel."""
    if not under_torchrun():
        if sequence:
            raise ValueError("sequence parallelism needs torchrun")
        return ONE_PROCESS
    dist.init_process_group("gloo")
    return TrainingGroup(dist.get_rank(), dist.get_world_size(), distributed=True,
                         sequence=sequence)
