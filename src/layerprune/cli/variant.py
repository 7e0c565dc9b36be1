"""`layerprune variant RECIPE`: post-train a model into a variant (sft, rft, grpo, distill), cached by recipe."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_from_recipe, build_schema
from layerprune.core.settings import RunSettings
from layerprune.posttrain.schema import VariantRecipe

ALIASES: dict[str, list[str]] = {"train.learning_rate": ["--learning-rate"], "train.max_steps": ["--max-steps"],
                                 "train.epochs": ["--epochs"], "sample.k": ["--k"],
                                 "sample.temperature": ["--temperature"]}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="Variant recipe: a YAML path or a shipped name (layerprune recipes list "
                                       "--kind variant)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="Checkpoint directory (default: the cache's variants/NAME-FINGERPRINT)")
    parser.add_argument("--dry-run", action="store_true", help="Print the data, steps, tokens and a CPU time "
                                                               "estimate; load no weights, train nothing")
    parser.add_argument("--data-dir", help="local data mirror (default: $LAYERPRUNE_DATA_DIR or ../shared/data)")
    add_schema_flags(parser, VariantRecipe, aliases=ALIASES, group="recipe (override the recipe file)")
    add_schema_flags(parser, RunSettings, group="run settings (how, not what)")


def run(args: argparse.Namespace) -> int:
    from layerprune.posttrain import dry_run, make_variant

    recipe = build_from_recipe(VariantRecipe, "variant", args.recipe, typed_layer(args, VariantRecipe))
    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    data_dir = Path(args.data_dir) if args.data_dir else None
    if args.dry_run:
        print(dry_run(recipe, settings, data_dir))
        return 0
    print(make_variant(recipe, settings, args.output, data_dir))
    return 0
