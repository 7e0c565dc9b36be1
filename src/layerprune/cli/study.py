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
                             "for the embedded model only (the measured 2-core rates)")
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
    if args.max_hours is not None:
        check_max_hours(estimate_seconds, studies, settings, args.max_hours)
    if args.dry_run:
        print(selection.dry_run([dry_run(study, settings) for study in studies]))
        return 0
    for index, study in enumerate(studies, 1):
        if selection.grid:
            print(f"cell {index}/{len(studies)}: {study.name} -> {study.run_dir()}", flush=True)
        word = "sweep" if study.grains is None else "grain study"
        print(f"{word}: {run_sweep(study, settings, args.overwrite)}")
    return 0


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
