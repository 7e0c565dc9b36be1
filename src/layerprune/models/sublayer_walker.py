"""Walk a model with some attention or MLP sublayers skipped, reusing the prefix that a skip leaves unchanged.

Skipping a sublayer of block b changes nothing before block b: every candidate in block b starts from the state
entering b (in the model with the sublayers already removed), runs block b with its own sublayer skipped too, then
the blocks after it. The skips are `skipped_sublayers`, the reference every sublayer surgery is verified against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layerprune.models.blocks import DecoderStack
from layerprune.models.sublayers import Sublayer, skipped_sublayers
from layerprune.models.walker import BlockInputs, Measure, masked_nll, run_blocks


def sublayer_prefix_states(stack: DecoderStack, inputs: BlockInputs, removed: Sequence[Sublayer]) -> list[torch.Tensor]:
    """h_0 .. h_L, the state entering each block and the last block's output, with `removed` skipped (the captured
    states of the full model when nothing is removed and they were kept)."""
    if not removed and len(inputs.hidden[-1]):
        return inputs.states()
    states = [inputs.hidden[0]]
    with skipped_sublayers(stack.model, removed):
        for index in range(len(inputs.call_args)):
            states.append(run_blocks(stack, inputs, states[-1], [index]))
    return states


def sublayer_candidate_measures(
    stack: DecoderStack,
    inputs: BlockInputs,
    removed: Sequence[Sublayer],
    candidates: Sequence[Sublayer],
    states: Sequence[torch.Tensor],
    measure: Measure = masked_nll,
) -> dict[Sublayer, Any]:
    """`measure(stack, final_hidden, batch)` of the model with `removed` and each candidate skipped, each candidate
    run from `states[candidate.block]` (from `sublayer_prefix_states` with the same `removed`)."""
    depth = len(inputs.call_args)
    results: dict[Sublayer, Any] = {}
    for candidate in candidates:
        with skipped_sublayers(stack.model, [*removed, candidate]):
            hidden = run_blocks(stack, inputs, states[candidate.block], range(candidate.block, depth))
        results[candidate] = measure(stack, hidden, inputs.batch)
    return results


def residual_around_sublayers(
    stack: DecoderStack, inputs: BlockInputs, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full model's residual stream before block `block`'s attention, between its attention and MLP, and after
    its MLP. The middle one is the block run again with its MLP skipped, so it holds exactly what the attention
    sublayer adds (post-norms included, as in Gemma), whatever the family calls its norms."""
    states = inputs.states()
    with skipped_sublayers(stack.model, [Sublayer(block, "mlp")]):
        middle = run_blocks(stack, inputs, states[block], [block])
    return states[block], middle, states[block + 1]
