"""Layer collapse (LaCo, arXiv 2402.11187): fold each dropped span into the kept block before it.

For a contiguous span s..e of dropped blocks and the kept block p = s - 1 before it, every parameter of p becomes

    theta_p <- theta_p + w * sum_{k=s..e} (theta_k - theta_p)

with theta_k the source (teacher) model's block k and w the span's weight (1: LaCo's sum of differences; 0: plain
pruning). The pruned model keeps its architecture and block count; only the anchor block's values change. Spans
are merged in block order, each from the source's weights, so no span's merge depends on another's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from layerprune.errors import LayerpruneError
from layerprune.recover.replace import Run, decoder_layers, dropped_runs

log = logging.getLogger(__name__)


def merge_runs(dropped: list[int], num_blocks_before: int) -> list[Run]:
    """The contiguous dropped spans with the kept block each merges into (a span at block 0 has none)."""
    if dropped and min(dropped) == 0:
        raise LayerpruneError("merge cannot fold a span that starts at block 0: no kept block before it to merge into")
    return dropped_runs(dropped, num_blocks_before)


def span_weights(runs: list[Run], weight: float, weights: list[float] | None) -> list[float]:
    """One weight per span: merge.span_weights when given (one per span, else an error), otherwise merge.weight."""
    if weights is None:
        return [weight] * len(runs)
    if len(weights) != len(runs):
        spans = ", ".join(f"{r.first}-{r.last}" for r in runs)
        raise LayerpruneError(f"merge.span_weights lists {len(weights)} weights for {len(runs)} dropped spans "
                              f"({spans})")
    return list(weights)


def check_mergeable(teacher: Any, run: Run) -> dict[str, torch.Tensor]:
    """The anchor's source parameters; every block of the span must have the same parameter names and shapes."""
    layers = decoder_layers(teacher)
    base = dict(layers[run.first - 1].named_parameters())
    for index in range(run.first, run.last + 1):
        params = dict(layers[index].named_parameters())
        odd = sorted(set(params) ^ set(base)) or [n for n in base if params[n].shape != base[n].shape]
        if odd:
            raise LayerpruneError(f"merge needs blocks with one parameter layout: block {index} and block "
                                  f"{run.first - 1} differ in {odd[0]}")
    return base


def merged_delta(teacher: Any, run: Run, name: str, base: torch.Tensor) -> torch.Tensor:
    """sum over the span of (theta_k - theta_anchor) for one parameter, in float64."""
    layers = decoder_layers(teacher)
    blocks = [dict(layers[k].named_parameters())[name] for k in range(run.first, run.last + 1)]
    return sum(b.detach().double() - base.detach().double() for b in blocks)  # type: ignore[return-value]


@torch.no_grad()
def merge_blocks(student: Any, teacher: Any, dropped: list[int], weight: float = 1.0,
                 weights: list[float] | None = None) -> list[dict[str, Any]]:
    """Merge every dropped span into the student's anchor block; return what each merge did."""
    runs = merge_runs(dropped, len(decoder_layers(teacher)))
    student_layers = decoder_layers(student)
    fits = []
    for run, w in zip(runs, span_weights(runs, weight, weights), strict=True):
        base = check_mergeable(teacher, run)
        anchor = dict(student_layers[run.anchor].named_parameters())
        if set(anchor) != set(base) or any(anchor[n].shape != base[n].shape for n in base):
            raise LayerpruneError(f"merge: the pruned model's block {run.anchor} does not match the source's block "
                                  f"{run.first - 1}")
        change = 0.0
        for name, param in anchor.items():
            delta = merged_delta(teacher, run, name, base[name]).to(param.device)
            param.copy_((param.double() + w * delta).to(param.dtype))
            change += float((w * delta).pow(2).sum())
        log.info("merge: blocks %d-%d folded into block %d (weight %g)", run.first, run.last, run.anchor, w)
        fits.append({"dropped": [run.first, run.last], "anchor": run.anchor, "weight": w,
                     "change_norm": change ** 0.5})
    return fits
