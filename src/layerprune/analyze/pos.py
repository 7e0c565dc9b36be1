"""Part-of-speech groups of the calibration tokens: the NMI's syntactic reference.

The tagger is TextBlob's bundled port of pattern.en (MIT; its lexicon and contextual rules are Brill's rule-based
tagger v1.14, trained on the Brown corpus and the Penn Treebank, MIT/UPenn licence), which ships its model inside
the wheel, so it runs offline. Its Penn tags are mapped to coarse universal groups (noun, verb, adjective, adverb,
pronoun, determiner, adposition, number, conjunction, particle, interjection, punctuation). A model token takes the
group of the tagged word its first non-space character falls in; tokens in no word (spaces, line breaks, the cut
left edge) have no group and are left out of the comparison.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from layerprune.analyze.tasks import TaskItem
from layerprune.core.errors import LayerpruneError

TAGGER_MODULE = "textblob"
TAGGER = "TextBlob's pattern.en tagger (Brill lexicon and rules, Penn tags -> universal groups)"


def tagger_missing() -> str | None:
    """Why no part-of-speech reference can be computed here, or None when it can."""
    if importlib.util.find_spec(TAGGER_MODULE) is None:
        return "textblob is not installed (pip install 'layerprune[analyze]')"
    return None


def word_groups(text: str) -> list[tuple[int, int, str]]:
    """(start, end, universal group) of each word the tagger finds in `text`, located in order."""
    from textblob._text import penntreebank2universal
    from textblob.en import tag

    spans, cursor = [], 0
    for word, penn in tag(text, tokenize=True):
        start = text.find(word, cursor)
        if start < 0:  # the tokenizer rewrote the word (e.g. quotes): it has no span, and its tokens no group
            continue
        spans.append((start, start + len(word), penntreebank2universal(word, penn)[1]))
        cursor = start + len(word)
    return spans


def token_spans(tokenizer: Any, text: str, special: bool) -> list[tuple[int, int]]:
    """Character span of each token of `text` as the tokenizer encodes it ((0, 0) for special tokens)."""
    if not getattr(tokenizer, "is_fast", False):
        raise LayerpruneError("the part-of-speech reference needs a fast tokenizer (character offsets)")
    encoded = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    return [tuple(span) for span in encoded["offset_mapping"]]


def group_of(span: tuple[int, int], text: str, words: Sequence[tuple[int, int, str]]) -> str | None:
    """The group of the word holding the token's first non-space character."""
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    if start >= end:
        return None
    for word_start, word_end, group in words:
        if word_start <= start < word_end:
            return group
        if word_start > start:
            break
    return None


def item_groups(tokenizer: Any, item: TaskItem, max_length: int) -> list[str | None]:
    """One group (or None) per token of the item, in `walk.encode_item`'s order and cut."""
    text = item.prompt + item.target
    words = word_groups(text)
    prompt = token_spans(tokenizer, item.prompt, special=True)
    target = [(s + len(item.prompt), e + len(item.prompt))
              for s, e in token_spans(tokenizer, item.target, special=False)][: max_length - 1]
    keep = max(1, max_length - len(target))
    return [group_of(span, text, words) for span in prompt[-keep:] + target]


def token_groups(tokenizer: Any, items: Sequence[TaskItem], max_length: int,
                 skip_first: bool = True) -> list[str | None]:
    """Groups of every token `walk.token_states` returns, in its order (items in order, the first token of each
    sequence left out when `skip_first`)."""
    groups: list[str | None] = []
    for item in items:
        groups += item_groups(tokenizer, item, max_length)[1 if skip_first else 0 :]
    return groups
