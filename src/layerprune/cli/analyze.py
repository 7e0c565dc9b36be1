"""`layerprune analyze importance|nmi|degeneration`: thin CLI over the analyze_* functions."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from layerprune.analyze.schemas import DegenerationAnalysis, ImportanceAnalysis, NmiAnalysis
from layerprune.schema_cli import add_schema_args, build_schema, explicit_values
from layerprune.settings import RunSettings

SUBCOMMANDS: dict[str, tuple[type[BaseModel], str, tuple[str, ...]]] = {
    "importance": (ImportanceAnalysis, "per-block ablation drops across models and tasks (heatmap, rank "
                                       "correlation, critical-set overlap)", ("models", "tasks", "tokenizers")),
    "nmi": (NmiAnalysis, "representation drift: NMI of each block's token clusters vs the embedding layer's", ()),
    "degeneration": (DegenerationAnalysis, "rep-n, self-BLEU-4 and length of generations (files or generated)",
                     ("generations", "models", "labels")),
}


RECIPE_ONLY = ("per_model",)  # nested settings: a recipe's business, no flag


def add_list_flag(parser: argparse.ArgumentParser, schema: type[BaseModel], name: str) -> None:
    """A list flag taking space- and/or comma-separated values, help text from the field."""
    field = schema.model_fields[name]
    parser.add_argument("--" + name.replace("_", "-"), dest=name, nargs="+", default=argparse.SUPPRESS,
                        metavar=name.upper().rstrip("S"), help=(field.description or "").replace("%", "%%"))


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the three analysis subcommands."""
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    for name, (schema, summary, list_flags) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        command.add_argument("--recipe", default=None,
                             help="YAML file (or shipped name) with these fields; flags override it")
        add_schema_args(command, schema, skip=(*list_flags, *RECIPE_ONLY))
        for flag in list_flags:
            add_list_flag(command, schema, flag)
        add_schema_args(command, RunSettings, skip=("max_shard_size",), group="run settings")


def flatten(values: list[str]) -> list[str]:
    """['a,b', 'c'] -> ['a', 'b', 'c']."""
    return [part.strip() for value in values for part in str(value).split(",") if part.strip()]


def build_config(args: argparse.Namespace) -> tuple[Any, RunSettings]:
    schema, _, list_flags = SUBCOMMANDS[args.analysis]
    values = explicit_values(args, schema)
    for flag in list_flags:
        if flag in values:
            values[flag] = flatten(values[flag])
    base: dict[str, Any] = {}
    if getattr(args, "recipe", None):
        from layerprune.recipes_cli import RECIPE_KINDS, find_recipe, read_recipe_dict

        _, path = find_recipe(args.recipe, args.analysis if args.analysis in RECIPE_KINDS else None)
        base = read_recipe_dict(path)
    return build_schema(schema, base, values), build_schema(RunSettings, explicit_values(args, RunSettings))


def analysis_function(name: str) -> Callable[[Any, RunSettings, Path], dict[str, Any]]:
    if name == "importance":
        from layerprune.analyze.importance import analyze_importance

        return analyze_importance
    if name == "nmi":
        from layerprune.analyze.nmi import analyze_nmi

        return analyze_nmi
    from layerprune.analyze.degeneration import analyze_degeneration

    return analyze_degeneration


def run(args: argparse.Namespace) -> int:
    """Validate, refuse an existing output, compute into a temporary directory, then move it in place."""
    from layerprune.outputs import atomic_output_dir, check_output_dir

    config, settings = build_config(args)
    if getattr(config, "dry_run", False):
        from layerprune.analyze.plan import dry_run_text

        print(dry_run_text(config, settings), end="")
        return 0
    out = config.output or Path("analysis") / args.analysis
    check_output_dir(out, config.overwrite)
    start = time.perf_counter()
    with atomic_output_dir(out, config.overwrite) as tmp:
        analysis_function(args.analysis)(config, settings, tmp)
        files = sorted(p.name for p in tmp.iterdir())
    print(f"wrote {out}/ ({', '.join(files)}) in {time.perf_counter() - start:.1f} s")
    print((out / "summary.md").read_text(encoding="utf-8"))
    return 0
