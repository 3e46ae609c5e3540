"""training.data: the character corpus, its split, its training batches and validation windows."""
import os

import numpy as np
import pytest
import torch

from training import data
from training.data import Corpus, load_corpus

# 2,345 characters: 2,345 x 0.95 = 2,227.75, well away from an integer, so the expected boundary
# (computed below in integers) does not depend on how 0.95 rounds.
LENGTH = 2345
CUT = LENGTH * 95 // 100  # 2227


@pytest.fixture
def text(random_text):
    return random_text(LENGTH, seed=1)


@pytest.fixture
def text_corpus(text, tmp_path):
    """The --text route: the text written to a file and read back by load_corpus."""
    path = tmp_path / "small.txt"
    path.write_text(text, encoding="utf-8")
    return load_corpus(str(path))


def decode(corpus, ids):
    return "".join(corpus.chars[i] for i in np.asarray(ids).reshape(-1))


def test_vocabulary_is_the_sorted_distinct_characters(text, text_corpus):
    """Ids index the characters in code-point order, and the ids spell the text back."""
    assert text_corpus.chars == sorted(set(text))
    assert text_corpus.vocab_size == len(set(text))
    assert text_corpus.name == "small.txt"
    assert decode(text_corpus, np.concatenate([text_corpus.train, text_corpus.validation])) == text
    # Code-point order: ' ' < ',' < '.' < 'a' ... ; the newline (10) comes first.
    assert text_corpus.chars[0] == "\n" and text_corpus.chars[-1] == "z"


def test_corpus_constructed_directly_equals_the_file_route(text, text_corpus):
    """Corpus(text, name) and load_corpus(path) give the same ids, vocabulary and digest."""
    direct = Corpus(text, "direct")
    assert direct.name == "direct"
    assert direct.chars == text_corpus.chars
    assert np.array_equal(direct.train, text_corpus.train)
    assert np.array_equal(direct.validation, text_corpus.validation)
    assert direct.digest == text_corpus.digest and len(direct.digest) == 16


def test_the_last_five_percent_is_validation(text, text_corpus):
    """Training is the first floor(0.95 n) characters, validation the rest, nothing lost."""
    assert len(text_corpus.train) == CUT
    assert len(text_corpus.validation) == LENGTH - CUT
    assert decode(text_corpus, text_corpus.train) == text[:CUT]
    assert decode(text_corpus, text_corpus.validation) == text[CUT:]


def test_batch_is_determined_by_seed_and_step(text_corpus):
    """A resumed run must see the same data as an uninterrupted one: the batch depends on
    (seed, step) only -- equal bitwise when asked twice, different for another step or seed."""
    x1, y1 = text_corpus.batch(3, 7, 5, 24)
    x2, y2 = text_corpus.batch(3, 7, 5, 24)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == y1.shape == (5, 24)
    assert x1.dtype == y1.dtype == torch.int64
    for seed, step in ((3, 8), (3, 6), (4, 7)):
        x, _ = text_corpus.batch(seed, step, 5, 24)
        assert not torch.equal(x, x1), (seed, step)
    # Drawing other batches in between changes nothing (no hidden global random state).
    text_corpus.batch(0, 0, 5, 24)
    np.random.seed(123)
    torch.manual_seed(123)
    assert torch.equal(text_corpus.batch(3, 7, 5, 24)[0], x1)


def test_batch_targets_are_the_next_characters_of_the_training_text(text, text_corpus):
    """targets[:, t] = inputs[:, t + 1], and each row is a window of the training split (the
    random text makes every 25-character window's place unique)."""
    train_text = text[:CUT]
    for step in range(4):
        x, y = text_corpus.batch(0, step, 6, 24)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            window = decode(text_corpus, row_x) + decode(text_corpus, row_y[-1:])
            start = train_text.find(window)
            assert start >= 0, "a batch window is not in the training split"
            assert train_text.find(window, start + 1) == -1
            assert decode(text_corpus, row_y) == train_text[start + 1:start + 25]


def test_validation_windows_are_consecutive_and_the_same_text_at_every_length(text_corpus):
    """Windows tile the start of the validation split without overlap, targets are shifted by
    one, and at lengths 8, 16, 32 (same token budget) they cover the same 96 characters: bpc at
    several context lengths compares the same text."""
    validation = text_corpus.validation
    covered = []
    for context in (8, 16, 32):
        x, y = text_corpus.validation_windows(context, 96)
        assert x.shape == y.shape == (96 // context, context)
        assert np.array_equal(x.reshape(-1).numpy(), validation[:96])
        assert np.array_equal(y.reshape(-1).numpy(), validation[1:97])
        covered.append(x.reshape(-1))
    assert all(torch.equal(c, covered[0]) for c in covered)


def test_validation_windows_are_capped_by_the_split(text_corpus):
    """A budget larger than the split gives as many whole windows as fit (each needs one more
    character for its last target); a budget below one window still gives one window; a context
    longer than the split is refused."""
    n = len(text_corpus.validation)  # 118
    x, y = text_corpus.validation_windows(16, 10 ** 6)
    assert x.shape == (int((n - 1) // 16), 16)
    assert np.array_equal(y.reshape(-1).numpy(), text_corpus.validation[1:1 + x.numel()])
    assert text_corpus.validation_windows(16, 3)[0].shape == (1, 16)
    assert text_corpus.validation_windows(n - 1, 1)[0].shape == (1, n - 1)
    with pytest.raises(ValueError, match="shorter than a context"):
        text_corpus.validation_windows(n, 1)


def test_too_short_text_is_refused(random_text):
    """Fewer than 100 characters cannot make a split: ValueError naming the text."""
    with pytest.raises(ValueError, match="tiny"):
        Corpus(random_text(99), "tiny")
    assert Corpus(random_text(100), "just enough").vocab_size > 1


def test_non_utf8_file_gives_runtime_error_naming_the_path(tmp_path):
    """A file that is not UTF-8 is reported as a RuntimeError with the --text path, not as a
    UnicodeDecodeError traceback."""
    path = tmp_path / "latin1.txt"
    path.write_bytes(("caf\u00e9 " * 50).encode("latin-1"))
    with pytest.raises(RuntimeError) as error:
        load_corpus(str(path))
    assert str(path) in str(error.value)
    assert "--text" in str(error.value)


def test_missing_file_gives_runtime_error_naming_the_path(tmp_path):
    path = tmp_path / "no" / "such.txt"
    with pytest.raises(RuntimeError) as error:
        load_corpus(str(path))
    assert str(path) in str(error.value)


def test_cache_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    """The Austen cache lives under $XDG_CACHE_HOME/linrope, else ~/.cache/linrope."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert data.cache_dir() == os.path.join(str(tmp_path), "linrope")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.cache_dir() == os.path.join(str(tmp_path / "home"), ".cache", "linrope")


@pytest.mark.skipif(not os.path.exists(os.path.join(data.cache_dir(), "austen.txt")),
                    reason="the Austen cache is not there (it needs Rscript and janeaustenr)")
def test_cached_austen_text_is_the_six_novels():
    """With the cache present, austen_text() reads it (no Rscript): the six novels are about
    4.0 million characters."""
    text = data.austen_text()
    assert len(text) > 3_900_000
    assert "Elinor" in text and "Elizabeth Bennet" in text and "Anne Elliot" in text


def test_words_are_the_training_splits_letter_runs_in_lower_case():
    """Corpus.words: runs of letters of the training split, lower-cased; the validation split's
    words are not among them."""
    text = "The cat, the DOG; a cat's hat. " * 19 + "zebra " * 2
    corpus = Corpus(text, "words")
    assert corpus.words() == {"the", "cat", "dog", "a", "s", "hat"}


def test_words_known_counts_a_samples_words_found_in_the_set():
    """(words, known): letter runs of the text, lower case, a word cut off by the text's end
    left out."""
    words = {"it", "is", "a", "truth"}
    assert data.words_known("It is a trut", words) == (3, 3)
    assert data.words_known("It is a truht.", words) == (4, 3)
    assert data.words_known("", words) == (0, 0)
