"""`analyze importance --dry-run`: each model's rendered prompt and token budget, from its tokenizer and config only.

No weights are read. A hub model's tokenizer and config come from the hub or its local cache, or from a local
tokenizer directory that `tokenizers` maps it to. A model whose tokenizer cannot be read here (offline, gated) is still
planned: its decoding, budget and the text of its user turn, with the chat template's rendering, the prompt's token
count and the depth marked unknown, and the plan ends by naming those models and how to complete it; a tokenizer found
without its model's config leaves only the depth unknown, and is named on a line of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from layerprune.analyze.importance import generation_plan
from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.analyze.tasks import ANALYSIS_TASKS, TaskItem, task_items
from layerprune.analyze.walk import render_prompt, with_instruction
from layerprune.core.errors import LayerpruneError, one_line
from layerprune.core.settings import RunSettings
from layerprune.tasks.data import resolve_data_dir


@dataclass
class ModelFiles:
    """What a dry run knows of one model: its tokenizer, its depth (None without a config) and where they came from."""

    tokenizer: Any  # None: not readable here (`where` says why)
    depth: int | None
    where: str


def model_location(model: str, config: ImportanceAnalysis, settings: RunSettings) -> tuple[str, str]:
    """(where to read the tokenizer, how to say it): the mapped local directory, or the model's own location."""
    if model in config.tokenizers:
        return str(config.tokenizers[model]), f"local tokenizer {config.tokenizers[model]}"
    from layerprune.models import resolve_model

    source = resolve_model(model, settings)
    return source.location, ("hub (or its cache)" if source.kind == "hub" else f"{source.kind} {source.location}")


def model_depth(places: list[str], settings: RunSettings) -> tuple[int | None, str]:
    """The number of decoder blocks from the first config found among `places`, and where it was found."""
    from transformers import AutoConfig

    for place in dict.fromkeys(places):
        try:
            model_config = AutoConfig.from_pretrained(place, trust_remote_code=settings.trust_remote_code)
            return model_config.get_text_config().num_hidden_layers, place
        except Exception:  # no config here (a bare tokenizer directory, or offline): try the next place
            continue
    return None, ""


def read_model_files(model: str, config: ImportanceAnalysis, settings: RunSettings) -> ModelFiles:
    """The tokenizer (required) and the depth: from the model's config, else from the tokenizer directory's (said)."""
    from transformers import AutoTokenizer

    location, where = model_location(model, config, settings)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=settings.trust_remote_code)
    own = model if model in config.tokenizers else location
    depth, found = model_depth([own, location], settings)
    if depth is not None and found != own:
        where += f"; depth from the config in {found}"
    return ModelFiles(tokenizer, depth, where)


def unavailable(exc: Exception) -> str:
    """Why a model's files could not be read, in one short line."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE and not isinstance(exc, LayerpruneError):
        return "not in the hub cache and the hub is offline (HF_HUB_OFFLINE)"
    return one_line(exc)[:200]


def read_all_model_files(config: ImportanceAnalysis, settings: RunSettings) -> dict[str, ModelFiles]:
    """Every model's files; a model whose tokenizer cannot be read gets none, and the reason in `where`."""
    files = {}
    for model in config.models:
        try:
            files[model] = read_model_files(model, config, settings)
        except Exception as exc:  # transformers/huggingface_hub raise many types for a missing or gated repo
            files[model] = ModelFiles(None, None, f"no tokenizer here: {unavailable(exc)}")
    return files


def planned_items(name: str, config: ImportanceAnalysis, settings: RunSettings) -> tuple[list[TaskItem], str]:
    """The task's planned items (fewer than `samples` where its data has fewer), or one placeholder and the reason its
    data is not here."""
    try:
        return task_items(name, config.samples, settings.seed, config.shots, resolve_data_dir(config.data_dir)), ""
    except LayerpruneError as exc:
        question = "Question: <question>\nAnswer:" if name == "gsm8k" else "Q: <question>\nA:"
        return [TaskItem(question, "", "")], f" (data not here: {exc})"


def rendered(item: TaskItem, plan: Any, tokenizer: Any, metric: str) -> tuple[str, str]:
    """The example as the model sees it and its token count. Generation: the chat template's rendering with the
    instruction (without a tokenizer: the user turn alone); teacher-forced: the raw prompt (its target follows)."""
    if metric != "generate":
        text = item.prompt
    elif tokenizer is None:
        text = with_instruction(item.prompt, plan.instruction)
    else:
        text = render_prompt(tokenizer, item.prompt, plan)
    if tokenizer is None:
        return text, "? prompt tokens: no tokenizer"
    special = metric != "generate" or not plan.chat  # a rendered template already holds its special tokens
    return text, f"{len(tokenizer(text, add_special_tokens=special)['input_ids'])} prompt tokens"


def task_lines(model: str, name: str, files: ModelFiles, config: ImportanceAnalysis,
               settings: RunSettings) -> list[str]:
    """One model/task: decoding, budget and the rendered example prompt (the user turn alone without a tokenizer)."""
    task = ANALYSIS_TASKS.get(name)
    tokenizer = files.tokenizer
    # without a tokenizer the template is unknown: plan as if it had one, so the user turn shows with its instruction
    stand_in = tokenizer if tokenizer is not None else SimpleNamespace(chat_template="unknown")
    loaded = SimpleNamespace(source=SimpleNamespace(spec=model), tokenizer=stand_in)
    plan = generation_plan(config, loaded, task, settings.seed)  # type: ignore[arg-type]
    items, note = planned_items(name, config, settings)
    n = config.samples if note else len(items)
    item = items[0]
    text, prompt_tokens = rendered(item, plan, tokenizer, config.metric)
    runs = None if files.depth is None else files.depth + 1
    if config.metric == "generate":
        sampled = (f"sampled at temperature {plan.temperature:g}, top_p {plan.top_p:g}, seed {plan.seed}"
                   if plan.temperature else "greedy")
        budget = (f"{n} items x {runs or '(blocks + 1)'} runs (full model + each block skipped)"
                  + (f" = {n * runs} generations, at most {n * runs * plan.max_new_tokens:,}"
                     " new tokens" if runs else f", at most {n * plan.max_new_tokens:,} new tokens a run"))
        form = "chat template" if plan.chat else "raw prompt"
        if tokenizer is None and plan.chat:
            form = "the user turn of its chat template if it has one (unknown here), else the raw prompt"
        head = (f"- {model} / {name}: {form}, {plan.max_new_tokens} new "
                f"tokens, {sampled}, stops {list(plan.stops)}; {budget}")
        example = "\n".join(f"      | {line}" for line in text.split("\n"))
    else:
        head = (f"- {model} / {name}: teacher-forced {config.metric} (no generation), {n} items x "
                f"{runs or '(blocks + 1)'} runs, sequences up to {config.max_length} tokens")
        if tokenizer is not None:
            note += f"; scored target ({len(tokenizer(item.target, add_special_tokens=False)['input_ids'])} tokens)"
        example = "\n".join([*(f"      | {line}" for line in text.split("\n")),
                             *(f"      > {line}" for line in item.target.split("\n"))])
    label = "example" if tokenizer is not None or not plan.chat else "example user turn"
    return [head, f"    {label} ({prompt_tokens}){note}:", example]


def dry_run_text(config: ImportanceAnalysis, settings: RunSettings) -> str:
    """The plan of `analyze importance`: budgets, then per model its files and each task's rendered prompt."""
    files = read_all_model_files(config, settings)
    lines = [f"# Dry run: analyze importance, metric {config.metric}",
             f"items per task: {config.samples} (seed {settings.seed}), shots {config.shots}; "
             f"batch {config.batch_size}, "
             f"max length {config.max_length}; critical = drop > {config.threshold:g} and significant (paired "
             f"bootstrap, {config.resamples} resamples, alpha {config.alpha:g}); no weights loaded", ""]
    for model in config.models:
        depth = f"{files[model].depth} blocks" if files[model].depth is not None else "depth unknown (no config)"
        where = files[model].where if files[model].tokenizer is None else f"tokenizer from {files[model].where}"
        lines.append(f"## {model} ({where}; {depth})")
        for name in config.tasks:
            lines += task_lines(model, name, files[model], config, settings)
        lines.append("")
    missing = [model for model in config.models if files[model].tokenizer is None]
    if missing:
        lines.append(f"INCOMPLETE: no tokenizer here for {', '.join(missing)}: their chat-template rendering, prompt "
                     "token counts and depth are unknown above; run with hub access or map each to a local tokenizer "
                     "directory: --tokenizers MODEL=DIR")
    depthless = [model for model in config.models if files[model].tokenizer is not None and files[model].depth is None]
    if depthless:
        lines.append(f"INCOMPLETE: depth unknown for {', '.join(depthless)} (a tokenizer without the model's config): "
                     "their runs and new-token budgets above are per (blocks + 1); run with hub access or put the "
                     "model's config.json beside its tokenizer")
    return "\n".join(lines)

