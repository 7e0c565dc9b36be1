"""`analyze degeneration`: rep-n, intra-response self-BLEU-4 and length, per variant (file or model)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from layerprune.analyze import charts, metrics
from layerprune.analyze.records import Timer, loaded_models, resolve_models, run_record, unique_labels, write_json
from layerprune.analyze.schemas import DegenerationAnalysis
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models.generate import generate_greedy
from layerprune.tasks.data import read_jsonl, resolve_data_dir

log = logging.getLogger(__name__)
PROMPT_FIELDS = ("instruction", "question", "prompt", "goal")


def text_of(value: Any) -> str | None:
    """A string, or the first string inside nested lists (lm-eval's `resps` look like [["..."]])."""
    while isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, str) else None


def read_generations(path: Path, prompt_field: str, output_field: str) -> list[dict[str, str]]:
    """Rows with a prompt and an output; a row without them is a one-line error naming the field."""
    rows = read_jsonl(path)
    pairs = []
    for number, row in enumerate(rows, 1):
        for name in (prompt_field, output_field):
            if text_of(row.get(name)) is None:
                raise LayerpruneError(f"{path}: row {number} has no text field '{name}' (fields: "
                                      f"{', '.join(sorted(row)) or 'none'}); use --prompt-field/--output-field")
        pairs.append({"prompt": text_of(row[prompt_field]), "output": text_of(row[output_field])})
    return pairs


def file_labels(paths: Sequence[Path]) -> list[str]:
    """File stems, or parent/stem when stems repeat (e.g. several samples.jsonl)."""
    stems = [p.stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return unique_labels([f"{p.parent.name}/{p.stem}" for p in paths])


def load_prompts(name: str, n: int, data_dir: Path | None) -> list[str]:
    """The first `n` prompts of a data-mirror folder (its first split), from a known prompt field."""
    folder = data_dir / name if data_dir else None
    files = sorted(folder.glob("*.jsonl")) if folder and folder.is_dir() else []
    if not files:
        raise LayerpruneError(f"no prompts for '{name}': put a JSONL file in <data-dir>/{name}/ (--data-dir)")
    prompts = []
    for row in read_jsonl(files[0])[:n]:
        field = next((f for f in PROMPT_FIELDS if isinstance(row.get(f), str)), None)
        if field is None:
            raise LayerpruneError(f"{files[0]} rows have none of the prompt fields {', '.join(PROMPT_FIELDS)}")
        prompts.append(row[field])
    return prompts


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The chat-formatted prompt when the tokenizer has a template, else the raw text."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def generate(loaded: Any, prompts: Sequence[str], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy responses to the chat-formatted prompts (models.generate: left-padded batches)."""
    texts = [chat_prompt(loaded.tokenizer, prompt) for prompt in prompts]
    return generate_greedy(loaded.model, loaded.tokenizer, texts, max_new_tokens, batch_size=batch_size,
                           add_special_tokens=False)


def check_labels(config: DegenerationAnalysis) -> list[str] | None:
    count = len(config.generations) + len(config.models)
    if count == 0:
        raise LayerpruneError("give --generations FILE [FILE ...] or --models SPEC [SPEC ...]")
    if config.labels and len(config.labels) != count:
        raise LayerpruneError(f"--labels has {len(config.labels)} names for {count} files/models")
    return config.labels or None


def collect_variants(config: DegenerationAnalysis, settings: RunSettings,
                     timer: Timer) -> dict[str, list[dict[str, str]]]:
    """label -> rows of {prompt, output}, from the files then from on-the-fly generation."""
    labels = check_labels(config)
    variants = {label: read_generations(path, config.prompt_field, config.output_field)
                for label, path in zip(file_labels(config.generations), config.generations, strict=False)}
    if config.models:
        sources = resolve_models(config.models, settings)
        prompts = load_prompts(config.prompts, config.samples, resolve_data_dir(config.data_dir))
        for label, loaded in loaded_models(sources, settings):
            log.info("degeneration: generating %d responses with %s", len(prompts), label)
            with timer(f"generate/{label}"):
                outputs = generate(loaded, prompts, config.max_new_tokens, config.batch_size)
            variants[label] = [{"prompt": p, "output": o} for p, o in zip(prompts, outputs, strict=False)]
    if labels:
        variants = dict(zip(labels, variants.values(), strict=False))
    return variants


def analyze_degeneration(config: DegenerationAnalysis, settings: RunSettings, out: Path) -> dict[str, Any]:
    """Write degeneration.json, degeneration.png, summary.md and (for generated ones) generations/*.jsonl."""
    timer = Timer()
    variants = collect_variants(config, settings, timer)
    outputs = {label: [r["output"] for r in rows] for label, rows in variants.items()}
    stats = {label: {**metrics.degeneration_stats(texts), **metrics.study_degeneration_stats(texts)}
             for label, texts in outputs.items()}
    report = {"config": config.model_dump(mode="json"), "variants": stats, "timings_s": timer.seconds,
              "cpu_s": timer.cpu_seconds,
              "definitions": {"rep_n": "1 - unique/total word n-grams within a response, mean over responses",
                              "self_bleu_4": "sacrebleu sentence BLEU-4 (floor smoothing 0.1, effective order) of "
                                             "each sentence against the other sentences of the same response "
                                             "(responses with 2+ sentences), mean, in [0, 1]",
                              "mean_length_words": "words and punctuation tokens per response",
                              "study_rep_n": "rep_n on nltk word tokens, x 100 (the pruning study's scale)",
                              "study_self_bleu_4": "as the pruning study: nltk tokens, sentences under 4 tokens "
                                                   "dropped, nltk sentence_bleu (method1 smoothing), x 100"},
              "run": run_record(settings)}
    write_json(out / "degeneration.json", report)
    if config.models:
        (out / "generations").mkdir()
        for label in list(variants)[len(config.generations):]:
            lines = "".join(json.dumps(r) + "\n" for r in variants[label])
            (out / "generations" / f"{label.replace('/', '_')}.jsonl").write_text(lines, encoding="utf-8")
    charts.plot_degeneration(out / "degeneration.png", stats)
    (out / "summary.md").write_text(degeneration_summary(stats), encoding="utf-8")
    return report


def degeneration_summary(stats: dict[str, dict[str, Any]]) -> str:
    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)

    keys = ["responses", "rep_2", "rep_3", "rep_4", "self_bleu_4", "mean_length_words", "study_rep_2",
            "study_self_bleu_4"]
    lines = ["# Degeneration", "", "| variant | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(fmt(s.get(k)) for k in keys) + " |" for label, s in stats.items()]
    return "\n".join(lines) + "\n"
