"""`layerprune study RECIPE`: the recovery study (prune once, recover with each arm at one budget, compare)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.settings import RunSettings


def configure(parser: argparse.ArgumentParser) -> None:
    from layerprune.schema_cli import add_schema_args

    parser.add_argument("recipe", help="Recovery-study recipe: a YAML path or a shipped name "
                                       "(layerprune recipes list --kind recovery-study)")
    parser.add_argument("--output", type=Path, default=None, help="Study directory (default: the recipe's)")
    parser.add_argument("--overwrite", action="store_true", help="Start over in a directory holding other outputs")
    parser.add_argument("--dry-run", action="store_true", help="Validate the recipe, model, data and memory; no work")
    add_schema_args(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.study import dry_run, load_study, run_study
    from layerprune.schema_cli import build_schema, explicit_values

    study = load_study(args.recipe, args.output)
    settings = build_schema(RunSettings, explicit_values(args, RunSettings))
    if args.dry_run:
        print(dry_run(study, settings))
        return 0
    print(f"study: {run_study(study, settings, args.overwrite)}")
    return 0
