"""`layerprune check-serve DIR`: vLLM loads the model and continues the verification prompts as transformers does."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_schema
from layerprune.core.settings import RunSettings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="A pruned or recovered model directory")
    parser.add_argument("--json", action="store_true", help="Print the whole result as JSON")
    add_schema_flags(parser, RunSettings, group="how to run")


def run(args: argparse.Namespace) -> int:
    from layerprune.models.serving import check_serve

    result = check_serve(args.model, build_schema(RunSettings, typed_layer(args, RunSettings)))
    if args.json:
        print(json.dumps(result, indent=2))
    verdict = "passed" if result["passed"] else "FAILED"
    print(f"serving check {verdict}: {result['engine']} ({result['dtype']}) gives transformers' greedy continuation "
          f"on {result['equal']}/{result['of']} verification prompts; engine start {result['engine_start_s']} s")
    return 0 if result["passed"] else 1
