"""Load a run recipe and dry-run it: recipes, model access, data presence and memory, without work."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from layerprune.core.errors import one_line
from layerprune.core.settings import RunSettings
from layerprune.pipeline.recipe import PipelineRecipe, RunRecipe
from layerprune.tasks.data import local_split, resolve_data_dir

# Public config values of the study models, used by --dry-run's memory plan only when the hub is unreachable.
KNOWN_SHAPES: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "Qwen/Qwen2.5-7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "mistralai/Mistral-7B-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      vocab_size=32768),
}


def load_run_recipe(name_or_path: str | Path, output: Path | None = None) -> RunRecipe:
    """Read and validate a run recipe (a shipped name or a YAML path); `output` replaces its run directory."""
    return RunRecipe.load(name_or_path, output)


def dry_run(recipe: RunRecipe, settings: RunSettings) -> str:
    """A plan of the run; problems that would stop it are errors, unknowns are said."""
    lines = [f"run '{recipe.name}' -> {recipe.run_dir()}", "recipe: valid (prune, evaluate"
             + (f", recover '{recipe.recover.recipe}')" if recipe.recover else ")")]
    lines.append(f"model: {check_model(recipe.model, settings)}")
    lines += [f"data: {line}" for line in check_data(recipe)]
    if recipe.recover is not None:
        lines.append(memory_plan(recipe, settings))
    return "\n".join(lines)


def check_model(spec: str | None, settings: RunSettings) -> str:
    from layerprune.models import resolve_model

    source = resolve_model(spec, settings)
    if source.kind != "hub":
        return f"{source.spec} ({source.kind}, {source.location})"
    try:
        from huggingface_hub import model_info

        info = model_info(source.location, timeout=10)
        return f"{source.spec} (hub, revision {info.sha})"
    except Exception as exc:  # offline, gated, or missing: say so, it is not an error of the recipe
        return f"{source.spec} (hub; not checked from here: {type(exc).__name__})"


def check_data(recipe: PipelineRecipe) -> list[str]:
    from layerprune.evaluate.suites import plan_tasks

    data_dir = resolve_data_dir(recipe.evaluate.data_dir or recipe.prune.data_dir)
    lines = [f"mirror {data_dir or 'none (hub)'}"]
    for name in recipe.prune.calib.split("+") if recipe.prune.needs_calibration else []:
        if name in ("gsm8k", "auto"):
            where = local_split(data_dir, "gsm8k", "train")
            lines.append(f"calibration {name}: {where or 'hub openai/gsm8k (train)'}")
    planned, skipped = plan_tasks(recipe.evaluate, data_dir)
    lines.append(f"evaluation: {len(planned)} tasks ({', '.join(t.spec.name for t in planned)})")
    lines += [f"evaluation skips {task}: {why}" for task, why in skipped.items()]
    return lines


def validate_data(recipe: PipelineRecipe, settings: RunSettings, prune_pending: bool = True) -> None:
    """Every data file the run reads, checked before any stage starts: the evaluation plan's files (empty files,
    bad JSONL lines, few-shot pools) and, while the prune stage is still to run, its calibration items."""
    from layerprune.evaluate.suites import plan_tasks

    plan_tasks(recipe.evaluate, resolve_data_dir(recipe.evaluate.data_dir))
    if prune_pending:
        from layerprune.prune.api import read_calibration

        read_calibration(recipe.prune, settings)


def memory_plan(recipe: RunRecipe, settings: RunSettings) -> str:
    """Recover's memory estimate for the pruned model on one GPU."""
    from layerprune.models import resolve_model
    from layerprune.recover import memory
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.methods import plan_for
    from layerprune.recover.runner import dry_run_length

    assert recipe.recover is not None
    config, note = model_config(recipe.model, settings)
    if config is None:
        return f"memory: not estimated ({note})"
    teacher_config = copy.deepcopy(config)
    config.num_hidden_layers -= recipe.prune.n_drop
    recover_recipe = recipe.recover.resolve("<pruned>", recipe.model)
    job = RecoverJob(output=recipe.run_dir() / "recovered", settings=settings,
                     data_dir=recipe.evaluate.data_dir or recipe.prune.data_dir)
    seq_len, how = dry_run_length(recover_recipe, resolve_model(recipe.model, settings), job)
    _, plan = plan_for(recover_recipe, config, job, cuda=True, seq_len=seq_len, teacher_config=teacher_config)
    plan.notes.insert(0, how)
    return memory.format_plan(plan, f"{recipe.model or 'embedded'} minus {recipe.prune.n_drop} blocks") + (
        f"\n({note})" if note else ""
    )


def model_config(spec: str | None, settings: RunSettings) -> tuple[Any, str]:
    from transformers import AutoConfig

    from layerprune.models import resolve_model

    source = resolve_model(spec, settings)
    try:
        return AutoConfig.from_pretrained(source.location, trust_remote_code=settings.trust_remote_code), ""
    except Exception as exc:
        base = next((k for k in KNOWN_SHAPES if source.location.startswith(k)), None)
        if base is None:
            return None, f"config of {source.spec} unreachable: {one_line(exc)[:120]}"
        fields = dict(KNOWN_SHAPES[base])
        return AutoConfig.for_model(
            fields.pop("model_type"), **fields
        ), f"hub unreachable: public config of {base} used"
