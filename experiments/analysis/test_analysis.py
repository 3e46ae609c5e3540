"""Unit tests of the analysis (CTest runs them: /usr/bin/python3 -m unittest in this directory),
from small hand-written CSVs and metadata to REPORT.md. The whole path, from the programs' own
output to REPORT.md with every section, is test_pipeline.py."""
import contextlib
import io
import math
import os
import shutil
import tempfile
import unittest

import common
import report
import rope_decay


def powers_of_two(lo, hi):
    return [2.0 ** e for e in range(lo, hi + 1)]


class FitLogLog(unittest.TestCase):
    def test_recovers_the_exponent_of_a_power_law(self):
        n = powers_of_two(8, 20)
        for p in (1.0, 2.0, 1.5):
            for c in (1e-6, 3.0):
                fit = common.fit_loglog(n, [c * x ** p for x in n], 2048)
                # Only rounding of log and pow (~1e-15 relative) over a log-range of 6.2.
                self.assertAlmostEqual(fit["slope"], p, delta=1e-12 * p)
                self.assertAlmostEqual(math.exp(fit["intercept"]), c, delta=1e-9 * c)
                self.assertAlmostEqual(fit["r2"], 1.0, delta=1e-12)
                self.assertEqual(fit["points"], 10)  # 2^11 .. 2^20

    def test_ignores_points_below_min_n_and_non_positive_or_non_finite_values(self):
        n = powers_of_two(8, 16)
        t = [5.0 if x < 2048 else 1e-6 * x * x for x in n]  # overhead, then quadratic
        t[0] = -1.0
        self.assertAlmostEqual(common.fit_loglog(n, t, 2048)["slope"], 2.0, delta=1e-12)
        self.assertLess(common.fit_loglog(n, t, 0)["slope"], 1.9)
        t[-1] = float("nan")
        self.assertEqual(common.fit_loglog(n, t, 2048)["points"], 5)  # 2^11 .. 2^15

    def test_nan_with_fewer_than_two_distinct_lengths(self):
        self.assertTrue(math.isnan(common.fit_loglog([4096, 4096], [1, 2])["slope"]))
        self.assertTrue(math.isnan(common.fit_loglog([], [])["slope"]))
        with self.assertRaises(ValueError):
            common.fit_loglog([4096, 4096], [1])


class Crossover(unittest.TestCase):
    # t_fast = 1e-3 n and t_slow = 1e-6 n^2 cross at n = 1000; log(t_fast / t_slow) is linear in
    # log n, so the log-log interpolation is exact.
    n = powers_of_two(6, 14)
    fast = [1e-3 * x for x in n]
    slow = [1e-6 * x * x for x in n]

    def test_interpolated(self):
        c = common.crossover(self.n, self.fast, self.slow)
        self.assertEqual(c["kind"], "interpolated")
        self.assertAlmostEqual(c["n"], 1000, delta=1e-6)
        self.assertEqual(common.describe_crossover(c), "n ~ 1000")

    def test_faster_throughout(self):
        c = common.crossover(self.n[5:], self.fast[5:], self.slow[5:])  # from 2048
        self.assertEqual((c["kind"], c["n"]), ("faster_throughout", 2048))

    def test_not_reached_extrapolates_the_fits(self):
        c = common.crossover(self.n[:4], self.fast[:4], self.slow[:4])  # up to 512
        self.assertEqual(c["kind"], "not_reached")
        self.assertAlmostEqual(c["n"], 1000, delta=1e-6)
        self.assertIn("~ 1e+03 by extrapolating", common.describe_crossover(c))

    def test_the_crossing_that_lasts(self):
        # Faster, slower, faster again: the crossing between 512 and 1024, the fast/slow ratio
        # going from 1.5 to 0.25, log(1.5) / (log(1.5) - log(0.25)) of the way in log n.
        c = common.crossover([256, 512, 1024], [0.5, 3.0, 1.0], [1.0, 2.0, 4.0])
        self.assertEqual(c["kind"], "interpolated")
        self.assertAlmostEqual(c["n"], 512 * 2 ** (math.log(1.5) / math.log(6)), delta=1e-9)
        # Faster at first, slower at the longest: not reached.
        c = common.crossover([256, 512, 1024], [0.5, 3.0, 5.0], [1.0, 2.0, 4.0])
        self.assertEqual(c["kind"], "not_reached")


class Csv(unittest.TestCase):
    def test_rows_with_missing_values_and_line_endings(self):
        text = common.csv_text([dict(a=1, b=None, extra="left out"), dict(a=float("nan"), b=2.5),
                                dict(a="x,y")], ["a", "b"])
        self.assertEqual(text, 'a,b\n1,\n,2.5\n"x,y",\n')

    def test_written_atomically(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "t.csv")
            common.write_csv(path, [dict(a=1)], ["a"])
            with open(path, newline="") as f:
                self.assertEqual(f.read(), "a\n1\n")
            self.assertEqual(os.listdir(directory), ["t.csv"])


class Statistics(unittest.TestCase):
    def test_mean_and_sample_std(self):
        x = [3, 1, 2, 10]
        self.assertEqual(common.mean(x), 4)
        # Sum of squares about 4 = 1 + 9 + 4 + 36 = 50, over n - 1 = 3.
        self.assertAlmostEqual(common.std(x), math.sqrt(50 / 3), delta=1e-15)
        self.assertEqual(common.std([7]), 0)
        self.assertTrue(math.isnan(common.mean([])))


class Formatting(unittest.TestCase):
    def test_numbers(self):
        self.assertEqual(common.fmt(0.123456), "0.123")
        self.assertEqual(common.fmt(float("nan")), "n/a")
        self.assertEqual(common.percent(0.467), "46.7%")
        self.assertEqual(common.percent(0.0123), "1.2%")
        self.assertEqual(common.percent(0.0), "0.0%")
        self.assertEqual(common.duration(185), "3m05s")

    def test_json_has_no_nan(self):
        self.assertEqual(common.clean({"a": [1.0, float("nan")], "b": float("inf")}),
                         {"a": [1.0, None], "b": None})


class ReadingTheCsv(unittest.TestCase):
    """A column the analysis asks for and the CSV lacks is an error naming both, never a NaN
    that a fit or a mean would swallow."""

    def setUp(self):
        self.directory = tempfile.TemporaryDirectory()
        self.addCleanup(self.directory.cleanup)
        with open(os.path.join(self.directory.name, "scaling.csv"), "w") as f:
            f.write("method,n,time_ms\nlinear,256,1.5\nlinear,512,nan\nlinear,1024,abc\n")
        self.rows = common.read_rows(self.directory.name, "scaling")
        self.path = os.path.join(self.directory.name, "scaling.csv")

    def test_numbers_and_the_programs_nan(self):
        self.assertEqual(common.num(self.rows[0], "time_ms"), 1.5)
        self.assertTrue(math.isnan(common.num(self.rows[1], "time_ms")))

    def test_a_misspelt_column_names_the_column_and_the_file(self):
        with self.assertRaises(KeyError) as caught:
            common.num(self.rows[0], "time_msec")
        self.assertIn("'time_msec'", str(caught.exception))
        self.assertIn(self.path, str(caught.exception))
        with self.assertRaises(KeyError):
            self.rows[0]["mthod"]  # text columns are read as row[...] too

    def test_a_cell_that_is_not_a_number_names_the_column_the_file_and_the_line(self):
        with self.assertRaises(ValueError) as caught:
            common.num(self.rows[2], "time_ms")
        self.assertIn("%s line 4: column 'time_ms' is 'abc'" % self.path, str(caught.exception))


ROPE_DECAY_META = {
    "status": "complete", "experiment": "rope-decay", "git_commit": "0" * 40, "git_dirty": False,
    "isa": ["avx2"], "date": "2024-05-01T12:00:00Z",
    "machine": {"cpu": "cpu", "cores": 2, "isa": ["avx512f", "avx2"]}, "openmp": {"threads": 2},
    "load_average_before": 0.5, "duration_s": 1.0, "points_measured": 15, "points_resumed": 0,
    "run": {"yarn_original_max_position": 4096},
    "options": {"mode": "quick", "rope_decay": {"dim": 8, "max_distance": 4}}}


def write_rope_decay(results, meta=None, column="decay"):
    """A small rope_decay.csv (3 curves, distances 0-4) and its metadata under results/."""
    directory = os.path.join(results, "rope_decay")
    os.makedirs(directory, exist_ok=True)
    rows = ["dim,base,scaling,factor,distance,%s,decay_relative" % column]
    for base, scaling, decay in (
            (500, "none", [4.5, 3, 2, 1.5, 1]), (10000, "none", [4.5, 4, 3, 2.5, 2]),
            (10000, "linear", [4.5, 4.4, 4.3, 4.1, 4])):
        rows += ["8,%d,%s,%s,%d,%s,%s" % (base, scaling, 1 if scaling == "none" else 4, m, v,
                                          v / 4.5) for m, v in enumerate(decay)]
    with open(os.path.join(directory, "rope_decay.csv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    common.write_json(os.path.join(directory, "rope_decay.json"), meta or ROPE_DECAY_META)
    return directory


def run_report(*argv):
    """report.main with stderr captured: (status, the stderr lines)."""
    with contextlib.redirect_stderr(io.StringIO()) as err:
        status = report.main(["report.py", *argv])
    return status, err.getvalue().splitlines()


def read(path):
    with open(path) as f:
        return f.read()


class RopeDecaySection(unittest.TestCase):
    """A section written from a small CSV: its numbers are those of the CSV."""

    def test_section_quotes_the_csv(self):
        with tempfile.TemporaryDirectory() as results:
            directory = write_rope_decay(results)
            self.assertEqual(run_report(results, "--no-plots"), (0, []))
            section = read(os.path.join(directory, "report_section.md"))
            self.assertIn("## " + rope_decay.TITLE, section)
            self.assertIn("(2 cores, 2 threads, built for avx2 on a CPU with avx512f,", section)
            self.assertIn("base 500: 4.5 -> 1 (22.2%), half reached at distance 2", section)
            self.assertIn("base 10000: 4.5 -> 2 (44.4%), half reached at distance 4", section)
            self.assertIn("base 500 is lowest on average over distances 1 to 4", section)
            self.assertIn("its bound at distance 4 is 4, and the unscaled base-10000 bound at "
                          "distance 1 is 4.", section)
            self.assertIn("Some plots were not generated: run with --no-plots", section)
            summary = common.read_json(os.path.join(directory, "summary.json"))
            self.assertEqual([c["first_distance_at_half"] for c in summary["curves"]], [2, 4, None])
            self.assertEqual(read(os.path.join(results, "REPORT.md")), report.HEADER + section)
            for d in (results, directory):
                self.assertFalse([name for name in os.listdir(d) if ".tmp-" in name])


def write_interrupted_scaling(results, **meta):
    """A scaling run's metadata, interrupted after 3 of 40 points (no CSV needed)."""
    interrupted = dict(ROPE_DECAY_META, experiment="scaling", status="interrupted",
                       signal="SIGINT", points_saved=3, points_total=40, points_measured=3, **meta)
    scaling = os.path.join(results, "scaling")
    os.makedirs(scaling)
    common.write_json(os.path.join(scaling, "scaling.json"), interrupted)


class Report(unittest.TestCase):
    """REPORT.md: the analysis alone writes it, from the metadata and CSVs it finds."""

    def setUp(self):
        self.results = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.results)

    def test_sections_in_report_order_whatever_ran_last(self):
        # scaling is dated a day before rope-decay and written after it: neither the newest
        # first nor the last written first would put it ahead, the report's order does.
        write_rope_decay(self.results)
        write_interrupted_scaling(self.results, date="2024-04-30T12:00:00Z")
        self.assertEqual(run_report(self.results, "--no-plots")[0], 0)
        md = read(os.path.join(self.results, "REPORT.md"))
        self.assertTrue(md.startswith("# linrope experiments\n"))
        self.assertLess(md.index("## scaling: interrupted, incomplete"),
                        md.index("## " + rope_decay.TITLE))

    def test_an_interrupted_sweep_gets_no_findings_and_loses_the_earlier_figures(self):
        directory = write_rope_decay(self.results)
        self.assertEqual(run_report(self.results, "--no-plots")[0], 0)  # a complete run first
        for name in ("rope_decay.png", "rope_decay.svg"):  # the earlier analysis's figures
            with open(os.path.join(directory, name), "w") as f:
                f.write("earlier")
        meta = dict(ROPE_DECAY_META, status="interrupted", signal="SIGTERM", points_saved=4,
                    points_total=15, points_measured=4)
        common.write_json(os.path.join(directory, "rope_decay.json"), meta)
        self.assertEqual(run_report(self.results), (0, []))
        self.assertEqual(sorted(os.listdir(directory)),
                         ["report_section.md", "rope_decay.csv", "rope_decay.json"])
        md = read(os.path.join(self.results, "REPORT.md"))
        self.assertIn("## rope-decay: interrupted, incomplete", md)
        self.assertIn("Interrupted by SIGTERM after 4 of 15 points", md)
        self.assertIn("--resume", md)
        self.assertNotIn("![", md)

    def test_without_plots_a_figure_older_than_the_run_is_removed_a_newer_one_kept(self):
        directory = write_rope_decay(self.results)
        meta = os.path.join(directory, "rope_decay.json")
        for name, age in (("rope_decay.png", 60), ("rope_decay.svg", -60)):
            path = os.path.join(directory, name)
            with open(path, "w") as f:
                f.write("a figure")
            written = os.path.getmtime(meta)
            os.utime(path, (written - age, written - age))
        self.assertEqual(run_report(self.results, "--no-plots")[0], 0)
        self.assertFalse(os.path.exists(os.path.join(directory, "rope_decay.png")))
        self.assertTrue(os.path.exists(os.path.join(directory, "rope_decay.svg")))
        md = read(os.path.join(self.results, "REPORT.md"))
        self.assertNotIn("](rope_decay/rope_decay.png)", md)
        self.assertIn("Some plots were not generated: run with --no-plots", md)

    def test_a_misspelt_column_fails_that_section_in_one_line_and_keeps_the_others(self):
        write_rope_decay(self.results, column="decya")
        write_interrupted_scaling(self.results)
        directory = write_rope_decay(os.path.join(self.results, "elsewhere"))
        os.rename(directory, os.path.join(self.results, "rope_relative"))  # not analysed: no JSON
        status, err = run_report(self.results, "--no-plots")
        self.assertEqual(status, 1)
        self.assertEqual(len(err), 1)
        self.assertIn("rope_decay: analysis failed", err[0])
        self.assertIn("no column 'decay'", err[0])
        self.assertIn(os.path.join(self.results, "rope_decay", "rope_decay.csv"), err[0])
        md = read(os.path.join(self.results, "REPORT.md"))
        self.assertIn("## rope-decay\n\n> The analysis failed: MissingColumn: ", md)
        self.assertIn("## scaling: interrupted, incomplete", md)  # the other section, kept

    def test_nothing_to_analyse_and_bad_command_lines(self):
        self.assertEqual(run_report(self.results)[0], 0)
        self.assertIn("No experiment output under", read(os.path.join(self.results, "REPORT.md")))
        status, err = run_report()
        self.assertEqual((status, len(err)), (2, 1))
        status, err = run_report(os.path.join(self.results, "missing"))
        self.assertEqual(status, 2)
        self.assertEqual(err, ["report.py: %s is not a directory" % os.path.join(
            self.results, "missing")])


if __name__ == "__main__":
    unittest.main()
