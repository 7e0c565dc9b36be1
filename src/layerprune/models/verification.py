"""The verification prompts every serving check uses, transformers' answers to them (the reference), and the one
verdict every engine (vLLM, llama.cpp, transformers' GGUF read-back, a quantized export) is given against them.

The reference is transformers' greedy continuation of each prompt (cut at the model's end tokens) and its logits,
teacher-forced, at every position of prompt + continuation. An engine is compared at each of those positions by its
top-1 token. Where transformers' top-2 margin (the same in logits and in log-probs) is below a stated threshold the
position is a near-tie: counted, not compared, since any rounding may flip it. A top-1 difference above the threshold
reads "different"; else the engine is "equal", or "equal up to N near-ties" where N near-ties flipped. The greedy
continuations are compared too, both cut at the same end tokens; one that parts at a near-tie is such a flip.
One prompt at a time, so no padding enters the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.generate import cut_at_end, end_token_ids, generate_ids, generate_new_tokens

VERIFY_PROMPTS = (
    "The capital of France is",
    "Question: What is 12 plus 7?\nAnswer:",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)
VERIFY_TOKENS = 16
# nats: transformers' top-1 minus top-2 logit below which a position is a near-tie, by the engine's encoding (a flip
# needs an error of half the margin in both logits). On SmolLM2-135M (bench/bench_verdict.py): bfloat16 rounding of
# every weight moves a logit by up to 0.23 and flips margins of 0.005 and 0.012, Q8_0-style rounding by up to 1.1,
# flipping 0.005-0.038; one q head reversed flips margins of 0.08-0.40, one k head's rotary pairs left unpermuted
# 0.28 and 0.31, one norm scaled by 0.8 up to 1.04.
NEAR_TIE: dict[str, float] = {"float32": 0.05, "float16": 0.25, "bfloat16": 0.25, "q8_0": 0.25}
LOSSY_NEAR_TIE = 1.0  # 2- to 6-bit types: their rounding is what the KL bound checks (export/quantize.py)
LISTED = 8  # differing positions listed in a verdict


@dataclass
class Reference:
    """transformers' answers, per prompt: the prompt's ids, the greedy continuation (cut at `end_ids`), and the
    teacher-forced logits and top-1 token at every position of prompt + continuation."""

    prompt_ids: list[list[int]]
    continuations: list[list[int]]
    top1: list[list[int]]
    logits: list[torch.Tensor]
    end_ids: list[int]
    max_new_tokens: int = VERIFY_TOKENS

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt + continuation, per prompt: what an engine is teacher-forced on."""
        return [p + c for p, c in zip(self.prompt_ids, self.continuations, strict=True)]

    def margins(self) -> list[torch.Tensor]:
        """transformers' top-1 minus top-2 logit at every position, per prompt."""
        return [row.topk(2, dim=-1).values.diff(dim=-1).neg().squeeze(-1) for row in self.logits]


def near_tie_for(encoding: str) -> float:
    """The near-tie threshold for an engine's weights or compute in `encoding` (a torch dtype or a GGUF type)."""
    name = encoding.lower().removeprefix("torch.")
    name = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(name, name)
    return NEAR_TIE.get(name, LOSSY_NEAR_TIE)


def prompt_ids(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts]


def teacher_forced_logits(model: Any, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """`model`'s float32 logits at every position of each sequence (one at a time: no padding)."""
    with torch.inference_mode():
        return [model(torch.tensor([list(row)], device=model.device)).logits[0].float().cpu() for row in sequences]


def reference(model: Any, tokenizer: Any, prompts: Sequence[str] = VERIFY_PROMPTS,
              max_new_tokens: int = VERIFY_TOKENS) -> Reference:
    """Greedy continuations (cut at the model's end tokens) and teacher-forced logits of prompt + continuation."""
    ids = prompt_ids(tokenizer, prompts)
    continuations = [generate_ids(model, tokenizer, [p], max_new_tokens)[0] if max_new_tokens else []
                     for p in prompts]
    logits = teacher_forced_logits(model, [p + c for p, c in zip(ids, continuations, strict=True)])
    return Reference(ids, continuations, [row.argmax(-1).tolist() for row in logits], logits,
                     end_token_ids(model, tokenizer), max_new_tokens)


def transformers_verdict(model: Any, tokenizer: Any, expected: Reference, near_tie: float = NEAR_TIE["float32"]
                         ) -> dict[str, Any]:
    """`compare` for another transformers model (a GGUF read back, a test's planted error): its teacher-forced logits
    on transformers' sequences and its own greedy continuations of the prompt ids."""
    logits = teacher_forced_logits(model, expected.sequences)
    continuations = [greedy_from_ids(model, tokenizer, ids, expected.max_new_tokens)
                     for ids in expected.prompt_ids] if expected.max_new_tokens else None
    return compare(expected, [row.argmax(-1).tolist() for row in logits], continuations,
                   {"max_abs_logit_diff": max_abs_error(expected.logits, logits)}, near_tie)


def greedy_from_ids(model: Any, tokenizer: Any, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """`model`'s greedy new tokens after the prompt `ids`, as generated (its own end token and padding kept)."""
    row = torch.tensor([list(ids)])
    new = generate_new_tokens(model, tokenizer, {"input_ids": row, "attention_mask": torch.ones_like(row)},
                              max_new_tokens)
    return new[0].tolist()


def agreement(expected: list[list[int]], found: list[list[int]]) -> dict[str, Any]:
    """How many rows are equal, and per row the first position where they part (None when equal)."""
    parted = [next((n for n, (a, b) in enumerate(zip(e, f, strict=False)) if a != b),
                   None if len(e) == len(f) else min(len(e), len(f))) for e, f in zip(expected, found, strict=True)]
    return {"equal": sum(p is None for p in parted), "of": len(parted), "first_difference": parted}


def max_abs_error(expected: Sequence[torch.Tensor], found: Sequence[torch.Tensor]) -> float:
    """The largest |transformers' logit - the engine's| over every position; one line when the widths differ."""
    for e, f in zip(expected, found, strict=True):
        if e.shape != f.shape:
            raise LayerpruneError(f"the engine's logits are {tuple(f.shape)}, transformers' {tuple(e.shape)} "
                                  "(its vocabulary or positions are not the model's)")
    return round(max((e - f).abs().max().item() for e, f in zip(expected, found, strict=True)), 5)


def compare(expected: Reference, top1: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]] | None = None,
            error: dict[str, float] | None = None, near_tie: float = NEAR_TIE["float32"]) -> dict[str, Any]:
    """The verdict of an engine against transformers.

    `top1`: the engine's top-1 at every position of `expected.sequences` (teacher-forced); `continuations`: its
    greedy continuations of the prompts (cut here at transformers' end tokens; None when not run); `error`: its
    largest logit (or log-prob) error, by name. Only "different" fails (`passed`)."""
    margins = expected.margins()
    differing, flipped = _top1_differences(expected, top1, margins, near_tie)
    result: dict[str, Any] = {"near_tie_threshold": near_tie, "positions": sum(len(m) for m in margins)}
    decisive = sum(int((m >= near_tie).sum()) for m in margins)
    result |= {"top1_agreement": f"{decisive - len(differing)}/{decisive}",
               "near_ties": result["positions"] - decisive, **(error or {})}
    if continuations is not None:
        cut = [cut_at_end(row, expected.end_ids) for row in continuations]
        parted = agreement(expected.continuations, cut)
        at_tie = _parted_at_near_tie(expected, parted["first_difference"], margins, near_tie)
        differing |= {(n, len(expected.prompt_ids[n]) - 1 + p) for n, (p, tie) in
                      enumerate(zip(parted["first_difference"], at_tie, strict=True)) if p is not None and not tie}
        flipped |= {(n, len(expected.prompt_ids[n]) - 1 + p) for n, (p, tie) in
                    enumerate(zip(parted["first_difference"], at_tie, strict=True)) if tie}
        result["continuations"] = {**parted, "parted_at_near_tie": at_tie, "transformers": expected.continuations,
                                   "engine": cut}
    flipped -= differing
    result["near_ties_differing"] = len(flipped)
    result["differing"] = [list(p) for p in sorted(differing)[:LISTED]]  # [prompt, position]
    result["verdict"] = verdict_text(len(differing), len(flipped))
    result["passed"] = not differing
    return result


def verdict_text(differing: int, flipped: int) -> str:
    """"different" where a top-1 differs above the threshold; else "equal", or "equal up to N near-ties"."""
    if differing:
        return "different"
    return f"equal up to {flipped} near-tie{'s' * (flipped != 1)}" if flipped else "equal"


def _top1_differences(expected: Reference, top1: Sequence[Sequence[int]], margins: list[torch.Tensor],
                      near_tie: float) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(prompt, position) pairs where the engine's top-1 is not transformers': above the threshold, and below it."""
    differing, flipped = set(), set()
    for n, (want, got, margin) in enumerate(zip(expected.top1, top1, margins, strict=True)):
        if len(got) != len(want):
            raise LayerpruneError(f"the engine gave {len(got)} top-1 tokens for prompt {n}, not {len(want)}")
        for position, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                (differing if margin[position] >= near_tie else flipped).add((n, position))
    return differing, flipped


def _parted_at_near_tie(expected: Reference, parted: list[int | None], margins: list[torch.Tensor],
                        near_tie: float) -> list[bool]:
    """Per prompt: whether the continuations part where transformers' next token was a near-tie."""
    return [p is not None and bool(margin[len(ids) - 1 + p] < near_tie)
            for ids, p, margin in zip(expected.prompt_ids, parted, margins, strict=True)]
