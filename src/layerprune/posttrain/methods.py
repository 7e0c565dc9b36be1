"""The ways to make a variant, registered by name: sft, rft, grpo, distill.

Each takes the source model, the items and the recipe, and returns the trained model and what training did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layerprune.core.registry import Registry
from layerprune.models.generate import generate_greedy
from layerprune.posttrain.items import Item
from layerprune.posttrain.schema import VariantRecipe
from layerprune.posttrain.train import Row, TrainResult, chat_messages, run_sft

log = logging.getLogger(__name__)


@dataclass
class Job:
    """Everything a method needs: the model to train, its tokenizer, the problems, the recipe, a work folder."""

    model: Any
    tokenizer: Any
    items: list[Item]
    recipe: VariantRecipe
    work: Path
    seed: int = 0
    load_teacher: Callable[[], Any] | None = None  # distill: (model, tokenizer) of the teacher
    card: dict[str, Any] = field(default_factory=dict)  # what the method adds to the data card


Method = Callable[[Job], tuple[Any, TrainResult]]
METHODS: Registry[Method] = Registry("variant kind")


def prompt_text(tokenizer: Any, item: Item, fmt: str) -> str:
    """The text a model continues: the plain few-shot prompt, or the chat turns through the template."""
    if fmt == "plain":
        return item.prompt
    return str(tokenizer.apply_chat_template(chat_messages(item), tokenize=False, add_generation_prompt=True))


def sample_answers(model: Any, tokenizer: Any, items: list[Item], fmt: str, k: int, temperature: float,
                   top_p: float, max_new_tokens: int, batch_size: int, seed: int) -> list[list[str]]:
    """k answers per item (greedy when temperature is 0: one, repeated), each cut before the item's stop."""
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {}
    repeats = draws_per_item(k, temperature)
    answers: list[list[str]] = [[] for _ in items]
    for stop in sorted({item.stop for item in items}):
        chosen = [n for n, item in enumerate(items) if item.stop == stop]
        prompts = [prompt_text(tokenizer, items[n], fmt) for n in chosen for _ in range(repeats)]
        texts = generate_greedy(model, tokenizer, prompts, max_new_tokens, [stop], batch_size,
                                add_special_tokens=fmt == "plain", **sampling)
        for index, n in enumerate(chosen):
            answers[n] = texts[index * repeats:(index + 1) * repeats] * (k if repeats == 1 else 1)
    return answers


def draws_per_item(k: int, temperature: float) -> int:
    """How many answers sample_answers generates per item: k when sampling, one (repeated k times) when greedy."""
    return k if temperature > 0 else 1


def _sample(job: Job, model: Any, tokenizer: Any, greedy: bool = False) -> list[list[str]]:
    s = job.recipe.sample
    return sample_answers(model, tokenizer, job.items, job.recipe.format, 1 if greedy else s.k,
                          0.0 if greedy else s.temperature, s.top_p, s.max_new_tokens, s.batch_size, job.seed)


@METHODS.register("sft")
def sft(job: Job) -> tuple[Any, TrainResult]:
    """Supervised fine-tuning on the gold solutions."""
    rows = [Row(item, item.answer) for item in job.items]
    return run_sft(job.model, job.tokenizer, rows, job.recipe, job.work, job.seed)


def graded_rows(items: list[Item], answers: list[list[str]]) -> list[Row]:
    """The distinct right answers of each item (the exact grader's verdict), as training rows."""
    rows = []
    for item, texts in zip(items, answers, strict=True):
        right = dict.fromkeys(text for text in texts if item.grade(text))
        rows += [Row(item, text) for text in right]
    return rows


@METHODS.register("rft")
def rft(job: Job) -> tuple[Any, TrainResult]:
    """Rejection-sampling fine-tuning: the model samples k answers per problem, SFT on the graded-right ones."""
    answers = _sample(job, job.model, job.tokenizer)
    rows = graded_rows(job.items, answers)
    job.card.update(sampled=sum(map(len, answers)), kept_right=len(rows),
                    problems_solved=sum(any(i.grade(t) for t in a) for i, a in zip(job.items, answers, strict=True)))
    if not rows:
        from layerprune.core.errors import LayerpruneError

        raise LayerpruneError(f"rft: none of the {job.card['sampled']} samples is right; nothing to train on")
    log.info("rft: %d of %d samples right", len(rows), job.card["sampled"])
    return run_sft(job.model, job.tokenizer, rows, job.recipe, job.work, job.seed)


@METHODS.register("distill")
def distill(job: Job) -> tuple[Any, TrainResult]:
    """SFT on a stronger teacher's greedy answers (all of them, or the right ones with sample.keep_correct)."""
    assert job.load_teacher is not None
    teacher, teacher_tokenizer = job.load_teacher()
    answers = _sample(job, teacher, teacher_tokenizer, greedy=True)
    del teacher
    rows = [Row(item, texts[0]) for item, texts in zip(job.items, answers, strict=True)]
    right = [row for row in rows if row.item.grade(row.completion)]
    job.card.update(teacher_answers=len(rows), teacher_right=len(right))
    rows = right if job.recipe.sample.keep_correct else rows
    if not rows:
        from layerprune.core.errors import LayerpruneError

        raise LayerpruneError("distill: the teacher answered no problem right; nothing to train on")
    return run_sft(job.model, job.tokenizer, rows, job.recipe, job.work, job.seed)


@METHODS.register("grpo")
def grpo(job: Job) -> tuple[Any, TrainResult]:
    """GRPO (TRL's GRPOTrainer) with the exact-answer reward of the project's graders."""
    from layerprune.posttrain.rl import run_grpo

    return run_grpo(job)
