"""training.answers: the opening sentences of the training section, written from small
hand-made summaries whose means, paired differences and rankings are known."""
import json

from training import answers
from training.summary import spread


def cell(values, diverged=0, steps=200, lr=0.01):
    """A char_lm cell: final bpc per seed (seeds 0, 1, ...)."""
    per_seed = {str(i): v for i, v in enumerate(values)}
    return dict(final_bpc_per_seed=per_seed, final_bpc=spread(values), diverged=diverged,
                seeds=len(values), steps=steps, lr=lr)


def mqar_cell(accuracy, floats):
    return dict(final_accuracy=spread([accuracy]), state_floats=floats,
                accuracy={"64/4": spread([accuracy])})


CELLS = {"softmax-rope": cell([1.8, 1.9]),
         "elu-numerator_only": cell([2.0, 2.1]), "elu-full": cell([2.2, 2.3]),
         "favor-full": cell([2.5, 2.6], diverged=1),
         "elu-numerator_only-conv4": cell([1.95, 2.05]),
         "elu-numerator_only-retnet": cell([2.4, 2.5])}


def test_placements_rank_each_maps_variants_without_extras():
    assert answers.placements(CELLS) == [
        "elu+1: **numerator_only** 2.050 (2.000-2.100, 2 seeds), then full +0.200 (per seed "
        "+0.200, +0.200; beyond the seed ranges)",
        "FAVOR+: **full** 2.550 (2.500-2.600, 2 seeds)"]


def test_extras_say_whether_they_change_the_ranking():
    """The convolution (1.95, 2.05) would still rank first in its base's place; the decay
    (2.45 on average) would fall behind elu+1 full (2.25): the ranking changes."""
    conv, decay = answers.extras(CELLS)
    assert conv.startswith("elu+1, numerator_only, short convolution 4 -0.050 (per seed "
                           "-0.050, -0.050; within the seed ranges) against numerator_only")
    assert conv.endswith("it would rank 1 of the 3 linear variants without extras, where the "
                         "base ranks 1 (the ranking stays)")
    assert decay.endswith("it would rank 2 of the 3 linear variants without extras, where the "
                          "base ranks 1 (**the ranking changes**)")


def test_the_best_linear_variant_against_softmax_per_context():
    gaps = answers.softmax_gaps({"256": dict(cells=CELLS), "1024": dict(cells={
        "softmax-rope": cell([1.5]), "favor-full": cell([1.7])})})
    assert gaps == [
        "at 256 the best linear variant, elu+1, numerator_only, short convolution 4, +0.150 "
        "(per seed +0.150, +0.150; beyond the seed ranges) bpc from softmax + RoPE (1.850 "
        "(1.800-1.900, 2 seeds))",
        "at 1024 the best linear variant, favor+, full, +0.200 (one seed, so of unknown "
        "significance) bpc from softmax + RoPE (1.500)"]


def test_recall_is_listed_by_state_size():
    mqar = {"64x4": dict(cells={"softmax-rope": mqar_cell(1.0, 8192),
                                "elu-numerator_only": mqar_cell(0.5, 1092),
                                "elu-numerator_only-conv4": mqar_cell(0.95, 1668)})}
    assert answers.recall(mqar) == [
        "at 64x4: elu+1, numerator_only 0.500 at 1092 floats, elu+1, numerator_only, short "
        "convolution 4 0.950 at 1668 floats, softmax, RoPE 1.000 at 8192 floats; the smallest "
        "state reaching 0.9: elu+1, numerator_only, short convolution 4"]


def test_stages_not_run_and_the_budget_of_the_rates():
    meta = dict(plan=dict(stages=["grid", "seeds", "long"]), stages_done=["grid"])
    assert answers.stages_note(meta).startswith("**Stages not run yet: seeds, long** (done: "
                                                "grid)")
    assert answers.stages_note(dict(meta, stages_done=["grid", "seeds", "long"])).startswith(
        "Every stage of the plan is done")
    assert answers.stages_note({}) is None
    lm = dict(grid_steps=50, cells=CELLS, best_lr={"softmax-rope": 0.001},
              lr_check={"softmax-rope": {"0.001": 2.0, "0.003": 1.9, "0.01": None}})
    assert answers.budget_note({"256": lm}) == (
        "Learning rates were chosen on a grid of 50 steps per run (the first seed); the ranked "
        "cells train 200 steps. At the full budget (the first seed, final bpc at each rate): "
        "softmax, RoPE 0.001 2.000, 0.003 1.900: the grid's rate 0.001 is not: 0.003 is.")


def test_changes_since_an_earlier_study():
    """The best placement per map, full's divergence (diverging or not), the gap to softmax (its
    sign), MQAR's softmax (reaching 0.9 or not): each sorted into held or changed."""
    old = {"char_lm": {"256": dict(cells={
        "softmax-rope": cell([1.0]), "elu-numerator_only": cell([1.5]), "elu-full": cell([1.4]),
        "favor-full": cell([3.0], diverged=1), "favor-numerator_only": cell([2.0])})},
        "mqar": {"softmax-rope": dict(accuracy={"64/4": spread([0.95])})}}
    new = {"char_lm": {"256": dict(cells=CELLS)},
           "mqar": {"64x4": dict(cells={"softmax-rope": mqar_cell(0.5, 8192)})}}
    text = answers.changes(new, (old, dict(date="2026-11-27", mode="full", git_commit="abc",
                                           plan=dict(char_lm=dict(steps=600)))))
    held, changed = text.split("held: ")[1].split(" Changed: ")
    assert held == "elu+1 full diverged in 0 of 1 seeds then, 0 of 2 now; FAVOR+ full diverged " \
        "in 1 of 1 seeds then, 1 of 2 now; at context 256 the best linear variant is +0.150 " \
        "bpc from softmax + RoPE now (elu+1, numerator_only, short convolution 4), +0.400 then " \
        "(elu+1, full)."
    assert changed == "elu+1's best placement: full then, numerator_only now; FAVOR+'s best " \
        "placement: numerator_only then, full now; MQAR at (64, 4), softmax, RoPE reaching " \
        "0.9 or not: 0.500 now, 0.950 then."
    assert text.startswith("**What changed since the earlier study** (2026-11-27, --full, "
                           "commit abc, 600 steps per char_lm run;")


def test_the_earlier_study_is_copied_beside_the_new_one(tmp_path, monkeypatch):
    """The committed study is read once and kept as previous_*.json in the output directory,
    which later analyses read even after a new study is committed; the committed study is not
    compared with itself (the same date)."""
    committed, out = tmp_path / "committed", tmp_path / "out"
    committed.mkdir()
    out.mkdir()
    (committed / "summary.json").write_text(json.dumps({"char_lm": {}}))
    (committed / "training.json").write_text(json.dumps({"date": "then"}))
    monkeypatch.setattr(answers, "COMMITTED", str(committed))
    assert answers.previous_study(str(out), {"date": "then"}) is None
    assert answers.previous_study(str(out), {"date": "now"}) == ({"char_lm": {}},
                                                                 {"date": "then"})
    (committed / "training.json").write_text(json.dumps({"date": "now"}))
    assert answers.previous_study(str(out), {"date": "now"}) == ({"char_lm": {}},
                                                                 {"date": "then"})
