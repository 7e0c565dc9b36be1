"""Per-item statistics of block ablation: paired bootstrap intervals of each drop, and which drops count.

Items are resampled with replacement, the same resample for the full and the skipped model (paired), and
the relative drop is recomputed on each resample. A block is critical only when its drop is above the
threshold AND significant (the lower end of the interval is above 0). When the full model's score is
below `min_base_score` the drops are undefined (None), not 0: there is nothing to lose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Score = Literal["mean", "probability"]


def score(values: np.ndarray, tokens: np.ndarray | None, kind: Score) -> np.ndarray:
    """Score over the last axis: mean (per-item correctness) or exp(-sum NLL / sum tokens) (per-item NLL sums)."""
    if kind == "mean":
        return values.mean(axis=-1)
    assert tokens is not None
    return np.exp(-values.sum(axis=-1) / np.maximum(tokens.sum(axis=-1), 1))


def bootstrap_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] item indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


@dataclass
class DropStat:
    """One block's relative drop with its (1 - alpha) percentile interval and one-sided bootstrap p-value."""

    drop: float | None
    low: float | None
    high: float | None
    p_value: float | None
    significant: bool


def drop_stat(base: np.ndarray, ablated: np.ndarray, tokens: np.ndarray | None, kind: Score, index: np.ndarray,
              alpha: float) -> DropStat:
    """Relative drop (base - ablated) / base of one block, its paired bootstrap interval and p(drop <= 0)."""
    full, skipped = float(score(base, tokens, kind)), float(score(ablated, tokens, kind))
    resampled_tokens = tokens[index] if tokens is not None else None
    b, a = score(base[index], resampled_tokens, kind), score(ablated[index], resampled_tokens, kind)
    with np.errstate(divide="ignore", invalid="ignore"):
        drops = np.where(b > 0, (b - a) / b, np.nan)
    drops = drops[np.isfinite(drops)]
    low, high = (float(v) for v in np.quantile(drops, [alpha / 2, 1 - alpha / 2]))
    p_value = float((1 + np.sum(drops <= 0)) / (1 + len(drops)))
    return DropStat((full - skipped) / full, low, high, p_value, low > 0)


def block_statistics(base: Sequence[float], ablated: Sequence[Sequence[float]], kind: Score, threshold: float,
                     tokens: Sequence[int] | None = None, resamples: int = 1000, alpha: float = 0.05,
                     min_base_score: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """Drops, intervals, p-values, significance and the critical blocks (drop > threshold and significant)."""
    base_values = np.asarray(base, dtype=np.float64)
    token_counts = np.asarray(tokens, dtype=np.float64) if tokens is not None else None
    full = float(score(base_values, token_counts, kind))
    if full < min_base_score or full <= 0:
        return {"base_score": full, "drops": [None] * len(ablated), "intervals": [None] * len(ablated),
                "p_values": [None] * len(ablated), "significant": [False] * len(ablated), "critical": [],
                "undefined": f"full-model score {full:.3g} is below min_base_score {min_base_score:g}"}
    index = bootstrap_indices(len(base_values), resamples, seed)
    stats = [drop_stat(base_values, np.asarray(a, dtype=np.float64), token_counts, kind, index, alpha)
             for a in ablated]
    return {"base_score": full, "drops": [s.drop for s in stats], "intervals": [[s.low, s.high] for s in stats],
            "p_values": [s.p_value for s in stats], "significant": [s.significant for s in stats],
            "critical": [i for i, s in enumerate(stats) if s.drop is not None and s.drop > threshold and s.significant],
            "undefined": None}
