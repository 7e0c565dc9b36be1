"""Name a decoder block's attention or MLP sublayer, and skip some for a while.

A sublayer is written `12.attn` or `12.mlp` (block index, then the part). Skipping one replaces its output by
zeros, so the block's residual stream passes it by: `x + attn(norm(x))` becomes `x`. That is the reference every
sublayer surgery is verified against, as `skipped_blocks` is for whole blocks.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import find_decoder_stack

Part = Literal["attn", "mlp"]
PARTS: tuple[Part, ...] = ("attn", "mlp")
MODULE_NAMES: dict[Part, tuple[str, ...]] = {
    "attn": ("self_attn", "attn", "attention", "self_attention"),
    "mlp": ("mlp", "feed_forward", "ffn"),
}
NORM_NAMES: dict[Part, tuple[str, ...]] = {  # the pre-norm that goes with the sublayer (llama-style blocks)
    "attn": ("input_layernorm",),
    "mlp": ("post_attention_layernorm",),
}
PATTERN = re.compile(r"^\s*(\d+)\.(attn|mlp)\s*$")


@dataclass(frozen=True, order=True)
class Sublayer:
    """One block's attention or MLP sublayer."""

    block: int
    part: Part

    def __str__(self) -> str:
        return f"{self.block}.{self.part}"


def parse_sublayer(text: str) -> Sublayer:
    """`"12.attn"` -> Sublayer(12, "attn"); one line naming the form on anything else."""
    match = PATTERN.match(text)
    if not match:
        raise LayerpruneError(f"cannot read sublayer {text!r}: write BLOCK.attn or BLOCK.mlp, e.g. 12.attn")
    return Sublayer(int(match.group(1)), match.group(2))  # type: ignore[arg-type]


def parse_sublayers(texts: Iterable[str], depth: int) -> list[Sublayer]:
    """Sorted, checked sublayers: each block index below `depth`, none named twice."""
    found = [parse_sublayer(text) for text in texts]
    for sub in found:
        if sub.block >= depth:
            raise LayerpruneError(f"sublayer {sub} is out of range: the model has {depth} blocks (0-{depth - 1})")
    if len(set(found)) != len(found):
        raise LayerpruneError(f"a sublayer is named twice in {', '.join(map(str, found))}")
    return sorted(found)


def all_sublayers(depth: int, parts: Sequence[Part] = PARTS) -> list[Sublayer]:
    return [Sublayer(block, part) for block in range(depth) for part in parts]


def whole_blocks(removed: Iterable[Sublayer]) -> list[int]:
    """The blocks whose attention and MLP are both removed (a layout drops such a block)."""
    parts: dict[int, set[str]] = {}
    for sub in removed:
        parts.setdefault(sub.block, set()).add(sub.part)
    return sorted(block for block, named in parts.items() if named == set(PARTS))


def sublayer_module(block: nn.Module, part: Part) -> nn.Module:
    """The block's attention or MLP module; one line when the block has neither name."""
    for name in MODULE_NAMES[part]:
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    raise LayerpruneError(f"cannot find the {part} sublayer of {type(block).__name__} "
                          f"(looked for {', '.join(MODULE_NAMES[part])})")


def sublayer_norm(block: nn.Module, part: Part) -> nn.Module | None:
    """The pre-norm feeding the sublayer in a llama-style block (a layout that removes the sublayer removes it)."""
    for name in NORM_NAMES[part]:
        module = getattr(block, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


def _zero_output(module: nn.Module, args: tuple, output: Any) -> Any:
    if isinstance(output, tuple):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


@contextlib.contextmanager
def skipped_sublayers(model: nn.Module, skip: Iterable[Sublayer]) -> Iterator[list[Sublayer]]:
    """Within the block, each skipped sublayer adds nothing to the residual stream (its output is zeros)."""
    layers = find_decoder_stack(model).layers
    chosen = sorted(set(skip))
    handles = [sublayer_module(layers[sub.block], sub.part).register_forward_hook(_zero_output) for sub in chosen]
    try:
        yield chosen
    finally:
        for handle in handles:
            handle.remove()
