"""Algorithmic probes generated from a seed: arithmetic and balanced brackets.

Evaluation and calibration draw from separate random streams, and a calibration draw never repeats an
expression of the evaluation items (the first PROBE_DOCS of every probe task of its family at EVAL_SEED).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

OPS = ("+", "-", "*")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}
BRACKETS = {"(": ")", "[": "]", "{": "}"}
PROBE_DOCS = 500  # items per probe task; evaluation's --limit takes the first ones
EVAL_SEED = 0  # the evaluation's default --probe-seed, whose items calibration avoids
PROBE_VERSION = 2  # bump when the items a seed gives change (2: distinct questions, separate calibration stream)
MAX_REPEATS = 1000  # consecutive repeated questions after which a probe family is taken as exhausted
Stream = str  # "eval" or "calib"


@dataclass(frozen=True)
class Probe:
    """One question with an exact expected answer; `prompt` holds the few-shot prefix, then `question`."""

    prompt: str
    answer: str
    kind: str
    question: str = ""  # the part of the prompt after the few-shot prefix


def probe_tasks() -> dict[str, dict[str, object]]:
    """Every probe task: name -> generator arguments (its `family` first)."""
    tasks: dict[str, dict[str, object]] = {"arith_1dc": {"family": "arithmetic", "kind": "composite"}}
    for digits in range(2, 6):
        for op in OPS:
            tasks[f"arith_{digits}d_{OP_NAMES[op]}"] = {"family": "arithmetic", "kind": "multi", "digits": digits,
                                                        "op": op}
    for depth in range(2, 9):
        tasks[f"brackets_d{depth}"] = {"family": "brackets", "depth": depth}
    return tasks


def distinct_items(task: str) -> int | None:
    """How many distinct questions a probe task has when that bounds its items (brackets of depth d: 3**d), else
    None (arithmetic: more than any evaluation takes)."""
    args = probe_tasks().get(task)
    if args is None or args["family"] != "brackets":
        return None
    return len(BRACKETS) ** int(args["depth"])  # type: ignore[call-overload]


def generate_probes(args: dict[str, object], n: int, seed: int, stream: Stream = "eval") -> list[Probe]:
    """The items of one probe task (arguments as in `probe_tasks`)."""
    rest = dict(args)
    family = rest.pop("family")
    if family == "brackets":
        return bracket_probes(n, depth=int(rest["depth"]), seed=seed, stream=stream)  # type: ignore[arg-type]
    return arithmetic_probes(n, seed=seed, stream=stream, **rest)  # type: ignore[arg-type]


@functools.cache
def evaluation_questions(family: str) -> frozenset[str]:
    """The questions of the evaluation items of a family: what a calibration draw must never be."""
    return frozenset(p.question for args in probe_tasks().values() if args["family"] == family
                     for p in generate_probes(args, PROBE_DOCS, EVAL_SEED))


def composite_expression(rng: random.Random) -> tuple[str, int]:
    """A single-digit three-operand composite such as '(8 + 3) * 5'."""
    a, b, c = (rng.randint(1, 9) for _ in range(3))
    op1, op2 = rng.choice(OPS), rng.choice(OPS)
    if rng.random() < 0.5:
        text = f"({a} {op1} {b}) {op2} {c}"
    else:
        text = f"{a} {op1} ({b} {op2} {c})"
    return text, int(eval(text))  # noqa: S307 - digits and operators we generated ourselves


def multi_digit_expression(rng: random.Random, digits: int, op: str) -> tuple[str, int]:
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    if op == "-" and b > a:
        a, b = b, a
    return f"{a} {op} {b}", int(eval(f"{a} {op} {b}"))  # noqa: S307


def _rng(key: str, stream: Stream) -> random.Random:
    return random.Random(key if stream == "eval" else f"{stream}:{key}")


def _avoiding(draw: Callable[[], tuple[str, str]], avoid: frozenset[str]) -> Callable[[], tuple[str, str]]:
    """`draw`, redrawn while its question is one to avoid."""
    def redraw() -> tuple[str, str]:
        for _ in range(MAX_REPEATS):
            question, answer = draw()
            if question not in avoid:
                return question, answer
        raise RuntimeError("every draw of this probe family is an evaluation item")
    return redraw


def _distinct(draw: Callable[[], tuple[str, str]], n: int, shots: int) -> list[tuple[list[tuple[str, str]], str, str]]:
    """Up to `n` items (examples, question, answer) with distinct questions; fewer when the family has fewer."""
    items, seen, repeats = [], set(), 0
    while len(items) < n and repeats < MAX_REPEATS:
        examples = [draw() for _ in range(shots)]
        question, answer = draw()
        if question in seen:
            repeats += 1
            continue
        seen.add(question)
        repeats = 0
        items.append((examples, question, answer))
    return items


def arithmetic_probes(n: int, seed: int = 0, shots: int = 3, kind: str = "composite", digits: int = 1,
                      op: str = "+", stream: Stream = "eval") -> list[Probe]:
    """Up to `n` arithmetic questions with distinct questions, each with a `shots`-example prefix, all from `seed`.

    stream "calib" draws from its own generator and never yields an evaluation question, in a question or an example.
    """
    rng = _rng(f"arith-{kind}-{digits}-{op}-{seed}", stream)

    def draw() -> tuple[str, str]:
        text, value = composite_expression(rng) if kind == "composite" else multi_digit_expression(rng, digits, op)
        return f"{text} =", f" {value}"

    if stream != "eval":
        draw = _avoiding(draw, evaluation_questions("arithmetic"))
    name = "arith_composite" if kind == "composite" else f"arith_{digits}d{op}"
    probes = []
    for examples, question, answer in _distinct(draw, n, shots):
        prefix = "".join(f"{q}{a}\n" for q, a in examples)
        probes.append(Probe(f"{prefix}{question}", answer, name, question))
    return probes


def bracket_sequence(rng: random.Random, depth: int) -> tuple[str, str]:
    """An opening sequence nested to `depth` and the closing sequence that balances it."""
    opening = "".join(rng.choice(list(BRACKETS)) for _ in range(depth))
    closing = "".join(BRACKETS[ch] for ch in reversed(opening))
    return opening, closing


def bracket_probes(n: int, depth: int, seed: int = 0, shots: int = 3, stream: Stream = "eval") -> list[Probe]:
    """'Complete the sequence' questions: input '( [ {' expects '} ] )'; at most 3**depth distinct ones."""
    rng = _rng(f"brackets-{depth}-{seed}", stream)

    def draw() -> tuple[str, str]:
        opening, closing = bracket_sequence(rng, depth)
        return f"Input: {' '.join(opening)}\nClosing:", f" {' '.join(closing)}"

    if stream != "eval":
        draw = _avoiding(draw, evaluation_questions("brackets"))
    probes = []
    for examples, question, answer in _distinct(draw, n, shots):
        prefix = "".join(f"{q}{a}\n" for q, a in examples)
        probes.append(Probe(f"{prefix}{question}", answer, f"brackets_d{depth}", question))
    return probes
