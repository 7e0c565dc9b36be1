"""Degeneration of a run's three models: rep-n and self-BLEU of their GSM8K answers, for report.md.

The answers are evaluate's own GSM8K generations (eval/<role>/samples/gsm8k.jsonl) when the run's suite scores
gsm8k; otherwise, when the recipe asks for it (`degeneration.samples`), each model answers that many GSM8K test
questions (greedy, chat template where the tokenizer has one), kept in eval/<role>/ so that re-evaluating a model
also renews its answers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from layerprune.analyze import metrics
from layerprune.analyze.degeneration import generate, load_prompts, text_of
from layerprune.analyze.records import write_json
from layerprune.core.settings import RunSettings
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import RunRecipe
from layerprune.tasks.data import read_jsonl, resolve_data_dir

log = logging.getLogger(__name__)
ROLES = {"baseline": "original", "pruned": "pruned", "recovered": "recovered"}
EVAL_TASKS = ("gsm8k", "gsm8k_boxed_chat")  # evaluate tasks whose samples are GSM8K answers
SHOWN = ("responses", "study_rep_2", "study_rep_4", "study_self_bleu_4", "rep_2", "self_bleu_4", "mean_length_words")
DEFINITIONS = {
    "rep_n": "1 - unique/total word n-grams within a response, mean over responses (regex words)",
    "self_bleu_4": "sacrebleu sentence BLEU-4 of each sentence against the other sentences of the same response, mean",
    "study_rep_n": "rep_n on nltk word tokens, x 100 (the pruning study's scale)",
    "study_self_bleu_4": "as the pruning study: nltk tokens, sentences under 4 tokens dropped, nltk sentence_bleu "
                         "(method1 smoothing) of each sentence against the others, mean x 100",
}


def evaluated_roles(paths: Any) -> list[str]:
    return [role for role in ROLES if (paths.eval(role) / SUMMARY_FILE).is_file()]


def sample_outputs(paths: Any, role: str, task: str) -> list[str] | None:
    """The generated texts of evaluate's samples of `task` for one role; None when it has none."""
    file = paths.eval(role) / "samples" / f"{task}.jsonl"
    if not file.is_file():
        return None
    texts = [text_of(row.get("resps")) for row in read_jsonl(file)]
    kept = [t for t in texts if t is not None]
    return kept or None


def role_model(recipe: RunRecipe, paths: Any, role: str) -> str | None:
    return {"baseline": recipe.model, "pruned": str(paths.pruned), "recovered": str(paths.recovered)}[role]


def generations_file(paths: Any, role: str, recipe: RunRecipe) -> Path:
    stage = recipe.degeneration
    return paths.eval(role) / f"degeneration_gsm8k_n{stage.samples}_t{stage.max_new_tokens}.jsonl"


def generated_outputs(recipe: RunRecipe, settings: RunSettings, paths: Any, role: str) -> list[str]:
    """`degeneration.samples` GSM8K answers of one role's model, generated once and kept next to its evaluation."""
    file = generations_file(paths, role, recipe)
    if file.is_file():
        return [row["output"] for row in read_jsonl(file)]
    from layerprune.models import load_model

    stage = recipe.degeneration
    data_dir = resolve_data_dir(recipe.evaluate.data_dir or recipe.prune.data_dir)
    prompts = load_prompts("gsm8k", stage.samples, data_dir)
    log.info("  degeneration: %d GSM8K answers of the %s model", len(prompts), ROLES[role])
    loaded = load_model(role_model(recipe, paths, role), settings)
    outputs = generate(loaded, prompts, stage.max_new_tokens, stage.batch_size)
    del loaded
    tmp = file.with_name(f".{file.name}.tmp")
    rows = [{"prompt": p, "output": o} for p, o in zip(prompts, outputs, strict=True)]
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(file)
    return outputs


def collect_outputs(recipe: RunRecipe, settings: RunSettings, paths: Any) -> tuple[str | None, dict[str, list[str]]]:
    """(where the answers come from, role -> answers); (None, {}) when the run has no GSM8K answers to measure."""
    roles = evaluated_roles(paths)
    for task in EVAL_TASKS:
        found = {role: sample_outputs(paths, role, task) for role in roles}
        if roles and all(found.values()):
            return f"evaluate's {task} samples (eval/<role>/samples/{task}.jsonl)", found  # type: ignore[return-value]
    if recipe.degeneration.samples == 0 or not roles:
        return None, {}
    stage = recipe.degeneration
    source = (f"{stage.samples} GSM8K test questions answered by each model (greedy, {stage.max_new_tokens} new "
              "tokens, chat template where the tokenizer has one)")
    return source, {role: generated_outputs(recipe, settings, paths, role) for role in roles}


def measure_degeneration(recipe: RunRecipe, settings: RunSettings, paths: Any) -> dict[str, Any] | None:
    """Write degeneration.json in the run directory (removed when there is nothing to measure); return it."""
    target = paths.root / "degeneration.json"
    source, outputs = collect_outputs(recipe, settings, paths)
    if source is None:
        target.unlink(missing_ok=True)
        return None
    models = {ROLES[role]: {**metrics.degeneration_stats(texts), **metrics.study_degeneration_stats(texts)}
              for role, texts in outputs.items()}
    data = {"source": source, "models": models, "definitions": DEFINITIONS}
    write_json(target, data)
    return data


def degeneration_lines(data: dict[str, Any] | None) -> list[str]:
    """report.md's degeneration section: one row per model, or why there is none."""
    lines = ["", "## Degeneration of GSM8K answers", ""]
    if data is None:
        return lines + ["Not measured: the suite scores no gsm8k and the recipe's `degeneration.samples` is 0 (set it "
                        "to have each model answer that many GSM8K questions)."]

    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

    lines += [f"From {data['source']}. The study's definitions (nltk tokens, x 100) first, then the usual ones "
              "(regex words, 0-1); higher rep-n / self-BLEU = more repetitive. See degeneration.json.", "",
              "| model | " + " | ".join(SHOWN) + " |", "|---" * (len(SHOWN) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(fmt(stats.get(key)) for key in SHOWN) + " |"
              for name, stats in data["models"].items()]
    return lines
