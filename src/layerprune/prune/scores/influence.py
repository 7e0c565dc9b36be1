"""Block influence (ShortGPT): 1 - cosine of a block's input and output hidden states."""

from __future__ import annotations

import torch

from layerprune.models.walker import capture_block_inputs
from layerprune.prune.metrics import accumulate, block_influence, last_token_mask, mean, select_lowest
from layerprune.prune.scores import BlockMajor, BlockMajorContext, ScoreContext, ScoreResult, register_score


def hidden_state_sums(ctx: ScoreContext, pair_fn, offset: int, tokens: str = "all") -> list[float | None]:  # noqa: ANN001
    """Average `pair_fn(h_l, h_{l+offset})` over calibration tokens (all, or each row's last), one forward per batch."""
    totals = [[0.0, 0] for _ in range(ctx.depth + 1 - offset)]
    with torch.inference_mode():
        for batch in ctx.batches:
            states = capture_block_inputs(ctx.stack, batch).states()
            mask = last_token_mask(batch.attention_mask) if tokens == "last" else batch.attention_mask
            for start, total in enumerate(totals):
                accumulate(total, pair_fn(states[start], states[start + offset], mask))
            if ctx.progress:
                ctx.progress("hidden states", 1)
    return [mean(s, n) for s, n in totals]


def influence_block_major(ctx: BlockMajorContext) -> ScoreResult:
    """The same scores, one block in memory at a time."""
    from layerprune.prune.blockwise import sweep

    scores = [mean(*p) for p in sweep(ctx.bw, ctx.batches, [], 1, block_influence, ctx.progress).pairs]
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected))


BLOCK_MAJOR = BlockMajor(influence_block_major, live_states=lambda depth, drop: 3, what="block-influence")


@register_score("block-influence", block_major=BLOCK_MAJOR)
def influence(ctx: ScoreContext) -> ScoreResult:
    scores = hidden_state_sums(ctx, block_influence, 1)
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected))
