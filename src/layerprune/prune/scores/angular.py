"""Angular distance between the hidden states n blocks apart; drops the best contiguous run."""

from __future__ import annotations

from layerprune.prune.metrics import angular_distance, best_contiguous_run
from layerprune.prune.scores import SCORES, ScoreContext, ScoreResult
from layerprune.prune.scores.influence import hidden_state_sums


@SCORES.register("angular")
def angular(ctx: ScoreContext) -> ScoreResult:
    """Score of block l = d(h_l, h_{l+n}) of the run starting there (None where no run of n fits).

    Gromov et al. measure the distance at the last token of each sequence (`angular_tokens="last"`, the
    default); "all" averages over every real token.
    """
    distances = hidden_state_sums(ctx, angular_distance, ctx.drop, ctx.angular_tokens)
    scores: list[float | None] = [*distances, *[None] * (ctx.depth - len(distances))]
    return ScoreResult(
        scores,
        best_contiguous_run(scores, ctx.drop, ctx.protected),
        details={"run_length": ctx.drop, "tokens": ctx.angular_tokens},
    )
