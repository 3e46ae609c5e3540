"""One training run: a Decoder of one variant, one task, one seed.

AdamW with linear warm-up and cosine decay to a tenth, gradient clipping (how often it clips is
recorded), batches drawn from (seed, step). An MQAR run with a stop_accuracy ends at the first
evaluation at which every setting's held-out accuracy reaches it (as Zoology stops its runs). A
NaN or infinite loss or gradient norm ends the run as diverged, at that step, before the
optimiser could apply it. Every `checkpoint_every` steps the whole state (model, optimiser,
records) is written atomically; a run started again with the same configuration continues from
it and gives the same numbers as an uninterrupted one.

Under torchrun (parallel.py) each rank trains on its share of the same global batch -- a block of
its sequences (data parallel), or a slice of every sequence along its length (sequence parallel:
the attention layers exchange states between the ranks) -- and the ranks average their gradients
after each backward; the loss curve is the single process's to float32 rounding, rank 0 alone
evaluates and writes, and a checkpoint written in any mode continues in any other.

RunHooks is the trainer's seam for tests that must reach runs built inside other processes."""
import dataclasses
import io
import math
import os
import time

import torch
import torch.nn.functional as F

import linrope
from analysis.common import write_atomic  # experiments/analysis

from . import mqar
from .caches import state_floats
from .model import Decoder, combine_stats
from .parallel import ONE_PROCESS
from .variants import Variant

LN2 = math.log(2.0)
# The records and summary entries that measure time: two runs of one configuration differ there.
TIMING = ("train_seconds", "wall_seconds", "tokens_per_s")
# MQAR: the summary gives the first evaluated step at which the held-out accuracy reached each.
RECALL_THRESHOLDS = (0.9, 0.99)


@dataclasses.dataclass
class Config:
    task: str                    # "char_lm" or "mqar"
    variant: Variant
    seed: int
    steps: int
    batch_size: int
    context: int                 # char_lm: training context; mqar: unused (settings)
    d_model: int
    layers: int
    heads: int
    lr: float
    warmup: int
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 100
    eval_tokens: int = 32768     # char_lm: validation characters per evaluation
    extrapolation: tuple = (1, 2, 4)  # char_lm: final evaluation at these multiples of context
    mqar_settings: tuple = ()    # ((length, pairs), ...): trained in turn, each tested
    mqar_vocab: int = 512
    mqar_test_size: int = 256
    stop_accuracy: float = None  # mqar: stop once every setting's held-out accuracy reaches it
    log_every: int = 10
    checkpoint_every: int = 100
    stats_threshold: float = 1e-3
    threads: int = 1
    text_digest: str = ""        # char_lm: the corpus's (data.Corpus.digest), so that --resume
    #                              never continues a run on another text
    final_eval_tokens: int = 0   # char_lm: validation characters at the end (0: all of them)

    def key(self):
        """The run's name, unique within a plan: what it trains and how (file names, logs)."""
        return run_key(self.task, self.context, self.mqar_settings, self.variant, self.lr,
                       self.steps, self.seed)

    @classmethod
    def from_dict(cls, saved):
        """The Config that dataclasses.asdict gave `saved` (also after a round trip through JSON,
        which makes tuples lists)."""
        return cls(**dict(saved, variant=Variant(**saved["variant"]),
                          extrapolation=tuple(saved["extrapolation"]),
                          mqar_settings=tuple(tuple(s) for s in saved["mqar_settings"])))


def run_key(task, context, mqar_settings, variant, lr, steps, seed):
    """A run's name: the task, char_lm's context or MQAR's settings, the variant's name, the
    learning rate, the budget (optimiser steps; None: not known, in tables that lack it) and the
    seed, e.g. char_lm-n256-favor-numerator_only-lr0.003-steps2441-s1 or
    mqar-64x4-softmax-rope-lr0.001-steps5000-s0."""
    where = "n%d" % context if task == "char_lm" else mqar.settings_name(mqar_settings)
    budget = [] if steps is None else ["steps%d" % steps]
    return "-".join([task, *([where] if where else []), variant.name, "lr%g" % lr, *budget,
                     "s%d" % seed])


class RunHooks:
    """The trainer's seam for tests: a Run calls started(run) once its model and optimiser exist
    (before a checkpoint is loaded into them) and finished(run) when train() returns. A test that
    cannot reach the runs themselves -- under torchrun they are built inside each process -- passes
    a subclass to training.__main__.main (tests/torchrun_entry.py) and acts on run.model through
    PyTorch's public module hooks: an interrupt at a step, a backward that raises on one rank, the
    digests of what each rank computed. Runs from the command line have none (these do nothing).
    Runs trained in worker processes (--jobs) get a pickled copy. stepped(run) is called at the
    end of every step train() completes, logging and evaluation included: bench/profile_step.py
    times steps there, as a long run takes them. finished(run) is called once the run has ended
    (by train(), before it returns the summary), not after a call that stop_after cut short."""

    def started(self, run):
        pass

    def stepped(self, run):
        pass

    def finished(self, run):
        pass


def learning_rate(config, step):
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def optimiser(model, config):
    # No weight decay on norms and biases (1-D); the embedding and output layer are weights.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=config.lr)


def loss_of(model, inputs, targets, reduction="mean"):
    """The cross-entropy over the scored positions (targets not mqar.IGNORE), whose logits alone
    are computed where some positions are not scored: model(inputs, at) gives them."""
    scored = targets != mqar.IGNORE
    if bool(scored.all()):
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction=reduction)
    return F.cross_entropy(model(inputs, scored), targets[scored], reduction=reduction)


@torch.no_grad()
def validation_bpc(model, corpus, context, tokens, batch=16):
    """Mean bits per character over every position of consecutive validation windows."""
    model.eval()
    x, y = corpus.validation_windows(context, tokens)
    total = 0.0
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + batch].reshape(-1),
                                 reduction="sum").item()
    model.train()
    return total / y.numel() / LN2


@torch.no_grad()
def mqar_accuracy(model, config, length, pairs, batch=64):
    """Share of query positions whose most likely next token is the key's value."""
    model.eval()
    x, y = mqar.test_set(config.seed, config.mqar_test_size, length, pairs, config.mqar_vocab)
    right = total = 0
    for i in range(0, len(x), batch):
        scored = y[i:i + batch] != mqar.IGNORE
        predicted = model(x[i:i + batch], scored).argmax(-1)
        right += int((predicted == y[i:i + batch][scored]).sum())
        total += int(scored.sum())
    model.train()
    return right / total


def gradient_norm(parameters):
    grads = [p.grad.reshape(-1) for p in parameters if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat(grads))) if grads else 0.0


def _refused(error):
    """The divergence reason for a kernel's linrope.NonFiniteError: weights that overflowed, or a
    NaN gradient reaching a backward -- the same divergence as a non-finite loss, found one call
    earlier."""
    return "non-finite values in a kernel's input: %s" % str(error).splitlines()[0]


class Run:
    """The state of one run; `records` holds what it measured so far (saved in checkpoints).
    group (parallel.TrainingGroup): the processes training it together, ONE_PROCESS by default;
    hooks: a test's RunHooks."""

    def __init__(self, config, corpus=None, group=ONE_PROCESS, hooks=None):
        self.config, self.corpus, self.group = config, corpus, group
        self.hooks = hooks or RunHooks()
        vocab = corpus.vocab_size if config.task == "char_lm" else config.mqar_vocab
        if config.task == "char_lm":
            if config.text_digest and config.text_digest != corpus.digest:
                raise ValueError("the text (sha256 %s...) is not the one this run was configured "
                                 "for (%s...)" % (corpus.digest, config.text_digest))
            # Fail now, not after training, if the final evaluation's longest window won't fit.
            corpus.validation_windows(max(config.extrapolation) * config.context, 1)
        self.model = Decoder(vocab, config.variant, config.d_model, config.layers, config.heads,
                             config.seed, config.stats_threshold)
        group.prepare(self.model)
        self.optimiser = optimiser(self.model, config)
        self.step = 0
        self.records = dict(curves=[], layers=[], evaluations=[], clipped=0, train_seconds=0.0,
                            diverged_step=None, diverged_reason=None, den_totals=None,
                            window=[], target_step=None, wall_seconds=0.0)
        self.hooks.started(self)

    # ---- checkpoints ------------------------------------------------------------------------
    def save(self, path):
        """Writes the checkpoint (rank 0 only: the other ranks hold the same state)."""
        if not self.group.main:
            return
        state = io.BytesIO()
        torch.save(dict(config=dataclasses.asdict(self.config), step=self.step,
                        model=self.model.state_dict(), optimiser=self.optimiser.state_dict(),
                        records=self.records), state)
        write_atomic(path, state.getvalue())

    def load(self, path):
        """Continues from the checkpoint at path if there is one and this configuration wrote it
        (returns whether it did). Rank 0 reads the file and sends its bytes to the other ranks:
        every rank continues from the same state, and only rank 0 needs to see the file."""
        data = None
        if self.group.main and os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
        data = self.group.broadcast(data)
        if data is None:
            return False
        state = torch.load(io.BytesIO(data))
        if state["config"] != dataclasses.asdict(self.config):
            return False
        self.model.load_state_dict(state["model"])
        self.optimiser.load_state_dict(state["optimiser"])
        self.step, self.records = state["step"], state["records"]
        return True

    # ---- training ---------------------------------------------------------------------------
    def batch(self, step):
        """The step's global batch (inputs, targets) [batch_size, n], drawn from (seed, step); a
        subclass may draw others (the tests do, to score the shares unevenly)."""
        c = self.config
        if c.task == "char_lm":
            return self.corpus.batch(c.seed, step, c.batch_size, c.context)
        return mqar.training_batch(c.seed, step, c.batch_size, c.mqar_settings, c.mqar_vocab)

    def evaluate(self, final=False):
        """Validation at the current step: char_lm bpc at the training context (and, when final,
        at each extrapolation multiple), mqar accuracy per (length, pairs). By this process
        alone, whole sequences (sequence parallelism off meanwhile: no collective inside)."""
        with self.model.alone():
            return self._evaluate(final)

    def _evaluate(self, final):
        c, rows = self.config, []
        if c.task == "char_lm":
            tokens = c.eval_tokens
            if final:
                tokens = c.final_eval_tokens or len(self.corpus.validation)
            for multiple in (c.extrapolation if final else (1,)):
                rows.append(dict(step=self.step, final=final, length=multiple * c.context,
                                 pairs=None, metric="bpc",
                                 value=validation_bpc(self.model, self.corpus,
                                                      multiple * c.context, tokens)))
        else:
            for length, pairs in c.mqar_settings:
                rows.append(dict(step=self.step, final=final, length=length, pairs=pairs,
                                 metric="accuracy",
                                 value=mqar_accuracy(self.model, c, length, pairs)))
        self.records["evaluations"].extend(rows)
        return rows

    def _record_denominators(self, step, layer_norms, per_layer):
        for layer, (stats, norm) in enumerate(zip(per_layer, layer_norms)):
            row = dict(step=step, layer=layer, grad_norm=norm, den_min=None,
                       nonpositive_share=None, tiny_share=None)
            if stats is not None:
                row.update(den_min=stats["min"],
                           nonpositive_share=stats["nonpositive"] / stats["count"],
                           tiny_share=stats["below_threshold"] / stats["count"])
            self.records["layers"].append(row)

    def _accumulate_denominators(self, stats):
        """The statistics over every training step so far, per layer (none for softmax)."""
        if stats[0] is not None:
            totals = self.records["den_totals"]
            self.records["den_totals"] = combine_stats([stats] if totals is None else
                                                       [totals, stats])

    def forward(self, tokens, at=None):
        """The logits of this rank's share of a training batch, at the positions `at` marks
        (None: every one): the model's (a subclass may compute them otherwise: the tests stand in
        for the other ranks of a sequence)."""
        return self.model(tokens, at)

    def step_loss(self, step):
        """This rank's loss on its share of the step's batch, weighted so that the ranks' losses
        average to the batch's mean, and, if a kernel refused its input, the reason (the loss is
        then None)."""
        inputs, targets = self.batch(step)
        scored = int((targets != mqar.IGNORE).sum())
        inputs, targets = self.group.share(inputs, targets)
        # The ranks average their gradients, so the losses the ranks differentiate must average
        # to the batch's mean, sum / scored: rank r's must be l_r = W sum_r / scored = mean_r x
        # W scored_r / scored, sum_r and scored_r its share's summed token losses and scored
        # tokens. Split by sequences the weight is exactly 1 (every char_lm position is scored,
        # every MQAR sequence scores exactly `pairs` queries). Split along the length it is not:
        # slices hold n/W rounded either way, and MQAR's queries follow its pairs, so early
        # slices score few or none.
        # Sequence parallel, l_r depends on the parameters also through the earlier ranks'
        # slices (their states, gathered in each attention layer's forward); the layer's
        # backward all-reduces the gradients with respect to every rank's state and hands rank p
        # the sum over r of dl_r/dstate_p. So rank p's gradient is d(sum_r l_r)/dtheta along
        # every path through rank p's computations (its own loss's and the later ranks' through
        # its states); summed over p, every path: d(sum_r l_r)/dtheta. The average divides by
        # W: the gradient of sum_r l_r / W = sum / scored, the batch mean's, for ANY split.
        share_scored = int((targets != mqar.IGNORE).sum())
        weight = self.group.world_size * share_scored / scored
        try:
            if share_scored:
                return loss_of(self.forward, inputs, targets) * weight, None
            # No scored token in the share: its mean is 0/0, its sum, 0, is l_r. A zero still
            # computed through the model, so that this rank's backward runs too: it joins the
            # attention layers' all-reduces and the gradients' average, and its parameters get
            # the later slices' gradients through its states.
            return loss_of(self.forward, inputs, targets, reduction="sum"), None
        except linrope.NonFiniteError as e:
            return None, _refused(e)

    def _exchange(self, loss, reason):
        """The step's one exchange between ranks: the mean loss over the whole batch, the first
        rank's failure (None if none failed) and the whole batch's denominator statistics, the
        same on every rank, and so are the decisions taken on them (a rank that stopped alone
        would leave the others waiting in the next collective)."""
        share = (math.nan if loss is None else float(loss) / self.group.world_size, reason,
                 self.model.denominator_stats())
        everyone = self.group.gather(share)
        reasons = [r for _, r, _ in everyone if r is not None]
        return (sum(part for part, _, _ in everyone), reasons[0] if reasons else None,
                combine_stats([stats for _, _, stats in everyone]))

    def _backward(self, loss, exchanges, logged):
        """Gradients (averaged over the ranks after the backward: TrainingGroup.backward), the
        attention blocks' gradient norms when logged, clipping: (norm, layer norms or None,
        divergence reason). A kernel refusing a non-finite gradient on one rank only gives the
        others NaN gradients: every rank ends the run at this step, the others' reason being
        "gradient norm nan"."""
        self.optimiser.zero_grad(set_to_none=True)
        try:
            self.group.backward(loss, exchanges, self.model.parameters())
        except linrope.NonFiniteError as e:
            return math.nan, None, _refused(e)
        layer_norms = None
        if logged:  # before clipping rescales the gradients in place
            layer_norms = [gradient_norm(b.attention.parameters()) for b in self.model.blocks]
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip))
        return norm, layer_norms, None if math.isfinite(norm) else "gradient norm %s" % norm

    def train(self, checkpoint=None, progress=None, stop_after=None):
        """Trains up to config.steps (the schedule's length) and returns the run's summary, once
        hooks.finished has seen it. With stop_after, at most that many steps of this call: a call
        that stops before the run ends (the schedule done, a divergence, the target reached)
        returns None, with no summary made (it decodes a whole sequence) and no finished hook,
        so that a caller stepping a run in parts (bench/profile_step.py) gets steps as a long run
        takes them, not each one the schedule's last (logged and summarised)."""
        c, model = self.config, self.model
        torch.set_num_threads(c.threads)
        linrope.set_num_threads(c.threads)
        model.train()
        last = c.steps if stop_after is None else min(c.steps, self.step + stop_after)
        while (self.step < last and self.records["diverged_step"] is None
               and self.records["target_step"] is None):
            step = self.step
            started = time.perf_counter()
            for param_group in self.optimiser.param_groups:
                param_group["lr"] = learning_rate(c, step)
            logged = (step + 1) % c.log_every == 0 or step + 1 == c.steps
            with self.group.recording() as exchanges:
                loss, reason = self.step_loss(step)
            mean_loss, reason, stats = self._exchange(loss, reason)
            norm, layer_norms = math.nan, None
            if reason is None:
                self._accumulate_denominators(stats)
                if not math.isfinite(mean_loss):
                    reason = "loss %s" % mean_loss
            if reason is None:
                norm, layer_norms, reason = self._backward(loss, exchanges, logged)
            logged = logged or reason is not None
            if logged:
                if layer_norms is None:  # the step failed before its backward
                    layer_norms = [math.nan] * len(model.blocks)
                self._record_denominators(step + 1, layer_norms, stats)
            if reason is not None:
                # Steps are counted from 1, as in the curves: step k is the k-th update.
                self.records["diverged_step"], self.records["diverged_reason"] = step + 1, reason
                break
            self.records["clipped"] += norm > c.clip
            self.optimiser.step()
            self.step += 1
            self.records["train_seconds"] += time.perf_counter() - started
            window = self.records["window"]  # losses since the last curve row, checkpointed
            window.append(mean_loss)
            if logged:
                self.records["curves"].append(dict(
                    step=self.step, train_loss=sum(window) / len(window),
                    scheduled_lr=learning_rate(c, step),
                    grad_norm=norm, clipped_so_far=self.records["clipped"]))
                window.clear()
            if self.step % c.eval_every == 0 or self.step == c.steps:
                self._scheduled_evaluation()
            if progress and logged:
                progress(self)
            if checkpoint and (self.step % c.checkpoint_every == 0):
                self.save(checkpoint)
            self.records["wall_seconds"] += time.perf_counter() - started
            self.hooks.stepped(self)
        if (self.step < c.steps and self.records["diverged_step"] is None
                and self.records["target_step"] is None):
            return None  # stopped after stop_after steps: the run goes on
        self.hooks.finished(self)
        return self.summary()

    def _scheduled_evaluation(self):
        """Rank 0 evaluates (no collective inside). With a stop_accuracy, a run whose every
        setting reached it ends here, this evaluation its final one: rank 0 decides, and every
        rank learns its decision."""
        c = self.config
        rows = self.evaluate(final=self.step == c.steps) if self.group.main else []
        if c.stop_accuracy is None:
            return
        reached = self.group.broadcast(bool(rows) and min(r["value"] for r in rows) >=
                                       c.stop_accuracy)
        if reached:
            for row in rows:
                row["final"] = True
            self.records["target_step"] = self.step

    # ---- results ----------------------------------------------------------------------------
    def summary(self):
        c, r = self.config, self.records
        steps_done = self.step
        tokens = steps_done * self.tokens_per_step()
        out = dict(steps=steps_done,
                   status="diverged" if r["diverged_step"] is not None else "complete",
                   diverged_step=r["diverged_step"], diverged_reason=r["diverged_reason"],
                   clip_share=r["clipped"] / steps_done if steps_done else math.nan,
                   tokens_per_s=tokens / r["train_seconds"] if r["train_seconds"] else math.nan,
                   train_seconds=r["train_seconds"], wall_seconds=r["wall_seconds"],
                   tokens_per_step=self.tokens_per_step(), tokens=tokens,
                   final_train_loss=r["curves"][-1]["train_loss"] if r["curves"] else math.nan,
                   # One sequence's decoding caches at the length trained (MQAR: the longest).
                   state_floats=state_floats(self.model, c.context if c.task == "char_lm" else
                                             max(n for n, _ in c.mqar_settings)))
        if c.task == "mqar":
            out.update(self._recall())
        for layer, total in enumerate(r["den_totals"] or []):
            out["layer%d_den_min" % layer] = total["min"]
            out["layer%d_nonpositive_share" % layer] = total["nonpositive"] / total["count"]
            out["layer%d_tiny_share" % layer] = total["below_threshold"] / total["count"]
        return out

    def tokens_per_step(self):
        """Tokens of one step's batch (MQAR: the mean over its settings, trained in turn)."""
        c = self.config
        if c.task == "char_lm":
            return c.batch_size * c.context
        return c.batch_size * sum(n for n, _ in c.mqar_settings) / len(c.mqar_settings)

    def _recall(self):
        """MQAR: the final accuracy (the worst setting's), the step the run stopped at having
        reached stop_accuracy (None: it did not stop early) and, per threshold of
        RECALL_THRESHOLDS, the first evaluated step at which every setting reached it (None:
        never)."""
        by_step = {}
        for e in self.records["evaluations"]:
            by_step.setdefault(e["step"], []).append(e["value"])
        finals = [e["value"] for e in self.records["evaluations"] if e["final"]]
        out = {"final_accuracy": min(finals) if finals and self.records["diverged_step"] is None
               else None, "target_step": self.records["target_step"]}
        for threshold in RECALL_THRESHOLDS:
            out["steps_to_%g" % threshold] = min(
                (step for step, values in by_step.items() if min(values) >= threshold),
                default=None)
        return out
