"""The whole pipeline, from the programs' own output to REPORT.md: linrope-experiments runs each
experiment at tiny sizes, the training experiment a tiny sweep, then report.py reads them all;
REPORT.md must hold every section, in report order, each linking its own files and figures.

CTest runs it in this directory with LINROPE_EXPERIMENTS_PROGRAM naming the program and, when the
Python package is built, LINROPE_PIPELINE_TRAINING=1 and PYTHONPATH naming the package and
experiments/ (the training needs both); without it the training is left out."""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

import common
import favor_error
import normalization
import report
import rope_decay
import rope_relative
import scaling

EXPERIMENTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.environ.get("LINROPE_EXPERIMENTS_PROGRAM")
TRAINING = os.environ.get("LINROPE_PIPELINE_TRAINING") == "1"
# The sizes of experiments/tests (small_options.hpp): each run takes well under a second.
SIZES = {
    "scaling": "--lengths 16,32 --heads 2 --dim 8 --reps 1 --naive-max 32 --softmax-max 32 "
               "--scaling-features 8 --one-head-n 64 --fit-min-n 16",
    "normalization": "--norm-lengths 8,16 --norm-seeds 2 --norm-dim 8 --norm-features 8",
    "favor-error": "--favor-length 32 --favor-dim 4 --favor-features 4,8 --favor-seeds 2 "
                   "--favor-pairs 64",
    "rope-decay": "--decay-dim 16 --decay-distance 8",
    "rope-relative": "--relative-positions 10,1000,1000000 --relative-dim 8 --relative-samples 16",
}
TRAINING_TITLE = "Training: numerator-only against full normalisation"


@unittest.skipUnless(PROGRAM, "LINROPE_EXPERIMENTS_PROGRAM does not name linrope-experiments")
class Pipeline(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = tempfile.mkdtemp(prefix="linrope-pipeline-")
        for experiment, sizes in SIZES.items():
            subprocess.run([PROGRAM, experiment, *sizes.split(), "--quiet", "--out", cls.results],
                           check=True, stdout=subprocess.DEVNULL)
        if TRAINING:
            # MQAR only (no corpus to extract), two variants, two steps, no step times: seconds.
            subprocess.run([sys.executable, "-B", "-m", "training", "--tasks", "mqar",
                            "--variants", "softmax-rope,elu-numerator_only", "--steps", "2",
                            "--no-step-time", "--jobs", "1", "--quiet",
                            "--out", os.path.join(cls.results, "training")],
                           check=True, cwd=EXPERIMENTS_DIR)
        cls.status = subprocess.run(
            [sys.executable, "-B", report.__file__, cls.results], capture_output=True, text=True)
        with open(os.path.join(cls.results, "REPORT.md")) as f:
            cls.report = f.read()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.results)

    def test_the_analysis_succeeds_quietly(self):
        self.assertEqual((self.status.returncode, self.status.stderr), (0, ""))

    def test_every_section_in_report_order_each_with_its_data(self):
        titles = [m.TITLE for m in (scaling, normalization, favor_error, rope_decay,
                                    rope_relative)] + ([TRAINING_TITLE] if TRAINING else [])
        headings = re.findall(r"^## (.*)$", self.report, re.MULTILINE)
        self.assertEqual(headings, titles)
        for stem in report.PROGRAM_EXPERIMENTS:
            self.assertIn("(%s/%s.csv)" % (stem, stem), self.report)
            self.assertIn("(%s/summary.json)" % stem, self.report)
        if TRAINING:
            self.assertIn("(training/runs.csv)", self.report)
            self.assertIn("(training/summary.json)", self.report)
            self.assertIn("MQAR (Zoology's multi-query associative recall)", self.report)

    def test_every_figure_linked_exists_and_every_figure_is_linked(self):
        linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", self.report)
        self.assertGreaterEqual(len(linked), 7 + (3 if TRAINING else 0))
        for path in linked:
            self.assertTrue(os.path.getsize(os.path.join(self.results, path)) > 1000, path)
        made = {os.path.relpath(os.path.join(d, name), self.results)
                for d, _, names in os.walk(self.results) for name in names
                if name.endswith(".png")}
        self.assertEqual(made, set(linked))

    def test_sections_quote_the_measurements(self):
        # rope-decay: at m = 0 the bound is (d/2 + 1) / 2 = 4.5 for d = 16, every curve.
        self.assertIn("d = 16, from distance 0 to 8", self.report)
        self.assertIn("base 500: 4.5 -> ", self.report)
        self.assertIn("base 10000, linear x4: 4.5 -> ", self.report)
        # scaling at H = 2: 2 causal settings x (2 softmax + 2 maps x 4 placements); one-head
        # points; every curve at both lengths.
        summary = common.read_json(os.path.join(self.results, "scaling", "summary.json"))
        self.assertEqual(len(summary["curves"]), 2 * (2 + 8))
        self.assertEqual(len(summary["one_head"]), 16)
        for curve in summary["curves"]:
            self.assertEqual(curve["n"], [16, 32])

    def test_no_temporary_file_is_left(self):
        for d, _, names in os.walk(self.results):
            self.assertFalse([n for n in names if ".tmp" in n], d)


if __name__ == "__main__":
    unittest.main()
