"""Algorithmic probes generated from a seed: arithmetic and balanced brackets."""

from __future__ import annotations

import random
from dataclasses import dataclass

OPS = ("+", "-", "*")
BRACKETS = {"(": ")", "[": "]", "{": "}"}


@dataclass(frozen=True)
class Probe:
    """One question with an exact expected answer; `prompt` already holds the few-shot prefix."""

    prompt: str
    answer: str
    kind: str


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


def arithmetic_probes(n: int, seed: int = 0, shots: int = 3, kind: str = "composite", digits: int = 1,
                      op: str = "+") -> list[Probe]:
    """`n` arithmetic questions, each with a `shots`-example prefix, all from `seed`."""
    rng = random.Random(f"arith-{kind}-{digits}-{op}-{seed}")

    def draw() -> tuple[str, int]:
        return composite_expression(rng) if kind == "composite" else multi_digit_expression(rng, digits, op)

    probes = []
    for _ in range(n):
        examples = [draw() for _ in range(shots)]
        question, answer = draw()
        prefix = "".join(f"{q} = {a}\n" for q, a in examples)
        probes.append(Probe(f"{prefix}{question} =", f" {answer}", f"arith_{kind}" if kind == "composite" else f"arith_{digits}d{op}"))
    return probes


def bracket_sequence(rng: random.Random, depth: int) -> tuple[str, str]:
    """An opening sequence nested to `depth` and the closing sequence that balances it."""
    opening = "".join(rng.choice(list(BRACKETS)) for _ in range(depth))
    closing = "".join(BRACKETS[ch] for ch in reversed(opening))
    return opening, closing


def bracket_probes(n: int, depth: int, seed: int = 0, shots: int = 3) -> list[Probe]:
    """'Complete the sequence' questions: input '( [ {' expects '} ] )'."""
    rng = random.Random(f"brackets-{depth}-{seed}")
    probes = []
    for _ in range(n):
        examples = [bracket_sequence(rng, depth) for _ in range(shots)]
        opening, closing = bracket_sequence(rng, depth)
        prefix = "".join(f"Input: {' '.join(o)}\nClosing: {' '.join(c)}\n" for o, c in examples)
        probes.append(Probe(f"{prefix}Input: {' '.join(opening)}\nClosing:", f" {' '.join(closing)}", f"brackets_d{depth}"))
    return probes
