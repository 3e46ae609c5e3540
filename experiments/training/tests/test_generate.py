"""training.generate: a finished char_lm run's saved model samples text through the layers'
caches, and --measure shows the caches' size: constant for linear attention, a row per token for
softmax. training.decoding: which models the sweep decodes and samples."""
import concurrent.futures
import csv
import dataclasses
import json
import os
import statistics

import pytest
import torch

from training import decoding, generate, sweep
from training.train import Run

PROMPT = "the cat"  # conftest's word_text is made of such words


def saved_model(tmp_path, run):
    path = str(tmp_path / "model.pt")
    generate.save_model(path, dataclasses.asdict(run.config), run.model, run.corpus.chars)
    return path


def greedy(model, chars, prompt, tokens):
    """The prompt and `tokens` most likely characters, each from the parallel forward over the
    whole text so far (no caches)."""
    index = {c: i for i, c in enumerate(chars)}
    text = prompt
    with torch.no_grad():
        for _ in range(tokens):
            logits = model(torch.tensor([[index[c] for c in text]]))
            text += chars[int(logits[0, -1].argmax())]
    return text


@pytest.mark.parametrize("variant", ["favor-numerator_only", "softmax-rope", "elu-nodenom"])
def test_a_saved_model_samples_and_measures(variant, tiny, corpus, tmp_path, capsys):
    run = Run(tiny(variant=variant, steps=4), corpus)
    run.train()
    path = saved_model(tmp_path, run)
    assert generate.main([path, "--prompt", PROMPT, "--tokens", "20", "--seed", "3"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert text.startswith(PROMPT) and len(text) == len(PROMPT) + 20
    assert set(text) <= set(corpus.chars)
    model, chars, _ = generate.load_model(path)
    # Temperature 0 is greedy: through the caches, the characters the parallel forward ranks
    # first.
    assert generate.sample(model, chars, PROMPT, 10, 0) == greedy(model, chars, PROMPT, 10)
    # At temperature 1 the seed decides: the same seed samples the same text, other seeds
    # others (8 seeds of 40 characters from a barely trained model: all alike would be a seed
    # that is ignored).
    texts = [generate.sample(model, chars, PROMPT, 40, 1.0, seed) for seed in range(8)]
    assert texts == [generate.sample(model, chars, PROMPT, 40, 1.0, seed) for seed in range(8)]
    assert len(set(texts)) > 1, texts
    out = str(tmp_path / "measure.csv")
    assert generate.main([path, "--measure", "--positions", "96", "--out", out]) == 0
    with open(out, newline="") as f:
        assert "\r" not in f.read()
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["position"]) for r in rows] == [32, 64, 96]
    assert {r["variant"] for r in rows} == {variant}
    sizes = [int(r["cache_bytes"]) for r in rows]
    if variant.startswith("softmax"):  # keys and values: a row per token and layer
        assert sizes[1] - sizes[0] == sizes[2] - sizes[1] > 0
    else:  # the state: the same size at every position
        assert sizes[0] == sizes[1] == sizes[2]
    assert all(float(r["seconds_per_token"]) > 0 for r in rows)


def test_a_prompt_outside_the_corpus_is_refused(tiny, corpus, tmp_path, capsys):
    path = saved_model(tmp_path, Run(tiny(steps=1), corpus))
    assert generate.main([path, "--prompt", "\u2603"]) == 1
    assert "not in it" in capsys.readouterr().err


def final_at(saved, length):
    """The run's last final evaluation at `length`, read from its runs/<key>.json."""
    return [e["value"] for e in saved["records"]["evaluations"]
            if e["final"] and e["length"] == length][-1]


def test_after_the_sweep_the_best_models_are_decoded_and_sampled(tiny, word_text, tmp_path):
    """decoding.run: per context, softmax + RoPE and the linear variant with the lowest mean
    final bpc, each the first seed's model at its best rate (the grid's), decoded from position 0
    to 8 x the context; a sample from every variant's model at the shortest context. The
    expected choices are read here from the saved runs' own evaluations."""
    text = tmp_path / "words.txt"
    text.write_text(word_text(words=3000), encoding="utf-8")
    out = str(tmp_path / "out")
    configs = [tiny(variant="softmax-rope", lr=lr, steps=4) for lr in (1e-2, 3e-2)]
    configs += [tiny(variant=v, steps=4, seed=s) for v in ("favor-numerator_only", "elu-nodenom")
                for s in (0, 1)]
    configs += [tiny(variant=v, steps=4, context=32) for v in ("softmax-rope", "elu-nodenom")]
    results = sweep.run_all(configs, out, 1, text=str(text),
                            pool=concurrent.futures.ThreadPoolExecutor(1))
    saved = {}
    for config in configs:
        with open(os.path.join(out, "runs", config.key() + ".json")) as f:
            saved[config.key()] = json.load(f)
    softmax = {c.lr: final_at(saved[c.key()], 16) for c in configs[:2]}
    best_softmax = min(softmax, key=softmax.get)
    linear = {v: statistics.fmean(final_at(saved[c.key()], 16) for c in configs[2:6]
                                  if c.variant.name == v)
              for v in ("favor-numerator_only", "elu-nodenom")}
    best_linear = min(linear, key=linear.get)
    decoding.run(out, results, quiet=True, prompt=PROMPT)

    with open(os.path.join(out, "decode.csv")) as f:
        rows = list(csv.DictReader(f))
    timed = {(int(r["context"]), r["variant"]) for r in rows}
    assert timed == {(16, "softmax-rope"), (16, best_linear), (32, "softmax-rope"),
                     (32, "elu-nodenom")}
    for context, variant in timed:
        windows = [r for r in rows if (int(r["context"]), r["variant"]) == (context, variant)]
        assert [int(r["position"]) for r in windows] == list(range(32, 8 * context + 1, 32))
    assert {float(r["lr"]) for r in rows if r["variant"] == "softmax-rope"
            and r["context"] == "16"} == {best_softmax}
    with open(os.path.join(out, "samples.json")) as f:
        samples = json.load(f)
    assert [s["variant"] for s in samples] == ["softmax-rope", "favor-numerator_only",
                                               "elu-nodenom"]
    for s in samples:
        assert s["context"] == 16 and s["seed"] == 0 and s["text"].startswith(PROMPT)
        assert len(s["text"]) == len(PROMPT) + decoding.SAMPLE_TOKENS
    assert [s["lr"] for s in samples][0] == best_softmax
