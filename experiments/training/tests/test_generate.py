"""training.generate: a finished char_lm run's saved model samples text through the layers'
caches, and --measure shows the caches' size: constant for linear attention, a row per token for
softmax."""
import csv
import json
import os
import statistics

import pytest

from training import decoding, generate, plans, sweep
from training.train import Run


@pytest.mark.parametrize("variant", ["favor-numerator_only", "softmax-rope", "elu-nodenom"])
def test_a_saved_model_samples_and_measures(variant, tiny, corpus, tmp_path, capsys):
    run = Run(tiny(variant=variant, steps=4), corpus)
    run.train()
    path = str(tmp_path / "model.pt")
    generate.save_model(path, dict(vars(run.config)), run.model, corpus.chars)
    prompt = corpus.text[:5] if hasattr(corpus, "text") else "".join(corpus.chars[:5])
    assert generate.main([path, "--prompt", prompt, "--tokens", "20", "--seed", "3"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    assert text.startswith(prompt) and len(text) == len(prompt) + 20
    assert set(text) <= set(corpus.chars)
    # Greedy decoding is deterministic; the same seed samples the same text.
    model, chars, _ = generate.load_model(path)
    assert generate.sample(model, chars, prompt, 10, 0) == generate.sample(model, chars, prompt,
                                                                           10, 0)
    out = str(tmp_path / "measure.csv")
    assert generate.main([path, "--measure", "--positions", "96", "--out", out]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["position"]) for r in rows] == [32, 64, 96]
    sizes = [int(r["cache_bytes"]) for r in rows]
    if variant.startswith("softmax"):  # keys and values: a row per token and layer
        assert sizes[1] - sizes[0] == sizes[2] - sizes[1] > 0
    else:  # the state: the same size at every position
        assert sizes[0] == sizes[1] == sizes[2]
    assert all(float(r["seconds_per_token"]) > 0 for r in rows)


def test_a_prompt_outside_the_corpus_is_refused(tiny, corpus, tmp_path, capsys):
    run = Run(tiny(steps=1), corpus)
    path = str(tmp_path / "model.pt")
    generate.save_model(path, dict(vars(run.config)), run.model, corpus.chars)
    assert generate.main([path, "--prompt", "\u2603"]) == 1
    assert "not in it" in capsys.readouterr().err


def test_after_the_sweep_the_best_models_are_decoded_and_sampled(tiny, word_text, tmp_path):
    """decoding.run: per context, softmax + RoPE and the linear variant with the lowest mean
    final bpc, each the first seed's model at its best rate (the grid's), decoded from position 0
    to 8 x the context; a sample from every variant's model at the shortest context."""
    text = tmp_path / "words.txt"
    text.write_text(word_text(words=3000), encoding="utf-8")
    out = str(tmp_path / "out")
    configs = [tiny(variant="softmax-rope", lr=lr, steps=4) for lr in (1e-2, 3e-2)]
    configs += [tiny(variant=v, steps=4, seed=s) for v in ("favor-numerator_only", "elu-nodenom")
                for s in (0, 1)]
    configs += [tiny(variant=v, steps=4, context=32) for v in ("softmax-rope", "elu-nodenom")]
    sweep._todo(configs, out, resume=False)  # the directories
    for config in configs:
        sweep._run_one(config, out, str(text), quiet=True)
    results = [sweep.finished(out, c) for c in configs]
    best_softmax = plans.best_lr(results, "softmax-rope", 16)
    linear = min(("favor-numerator_only", "elu-nodenom"), key=lambda v: statistics.fmean(
        plans.final_bpc(r) for r in results if r["config"]["variant"] == v
        and r["config"]["context"] == 16))
    prompt = text.read_text(encoding="utf-8")[:6]
    decoding.run(out, results, quiet=True, prompt=prompt)

    with open(os.path.join(out, "decode.csv")) as f:
        rows = list(csv.DictReader(f))
    timed = {(int(r["context"]), r["variant"]) for r in rows}
    assert timed == {(16, "softmax-rope"), (16, linear), (32, "softmax-rope"), (32, "elu-nodenom")}
    for context, variant in timed:
        mine = [r for r in rows if (int(r["context"]), r["variant"]) == (context, variant)]
        assert [int(r["position"]) for r in mine] == list(range(32, 8 * context + 1, 32))
    assert {float(r["lr"]) for r in rows if r["variant"] == "softmax-rope"
            and r["context"] == "16"} == {best_softmax}
    with open(os.path.join(out, "samples.json")) as f:
        samples = json.load(f)
    assert [s["variant"] for s in samples] == ["softmax-rope", "favor-numerator_only",
                                               "elu-nodenom"]
    for s in samples:
        assert s["context"] == 16 and s["seed"] == 0 and s["text"].startswith(prompt)
        assert len(s["text"]) == len(prompt) + decoding.SAMPLE_TOKENS
