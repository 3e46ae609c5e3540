"""training.report: the numbers it derives from hand-written CSVs (known means, ranges and
crossover), the sentences that quote them, and the plots."""
import json
import math

import pytest

from training import report
from training.step_time import crossover

RUNS = """task,variant,seed,status,steps,diverged_step,clip_share,tokens_per_s,final_train_loss,\
layer0_den_min,layer0_nonpositive_share,layer0_tiny_share
char_lm,softmax-rope,0,complete,10,,0.1,1000,1.0,,,
char_lm,softmax-rope,1,complete,10,,0.3,3000,1.2,,,
char_lm,favor-numerator_only,0,complete,10,,0.5,2000,1.5,0.25,0,0
char_lm,favor-numerator_only,1,complete,10,,0.5,2000,1.5,0.5,0,0
char_lm,favor-full,0,diverged,4,5,0.5,2000,2.0,-7.0,0.25,0.5
char_lm,favor-full,1,complete,10,,0.5,2000,2.0,-3.0,0.75,0.25
"""
EVALUATIONS = "task,variant,seed,step,final,length,pairs,metric,value\n" + "".join(
    "char_lm,%s,%d,10,True,%d,,bpc,%s\n" % (v, seed, n, value)
    for v, seed, n, value in [
        ("softmax-rope", 0, 8, 2.0), ("softmax-rope", 1, 8, 2.2), ("softmax-rope", 0, 16, 3.0),
        ("softmax-rope", 1, 16, 3.0), ("softmax-rope", 0, 32, 4.0), ("softmax-rope", 1, 32, 4.0),
        ("favor-numerator_only", 0, 8, 2.5), ("favor-numerator_only", 1, 8, 2.7),
        ("favor-numerator_only", 0, 32, 2.6), ("favor-numerator_only", 1, 32, 2.8),
        ("favor-full", 1, 8, 3.5), ("favor-full", 1, 32, 3.5)])
LAYERS = """task,variant,seed,step,layer,den_min,nonpositive_share,tiny_share,grad_norm
char_lm,favor-full,1,10,0,-3.0,0.75,0.25,2.0
char_lm,favor-numerator_only,1,10,0,0.5,0,0,1.0
"""
CURVES = """task,variant,seed,step,train_loss,lr,grad_norm,clipped_so_far
char_lm,softmax-rope,0,10,1.0,0.001,1.0,1
char_lm,favor-full,1,10,2.0,0.001,1.0,5
"""
STEP_TIME = """variant,length,seconds,tokens_per_s,threads,repeats,load_average_before
softmax-rope,256,1.0,256,2,3,0.1
softmax-rope,1024,4.0,256,2,3,0.1
elu-numerator_only,256,2.0,128,2,3,0.1
elu-numerator_only,1024,2.0,512,2,3,0.1
favor-numerator_only,256,0.5,512,2,3,0.1
favor-numerator_only,1024,1.0,1024,2,3,0.1
"""


@pytest.fixture
def out(tmp_path):
    for name, text in (("runs", RUNS), ("evaluations", EVALUATIONS), ("layers", LAYERS),
                       ("curves", CURVES), ("step_time", STEP_TIME)):
        (tmp_path / (name + ".csv")).write_text(text)
    return tmp_path


def test_summary_means_ranges_and_divergence(out):
    s = report.summarise(str(out))["char_lm"]
    assert s["softmax-rope"]["final_bpc"] == dict(mean=pytest.approx(2.1), min=2.0, max=2.2, n=2)
    assert s["softmax-rope"]["extrapolation"]["32"]["mean"] == 4.0
    assert s["softmax-rope"]["tokens_per_s"]["mean"] == 2000
    full = s["favor-full"]
    assert (full["diverged"], full["diverged_steps"], full["final_bpc"]["n"]) == (1, [5], 1)
    assert full["layers"]["0"]["den_min"] == -7.0  # the smallest over seeds
    assert full["layers"]["0"]["nonpositive_share"]["mean"] == 0.5


def test_crossover_interpolates_on_log_length():
    # linear/softmax time ratio 2 at n = 256 and 0.5 at n = 1024: log ratio crosses 0 halfway
    # in log n, at n = 512.
    assert crossover([256, 1024], [1.0, 4.0], [2.0, 2.0]) == pytest.approx(512)
    assert crossover([256, 1024], [1.0, 4.0], [0.5, 1.0]) == 256  # faster from the start
    assert crossover([256, 1024], [1.0, 1.0], [2.0, 2.0]) is None
    # Faster at first, slower at the longest: no crossover to report.
    assert crossover([256, 512, 1024], [1.0, 2.0, 4.0], [0.5, 3.0, 5.0]) is None
    # Faster, slower, faster again: the crossing that lasts, between 512 and 1024 (ratio 1.5
    # then 0.25 per log-length step: log(1.5) / (log(1.5) - log(0.25)) of the way).
    expected = 512 * 2 ** (math.log(1.5) / (math.log(1.5) - math.log(0.25)))
    assert crossover([256, 512, 1024], [1.0, 2.0, 4.0], [0.5, 3.0, 1.0]) == pytest.approx(expected)


def test_section_quotes_the_summary_and_plots_are_made(out):
    (out / "training.json").write_text(json.dumps(dict(
        date="2026-11-26 08:00 UTC", mode="full", git_commit="0123456789abcdef", git_dirty=False,
        machine=dict(cpu="test CPU", cores=2), jobs=2, threads=1, duration_s=600.0,
        command="python3 -m training --full", corpus=dict(name="a test text"))))
    md = report.section(str(out))
    assert md.startswith("## Training: numerator-only against full normalisation\n")
    assert "commit 0123456789ab" in md and "10 min" in md
    assert "(2 cores; 2 runs at once, 1 thread each)" in md
    assert "| softmax, RoPE | 2.100 (2.000-2.200, 2 seeds) |" in md
    assert "FAVOR+: full diverged in 1 of 2 seeds (at step 5)" in md
    assert "ended +0.900 bpc from numerator_only" in md  # 3.5 - 2.6
    assert "elu+1, numerator_only from n = 512" in md
    assert "favor+, numerator_only already at n = 256" in md
    for name in ("char_lm_curves.png", "char_lm_extrapolation.png", "denominators.png",
                 "step_time.png"):
        assert (out / name).stat().st_size > 1000, name
        assert "training/" + name in md
    assert not math.isnan(json.loads((out / "summary.json").read_text())["step_time"]
                          ["crossover"]["elu-numerator_only"])


@pytest.mark.parametrize("parallel, said", [(None, "torchrun"),
                                             ("data", "torchrun, data parallel"),
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
