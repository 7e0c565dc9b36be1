"""Ablation: how much worse the model gets when a block is skipped (NLL or exact-match accuracy)."""

from __future__ import annotations

from typing import Sequence

import torch

from layerprune.errors import LayerpruneError
from layerprune.models.blocks import skipped_blocks
from layerprune.prune.calib import CalibItem, extract_last_number
from layerprune.prune.forward import (FINAL, BlockInputs, candidate_losses, capture_block_inputs, masked_nll,
                                      prefix_states)
from layerprune.prune.scores import SCORES, ScoreContext, ScoreResult


@SCORES.register("ablation")
def ablation(ctx: ScoreContext) -> ScoreResult:
    """One-shot: score all blocks once; iterative: drop the cheapest block, re-score the rest, repeat."""
    measure = _nll_losses if ctx.metric == "nll" else _accuracy_losses
    kept = list(range(ctx.depth))
    cache: list[BlockInputs] = []
    if not ctx.iterative:
        base, losses = measure(ctx, kept, kept, cache)
        scores = [losses[i] - base for i in kept]
        drop = sorted(sorted((s, -i, i) for i, s in enumerate(scores) if i not in ctx.protected)[: ctx.drop])
        return ScoreResult(scores, sorted(i for _, _, i in drop), details={"base": base, "metric": ctx.metric})
    return _iterative(ctx, measure, kept, cache)


def _iterative(ctx: ScoreContext, measure, kept: list[int], cache: list[BlockInputs]) -> ScoreResult:  # noqa: ANN001
    steps: list[dict] = []
    first: dict[int, float] = {}
    for step in range(ctx.drop):
        candidates = [i for i in kept if i not in ctx.protected]
        base, losses = measure(ctx, kept, candidates, cache)
        chosen = min(candidates, key=lambda i: (losses[i], -i))
        steps.append({"step": step + 1, "base": base, "deltas": {i: losses[i] - base for i in candidates}, "dropped": chosen})
        first = first or {i: losses[i] - base for i in candidates}
        kept = [i for i in kept if i != chosen]
        if ctx.progress:
            ctx.progress(f"iterative step {step + 1}/{ctx.drop}: dropped block {chosen}", 0)
    scores = [first.get(i) for i in range(ctx.depth)]
    return ScoreResult(scores, sorted(s["dropped"] for s in steps), steps, {"metric": ctx.metric, "order": [s["dropped"] for s in steps]})


def _nll_losses(
    ctx: ScoreContext, kept: Sequence[int], candidates: Sequence[int], cache: list[BlockInputs]
) -> tuple[float, dict[int, float]]:
    """Mean NLL of the `kept` model, and of it with each candidate skipped (prefix reused)."""
    full = len(kept) == ctx.depth
    totals = {c: [0.0, 0] for c in [-1, *candidates]}
    with torch.inference_mode():
        for number, batch in enumerate(ctx.batches):
            inputs = cache[number] if number < len(cache) else capture_block_inputs(ctx.stack, batch, keep_hidden=full)
            if not full and number >= len(cache):
                cache.append(inputs)
            states = prefix_states(ctx.stack, inputs, kept)  # one pass gives every prefix and the base loss
            _add(totals[-1], masked_nll(ctx.stack, states[FINAL], batch))
            losses = candidate_losses(ctx.stack, inputs, kept, candidates, states, ctx.stack_candidates)
            for candidate, loss in losses.items():
                _add(totals[candidate], loss)
            if ctx.progress:
                ctx.progress("ablation", 1)
    means = {c: s / max(n, 1) for c, (s, n) in totals.items()}
    return means.pop(-1), means


def _add(total: list, loss: tuple[float, int]) -> None:
    total[0] += loss[0]
    total[1] += loss[1]


def _accuracy_losses(
    ctx: ScoreContext, kept: Sequence[int], candidates: Sequence[int], cache: list
) -> tuple[float, dict[int, float]]:
    """Error rate (1 - exact-match accuracy) of greedy answers with each candidate skipped."""
    items = [item for item in ctx.calib.items if item.expected is not None]
    if not items:
        raise LayerpruneError("--metric accuracy needs calibration items with answers (gsm8k, arithmetic, prompt+answer JSONL)")
    dropped = [i for i in range(ctx.depth) if i not in kept]
    base = 1.0 - greedy_accuracy(ctx, items, dropped)
    losses = {}
    for candidate in candidates:
        losses[candidate] = 1.0 - greedy_accuracy(ctx, items, sorted([*dropped, candidate]))
        if ctx.progress:
            ctx.progress("ablation", 1)
    return base, losses


def greedy_accuracy(ctx: ScoreContext, items: list[CalibItem], skip: list[int]) -> float:
    """Exact-match accuracy of greedy answers with `skip` blocks removed."""
    correct = 0
    with skipped_blocks(ctx.model, skip):
        for start in range(0, len(items), ctx.batch_size):
            chunk = items[start : start + ctx.batch_size]
            for item, text in zip(chunk, generate_greedy(ctx.model, ctx.tokenizer, [i.prompt for i in chunk], ctx.max_new_tokens)):
                correct += extract_last_number(text.split(item.stop)[0]) == item.expected
    return correct / len(items)


def generate_greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:  # noqa: ANN001
    """Batched greedy continuations (left padding), decoded without the prompt."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    finally:
        tokenizer.padding_side = side
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None)
    return tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
