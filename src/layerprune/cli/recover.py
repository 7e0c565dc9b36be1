"""`layerprune recover` (alias `recover`): flags come from the recipe schema; CLI beats recipe beats defaults."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from layerprune.errors import LayerpruneError
from layerprune.schema_cli import flag_kwargs, add_schema_args, explicit_values, validation_message
from layerprune.settings import RunSettings

TOP_LEVEL = ("model", "teacher", "drop_blocks", "method")
# short flags for the section fields people change most (the long form --section-field always works)
ALIASES: dict[str, str] = {
    "prompts.samples": "--samples", "prompts.source": "--prompts", "generate.backend": "--backend",
    "generate.temperature": "--temperature", "generate.top_p": "--top-p", "generate.max_new_tokens": "--max-new-tokens",
    "generate.system_prompt": "--system-prompt", "generate.filter": "--filter", "train.learning_rate": "--learning-rate",
    "train.epochs": "--epochs", "train.max_steps": "--max-steps", "train.max_length": "--max-length",
    "train.held_out": "--held-out", "train.optimizer": "--optimizer",
}


def configure(parser: argparse.ArgumentParser) -> None:
    from layerprune.recover.schema import SECTIONS, RecoverRecipe

    parser.add_argument("--recipe", help="shipped recipe name (see `layerprune recipes list`) or a YAML file")
    parser.add_argument("-o", "--output", type=Path, help="output directory (default: MODEL-recovered)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--resume", action="store_true", help="continue training from the last checkpoint")
    parser.add_argument("--dry-run", action="store_true", help="print the memory plan and exit; load no weights")
    parser.add_argument("--memory-budget", type=float, default=80.0, help="GPU memory budget in GB (default: 80)")
    parser.add_argument("--data-dir", help="local data mirror (default: $LAYERPRUNE_DATA_DIR or ../shared/data)")
    recipe = parser.add_argument_group("recipe (override the recipe file)")
    add_schema_args(recipe, RecoverRecipe, skip=[n for n in RecoverRecipe.model_fields if n not in TOP_LEVEL])
    for section, schema in SECTIONS.items():
        add_section_args(parser.add_argument_group(f"recipe section '{section}'"), section, schema)
    add_schema_args(parser, RunSettings, group="run settings (how, not what)")


def add_section_args(group: Any, section: str, schema: type[BaseModel]) -> None:
    """`--section-field` for each field of a recipe section (dest 'section.field'), plus the short aliases."""
    for name, field in schema.model_fields.items():
        dest = f"{section}.{name}"
        flags = [f"--{section}-{name}".replace("_", "-")] + ([ALIASES[dest]] if dest in ALIASES else [])
        default = field.get_default(call_default_factory=True)
        help_text = (field.description or "") + (f" (default: {default})" if default is not None else "")
        kwargs = flag_kwargs(field.annotation)
        if "type" in kwargs:
            kwargs["metavar"] = name.upper()
        group.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"), **kwargs)


def cli_layer(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe fields typed on the command line, nested by section."""
    layer: dict[str, Any] = {k: v for k, v in vars(args).items() if k in TOP_LEVEL}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            layer.setdefault(section, {})[name] = value
    return layer


def build_recipe(args: argparse.Namespace) -> Any:
    """Schema defaults < recipe file < explicit CLI flags."""
    from layerprune.recipes_cli import load_recipe
    from layerprune.recover.schema import RecoverRecipe, merge_layers

    base, where = ({}, "command line") if not args.recipe else load_recipe(args.recipe, "recover")
    try:
        return RecoverRecipe.model_validate(merge_layers(base, cli_layer(args)))
    except ValidationError as exc:
        raise LayerpruneError(validation_message(exc, f"recover recipe ({where})")) from exc


def default_output(recipe: Any) -> Path:
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
    from layerprune.recover.runner import RecoverJob, distributed_state, dry_run, recover_model

    recipe = build_recipe(args)
    if getattr(args, "quiet", False):
        quiet_progress_bars()
    settings = RunSettings(**explicit_values(args, RunSettings))
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
