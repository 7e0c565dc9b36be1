"""Baselines that need no data: drop the last N blocks, or N random blocks (seeded)."""

from __future__ import annotations

import random

from layerprune.prune.metrics import select_lowest
from layerprune.prune.scores import ScoreContext, ScoreResult, register_score


@register_score("last", data_free=True)
def last(ctx: ScoreContext) -> ScoreResult:
    scores = [float(ctx.depth - 1 - i) for i in range(ctx.depth)]
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected))


@register_score("random", data_free=True)
def random_blocks(ctx: ScoreContext) -> ScoreResult:
    rng = random.Random(f"layerprune-random-{ctx.seed}")
    scores = [rng.random() for _ in range(ctx.depth)]
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected), details={"seed": ctx.seed})
