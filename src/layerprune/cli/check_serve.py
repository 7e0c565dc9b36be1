"""`layerprune check-serve DIR`: vLLM loads the model and answers the verification prompts as transformers does (top-1
at every position, up to near-ties, and the greedy continuations); only a "different" verdict fails."""

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
    print(f"serving check {verdict}: {result['engine']} ({result['dtype']}) reads {result['verdict']}: top-1 "
          f"{result['top1_agreement']} where transformers' top-2 margin is >= {result['near_tie_threshold']} "
          f"(near-ties below it: {result['near_ties']}), greedy continuation equal on {result['equal']}/{result['of']} "
          f"verification prompts, max |log-prob diff| {result['max_abs_logprob_diff']}; "
          f"engine start {result['engine_start_s']} s")
    return 0 if result["passed"] else 1
