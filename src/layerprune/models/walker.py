"""Walk a model block by block: capture each block's inputs once, then replay any subset of blocks.

This is what makes ablation (prune) and per-block analysis (analyze) cheap: the hidden states before an
ablated block are the full model's, so every candidate starts from the cached input of the block it removes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from layerprune.models.blocks import DecoderStack


@dataclass
class CalibBatch:
    """Token ids, attention mask and a mask of the positions whose token is scored (labels)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor

    def to(self, device: torch.device) -> CalibBatch:
        return CalibBatch(self.input_ids.to(device), self.attention_mask.to(device), self.loss_mask.to(device))


@dataclass
class BlockInputs:
    """What the full model fed each block: hidden states (in) and the other call arguments."""

    batch: CalibBatch
    hidden: list[torch.Tensor]
    call_args: list[tuple[tuple[Any, ...], dict[str, Any]]]
    output: torch.Tensor

    def states(self) -> list[torch.Tensor]:
        """h_0 .. h_L: the input of every block and the output of the last one."""
        return [*self.hidden, self.output]


def block_output(out: Any) -> torch.Tensor:
    """Decoder blocks return a tensor (transformers 5) or a tuple whose first item is it."""
    return out[0] if isinstance(out, (tuple, list)) else out


def capture_block_inputs(stack: DecoderStack, batch: CalibBatch, keep_hidden: bool = True) -> BlockInputs:
    """One forward of the base model with hooks recording every block's inputs and the last output.

    keep_hidden=False keeps the first block's input (and the output) only: the others become empty tensors that own
    no storage (a zero-row slice would be a view pinning the whole state)."""
    hidden: list[torch.Tensor] = []
    call_args: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    last: list[torch.Tensor] = []

    def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = args[0] if args else kwargs["hidden_states"]
        hidden.append(state if keep_hidden or not hidden else _nothing(state))
        call_args.append((tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"}))

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        last.append(block_output(output))

    handles = [block.register_forward_pre_hook(pre_hook, with_kwargs=True) for block in stack.layers]
    handles.append(stack.layers[-1].register_forward_hook(post_hook))
    try:
        stack.base(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return BlockInputs(batch, hidden, call_args, last[-1])


def _nothing(state: torch.Tensor) -> torch.Tensor:
    """A zero-row tensor shaped like `state` with storage of its own (none), so `state` can be freed."""
    return state.new_empty((0, *state.shape[1:]))


def run_blocks(stack: DecoderStack, inputs: BlockInputs, hidden: torch.Tensor, blocks: Iterable[int]) -> torch.Tensor:
    """Apply the given blocks (original indices, in order) to `hidden`, each with its recorded arguments."""
    for index in blocks:
        args, kwargs = inputs.call_args[index]
        hidden = block_output(stack.layers[index](hidden, *args, **kwargs))
    return hidden


def nll_sum(stack: DecoderStack, hidden: torch.Tensor, batch: CalibBatch) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the scored positions; logits are computed only where needed."""
    mask = batch.loss_mask[:, 1:].bool()
    logits = stack.logits(hidden[:, :-1][mask.to(hidden.device)])  # blocks may sit on several devices
    targets = batch.input_ids[:, 1:][mask].to(logits.device)
    return F.cross_entropy(logits.float(), targets, reduction="sum"), int(targets.numel())


def masked_nll(stack: DecoderStack, hidden: torch.Tensor, batch: CalibBatch) -> tuple[float, int]:
    """`nll_sum` as a plain float."""
    total, count = nll_sum(stack, hidden, batch)
    return float(total), count


Measure = Callable[[DecoderStack, torch.Tensor, CalibBatch], Any]


def greedy_match(stack: DecoderStack, hidden: torch.Tensor, batch: CalibBatch, stops: torch.Tensor,
                 needs_stop: torch.Tensor) -> torch.Tensor:
    """Per row: would greedy decoding emit exactly the scored (answer) tokens, then a stop token?

    Teacher-forced: the argmax before every answer token must be that token, and (where `needs_stop`) the
    argmax after the last one must be in `stops` (a bool mask over the vocabulary). One pass, no decoding.
    """
    mask = batch.loss_mask[:, 1:].bool().to(hidden.device)
    predicted = stack.logits(hidden[:, :-1][mask]).argmax(-1)
    hits = predicted == batch.input_ids[:, 1:].to(hidden.device)[mask].to(predicted.device)
    misses = torch.zeros(mask.shape[0], device=hits.device).index_add_(
        0, mask.nonzero()[:, 0].to(hits.device), (~hits).float()
    )
    positions = torch.arange(mask.shape[1] + 1, device=hidden.device)
    last = (batch.loss_mask.to(hidden.device).bool() * positions).argmax(1)
    after = stack.logits(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).argmax(-1)
    return (misses.to(after.device) == 0) & (stops.to(after.device)[after] | ~needs_stop.to(after.device))


FINAL = -1  # key of the last kept block's output in `prefix_states`


def prefix_states(stack: DecoderStack, inputs: BlockInputs, kept: Sequence[int]) -> dict[int, torch.Tensor]:
    """The hidden state entering each kept block in the model made of `kept` blocks only (FINAL: its output)."""
    if len(kept) == len(inputs.call_args) and len(inputs.hidden[-1]):
        return {**dict(zip(kept, inputs.hidden, strict=False)), FINAL: inputs.output}
    states: dict[int, torch.Tensor] = {}
    hidden = inputs.hidden[0]
    for index in kept:
        states[index] = hidden
        hidden = run_blocks(stack, inputs, hidden, [index])
    states[FINAL] = hidden
    return states


BASE = -1  # key of the kept model itself in `ablation_measures`, beside the candidates' block indices


def ablation_measures(
    stack: DecoderStack,
    inputs: BlockInputs,
    kept: Sequence[int],
    candidates: Sequence[int],
    group: int = 1,
    measure: Measure | None = None,
) -> dict[int, Any]:
    """The ablation of one batch (prune's scores and analyze's per-block numbers): `measure(stack, final_hidden,
    batch)` (default: NLL sum and count) of the `kept` model (key BASE) and of it with each candidate skipped. One
    pass gives every prefix; each candidate starts from the state entering it (`candidate_losses`, `group` stacked)."""
    measure = measure or masked_nll
    states = prefix_states(stack, inputs, kept)
    base = measure(stack, states[FINAL], inputs.batch)
    return {BASE: base, **candidate_losses(stack, inputs, kept, candidates, states, group, measure)}


def candidate_losses(
    stack: DecoderStack,
    inputs: BlockInputs,
    kept: Sequence[int],
    candidates: Sequence[int],
    states: dict[int, torch.Tensor] | None = None,
    group: int = 0,
    measure: Measure | None = None,
) -> dict[int, Any]:
    """NLL (sum, count) of the `kept` model with each candidate removed, from the shared prefix (or what
    `measure(stack, final_hidden, batch)` returns instead).

    Candidates advance together, block by block: the ones already skipped are stacked along the batch axis, so
    each kept block runs once per step on a bigger batch instead of once per candidate. `group` caps how many are
    stacked at once (0: all of them; 1: one at a time, the least memory); each group starts from its own prefix.
    """
    states = states if states is not None else prefix_states(stack, inputs, kept)
    wanted = set(candidates)
    ordered = [index for index in kept if index in wanted]
    size = group if group > 0 else max(len(ordered), 1)
    losses: dict[int, tuple[float, int]] = {}
    for start in range(0, len(ordered), size):
        losses.update(
            _stacked_losses(stack, inputs, kept, ordered[start : start + size], states, measure or masked_nll)
        )
    return losses


def _stacked_losses(
    stack: DecoderStack,
    inputs: BlockInputs,
    kept: Sequence[int],
    candidates: Sequence[int],
    states: dict[int, torch.Tensor],
    measure: Measure,
) -> dict[int, Any]:
    """`candidate_losses` for one group of candidates, all stacked."""
    wanted = set(candidates)
    order: list[int] = []
    active: torch.Tensor | None = None
    for index in kept[kept.index(candidates[0]) :]:
        if active is not None:
            active = _run_stacked(stack, inputs, index, active, len(order))
        if index in wanted:  # skipping `index`: its output is its input
            order.append(index)
            active = states[index] if active is None else torch.cat([active, states[index].to(active.device)])
    assert active is not None
    finals = active.chunk(len(order))
    return {c: measure(stack, final, inputs.batch) for c, final in zip(order, finals, strict=False)}


def _run_stacked(
    stack: DecoderStack, inputs: BlockInputs, index: int, hidden: torch.Tensor, copies: int
) -> torch.Tensor:
    """Block `index` on `copies` batches stacked along dim 0, its recorded arguments repeated to match."""
    args, kwargs = inputs.call_args[index]
    size = inputs.batch.input_ids.shape[0]
    args = tuple(_repeat(a, size, copies) for a in args)
    kwargs = {k: _repeat(v, size, copies) for k, v in kwargs.items()}
    return block_output(stack.layers[index](hidden, *args, **kwargs))


def _repeat(value: Any, size: int, copies: int) -> Any:
    """Tile per-example tensors (first dim == batch size) `copies` times; broadcastable ones stay as they are."""
    if copies == 1:
        return value
    if isinstance(value, torch.Tensor):
        return value.repeat(copies, *([1] * (value.dim() - 1))) if value.dim() and value.shape[0] == size else value
    if isinstance(value, (tuple, list)):
        return type(value)(_repeat(v, size, copies) for v in value)
    if isinstance(value, dict):
        return {k: _repeat(v, size, copies) for k, v in value.items()}
    return value
