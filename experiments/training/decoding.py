"""The trained models in use, after the sweep: decoding cost against position and text samples.

For each char_lm training context of the sweep, softmax + RoPE and the linear variant with the
lowest mean final bpc (the first seed's model of its cell: the full budget, its chosen learning
rate, plans.cell_runs) are decoded a token at a time from position 0 to 8 x the context
(generate.measure): the time per token and the bytes their caches hold, to decode.csv. Every
char_lm variant's first-seed model at the shortest context samples a short text from one prompt
(generate.sample, fixed seed), to samples.json, with how many of its words the training text has
(data.words_known). Decoding runs in this process on one thread; the time per token is a median
per window."""
import os
import statistics
import sys

import torch

import linrope
from analysis.common import write_csv, write_json  # experiments/analysis

from .data import words_known
from .generate import PROMPT, load_model, measure, sample
from .plans import cell_runs
from .variants import SOFTMAX_ROPE, in_catalogue_order

SAMPLE_TOKENS = 160
TEMPERATURE = 0.8
COLUMNS = ["variant", "context", "lr", "position", "seconds_per_token", "cache_bytes"]


def first_seed_models(results, out, context):
    """variant -> (the path of its cell's first seed's model, the mean final bpc of the cell),
    over the char_lm results at `context`, in catalogue order; a variant with W redrawn only
    where the same variant with W fixed was not trained."""
    variants_run = {r.variant for r in results if r.task == "char_lm" and r.context == context}
    chosen = {}
    for variant in in_catalogue_order(variants_run):
        if variant.redraw_interval and variant.replace(redraw_interval=0) in variants_run:
            continue
        at_best = cell_runs(results, "char_lm", context, variant)
        path = at_best[0].model_path(out)
        if os.path.exists(path):
            chosen[variant] = (path, statistics.fmean(r.final_bpc() for r in at_best))
    return chosen


def run(out, results, quiet=False, prompt=PROMPT, words=None):
    """Writes out/decode.csv and out/samples.json from the sweep's char_lm models (results:
    results.Result, as sweep.run_all returns them); words: the training text's (data.Corpus.words),
    to count a sample's known words (None: not counted)."""
    torch.set_num_threads(1)
    linrope.set_num_threads(1)
    contexts = sorted({r.context for r in results if r.task == "char_lm"})
    if not contexts:
        return
    rows, samples = [], []
    for context in contexts:
        models = first_seed_models(results, out, context)
        linear = [v for v in models if v.linear and models[v][1] < float("inf")]
        timed = [v for v in (SOFTMAX_ROPE,) if v in models]
        if linear:
            timed.append(min(linear, key=lambda v: models[v][1]))
        for variant in timed:
            model, _, config = load_model(models[variant][0])
            if not quiet:
                sys.stderr.write("decoding: %s (context %d) to position %d\n" % (
                    variant.name, context, 8 * context))
            for row in measure(model, 8 * context):
                rows.append(dict(variant=variant.name, context=context, lr=config.lr, **row))
        if context != contexts[0]:
            continue
        for variant, (path, _) in models.items():
            model, chars, config = load_model(path)
            if not set(prompt) <= set(chars):
                continue  # another corpus without the prompt's characters
            text = sample(model, chars, prompt, SAMPLE_TOKENS, TEMPERATURE)
            count, known = words_known(text[len(prompt):], words) if words else (None, None)
            samples.append(dict(variant=variant.name, context=context, lr=config.lr,
                                seed=config.seed, steps=config.steps, prompt=prompt,
                                temperature=TEMPERATURE, text=text, words=count,
                                known_words=known))
    write_csv(os.path.join(out, "decode.csv"), rows, COLUMNS)
    write_json(os.path.join(out, "samples.json"), samples)
