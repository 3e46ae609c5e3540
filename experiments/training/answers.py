"""The answers the training section opens with, each sentence written from summary.json: per
feature map the placement that trains best and by how much; whether the short convolution or
the decay changes that ranking; the best linear variant's distance from softmax + RoPE at each
context; the recall each form reaches at its state size; which stages are not run yet and what
budget chose the rates; and what changed since an earlier study (its summary.json)."""
import json
import os

from analysis.common import write_json  # experiments/analysis

from .variants import FEATURE_MAPS, from_name
from .wording import REFERENCE, compare, describe, format_spread, placement

# The committed study the report compares with, until a study is committed over it: then the
# copy kept beside the new one (PREVIOUS) is read instead.
COMMITTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                         "docs", "results", "training")
PREVIOUS = ("previous_summary.json", "previous_training.json")


def _finished(cells, name):
    return name in cells and cells[name]["final_bpc"]["n"] > 0


def _mean(cells, name):
    return cells[name]["final_bpc"]["mean"]


def _bases(cells, kind=None):
    """The linear variants without a decay or a short convolution (and with W fixed) that
    finished, of map `kind` (None: every map), best first."""
    names = [v for v in cells if _finished(cells, v) and from_name(v).linear
             and not from_name(v).extras and not from_name(v).redraw_interval
             and (kind is None or from_name(v).feature_map == kind)]
    return sorted(names, key=lambda v: _mean(cells, v))


def _best_linear(cells):
    names = [v for v in cells if _finished(cells, v) and from_name(v).linear]
    return min(names, key=lambda v: _mean(cells, v)) if names else None


def placements(cells):
    """Per map, its placements (no extras) best first, each other as a paired difference."""
    out = []
    for kind, names in FEATURE_MAPS.items():
        ranking = _bases(cells, kind)
        if not ranking:
            continue
        text = "%s: **%s** %s" % (names.label, placement(ranking[0]),
                                  format_spread(cells[ranking[0]]["final_bpc"]))
        if ranking[1:]:
            text += ", then " + "; ".join("%s %s" % (placement(v), compare(
                cells[v], cells[ranking[0]])) for v in ranking[1:])
        out.append(text)
    return out


def extras(cells):
    """Per variant with a short convolution or a decay: its paired difference from its base
    and where it would rank among the variants without extras."""
    bases = _bases(cells)
    out = []
    for v in cells:
        variant = from_name(v)
        base = variant.base.name
        if not variant.extras or not _finished(cells, v) or base not in bases:
            continue
        place = 1 + sum(_mean(cells, b) < _mean(cells, v) for b in bases if b != base)
        was = 1 + bases.index(base)
        out.append("%s %s against %s: in its base's place it would rank %d of the %d linear "
                   "variants without extras, where the base ranks %d (%s)" % (
                       describe(v), compare(cells[v], cells[base]), placement(base), place,
                       len(bases), was, "**the ranking changes**" if place != was else
                       "the ranking stays"))
    return out


def softmax_gaps(char_lm):
    """Per context: the best linear variant against softmax + RoPE, paired."""
    out = []
    for context, lm in sorted(char_lm.items(), key=lambda kv: int(kv[0])):
        cells = lm["cells"]
        best = _best_linear(cells)
        if best is None or not _finished(cells, REFERENCE):
            continue
        out.append("at %s the best linear variant, %s, %s bpc from softmax + RoPE (%s)" % (
            context, describe(best), compare(cells[best], cells[REFERENCE]),
            format_spread(cells[REFERENCE]["final_bpc"])))
    return out


def recall(mqar):
    """Per MQAR setting: each variant's final accuracy at its state size, smallest state first,
    and the smallest state that reached 0.9 in the mean."""
    out = []
    for name, m in mqar.items():
        cells = [(c["state_floats"], v, c) for v, c in m["cells"].items()
                 if c["final_accuracy"]["n"] and c["state_floats"]]
        if not cells:
            continue
        cells.sort(key=lambda item: (item[0], item[1]))
        reached = [v for floats, v, c in cells if c["final_accuracy"]["mean"] >= 0.9]
        out.append("at %s: %s; %s" % (
            name, ", ".join("%s %.3f at %d floats" % (describe(v), c["final_accuracy"]["mean"],
                                                      floats) for floats, v, c in cells),
            "the smallest state reaching 0.9: %s" % describe(reached[0]) if reached else
            "none reached 0.9"))
    return out


def stages_note(meta):
    """Which of the plan's stages are not run yet (training.json's plan and stages_done)."""
    planned = (meta.get("plan") or {}).get("stages")
    done = meta.get("stages_done")
    if not planned or done is None:
        return None
    missing = [s for s in planned if s not in done]
    if not missing:
        return "Every stage of the plan is done (%s)." % ", ".join(planned)
    return ("**Stages not run yet: %s** (done: %s); what follows is what the stages done "
            "measured." % (", ".join(missing), ", ".join(done) or "none"))


def budget_note(char_lm):
    """What budget chose the rates, and what the check at the full budget found."""
    if not char_lm:
        return None
    context = min(char_lm, key=int)
    lm = char_lm[context]
    steps = sorted({c["steps"] for c in lm["cells"].values() if c["steps"]})
    if not lm.get("grid_steps") or not steps:
        return None
    text = ("Learning rates were chosen on a grid of %d steps per run (the first seed); the "
            "ranked cells train %s steps." % (lm["grid_steps"], ", ".join(map(str, steps))))
    checks = []
    for v, rates in lm.get("lr_check", {}).items():
        finished = {r: bpc for r, bpc in rates.items() if bpc is not None}
        if not finished:
            continue
        best = min(finished, key=finished.get)
        chosen = "%g" % lm["best_lr"][v]
        checks.append("%s %s: the grid's rate %s %s" % (
            describe(v), ", ".join("%s %.3f" % kv for kv in sorted(
                finished.items(), key=lambda kv: float(kv[0]))), chosen,
            "is the best of them" if best == chosen else "is not: %s is" % best))
    if checks:
        text += (" At the full budget (the first seed, final bpc at each rate): " +
                 "; ".join(checks) + ".")
    return text


def previous_study(out, meta):
    """(summary, training.json) of the study to compare with, or None: the copy kept in out, else
    the committed study unless it is this one (the same date); a copy is then kept in out."""
    paths = [os.path.join(out, name) for name in PREVIOUS]
    if not os.path.exists(paths[0]):
        committed = [os.path.join(COMMITTED, name) for name in ("summary.json", "training.json")]
        if not all(os.path.exists(p) for p in committed):
            return None
        loaded = [_load(p) for p in committed]
        if loaded[1].get("date") == meta.get("date") or \
                os.path.realpath(COMMITTED) == os.path.realpath(out):
            return None
        for path, value in zip(paths, loaded):
            write_json(path, value)
    loaded = [_load(p) if os.path.exists(p) else {} for p in paths]
    return tuple(loaded)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _mqar_accuracy(mqar, variant, setting):
    """A variant's mean final accuracy at (length, pairs) in either summary's form: per setting
    then cells, or (an earlier form) per variant with every setting trained in turn."""
    key = "%d/%d" % setting
    cell = (mqar.get("%dx%d" % setting, {}).get("cells", {}).get(variant) or
            (mqar.get(variant) if "accuracy" in mqar.get(variant, {}) else None))
    if not cell or key not in cell["accuracy"] or not cell["accuracy"][key]["n"]:
        return None
    return cell["accuracy"][key]["mean"]


def changes(summary, previous):
    """The sentences comparing this study with an earlier one: each map's best placement, the
    gap to softmax + RoPE, whether full normalisation diverged, and MQAR at (64, 4)."""
    old_summary, old_meta = previous
    held, changed = [], []
    old_lm, new_lm = old_summary.get("char_lm", {}), summary.get("char_lm", {})
    common = sorted(set(old_lm) & set(new_lm), key=int)
    if common:
        context = common[0]
        old, new = old_lm[context]["cells"], new_lm[context]["cells"]
        for kind, names in FEATURE_MAPS.items():
            was, now = _bases(old, kind), _bases(new, kind)
            if was and now:
                if was[0] == now[0]:
                    held.append("%s trains best with %s" % (names.label, placement(now[0])))
                else:
                    changed.append("%s's best placement: %s then, %s now" % (
                        names.label, placement(was[0]), placement(now[0])))
            full = [v for v in (_linear_full(kind),) if v in old and v in new]
            for v in full:
                then, now_ = old[v]["diverged"], new[v]["diverged"]
                (held if bool(then) == bool(now_) else changed).append(
                    "%s full diverged in %d of %d seeds then, %d of %d now" % (
                        names.label, then, old[v]["seeds"], now_, new[v]["seeds"]))
        if all(_best_linear(c) and _finished(c, REFERENCE) for c in (old, new)):
            (was, then), (best, now) = [
                (_best_linear(c), _mean(c, _best_linear(c)) - _mean(c, REFERENCE))
                for c in (old, new)]
            (held if (then > 0) == (now > 0) else changed).append(
                "at context %s the best linear variant is %+.3f bpc from softmax + RoPE now "
                "(%s), %+.3f then (%s)" % (context, now, describe(best), then, describe(was)))
    for variant in (REFERENCE,):
        was = _mqar_accuracy(old_summary.get("mqar", {}), variant, (64, 4))
        now = _mqar_accuracy(summary.get("mqar", {}), variant, (64, 4))
        if was is not None and now is not None:
            (held if (was >= 0.9) == (now >= 0.9) else changed).append(
                "MQAR at (64, 4), %s reaching 0.9 or not: %.3f now, %.3f then" % (
                    describe(variant), now, was))
    if not held and not changed:
        return None
    steps = ((old_meta.get("plan") or {}).get("char_lm") or {}).get("steps")
    return ("**What changed since the earlier study** (%s, --%s, commit %s%s; its numbers "
            "from `previous_summary.json`): held: %s. Changed: %s." % (
                old_meta.get("date", "date unknown"), old_meta.get("mode", "?"),
                (old_meta.get("git_commit") or "unknown")[:12],
                ", %d steps per char_lm run" % steps if steps else "",
                "; ".join(held) or "nothing compared held", "; ".join(changed) or "nothing"))


def _linear_full(kind):
    return "%s-full" % FEATURE_MAPS[kind].short


def opening(summary, meta, previous=None):
    """The section's opening paragraphs (none without results)."""
    out = [p for p in (stages_note(meta),) if p]
    char_lm = summary.get("char_lm", {})
    if char_lm:
        context = min(char_lm, key=int)
        cells = char_lm[context]["cells"]
        ranked = placements(cells)
        if ranked:
            out.append("**Which placement trains best** (context %s, final validation bpc, "
                       "each variant at its chosen rate, mean over seeds with the range; the "
                       "others as paired differences from the best): %s." % (
                           context, "; ".join(ranked)))
        added = extras(cells)
        if added:
            out.append("**The short convolution and the decay** (paired by seed): %s." %
                       "; ".join(added))
        gaps = softmax_gaps(char_lm)
        if gaps:
            out.append("**Against softmax + RoPE**: %s." % "; ".join(gaps))
        note = budget_note(char_lm)
        if note:
            out.append(note)
    recalls = recall(summary.get("mqar", {}))
    if recalls:
        out.append("**Recall against state size** (MQAR, final accuracy, mean over seeds; the "
                   "state: the floats one sequence's decoding caches hold): %s." %
                   "; ".join(recalls))
    if previous:
        compared = changes(summary, previous)
        if compared:
            out.append(compared)
    return out
