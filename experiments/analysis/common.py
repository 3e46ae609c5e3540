"""What the analyses share: reading the C++ program's CSV and JSON, writing files (CSV, JSON)
atomically, statistics, power-law fits and crossovers, and number formatting for the report
text. Standard library only: the report is written even where numpy and matplotlib are missing
(the plots need them). The training package (experiments/training) and the benchmarks write their
CSVs and find their crossovers here too."""
import csv
import io
import json
import math
import os


class MissingColumn(KeyError):
    """A column the analysis asks for that the CSV does not have: a misspelt name or a CSV from
    another version of the program. Its message names the column and the file."""

    def __str__(self):
        return self.args[0]


class Row(dict):
    """One CSV row (column -> text) that knows where it came from, so that an error can say so."""

    def __init__(self, values, path, line):
        super().__init__(values)
        self.path, self.line = path, line

    def __missing__(self, column):
        # A missing column is a bug in the analysis or a foreign CSV, never a missing value:
        # read as NaN it would flow silently into fits, means and the report's sentences.
        raise MissingColumn("%s has no column '%s' (its columns: %s)" % (
            self.path, column, ", ".join(self)))


def read_rows(directory, stem):
    """The rows of <directory>/<stem>.csv as Rows (the CSV is the program's output)."""
    path = os.path.join(directory, stem + ".csv")
    with open(path, newline="") as f:
        # Line 1 is the header; the program writes no line breaks inside cells.
        return [Row(r, path, i) for i, r in enumerate(csv.DictReader(f), start=2)]


def read_json(path):
    with open(path) as f:
        return json.load(f)


def num(row, key):
    """The cell as a float ('nan' and 'inf' as the program writes them). A missing column raises
    MissingColumn, a cell that is not a number ValueError, each naming the column and the file."""
    text = row[key]
    try:
        return float(text)
    except ValueError:
        where = "%s line %d" % (row.path, row.line) if isinstance(row, Row) else "the row"
        raise ValueError("%s: column '%s' is %r, not a number" % (where, key, text)) from None


def write_atomic(path, text):
    """Writes text (str, or bytes written as they are) under a temporary name in the same
    directory, flushed to disk, then renames it over path (as the program's own writes do), so a
    reader never sees half a file."""
    temporary = os.path.join(os.path.dirname(path) or ".",
                             ".%s.tmp-%d" % (os.path.basename(path), os.getpid()))
    try:
        with open(temporary, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def csv_text(rows, columns):
    """rows (dicts) as CSV text: a header of columns, then a line per row ("\n" line endings, as
    the program writes its CSVs); None and NaN as empty cells, keys outside columns left out."""
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None or (isinstance(v, float) and math.isnan(v)) else v
                         for k, v in row.items()})
    return text.getvalue()


def write_csv(path, rows, columns):
    """csv_text(rows, columns), written atomically (write_atomic)."""
    write_atomic(path, csv_text(rows, columns))


def write_json(path, value):
    write_atomic(path, json.dumps(clean(value), indent=2, sort_keys=True) + "\n")


def clean(value):
    """NaN and infinities as null: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


# ---- statistics --------------------------------------------------------------------------------
def mean(values):
    values = list(values)
    return math.fsum(values) / len(values) if values else float("nan")


def std(values):
    """Sample standard deviation (n - 1); 0 for one value, NaN for none."""
    values = list(values)
    if len(values) < 2:
        return 0.0 if values else float("nan")
    m = mean(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def fit_loglog(n, t, min_n=0.0):
    """Least squares on log t = slope log n + intercept over the points with n >= min_n and n, t
    finite and positive. NaN slope, intercept and r2 with fewer than two distinct such n."""
    n, t = list(n), list(t)
    if len(n) != len(t):
        raise ValueError("fit_loglog: n has %d values but t has %d" % (len(n), len(t)))
    points = [(math.log(a), math.log(b)) for a, b in zip(n, t)
              if math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0 and a >= min_n]
    fit = {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan"),
           "points": len(points)}
    if len({x for x, _ in points}) < 2:
        return fit
    mx, my = mean(x for x, _ in points), mean(y for _, y in points)
    sxx = math.fsum((x - mx) ** 2 for x, _ in points)
    sxy = math.fsum((x - mx) * (y - my) for x, y in points)
    syy = math.fsum((y - my) ** 2 for _, y in points)
    fit["slope"] = sxy / sxx
    fit["intercept"] = my - fit["slope"] * mx
    fit["r2"] = sxy * sxy / (sxx * syy) if syy > 0 else 1.0
    return fit


def crossover(n, t_fast, t_slow, fit_min_n=0.0):
    """Where curve t_fast (e.g. linear attention) overtakes t_slow (softmax), both measured at the
    same ascending lengths n. With r = log(t_fast / t_slow):
      interpolated       r >= 0 up to n_i and r < 0 from n_(i+1) on: the log-log interpolation
                         of the root between them;
      faster_throughout  r < 0 everywhere: n is the smallest length;
      not_reached        r >= 0 at the largest n: where the fitted power laws (n >= fit_min_n)
                         cross if the slow curve grows faster, else NaN."""
    n, t_fast, t_slow = list(n), list(t_fast), list(t_slow)
    if not n or len(t_fast) != len(n) or len(t_slow) != len(n):
        raise ValueError("crossover: n, t_fast and t_slow must have the same, nonzero size")
    ratio = [math.log(f / s) for f, s in zip(t_fast, t_slow)]
    slower = [i for i, r in enumerate(ratio) if r >= 0]
    if not slower:
        return {"kind": "faster_throughout", "n": n[0]}
    i = slower[-1]
    if i + 1 < len(n):
        a, b = math.log(n[i]), math.log(n[i + 1])
        fraction = ratio[i] / (ratio[i] - ratio[i + 1])
        return {"kind": "interpolated", "n": math.exp(a + fraction * (b - a))}
    fast, slow = fit_loglog(n, t_fast, fit_min_n), fit_loglog(n, t_slow, fit_min_n)
    estimate = float("nan")
    if slow["slope"] > fast["slope"]:
        estimate = math.exp((fast["intercept"] - slow["intercept"]) /
                            (slow["slope"] - fast["slope"]))
    return {"kind": "not_reached", "n": estimate}


def describe_crossover(c):
    if c["kind"] == "interpolated":
        return "n ~ %.0f" % c["n"]
    if c["kind"] == "faster_throughout":
        return "below %.0f (faster at every length)" % c["n"]
    if c["n"] is not None and math.isfinite(c["n"]):
        return "not reached (~ %.3g by extrapolating the fits)" % c["n"]
    return "not reached"


# ---- formatting --------------------------------------------------------------------------------
def fmt(value, digits=3):
    """'%.3g', and 'n/a' for a missing value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return "%.*g" % (digits, value)


def percent(fraction):
    if fraction is None or math.isnan(fraction):
        return "n/a"
    p = 100 * fraction
    return ("%.1f%%" % p) if p == 0 or p >= 10 else ("%.2g%%" % p)


def join(parts, separator="; "):
    return separator.join(parts)


def duration(seconds):
    """Like the program's progress line: '45s', '3m05s', '1h02m'."""
    s = int(round(seconds))
    if s < 60:
        return "%ds" % s
    if s < 3600:
        return "%dm%02ds" % (s // 60, s % 60)
    return "%dh%02dm" % (s // 3600, (s % 3600) // 60)


def save_figure(fig, directory, name):
    """Writes name (a .png, for the report) and the same figure as .svg (vector, for papers),
    each to a temporary name first and then renamed, so an interrupted run leaves no half file."""
    import matplotlib.pyplot as plt

    try:
        for path, kind in ((name, "png"), (os.path.splitext(name)[0] + ".svg", "svg")):
            final = os.path.join(directory, path)
            temporary = os.path.join(directory, ".%s.tmp-%d" % (path, os.getpid()))
            try:
                fig.savefig(temporary, format=kind, dpi=110, bbox_inches="tight")
                os.replace(temporary, final)
            finally:
                if os.path.exists(temporary):
                    os.remove(temporary)
    finally:
        plt.close(fig)
