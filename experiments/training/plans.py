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
(best_lr): the same rule for the plan and the report. The plan is deterministic given the grid's
results, so --resume finds the same runs again."""
import dataclasses
import math

from .model import VARIANTS
from .train import Config

# d_model 64, 2 layers, 2 heads of 32: the --full plan ran in 92 minutes on a 2-core CPU
# (an Intel Xeon, two runs at once).
MODEL = dict(d_model=64, layers=2, heads=2)
# Log-spaced, the same grid for every variant. 3e-2 was added after a first grid of three ended
# with 9 of the 14 variants best at 1e-2, its edge (600 steps favour large rates).
LEARNING_RATES = (1e-3, 3e-3, 1e-2, 3e-2)
MAPS = ("elu", "favor", "cos")
# At the long context whatever the grid says: the comparison the study is about, for FAVOR+
# (elu+1's is at 256 only, to fit the budget).
LONG_ALWAYS = ("softmax-rope", "favor-numerator_only", "favor-full")

# MQAR at lr 1e-3: at 3e-3 softmax + RoPE did not learn it (64 tokens, 4 pairs, 1000 steps, batch
# 64: 0.17 accuracy against 0.90 at 1e-3, untied output layer; model.Decoder).
# (Cut to fit the budget: elu+1's before_map and full, FAVOR+'s before_map, 1+cos.)
MQAR_VARIANTS = ("softmax-rope", "elu-numerator_only", "elu-nodenom", "favor-numerator_only",
                 "favor-full", "favor-nodenom")

MODES = {
    "quick": dict(
        variants=("softmax-rope", "favor-numerator_only", "favor-full", "elu-nodenom"),
        seeds=(0, 1),
        char_lm=dict(lrs=(3e-3, 1e-2), steps=30, batch_size=16, context=64, warmup=5,
                     eval_every=15, eval_tokens=2048, final_eval_tokens=2048, log_every=5,
                     checkpoint_every=15, long=dict(context=128, batch_size=8),
                     redraw=dict(interval=10, placements=2)),
        mqar=dict(variants=("softmax-rope", "favor-numerator_only"),
                  more_features=dict(factor=4, variants=("favor-numerator_only",)), seeds=(0,), steps=30, batch_size=16, lr=1e-3, warmup=5, eval_every=15,
                  log_every=5, checkpoint_every=15, mqar_test_size=32,
                  mqar_settings=((64, 4), (128, 8))),
        step_time=dict(lengths=(256, 512, 1024), repeats=3)),
    "full": dict(
        variants=tuple(VARIANTS),
        seeds=(0, 1, 2),
        char_lm=dict(lrs=LEARNING_RATES, steps=600, batch_size=16, context=256, warmup=60,
                     eval_every=100, eval_tokens=32768, log_every=10, checkpoint_every=100,
                     long=dict(context=1024, batch_size=4),  # the same tokens per step
                     redraw=dict(interval=100, placements=2)),
        # Recall against state size: FAVOR+ at m = 4 x head dim as well, for two placements.
        mqar=dict(variants=MQAR_VARIANTS, seeds=(0, 1), steps=1500, batch_size=64, lr=1e-3,
                  more_features=dict(factor=4, variants=("favor-numerator_only",)),
                  warmup=150, eval_every=250, log_every=10, checkpoint_every=250,
                  mqar_test_size=256, mqar_settings=((64, 4), (128, 8), (128, 16))),
        step_time=dict(lengths=(256, 512, 1024, 2048, 4096, 8192), repeats=5)),
}

TASKS = ("char_lm", "mqar")
STAGES = ("grid", "seeds", "redraw", "long", "mqar")
_TASK_OF = dict(grid="char_lm", seeds="char_lm", redraw="char_lm", long="char_lm", mqar="mqar")


def final_bpc(result):
    """A char_lm run's final validation bpc at its training context (inf if it diverged)."""
    if result["summary"]["status"] != "complete":
        return math.inf
    context = result["config"]["context"]
    values = [e["value"] for e in result["records"]["evaluations"]
              if e["final"] and e["length"] == context]
    return values[-1] if values else math.inf


def _grid_runs(results, variant, context, redraw_interval):
    return [r for r in results if r["config"]["task"] == "char_lm"
            and r["config"]["variant"] == variant and r["config"]["context"] == context
            and r["config"]["redraw_interval"] == redraw_interval]


def best_lr(results, variant, context, redraw_interval=0):
    """The learning rate whose grid run (the first seed, char_lm at `context`, W redrawn as
    the grid was: every redraw_interval steps, 0 never) ends lowest (ties to the smaller rate);
    None without such a run. The grid is the runs of the smallest seed present."""
    runs = _grid_runs(results, variant, context, redraw_interval)
    if not runs:
        return None
    seed = min(r["config"]["seed"] for r in runs)
    grid = sorted((final_bpc(r), r["config"]["lr"]) for r in runs if r["config"]["seed"] == seed)
    return grid[0][1]


def best_variants(results, candidates, context, redraw_interval=0):
    """candidates ordered by their grid's best final bpc (the first seed's, as best_lr reads it;
    those without a grid run left out)."""
    scored = []
    for variant in candidates:
        runs = _grid_runs(results, variant, context, redraw_interval)
        if runs:
            seed = min(r["config"]["seed"] for r in runs)
            scored.append((min(final_bpc(r) for r in runs if r["config"]["seed"] == seed),
                           variant))
    return [v for _, v in sorted(scored)]


@dataclasses.dataclass
class Plan:
    """A mode's runs with the command line's overrides; stage(name, results) gives a stage's
    configs from the results of the stages before it."""
    mode: str = "quick"
    tasks: tuple = TASKS
    variants: tuple = None       # None: the mode's; else these in every stage
    seeds: tuple = None          # None: the mode's (the grid runs the first)
    steps: int = None
    redraw_interval: int = 0     # > 0: every run redraws W every k steps (no redraw stage)
    threads: int = 1
    lrs: tuple = None            # None: the mode's grid
    stages: tuple = STAGES

    def __post_init__(self):
        self.plan = MODES[self.mode]

    def stage_names(self):
        return [s for s in STAGES if s in self.stages and _TASK_OF[s] in self.tasks
                and not (s == "redraw" and self.redraw_interval)
                and not (s == "long" and not self.plan["char_lm"].get("long"))]

    def _variants(self, wanted):
        """The mode's variants for a stage, or those of --variants instead."""
        return list(wanted if self.variants is None else self.variants)

    def _among_chosen(self, wanted):
        """Those of the mode's variants that --variants, if given, names."""
        return [v for v in wanted if self.variants is None or v in self.variants]

    def _seeds(self, task):
        if self.seeds is not None:
            return tuple(self.seeds)
        return tuple(self.plan[task].get("seeds", self.plan["seeds"]))

    def _config(self, task, variant, seed, lr, **changes):
        settings = {k: v for k, v in self.plan[task].items()
                    if k not in ("lrs", "lr", "long", "redraw", "variants", "more_features",
                                 "seeds")}
        settings.update(changes)
        if self.steps is not None:
            settings["steps"] = self.steps
            settings["warmup"] = min(settings["warmup"], max(1, self.steps // 10))
        settings.setdefault("context", 0)
        settings.setdefault("redraw_interval", self.redraw_interval)
        return Config(task=task, variant=variant, seed=seed, lr=lr, threads=self.threads,
                      **MODEL, **settings)

    def stage(self, name, results=()):
        """The configs of stage `name`, given the results of the stages before it (dicts as
        sweep.finished returns: config, summary, records)."""
        char_lm = self.plan["char_lm"]
        context, seeds = char_lm["context"], self._seeds("char_lm")
        variants = self._variants(self.plan["variants"])
        if name == "grid":
            return [self._config("char_lm", v, seeds[0], lr)
                    for v in variants for lr in self.lrs or char_lm["lrs"]]
        redraw = self.redraw_interval
        best = {v: best_lr(results, v, context, redraw) for v in variants}
        if name == "seeds":
            return [self._config("char_lm", v, s, best[v]) for v in variants if best[v]
                    for s in seeds[1:]]
        if name == "redraw":
            redraws = char_lm["redraw"]
            favor = best_variants(results, [v for v in variants if v.startswith("favor-")],
                                  context)[:redraws["placements"]]
            return [self._config("char_lm", v, s, best[v], redraw_interval=redraws["interval"])
                    for v in favor for s in seeds]
        if name == "long":
            chosen = list(LONG_ALWAYS)
            for short in MAPS:
                chosen += best_variants(results, [v for v in variants
                                                  if v.startswith(short + "-")], context,
                                        redraw)[:1]
            chosen = [v for v in dict.fromkeys(chosen) if v in variants and best.get(v)]
            return [self._config("char_lm", v, s, best[v], **char_lm["long"])
                    for v in chosen for s in seeds]
        if name == "mqar":
            mqar, more = self.plan["mqar"], self.plan["mqar"].get("more_features")
            cells = [(v, 2) for v in self._variants(mqar["variants"])]
            if more:
                cells += [(v, more["factor"]) for v in self._among_chosen(more["variants"])]
            return [self._config("mqar", v, s, mqar["lr"], feature_factor=f)
                    for v, f in cells for s in self._seeds("mqar")]
        raise ValueError("unknown stage %r; the stages are %s" % (name, ", ".join(STAGES)))

    def all_variants(self):
        """Every variant some stage may train (for the command line's checks and the metadata)."""
        return tuple(dict.fromkeys(self._variants(self.plan["variants"]) +
                                   self._variants(self.plan["mqar"]["variants"])))

    def preview(self):
        """Every stage's configs as if each grid run had ended at the same bpc (the smallest
        learning rate then being every variant's best): the shapes and contexts the plan will
        train, to check before the first run."""
        grid = self.stage("grid") if "grid" in self.stage_names() else []
        results = [dict(config=dataclasses.asdict(c), summary=dict(status="complete"),
                        records=dict(evaluations=[dict(final=True, length=c.context,
                                                       value=0.0)]))
                   for c in grid]
        return [c for name in self.stage_names() for c in
                (grid if name == "grid" else self.stage(name, results))]
