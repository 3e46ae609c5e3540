"""A finished run as one record, Result: what the sweep saves of it (runs/<key>.json: its
configuration, its summary and its records) and what the tables hold (runs.csv, a row per run;
curves.csv, layers.csv and evaluations.csv, a row per record), read into the same type. The plans
(the best learning rate), decoding (which models to use), the summary and the report all read
Results; write_tables and read_tables are each other's inverse."""
import dataclasses
import math
import os

from analysis.common import read_rows, write_csv  # experiments/analysis

from .mqar import parse_settings, settings_name
from .train import run_key
from .variants import Variant, from_name

# What tells one run from another in the tables: the cell (task, context or MQAR settings,
# variant, learning rate, budget: the optimiser steps configured) and the seed.
IDS = ("task", "context", "mqar_settings", "variant", "lr", "budget", "seed")
# The records written a row each, and their columns after the ids.
RECORDS = dict(curves=("step", "train_loss", "scheduled_lr", "grad_norm", "clipped_so_far"),
               layers=("step", "layer", "den_min", "nonpositive_share", "tiny_share",
                       "grad_norm"),
               evaluations=("step", "final", "length", "pairs", "metric", "value"))


@dataclasses.dataclass
class Result:
    """One finished run. summary: train.Run.summary() (status, steps done, divergence, clip
    share, throughput, state size, MQAR's recall, the denominators' totals per layer); records:
    its curves, layers and evaluations, lists of rows (dicts). NaN reads as None, from either
    source."""
    task: str
    context: int        # char_lm's training context; 0 for mqar
    variant: Variant
    lr: float
    seed: int
    summary: dict
    records: dict
    resumed_from_step: int = None  # where a resumed run continued (runs/<key>.json only)
    mqar_settings: tuple = ()      # mqar's ((length, pairs), ...)
    budget: int = None             # the optimiser steps configured (None: tables without them)

    @property
    def key(self):
        """The run's name (train.Config.key): its files' name."""
        return run_key(self.task, self.context, self.mqar_settings, self.variant, self.lr,
                       self.budget, self.seed)

    @property
    def setting(self):
        """Where the run trained: char_lm's context, or MQAR's settings."""
        return self.context if self.task == "char_lm" else self.mqar_settings

    @property
    def cell(self):
        """What the seeds of one measurement share: (task, setting, variant, lr, budget)."""
        return self.task, self.setting, self.variant, self.lr, self.budget

    @property
    def complete(self):
        return self.summary["status"] == "complete"

    def model_path(self, out):
        """Where the sweep keeps a char_lm run's model (training.generate reads it)."""
        return os.path.join(out, "models", self.key + ".pt")

    def finals(self, length=None):
        """The final evaluations (at `length` only, if given)."""
        return [e for e in self.records["evaluations"]
                if e["final"] and (length is None or e["length"] == length)]

    def final_bpc(self):
        """A char_lm run's final validation bpc at its training context (inf if it diverged)."""
        values = [e["value"] for e in self.finals(self.context)]
        return values[-1] if self.complete and values and values[-1] is not None else math.inf

    def final_accuracy(self):
        """An MQAR run's final held-out accuracy, the worst of its settings' (None if it
        diverged)."""
        values = [e["value"] for e in self.finals()]
        return min(values) if self.complete and values and None not in values else None

    def score(self):
        """What best_lr ranks runs by, smaller better: char_lm's final bpc; MQAR's final
        accuracy (negated), then the steps it took (a run stops once it reaches its
        stop_accuracy). A diverged run ranks after every finished one."""
        if self.task == "char_lm":
            return (self.final_bpc(), 0)
        accuracy = self.final_accuracy()
        return (math.inf, 0) if accuracy is None else (-accuracy, self.summary["steps"])

    def layer_ids(self):
        """The attention layers the run recorded: in its layer rows, or (without them) in the
        summary's denominator totals (layer<i>_den_min, ...)."""
        ids = {row["layer"] for row in self.records["layers"]}
        while self.summary.get("layer%d_den_min" % len(ids)) is not None:
            ids.add(len(ids))
        return sorted(ids)


def from_saved(saved):
    """The Result of a runs/<key>.json (as sweep saves it)."""
    config = saved["config"]
    return Result(config["task"], config["context"], Variant(**config["variant"]), config["lr"],
                  config["seed"], saved["summary"],
                  {name: saved["records"][name] for name in RECORDS},
                  saved.get("resumed_from_step"),
                  tuple(tuple(s) for s in config["mqar_settings"]) if config["task"] == "mqar"
                  else (), config["steps"])


def _ids(result):
    return dict(task=result.task, context=result.context,
                mqar_settings=settings_name(result.mqar_settings), variant=result.variant.name,
                lr=result.lr, budget=result.budget, seed=result.seed)


def write_tables(results, out):
    """runs.csv (the ids, then the summary), curves.csv, layers.csv and evaluations.csv (the ids,
    then the record), each written atomically, None and NaN as empty cells."""
    runs = [dict(_ids(r), **r.summary) for r in results]
    columns = list(dict.fromkeys(list(IDS) + ["status"] + [k for row in runs for k in row]))
    write_csv(os.path.join(out, "runs.csv"), runs, columns)
    for name, record_columns in RECORDS.items():
        rows = [dict(_ids(r), **row) for r in results for row in r.records[name]]
        write_csv(os.path.join(out, name + ".csv"), rows, list(IDS + record_columns))


def _value(text):
    """A cell as the writer's value: None (empty), a bool, an int, a float or the text (MQAR's
    settings stay text: "64x4" is no number)."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# The committed study's tables (docs/results/training) give FAVOR+'s feature count and the redraw
# interval in columns of their own beside the name: the variant is then the name's with these.
_FIELD_COLUMNS = ("feature_factor", "redraw_interval")


def _cells(row):
    """A table row's values (read_rows's text) and its variant."""
    values = {k: _value(v) for k, v in row.items()}
    variant = from_name(values.pop("variant")).replace(
        **{k: values.pop(k) for k in _FIELD_COLUMNS if k in values})
    values["mqar_settings"] = parse_settings(values.get("mqar_settings") or "")
    values.setdefault("budget", None)  # the committed study's tables have no budget column
    return values, variant


def _pop_ids(values, variant):
    """The ids Result takes, removed from values: (task, context, variant, lr, seed) and the
    keywords mqar_settings and budget."""
    ids = [values.pop(k) for k in ("task", "context")] + [variant] + \
        [values.pop(k) for k in ("lr", "seed")]
    return ids, dict(mqar_settings=values.pop("mqar_settings"), budget=values.pop("budget"))


def read_tables(directory):
    """The Results the tables in directory hold, in runs.csv's order ([] without runs.csv)."""
    if not os.path.exists(os.path.join(directory, "runs.csv")):
        return []
    results, by_key = [], {}
    for row in read_rows(directory, "runs"):
        values, variant = _cells(row)
        ids, keywords = _pop_ids(values, variant)
        result = Result(*ids, summary=values, records={name: [] for name in RECORDS}, **keywords)
        results.append(result)
        by_key[result.key] = result
    for name in RECORDS:
        if not os.path.exists(os.path.join(directory, name + ".csv")):
            continue
        for row in read_rows(directory, name):
            values, variant = _cells(row)
            ids, keywords = _pop_ids(values, variant)
            by_key[Result(*ids, summary={}, records={}, **keywords).key].records[name].append(
                values)
    return results
