"""First-order Taylor importance: |gradient x weight| of the calibration NLL, summed per block."""

from __future__ import annotations

import torch

from layerprune.models.walker import capture_block_inputs, nll_sum
from layerprune.prune.metrics import select_lowest, taylor_importance
from layerprune.prune.scores import ScoreContext, ScoreResult, register_score


@register_score("taylor")
def taylor(ctx: ScoreContext) -> ScoreResult:
    params = list(ctx.model.parameters())
    flags = [p.requires_grad for p in params]
    in_blocks = {id(p) for p in ctx.stack.layers.parameters()}
    ctx.model.zero_grad(set_to_none=True)
    try:
        for p in params:  # gradients only where they are scored
            p.requires_grad_(id(p) in in_blocks)
        for batch in ctx.batches:
            _backward(ctx, batch)
            if ctx.progress:
                ctx.progress("gradients", 1)
        scores = [
            taylor_importance((p.grad, p) for p in block.parameters() if p.grad is not None)
            for block in ctx.stack.layers
        ]
    finally:
        ctx.model.zero_grad(set_to_none=True)
        for p, flag in zip(params, flags, strict=False):
            p.requires_grad_(flag)
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected))


def _backward(ctx: ScoreContext, batch) -> None:  # noqa: ANN001
    with torch.enable_grad():
        inputs = capture_block_inputs(ctx.stack, batch, keep_hidden=False)
        total, count = nll_sum(ctx.stack, inputs.output, batch)
        (total / max(1, count)).backward()
