"""Answer graders shared by the stages: GSM8K-style numeric answers and TriviaQA-style short answers.

GSM8K: the answer is read the way lm-eval's gsm8k filters read it ("#### N", else "The answer is N", else
the last number: its strict and flexible extracts), after cutting the text at a new turn ("Question:",
"Human:", ...), and compared as numbers ("18.00" equals "18", "$1,000" equals "1000").
TriviaQA: lm-eval's triviaqa normalisation (generation cut at its stop strings "\\n", ".", ","; case and
punctuation ignored through lm-eval's own `exact_match_hf_evaluate`) against every alias; an alias contained
as whole words in the normalised answer also counts (chat models answer in sentences).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
NEW_TURN = re.compile(r"\n\s*(?:Question|Human|User|Q)\s*:|Question:|Human:")
BOXED = re.compile(r"\\boxed\{\s*\$?(\-?[0-9][0-9\.\,]*)\s*\}")  # R1-style final answers
BOXED_TEXT = re.compile(r"\\boxed\{([^{}]*)\}")
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")  # lm-eval gsm8k.yaml strict-match
ANSWER_IS = re.compile(r"answer is[:\s]*\$?(\-?[0-9][0-9\.\,]*)", re.IGNORECASE)
TRIVIAQA_STOPS = ("\n", ".", ",")  # lm-eval triviaqa/default.yaml generation_kwargs.until
GSM8K_STOPS = ("Question:", "</s>", "<|im_end|>")  # lm-eval gsm8k.yaml generation_kwargs.until


def cut_at_new_turn(text: str) -> str:
    """The text before the model starts a new "Question:"/"Human:"/"User:" turn of its own."""
    return NEW_TURN.split(text, maxsplit=1)[0]


def as_number(text: str) -> Decimal | None:
    """'1,000.00' / '$18' / '18.' / '25%' -> Decimal; None when it is not a finite number ('NaN', 'inf', 'x')."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace("\\%", "").replace("%", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def numbers_equal(a: str, b: str) -> bool:
    """Numeric equivalence: '18.00' == '18'; anything that is not a number equals nothing."""
    x, y = as_number(a), as_number(b)
    return x is not None and y is not None and x == y


def final_number(text: str) -> str:
    """The GSM8K answer of a text, the one extractor every stage uses (calibration answers, self-generation filters,
    graders): '\\boxed{N}', else '#### N', else 'the answer is N', else the last number, read before any new turn;
    thousands separators, '$' and a trailing '.' dropped, the sign kept ('' if none)."""
    text = cut_at_new_turn(text)
    for pattern in (BOXED, STRICT, ANSWER_IS):
        found = pattern.findall(text)
        if found:
            return found[-1].replace(",", "").rstrip(".")
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").replace("$", "").rstrip(".") if found else ""


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in a text (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def grade_number(text: str, gold: str) -> bool:
    """Whether a generation's final number equals `gold` numerically."""
    return numbers_equal(final_number(text), gold)


def first_number(text: str) -> str:
    """The first number of the first non-empty line (short-answer arithmetic), '' if none."""
    lines = [line for line in cut_at_new_turn(text).splitlines() if line.strip()]
    found = NUMBER.findall(lines[0]) if lines else []
    return found[0] if found else ""


def triviaqa_cut(text: str) -> str:
    """A generation as lm-eval's triviaqa keeps it: up to the first stop string, leading whitespace removed."""
    for stop in TRIVIAQA_STOPS:  # lm-eval's HFLM: continuation.split(term)[0] for each term
        text = text.split(stop)[0]
    return text.lstrip()  # lm-eval's remove_whitespace filter


def normalize_short_answer(text: str) -> str:
    """lm-eval's exact_match normalisation with ignore_case and ignore_punctuation, whitespace collapsed."""
    table = str.maketrans("", "", string.punctuation)
    return " ".join(text.lower().translate(table).split())


def lm_eval_exact_match(prediction: str, alias: str) -> bool:
    """lm-eval's own exact_match (ignore_case, ignore_punctuation), as its triviaqa task scores."""
    from lm_eval.api.metrics import exact_match_hf_evaluate

    return bool(exact_match_hf_evaluate(predictions=[prediction], references=[alias], ignore_case=True,
                                        ignore_punctuation=True)["exact_match"])


def final_answer_text(text: str) -> str:
    """A reasoning model's answer: the text after its last '</think>', and the last \\boxed{...} in it if any."""
    text = text.rsplit("</think>", 1)[-1]
    boxed = BOXED_TEXT.findall(text)
    return boxed[-1] if boxed else text


def grade_short_answer(text: str, aliases: Sequence[str]) -> bool:
    """TriviaQA grading over every alias: lm-eval's exact match of the cut answer, or the normalised alias
    contained as whole words in the normalised answer (the first line of it); a reasoning model's
    '</think>' and '\\boxed{}' are read first."""
    text = final_answer_text(text)
    cut = triviaqa_cut(text)
    if any(lm_eval_exact_match(cut, alias) for alias in aliases):
        return True
    lines = [line for line in cut_at_new_turn(text).splitlines() if line.strip()]
    answer = f" {normalize_short_answer(lines[0])} " if lines else ""
    return any(normalize_short_answer(a) and f" {normalize_short_answer(a)} " in answer for a in aliases)
