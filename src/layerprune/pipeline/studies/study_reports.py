"""A sweep's reports: drawn by its last stage, or on demand from a run in progress (`layerprune study NAME --report`).

The report stage draws sweep.md (with budgets budget.md too; a grain study grain.md) and then writes REPORTED, the
mark that it drew them from a finished run: a report drawn on demand never writes it, so the stage still draws the
study's report at the end however many partial ones were read before; a report drawn on demand removes the mark, and
a run given stages since (replicates, arms) loses it too. One lock file per run folder keeps a report drawn on demand
from interleaving with the stage's (the later drawing wins, whole)."""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timezone
from pathlib import Path

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import file_lock, write_atomic
from layerprune.core.reports import read_report
from layerprune.core.settings import RunSettings
from layerprune.pipeline.stages import RunPaths, RunState, in_brief, owns
from layerprune.pipeline.studies.sweep_cells import Cell, cells
from layerprune.pipeline.studies.sweep_grid import SweepStudy

LOCK = ".report.lock"


def report_file(study: SweepStudy, root: Path) -> Path:
    """The report a reader opens first: grain.md for a grain study, else sweep.md."""
    return root / ("grain.md" if study.grains is not None else "sweep.md")


def write_reports(study: SweepStudy, settings: RunSettings, root: Path, cell: Cell) -> None:
    """The report stage: every report of the finished run, then its mark (`cell.output`, REPORTED)."""
    with report_lock(root):
        draw(study, root)
        write_atomic(cell.output, json.dumps({"drawn": datetime.now(timezone.utc).isoformat(timespec="seconds")}))


def draw(study: SweepStudy, root: Path) -> list[Path]:
    """Draw the study's reports from the evaluations in `root`; the report files written."""
    if study.grains is not None:  # a grain study's report instead (pipeline/studies/grain_report.py)
        from layerprune.pipeline.studies.grain_report import write_grain_report

        return [write_grain_report(study, root)]
    from layerprune.pipeline.studies.sweep_report import write_sweep_report

    drawn = [write_sweep_report(study, root)]
    if study.budgets:  # the budget curves beside it (pipeline/studies/budget_report.py)
        from layerprune.pipeline.studies.budget_report import write_budget_report

        drawn.append(write_budget_report(study, root))
    return drawn


def draw_report(study: SweepStudy, adds_arms: bool = False) -> Path:
    """The reports drawn from the stages complete so far, nothing run: each headed, while stages are left, by what is
    not run yet (their figures and verdicts are over what is scored, not the design's). `adds_arms`: the recipe adds
    arms to the run there (sweep.arms_added), which it then reports as not scored yet. Refused in one line where the
    folder holds no run of the recipe, or before its cut and the original's evaluation."""
    paths = RunPaths(study.run_dir())
    if not paths.state.is_file():
        raise LayerpruneError(f"{paths.root} holds no run of {study.name}: nothing to report (run the study first)")
    if not (adds_arms or owns(read_report(paths.state, RunState), study)):
        raise LayerpruneError(f"{paths.root} holds another recipe's run, not {study.name}'s: nothing drawn")
    with report_lock(paths.root):  # what has run, read under the lock: a stage drawing at once waits or went first
        grid = cells(study, paths.root)
        for cell in (next(c for c in grid if c.step in ("score", "prune", "plan")),
                     next(c for c in grid if c.step == "eval")):  # every figure reads the cut, against the original
            if not cell.output.exists():
                raise LayerpruneError(f"{paths.root}: nothing to report before its {cell.name} stage has run")
        left = [c.name for c in grid if c.step != "report" and not c.output.exists()]
        grid[-1].output.unlink(missing_ok=True)  # drawn over the stage's: it draws them again on the next resume
        drawn = draw(study, paths.root)
        if left:
            mark_partial(study.name, drawn, left, len(grid) - 1)
    return report_file(study, paths.root)


def mark_partial(name: str, drawn: list[Path], left: list[str], stages: int) -> None:
    """Head each report drawn from a run in progress with what is not run yet, and record it in its JSON."""
    partial = {"stages": stages, "complete": stages - len(left), "left": left}
    banner = (f"> **Drawn from a run in progress** (`layerprune study {name} --report`): {stages - len(left)} of "
              f"{stages} stages complete; not run yet: {in_brief(left)}. Every figure, verdict and family below is "
              "over the models scored so far, not the protocol's design: none is the study's result until its "
              "report stage draws it at the end.\n\n")
    for path in drawn:
        write_atomic(path, banner + path.read_text())
        record = path.with_suffix(".json")
        if record.is_file():
            write_atomic(record, json.dumps({**json.loads(record.read_text()), "partial": partial}, indent=1))


def unmark_if_left(study: SweepStudy, root: Path) -> None:
    """Forget that the reports were drawn from a finished run where stages are left (replicates or arms added
    since): the report stage then draws them again once they have run, even in a later part that runs nothing else."""
    grid = cells(study, root)
    if any(c.step != "report" and not c.output.exists() for c in grid):
        grid[-1].output.unlink(missing_ok=True)


def report_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """One drawing of a run folder's reports at a time, whoever draws them (a hidden lock file in the folder: no
    archive packs it)."""
    return file_lock(root / LOCK)
