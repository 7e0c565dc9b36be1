"""Importance scores of attention and MLP sublayers, registered by name. Higher score = more important.

The scores that make sense for one sublayer: ablation (NLL or accuracy, one-shot or iterative, prefix reused),
block influence of the sublayer's residual update, angular distance across it, and the data-free baselines.
Taylor and the contiguous-run angular of Gromov et al. rank whole blocks only (the recipe refuses them here).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import Registry
from layerprune.models.nas_surgery import removal_refusal
from layerprune.models.sublayer_walker import (
    residual_around_sublayers,
    sublayer_candidate_measures,
    sublayer_prefix_states,
)
from layerprune.models.sublayers import Part, Sublayer, all_sublayers, skipped_sublayers
from layerprune.models.walker import BlockInputs, capture_block_inputs, masked_nll
from layerprune.prune.calib import CalibItem, is_short_answer
from layerprune.prune.metrics import accumulate, angular_distance, block_influence, last_token_mask, mean
from layerprune.prune.scores import ScoreContext
from layerprune.prune.scores.ablation import correct_per_key, greedy_correct

BASE = None  # the key of the model without a further removal, beside the candidates'


@dataclass
class SublayerResult:
    """Scores per sublayer (one-shot, or the first round of an iterative run), the sublayers chosen, and the rounds."""

    scores: dict[Sublayer, float | None]
    drop: list[Sublayer]
    steps: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


SublayerScoreFn = Callable[[ScoreContext, Sequence[Part]], SublayerResult]
SUBLAYER_SCORES: Registry[SublayerScoreFn] = Registry("sublayer score")


def score_sublayers(name: str, ctx: ScoreContext, parts: Sequence[Part]) -> SublayerResult:
    """Run the named score over the `parts` ("attn", "mlp") of every block; choose `ctx.drop` unprotected ones whose
    removal the Nemotron-NAS layout serves (`servable_lowest`)."""
    return SUBLAYER_SCORES.get(name)(ctx, parts)


def candidates(
    depth: int, parts: Sequence[Part], protected: Sequence[int], removed: Sequence[Sublayer] = ()
) -> list[Sublayer]:
    """The sublayers that may still go: of unprotected blocks, not removed yet."""
    return [sub for sub in all_sublayers(depth, parts) if sub.block not in protected and sub not in removed]


def servable_lowest(
    scores: Mapping[Sublayer, float | None], n: int, depth: int, removed: Sequence[Sublayer] = ()
) -> list[Sublayer]:
    """The `n` lowest-scored sublayers (sorted) that the Nemotron-NAS layout serves removed together with `removed`
    (`servable_order`); fewer only when no more can go."""
    return sorted(servable_order(scores, depth, removed, n))


def servable_order(
    scores: Mapping[Sublayer, float | None], depth: int, removed: Sequence[Sublayer] = (), n: int | None = None
) -> list[Sublayer]:
    """The scored sublayers, least important first, each next one the lowest whose removal with `removed` and those
    before it the layout takes (`removal_refusal`): every prefix is servable, and none longer is (at most `n`).
    Ties go to the later sublayer; None and NaN are never taken."""
    pool = sorted((sub for sub, s in scores.items() if s is not None and not math.isnan(s)), reverse=True)
    skip = set(removed)
    ranked = [sub for sub in sorted(pool, key=lambda sub: float(scores[sub])) if sub not in skip]  # type: ignore[arg-type]
    chosen, order = list(removed), []
    while ranked and (n is None or len(order) < n):
        nxt = next((sub for sub in ranked if removal_refusal(depth, [*chosen, sub]) is None), None)
        if nxt is None:
            break
        ranked.remove(nxt)
        chosen.append(nxt)
        order.append(nxt)
    return order


def _chosen(ctx: ScoreContext, scores: dict[Sublayer, float | None]) -> list[Sublayer]:
    return servable_lowest({sub: s for sub, s in scores.items() if sub.block not in ctx.protected}, ctx.drop,
                           ctx.depth)


@SUBLAYER_SCORES.register("ablation")
def ablation(ctx: ScoreContext, parts: Sequence[Part]) -> SublayerResult:
    """One-shot: each sublayer skipped alone; iterative: skip the cheapest, re-score the rest, repeat."""
    measure = _nll_losses if ctx.metric == "nll" else _accuracy_losses
    cache: list = []
    if not ctx.iterative:
        pool = candidates(ctx.depth, parts, ctx.protected)
        base, losses = measure(ctx, [], pool, cache)
        scores: dict[Sublayer, float | None] = {sub: losses[sub] - base for sub in pool}
        return SublayerResult(scores, _chosen(ctx, scores), details={"base": base, "metric": ctx.metric})
    removed: list[Sublayer] = []
    steps: list[dict[str, Any]] = []
    first: dict[Sublayer, float | None] = {}
    for step in range(ctx.drop):
        pool = candidates(ctx.depth, parts, ctx.protected, removed)
        base, losses = measure(ctx, removed, pool, cache)
        deltas = {sub: losses[sub] - base for sub in pool}
        next_one = servable_lowest(deltas, 1, ctx.depth, removed)
        if not next_one:
            break
        chosen = next_one[0]
        steps.append({"step": step + 1, "base": base, "deltas": {str(s): d for s, d in deltas.items()},
                      "dropped": str(chosen)})
        first = first or dict(deltas)
        removed.append(chosen)
        if ctx.progress:
            ctx.progress(f"iterative step {step + 1}/{ctx.drop}: removed {chosen}", 0)
    order = [str(sub) for sub in removed]
    return SublayerResult(first, sorted(removed), steps, {"metric": ctx.metric, "order": order})


def _nll_losses(
    ctx: ScoreContext, removed: Sequence[Sublayer], pool: Sequence[Sublayer], cache: list[BlockInputs]
) -> tuple[float, dict[Sublayer, float]]:
    """Mean NLL of the model with `removed` skipped, and of it with each of `pool` skipped too (prefix reused)."""
    full = not removed
    totals: dict[Sublayer | None, list] = {key: [0.0, 0] for key in [BASE, *pool]}
    with torch.inference_mode():
        for number, batch in enumerate(ctx.batches):
            inputs = cache[number] if number < len(cache) else capture_block_inputs(ctx.stack, batch, keep_hidden=full)
            if not full and number >= len(cache):
                cache.append(inputs)  # only the first block's input is kept: the rest depends on `removed`
            states = sublayer_prefix_states(ctx.stack, inputs, removed)
            accumulate(totals[BASE], masked_nll(ctx.stack, states[-1], batch))
            for sub, loss in sublayer_candidate_measures(ctx.stack, inputs, removed, pool, states).items():
                accumulate(totals[sub], loss)
            if ctx.progress:
                ctx.progress("ablation", 1)
    means = {key: total / max(count, 1) for key, (total, count) in totals.items()}
    return means.pop(BASE), means  # type: ignore[return-value]


def _accuracy_losses(
    ctx: ScoreContext, removed: Sequence[Sublayer], pool: Sequence[Sublayer], cache: list
) -> tuple[float, dict[Sublayer, float]]:
    """Error rate (1 - exact-match accuracy): short answers teacher-forced from the shared prefix, free-form ones
    (GSM8K) generated with each candidate skipped."""
    items = [item for item in ctx.calib.items if item.expected is not None]
    if not items:
        raise LayerpruneError(
            "--metric accuracy needs calibration items with answers (gsm8k, arithmetic, prompt+answer JSONL)"
        )
    short = [item for item in items if is_short_answer(item)]
    free = [item for item in items if not is_short_answer(item)]
    wrong: dict[Sublayer | None, int] = {key: 0 for key in [BASE, *pool]}
    if short:
        for key, correct in _teacher_forced_correct(ctx, short, removed, pool, cache).items():
            wrong[key] += correct.count(False)
    for key in wrong if free else []:
        skip = [*removed, *([key] if key is not None else [])]
        wrong[key] += _generated_correct(ctx, free, skip).count(False)
    if ctx.progress:
        ctx.progress("ablation", len(pool))
    rates = {key: count / len(items) for key, count in wrong.items()}
    return rates.pop(BASE), rates  # type: ignore[return-value]


def _teacher_forced_correct(
    ctx: ScoreContext, items: list[CalibItem], removed: Sequence[Sublayer], pool: Sequence[Sublayer], cache: list
) -> dict[Sublayer | None, list[bool]]:
    """Per item, would greedy decoding give exactly its answer (then a stop), without and with each candidate."""

    def measures(inputs: BlockInputs, batch: Any, measure: Any) -> dict[Sublayer | None, Any]:
        states = sublayer_prefix_states(ctx.stack, inputs, removed)
        return {BASE: measure(ctx.stack, states[-1], batch),
                **sublayer_candidate_measures(ctx.stack, inputs, removed, pool, states, measure)}

    return correct_per_key(ctx, items, [BASE, *pool], not removed, cache, measures)


def _generated_correct(ctx: ScoreContext, items: list[CalibItem], skip: list[Sublayer]) -> list[bool]:
    """Per item, is the greedy answer (generated until its stop string) right, with the `skip` sublayers skipped."""
    with skipped_sublayers(ctx.model, skip):
        return greedy_correct(ctx, items)


def residual_sums(ctx: ScoreContext, parts: Sequence[Part], pair_fn, tokens: str = "all") -> dict[Sublayer, float]:  # noqa: ANN001
    """Average `pair_fn(before, after)` of each sublayer's residual stream over calibration tokens (all, or each
    row's last): one forward per batch, and each block once more with its MLP skipped."""
    totals = {sub: [0.0, 0] for sub in all_sublayers(ctx.depth, parts)}
    with torch.inference_mode():
        for batch in ctx.batches:
            inputs = capture_block_inputs(ctx.stack, batch)
            mask = last_token_mask(batch.attention_mask) if tokens == "last" else batch.attention_mask
            for block in range(ctx.depth):
                before, middle, after = residual_around_sublayers(ctx.stack, inputs, block)
                pairs = {"attn": (before, middle), "mlp": (middle, after)}
                for part in parts:
                    accumulate(totals[Sublayer(block, part)], pair_fn(*pairs[part], mask))
            if ctx.progress:
                ctx.progress("residual stream", 1)
    return {sub: mean(total, count) for sub, (total, count) in totals.items()}


@SUBLAYER_SCORES.register("block-influence")
def influence(ctx: ScoreContext, parts: Sequence[Part]) -> SublayerResult:
    """1 - cos(x, x + f(x)) of the sublayer's residual update f, averaged over every token."""
    scores: dict[Sublayer, float | None] = dict(residual_sums(ctx, parts, block_influence))
    return SublayerResult(scores, _chosen(ctx, scores))


@SUBLAYER_SCORES.register("angular")
def angular(ctx: ScoreContext, parts: Sequence[Part]) -> SublayerResult:
    """arccos(cos(x, x + f(x))) / pi across one sublayer (not a run of them), at the last token or all tokens."""
    scores: dict[Sublayer, float | None] = dict(residual_sums(ctx, parts, angular_distance, ctx.angular_tokens))
    return SublayerResult(scores, _chosen(ctx, scores), details={"tokens": ctx.angular_tokens, "run_length": 1})


@SUBLAYER_SCORES.register("last")
def last(ctx: ScoreContext, parts: Sequence[Part]) -> SublayerResult:
    """The last sublayers in forward order go first."""
    order = all_sublayers(ctx.depth, parts)
    scores: dict[Sublayer, float | None] = {sub: float(len(order) - 1 - n) for n, sub in enumerate(order)}
    return SublayerResult(scores, _chosen(ctx, scores))


@SUBLAYER_SCORES.register("random")
def random_sublayers(ctx: ScoreContext, parts: Sequence[Part]) -> SublayerResult:
    rng = random.Random(f"layerprune-random-sublayers-{ctx.seed}")
    scores: dict[Sublayer, float | None] = {sub: rng.random() for sub in all_sublayers(ctx.depth, parts)}
    return SublayerResult(scores, _chosen(ctx, scores), details={"seed": ctx.seed})
