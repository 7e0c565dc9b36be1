"""Several pruned variants of one model in one batch: each row skips its own decoder blocks.

A skipped block still runs on the row (its KV cache for that row is written and never read by the row's output),
then the row's hidden state leaves the block unchanged. So one `generate` call decodes every candidate of an
ablation sweep side by side, with per-row stopping, instead of one call per candidate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from layerprune.models.blocks import find_decoder_stack


@contextlib.contextmanager
def row_skipped_blocks(model: nn.Module, row_skips: Sequence[Sequence[int]]) -> Iterator[None]:
    """While inside, row `r` of every forward batch behaves as if the blocks `row_skips[r]` were dropped."""
    stack = find_decoder_stack(model)
    handles = []
    try:
        for index, block in enumerate(stack.layers):
            rows = [r for r, skip in enumerate(row_skips) if index in skip]
            if rows:
                handles.append(block.register_forward_hook(_pass_through(rows, len(row_skips)), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _pass_through(rows: list[int], batch: int):  # noqa: ANN202
    """A forward hook that gives `rows` their block input back as the block output."""
    mask = torch.zeros(batch, dtype=torch.bool)
    mask[rows] = True

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        hidden_in = args[0] if args else kwargs["hidden_states"]
        hidden_out = output[0] if isinstance(output, tuple) else output
        if hidden_out.shape[0] != batch:
            raise ValueError(f"row skips were set for a batch of {batch} rows, the block got {hidden_out.shape[0]}")
        keep = mask.to(hidden_out.device).view(-1, *([1] * (hidden_out.dim() - 1)))
        mixed = torch.where(keep, hidden_in, hidden_out)
        return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

    return hook
