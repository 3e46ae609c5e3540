"""What --quick and --full run: the models, the budgets, the variants, the learning rates and the
seeds, in stages, each stage's runs chosen from the results of the stages before it
(results.Result), so that one command runs the whole study and --resume finds the same runs:

  grid        char_lm at the training context and the grid's (shorter) budget: every variant at
              every rate of the learning-rate grid, the first seed;
  grid_edge   char_lm, as the grid: a variant whose best rate is the smallest or the largest it
              tried gets the next rate beyond it on the 1-3-10 ladder, and again (up to
              `extensions` rates per variant) while its best stays at that edge;
  seeds       char_lm at the full budget: every variant at its best rate, every seed;
  lr_check    char_lm at the full budget, the first seed: softmax + RoPE and the best linear
              variant of the grid at the rates beside their best, to check that the best rate of
              the shorter budget is also the best of the full one;
  extras      char_lm at the full budget: the best linear variant(s) of the seeds stage with the
              short convolution and with RetNet's decay, at the base variant's rate, every seed;
  long        char_lm at the long context, the full budget (the same characters per run):
              softmax + RoPE, each map's best placement and the best linear variant with or
              without the extras (seeds and extras stages), at their rates of the training
              context, every seed;
  mqar_grid   MQAR, each (length, pairs) setting trained on its own: every variant at every rate,
              the first seed, each run until its held-out accuracy reaches the stop accuracy or
              the steps run out (its cap);
  mqar_seeds  MQAR: every variant and setting at its best rate, the other seeds.

One rule picks a learning rate, best_lr: the rate whose grid run (the first seed's, at the
smallest budget) scores best by results.Result.score -- the lowest final validation bpc, or the
highest final accuracy and then the fewest steps --, ties to the smaller rate; a variant with a
decay or a short convolution added and no grid of its own takes its base variant's (chosen_lr).
The plan, the summary, the decoding and the report all choose by it."""
import dataclasses
import math

from .results import Result
from .train import Config
from .variants import FEATURE_MAPS, SOFTMAX_ROPE, from_name


def _named(*names):
    return tuple(map(from_name, names))


# The char_lm model and its throughput: tokens/s of one training run on one thread (forward,
# backward, clipping, AdamW; the median step's CPU time, which is its wall time on a core of its
# own) at each context, for softmax + RoPE and for the slowest linear variant measured (elu+1
# and FAVOR+ eq. 19), from which --plan and the first stage's estimate cost the plan
# (budget.py). Measured by bench/profile_step.py (bench/RESULTS.md, "The study's training step")
# on the 2-core EPYC: d_model 128 and 4 layers trains ~9,300-10,700 tokens/s at context 256,
# 5x slower than d_model 64 and 2 layers: its char_lm stages alone would take ~9 h of the 5.
# d_model 64 gives every run its 10 M characters.
MODEL = dict(d_model=64, layers=2, heads=4)
THROUGHPUT = {256: dict(softmax=49000, linear=44000), 1024: dict(softmax=27000, linear=49000)}
# MQAR's model: Zoology's two layers; recall against state size comes from the variants.
MQAR_MODEL = dict(d_model=64, layers=2, heads=2)
# Measured after the loss took the logits of the scored positions only (bench/RESULTS.md, "MQAR's
# loss at its scored positions only").
MQAR_THROUGHPUT = {64: dict(softmax=53000, linear=44000), 128: dict(softmax=60000, linear=44000),
                   256: dict(softmax=60000, linear=32000)}

# The study's char_lm variants: softmax + RoPE; elu+1 and FAVOR+ each with eq. 19
# (numerator_only), full, before_map and no denominator. (Cut from the catalogue to fit the
# budget: RoPE "none", softmax without positions and 1+cos, which the 600-step study placed last
# or near it.)
CHAR_LM_VARIANTS = _named(
    "softmax-rope", "elu-numerator_only", "elu-full", "elu-before_map", "elu-nodenom",
    "favor-numerator_only", "favor-full", "favor-before_map", "favor-nodenom")
# MQAR: softmax + RoPE, and eq. 19 (RoPE in the numerator only, this library's subject) with a
# width-4 short convolution for elu+1 and FAVOR+: what recall each form reaches at its state size
# (FAVOR+'s, 9,604 floats, is 1.8 x elu+1's; softmax's KV cache 16,384 at (64, 4)). (Without the
# convolution, eq. 19 stayed at the guessing level at (64, 4): docs/results/mqar-64x4-short-conv.)
# Cut to fit the 5 hours (each variant costs ~45-60 min of the plan at its caps; README), though
# the issue asks for them: elu+1 without a denominator (cut last, when the 128x8 runs measured
# ~22 min each against the plan's 16), elu+1 full, FAVOR+ full and no denominator, each with and
# without the convolution, FAVOR+ eq. 19 without it; RetNet's decay; FAVOR+ at 4 x head dim
# features.
MQAR_VARIANTS = _named("softmax-rope", "elu-numerator_only-conv4", "favor-numerator_only-conv4")

MODES = {
    "quick": dict(
        seeds=(0, 1),
        char_lm=dict(
            model=dict(d_model=32, layers=2, heads=2),
            variants=_named("softmax-rope", "elu-numerator_only", "favor-numerator_only",
                            "favor-full"),
            context=64, batch_size=16, tokens=40 * 16 * 64, warmup=0.1,
            grid=dict(lrs=(3e-3, 1e-2), tokens=20 * 16 * 64, extensions=1),
            lr_check=dict(variants=2),
            extras=dict(best=1, short_conv=4, decay="retnet"),
            long=dict(context=128, batch_size=8),
            run=dict(eval_every=10, eval_tokens=2048, final_eval_tokens=2048, log_every=5,
                     checkpoint_every=10)),
        mqar=dict(
            model=dict(d_model=32, layers=2, heads=2),
            variants=_named("softmax-rope", "elu-nodenom", "elu-nodenom-conv4"),
            settings=((64, 4), (128, 8)), lrs=(1e-3, 3e-3), steps=30, batch_size=16,
            warmup=0.1,
            run=dict(stop_accuracy=0.99, eval_every=10, log_every=5, checkpoint_every=10,
                     mqar_test_size=32)),
        step_time=dict(lengths=(256, 512, 1024), repeats=3)),
    "full": dict(
        seeds=(0, 1, 2),
        char_lm=dict(
            model=MODEL, throughput=THROUGHPUT, variants=CHAR_LM_VARIANTS,
            # 10 M characters per run (2,441 steps of 16 x 256), the grid at a quarter of that.
            context=256, batch_size=16, tokens=10_000_000, warmup=0.1,
            grid=dict(lrs=(1e-3, 3e-3, 1e-2), tokens=2_500_000, extensions=2),
            lr_check=dict(variants=2),
            extras=dict(best=1, short_conv=4, decay="retnet"),
            long=dict(context=1024, batch_size=4),  # the same characters per step
            run=dict(eval_every=100, eval_tokens=32768, final_eval_tokens=131072, log_every=10,
                     checkpoint_every=100)),
        mqar=dict(
            model=MQAR_MODEL, throughput=MQAR_THROUGHPUT, variants=MQAR_VARIANTS, seeds=(0, 1),
            # (256, 16) cut: 16,384 tokens a step at ~32,000 tokens/s (linear), ~45 min a run
            # at the cap, 9 runs: more than the other two settings together.
            settings=((64, 4), (128, 8)), lrs=(3e-4, 1e-3, 3e-3),
            steps=5000, batch_size=64, warmup=0.1,  # the cap; a run stops at 0.99 before it
            run=dict(stop_accuracy=0.99, eval_every=100, log_every=10, checkpoint_every=500,
                     mqar_test_size=256)),
        step_time=dict(lengths=(256, 512, 1024, 2048, 4096, 8192), repeats=5)),
}

TASKS = ("char_lm", "mqar")
STAGES = ("grid", "grid_edge", "seeds", "lr_check", "extras", "long", "mqar_grid", "mqar_seeds")
TASK_OF = {stage: "mqar" if stage.startswith("mqar") else "char_lm" for stage in STAGES}
# The char_lm stages a mode leaves out by setting their entry to None (the tests' tiny plans do).
OPTIONAL = ("lr_check", "extras", "long")


# ---- choosing from results ----------------------------------------------------------------

def grid_runs(results, task, setting, variant):
    """The grid of `variant` at `setting` (char_lm's context, MQAR's settings): its runs of the
    smallest seed present at the smallest budget any run of the task there has."""
    here = [r for r in results if r.task == task and r.setting == setting]
    budget = min((r.budget or 0 for r in here), default=None)
    runs = [r for r in here if r.variant == variant and (r.budget or 0) == budget]
    seed = min((r.seed for r in runs), default=None)
    return [r for r in runs if r.seed == seed]


def best_lr(runs):
    """The learning rate of the best-scoring run (results.Result.score), ties to the smaller
    rate; None without runs."""
    ranked = sorted((r.score(), r.lr) for r in runs)
    return ranked[0][1] if ranked else None


def grid_setting(results, task, setting):
    """Where the rates of runs at `setting` were chosen: char_lm's smallest context (the longer
    one trains at its rates), MQAR's setting itself."""
    if task == "mqar":
        return setting
    return min((r.context for r in results if r.task == "char_lm"), default=setting)


def chosen_lr(results, task, setting, variant):
    """The rate `variant` trains at beyond the grid: best_lr of its grid (at grid_setting), or,
    for a variant with extras and no grid of its own, its base variant's."""
    where = grid_setting(results, task, setting)
    rate = best_lr(grid_runs(results, task, where, variant))
    if rate is None and variant.extras:
        rate = best_lr(grid_runs(results, task, where, variant.base))
    return rate


def cell_runs(results, task, setting, variant):
    """The runs of one ranked cell, by seed: the variant's at `setting` at the largest budget
    trained there, at its chosen rate when they have several."""
    here = [r for r in results if r.task == task and r.setting == setting and r.variant == variant]
    budget = max((r.budget or 0 for r in here), default=None)
    here = [r for r in here if (r.budget or 0) == budget]
    if len({r.lr for r in here}) > 1:
        rate = chosen_lr(results, task, setting, variant)
        here = [r for r in here if r.lr == rate]
    return sorted(here, key=lambda r: r.seed)


def cell_score(runs):
    """The mean of the runs' first score (final bpc, or negated accuracy); inf if one diverged
    or there are none."""
    scores = [r.score()[0] for r in runs]
    return sum(scores) / len(scores) if scores else math.inf


def ranked(results, task, setting, candidates):
    """candidates ordered by their cells' mean score at `setting` (best first; ties keep the
    given order); those without a cell left out."""
    scored = [(cell_score(cell_runs(results, task, setting, v)), i, v)
              for i, v in enumerate(candidates)
              if cell_runs(results, task, setting, v)]
    return [v for _, _, v in sorted(scored, key=lambda item: item[:2])]


def ladder(rate, step):
    """The rate `step` places from `rate` on the 1-3-10 ladder (..., 1e-3, 3e-3, 1e-2, ...):
    the grids' spacing, used to go beyond a grid's edge."""
    position = round(2 * math.log10(rate)) + step
    decade, half = divmod(position, 2)
    return float("%ge%d" % (3 if half else 1, decade))


def edge(runs):
    """-1 or +1 if the best rate of `runs` (a variant's grid) is the smallest or the largest it
    tried (diverged runs count as tried), else None; None for fewer than two rates."""
    rates = sorted({r.lr for r in runs})
    best = best_lr(runs)
    if len(rates) < 2 or best is None:
        return None
    return -1 if best == rates[0] else (+1 if best == rates[-1] else None)


def run_settings(entry):
    """A plan's MQAR setting as a run's mqar_settings: a (length, pairs) trained on its own, or
    a tuple of them trained in turn (train.Config)."""
    return (tuple(entry),) if isinstance(entry[0], int) else tuple(tuple(s) for s in entry)


# ---- the plan -----------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    """A mode's runs with the command line's overrides; stage(name, results) gives a stage's
    configs from the results of the stages before it. modes and model stand in for MODES and
    every task's model (None: those): the seam through which the tests under torchrun train tiny
    plans (tests/torchrun_entry.py).

    variants: None (the mode's) or these Variants in every stage; seeds: None (the mode's; the
    grids run the first); steps: every run's optimiser steps instead of the budgets; lrs: every
    grid's rates; stages: those to train (the others' finished runs are read, not trained);
    mqar_settings: MQAR's settings instead of the mode's (each a (length, pairs) or a tuple of
    them: run_settings)."""
    mode: str = "quick"
    tasks: tuple = TASKS
    variants: tuple = None
    seeds: tuple = None
    steps: int = None
    redraw_interval: int = 0     # > 0: every FAVOR+ run redraws W every k steps
    threads: int = 1
    lrs: tuple = None
    stages: tuple = STAGES
    modes: dict = None
    model: dict = None
    mqar_settings: tuple = None

    def __post_init__(self):
        self.settings = (MODES if self.modes is None else self.modes)[self.mode]

    # ---- what the plan holds ----
    def stage_names(self):
        """Every stage of the plan's tasks, in order (trained or not: see selected)."""
        char_lm = self.settings["char_lm"]
        return [s for s in STAGES if TASK_OF[s] in self.tasks
                and not (s in OPTIONAL and not char_lm.get(s))
                and not (s == "grid_edge" and not char_lm["grid"].get("extensions"))]

    def selected(self, stage):
        """Whether --stages asks to train this stage."""
        return stage in self.stages

    def model_of(self, task):
        return dict(self.settings[task]["model"] if self.model is None else self.model)

    def rates(self, task="char_lm"):
        """The learning-rate grid of a task."""
        settings = self.settings[task]
        return tuple(self.lrs or (settings["grid"]["lrs"] if task == "char_lm" else
                                  settings["lrs"]))

    def mqar_setting_list(self):
        """MQAR's settings, each a run's mqar_settings (run_settings)."""
        return tuple(map(run_settings, self.mqar_settings or self.settings["mqar"]["settings"]))

    def _variants(self, task):
        """The mode's variants of a task, or those of --variants; with --redraw-interval,
        FAVOR+'s redrawn."""
        chosen = self.settings[task]["variants"] if self.variants is None else self.variants
        return [self._redrawn(v) for v in chosen]

    def _redrawn(self, variant):
        if self.redraw_interval and variant.feature_map == "favor+":
            return variant.replace(redraw_interval=self.redraw_interval)
        return variant

    def seeds_of(self, task):
        if self.seeds is not None:
            return tuple(self.seeds)
        return tuple(self.settings[task].get("seeds", self.settings["seeds"]))

    # ---- configs ----
    def _config(self, task, variant, seed, lr, steps, **fields):
        settings = self.settings[task]
        steps = self.steps or steps
        return Config(task=task, variant=variant, seed=seed, lr=lr, steps=steps,
                      warmup=max(1, round(settings["warmup"] * steps)), threads=self.threads,
                      **self.model_of(task), **dict(settings["run"], **fields))

    def _char_lm(self, variant, seed, lr, tokens=None, long=False):
        """A char_lm config at the full budget (tokens: another), at the training context or
        (long) the long one."""
        s = self.settings["char_lm"]
        shape = s["long"] if long else s
        tokens = tokens or s["tokens"]
        steps = max(1, round(tokens / (shape["batch_size"] * shape["context"])))
        return self._config("char_lm", variant, seed, lr, steps, context=shape["context"],
                            batch_size=shape["batch_size"])

    def _mqar(self, variant, settings, seed, lr):
        s = self.settings["mqar"]
        return self._config("mqar", variant, seed, lr, s["steps"], context=0,
                            batch_size=s["batch_size"], mqar_settings=settings)

    def stage(self, name, results=()):
        """The configs of stage `name` given the results (results.Result) of the stages before
        it -- and of its own earlier rounds: grid_edge adds one rate per variant a round, and
        a stage is done when it gives no config that has not run."""
        stages = dict(grid=self._grid, grid_edge=self._grid_edge, seeds=self._seeds_stage,
                      lr_check=self._lr_check, extras=self._extras, long=self._long,
                      mqar_grid=self._mqar_grid, mqar_seeds=self._mqar_seeds)
        if name not in stages:
            raise ValueError("unknown stage %r; the stages are %s" % (name, ", ".join(STAGES)))
        return stages[name](list(results))

    def _grid(self, results):
        s = self.settings["char_lm"]
        return [self._char_lm(v, self.seeds_of("char_lm")[0], lr, s["grid"]["tokens"])
                for v in self._variants("char_lm") for lr in self.rates()]

    def _grid_edge(self, results):
        s = self.settings["char_lm"]
        configs = []
        for v in self._variants("char_lm"):
            runs = grid_runs(results, "char_lm", s["context"], v)
            side = edge(runs)
            tried = {r.lr for r in runs} - set(self.rates())
            if side is None or len(tried) >= s["grid"]["extensions"]:
                continue
            rate = ladder(best_lr(runs), side)
            if 0 < rate < 1:
                configs.append(self._char_lm(v, self.seeds_of("char_lm")[0], rate,
                                             s["grid"]["tokens"]))
        return configs

    def _rate(self, results, variant, context=None):
        return chosen_lr(results, "char_lm", context or self.settings["char_lm"]["context"],
                         variant)

    def _every_seed(self, results, variants, long=False):
        """Every seed of each variant at its chosen rate (those without one left out)."""
        return [self._char_lm(v, s, self._rate(results, v), long=long) for v in variants
                if self._rate(results, v) for s in self.seeds_of("char_lm")]

    def _seeds_stage(self, results):
        return self._every_seed(results, self._variants("char_lm"))

    def _lr_check(self, results):
        s = self.settings["char_lm"]
        context = s["context"]
        variants = self._variants("char_lm")
        grids = {v: grid_runs(results, "char_lm", context, v) for v in variants if v.linear}
        by_grid = sorted((v for v in grids if grids[v]),
                         key=lambda v: min(r.score() for r in grids[v]))
        checked = ([SOFTMAX_ROPE] if SOFTMAX_ROPE in variants else []) + by_grid
        configs = []
        for v in checked[:s["lr_check"]["variants"]]:
            rates = sorted({r.lr for r in grid_runs(results, "char_lm", context, v)})
            best = self._rate(results, v)
            if best not in rates:
                continue
            i = rates.index(best)
            configs += [self._char_lm(v, self.seeds_of("char_lm")[0], rate)
                        for rate in rates[max(0, i - 1):i] + rates[i + 1:i + 2]]
        return configs

    def _bases(self, results):
        """The linear variants without extras of the plan, best cell first (seeds stage)."""
        return ranked(results, "char_lm", self.settings["char_lm"]["context"],
                      [v for v in self._variants("char_lm") if v.linear and not v.extras])

    def _extra_variants(self, results):
        extras = self.settings["char_lm"]["extras"]
        added = []
        for v in self._bases(results)[:extras["best"]]:
            if extras.get("short_conv"):
                added.append(v.replace(short_conv=extras["short_conv"]))
            if extras.get("decay"):
                added.append(v.replace(decay=extras["decay"]))
        return added

    def _extras(self, results):
        return self._every_seed(results, self._extra_variants(results))

    def _long(self, results):
        context = self.settings["char_lm"]["context"]
        variants = self._variants("char_lm")
        chosen = [SOFTMAX_ROPE] if SOFTMAX_ROPE in variants else []
        bases = self._bases(results)
        for kind in FEATURE_MAPS:
            chosen += [v for v in bases if v.feature_map == kind][:1]
        linear = bases + (self._extra_variants(results) if "extras" in self.stage_names()
                          else [])
        chosen += ranked(results, "char_lm", context, linear)[:1]
        return self._every_seed(results, list(dict.fromkeys(chosen)), long=True)

    def _mqar_grid(self, results):
        seed = self.seeds_of("mqar")[0]
        return [self._mqar(v, setting, seed, lr) for v in self._variants("mqar")
                for setting in self.mqar_setting_list() for lr in self.rates("mqar")]

    def _mqar_seeds(self, results):
        configs = []
        for v in self._variants("mqar"):
            for setting in self.mqar_setting_list():
                rate = chosen_lr(results, "mqar", setting, v)
                if rate:
                    configs += [self._mqar(v, setting, s, rate) for s in self.seeds_of("mqar")[1:]]
        return configs

    # ---- the whole plan, before it runs ----
    def all_variants(self, tasks=None):
        """Every variant some stage of `tasks` (None: the plan's) may train (for the command
        line's checks and the metadata): the plan's, and the extras' for each of its linear
        char_lm variants."""
        tasks = self.tasks if tasks is None else tasks
        variants = []
        if "char_lm" in tasks:
            variants += self._variants("char_lm")
            extras = self.settings["char_lm"].get("extras")
            if extras and "extras" in self.stage_names():
                variants += [v.replace(**{k: extras[k]}) for v in variants
                             if v.linear and not v.extras
                             for k in ("short_conv", "decay") if extras.get(k)]
        if "mqar" in tasks:
            variants += self._variants("mqar")
        return tuple(dict.fromkeys(variants))

    def preview(self):
        """Every stage's configs as if every grid had found its middle rate best and the
        variants ranked in the plan's order: the runs, shapes and budgets the plan will train
        (grid_edge then adds none; MQAR's runs at their cap), to check before the first run."""
        return [c for _, configs in self.preview_stages() for c in configs]

    def preview_stages(self):
        """preview, stage by stage: [(stage name, its configs)]."""
        results, stages, seen = [], [], set()
        for name in self.stage_names():
            configs = []
            while True:
                new = [c for c in self.stage(name, results) if c.key() not in seen]
                if not new:
                    break
                seen.update(c.key() for c in new)
                configs += new
                results += [self._imagined(c) for c in new]
            stages.append((name, configs))
        return stages

    def _imagined(self, config):
        """A finished run of config for preview: its score grows with the rate's distance from
        the grid's middle rate and with the variant's place in the plan."""
        rates = self.rates(config.task)
        middle = rates[len(rates) // 2]
        order = list(self.all_variants())
        place = order.index(config.variant) if config.variant in order else len(order)
        value = abs(math.log10(config.lr / middle)) + 0.01 * place
        if config.task == "char_lm":
            evaluations = [dict(final=True, length=config.context, pairs=None, value=2 + value)]
        else:
            evaluations = [dict(final=True, length=length, pairs=pairs, value=1 / (1 + value))
                           for length, pairs in config.mqar_settings]
        return Result(config.task, config.context, config.variant, config.lr, config.seed,
                      summary=dict(status="complete", steps=config.steps),
                      records=dict(curves=[], layers=[], evaluations=evaluations),
                      mqar_settings=config.mqar_settings, budget=config.steps)
