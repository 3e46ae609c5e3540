"""A plan (plans.Plan) run stage by stage, in the plan's order. Each stage's configs are chosen
from the results so far; a stage that --stages selects trains them (sweep.run_all), one that it
does not only reads their finished runs from the output directory, so that a later stage can be
trained on its own from the earlier stages' runs. A stage that adds runs in rounds (grid_edge:
one more rate per variant a round) goes on until it gives no config that has not run. A stage
is done when every run it gives has finished and the stages of its task before it are done.

Under torchrun rank 0 alone holds the results and reads the files: it sends every round's
configs to the other ranks, which train them with it."""
import dataclasses
import sys

from . import budget, sweep
from .plans import TASK_OF


def with_text(configs, corpus):
    """char_lm configs bound to the corpus (a resumed run never continues on another text)."""
    return [dataclasses.replace(c, text_digest=corpus.digest) if c.task == "char_lm" else c
            for c in configs]


@dataclasses.dataclass
class Progress:
    """What a run of the plan has so far (rank 0's; the other ranks hold nothing): every
    finished run (results.Result), the stages done, and those whose runs this process trained."""
    results: list = dataclasses.field(default_factory=list)
    done: list = dataclasses.field(default_factory=list)
    trained: list = dataclasses.field(default_factory=list)


def _new_configs(plan, name, results, corpus):
    keys = {r.key for r in results}
    return [c for c in with_text(plan.stage(name, results), corpus) if c.key() not in keys]


def _read_stage(plan, name, results, out, corpus):
    """The stage's finished runs in out, round after round, and how many of its runs are not
    there."""
    found = []
    while True:
        configs = _new_configs(plan, name, results + found, corpus)
        present = [r for r in (sweep.finished(out, c) for c in configs) if r is not None]
        if not present:
            return found, len(configs)
        found += present


def _train_stage(plan, name, progress, out, corpus, train, jobs, group, resume):
    """Trains the stage's runs, round after round, each round's configs sent by rank 0. The stage
    counts as trained by this process (progress.trained: its command and commit go in the stage
    log) unless every run was finished before and `resume` keeps them: --resume over a finished
    stage (to write the tables and samples again) leaves the log as it was."""
    while True:
        configs = group.broadcast(_new_configs(plan, name, progress.results, corpus)
                                  if group.main else None)
        if not configs:
            return
        unfinished = False
        if group.main:
            sys.stderr.write("training: %s\n" % budget.stage_estimate(
                name, configs, progress.results, plan, jobs))
            unfinished = not resume or any(sweep.finished(out, c) is None for c in configs)
        progress.results += train(configs) or []
        if unfinished and name not in progress.trained:
            progress.trained.append(name)


def run(plan, out, corpus, train, jobs, group, after_stage=None, resume=False):
    """Runs the plan's stages; returns the Progress. train(configs): the stage's runs trained
    (sweep.run_all's results, in order; None on ranks other than 0), finished ones kept if
    `resume` (as the command's --resume); after_stage(progress): called on rank 0 after every
    stage trained (to write the tables and the metadata)."""
    progress = Progress()
    names = plan.stage_names()
    for i, name in enumerate(names):
        earlier = [s for s in names[:i] if TASK_OF[s] == TASK_OF[name]]
        if plan.selected(name):
            _train_stage(plan, name, progress, out, corpus, train, jobs, group, resume)
            missing = 0
        elif group.main:
            found, missing = _read_stage(plan, name, progress.results, out, corpus)
            progress.results += found
            if missing:
                sys.stderr.write("training: stage %s (not in --stages): %d finished runs read, "
                                 "%d not run yet\n" % (name, len(found), missing))
        else:
            continue
        if not missing and all(s in progress.done for s in earlier):
            progress.done.append(name)
        if plan.selected(name) and group.main and after_stage:
            after_stage(progress)
    return progress
