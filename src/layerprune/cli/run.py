"""`layerprune run RECIPE`: the whole pipeline from one recipe file; a grid's name runs its cells in turn."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_schema
from layerprune.core.settings import RunSettings
from layerprune.pipeline.recipe import PipelineRecipe
from layerprune.prune.recipe import PruneRecipe


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Run recipe: a YAML path or a shipped name (layerprune recipes list --kind "
                                       "run); a grid's name runs each of its cells")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="Run directory (default: the recipe's, or runs/<name>); for a grid, the folder of one "
                             "run directory per cell (<output>/<cell>)")
    parser.add_argument("--from", dest="from_stage", default=None, help="Re-run from this stage: prune, "
                        "eval-baseline, eval-pruned, recover, eval-recovered, export, report")
    parser.add_argument("--overwrite", action="store_true",
                        help="Start over in a run directory holding another recipe's outputs")
    parser.add_argument("--dry-run", action="store_true",
                        help="Validate recipes, model access, data and memory; do no work (a grid: list its cells)")
    parser.add_argument("--allow-overlap", action="store_true",
                        help="Evaluate even when evaluated documents are among the calibration items (recorded)")
    add_model_flags(parser)
    add_schema_flags(parser, RunSettings, group="how to run")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model, --drop and --cell: a shipped protocol on the user's model, some cells of a grid."""
    parser.add_argument("--model", default=None, metavar="MODEL",
                        help=f"{PipelineRecipe.model_fields['model'].description}, or variant:NAME: run the recipe's "
                             "protocol on it (a grid's model axis collapses to it; the run directory gets its name "
                             "appended unless -o is given)")
    parser.add_argument("--drop", type=int, default=None, metavar="N",
                        help=f"With --model: {PruneRecipe.model_fields['drop'].description} (default: the recipe's "
                             "count, or the share of the blocks its grid removes from each model)")
    parser.add_argument("--cell", nargs="+", default=(), metavar="NAME",
                        help="Of a grid: run only these cells (names as `--dry-run` lists them)")


def cell_output(args: argparse.Namespace, grid: str | None, cell: str) -> dict[str, str]:
    """-o as a layer: the run directory, or a grid's folder holding one per cell."""
    if args.output is None:
        return {}
    return {"output": str(args.output / cell if grid else args.output)}


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.plan import dry_run
    from layerprune.pipeline.recipe import RunRecipe
    from layerprune.pipeline.recipe_cells import select_cells
    from layerprune.pipeline.stages import check_run_target, run_pipeline

    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    selection = select_cells(args.recipe, RunRecipe.kind, settings, args.model, args.drop, args.cell)
    recipes = [selection.build(RunRecipe, cell, cell_output(args, selection.grid, cell.name))
               for cell in selection.cells]  # every cell valid before any runs
    for recipe in recipes:
        recipe.evaluate.allow_overlap = recipe.evaluate.allow_overlap or args.allow_overlap
        check_run_target(recipe, args.from_stage)
    if args.dry_run:
        plans = [dry_run(recipe, settings) for recipe in recipes]
        print(selection.dry_run(plans))
        return 0
    for index, recipe in enumerate(recipes, 1):
        if selection.grid:
            print(f"cell {index}/{len(recipes)}: {recipe.name} -> {recipe.run_dir()}", flush=True)
        report = run_pipeline(recipe, settings, args.from_stage, args.overwrite)
        print(f"report: {report}")
    return 0

