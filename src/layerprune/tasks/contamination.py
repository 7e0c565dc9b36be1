"""Text normalized for contamination checks, and the probe families' templates found in any text.

Two normalizations, one per kind of scored item:

- a document (ARC, PIQA, GSM8K...): `janitor_tokens`, lm-eval's decontamination normalization (its Janitor, after
  GPT-3): case folded, punctuation dropped, whitespace collapsed; here punctuation becomes a space rather than being
  deleted, so that 'x-rays' and 'x rays' and 'k,d' and 'k d' read alike. Its n-grams are then matched.
- a probe item (a few symbols in a fixed template): its *payload*, the values the template holds ('81 - 50 =' holds
  81 and 50 under the shape '<2> - <2>', digits to a placeholder of their length; 'Input: k d m\\nCopy:' the letters
  k d m under 'letters:3'), found wherever the family's template stands in a text, whatever the wording around it:
  GPT-3's arithmetic check searched its training data for '<NUM1> + <NUM2> =' and '<NUM1> plus <NUM2>' alike.
  So 'What is 81 - 50?', '81 minus 50 =', 'k, d, m', '[K, D, M]' and 'Repeat: k d m' are each the item they hold,
  and a sum of two holds its addends in order ('50 + 31 =' is the item '31 + 50 ='). Not a sum of three one-digit
  addends: its 165 sets of addends are nearly all among the 500 ordered evaluation items, so in any order every such
  question would be an item.

A template is specific on purpose: an arithmetic expression counts only when an '=' or a '?' follows it or a cue
('what is', 'compute', 'calculate', 'evaluate', 'solve') precedes it, so '1990 - 2000' or 'pages 12 - 15' in prose
are not arithmetic questions; a list is at least MIN_RUN single letters (or count words) in a row ('U.S.A.' is an
abbreviation), a bracket sequence at least MIN_RUN opening brackets in a row that no word follows at once ('((roughly))'
is prose). A payload matches an item only whole (the maximal run, not a part of a longer one): the item is the unit.

Near duplicates: a payload of the same shape with exactly one value changed (one letter, one number, one bracket).
Whether that is evidence depends on how crowded the family is: among two-digit subtractions most questions are one
number away from some evaluated item, among 7-letter lists almost none is; `near_expected` gives how many items
would have a neighbour by chance if the recovery's payloads of that shape were random draws.
"""

from __future__ import annotations

import math
import re
import string
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from layerprune.tasks.probes import BRACKETS, CALIB_BRACKETS, COUNT_WORDS, LETTERS

MIN_RUN = 2  # a list or bracket sequence this long or longer is a template instance (every probe item's is)
OPENING = "".join(CALIB_BRACKETS)
OPERATORS = {"+": "+", "-": "-", "*": "*", "plus": "+", "minus": "-", "times": "*", "x": "*"}
CUES = (("what", "is"), ("compute",), ("calculate",), ("evaluate",), ("solve",))
TOKEN = re.compile(r"\d+|[a-z]+|[-+*=?.()\[\]{}<>]")
ID_LIKE = re.compile(r"[\w./:-]*")
OPEN_RUN = re.compile(r"[(\[{<](?:[ \t,]*[(\[{<])*")
SYMBOLS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u00d7": "*", "\u22c5": "*"})
_PUNCTUATION = str.maketrans({ch: " " for ch in string.punctuation})


@dataclass(frozen=True)
class Payload:
    """The values a probe template holds and its shape: 'arith:<2> - <2>' (numbers placeholdered by their digit
    count), 'letters:7', 'words:4' or 'open:6'."""

    shape: str
    values: tuple[str, ...]


def janitor_tokens(text: str) -> list[str]:
    """lm-eval's decontamination normalization: NFKC, case folded, punctuation to spaces, split on whitespace."""
    return unicodedata.normalize("NFKC", text).lower().translate(_PUNCTUATION).split()


def symbol_tokens(text: str) -> list[str]:
    """Numbers, words and the operator, '=', '?', '.' and bracket symbols of a text, case folded; commas, quotes,
    colons and whitespace dropped (they separate, they do not identify). A '.' is kept so that abbreviations ('U.S.A.',
    'e.g.') are not letter lists."""
    return TOKEN.findall(unicodedata.normalize("NFKC", text).lower().translate(SYMBOLS))


def find_payloads(text: str) -> list[Payload]:
    """Every probe template instance in `text`: arithmetic questions, letter lists, count-word lists, bracket
    sequences (their maximal runs)."""
    tokens = symbol_tokens(text)
    return [*_arithmetic(tokens), *_runs(tokens, set(LETTERS), "letters"), *_runs(tokens, set(COUNT_WORDS), "words"),
            *_bracket_runs(unicodedata.normalize("NFKC", text))]


def _bracket_runs(text: str) -> list[Payload]:
    """Maximal runs of opening brackets (spaces or commas between them allowed) that no word or quote follows at once
    and no name precedes: '( [ {' and '([{' are sequences; '((roughly))', code ('f([x', 'g([], 4)', 'h(['a'') and
    JSON ('[{"a": 1}]') are not."""
    found = []
    for match in OPEN_RUN.finditer(text):
        values = tuple(ch for ch in match.group() if ch in OPENING)
        after, before = text[match.end():match.end() + 1], text[max(match.start() - 1, 0):match.start()]
        followed = after.isalnum() or after in ("_", "'", '"')  # a word or a string literal at once
        named = before.isalnum() or before == "_"  # a call or an index: f([, x[(
        if len(values) >= MIN_RUN and not followed and not named:
            found.append(Payload(f"open:{len(values)}", values))
    return found


def _runs(tokens: Sequence[str], alphabet: set[str], kind: str) -> list[Payload]:
    found, run = [], []
    for token in [*tokens, ""]:
        if token in alphabet:
            run.append(token)
            continue
        if len(run) >= MIN_RUN:
            found.append(Payload(f"{kind}:{len(run)}", tuple(run)))
        run = []
    return found


def _arithmetic(tokens: Sequence[str]) -> list[Payload]:
    """Maximal runs of numbers joined by operators (parentheses allowed) in a question's context."""
    found, i = [], 0
    while i < len(tokens):
        end = _expression_end(tokens, i)
        if end > i and sum(t.isdigit() for t in tokens[i:end]) >= 2 and _asked(tokens, i, end):
            expression = list(tokens[i:end])
            if len(expression) == 3 and OPERATORS.get(expression[1]) == "+":  # a sum of two: its addends in order
                expression = [*sorted(expression[::2], key=int)[:1], "+", *sorted(expression[::2], key=int)[1:]]
            shape = " ".join(f"<{len(t)}>" if t.isdigit() else OPERATORS.get(t, t) for t in expression)  # in order
            found.append(Payload(f"arith:{shape}", tuple(t for t in expression if t.isdigit())))
        i = max(end, i + 1)
    return found


def _expression_end(tokens: Sequence[str], start: int) -> int:
    """The end of an expression 'a op b [op c]' (parentheses allowed) starting at `start`, or `start` if none."""
    depth, expect_number, last_number, operators, i = 0, True, start, 0, start
    while i < len(tokens):
        token = tokens[i]
        if expect_number and token == "(":
            depth += 1
        elif expect_number and token.isdigit():
            expect_number, last_number = False, i + 1
        elif not expect_number and token == ")" and depth > 0:
            depth, last_number = depth - 1, i + 1
        elif not expect_number and token in OPERATORS and (token != "x" or _next_is_number(tokens, i)):
            expect_number, operators = True, operators + 1
        else:
            break
        i += 1
    return last_number if operators and depth == 0 and (tokens[start] == "(" or tokens[start].isdigit()) else start


def _next_is_number(tokens: Sequence[str], i: int) -> bool:
    return i + 1 < len(tokens) and tokens[i + 1].isdigit()


def _asked(tokens: Sequence[str], start: int, end: int) -> bool:
    """An '=' or '?' right after the expression, or a cue right before it."""
    if end < len(tokens) and tokens[end] in ("=", "?"):
        return True
    return any(tuple(tokens[max(0, start - len(cue)):start]) == cue for cue in CUES)


def document_strings(value: Any) -> list[str]:
    """The strings of a logged document (or one of its fields), nested lists and dicts (ARC's choices) walked in
    order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in document_strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in document_strings(v)]
    return []


def identifying(text: str) -> bool:
    """Whether a document's string can identify it, not an id or a label ('Mercury_7175875', 'B', '1'): text with a
    space, or a word without digits or '_'."""
    text = " ".join(text.split())
    return bool(text) and not (ID_LIKE.fullmatch(text) and (len(text) <= 2 or re.search(r"[\d_]", text)))


def item_payload(question: str, family: str) -> Payload | None:
    """The payload of a probe item's question: its arithmetic expression, its list or its bracket sequence (by
    family), or None when the question holds none."""
    kind = {"copy": "letters", "reverse": "letters", "count": "words", "brackets": "open",
            "brackets_mix": "open"}.get(family, "arith")
    found = [p for p in find_payloads(question) if p.shape.startswith(f"{kind}:")]
    return found[-1] if found else None


def alphabet_size(shape: str, position: int) -> int:
    """How many values the `position`-th value of a payload of `shape` takes in the evaluation items' families."""
    kind, _, rest = shape.partition(":")
    if kind == "arith":
        digits = int(re.findall(r"<(\d+)>", rest)[position])
        return 9 * 10 ** (digits - 1)
    return {"letters": len(LETTERS), "words": len(COUNT_WORDS), "open": len(BRACKETS)}[kind]


class PayloadIndex:
    """The payloads of a collection of texts, exact and with each position wildcarded (for near duplicates)."""

    def __init__(self, payloads: Iterable[Payload]) -> None:
        self.exact: set[Payload] = set()
        self.wild: dict[tuple[str, int, tuple[str, ...]], set[str]] = defaultdict(set)
        self.shapes: dict[str, int] = defaultdict(int)
        for payload in set(payloads):
            self.exact.add(payload)
            self.shapes[payload.shape] += 1
            for i, value in enumerate(payload.values):
                self.wild[(payload.shape, i, payload.values[:i] + payload.values[i + 1:])].add(value)

    def near(self, payload: Payload) -> bool:
        """Whether a payload of the same shape with exactly one value changed is in the index."""
        return any(self.wild.get((payload.shape, i, payload.values[:i] + payload.values[i + 1:]), set()) - {value}
                   for i, value in enumerate(payload.values))


def near_chance(payload: Payload, draws: int) -> float:
    """The probability that one of `draws` random payloads of its shape is exactly one value from `payload`."""
    sizes = [alphabet_size(payload.shape, i) for i in range(len(payload.values))]
    neighbours, space = sum(size - 1 for size in sizes), math.prod(sizes)
    return 1 - (1 - min(1.0, neighbours / space)) ** draws


def poisson_tail(observed: int, expected: float) -> float:
    """P(X >= observed) for X ~ Poisson(expected): how often chance alone gives this many near items."""
    if observed <= 0:
        return 1.0
    if expected <= 0:
        return 0.0
    below = sum(math.exp(k * math.log(expected) - expected - math.lgamma(k + 1)) for k in range(observed))
    return max(0.0, 1 - below)
