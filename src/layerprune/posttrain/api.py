"""`make_variant`: post-train a source model by a variant recipe into a Hugging Face checkpoint, cached by recipe.

A variant's folder is keyed by its fingerprint: the recipe (every field), the source (and teacher) weights' hash, the
seed and the dtype. The same recipe and source return the cached checkpoint without training; one field changed makes
another. The checkpoint is written to a temporary sibling and renamed at the end: it appears whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.model_card import card_text
from layerprune.core.outputs import atomic_output_dir, cache_lock, write_atomic
from layerprune.core.provenance import collect_provenance
from layerprune.core.settings import RunSettings
from layerprune.models.identity import model_hash
from layerprune.models.lineage import VARIANT_REPORT
from layerprune.models.loading import load_model, load_tokenizer, resolve_model
from layerprune.posttrain.items import Item, load_items, probe_items
from layerprune.posttrain.methods import METHODS, Job, draws_per_item, prompt_text
from layerprune.posttrain.schema import VariantRecipe
from layerprune.posttrain.train import Row, TrainResult, planned_steps, token_counts
from layerprune.tasks.data import resolve_data_dir

if TYPE_CHECKING:
    from huggingface_hub import ModelCardData

log = logging.getLogger(__name__)
VARIANT_VERSION = 1  # bump when the same recipe would train differently
SECONDS_PER_STEP = (5.0, 8.0)  # full fp32 SmolLM2-135M, ~850 tokens a step, 2 idle CPU cores: 7.1 s measured with
# TRL's recomputation on (math variant v2, 821 tokens a step); the low end, without it, is estimated, not measured
TOKENS_PER_MEASURED_STEP = 850
# rft's sampling, the same model and cores, batch 64, measured with nothing beside it (2026-12-05): 64 rows of 41 prompt
# tokens prefilled in 3.38 s, and each further token of the 64 rows 0.21 s (12 tokens in 5.71-5.80 s)
PREFILL_TOKENS_PER_S = 780.0
DECODE_S_PER_ROW_TOKEN = 0.0033


def fingerprint(recipe: VariantRecipe, settings: RunSettings) -> str:
    """What decides a variant's weights: the recipe, the source (and teacher) weights, seed and dtype. Gradient
    checkpointing only recomputes activations (the same weights), so it is not part of the key: a variant made with
    it is found by the same recipe without it."""
    cache = settings.resolved_cache_dir()
    models = {"source": model_hash(resolve_model(recipe.model, settings), cache)}
    if recipe.teacher:
        models["teacher"] = model_hash(resolve_model(recipe.teacher, settings), cache)
    dumped = recipe.model_dump(mode="json", exclude={"description": True, "train": {"gradient_checkpointing"}})
    key = {"recipe": dumped, "models": models, "seed": settings.seed,
           "dtype": settings.dtype, "version": VARIANT_VERSION}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def variant_dir(recipe: VariantRecipe, settings: RunSettings, digest: str) -> Path:
    """The cache folder of a variant: CACHE/variants/NAME-DIGEST16."""
    return settings.resolved_cache_dir() / "variants" / f"{recipe.name or recipe.method}-{digest[:16]}"


def cached_fingerprint(folder: Path) -> str | None:
    """The fingerprint a finished variant folder records (None: no finished variant there)."""
    try:
        return str(json.loads((folder / VARIANT_REPORT).read_text(encoding="utf-8"))["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def trained_questions(folder: Path) -> frozenset[str]:
    """The probe questions a model made by `layerprune variant` was trained or prompted on (its recipe's probe items,
    drawn again from the recipe its report keeps; rft and grpo prompted on every one); empty for any other model.
    What scores such a model as an unseen problem (the sweep's probe gate) leaves these out."""
    from pydantic import ValidationError

    try:
        report = json.loads((folder / VARIANT_REPORT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    try:
        data = VariantRecipe.model_validate(report["recipe"]).data
    except (KeyError, TypeError, ValidationError) as exc:
        raise LayerpruneError(f"{folder / VARIANT_REPORT}: its recipe does not read ({str(exc).splitlines()[0]}), so "
                              "the problems it was trained on are unknown") from exc
    return frozenset(item.messages[-1][1] for task, wanted in data.probes.items()
                     for item in probe_items(task, wanted, data)[0])


def make_variant(recipe: VariantRecipe, settings: RunSettings | None = None, output: Path | None = None,
                 data_dir: Path | None = None) -> Path:
    """Post-train `recipe.model` by the recipe; the checkpoint's folder (the cache's, or `output`).

    A folder that already holds this recipe's variant (same fingerprint) is returned without training; `output`
    holding anything else is an error."""
    settings = settings or RunSettings()
    digest = fingerprint(recipe, settings)
    target = Path(output) if output is not None else variant_dir(recipe, settings, digest)
    if cached_fingerprint(target) == digest:
        log.info("variant %s is cached in %s", digest[:16], target)
        return target
    if target.exists():
        raise LayerpruneError(f"output {target} exists and is not this recipe's variant; choose another")
    with cache_lock(settings.resolved_cache_dir(), f"variant-{digest[:16]}"):
        if cached_fingerprint(target) == digest:  # another process made it while this one waited
            return target
        build_variant(recipe, settings, target, digest, resolve_data_dir(data_dir))
    return target


def build_variant(recipe: VariantRecipe, settings: RunSettings, target: Path, digest: str,
                  data_dir: Path | None) -> None:
    """Train and write the checkpoint, its model card and report, atomically."""
    start = time.perf_counter()
    items, card = load_items(recipe.data, data_dir)
    loaded = load_model(recipe.model, trained_settings(settings))
    with atomic_output_dir(target) as tmp:
        job = Job(loaded.model, loaded.tokenizer, items, recipe, tmp / ".trainer", settings.seed,
                  load_teacher=lambda: teacher_pair(recipe, settings), card=card)
        model, result = METHODS.get(recipe.method)(job)
        model.save_pretrained(tmp, safe_serialization=True)
        loaded.tokenizer.save_pretrained(tmp)
        _remove_tree(tmp / ".trainer")
        report = variant_report(recipe, settings, digest, card, result, time.perf_counter() - start,
                                loaded.source.identity)
        write_atomic(tmp / VARIANT_REPORT, json.dumps(report, indent=2, default=str) + "\n")
        write_atomic(tmp / "README.md", model_card(report))


def trained_settings(settings: RunSettings) -> RunSettings:
    """The student loads in float32 unless the settings name a dtype (train.bf16 is autocast over fp32 weights)."""
    return settings if settings.dtype != "auto" else settings.model_copy(update={"dtype": "float32"})


def teacher_pair(recipe: VariantRecipe, settings: RunSettings) -> tuple[Any, Any]:
    teacher = load_model(recipe.teacher, settings)
    return teacher.model, teacher.tokenizer


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def variant_report(recipe: VariantRecipe, settings: RunSettings, digest: str, card: dict[str, Any],
                   result: TrainResult, seconds: float, source: dict[str, Any]) -> dict[str, Any]:
    """How the variant was made: kind, source, data (counts, the scored-item check), steps, tokens, time,
    provenance."""
    return {"fingerprint": digest, "kind": recipe.method, "source_model": recipe.model, "source_identity": source,
            "teacher": recipe.teacher, "format": recipe.format, "data": card,
            "train": {"method": recipe.train.method, "steps": result.steps, "sequences": result.sequences,
                      "tokens": result.tokens, "target_tokens": result.target_tokens,
                      "loss_first": result.loss_first, "loss_last": result.loss_last},
            "seconds": round(seconds, 1), "settings": settings.model_dump(mode="json"),
            "recipe": recipe.model_dump(mode="json"), "provenance": collect_provenance().model_dump(mode="json")}


def model_card(report: dict[str, Any]) -> str:
    """README.md of the checkpoint: what it is and how it was made."""
    data, train = report["data"], report["train"]
    sources = ", ".join(f"{name} {count}" for name, count in data["per_source"].items())
    return card_text(card_data(report), [
        f"# {report['kind']} variant of {report['source_model']}", "",
        f"Made by `layerprune variant` ({report['kind']}, {report['format']} format, {train['method']} fine-tuning"
        + (f", teacher {report['teacher']}" if report["teacher"] else "") + ").", "",
        f"- data: {data['items']} problems ({sources}); calibration seed {data['calibration_seed']}",
        f"- evaluation items trained on: {data['scored_items_trained']} (checked against the evaluation items of "
        f"probe seeds {data['exclude_probe_seeds']}; dropped as scored: {data['dropped_scored']})",
        *how_trained(report),
        f"- steps {train['steps']}, sequences {train['sequences']}, unpadded tokens {train['tokens']} "
        f"(target tokens {train['target_tokens']}), loss {_number(train['loss_first'])} -> "
        f"{_number(train['loss_last'])}",
        f"- time {report['seconds']} s; fingerprint {report['fingerprint'][:16]}",
        f"- layerprune {report['provenance']['layerprune']}; the recipe and provenance are in variant_report.json"])


def card_data(report: dict[str, Any]) -> ModelCardData:
    """The card's metadata: the source's hub id as base model (a fine-tune of it), the variant's kind, recipe and
    teacher."""
    from huggingface_hub import ModelCardData

    from layerprune.models.hub_ids import base_model_of_spec

    base = base_model_of_spec(report["source_model"], report.get("source_identity"))
    name = (report.get("recipe") or {}).get("name")
    teacher = report.get("teacher")
    return ModelCardData(
        base_model=base.hub_id, library_name="transformers", pipeline_tag="text-generation",
        tags=["layerprune", "variant", report["kind"]], layerprune={
            "source": report["source_model"], **({"variant": base.variant} if base.variant else {}),
            "variant_recipe": name, "variant_kind": report["kind"], "train_method": report["train"]["method"],
            **({"teacher": teacher, "teacher_base_model": base_model_of_spec(teacher).base_model} if teacher else {})},
        **({"base_model_relation": "finetune"} if base.on_hub else {}))


def how_trained(report: dict[str, Any]) -> list[str]:
    """What the problems became before training, by kind: rft's samples and the right ones kept, distill's teacher
    answers, grpo's sampled completions and reward (sft trains on the gold answers as they are)."""
    data, sample = report["data"], report.get("recipe", {}).get("sample", {})
    draws = f"{sample.get('k')} a problem at temperature {sample.get('temperature')}" if sample else "sampled"
    if report["kind"] == "rft" and "sampled" in data:
        share = data["kept_right"] / max(data["sampled"], 1)
        return [f"- trained on its own right answers: {data['sampled']} samples ({draws}), {data['kept_right']} "
                f"distinct right answers kept ({share:.1%} of the samples; {data['problems_solved']} problems solved "
                "at least once), SFT on those"]
    if report["kind"] == "distill" and "teacher_answers" in data:
        return [f"- trained on the teacher's greedy answers: {data['teacher_answers']}, {data['teacher_right']} "
                "graded right" + (" (only those kept)" if sample.get("keep_correct") else "")]
    if report["kind"] == "grpo" and "reward_first" in data:
        return [f"- GRPO: completions {draws}, reward 1 for a graded-right answer; mean reward of a logging window "
                f"{_number(data['reward_first'])} (first) -> {_number(data['reward_last'])} (last)"]
    return [] if report["kind"] == "sft" else [f"- {report['kind']}: see variant_report.json for its data"]


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def dry_run(recipe: VariantRecipe, settings: RunSettings | None = None, data_dir: Path | None = None) -> str:
    """The plan without weights: items per source, sequences, steps, tokens and a CPU time estimate."""
    settings = settings or RunSettings()
    items, card = load_items(recipe.data, resolve_data_dir(data_dir))
    tokenizer = load_tokenizer(resolve_model(recipe.model, settings), settings)
    plan = plan_numbers(recipe, items, tokenizer)
    low, high = train_minutes(plan)
    lines = [f"variant {recipe.method} of {recipe.model} ({recipe.format} format, {recipe.train.method})",
             f"data: {card['items']} problems: " + ", ".join(f"{k} {v}" for k, v in card["per_source"].items()),
             f"dropped as scored (probe seeds {recipe.data.exclude_probe_seeds}): {card['dropped_scored']}; "
             f"evaluation items kept: {card['scored_items_trained']}",
             f"steps {plan['steps']} x {recipe.train.sequences_per_step()} sequences = {plan['sequences']} sequences, "
             f"{plan['tokens']} unpadded tokens ({plan['target_tokens']} target), ~{plan['tokens_per_step']} a step",
             f"estimate (full fp32 SmolLM2-135M on 2 idle CPU cores, {SECONDS_PER_STEP[0]:g}-{SECONDS_PER_STEP[1]:g} "
             f"s per {TOKENS_PER_MEASURED_STEP} tokens): {low:.0f}-{high:.0f} min"]
    if recipe.method == "rft":
        lines.append(sampling_estimate(recipe, items, tokenizer))
    elif recipe.method in ("grpo", "distill"):
        lines.append(f"plus sampling: {len(items)} problems x {recipe.sample.k if recipe.method != 'distill' else 1} "
                     f"answers of up to {recipe.sample.max_new_tokens} tokens (not in the estimate)")
    return "\n".join(lines)


def train_minutes(plan: dict[str, int]) -> tuple[float, float]:
    """The training's CPU time estimate in minutes (low, high) from `plan_numbers` (sampling not included)."""
    low, high = (plan["steps"] * plan["tokens_per_step"] / TOKENS_PER_MEASURED_STEP * s / 60 for s in SECONDS_PER_STEP)
    return low, high


def estimate_minutes(recipe: VariantRecipe, settings: RunSettings | None = None,
                     data_dir: Path | None = None) -> tuple[float, float]:
    """`dry_run`'s training estimate of one make of the variant, in minutes (low, high; sampling not included)."""
    settings = settings or RunSettings()
    items, _ = load_items(recipe.data, resolve_data_dir(data_dir))
    tokenizer = load_tokenizer(resolve_model(recipe.model, settings), settings)
    return train_minutes(plan_numbers(recipe, items, tokenizer))


def sampling_estimate(recipe: VariantRecipe, items: list[Item], tokenizer: Any) -> str:
    """rft's sampling time at the measured CPU rates: every prompt prefilled once per answer, every answer decoded
    to max_new_tokens (an upper bound: a batch stops early only when all its answers have ended)."""
    k = draws_per_item(recipe.sample.k, recipe.sample.temperature)
    new = recipe.sample.max_new_tokens
    plain = recipe.format == "plain"  # as the sampler tokenizes: special tokens for plain text, the template's own
    prompt_tokens = k * sum(len(tokenizer(prompt_text(tokenizer, item, recipe.format), add_special_tokens=plain)
                                ["input_ids"]) for item in items)
    minutes = (prompt_tokens / PREFILL_TOKENS_PER_S + len(items) * k * new * DECODE_S_PER_ROW_TOKEN) / 60
    return (f"plus sampling: {len(items)} problems x {k} answers of up to {new} tokens ({prompt_tokens} prompt "
            f"tokens prefilled): ~{minutes:.0f} min for SmolLM2-135M on 2 idle CPU cores (prefill "
            f"~{PREFILL_TOKENS_PER_S:.0f} tokens/s, {DECODE_S_PER_ROW_TOKEN * 1000:.1f} ms an answer a token, measured "
            f"at batch 64; this recipe samples in batches of {recipe.sample.batch_size})")


def plan_numbers(recipe: VariantRecipe, items: list[Item], tokenizer: Any) -> dict[str, int]:
    """Steps, sequences and unpadded tokens of SFT on the gold solutions (rft/distill: an upper bound on rows)."""
    rows = [Row(item, item.answer) for item in items]
    sequences, tokens, target = token_counts(tokenizer, rows, recipe.format, recipe.train)
    steps = planned_steps(recipe.train, len(rows))
    return {"steps": steps, "sequences": sequences, "tokens": tokens, "target_tokens": target,
            "tokens_per_step": math.ceil(tokens / max(steps, 1))}
