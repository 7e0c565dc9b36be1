"""Block-major scoring: advance every candidate's hidden states through one loaded block at a time.

For ablation (one-shot NLL), block-influence and angular, the model never needs to be in memory whole: the
full model's states and one state per candidate (the model with that block skipped) go through block i
together, then block i is freed. Scores equal the in-memory scorer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from layerprune.core.errors import LayerpruneError
from layerprune.models.blockwise import BlockwiseModel, MemoryPlan, block_call_args, loaded_block, memory_plan
from layerprune.models.verify_blockwise import check_blockwise_head
from layerprune.models.walker import CalibBatch, block_output, masked_nll
from layerprune.prune.metrics import (
    accumulate,
    angular_distance,
    best_contiguous_run,
    block_influence,
    last_token_mask,
    mean,
    select_lowest,
)
from layerprune.prune.scores import ScoreResult

BLOCKWISE_SCORES = ("ablation", "block-influence", "angular")


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
    """Block-major scoring exists for one-shot NLL ablation, block-influence and angular."""
    if name not in BLOCKWISE_SCORES or (name == "ablation" and (metric != "nll" or iterative)):
        what = f"{name} ({metric}{', iterative' if iterative else ''})" if name == "ablation" else name
        raise LayerpruneError(
            f"--block-major supports one-shot ablation with --metric nll, block-influence and angular, not {what}"
        )


def score_blockwise(
    name: str,
    bw: BlockwiseModel,
    batches: Sequence[CalibBatch],
    drop: int,
    protected: list[int],
    metric: str = "nll",
    iterative: bool = False,
    progress: Callable[[str, int], Any] | None = None,
    angular_tokens: str = "last",
) -> ScoreResult:
    """The named score, block-major (ablation: one-shot NLL only)."""
    check_blockwise(name, metric, iterative)
    depth = len(bw)
    if name == "ablation":
        result = sweep(bw, batches, list(range(depth)), progress=progress)
        check = _check_head(bw, batches[0], result.final) if batches and result.final is not None else None
        base = mean(*result.base)
        scores = [mean(*result.candidates[i]) - base for i in range(depth)]
        details = {"base": base, "metric": metric, "check_logits_max_abs_diff": check}
        return ScoreResult(scores, select_lowest(scores, drop, protected), details=details)
    if name == "block-influence":
        pairs = sweep(bw, batches, [], 1, block_influence, progress).pairs
        scores = [mean(*p) for p in pairs]
        return ScoreResult(scores, select_lowest(scores, drop, protected))
    pairs = sweep(bw, batches, [], drop, angular_distance, progress, angular_tokens).pairs
    distances: list[float | None] = [*(mean(*p) for p in pairs), *[None] * (depth - len(pairs))]
    return ScoreResult(
        distances,
        best_contiguous_run(distances, drop, protected),
        details={"run_length": drop, "tokens": angular_tokens},
    )


def _check_head(bw: BlockwiseModel, batch: CalibBatch, final: torch.Tensor) -> float:
    """Once per run, on the first two sequences: the NLLs came from norm + head on the last block's output, which
    must be what the model's own forward gives (run block-major too)."""
    ids, mask = batch.input_ids[:2], batch.attention_mask[:2]
    return check_blockwise_head(bw, ids, mask, final[:2])


def live_states(name: str, depth: int, drop: int) -> int:
    """Hidden states alive at once: ablation holds every candidate's, the others a short window."""
    return depth + 2 if name == "ablation" else (drop if name == "angular" else 1) + 2


def plan_for(config: Any, name: str, batches: Sequence[CalibBatch], dtype: torch.dtype, drop: int) -> MemoryPlan:
    """The memory plan of scoring these batches block-major."""
    tokens = sum(b.input_ids.numel() for b in batches)
    shape = max((tuple(b.input_ids.shape) for b in batches), key=lambda s: s[0] * s[1])
    depth = (config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers
    return memory_plan(config, tokens, shape, dtype, live_states(name, depth, drop))
