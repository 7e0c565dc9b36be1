"""`layerprune variant-study RECIPE`: make a variant with our recovery code, compare importance profiles."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_schema
from layerprune.core.settings import RunSettings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Variant-study recipe: a YAML path or a shipped name "
                                       "(layerprune recipes list --kind variant-study)")
    parser.add_argument("-o", "--output", type=Path, default=None, help="Study directory (default: the recipe's)")
    parser.add_argument("--dry-run", action="store_true", help="Print the plan (variant recipe, prompts, budgets); "
                                                               "no weights, no work")
    add_schema_flags(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.pipeline.studies.variant import dry_run, run_variant_study
    from layerprune.pipeline.studies.variant_grid import load_variant_study

    study = load_variant_study(args.recipe, args.output)
    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    if args.dry_run:
        print(dry_run(study, settings))
        return 0
    report = run_variant_study(study, settings)
    print(report.read_text(encoding="utf-8"))
    return 0
