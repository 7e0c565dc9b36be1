"""`layerprune evaluate`: one model, or baseline / pruned / recovered with a comparison report."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import build_from_recipe, build_schema
from layerprune.core.settings import RunSettings
from layerprune.evaluate.schema import EvalSettings, parse_task_list

log = logging.getLogger(__name__)
DEFAULT_OUTPUT = Path("runs/evaluate")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="evaluate recipe: a shipped name (layerprune recipes list --kind evaluate) "
                        "or a YAML file of the evaluation fields below; flags override it")
    parser.add_argument("--model", default=None, help="model to evaluate: hub id, local dir, .gguf or embedded "
                        "(default: embedded SmolLM2-135M-Instruct); the recovered model when --pruned is given")
    parser.add_argument("--baseline", default=None, help="original model to compare against")
    parser.add_argument("--pruned", default=None, help="pruned model (then --model is the recovered one)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help=f"output directory (default: {DEFAULT_OUTPUT}/<model>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--list", action="store_true", help="list suites and tasks, then exit")
    add_schema_flags(parser, EvalSettings, group="evaluation")
    add_schema_flags(parser, RunSettings, skip=("max_shard_size",), group="execution")


def build_settings(args: argparse.Namespace) -> tuple[EvalSettings, RunSettings]:
    """Schema defaults < --recipe < explicit flags; and the run settings."""
    values = typed_layer(args, EvalSettings)
    if "tasks" in values:
        values["tasks"] = parse_task_list(values["tasks"])
    settings = build_from_recipe(EvalSettings, "evaluate", args.recipe, values)
    return settings, build_schema(RunSettings, typed_layer(args, RunSettings))


def model_roles(args: argparse.Namespace) -> dict[str, Any]:
    """role -> model spec: one model alone, or baseline / pruned / recovered."""
    if args.baseline is None and args.pruned is None:
        return {"model": args.model}
    roles = {"baseline": args.baseline} if args.baseline is not None else {}
    if args.pruned is not None:
        roles.update(pruned=args.pruned, recovered=args.model)
    else:
        roles["pruned"] = args.model
    return roles


def _default_output(roles: dict[str, Any]) -> Path:
    spec = roles.get("recovered", roles.get("pruned", roles.get("model"))) or "embedded"
    return DEFAULT_OUTPUT / Path(str(spec).rstrip("/")).name.replace(":", "-")


def run(args: argparse.Namespace) -> int:
    if args.list:
        from layerprune.evaluate.suites import describe_suites

        print(describe_suites())
        return 0
    from layerprune.evaluate.api import evaluate_models

    settings, run_settings = build_settings(args)
    if settings.reference_solutions and any(v is not None for v in (args.model, args.baseline, args.pruned)):
        raise LayerpruneError("--reference-solutions scores the dataset's own solutions; drop --model, --baseline "
                              "and --pruned")
    roles = model_roles(args)
    output = args.output or _default_output(roles)
    tables = evaluate_models(roles, settings, run_settings, output, args.overwrite)
    print(tables)
    print(f"\nresults in {output}")
    return 0
