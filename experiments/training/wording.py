"""The words the training report writes numbers in: a cell's mean and range, a paired
difference between two cells, a variant's description and its placement label."""
from .summary import paired
from .variants import SOFTMAX_ROPE, from_name

REFERENCE = SOFTMAX_ROPE.name


def format_spread(s, digits=3):
    """'2.345 (2.301-2.389, 3 seeds)', the value alone for one seed, 'n/a' for none."""
    if not s["n"]:
        return "n/a"
    if s["n"] == 1:
        return "%.*f" % (digits, s["mean"])
    return "%.*f (%.*f-%.*f, %d seeds)" % (digits, s["mean"], digits, s["min"], digits, s["max"],
                                           s["n"])


def _separated(a, b):
    """Whether the seed ranges of a and b do not overlap (the difference exceeds the spread)."""
    return a["n"] > 1 and b["n"] > 1 and (a["max"] < b["min"] or b["max"] < a["min"])


def compare(a, b, key="final_bpc"):
    """'+0.021 (per seed +0.018, +0.025, +0.020; beyond the seed ranges)': cell a minus cell b,
    paired by seed, and whether their ranges overlap."""
    diffs = paired(a[key + "_per_seed"], b[key + "_per_seed"])
    if not diffs:
        return "not comparable (no seed finished both)"
    mean = sum(diffs.values()) / len(diffs)
    if len(diffs) == 1:
        return "%+.3f (one seed, so of unknown significance)" % mean
    signs = {d > 0 for d in diffs.values()}
    return "%+.3f (per seed %s; %s%s)" % (
        mean, ", ".join("%+.3f" % d for d in diffs.values()),
        "beyond the seed ranges" if _separated(a[key], b[key]) else "within the seed ranges",
        "" if len(signs) == 1 else ", the sign changes between seeds")


def describe(name):
    return from_name(name).describe()


def placement(name):
    """The placement in words ('numerator_only', 'no denominator'), with the variant's extras;
    softmax's description."""
    v = from_name(name)
    if not v.linear:
        return v.describe()
    return ("no denominator" if not v.denominator else v.placement) + v.describe_extras()
