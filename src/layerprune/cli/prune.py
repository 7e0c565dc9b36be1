"""`layerprune prune` / `prune`: a thin layer over `prune_model`."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_from_recipe, build_schema
from layerprune.core.settings import RunSettings
from layerprune.prune.recipe import PruneRecipe

if TYPE_CHECKING:
    from layerprune.prune.scores import Score


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="prune recipe: a shipped name (layerprune recipes list --kind prune) or a "
                        "YAML file of the fields below; flags override it")
    parser.add_argument("--model", default=None, help="Hub id, local directory, .gguf file, or embedded[:NAME] "
                        "(default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("-o", "--output", type=Path, default=None,
                        help="Output directory (default: runs/<model>-<score>-drop<N>)")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing output directory")
    parser.add_argument("--dry-run", action="store_true", help="Score and print the plan; write nothing (a directory "
                        "with only a config.json: print the block-major memory plan)")
    parser.add_argument("--json", action="store_true", help="Print the report as JSON at the end")
    add_schema_flags(parser, PruneRecipe, group="what to prune")
    for score in score_schemas():
        add_schema_flags(parser, score.params, group=f"score '{score.name}'")
    add_schema_flags(parser, RunSettings, group="how to run")


def score_schemas() -> list[Score]:
    """The registered scores that declare parameters of their own (each a flag group)."""
    from layerprune.prune.scores import SCORES

    return [score for score in map(SCORES.get, SCORES.names()) if score.params.model_fields]


def default_output(model: str | None, recipe: PruneRecipe) -> Path:
    name = re.sub(r"[^\w.-]+", "-", Path(model).name if model else "smollm2-135m-instruct").strip("-") or "model"
    grain = "" if recipe.granularity == "block" else f"-{recipe.granularity}"
    amount = f"drop{recipe.n_drop}" if recipe.target is None else re.sub(r"[^\w.-]+", "-", recipe.target)
    return Path("runs") / f"{name}-{recipe.method_name}{grain}-{amount}"


def build_recipe(args: argparse.Namespace) -> PruneRecipe:
    """Schema defaults < --recipe < explicit flags."""
    typed = typed_layer(args, PruneRecipe)
    for score in score_schemas():
        typed.update(typed_layer(args, score.params))
    return build_from_recipe(PruneRecipe, "prune", args.recipe, typed)


def run(args: argparse.Namespace) -> int:
    from layerprune.prune.api import prune_model

    recipe = build_recipe(args)
    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    output = args.output or default_output(args.model, recipe)
    result = prune_model(args.model, recipe, settings, output, overwrite=args.overwrite, dry_run=args.dry_run)
    print_summary(result.report, result.output)
    if args.json:
        print(json.dumps(result.report, indent=2, default=str))
    return 0


def print_summary(report: dict, output: Path | None) -> None:
    if report.get("plan_only"):  # --dry-run on a config without weights
        print("\n".join(report["plan_lines"]))
        return
    if report.get("removed_sublayers") is not None:
        print_sublayer_plan(report)
        print_target(report)
        print(f"output: {output}" if output else "dry run: nothing written")
        return
    scores = report["scores"]
    if any(s is not None for s in scores):
        print("block scores (higher = more important):")
        print("  " + "  ".join(f"{i}:{'-' if s is None else f'{s:.4g}'}" for i, s in enumerate(scores)))
    print(f"blocks {report['num_blocks_before']} -> {report['num_blocks_after']}, "
          f"parameters {report['params_before'] / 1e6:.1f}M -> {report['params_after'] / 1e6:.1f}M")
    print(f"dropped blocks (original numbering): {report['dropped']}")
    print_target(report)
    check = report.get("verification") or {}
    if output and check.get("checked") is True:
        print(f"verified: the reloaded model gives the skipped original's logits (max |diff| "
              f"{check['max_abs_diff']:.3g}, {check['seconds']}s); saved in {report['dtype']['saved']}")
    elif output and check.get("checked") == "meta":  # streamed save with --no-verify: tensors checked, no logits
        print(f"written tensors checked against the new config; logits not compared (--no-verify); saved in "
              f"{report['dtype']['saved']}")
    elif output:
        print(f"not verified (--no-verify); saved in {report['dtype']['saved']}")
    print(f"output: {output}" if output else "dry run: nothing written")


def print_target(report: dict) -> None:
    """The --target plan: predicted values before -> after, and the measured speedup."""
    if report.get("target"):
        from layerprune.prune.report import TargetRecord
        from layerprune.prune.target import plan_lines

        print("\n".join(plan_lines(TargetRecord.model_validate(report["target"]))))


def print_sublayer_plan(report: dict) -> None:
    """Scores per sublayer, the ones removed, parameters before/after and the KV cache kept."""
    scores = report["sublayer_scores"]
    if any(s is not None for s in scores.values()):
        print("sublayer scores (higher = more important):")
        print("  " + "  ".join(f"{name}:{'-' if s is None else f'{s:.4g}'}" for name, s in scores.items()))
    removed, depth = report["removed_sublayers"], report["num_blocks_before"]
    attention = depth - sum(name.endswith(".attn") for name in removed)
    print(f"removed sublayers (original numbering): {', '.join(removed)}")
    if report["dropped"]:
        print(f"blocks with both sublayers removed (dropped whole): {report['dropped']}")
    print(f"blocks {depth} -> {report['num_blocks_after']}, parameters {report['params_before'] / 1e6:.1f}M -> "
          f"{report['params_after'] / 1e6:.1f}M ({(report['params_before'] - report['params_after']) / 1e6:.2f}M "
          f"removed)")
    print(f"KV cache kept: {attention}/{depth} attention sublayers ({report['kv_cache_kept']:.3g}x)")
