"""Pure measures used by `analyze`: drops, critical sets, rank correlation, overlap, elbow, degeneration.

Everything here works on plain Python numbers and strings (no model, no torch), so each function is
unit-tested against values computed by hand.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

WORD = re.compile(r"\w+|[^\w\s]")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def answer_probability(mean_nll: float) -> float:
    """Geometric-mean probability of the scored tokens, exp(-mean NLL): an accuracy-like score in (0, 1]."""
    return math.exp(-mean_nll)


def relative_drops(base: float, ablated: Sequence[float]) -> list[float]:
    """(base - ablated) / base for each ablated score (higher-is-better scores); 0 when base is 0."""
    if base == 0:
        return [0.0 for _ in ablated]
    return [(base - value) / base for value in ablated]


def critical_blocks(drops: Sequence[float], threshold: float) -> list[int]:
    """Indices whose relative drop is strictly above `threshold`."""
    return [index for index, drop in enumerate(drops) if drop > threshold]


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman rank correlation (scipy; ties share their mean rank); None when undefined (fewer than 2 values,
    or one side constant)."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs equal lengths, got {len(x)} and {len(y)}")
    if len(x) < 2 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


def jaccard(a: set[int] | Sequence[int], b: set[int] | Sequence[int]) -> float | None:
    """|A & B| / |A | B|; None when both sets are empty (nothing to compare)."""
    a, b = set(a), set(b)
    if not a and not b:
        return None
    return len(a & b) / len(a | b)


def relative_depth_map(depth: int, grid: int) -> list[int]:
    """For each of `grid` rows at relative depth (r + 0.5) / grid, the block of a `depth`-block model there."""
    return [min(depth - 1, int((row + 0.5) / grid * depth)) for row in range(grid)]


def align_by_depth(values: Sequence[float], grid: int) -> list[float]:
    """Resample per-block values onto `grid` rows by relative depth (identity when the depths match)."""
    return [values[block] for block in relative_depth_map(len(values), grid)]


def align_blocks(blocks: Sequence[int], depth: int, grid: int) -> set[int]:
    """Grid rows that fall on any of `blocks` of a `depth`-block model."""
    chosen = set(blocks)
    return {row for row, block in enumerate(relative_depth_map(depth, grid)) if block in chosen}


def largest_drop(series: Sequence[float], start: int = 1) -> int | None:
    """Index i >= start maximising series[i-1] - series[i] (the elbow); None when there is no such step.

    `start=2` leaves the first step (embeddings -> after block 0) out."""
    if len(series) <= max(start, 1):
        return None
    return max(range(max(start, 1), len(series)), key=lambda i: series[i - 1] - series[i])


def distance_to_nearest(block: int | None, blocks: Sequence[int]) -> int | None:
    """|block - b| for the nearest b of `blocks`; None when either is missing."""
    if block is None or not blocks:
        return None
    return min(abs(block - b) for b in blocks)


def words(text: str) -> list[str]:
    """Lower-cased word and punctuation tokens."""
    return WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def rep_n(tokens: Sequence[str], n: int) -> float | None:
    """Share of repeated n-grams in one response: 1 - unique / total; None when it has no n-gram."""
    grams = ngrams(tokens, n)
    if not grams:
        return None
    return 1 - len(set(grams)) / len(grams)


def split_sentences(text: str) -> list[str]:
    """Sentences split at . ! ? followed by space, and at line breaks; empty pieces dropped."""
    return [part.strip() for part in SENTENCE_END.split(text) if part.strip()]


def self_bleu(text: str, max_n: int = 4) -> float | None:
    """Mean sentence BLEU-`max_n` of each sentence against the other sentences of the same response, in [0, 1];
    None under 2 sentences. sacrebleu on `words` tokens: clipped counts, brevity penalty against the closest
    reference length, an order without matches floored to 0.1 matches, and a sentence shorter than `max_n` tokens
    scored on the orders it has (sacrebleu's effective order)."""
    from sacrebleu.metrics import BLEU

    sentences = [" ".join(words(s)) for s in split_sentences(text)]
    sentences = [s for s in sentences if s]
    if len(sentences) < 2:
        return None
    bleu = BLEU(max_ngram_order=max_n, smooth_method="floor", smooth_value=0.1, tokenize="none", effective_order=True)
    scores = [bleu.sentence_score(s, sentences[:i] + sentences[i + 1 :]).score / 100 for i, s in enumerate(sentences)]
    return sum(scores) / len(scores)


def mean_or_none(values: Sequence[float | None]) -> float | None:
    """Mean of the defined values; None when none is defined."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def degeneration_stats(outputs: Sequence[str]) -> dict[str, float | int | None]:
    """rep-2/3/4 and self-BLEU-4 (means over responses where defined) and mean length in words."""
    tokenized = [words(text) for text in outputs]
    stats: dict[str, float | int | None] = {"responses": len(outputs)}
    for n in (2, 3, 4):
        stats[f"rep_{n}"] = mean_or_none([rep_n(tokens, n) for tokens in tokenized])
    stats["self_bleu_4"] = mean_or_none([self_bleu(text) for text in outputs])
    stats["mean_length_words"] = mean_or_none([float(len(tokens)) for tokens in tokenized])
    return stats


STUDY_MIN_SENTENCE_TOKENS = 4


def study_tokens(text: str) -> list[str]:
    """nltk's word tokenizer (Treebank rules, no downloaded data), lower-cased."""
    from nltk.tokenize import NLTKWordTokenizer

    return [token.lower() for token in NLTKWordTokenizer().tokenize(text)]


def study_self_bleu(text: str) -> float | None:
    """The pruning study's self-BLEU-4: nltk tokens, sentences under 4 tokens dropped, nltk's sentence_bleu
    (uniform weights, smoothing method1) of each sentence against the others, mean x 100; None under 2 sentences."""
    from nltk.translate.bleu_score import SmoothingFunction
    from nltk.translate.bleu_score import sentence_bleu as nltk_bleu

    sentences = [study_tokens(s) for s in split_sentences(text)]
    sentences = [s for s in sentences if len(s) >= STUDY_MIN_SENTENCE_TOKENS]
    if len(sentences) < 2:
        return None
    smooth = SmoothingFunction().method1
    scores = [nltk_bleu(sentences[:i] + sentences[i + 1 :], s, smoothing_function=smooth)
              for i, s in enumerate(sentences)]
    return 100 * sum(scores) / len(scores)


def study_degeneration_stats(outputs: Sequence[str]) -> dict[str, float | None]:
    """rep-2/3/4 on nltk tokens and the study's self-BLEU-4, both x 100 (means over responses where defined)."""
    tokenized = [study_tokens(text) for text in outputs]
    stats: dict[str, float | None] = {}
    for n in (2, 3, 4):
        value = mean_or_none([rep_n(tokens, n) for tokens in tokenized])
        stats[f"study_rep_{n}"] = None if value is None else 100 * value
    stats["study_self_bleu_4"] = mean_or_none([study_self_bleu(text) for text in outputs])
    return stats
