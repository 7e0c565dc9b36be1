"""The one generator every stage uses: left-padded batches through `model.generate`, greedy by default.

A row ends at one of the model's end tokens (`generation_config.eos_token_id`, an id or a list, and the
tokenizer's eos; never a hard-coded token), at a stop string, or after `max_new_tokens`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 60.0  # a long generation (a variant's sampling: thousands of prompts) says how far it is
GREEDY: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
_CRITERIA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def end_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a generation: the model's `generation_config.eos_token_id` (an id or a list), then the
    tokenizer's eos token; each once."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    return list(dict.fromkeys(int(i) for i in [*ids, tokenizer.eos_token_id] if i is not None))


def cut_at_end(ids: Sequence[int], end_ids: Sequence[int], pad_id: int | None = None) -> list[int]:
    """The ids before the first end token, without the padding that follows a row a stop string ended."""
    ends = set(end_ids)
    kept = list(ids[: next((n for n, i in enumerate(ids) if i in ends), len(ids))])
    while kept and pad_id is not None and kept[-1] == pad_id:
        kept.pop()
    return kept


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """The text before the first of `stops` (lm-eval's `until`)."""
    for stop in stops:
        text = text.split(stop)[0]
    return text


def left_padded(tokenizer: Any, prompts: Sequence[str], add_special_tokens: bool = True) -> Any:
    """The prompts as one left-padded batch; the tokenizer's padding side is left as it was."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        return tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    finally:
        tokenizer.padding_side = side


def stop_criteria(tokenizer: Any, stops: Sequence[str]) -> Any:
    """Stop-string criteria, built once per tokenizer and stops (building one walks the whole vocabulary)."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    built = _CRITERIA.setdefault(tokenizer, {})
    key = tuple(stops)
    if key not in built:
        built[key] = StoppingCriteriaList([StopStringCriteria(tokenizer, list(key))])
    return built[key]


def generate_new_tokens(model: Any, tokenizer: Any, encoded: Mapping[str, torch.Tensor], max_new_tokens: int,
                        stop_strings: Sequence[str] = (), **generation: Any) -> torch.Tensor:
    """`model.generate` on an encoded batch; only the new tokens come back (finished rows padded).

    Greedy unless `generation` says otherwise (sampling settings, a logits processor, `min_new_tokens`, ...);
    rows end at `end_token_ids` and at `stop_strings`."""
    end_ids = end_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (end_ids or [None])[0]
    inputs = {name: value.to(model.device) for name, value in encoded.items()}
    stopping = {"stopping_criteria": stop_criteria(tokenizer, stop_strings)} if stop_strings else {}
    decoding = generation if generation.get("do_sample") else {**GREEDY, **generation}
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, eos_token_id=end_ids or None,
                             pad_token_id=pad, **stopping, **decoding)
    return out[:, inputs["input_ids"].shape[1]:]


def generate_ids(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                 stop_strings: Sequence[str] = (), add_special_tokens: bool = True,
                 **generation: Any) -> list[list[int]]:
    """The prompts as one left-padded batch: per prompt, the new token ids before its first end token."""
    encoded = left_padded(tokenizer, prompts, add_special_tokens)
    new = generate_new_tokens(model, tokenizer, encoded, max_new_tokens, stop_strings, **generation)
    end_ids = end_token_ids(model, tokenizer)
    return [cut_at_end(row, end_ids, tokenizer.pad_token_id) for row in new.tolist()]


def generate_greedy(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                    stop_strings: Sequence[str] | None = None, batch_size: int = 8, add_special_tokens: bool = True,
                    **generation: Any) -> list[str]:
    """Greedy continuations of `prompts` in left-padded batches of `batch_size`, decoded without the prompt
    and cut before the first stop string. `generation` overrides the greedy defaults (e.g. seeded sampling);
    `add_special_tokens=False` for prompts already rendered with a chat template."""
    stops = list(stop_strings or [])
    texts: list[str] = []
    began = said = time.monotonic()
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start: start + batch_size]
        rows = generate_ids(model, tokenizer, chunk, max_new_tokens, stops, add_special_tokens, **generation)
        texts += [cut_at_stops(text, stops) for text in tokenizer.batch_decode(rows, skip_special_tokens=True)]
        if time.monotonic() - said >= PROGRESS_EVERY_S and len(texts) < len(prompts):
            said = time.monotonic()
            log.info("generated %d of %d continuations (%.0f s)", len(texts), len(prompts), said - began)
    return texts
