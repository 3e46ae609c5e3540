"""Shared pieces of the training package's tests: small synthetic texts and tiny configurations.

Runs from any directory with an interpreter that imports linrope (`build/venv/bin/python -m
pytest experiments/training/tests` after either README command, or PYTHONPATH naming a build's
python/ directory): this file
puts experiments/ (the home of `training` and `analysis`) on sys.path itself.

Every model here is tiny (d_model 16, one layer, one head) so the whole suite takes seconds."""
import dataclasses
import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from training.data import Corpus  # noqa: E402
from training.train import Config  # noqa: E402
from training.variants import from_name  # noqa: E402

WORDS = ("the ", "cat ", "sat ", "on ", "a ", "mat. ", "dog ", "ran ")


def word_text(words=1500, seed=0):
    """Random words from a small list: structured enough that a tiny decoder learns it in a few
    dozen steps (the next character is often fixed by the previous ones)."""
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) for _ in range(words))


def random_text(length, seed=0, alphabet="abcdefghijklmnopqrstuvwxyz .,\n"):
    """Random characters: every window of a dozen characters is (almost surely) unique, so a
    window can be located in the text unambiguously."""
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(length))


@pytest.fixture(name="word_text", scope="session")
def word_text_fixture():
    """The function word_text (fixtures are how test modules reach these helpers)."""
    return word_text


@pytest.fixture(name="random_text", scope="session")
def random_text_fixture():
    """The function random_text."""
    return random_text


@pytest.fixture(scope="session")
def corpus():
    """About 5,700 characters of random words; the validation split (5%) is ~285 characters,
    enough for validation windows of 4 x 16 + 1 characters."""
    return Corpus(word_text(), "words")


# A run that takes well under a second: 12 steps of batch 4 x 16 characters, d_model 16.
TINY = dict(task="char_lm", variant="softmax-rope", seed=0, steps=12, batch_size=4, context=16,
            d_model=16, layers=1, heads=1, lr=1e-2, warmup=2, eval_every=4, eval_tokens=64,
            extrapolation=(1, 2), log_every=1, checkpoint_every=4, mqar_settings=((16, 2), (32, 4)),
            mqar_vocab=64, mqar_test_size=16)


@pytest.fixture(scope="session")
def tiny():
    """A factory of tiny Configs: tiny(variant="favor-full", steps=20, ...), the variant by name.
    Each comes back from its JSON form (what checkpoints, runs/<key>.json and saved models
    hold) as itself: Config.from_dict, which resuming and training.generate rely on, is checked
    on every config a test uses."""
    def make(**overrides):
        fields = dict(TINY, **overrides)
        config = Config(**dict(fields, variant=from_name(fields["variant"])))
        assert Config.from_dict(json.loads(json.dumps(dataclasses.asdict(config)))) == config
        return config
    return make
