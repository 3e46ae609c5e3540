"""training.report: the numbers it derives from hand-written CSVs (known means, ranges and
crossover), the sentences that quote them, and the plots."""
import json

import pytest

from training import answers, report
from training.variants import from_name

IDS = "task,context,mqar_settings,variant,lr,budget,seed"


def ids(variant, seed, lr=0.01, context=8, redraw=0, task="char_lm", factor=2, settings=""):
    name = from_name(variant).replace(redraw_interval=redraw, feature_factor=factor).name
    return "%s,%d,%s,%s,%g,10,%d" % (task, context, settings, name, lr, seed)


def mqar_ids(factor, settings):
    return ids("favor-numerator_only", 0, 0.001, 0, task="mqar", factor=factor,
               settings=settings)


# A grid at lr 0.001 and 0.01 (seed 0), the best rate's second seed (1), a redrawn cell, and
# a longer context (16) at the best rates; MQAR with FAVOR+ at 2x and 4x features, each setting
# trained alone.
RUNS = IDS + """,status,steps,diverged_step,clip_share,tokens_per_s,final_train_loss,\
layer0_den_min,layer0_nonpositive_share,layer0_tiny_share,state_floats,final_accuracy,\
steps_to_0.9,steps_to_0.99
""" + "".join(line + "\n" for line in [
    ids("softmax-rope", 0, 0.001) + ",complete,10,,0.1,1000,1.0,,,,2048,,,",
    ids("softmax-rope", 0) + ",complete,10,,0.1,1000,1.0,,,,2048,,,",
    ids("softmax-rope", 1) + ",complete,10,,0.3,3000,1.2,,,,2048,,,",
    ids("favor-numerator_only", 0, 0.001) + ",complete,10,,0.5,2000,1.5,0.25,0,0,1056,,,",
    ids("favor-numerator_only", 0) + ",complete,10,,0.5,2000,1.5,0.25,0,0,1056,,,",
    ids("favor-numerator_only", 1) + ",complete,10,,0.5,2000,1.5,0.5,0,0,1056,,,",
    ids("favor-full", 0, 0.001) + ",complete,10,,0.5,2000,2.0,-1.0,0.5,0,1056,,,",
    ids("favor-full", 0) + ",diverged,4,5,0.5,2000,2.0,-7.0,0.25,0.5,,,,",
    ids("favor-full", 1) + ",diverged,4,3,0.5,2000,2.0,-3.0,0.75,0.25,,,,",
    ids("favor-numerator_only", 0, redraw=5) + ",complete,10,,0.5,2000,1.5,0.25,0,0,1056,,,",
    ids("favor-numerator_only", 1, redraw=5) + ",complete,10,,0.5,2000,1.5,0.25,0,0,1056,,,",
    ids("softmax-rope", 0, context=16) + ",complete,10,,0.1,500,1.0,,,,4096,,,",
    ids("favor-numerator_only", 0, context=16) + ",complete,10,,0.1,1500,1.0,0.1,0,0,1056,,,",
    mqar_ids(2, "64x4") + ",complete,10,,0.1,900,1.0,0.1,0,0,1056,0.5,,",
    mqar_ids(2, "128x8") + ",complete,10,,0.1,900,1.0,0.1,0,0,1056,0.25,,",
    mqar_ids(4, "64x4") + ",complete,10,,0.1,800,1.0,0.1,0,0,2080,1.0,6,8",
    mqar_ids(4, "128x8") + ",complete,10,,0.1,800,1.0,0.1,0,0,2080,0.5,,"])
EVALUATIONS = IDS + ",step,final,length,pairs,metric,value\n" + "".join(
    "%s,10,True,%d,,bpc,%s\n" % (ids(v, seed, lr, context, redraw), n, value)
    for v, seed, lr, context, redraw, n, value in [
        ("softmax-rope", 0, 0.001, 8, 0, 8, 2.3),
        ("softmax-rope", 0, 0.01, 8, 0, 8, 2.0), ("softmax-rope", 1, 0.01, 8, 0, 8, 2.2),
        ("softmax-rope", 0, 0.01, 8, 0, 16, 3.0), ("softmax-rope", 1, 0.01, 8, 0, 16, 3.0),
        ("softmax-rope", 0, 0.01, 8, 0, 32, 4.0), ("softmax-rope", 1, 0.01, 8, 0, 32, 4.0),
        ("favor-numerator_only", 0, 0.001, 8, 0, 8, 2.9),
        ("favor-numerator_only", 0, 0.01, 8, 0, 8, 2.5),
        ("favor-numerator_only", 1, 0.01, 8, 0, 8, 2.7),
        ("favor-numerator_only", 0, 0.01, 8, 0, 32, 2.6),
        ("favor-numerator_only", 1, 0.01, 8, 0, 32, 2.8),
        ("favor-full", 0, 0.001, 8, 0, 8, 3.5),
        ("favor-numerator_only", 0, 0.01, 8, 5, 8, 2.4),
        ("favor-numerator_only", 1, 0.01, 8, 5, 8, 2.75),
        ("softmax-rope", 0, 0.01, 16, 0, 16, 1.9),
        ("favor-numerator_only", 0, 0.01, 16, 0, 16, 1.8)]) + "".join(
    "%s,10,True,%d,%d,accuracy,%s\n" % (mqar_ids(factor, "%dx%d" % (n, p)), n, p, value)
    for factor, n, p, value in [(2, 64, 4, 0.5), (2, 128, 8, 0.25), (4, 64, 4, 1.0),
                                (4, 128, 8, 0.5)])
LAYERS = IDS + """,step,layer,den_min,nonpositive_share,tiny_share,grad_norm
""" + ids("favor-full", 1) + """,10,0,-3.0,0.75,0.25,2.0
""" + ids("favor-numerator_only", 1) + """,10,0,0.5,0,0,1.0
"""
CURVES = IDS + """,step,train_loss,scheduled_lr,grad_norm,clipped_so_far
""" + ids("softmax-rope", 0) + """,10,1.0,0.001,1.0,1
""" + ids("favor-full", 1) + """,10,2.0,0.001,1.0,5
"""
STEP_TIME = """variant,length,seconds,tokens_per_s,threads,repeats,load_average_before
softmax-rope,256,1.0,256,2,3,0.1
softmax-rope,1024,4.0,256,2,3,0.1
elu-numerator_only,256,2.0,128,2,3,0.1
elu-numerator_only,1024,2.0,512,2,3,0.1
favor-numerator_only,256,0.5,512,2,3,0.1
favor-numerator_only,1024,1.0,1024,2,3,0.1
"""
DECODE = """variant,context,lr,position,seconds_per_token,cache_bytes
softmax-rope,8,0.01,32,0.001,1024
softmax-rope,8,0.01,64,0.002,2048
favor-numerator_only,8,0.01,32,0.001,512
favor-numerator_only,8,0.01,64,0.001,512
"""
SAMPLES = [dict(variant="softmax-rope", context=8, lr=0.01, seed=0, prompt="It is",
                temperature=0.8, text="It is a | b", words=1, known_words=1)]


@pytest.fixture(autouse=True)
def no_earlier_study(monkeypatch, tmp_path):
    """The section compares with no committed study here (test_answers covers that)."""
    monkeypatch.setattr(answers, "COMMITTED", str(tmp_path / "no study"))


@pytest.fixture
def out(tmp_path):
    for name, text in (("runs", RUNS), ("evaluations", EVALUATIONS), ("layers", LAYERS),
                       ("curves", CURVES), ("step_time", STEP_TIME), ("decode", DECODE)):
        (tmp_path / (name + ".csv")).write_text(text)
    (tmp_path / "samples.json").write_text(json.dumps(SAMPLES))
    return tmp_path


def test_summary_means_ranges_and_divergence(out):
    """Per context, each variant's cell at its grid's best rate (a diverged run never best),
    with mean, range and per-seed values; the grid's first-seed bpc per rate; redrawn cells
    apart; MQAR cells named by their features."""
    char_lm = report.summarise(str(out))["char_lm"]
    s = char_lm["8"]
    assert s["best_lr"] == {"softmax-rope": 0.01, "favor-numerator_only": 0.01,
                            "favor-full": 0.001}
    assert s["grid"]["softmax-rope"] == {"0.001": 2.3, "0.01": 2.0}
    assert s["grid"]["favor-full"] == {"0.001": 3.5, "0.01": None}
    cells = s["cells"]
    assert cells["softmax-rope"]["final_bpc"] == dict(mean=pytest.approx(2.1), min=2.0, max=2.2,
                                                      n=2)
    assert cells["softmax-rope"]["final_bpc_per_seed"] == {"0": 2.0, "1": 2.2}
    assert cells["softmax-rope"]["extrapolation"]["32"]["mean"] == 4.0
    assert cells["softmax-rope"]["tokens_per_s"]["mean"] == 2000
    assert cells["favor-full"]["lr"] == 0.001 and cells["favor-full"]["seeds"] == 1
    assert s["redrawn"]["favor-numerator_only-redraw5"]["final_bpc_per_seed"] == {"0": 2.4,
                                                                                  "1": 2.75}
    assert list(char_lm["16"]["cells"]) == ["softmax-rope", "favor-numerator_only"]
    mqar = report.summarise(str(out))["mqar"]
    assert list(mqar) == ["64x4", "128x8"]
    cells = mqar["64x4"]["cells"]
    assert list(cells) == ["favor-numerator_only", "favor-numerator_only-m4x"]
    m4x = cells["favor-numerator_only-m4x"]
    assert m4x["final_accuracy"]["mean"] == 1.0 and m4x["accuracy"]["64/4"]["mean"] == 1.0
    assert (m4x["steps_to_0.9"]["mean"], m4x["steps_to_0.99_per_seed"]) == (6, {"0": 8})
    assert m4x["state_floats"] == 2080
    assert mqar["128x8"]["cells"]["favor-numerator_only"]["final_accuracy"]["mean"] == 0.25
    assert mqar["128x8"]["best_lr"] == {"favor-numerator_only": 0.001,
                                        "favor-numerator_only-m4x": 0.001}


def test_divergence_and_denominators_of_a_cell(out):
    """Every rate of a grid diverged: the smallest is its "best"; the cell counts the divergence
    and its step, and keeps the smallest denominator over its seeds."""
    (out / "runs.csv").write_text(RUNS.replace(ids("favor-full", 0, 0.001) + ",complete,10,,",
                                               ids("favor-full", 0, 0.001) + ",diverged,6,7,"))
    (out / "evaluations.csv").write_text("".join(  # a diverged run has no final evaluation
        line for line in EVALUATIONS.splitlines(True)
        if not line.startswith(ids("favor-full", 0, 0.001) + ",")))
    s = report.summarise(str(out))["char_lm"]["8"]
    assert s["best_lr"]["favor-full"] == 0.001
    assert s["grid"]["favor-full"] == {"0.001": None, "0.01": None}
    full = s["cells"]["favor-full"]
    assert (full["diverged"], full["diverged_steps"], full["final_bpc"]["n"]) == (1, [7], 0)
    assert full["layers"]["0"]["den_min"] == -1.0


def test_paired_comparison_words():
    a = dict(final_bpc_per_seed={"0": 2.5, "1": 2.7}, final_bpc=dict(mean=2.6, min=2.5, max=2.7,
                                                                     n=2))
    b = dict(final_bpc_per_seed={"0": 2.0, "1": 2.2, "2": 9.0},
             final_bpc=dict(mean=2.1, min=2.0, max=2.2, n=2))
    assert report.compare(a, b) == "+0.500 (per seed +0.500, +0.500; beyond the seed ranges)"
    b["final_bpc_per_seed"] = {"0": 2.6, "1": 2.2}
    b["final_bpc"] = dict(mean=2.4, min=2.2, max=2.6, n=2)
    assert report.compare(a, b) == ("+0.200 (per seed -0.100, +0.500; within the seed ranges, "
                                    "the sign changes between seeds)")
    assert report.compare(a, dict(b, final_bpc_per_seed={"0": None, "1": None})).startswith(
        "not comparable")


def test_section_quotes_the_summary_and_plots_are_made(out):
    (out / "training.json").write_text(json.dumps(dict(
        date="2026-11-26 08:00 UTC", mode="full", git_commit="0123456789abcdef", git_dirty=False,
        machine=dict(cpu="test CPU", cores=2), jobs=2, threads=1, duration_s=600.0,
        command="python3 -m training --full", corpus=dict(name="a test text"))))
    md = report.section(str(out))
    assert md.startswith("## Training: numerator-only against full normalisation\n")
    assert "commit 0123456789ab" in md and "10 min" in md
    assert "(2 cores; 2 runs at once, 1 thread each)" in md
    assert "### Character-level a test text, context 8" in md
    assert "| softmax, RoPE | 0.01 | 2.100 (2.000-2.200, 2 seeds) | - |" in md
    assert ("| favor+, numerator_only | 0.01 | 2.600 (2.500-2.700, 2 seeds) | +0.500 (per seed "
            "+0.500, +0.500; beyond the seed ranges) |") in md
    assert "picked: softmax, RoPE 0.01, favor+, numerator_only 0.01, favor+, full 0.001" in md
    assert "Diverged in the grid: favor+, full at 0.01" in md
    assert ("FAVOR+: full never diverged, ended +1.000 (one seed, so of unknown significance) "
            "bpc from numerator_only") in md
    assert ("redrawn every 5 steps 2.575 (2.400-2.750, 2 seeds), -0.025 (per seed -0.100, "
            "+0.050; within the seed ranges, the sign changes between seeds)") in md
    assert "from 8 to 16: favor+, numerator_only +0.500 -> -0.100" in md
    assert ("| favor+, numerator_only, m = 4 x head dim | 0.001 | 2080 | 1.000 | 6 | 8 | 0 of 1 |"
            in md)
    assert ("4x the features adds to favor+, numerator_only +0.500 (one seed, so of unknown "
            "significance)") in md
    assert "1/pairs = 0.125" in md
    assert "softmax, RoPE (trained at 8): 1.00 ms per token at position 32, 2.00 ms at 64" in md
    assert "| softmax, RoPE | It is a \\| b | 1 of 1 |" in md
    assert md.index("**Which placement trains best** (context 8") < md.index("![")
    assert "elu+1, numerator_only from n = 512" in md
    assert "favor+, numerator_only already at n = 256" in md
    for name in ("char_lm_curves_8.png", "char_lm_curves_16.png", "lr_sensitivity_8.png",
                 "char_lm_extrapolation_8.png", "denominators.png", "mqar_accuracy.png",
                 "step_time.png", "decoding.png"):
        assert (out / name).stat().st_size > 1000, name
        assert "training/" + name in md
    assert "a test text" in md.split("lr_sensitivity_8.png")[1].split("\n\n")[1]  # caption
    assert not (out / "lr_sensitivity_16.png").exists()  # one rate there: no grid
    crossover = json.loads((out / "summary.json").read_text())["step_time"]["crossover"]
    assert crossover["elu-numerator_only"] == dict(kind="interpolated", n=pytest.approx(512))
    assert crossover["favor-numerator_only"] == dict(kind="faster_throughout", n=256)


@pytest.mark.parametrize("parallel, said", [
    (None, "torchrun"), ("data", "torchrun, data parallel"),
    ("sequence", "torchrun, sequence parallel")])
def test_section_names_the_processes_of_a_parallel_sweep(out, parallel, said):
    """training.json of a torchrun sweep (processes 2, jobs 1): the runs were trained one at a
    time, each on 2 processes, and the section says so, and how they shared the batches when
    training.json says (files written before sequence parallelism existed have no "parallel")."""
    meta = dict(
        date="2026-11-26 08:00 UTC", mode="quick", git_commit=None, git_dirty=True,
        machine=dict(cpu="test CPU", cores=2), jobs=1, processes=2, threads=1, duration_s=60.0,
        command="python3 -m torch.distributed.run (2 processes) python3 -m training",
        corpus=dict(name="a test text"))
    if parallel is not None:
        meta["parallel"] = parallel
    (out / "training.json").write_text(json.dumps(meta))
    md = report.section(str(out), plot_note="a test")
    assert "(2 cores; each run on 2 processes (%s), 1 thread each)" % said in md


def test_section_without_plots_says_why_and_links_from_its_own_directory(out):
    md = report.section(str(out), plot_note="run with --no-plots", link_prefix="")
    assert "> The plots were not generated: run with --no-plots." in md
    assert "![" not in md and "training/" not in md
    assert not [p for p in out.iterdir() if p.suffix == ".png"]
