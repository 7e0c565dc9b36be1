"""`layerprune study RECIPE`: the recovery study (prune once, recover with each arm at one budget, compare)."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.recipe_loading import build_schema
from layerprune.settings import RunSettings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Recovery-study recipe: a YAML path or a shipped name "
                                       "(layerprune recipes list --kind recovery-study)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="Study directory (default: the recipe's)")
    parser.add_argument("--overwrite", action="store_true", help="Start over in a directory holding other outputs")
    parser.add_argument("--dry-run", action="store_true", help="Validate the recipe, model, data and memory; no work")
    add_schema_flags(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.study import RecoveryStudy, dry_run, run_study

    study = RecoveryStudy.load(args.recipe, args.output)
    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    if args.dry_run:
        print(dry_run(study, settings))
        return 0
    print(f"study: {run_study(study, settings, args.overwrite)}")
    return 0
