"""Block-major scoring: advance every candidate's hidden states through one loaded block at a time.

The model never needs to be in memory whole: the full model's states and one state per candidate (the model with
that block skipped) go through block i together, then block i is freed. `sweep` is the walk; each score that has a
block-major form (ablation with one-shot NLL, block-influence, angular) registers it with itself (prune.scores) and
reads the sums it needs from one sweep. Scores equal the in-memory scorer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.blockwise import BlockwiseModel, MemoryPlan, block_call_args, loaded_block, memory_plan
from layerprune.models.verify_blockwise import check_blockwise_head
from layerprune.models.walker import CalibBatch, block_output, masked_nll
from layerprune.prune.metrics import accumulate, last_token_mask
from layerprune.prune.scores import SCORES, BlockMajorContext, ScoreResult


@dataclass
class Sweep:
    """What one block-major pass gives: NLL of the full model and of each candidate, and pair sums of states."""

    base: list[float] = field(default_factory=lambda: [0.0, 0])
    candidates: dict[int, list[float]] = field(default_factory=dict)
    pairs: list[list[float]] = field(default_factory=list)
    final: torch.Tensor | None = None  # the full model's last block output on the first batch


def sweep(bw: BlockwiseModel, batches: Sequence[CalibBatch], candidates: Sequence[int], offset: int = 0,
          pair_fn: Callable[..., tuple[float, int]] | None = None, progress: Callable[[str, int], Any] | None = None,
          tokens: str = "all") -> Sweep:
    """One pass over the blocks; `pair_fn(h_l, h_{l+offset}, mask)` summed where given (over every token, or the
    last of each sequence), NLLs where candidates."""
    depth = len(bw)
    result = Sweep(candidates={c: [0.0, 0] for c in candidates},
                   pairs=[[0.0, 0] for _ in range(depth + 1 - offset)] if pair_fn else [])
    batches = [b.to(bw.device) for b in batches]
    with torch.inference_mode():
        calls = [block_call_args(bw, b.input_ids, b.attention_mask) for b in batches]
        masks = [last_token_mask(b.attention_mask) if tokens == "last" else b.attention_mask for b in batches]
        base = [first for first, _ in calls]
        window = [[h] for h in base]  # the last `offset` + 1 full-model states, per batch
        active: dict[int, list[torch.Tensor]] = {}
        for index in range(depth):
            with loaded_block(bw, index) as block:
                skipped = [h for h in base]  # skipping block `index`: its output is its input
                for n, (_, records) in enumerate(calls):
                    args, kwargs = records[index]
                    h_in = base[n]
                    base[n] = block_output(block(h_in, *args, **kwargs))
                    for states in active.values():
                        states[n] = block_output(block(states[n], *args, **kwargs))
                    if pair_fn:
                        window[n] = [*window[n], base[n]][-(offset + 1):]
                        if index + 1 >= offset:
                            accumulate(result.pairs[index + 1 - offset], pair_fn(window[n][0], window[n][-1], masks[n]))
            if index in result.candidates:
                active[index] = skipped
            if progress:
                progress(f"block {index + 1}/{depth}", 1)
        result.final = base[0] if base else None
        for n, batch in enumerate(batches):
            if result.candidates:
                accumulate(result.base, masked_nll(bw.stack, base[n], batch))
            for candidate, states in active.items():
                accumulate(result.candidates[candidate], masked_nll(bw.stack, states[n], batch))
    return result


def check_blockwise(name: str, metric: str = "nll", iterative: bool = False) -> None:
    """Refuse a score (or request) without a block-major form, naming the ones there are."""
    score = SCORES.get(name)
    if score.block_major is None or not score.block_major.supports(metric, iterative):
        forms = [SCORES.get(n).block_major for n in SCORES.names()]
        known = [form.what for form in forms if form is not None]
        what = name if score.block_major is None else f"{name} ({metric}{', iterative' if iterative else ''})"
        said = f"{', '.join(known[:-1])} and {known[-1]}" if len(known) > 1 else "".join(known)
        raise LayerpruneError(f"--block-major supports {said}, not {what}")


def score_blockwise(
    name: str,
    bw: BlockwiseModel,
    batches: Sequence[CalibBatch],
    drop: int,
    protected: list[int],
    metric: str = "nll",
    iterative: bool = False,
    progress: Callable[[str, int], Any] | None = None,
    params: Mapping[str, Any] | None = None,
) -> ScoreResult:
    """The named score's block-major form (registered with the score), its parameters from `params`."""
    check_blockwise(name, metric, iterative)
    form = SCORES.get(name).block_major
    assert form is not None
    return form.score(BlockMajorContext(bw, list(batches), drop, protected, metric, dict(params or {}), progress))


def check_head(bw: BlockwiseModel, batch: CalibBatch, final: torch.Tensor) -> float:
    """Once per run, on the first two sequences: the NLLs came from norm + head on the last block's output, which
    must be what the model's own forward gives (run block-major too)."""
    ids, mask = batch.input_ids[:2], batch.attention_mask[:2]
    return check_blockwise_head(bw, ids, mask, final[:2])


def live_states(name: str, depth: int, drop: int) -> int:
    """Hidden states alive at once, as the score's block-major form says (a short window, 3, without one)."""
    form = SCORES.get(name).block_major
    return form.live_states(depth, drop) if form is not None else 3


def plan_for(config: Any, name: str, batches: Sequence[CalibBatch], dtype: torch.dtype, drop: int) -> MemoryPlan:
    """The memory plan of scoring these batches block-major."""
    tokens = sum(b.input_ids.numel() for b in batches)
    shape = max((tuple(b.input_ids.shape) for b in batches), key=lambda s: s[0] * s[1])
    depth = (config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers
    return memory_plan(config, tokens, shape, dtype, live_states(name, depth, drop))
