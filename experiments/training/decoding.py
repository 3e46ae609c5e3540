"""The trained models in use, after the sweep: decoding cost against position and text samples.

For each char_lm training context of the sweep, softmax + RoPE and the linear variant with the
lowest mean final bpc (the first seed's model, at its best learning rate, plans.best_lr) are
decoded a token at a time from position 0 to 8 x the context (generate.measure): the time per
token and the bytes their caches hold, to decode.csv. Every char_lm variant's first-seed model at the shortest
context samples a short text from one prompt (generate.sample, fixed seed), to samples.json.
Decoding runs in this process on one thread; the time per token is a median per window."""
import csv
import io
import os
import statistics
import sys

import torch

import linrope
from analysis.common import write_atomic, write_json  # experiments/analysis

from .generate import load_model, measure, sample
from .model import VARIANTS
from .plans import best_lr, final_bpc

PROMPT = "It is a truth universally acknowledged"
SAMPLE_TOKENS = 160
TEMPERATURE = 0.8


def _first_seed_models(results, out, context):
    """variant -> (the path of its first seed's model at its best learning rate, the mean final
    bpc of its seeds there), over the char_lm runs at `context` (W never redrawn, unless every
    run was)."""
    runs = [r for r in results if r["config"]["task"] == "char_lm"
            and r["config"]["context"] == context]
    redraw = min((r["config"]["redraw_interval"] for r in runs), default=0)
    runs = [r for r in runs if r["config"]["redraw_interval"] == redraw]
    chosen = {}
    for variant in dict.fromkeys(r["config"]["variant"] for r in runs):
        lr = best_lr(runs, variant, context, redraw)
        mine = sorted((r for r in runs if r["config"]["variant"] == variant
                       and r["config"]["lr"] == lr), key=lambda r: r["config"]["seed"])
        path = os.path.join(out, "models", _key(mine[0]) + ".pt")
        if os.path.exists(path):
            chosen[variant] = (path, statistics.fmean(final_bpc(r) for r in mine))
    return chosen


def _key(result):
    from .train import Config  # the file name is the run's key
    config = dict(result["config"])
    config["extrapolation"] = tuple(config["extrapolation"])
    config["mqar_settings"] = tuple(tuple(s) for s in config["mqar_settings"])
    return Config(**config).key()


def run(out, results, quiet=False, prompt=PROMPT):
    """Writes out/decode.csv and out/samples.json from the sweep's char_lm models (results as
    sweep.run_all returns them)."""
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    contexts = sorted({r["config"]["context"] for r in results
                       if r["config"]["task"] == "char_lm"})
    if not contexts:
        return
    rows, samples = [], []
    for context in contexts:
        models = _first_seed_models(results, out, context)
        linear = [v for v in models if VARIANTS[v]["attention"] == "linear"
                  and models[v][1] < float("inf")]
        timed = [v for v in ("softmax-rope",) if v in models]
        if linear:
            timed.append(min(linear, key=lambda v: models[v][1]))
        for variant in timed:
            model, _, config = load_model(models[variant][0])
            if not quiet:
                sys.stderr.write("decoding: %s (context %d) to position %d\n" % (
                    variant, context, 8 * context))
            for row in measure(model, 8 * context):
                rows.append(dict(variant=variant, context=context, lr=config["lr"], **row))
        if context != contexts[0]:
            continue
        for variant in [v for v in VARIANTS if v in models]:
            model, chars, config = load_model(models[variant][0])
            if not set(prompt) <= set(chars):
                continue  # another corpus without the prompt's characters
            samples.append(dict(variant=variant, context=context, lr=config["lr"],
                                seed=config["seed"], prompt=prompt, temperature=TEMPERATURE,
                                text=sample(model, chars, prompt, SAMPLE_TOKENS, TEMPERATURE)))
    text = io.StringIO()
    writer = csv.DictWriter(text, ["variant", "context", "lr", "position", "seconds_per_token",
                                   "cache_bytes"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(os.path.join(out, "decode.csv"), text.getvalue())
    write_json(os.path.join(out, "samples.json"), samples)
