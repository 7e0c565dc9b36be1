"""Tasks for block ablation and calibration: (prompt, scored target, short answer) items, by name.

- arithmetic: few-shot composite arithmetic probes (layerprune.tasks.probes), answer = the number.
- arith_2d_add, arith_3d_sub, ..., arith_2d_add_nc, arith_1d_sum3, brackets_d2 ... brackets_d8, brackets_mix: each
  arithmetic and brackets level of the probes as the probe gate scores it (evaluation stream, the probes' own
  few-shot prefix: `shots` does not apply), so a variant trained on the levels' calibration streams is measured on
  what it learned.
- gsm8k: GSM8K *train* questions, zero-shot, target = the worked solution ending "The answer is N."
- factual: few-shot "capital of <country>" recall from a list shipped with the code (facts.py).
- triviaqa: few-shot closed-book questions from <data-dir>/triviaqa/train.jsonl (the rc.nocontext *train*
  split: `evaluate` scores validation; not in the default mirror: a clear error says where to put it).

Generations are graded by layerprune.tasks.grading: numbers by numeric equivalence (gsm8k, arithmetic), short
answers by lm-eval's triviaqa normalisation over every alias (factual, triviaqa).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.analyze.facts import CAPITALS
from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import Registry
from layerprune.tasks import grading
from layerprune.tasks.data import load_rows
from layerprune.tasks.probes import arithmetic_probes, generate_probes, probe_tasks


@dataclass(frozen=True)
class TaskItem:
    """One example: `target` is what NLL scores (after `prompt`); `answer` is what a generation is graded
    against (with `aliases`, every accepted spelling, for short answers)."""

    prompt: str
    target: str
    answer: str
    aliases: tuple[str, ...] = ()

    def accepted(self) -> tuple[str, ...]:
        return self.aliases or (self.answer,)


@dataclass(frozen=True)
class Task:
    """How to build a task's items and how to grade a generation (layerprune.tasks.grading)."""

    build: Callable[[int, int, int, Path | None], list[TaskItem]]
    grade: Callable[[str, TaskItem], bool]
    max_new_tokens: int
    kind: str  # math | brackets | factual
    stops: tuple[str, ...] = ()  # generation stops at any of these (lm-eval's `until` for the task)
    chat_protocol: bool = False  # chat_template auto applies the template (as evaluate does for this task)


ANALYSIS_TASKS: Registry[Task] = Registry("task")


def grade_first_number(text: str, item: TaskItem) -> bool:
    """Short numeric answers: the first number of the first line, compared numerically."""
    return grading.numbers_equal(grading.first_number(text), item.answer)


def grade_final_number(text: str, item: TaskItem) -> bool:
    """GSM8K: the final number of the solution (before any new turn), compared numerically."""
    return grading.grade_number(text, item.answer)


def grade_short_answer(text: str, item: TaskItem) -> bool:
    """TriviaQA-style: lm-eval's normalisation over every alias."""
    return grading.grade_short_answer(text, item.accepted())


def build_arithmetic(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    return [TaskItem(p.prompt, p.answer, p.answer.strip()) for p in arithmetic_probes(n, seed=seed, shots=shots)]


def clean_gsm8k_solution(answer: str) -> tuple[str, str]:
    """Drop calculator annotations '<<...>>'; '#### N' becomes 'The answer is N.'; return (text, N)."""
    body = re.sub(r"<<[^>]*>>", "", answer.partition("####")[0]).strip()
    final = grading.final_number(answer)
    return f"{body}\nThe answer is {final}.", final


def build_gsm8k(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    rows = load_rows("gsm8k", "train", data_dir)
    items = []
    for row in random.Random(seed).sample(rows, min(n, len(rows))):
        solution, final = clean_gsm8k_solution(str(row["answer"]))
        items.append(TaskItem(f"Question: {row['question']}\nAnswer:", f" {solution}", final))
    return items


def qa_items(pairs: list[tuple[str, str]], n: int, seed: int, shots: int,
             aliases: list[tuple[str, ...]] | None = None) -> list[TaskItem]:
    """Few-shot 'Q: ...\\nA: ...' items; the shots are other pairs of the same list."""
    rng = random.Random(seed)
    chosen = rng.sample(range(len(pairs)), min(n, len(pairs)))
    items = []
    for index in chosen:
        others = rng.sample([i for i in range(len(pairs)) if i != index], min(shots, len(pairs) - 1))
        prefix = "".join(f"Q: {pairs[i][0]}\nA: {pairs[i][1]}\n" for i in others)
        question, answer = pairs[index]
        accepted = aliases[index] if aliases else (answer,)
        items.append(TaskItem(f"{prefix}Q: {question}\nA:", f" {answer}", answer, accepted))
    return items


def build_factual(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    pairs = [(f"What is the capital of {country}?", capital) for country, capital in CAPITALS]
    return qa_items(pairs, n, seed, shots)


def triviaqa_answer(row: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """The answer and every alias of a TriviaQA row (a string answer is its own only alias)."""
    answer = row.get("answer")
    aliases: tuple[str, ...] = ()
    if isinstance(answer, dict):
        aliases = tuple(str(a) for a in answer.get("aliases") or [] if a)
        answer = answer.get("value") or (aliases or [None])[0]
    if not isinstance(answer, str) or not answer:
        raise LayerpruneError("triviaqa rows need 'question' and 'answer' (a string or {'value': ...})")
    return answer, aliases or (answer,)


def build_triviaqa(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    rows = load_rows("triviaqa", "train", data_dir)
    pool = random.Random(seed).sample(rows, min(len(rows), n + shots + 16))
    answers = [triviaqa_answer(row) for row in pool]
    pairs = [(str(row["question"]), answer) for row, (answer, _) in zip(pool, answers, strict=False)]
    return qa_items(pairs, n, seed, shots, [aliases for _, aliases in answers])


ANALYSIS_TASKS.register("arithmetic")(Task(build_arithmetic, grade_first_number, 6, "math"))
ANALYSIS_TASKS.register("gsm8k")(Task(build_gsm8k, grade_final_number, 192, "math", grading.GSM8K_STOPS, True))
ANALYSIS_TASKS.register("factual")(Task(build_factual, grade_short_answer, 8, "factual"))
ANALYSIS_TASKS.register("triviaqa")(Task(build_triviaqa, grade_short_answer, 16, "factual", (), True))


def probe_level(args: dict[str, object]) -> Callable[[int, int, int, Path | None], list[TaskItem]]:
    def build(n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
        return [TaskItem(p.prompt, p.answer, p.answer.strip()) for p in generate_probes(args, n, seed)]

    return build


def grade_exact_line(text: str, item: TaskItem) -> bool:
    """Brackets: the first line of the generation, stripped, is the answer (as `evaluate` scores the probe)."""
    return text.split("\n")[0].strip() == item.answer.strip()


for _name, _args in probe_tasks().items():
    if _args["family"] == "arithmetic" and _name != "arith_1dc":  # arith_1dc is `arithmetic` at its own shots
        ANALYSIS_TASKS.register(_name)(Task(probe_level(_args), grade_first_number, 8, "math"))
    elif str(_args["family"]).startswith("brackets"):  # each depth and the mixed-depth level
        ANALYSIS_TASKS.register(_name)(Task(probe_level(_args), grade_exact_line, 24, "brackets", ("\n",)))


def task_items(name: str, n: int, seed: int, shots: int, data_dir: Path | None) -> list[TaskItem]:
    """Build `n` items of a task by name; a task with no items is an error."""
    items = ANALYSIS_TASKS.get(name).build(n, seed, shots, data_dir)
    if not items:
        raise LayerpruneError(f"task '{name}' has no data")
    return items
