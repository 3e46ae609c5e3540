"""Character-level text: Jane Austen's six novels (from Debian's r-cran-janeaustenr, extracted
once into a cache) or any UTF-8 file; the last 5% is validation. Training batches depend only on
(seed, step), so a resumed run sees the same data as an uninterrupted one."""
import hashlib
import os
import re
import subprocess
import tempfile

import numpy as np
import torch

AUSTEN_R = ("library(janeaustenr); writeLines(c(sensesensibility, prideprejudice, mansfieldpark, "
            "emma, northangerabbey, persuasion))")
VALIDATION_SHARE = 0.05


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "linrope")


def austen_text():
    """The six novels as one string, extracted by Rscript the first time and cached."""
    path = os.path.join(cache_dir(), "austen.txt")
    if not os.path.exists(path):
        try:
            text = subprocess.run(["Rscript", "-e", AUSTEN_R], check=True, capture_output=True,
                                  text=True).stdout
        except FileNotFoundError:
            raise RuntimeError("Rscript not found: install r-cran-janeaustenr (apt-get install "
                               "r-cran-janeaustenr) or pass --text PATH") from None
        except subprocess.CalledProcessError as e:
            raise RuntimeError("Rscript could not load janeaustenr (%s): install "
                               "r-cran-janeaustenr or pass --text PATH" %
                               e.stderr.strip().splitlines()[-1:]) from None
        if len(text) < 1_000_000:  # the novels are 4 MB: never cache a truncated extraction
            raise RuntimeError("Rscript gave %d characters of Austen, not the expected ~4 million"
                               % len(text))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".austen-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
    with open(path, encoding="utf-8") as f:
        return f.read()


class Corpus:
    """A text as character ids: vocabulary = its distinct characters in code-point order."""

    def __init__(self, text, name):
        if len(text) < 100:
            raise ValueError("the text %s has %d characters; at least 100 are needed" %
                             (name, len(text)))
        self.name = name
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text))
        cut = int(len(ids) * (1 - VALIDATION_SHARE))
        self.train, self.validation = ids[:cut], ids[cut:]
        self.digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    @property
    def vocab_size(self):
        return len(self.chars)

    def words(self):
        """The words of the training split (runs of letters, lower case): what a sample's words
        are looked up in (words_known)."""
        text = "".join(np.array(self.chars)[self.train])
        return set(re.findall(r"[a-z]+", text.lower()))

    def batch(self, seed, step, batch_size, context):
        """Inputs and next-character targets [batch_size, context] at random places of the
        training split, drawn from (seed, step) alone."""
        if len(self.train) < context + 1:
            raise ValueError("the training split (%d characters) is shorter than a context of %d "
                             "plus one" % (len(self.train), context))
        rng = np.random.default_rng([seed, step, 0x6c72])
        # A window s..s+context (targets one ahead) needs s <= len - context - 1.
        starts = rng.integers(0, len(self.train) - context, size=batch_size)
        windows = np.stack([self.train[s:s + context + 1] for s in starts])
        return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])

    def validation_windows(self, context, tokens):
        """Consecutive, non-overlapping windows of the validation split, as many as make up
        `tokens` characters (fewer if the split is shorter): the same text at every length."""
        count = min(max(tokens // context, 1), (len(self.validation) - 1) // context)
        if count < 1:
            raise ValueError("the validation split (%d characters) is shorter than a context of "
                             "%d" % (len(self.validation), context))
        ids = self.validation[:count * context + 1]
        x = np.stack([ids[i * context:(i + 1) * context] for i in range(count)])
        y = np.stack([ids[i * context + 1:(i + 1) * context + 1] for i in range(count)])
        return torch.from_numpy(x), torch.from_numpy(y)


def load_corpus(path=None):
    if path is None:
        return Corpus(austen_text(), "Jane Austen's six novels (r-cran-janeaustenr)")
    try:
        with open(path, encoding="utf-8") as f:
            return Corpus(f.read(), os.path.basename(path))
    except (OSError, UnicodeDecodeError) as e:
        raise RuntimeError("--text %s: %s" % (path, e)) from None


def words_known(text, words):
    """(words in text, how many of them are in `words`): runs of letters, lower case, the last
    left out when the text ends inside it (a word cut off)."""
    found = re.findall(r"[a-z]+", text.lower())
    if found and text[-1:].isalpha():
        found = found[:-1]
    return len(found), sum(w in words for w in found)
