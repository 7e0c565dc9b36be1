"""`layerprune study RECIPE`: the recovery study (prune once, recover with each arm at one budget, compare), the
pruning-ratio sweep (one ranking cut at several k, each recovered the same way), or the grain study (blocks, attention
or MLP sublayers removed at matched savings, before and after one recovery)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_from_recipe, build_schema
from layerprune.core.settings import RunSettings
from layerprune.pipeline.studies.recovery_grid import RecoveryStudy


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Recovery-study or sweep recipe: a YAML path or a shipped name "
                                       "(layerprune recipes list --kind recovery-study | sweep-study | grain-study)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="Study directory (default: the recipe's)")
    parser.add_argument("--overwrite", action="store_true", help="Start over in a directory holding other outputs")
    parser.add_argument("--dry-run", action="store_true", help="Validate the recipe, model, data and memory; no work")
    parser.add_argument("--replicates", type=int, default=None, metavar="N",
                        help=RecoveryStudy.model_fields["replicates"].description
                        + " (beats the recipe's)")
    add_schema_flags(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.studies import recovery, sweep, sweep_plan

    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    if is_sweep(args.recipe):
        ratios = sweep.SweepStudy.load(args.recipe, args.output)
        if args.replicates is not None:  # defaults < recipe < flags
            ratios = sweep.SweepStudy.model_validate({**ratios.model_dump(), "replicates": args.replicates})
        if args.dry_run:
            print(sweep_plan.dry_run(ratios, settings))
        else:
            print(f"sweep: {sweep.run_sweep(ratios, settings, args.overwrite)}")
        return 0
    if is_grain(args.recipe):
        return run_grain(args, settings)
    top = {key: value for key, value in (("output", args.output and str(args.output)),
                                         ("replicates", args.replicates)) if value is not None}
    study = build_from_recipe(RecoveryStudy, RecoveryStudy.kind, args.recipe, top)  # defaults < recipe < flags
    if args.dry_run:
        print(recovery.dry_run(study, settings))
    else:
        print(f"study: {recovery.run_study(study, settings, args.overwrite)}")
    return 0


def run_grain(args: argparse.Namespace, settings: RunSettings) -> int:
    """The grain study: defaults < recipe < flags (--output, --replicates)."""
    from layerprune.pipeline.studies import grain

    top = {key: value for key, value in (("output", args.output and str(args.output)),
                                         ("replicates", args.replicates)) if value is not None}
    study = build_from_recipe(grain.GrainStudy, grain.GrainStudy.kind, args.recipe, top)
    if args.dry_run:
        print(grain.dry_run(study, settings))
    else:
        print(f"grain study: {grain.run_study(study, settings, args.overwrite)}")
    return 0


def is_grain(recipe: str) -> bool:
    """A grain study: a recipe of kind grain-study, or a file that says no kind and has `grains` or `levels`."""
    from layerprune.core.recipe_loading import find_recipe, load_recipe

    kind, _ = find_recipe(recipe)
    return kind == "grain-study" or (kind is None and bool({"grains", "levels"} & set(load_recipe(recipe, None)[0])))


def is_sweep(recipe: str) -> bool:
    """A pruning-ratio sweep (a recipe of kind sweep-study, or a file that says no kind and has `ratios`), else a
    recovery study."""
    from layerprune.core.recipe_loading import find_recipe, load_recipe

    kind, _ = find_recipe(recipe)
    return kind == "sweep-study" or (kind is None and "ratios" in load_recipe(recipe, None)[0])
