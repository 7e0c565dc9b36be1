"""Algorithmic probes generated from a seed: arithmetic, balanced brackets, and copying, reversing and counting lists.

Evaluation and calibration draw from separate random streams, and a calibration draw never repeats an
expression of the evaluation items (the first PROBE_DOCS of every probe task of its family at EVAL_SEED).

A fixed-depth bracket level with at most PROBE_DOCS distinct questions (depth 2-5: 3**depth of them) is evaluated
exhaustively: its evaluation items are all its questions, so its calibration stream asks the same depth in the same
words over four bracket pairs, every question holding at least one '<' (4**depth - 3**depth questions, none of them
an evaluation item: no evaluation question holds '<'). brackets_mix's calibration stream does the same at each depth
it draws (its evaluation items hold every question of depth 2 and 3, so avoiding them left only depth 4-6).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

OPS = ("+", "-", "*")
OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}
BRACKETS = {"(": ")", "[": "]", "{": "}"}
CALIB_BRACKETS = {**BRACKETS, "<": ">"}  # an exhaustive bracket level's calibration pairs ('<' in every question)
PROBE_DOCS = 500  # items per probe task; evaluation's --limit takes the first ones
PROBE_SHOTS = 3  # few-shot examples before each question
EVAL_SEED = 0  # the evaluation's default --probe-seed, whose items calibration avoids
PROBE_VERSION = 3  # bump when the items a seed gives change (2: distinct questions, separate calibration stream;
#                   3: fixed-depth bracket levels of at most 500 questions enumerated whole at every seed)
# (new tasks do not bump it: the items of every existing task are unchanged)
MAX_REPEATS = 1000  # consecutive repeated questions after which a probe family is taken as exhausted
Stream = str  # "eval" or "calib"


@dataclass(frozen=True)
class Probe:
    """One question with an exact expected answer; `prompt` holds the few-shot prefix, then `question`."""

    prompt: str
    answer: str
    kind: str
    question: str = ""  # the part of the prompt after the few-shot prefix
    examples: tuple[tuple[str, str], ...] = ()  # the few-shot prefix's (question, answer) pairs, in order


def _as_probes(items: list[tuple[list[tuple[str, str]], str, str]], name: str) -> list[Probe]:
    """Probes from `_distinct`'s items: each example as 'question answer' on a line of its own, then the question."""
    return [Probe("".join(f"{q}{a}\n" for q, a in examples) + question, answer, name, question, tuple(examples))
            for examples, question, answer in items]


def probe_tasks() -> dict[str, dict[str, object]]:
    """Every probe task: name -> generator arguments (its `family` first)."""
    tasks: dict[str, dict[str, object]] = {"arith_1dc": {"family": "arithmetic", "kind": "composite"}}
    for digits in range(2, 6):
        for op in OPS:
            tasks[f"arith_{digits}d_{OP_NAMES[op]}"] = {"family": "arithmetic", "kind": "multi", "digits": digits,
                                                        "op": op}
    for depth in range(2, 9):
        tasks[f"brackets_d{depth}"] = {"family": "brackets", "depth": depth}
    tasks.update(easy_probe_tasks())
    return tasks


def easy_probe_tasks() -> dict[str, dict[str, object]]:
    """Levels a 135M-270M model does often but not always, each with at least 500 distinct questions: two-digit
    addition without carries, three one-digit addends, copying, reversing and counting a short list, and closing a
    bracket sequence of mixed depth (2-6)."""
    tasks: dict[str, dict[str, object]] = {
        "arith_2d_add_nc": {"family": "arithmetic", "kind": "nocarry", "digits": 2, "op": "+"},
        "arith_1d_sum3": {"family": "arithmetic", "kind": "sum3"},
        "brackets_mix": {"family": "brackets_mix", "depth": 2, "max_depth": MIX_DEPTH},
    }
    for length in LIST_LENGTHS:
        tasks[f"copy_l{length}"] = {"family": "copy", "length": length}
        tasks[f"reverse_l{length}"] = {"family": "reverse", "length": length}
    for low, high in COUNT_RANGES:
        tasks[f"count_{low}to{high}"] = {"family": "count", "length": low, "max_length": high}
    return tasks


MIX_DEPTH = 6  # brackets_mix: depths 2..6, 9 + 27 + 81 + 243 + 729 = 1089 distinct questions, asked in words of
# their own ('Sequence: ... Close:') so that none is a question of a fixed-depth brackets task (whose shallow depths
# are evaluated exhaustively and would leave the calibration stream nothing below depth 6)
LIST_LENGTHS = (3, 5, 7)  # copy_l*/reverse_l*: letters a-z, 26**length distinct questions
COUNT_RANGES = ((2, 5), (4, 9))  # count_*: how many words, a list of this many (a vocabulary of 12 words)
COUNT_WORDS = ("cat", "dog", "sun", "tree", "car", "book", "fish", "bird", "cup", "hat", "pen", "box")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
LIST_FAMILIES = ("copy", "reverse", "count")


def distinct_items(task: str, stream: Stream = "eval") -> int | None:
    """How many distinct questions a probe task has when that bounds its items (brackets of depth d: 3**d; three
    one-digit addends: 9**3; two-digit sums without a carry: 36 * 55), else None (more than any evaluation takes).

    stream "calib": the calibration questions of an exhaustive bracket level (4**d - 3**d); else as "eval" (an
    upper bound: calibration never asks an evaluation question)."""
    args = probe_tasks().get(task)
    if args is None:
        return None
    if stream != "eval" and exhaustive(args):
        depth = int(args["depth"])  # type: ignore[call-overload]
        return len(CALIB_BRACKETS) ** depth - len(BRACKETS) ** depth
    if str(args["family"]).startswith("brackets"):
        low, high = int(args["depth"]), int(args.get("max_depth", args["depth"]))  # type: ignore[call-overload]
        return sum(len(BRACKETS) ** d for d in range(low, high + 1))
    return {"sum3": 9**3, "nocarry": 36 * 55}.get(str(args.get("kind")))


def exhaustive(args: dict[str, object]) -> bool:
    """Whether a probe task's evaluation items are all its questions: a fixed-depth bracket level with at most
    PROBE_DOCS of them (depth 2-5)."""
    return args["family"] == "brackets" and len(BRACKETS) ** int(args["depth"]) <= PROBE_DOCS  # type: ignore[call-overload]


def family_of(task: str) -> str:
    """The family of a probe task: arithmetic, brackets, brackets_mix, copy, reverse or count."""
    return str(probe_tasks()[task]["family"])


FAMILY_LABELS = {"arithmetic": "arithmetic", "brackets": "brackets", "brackets_mix": "brackets"}


def family_label(task: str) -> str:
    """What a probe task measures: arithmetic, brackets, or retrieval (copy and the list families, which repeat or
    reorder what the prompt holds)."""
    family = family_of(task)
    return FAMILY_LABELS.get(family, f"retrieval ({family})")


def generate_probes(args: dict[str, object], n: int, seed: int, stream: Stream = "eval") -> list[Probe]:
    """The items of one probe task (arguments as in `probe_tasks`). Up to PROBE_DOCS items are drawn once per process
    for each set of arguments (a study asks for the same items at every stage, ~30 ms a draw), a new list each call;
    larger draws (recovery prompts drawn from a task, 64 per prompt kept) are not kept."""
    if n > PROBE_DOCS:
        return _draw_probes(dict(args), n, seed, stream)
    return list(_generated(tuple(sorted(args.items())), n, seed, stream))


@functools.lru_cache(maxsize=256)
def _generated(args: tuple[tuple[str, object], ...], n: int, seed: int, stream: Stream) -> tuple[Probe, ...]:
    return tuple(_draw_probes(dict(args), n, seed, stream))


def _draw_probes(args: dict[str, object], n: int, seed: int, stream: Stream) -> list[Probe]:
    rest = dict(args)
    family = rest.pop("family")
    if family in ("brackets", "brackets_mix"):
        return bracket_probes(n, depth=int(rest["depth"]), seed=seed, stream=stream,  # type: ignore[call-overload]
                              max_depth=rest.get("max_depth"))  # type: ignore[arg-type]
    if family in LIST_FAMILIES:
        return list_probes(n, str(family), seed=seed, stream=stream, **rest)  # type: ignore[arg-type]
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


def nocarry_expression(rng: random.Random) -> tuple[str, int]:
    """Two two-digit numbers whose digits add up without a carry, such as '23 + 45'."""
    tens = rng.choice([(a, b) for a in range(1, 10) for b in range(1, 10) if a + b <= 9])
    units = rng.choice([(a, b) for a in range(10) for b in range(10) if a + b <= 9])
    a, b = 10 * tens[0] + units[0], 10 * tens[1] + units[1]
    return f"{a} + {b}", a + b


def sum3_expression(rng: random.Random) -> tuple[str, int]:
    """Three one-digit addends, such as '3 + 5 + 1'."""
    a, b, c = (rng.randint(1, 9) for _ in range(3))
    return f"{a} + {b} + {c}", a + b + c


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


def _distinct(draw: Callable[[], tuple[str, str]], n: int, shots: int,
              total: int | None = None) -> list[tuple[list[tuple[str, str]], str, str]]:
    """Up to `n` items (examples, question, answer) with distinct questions; fewer when the family has fewer. With
    `total` (the family's number of distinct questions), draws go on until min(n, total) are there: all of them when
    n >= total, however many repeats that takes."""
    items, seen, repeats = [], set(), 0
    while len(items) < (n if total is None else min(n, total)) and (total is not None or repeats < MAX_REPEATS):
        examples = [draw() for _ in range(shots)]
        question, answer = draw()
        if question in seen:
            repeats += 1
            continue
        seen.add(question)
        repeats = 0
        items.append((examples, question, answer))
    return items


def arithmetic_probes(n: int, seed: int = 0, shots: int = PROBE_SHOTS, kind: str = "composite", digits: int = 1,
                      op: str = "+", stream: Stream = "eval") -> list[Probe]:
    """Up to `n` arithmetic questions with distinct questions, each with a `shots`-example prefix, all from `seed`.

    stream "calib" draws from its own generator and never yields an evaluation question, in a question or an example.
    """
    rng = _rng(f"arith-{kind}-{digits}-{op}-{seed}", stream)

    def draw() -> tuple[str, str]:
        text, value = {"composite": composite_expression, "nocarry": nocarry_expression,
                       "sum3": sum3_expression}.get(kind, lambda r: multi_digit_expression(r, digits, op))(rng)
        return f"{text} =", f" {value}"

    if stream != "eval":
        draw = _avoiding(draw, evaluation_questions("arithmetic"))
    name = {"composite": "arith_composite", "nocarry": "arith_2d_add_nc", "sum3": "arith_1d_sum3"}.get(
        kind, f"arith_{digits}d{op}")
    return _as_probes(_distinct(draw, n, shots), name)


def bracket_sequence(rng: random.Random, depth: int, pairs: dict[str, str] = BRACKETS) -> tuple[str, str]:
    """An opening sequence nested to `depth` (each bracket one of `pairs`) and the closing sequence that balances it:
    len(pairs)**depth distinct ones."""
    opening = "".join(rng.choice(list(pairs)) for _ in range(depth))
    closing = "".join(pairs[ch] for ch in reversed(opening))
    return opening, closing


def calib_bracket_sequence(rng: random.Random, depth: int) -> tuple[str, str]:
    """A sequence over CALIB_BRACKETS holding at least one '<': never one of `bracket_sequence`'s."""
    while True:
        opening, closing = bracket_sequence(rng, depth, CALIB_BRACKETS)
        if "<" in opening:
            return opening, closing


def bracket_probes(n: int, depth: int, seed: int = 0, shots: int = PROBE_SHOTS, stream: Stream = "eval",
                   max_depth: int | None = None) -> list[Probe]:
    """'Complete the sequence' questions: input '( [ {' expects '} ] )'; at most 3**depth distinct ones, all of them
    where that is at most PROBE_DOCS (`exhaustive`; its calibration stream: `calib_bracket_sequence`). With
    `max_depth`, each question (and example) draws its depth from depth..max_depth (task brackets_mix; its
    calibration stream too is `calib_bracket_sequence`'s)."""
    key = f"brackets-{depth}-{seed}" if max_depth is None else f"brackets-{depth}to{max_depth}-{seed}"
    rng = _rng(key, stream)
    name = f"brackets_d{depth}" if max_depth is None else "brackets_mix"
    whole = max_depth is None and exhaustive({"family": "brackets", "depth": depth})
    calib = (whole or max_depth is not None) and stream != "eval"  # brackets_mix's evaluation takes every question
    # of depth 2-3: its calibration too asks over four pairs, so that it keeps every depth
    sequence = calib_bracket_sequence if calib else bracket_sequence

    def draw() -> tuple[str, str]:
        opening, closing = sequence(rng, depth if max_depth is None else rng.randint(depth, max_depth))
        if max_depth is not None:
            return f"Sequence: {' '.join(opening)}\nClose:", f" {' '.join(closing)}"
        return f"Input: {' '.join(opening)}\nClosing:", f" {' '.join(closing)}"

    if stream != "eval":
        draw = _avoiding(draw, evaluation_questions("brackets" if max_depth is None else "brackets_mix"))
    total = len(CALIB_BRACKETS) ** depth - len(BRACKETS) ** depth if calib else len(BRACKETS) ** depth
    return _as_probes(_distinct(draw, n, shots, total if whole else None), name)


def list_question(rng: random.Random, family: str, length: int, max_length: int | None) -> tuple[str, str]:
    """One copy / reverse / count question and its answer: 'Input: k d m\nCopy:' -> ' k d m'."""
    if family == "count":
        items = [rng.choice(COUNT_WORDS) for _ in range(rng.randint(length, max_length or length))]
        return f"Input: {' '.join(items)}\nCount:", f" {len(items)}"
    items = [rng.choice(LETTERS) for _ in range(length)]
    shown = items if family == "copy" else items[::-1]
    return f"Input: {' '.join(items)}\n{family.capitalize()}:", f" {' '.join(shown)}"


def list_probes(n: int, family: str, length: int, seed: int = 0, shots: int = PROBE_SHOTS, stream: Stream = "eval",
                max_length: int | None = None) -> list[Probe]:
    """Copy or reverse a list of `length` letters, or count the words of a list of length..max_length words."""
    span = f"{length}to{max_length}" if max_length else str(length)
    rng = _rng(f"{family}-{span}-{seed}", stream)

    def draw() -> tuple[str, str]:
        return list_question(rng, family, length, max_length)

    if stream != "eval":
        draw = _avoiding(draw, evaluation_questions(family))
    name = f"count_{span}" if family == "count" else f"{family}_l{length}"
    return _as_probes(_distinct(draw, n, shots), name)
