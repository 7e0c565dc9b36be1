"""`layerprune analyze importance|nmi|degeneration|sweeps`: thin CLI over the analyze_* functions."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from layerprune.analyze.schemas import DegenerationAnalysis, ImportanceAnalysis, NmiAnalysis, SweepsAnalysis
from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.cli.recipe_kinds import RECIPE_SCHEMAS
from layerprune.core.recipe_loading import build_from_recipe, build_schema
from layerprune.core.settings import RunSettings

SUBCOMMANDS: dict[str, tuple[type[BaseModel], str]] = {
    "importance": (ImportanceAnalysis, "per-block ablation drops across models and tasks (heatmap, rank "
                                       "correlation, critical-set overlap)"),
    "nmi": (NmiAnalysis, "representation drift: NMI of each block's token clusters vs the embedding layer's"),
    "degeneration": (DegenerationAnalysis, "rep-n, self-BLEU-4 and length of generations (files or generated)"),
    "sweeps": (SweepsAnalysis, "sweeps of one model and cut that recovered differently (generic against "
                               "task-aligned data), their arms compared paired"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the analysis subcommands."""
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    for name, (schema, summary) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        command.add_argument("--recipe", default=None,
                             help="YAML file (or shipped name) with these fields; flags override it")
        add_schema_flags(command, schema, aliases={"output": ["-o"]})
        add_schema_flags(command, RunSettings, skip=("max_shard_size",), group="run settings")


def build_config(args: argparse.Namespace) -> tuple[Any, RunSettings]:
    """Schema defaults < --recipe < explicit flags; and the run settings."""
    schema, _ = SUBCOMMANDS[args.analysis]
    kind = args.analysis if args.analysis in RECIPE_SCHEMAS else None
    config = build_from_recipe(schema, kind, args.recipe, typed_layer(args, schema))
    return config, build_schema(RunSettings, typed_layer(args, RunSettings))


def analysis_function(name: str) -> Callable[[Any, RunSettings, Path], dict[str, Any]]:
    if name == "importance":
        from layerprune.analyze.importance import analyze_importance

        return analyze_importance
    if name == "nmi":
        from layerprune.analyze.nmi import analyze_nmi

        return analyze_nmi
    if name == "sweeps":
        from layerprune.pipeline.studies.sweep_join import analyze_sweeps

        return analyze_sweeps
    from layerprune.analyze.degeneration import analyze_degeneration

    return analyze_degeneration


ANALYSIS_INPUTS = ("models", "generations", "runs", "critical_from")  # what an analysis reads: never its output


def run(args: argparse.Namespace) -> int:
    """Validate, refuse an existing output, compute into a temporary directory, then move it in place."""
    from layerprune.core.outputs import atomic_output_dir, check_output_dir, input_paths

    config, settings = build_config(args)
    if getattr(config, "dry_run", False):
        from layerprune.analyze.plan import dry_run_text

        print(dry_run_text(config, settings), end="")
        return 0
    out = config.output or Path("analysis") / args.analysis
    check_output_dir(out, config.overwrite, input_paths(*(getattr(config, name, None) for name in ANALYSIS_INPUTS)))
    start = time.perf_counter()
    with atomic_output_dir(out, config.overwrite) as tmp:
        analysis_function(args.analysis)(config, settings, tmp)
        files = sorted(p.name for p in tmp.iterdir())
    print(f"wrote {out}/ ({', '.join(files)}) in {time.perf_counter() - start:.1f} s")
    print((out / "summary.md").read_text(encoding="utf-8"))
    return 0
