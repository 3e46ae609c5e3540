"""training.generate: a finished char_lm run's saved model samples text through the layers'
caches, and --measure shows the caches' size: constant for linear attention, a row per token for
softmax."""
import csv

import pytest

from training import generate
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
