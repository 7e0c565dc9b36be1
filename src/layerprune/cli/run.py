"""`layerprune run RECIPE`: the whole pipeline from one recipe file."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_schema
from layerprune.core.settings import RunSettings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Run recipe: a YAML path or a shipped name (layerprune recipes list --kind run)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="Run directory (default: the recipe's, or runs/<name>)")
    parser.add_argument("--from", dest="from_stage", default=None, help="Re-run from this stage: prune, "
                        "eval-baseline, eval-pruned, recover, eval-recovered, export, report")
    parser.add_argument("--overwrite", action="store_true",
                        help="Start over in a run directory holding another recipe's outputs")
    parser.add_argument("--dry-run", action="store_true",
                        help="Validate recipes, model access, data and memory; do no work")
    parser.add_argument("--allow-overlap", action="store_true",
                        help="Evaluate even when evaluated documents are among the calibration items (recorded)")
    add_schema_flags(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.plan import dry_run, load_run_recipe
    from layerprune.pipeline.stages import run_pipeline

    recipe = load_run_recipe(args.recipe, args.output)
    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    if args.allow_overlap:
        recipe.evaluate.allow_overlap = True
    if args.dry_run:
        print(dry_run(recipe, settings))
        return 0
    report = run_pipeline(recipe, settings, args.from_stage, args.overwrite)
    print(f"report: {report}")
    return 0
