"""`layerprune study RECIPE`: the one study engine, a pruning-ratio sweep (one ranking cut at several k, each
recovered the same way by every arm; one k, `ratios: [N]`, is a recovery study: one cut recovered with several methods
at one budget; with `grains`, the grain study: blocks, attention or MLP sublayers removed at matched savings, before
and after one recovery). A grid's
name runs its cells in turn; `--model X` runs the protocol on the user's model."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.cli.run import add_model_flags, cell_output
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import build_schema
from layerprune.core.settings import RunSettings
from layerprune.pipeline.studies.sweep_grid import SweepStudy


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Study recipe: a YAML path or a shipped name "
                                       "(layerprune recipes list --kind sweep-study); "
                                       "a grid's name runs each of its cells")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="Study directory (default: the recipe's); for a grid, the folder of one per cell")
    parser.add_argument("--overwrite", action="store_true", help="Start over in a directory holding other outputs")
    parser.add_argument("--dry-run", action="store_true", help="Validate the recipe, model, data and memory; no work "
                                                               "(a grid: list its cells)")
    parser.add_argument("--replicates", type=int, default=None, metavar="N",
                        help=SweepStudy.model_fields["replicates"].description
                        + " (beats the recipe's)")
    parser.add_argument("--max-hours", type=positive_hours, default=None, metavar="H",
                        help="Refuse, before any stage runs (and in a dry run), a study or grid whose dry-run time "
                             "estimate (every stage, complete ones included) is over H hours; the estimate exists "
                             "for the embedded model only (the measured 2-core rates) and, once an arm's learning-"
                             "rate search has run, takes its measured answer lengths: it can change on resume")
    parser.add_argument("--save-progress", type=Path, default=None, metavar="FILE.tar.gz",
                        help="Pack the study's progress, no weights and no document text, into FILE (replaced if "
                             "there) and run nothing: every finished stage, less the folders a pending stage reads, "
                             "to resume on another machine with --from-progress")
    parser.add_argument("--report", action="store_true",
                        help="Draw the report (sweep.md; with budgets budget.md too; with grains grain.md) from the "
                             "stages complete so far and run nothing: a run in parts read before its end says what "
                             "is not scored yet (after --from-progress: the archive's report)")
    parser.add_argument("--from-progress", type=Path, default=None, metavar="FILE.tar.gz",
                        help="Restore a --save-progress archive into the study's new directory, then resume: no "
                             "finished stage runs again")
    add_model_flags(parser)
    add_schema_flags(parser, RunSettings, group="how to run")


def positive_hours(text: str) -> float:
    """--max-hours: a number of hours above 0."""
    try:
        hours = float(text)
    except ValueError:
        hours = float("nan")
    if not hours > 0:
        raise argparse.ArgumentTypeError(f"expected a number of hours above 0, not {text!r}")
    return hours


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.recipe_cells import select_cells
    from layerprune.pipeline.studies.sweep import run_sweep
    from layerprune.pipeline.studies.sweep_plan import dry_run, estimate_seconds

    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    selection = select_cells(args.recipe, SweepStudy.kind, settings, args.model, args.drop, args.cell)
    replicates = {} if args.replicates is None else {"replicates": args.replicates}  # defaults < recipe < flags
    studies = [selection.build(SweepStudy, cell, cell_output(args, selection.grid, cell.name), replicates)
               for cell in selection.cells]  # every cell valid before any runs
    if args.report and (args.dry_run or args.save_progress is not None or args.max_hours is not None):
        raise LayerpruneError("--report draws the report of what has run and runs nothing: not with --dry-run, "
                              "--save-progress or --max-hours")
    if args.max_hours is not None:
        check_max_hours(estimate_seconds, studies, settings, args.max_hours)
    if args.save_progress is not None or args.from_progress is not None:
        if len(studies) > 1:
            raise LayerpruneError("--save-progress and --from-progress take one study, not a grid: name its cell")
        if args.save_progress is not None:
            return save_progress(studies[0], args.save_progress)
        restore(studies[0], args.from_progress, args.dry_run)
    if args.report:
        return report(studies)
    if args.dry_run:
        print(selection.dry_run([dry_run(study, settings) for study in studies]))
        return 0
    for index, study in enumerate(studies, 1):
        if selection.grid:
            print(f"cell {index}/{len(studies)}: {study.name} -> {study.run_dir()}", flush=True)
        word = "sweep" if study.grains is None else "grain study"
        print(f"{word}: {run_sweep(study, settings, args.overwrite)}")
    return 0


def report(studies: list[SweepStudy]) -> int:
    """--report: each study's report drawn from its stages complete so far; a grid's cells without a run of their
    own said and passed over (refused, one line, where no cell has one)."""
    from layerprune.pipeline.stages import RunPaths
    from layerprune.pipeline.studies.study_reports import draw_report
    from layerprune.pipeline.studies.sweep import arms_added

    drawn, passed = 0, []
    for study in studies:
        try:
            path = draw_report(study, adds_arms=arms_added(study, RunPaths(study.run_dir())) is not None)
        except LayerpruneError as exc:
            if len(studies) == 1:
                raise
            passed.append(f"{study.name}: {exc}")
            continue
        drawn += 1
        print(f"report of {study.name} (the stages complete so far): {path}")
    for line in passed:
        print(f"no report of {line}")
    if not drawn:
        raise LayerpruneError(f"no cell of the grid has a report to draw ({passed[0]})")
    return 0


def save_progress(study: SweepStudy, archive: Path) -> int:
    from layerprune.pipeline.studies.progress import pack_progress

    record = pack_progress(study, study.run_dir(), archive, overwrite=True)
    print(f"progress of {study.name}: {len(record['complete'])} stages complete, {record['files']} files, "
          f"{archive.stat().st_size / 2**20:.1f} MiB -> {archive} (resume: layerprune study {study.name} "
          f"--from-progress {archive})")
    return 0


def restore(study: SweepStudy, archive: Path, dry_run: bool) -> None:
    """The archive's progress unpacked into the study's directory (in a dry run, only checked to be one)."""
    from layerprune.pipeline.studies.progress import MANIFEST, read_archive_manifest, restore_progress

    if dry_run:
        record = read_archive_manifest(archive)
        print(f"{archive}: progress of {record.get('study')}, {len(record.get('complete') or [])} stages complete "
              f"(a dry run restores nothing; {MANIFEST})")
        return
    names = restore_progress(study, archive, study.run_dir())
    print(f"restored {len(names)} files of {study.name}'s progress into {study.run_dir()}" if names else
          f"{study.run_dir()} holds {study.name}'s run already: resuming it as it stands ({archive} not unpacked)",
          flush=True)


def check_max_hours(estimate: Callable[[Any, RunSettings], float | None], studies: list[Any], settings: RunSettings,
                    hours: float) -> None:
    """Refuse (LayerpruneError, one line) studies whose summed dry-run estimate (`estimate`: seconds, None without
    measured rates) is over `hours`, or that have none."""
    from layerprune.core.errors import LayerpruneError

    seconds = [estimate(study, settings) for study in studies]
    if None in seconds:
        unknown = next(s.name for s, t in zip(studies, seconds, strict=True) if t is None)
        raise LayerpruneError(f"--max-hours: {unknown} has no time estimate (the rates were measured for the embedded "
                              "model on 2 CPU cores); run without --max-hours")
    total = sum(t for t in seconds if t is not None) / 3600
    if total > hours:
        cells = f" over {len(studies)} cells" if len(studies) > 1 else ""
        raise LayerpruneError(f"{studies[0].name if len(studies) == 1 else 'the grid'}: the estimate is about "
                              f"{total:.1f} h{cells}, over --max-hours {hours:g}: cut items, replicates, arms or "
                              "budgets (or raise --max-hours); nothing ran")
