"""What --quick and --full run: the model, the budget, the variants and the seeds."""
from .model import VARIANTS
from .train import Config

# Scaled so that the --full sweep fits in under an hour on a 2-core CPU: d_model 64, 2 layers, 2 heads of 32; MQAR trained on
# lengths 64-256 with 4-16 pairs, taken in turn.
MODEL = dict(d_model=64, layers=2, heads=2)
MQAR_SETTINGS = ((64, 4), (128, 8), (256, 16))
# MQAR at lr 1e-3: at 3e-3 softmax + RoPE did not learn it (64 tokens, 4 pairs, 1000 steps, batch
# 64: 0.17 accuracy against 0.90 at 1e-3, untied output layer; model.Decoder).

MODES = {
    "quick": dict(
        variants=("softmax-rope", "favor-numerator_only", "favor-full", "elu-numerator_only"),
        char_lm=dict(seeds=(0,), steps=40, batch_size=16, context=128, lr=3e-3, warmup=10,
                     eval_every=20, eval_tokens=4096, final_eval_tokens=4096, log_every=5,
                     checkpoint_every=20),
        mqar=dict(seeds=(0,), steps=40, batch_size=16, lr=1e-3, warmup=10, eval_every=20,
                  log_every=5, checkpoint_every=20, mqar_test_size=32,
                  mqar_settings=((64, 4), (128, 8))),
        step_time=dict(lengths=(256, 512, 1024), repeats=3)),
    "full": dict(
        variants=tuple(VARIANTS),
        char_lm=dict(seeds=(0, 1, 2), steps=1500, batch_size=16, context=256, lr=3e-3,
                     warmup=100, eval_every=100, eval_tokens=32768, log_every=10,
                     checkpoint_every=100),
        mqar=dict(seeds=(0, 1), steps=1000, batch_size=32, lr=1e-3, warmup=100, eval_every=250,
                  log_every=10, checkpoint_every=250, mqar_test_size=256,
                  mqar_settings=MQAR_SETTINGS),
        step_time=dict(lengths=(256, 512, 1024, 2048, 4096, 8192), repeats=5)),
}

TASKS = ("char_lm", "mqar")


def configs(mode, tasks=TASKS, variants=None, seeds=None, steps=None, redraw_interval=0,
            threads=1):
    plan = MODES[mode]
    out = []
    for task in tasks:
        settings = dict(plan[task])
        task_seeds = settings.pop("seeds")
        if steps is not None:
            settings["steps"] = steps
            settings["warmup"] = min(settings["warmup"], max(1, steps // 10))
        if task == "mqar":
            settings.setdefault("context", 0)
        for variant in variants or plan["variants"]:
            for seed in seeds if seeds is not None else task_seeds:
                out.append(Config(task=task, variant=variant, seed=seed,
                                  redraw_interval=redraw_interval, threads=threads,
                                  **MODEL, **settings))
    return out
