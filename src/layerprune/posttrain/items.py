"""The problems a variant trains on, with gold answers: probe items from the calibration streams, GSM8K train rows.

No scored item is ever trained on: a probe item whose question, or one of whose few-shot examples, is among the first
PROBE_DOCS evaluation items of any probe task of its family under a seed of `exclude_probe_seeds` is dropped (the
calibration stream avoids seed 0's by construction; other seeds' items can collide, two-digit problems having only
8,100 pairs), and so is a GSM8K train row whose question is a GSM8K test question. `scored_collisions` checks the kept
items again, independently, and the report records the count (zero).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.posttrain.schema import DataSection
from layerprune.tasks import probes
from layerprune.tasks.data import load_rows, local_split, read_jsonl
from layerprune.tasks.grading import final_number, grade_number

PROBE_STOP = "\n"  # the probe evaluation's stop: the first generated line is the answer
GSM8K_STOP = "\n\n"  # a solution ends with its '#### N' line


@dataclass(frozen=True)
class Item:
    """One problem: the plain prompt, the gold completion (without its stop), and how an answer is graded."""

    source: str  # probe task name or 'gsm8k'
    prompt: str
    answer: str
    gold: str  # what the grader compares against
    grader: str  # 'exact' (first line, spaces ignored) or 'number' (GSM8K final number)
    stop: str
    messages: tuple[tuple[str, str], ...] = field(default=())  # (role, content) turns for the chat format

    def grade(self, text: str) -> bool:
        """Whether a generated answer is right, as the evaluation grades it."""
        return grade_answer(text, self.gold, self.grader)


def grade_answer(text: str, gold: str, grader: str) -> bool:
    """'exact': the first line of the text equals gold (surrounding spaces ignored), as the probes score; 'number':
    the GSM8K final number equals gold."""
    if grader == "exact":
        return text.split(PROBE_STOP, 1)[0].strip() == gold.strip()
    return grade_number(text, gold)


@functools.lru_cache(maxsize=32)
def scored_questions(family: str, seed: int) -> frozenset[str]:
    """The questions of the first PROBE_DOCS evaluation items of every probe task of a family under a seed."""
    return frozenset(p.question for args in probes.probe_tasks().values() if args["family"] == family
                     for p in probes.generate_probes(args, probes.PROBE_DOCS, seed))


def is_scored(probe: probes.Probe, family: str, seeds: list[int]) -> bool:
    """Whether a probe's question or any of its examples is an evaluation question of its family under a seed."""
    asked = {probe.question, *(q for q, _ in probe.examples)}
    return any(asked & scored_questions(family, seed) for seed in seeds)


def probe_items(task: str, wanted: int, data: DataSection) -> tuple[list[Item], int]:
    """`wanted` items of a probe task from its calibration stream (fewer when it has fewer) and how many drawn
    items were dropped as scored."""
    args = probes.probe_tasks()[task]
    drawn = probes.generate_probes(args, 4 * wanted + 64, seed=data.seed, stream="calib")
    kept: list[Item] = []
    dropped = 0
    for probe in drawn:
        if len(kept) == wanted:
            break
        if is_scored(probe, probes.family_of(task), data.exclude_probe_seeds):
            dropped += 1
        else:
            kept.append(as_item(task, probe))
    return kept, dropped


def as_item(task: str, probe: probes.Probe) -> Item:
    turns = [turn for q, a in probe.examples for turn in (("user", q), ("assistant", a.strip()))]
    return Item(task, probe.prompt, probe.answer, probe.answer.strip(), "exact", PROBE_STOP,
                (*turns, ("user", probe.question)))


def gsm8k_items(wanted: int, data: DataSection, data_dir: Path | None) -> tuple[list[Item], int]:
    """`wanted` GSM8K train rows (shuffled by the data seed) as items, and how many were dropped as test questions."""
    rows = load_rows("gsm8k", "train", data_dir)
    test_path = local_split(data_dir, "gsm8k", "test")
    test = {str(r.get("question", "")).strip() for r in read_jsonl(test_path)} if test_path else set()
    random.Random(data.seed).shuffle(rows)
    kept = [r for r in rows if str(r["question"]).strip() not in test]
    return [gsm8k_item(r) for r in kept[:wanted]], len(rows) - len(kept)


def gsm8k_item(row: dict[str, Any]) -> Item:
    question, answer = str(row["question"]).strip(), str(row["answer"]).strip()
    return Item("gsm8k", f"Question: {question}\nAnswer:", f" {answer}", final_number(answer), "number", GSM8K_STOP,
                (("user", question),))


def load_items(data: DataSection, data_dir: Path | None) -> tuple[list[Item], dict[str, Any]]:
    """Every item the recipe names, in a seeded shuffle, and the data card: counts per source, dropped, checked."""
    items: list[Item] = []
    card: dict[str, Any] = {"per_source": {}, "dropped_scored": {}, "exclude_probe_seeds": data.exclude_probe_seeds,
                            "calibration_seed": data.seed}
    for task, wanted in data.probes.items():
        got, dropped = probe_items(task, wanted, data)
        items += got
        card["per_source"][task], card["dropped_scored"][task] = len(got), dropped
    if data.gsm8k:
        got, dropped = gsm8k_items(data.gsm8k, data, data_dir)
        items += got
        card["per_source"]["gsm8k"], card["dropped_scored"]["gsm8k_test"] = len(got), dropped
    if not items:
        raise LayerpruneError("the recipe's data gave no item to train on")
    random.Random(data.seed).shuffle(items)
    card["items"] = len(items)
    card["scored_items_trained"] = scored_collisions(items, data.exclude_probe_seeds)
    if card["scored_items_trained"]:
        raise LayerpruneError(f"{card['scored_items_trained']} items are evaluation items; nothing was trained")
    return items, card


def scored_collisions(items: list[Item], seeds: list[int]) -> int:
    """How many probe items ask (in their question) an evaluation question of any probe task under the seeds."""
    scored = frozenset().union(*(scored_questions(f, s) for f in {probes.family_of(i.source) for i in items
                                                                  if i.source in probes.probe_tasks()}
                                 for s in seeds))
    return sum(i.messages[-1][1] in scored for i in items if i.source != "gsm8k")
