"""Angular distance between the hidden states n blocks apart; drops the best contiguous run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from layerprune.prune.metrics import angular_distance, best_contiguous_run, mean
from layerprune.prune.scores import (
    BlockMajor,
    BlockMajorContext,
    ScoreContext,
    ScoreParams,
    ScoreResult,
    register_score,
)
from layerprune.prune.scores.influence import hidden_state_sums


class AngularParams(ScoreParams):
    angular_tokens: Literal["last", "all"] = Field(
        "last",
        description="Angular score: distance at each sequence's last token (Gromov et al.) or averaged over all tokens",
    )


def _result(distances: list[float | None], depth: int, drop: int, protected: list[int], tokens: str) -> ScoreResult:
    scores: list[float | None] = [*distances, *[None] * (depth - len(distances))]
    return ScoreResult(scores, best_contiguous_run(scores, drop, protected), details={"run_length": drop,
                                                                                      "tokens": tokens})


def angular_block_major(ctx: BlockMajorContext) -> ScoreResult:
    """The same distances, one block in memory at a time (a window of the last `drop` + 1 states)."""
    from layerprune.prune.blockwise import sweep

    tokens = AngularParams.of(ctx.params).angular_tokens
    pairs = sweep(ctx.bw, ctx.batches, [], ctx.drop, angular_distance, ctx.progress, tokens).pairs
    return _result([mean(*p) for p in pairs], len(ctx.bw), ctx.drop, ctx.protected, tokens)


BLOCK_MAJOR = BlockMajor(angular_block_major, live_states=lambda depth, drop: drop + 2, what="angular")


@register_score("angular", AngularParams, BLOCK_MAJOR)
def angular(ctx: ScoreContext) -> ScoreResult:
    """Score of block l = d(h_l, h_{l+n}) of the run starting there (None where no run of n fits).

    Gromov et al. measure the distance at the last token of each sequence (`angular_tokens="last"`, the
    default); "all" averages over every real token.
    """
    tokens = ctx.params_of(AngularParams).angular_tokens
    distances = hidden_state_sums(ctx, angular_distance, ctx.drop, tokens)
    return _result(distances, ctx.depth, ctx.drop, ctx.protected, tokens)
