"""Tasks for block ablation and calibration: (prompt, scored target, short answer) items, by name.

- arithmetic: few-shot composite arithmetic probes (layerprune.probes), answer = the number.
- gsm8k: GSM8K *train* questions, zero-shot, target = the worked solution ending "The answer is N."
- factual: few-shot "capital of <country>" recall from a list shipped with the code (facts.py).
- triviaqa: few-shot closed-book questions from <data-dir>/triviaqa/validation.jsonl (not in the
  default mirror: a clear error says where to put it).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from layerprune.analyze.facts import CAPITALS
from layerprune.data import load_rows
from layerprune.errors import LayerpruneError
from layerprune.probes import arithmetic_probes
from layerprune.registry import Registry

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class TaskItem:
    """One example: `target` is what NLL scores (after `prompt`); `answer` is what accuracy matches."""

    prompt: str
    target: str
    answer: str


@dataclass(frozen=True)
class Task:
    """How to build a task's items and how to read an answer out of a greedy generation."""

    build: Callable[[int, int, int, Path | None], list[TaskItem]]
    extract: Callable[[str], str]
    max_new_tokens: int
    kind: str  # math | factual


TASKS: Registry[Task] = Registry("task")


def first_line(text: str) -> str:
    """The first non-empty line of a continuation, stripped and lower-cased."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0].lower() if lines else ""


def final_number(text: str) -> str:
    """The number after '####' or 'The answer is', else the last number in the text ('' if none)."""
    text = text.split("\nQuestion:")[0]
    for marker in ("####", "answer is"):
        if marker in text:
            found = NUMBER.findall(text.rsplit(marker, 1)[1])
            if found:
                return found[0].replace(",", "").rstrip(".")
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else ""


def build_arithmetic(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    return [TaskItem(p.prompt, p.answer, p.answer.strip()) for p in arithmetic_probes(n, seed=seed, shots=shots)]


def clean_gsm8k_solution(answer: str) -> tuple[str, str]:
    """Drop calculator annotations '<<...>>'; '#### N' becomes 'The answer is N.'; return (text, N)."""
    body, _, final = answer.partition("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip()
    final = final.strip().replace(",", "")
    return f"{body}\nThe answer is {final}.", final


def build_gsm8k(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    rows = load_rows("gsm8k", "train", data_dir)
    items = []
    for row in random.Random(seed).sample(rows, min(n, len(rows))):
        solution, final = clean_gsm8k_solution(str(row["answer"]))
        items.append(TaskItem(f"Question: {row['question']}\nAnswer:", f" {solution}", final))
    return items


def qa_items(pairs: list[tuple[str, str]], n: int, seed: int, shots: int) -> list[TaskItem]:
    """Few-shot 'Q: ...\\nA: ...' items; the shots are other pairs of the same list."""
    rng = random.Random(seed)
    chosen = rng.sample(range(len(pairs)), min(n, len(pairs)))
    items = []
    for index in chosen:
        others = rng.sample([i for i in range(len(pairs)) if i != index], min(shots, len(pairs) - 1))
        prefix = "".join(f"Q: {pairs[i][0]}\nA: {pairs[i][1]}\n" for i in others)
        question, answer = pairs[index]
        items.append(TaskItem(f"{prefix}Q: {question}\nA:", f" {answer}", answer.lower()))
    return items


def build_factual(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    pairs = [(f"What is the capital of {country}?", capital) for country, capital in CAPITALS]
    return qa_items(pairs, n, seed, shots)


def triviaqa_answer(row: dict[str, Any]) -> str:
    answer = row.get("answer")
    if isinstance(answer, dict):
        answer = answer.get("value") or (answer.get("aliases") or [None])[0]
    if not isinstance(answer, str) or not answer:
        raise LayerpruneError("triviaqa rows need 'question' and 'answer' (a string or {'value': ...})")
    return answer


def build_triviaqa(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    rows = load_rows("triviaqa", "validation", data_dir)
    pool = random.Random(seed).sample(rows, min(len(rows), n + shots + 16))
    return qa_items([(str(row["question"]), triviaqa_answer(row)) for row in pool], n, seed, shots)


TASKS.register("arithmetic")(Task(build_arithmetic, first_line, 6, "math"))
TASKS.register("gsm8k")(Task(build_gsm8k, final_number, 192, "math"))
TASKS.register("factual")(Task(build_factual, first_line, 8, "factual"))
TASKS.register("triviaqa")(Task(build_triviaqa, first_line, 16, "factual"))


def task_items(name: str, n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    """Build `n` items of a task by name; a task with no items is an error."""
    items = TASKS.get(name).build(n, seed, shots, data_dir)
    if not items:
        raise LayerpruneError(f"task '{name}' has no data")
    return items
