"""`layerprune recover` (alias `recover`): flags come from the recipe schema; CLI beats recipe beats defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.recipe_loading import build_from_recipe, build_schema
from layerprune.core.settings import RunSettings
from layerprune.recover.schema import RecoverRecipe

RECIPE_ONLY = ("name", "description")  # the recipe's own label: no flag
# short flags for the section fields people change most (the long form --section-field always works)
ALIASES: dict[str, list[str]] = {
    "prompts.samples": ["--samples"], "prompts.source": ["--prompts"], "generate.backend": ["--backend"],
    "generate.temperature": ["--temperature"], "generate.top_p": ["--top-p"],
    "generate.max_new_tokens": ["--max-new-tokens"], "generate.system_prompt": ["--system-prompt"],
    "generate.filter": ["--filter"], "train.learning_rate": ["--learning-rate"], "train.epochs": ["--epochs"],
    "train.max_steps": ["--max-steps"], "train.max_length": ["--max-length"], "train.held_out": ["--held-out"],
    "train.optimizer": ["--optimizer"],
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="shipped recipe name (see `layerprune recipes list`) or a YAML file")
    parser.add_argument("-o", "--output", type=Path, help="output directory (default: MODEL-recovered)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--resume", action="store_true", help="continue training from the last checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the memory plan and exit; load no weights")
    parser.add_argument("--memory-budget", type=float, default=80.0, help="GPU memory budget in GB (default: 80)")
    parser.add_argument("--data-dir", help="local data mirror (default: $LAYERPRUNE_DATA_DIR or ../shared/data)")
    add_schema_flags(parser, RecoverRecipe, skip=RECIPE_ONLY, aliases=ALIASES,
                     group="recipe (override the recipe file)")
    add_schema_flags(parser, RunSettings, group="run settings (how, not what)")


def build_recipe(args: argparse.Namespace) -> RecoverRecipe:
    """Schema defaults < recipe file < explicit CLI flags."""
    return build_from_recipe(RecoverRecipe, "recover", args.recipe, typed_layer(args, RecoverRecipe))


def default_output(recipe: RecoverRecipe) -> Path:
    model = Path(recipe.model) if recipe.model else None
    if model is not None and model.is_dir():
        return model.parent / f"{model.name}-recovered"
    return Path("runs") / f"recover-{recipe.name}"


def quiet_progress_bars() -> None:
    """-q: no transformers/datasets progress bars either."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def run(args: argparse.Namespace) -> int:
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.runner import distributed_state, dry_run, recover_model

    recipe = build_recipe(args)
    if getattr(args, "quiet", False):
        quiet_progress_bars()
    settings = build_schema(RunSettings, typed_layer(args, RunSettings))
    job = RecoverJob(output=args.output or default_output(recipe), settings=settings, overwrite=args.overwrite,
                     resume=args.resume, data_dir=args.data_dir, memory_budget=args.memory_budget)
    if args.dry_run:
        dry_run(recipe, job)
        return 0
    report = recover_model(recipe, job)
    if not distributed_state(settings).is_main_process:
        return 0
    loss = report.held_out_loss
    print(f"recovered model: {job.output}  held-out loss {loss.before} -> {loss.after}  ({report.seconds.total:.0f} s)")
    return 0
