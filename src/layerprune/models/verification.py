"""The verification prompts every serving check uses, and transformers' answers to them (the reference).

A served or exported model is checked against transformers on these prompts: the greedy continuation (token ids)
and the top-1 next token at every prompt position. One prompt at a time, so no padding enters the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerprune.models.generate import generate_ids

VERIFY_PROMPTS = (
    "The capital of France is",
    "Question: What is 12 plus 7?\nAnswer:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)
VERIFY_TOKENS = 16


@dataclass
class Reference:
    """transformers' greedy continuation ids, and its top-1 token at each prompt position, per prompt."""

    prompt_ids: list[list[int]]
    continuations: list[list[int]]
    top1: list[list[int]]
    logits: list[torch.Tensor]


def prompt_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts]


def reference(model: Any, tokenizer: Any, prompts: Sequence[str] = VERIFY_PROMPTS,
              max_new_tokens: int = VERIFY_TOKENS) -> Reference:
    """Greedy continuations (cut at the model's end tokens) and per-position logits of `prompts`."""
    ids = prompt_ids(tokenizer, prompts)
    continuations = [generate_ids(model, tokenizer, [p], max_new_tokens)[0] if max_new_tokens else []
                     for p in prompts]
    with torch.inference_mode():
        logits = [model(torch.tensor([row], device=model.device)).logits[0].float().cpu() for row in ids]
    return Reference(ids, continuations, [row.argmax(-1).tolist() for row in logits], logits)


def agreement(expected: list[list[int]], found: list[list[int]]) -> dict[str, Any]:
    """How many rows are equal, and per row the first position where they part (None when equal)."""
    parted = [next((n for n, (a, b) in enumerate(zip(e, f, strict=False)) if a != b),
                   None if len(e) == len(f) else min(len(e), len(f))) for e, f in zip(expected, found, strict=True)]
    return {"equal": sum(p is None for p in parted), "of": len(parted), "first_difference": parted}
