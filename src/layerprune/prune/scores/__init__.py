"""Importance scores: one small module each, registered by name. Higher score = more important."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from layerprune.core.registry import Registry
from layerprune.models.blocks import DecoderStack
from layerprune.models.walker import CalibBatch
from layerprune.prune.calib import CalibSet


@dataclass
class ScoreContext:
    """Everything a score needs: the model, its blocks, calibration data and the drop request."""

    model: nn.Module
    tokenizer: Any
    stack: DecoderStack
    batches: list[CalibBatch]
    calib: CalibSet
    drop: int
    protected: list[int]
    metric: str = "nll"
    iterative: bool = False
    seed: int = 0
    batch_size: int = 8
    max_new_tokens: int = 8
    stack_candidates: int = 1  # ablation: candidates stacked per pass (0: all)
    angular_tokens: str = "last"  # angular: the last token of each sequence (Gromov et al.) or all tokens
    progress: Callable[[str, int], Any] | None = None
    num_blocks: int | None = None  # depth without a model (scores that need only the block count)

    @property
    def depth(self) -> int:
        return self.num_blocks if self.num_blocks is not None else len(self.stack)


@dataclass
class ScoreResult:
    """Per-block scores (original numbering; None where not scored) and the blocks chosen to drop."""

    scores: list[float | None]
    drop: list[int]
    steps: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


ScoreFn = Callable[[ScoreContext], ScoreResult]
SCORES: Registry[ScoreFn] = Registry("score")


def run_importance_score(name: str, ctx: ScoreContext) -> ScoreResult:
    """Run the named importance score."""
    return SCORES.get(name)(ctx)


from layerprune.prune.scores import ablation, angular, influence, simple, taylor  # noqa: E402,F401  (registration)
