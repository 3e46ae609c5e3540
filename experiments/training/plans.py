"""What --quick and --full run: the model, the budget, the variants, the learning rates and the
seeds, in stages, each stage's runs chosen from the results of the stages before it:

  grid    char_lm at the training context: every variant at every learning rate of the grid,
          the first seed;
  seeds   char_lm: every variant at its best learning rate (grid), the other seeds;
  redraw  char_lm: FAVOR+ with W redrawn every k steps, for its best two placements (grid), at
          their best learning rates, every seed;
  long    char_lm at the long context: softmax + RoPE, each feature map's best placement (grid)
          and FAVOR+'s numerator_only and full (the study's question), at their best learning
          rates of the short context, every seed;
  mqar    MQAR: its variants (some FAVOR+ ones also with more features), one learning rate, its
          seeds.

A variant's best learning rate is the one whose grid run ends with the lowest validation bpc
(best_lr): the same rule for the plan, the decoding and the report. The plan is deterministic
given the grid's results, so --resume finds the same runs again."""
import dataclasses

from .train import Config
from .variants import CATALOGUE, FEATURE_MAPS, from_name

# d_model 64, 2 layers, 2 heads of 32: the --full plan ran in 92 minutes on a 2-core CPU
# (an Intel Xeon, two runs at once).
MODEL = dict(d_model=64, layers=2, heads=2)
# Log-spaced, the same grid for every variant; it reaches 3e-2 because a grid ending at 1e-2 left
# 9 of the 14 variants best at its edge (600 steps favour large rates).
LEARNING_RATES = (1e-3, 3e-3, 1e-2, 3e-2)
# At the long context whatever the grid says: the comparison the study is about, for FAVOR+
# (elu+1's is at 256 only, to fit the budget).
LONG_ALWAYS = tuple(map(from_name, ("softmax-rope", "favor-numerator_only", "favor-full")))

# MQAR at lr 1e-3: at 3e-3 softmax + RoPE did not learn it (64 tokens, 4 pairs, 1000 steps, batch
# 64: 0.17 accuracy against 0.90 at 1e-3, untied output layer; model.Decoder).
# (Cut to fit the budget: elu+1's before_map and full, FAVOR+'s before_map, 1+cos.)
MQAR_VARIANTS = tuple(map(from_name, (
    "softmax-rope", "elu-numerator_only", "elu-nodenom", "favor-numerator_only", "favor-full",
    "favor-nodenom")))

MODES = {
    "quick": dict(
        variants=tuple(map(from_name, ("softmax-rope", "favor-numerator_only", "favor-full",
                                       "elu-nodenom"))),
        seeds=(0, 1),
        char_lm=dict(lrs=(3e-3, 1e-2), steps=30, batch_size=16, context=64, warmup=5,
                     eval_every=15, eval_tokens=2048, final_eval_tokens=2048, log_every=5,
                     checkpoint_every=15, long=dict(context=128, batch_size=8),
                     redraw=dict(interval=10, placements=2)),
        mqar=dict(variants=tuple(map(from_name, ("softmax-rope", "favor-numerator_only"))),
                  more_features=dict(factor=4, variants=(from_name("favor-numerator_only"),)),
                  seeds=(0,), steps=30, batch_size=16, lr=1e-3, warmup=5, eval_every=15,
                  log_every=5, checkpoint_every=15, mqar_test_size=32,
                  mqar_settings=((64, 4), (128, 8))),
        step_time=dict(lengths=(256, 512, 1024), repeats=3)),
    "full": dict(
        variants=CATALOGUE,
        seeds=(0, 1, 2),
        char_lm=dict(lrs=LEARNING_RATES, steps=600, batch_size=16, context=256, warmup=60,
                     eval_every=100, eval_tokens=32768, log_every=10, checkpoint_every=100,
                     long=dict(context=1024, batch_size=4),  # the same tokens per step
                     redraw=dict(interval=100, placements=2)),
        # Recall against state size: FAVOR+ at m = 4 x head dim as well, for two placements.
        mqar=dict(variants=MQAR_VARIANTS, seeds=(0, 1), steps=1500, batch_size=64, lr=1e-3,
                  more_features=dict(factor=4, variants=(from_name("favor-numerator_only"),)),
                  warmup=150, eval_every=250, log_every=10, checkpoint_every=250,
                  mqar_test_size=256, mqar_settings=((64, 4), (128, 8), (128, 16))),
        step_time=dict(lengths=(256, 512, 1024, 2048, 4096, 8192), repeats=5)),
}

TASKS = ("char_lm", "mqar")
STAGES = ("grid", "seeds", "redraw", "long", "mqar")
_TASK_OF = dict(grid="char_lm", seeds="char_lm", redraw="char_lm", long="char_lm", mqar="mqar")


def grid_runs(results, variant, context):
    """The grid of `variant` at `context`: its char_lm runs of the smallest seed present."""
    runs = [r for r in results if r.task == "char_lm" and r.variant == variant
            and r.context == context]
    seed = min((r.seed for r in runs), default=None)
    return [r for r in runs if r.seed == seed]


def best_lr(results, variant, context):
    """The learning rate whose grid run (results.Result; the first seed's, char_lm at `context`)
    ends lowest, ties to the smaller rate; None without such a run."""
    grid = sorted((r.final_bpc(), r.lr) for r in grid_runs(results, variant, context))
    return grid[0][1] if grid else None


def best_variants(results, candidates, context):
    """candidates ordered by their grid's best final bpc (the first seed's, as best_lr reads it;
    those without a grid run left out)."""
    scored = [(min(r.final_bpc() for r in grid), i) for i, grid in enumerate(
        grid_runs(results, v, context) for v in candidates) if grid]
    return [candidates[i] for _, i in sorted(scored)]


@dataclasses.dataclass
class Plan:
    """A mode's runs with the command line's overrides; stage(name, results) gives a stage's
    configs from the results of the stages before it. modes and model stand in for MODES and
    MODEL (None: those): the seam through which the tests under torchrun train tiny plans
    (tests/torchrun_entry.py)."""
    mode: str = "quick"
    tasks: tuple = TASKS
    variants: tuple = None       # None: the mode's; else these Variants in every stage
    seeds: tuple = None          # None: the mode's (the grid runs the first)
    steps: int = None
    redraw_interval: int = 0     # > 0: every FAVOR+ run redraws W every k steps (no redraw stage)
    threads: int = 1
    lrs: tuple = None            # None: the mode's grid
    stages: tuple = STAGES
    modes: dict = None
    model: dict = None

    def __post_init__(self):
        self.model = dict(MODEL if self.model is None else self.model)
        self.settings = (MODES if self.modes is None else self.modes)[self.mode]

    def stage_names(self):
        return [s for s in STAGES if s in self.stages and _TASK_OF[s] in self.tasks
                and not (s == "redraw" and self.redraw_interval)
                and not (s == "long" and not self.settings["char_lm"].get("long"))]

    def _variants(self, wanted):
        """The mode's variants for a stage, or those of --variants instead; with
        --redraw-interval, FAVOR+'s redrawn."""
        return [self._redrawn(v) for v in (wanted if self.variants is None else self.variants)]

    def _redrawn(self, variant):
        if self.redraw_interval and variant.feature_map == "favor+":
            return variant.replace(redraw_interval=self.redraw_interval)
        return variant

    def _more_features(self):
        """MQAR's variants with more features: those of the mode's that --variants, if given,
        names."""
        more = self.settings["mqar"].get("more_features")
        if not more:
            return []
        chosen = [v for v in more["variants"] if self.variants is None or v in self.variants]
        return [self._redrawn(v).replace(feature_factor=more["factor"]) for v in chosen]

    def _seeds(self, task):
        if self.seeds is not None:
            return tuple(self.seeds)
        return tuple(self.settings[task].get("seeds", self.settings["seeds"]))

    def _config(self, task, variant, seed, lr, **changes):
        settings = {k: v for k, v in self.settings[task].items()
                    if k not in ("lrs", "lr", "long", "redraw", "variants", "more_features",
                                 "seeds")}
        settings.update(changes)
        if self.steps is not None:
            settings["steps"] = self.steps
            settings["warmup"] = min(settings["warmup"], max(1, self.steps // 10))
        settings.setdefault("context", 0)
        return Config(task=task, variant=variant, seed=seed, lr=lr, threads=self.threads,
                      **self.model, **settings)

    def rates(self):
        """The learning-rate grid."""
        return tuple(self.lrs or self.settings["char_lm"]["lrs"])

    def stage(self, name, results=()):
        """The configs of stage `name`, given the results of the stages before it
        (results.Result)."""
        context = self.settings["char_lm"]["context"]
        return self._stage(name, lambda v: best_lr(results, v, context),
                           lambda candidates: best_variants(results, candidates, context))

    def _stage(self, name, best_lr_of, ranked):
        """stage(), its choices made by best_lr_of(variant) (None: no grid run) and
        ranked(candidates) (best first, those without a grid run left out)."""
        char_lm = self.settings["char_lm"]
        seeds = self._seeds("char_lm")
        variants = self._variants(self.settings["variants"])
        if name == "grid":
            return [self._config("char_lm", v, seeds[0], lr)
                    for v in variants for lr in self.rates()]
        best = {v: best_lr_of(v) for v in variants}
        if name == "seeds":
            return [self._config("char_lm", v, s, best[v]) for v in variants if best[v]
                    for s in seeds[1:]]
        if name == "redraw":
            redraws = char_lm["redraw"]
            favor = ranked([v for v in variants if v.feature_map == "favor+"])
            return [self._config("char_lm", v.replace(redraw_interval=redraws["interval"]), s,
                                 best[v])
                    for v in favor[:redraws["placements"]] for s in seeds]
        if name == "long":
            chosen = [self._redrawn(v) for v in LONG_ALWAYS]
            for kind in FEATURE_MAPS:
                chosen += ranked([v for v in variants if v.feature_map == kind])[:1]
            chosen = [v for v in dict.fromkeys(chosen) if v in variants and best.get(v)]
            return [self._config("char_lm", v, s, best[v], **char_lm["long"])
                    for v in chosen for s in seeds]
        if name == "mqar":
            mqar = self.settings["mqar"]
            return [self._config("mqar", v, s, mqar["lr"])
                    for v in self._variants(mqar["variants"]) + self._more_features()
                    for s in self._seeds("mqar")]
        raise ValueError("unknown stage %r; the stages are %s" % (name, ", ".join(STAGES)))

    def all_variants(self):
        """Every variant some stage may train (for the command line's checks and the metadata)."""
        variants = self._variants(self.settings["variants"])
        if "redraw" in self.stage_names():
            interval = self.settings["char_lm"]["redraw"]["interval"]
            variants += [v.replace(redraw_interval=interval) for v in variants
                         if v.feature_map == "favor+"]
        return tuple(dict.fromkeys(variants + self._variants(self.settings["mqar"]["variants"]) +
                                   self._more_features()))

    def preview(self):
        """Every stage's configs as if each grid run had ended at the same bpc (the smallest
        learning rate then being every variant's best): the shapes and contexts the plan will
        train, to check before the first run."""
        names = self.stage_names()
        smallest = min(self.rates()) if "grid" in names else None  # no grid: no choice either
        return [c for name in names for c in self._stage(
            name, lambda v: smallest, lambda candidates: candidates if smallest else [])]
