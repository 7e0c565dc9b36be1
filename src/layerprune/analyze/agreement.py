"""How much two models' importance profiles agree, with bootstrap intervals over the shared items.

Both models were scored on the same items (same task, seed and count). Items are resampled with replacement,
the same resample for both models and for every block; on each resample both drop profiles are recomputed, then
their Spearman correlation and the Jaccard overlap of the blocks whose drop is above the threshold. The point
values are the analysis's own (its critical sets also ask for significance; a resample asks only for the threshold).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.stats import spearmanr

from layerprune.analyze import metrics
from layerprune.analyze.stats import Score, bootstrap_indices, score


def per_item(result: dict[str, Any], kind: Score) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(base [items], ablated [blocks, items], tokens [items] or None) from one importance.json task result."""
    items = result["per_item"]
    if kind == "probability":
        return (np.asarray(items["base_item_nll"], dtype=np.float64),
                np.asarray(items["ablated_item_nll"], dtype=np.float64),
                np.asarray(items["item_tokens"], dtype=np.float64))
    return (np.asarray(items["base_item_correct"], dtype=np.float64),
            np.asarray(items["ablated_item_correct"], dtype=np.float64), None)


def resampled_drops(base: np.ndarray, ablated: np.ndarray, tokens: np.ndarray | None, kind: Score,
                    index: np.ndarray) -> np.ndarray:
    """[resamples, blocks] relative drops on each resample of the items (nan where the full score is 0)."""
    resampled_tokens = tokens[index] if tokens is not None else None
    full = score(base[index], resampled_tokens, kind)  # [resamples]
    skipped = np.stack([score(a[index], resampled_tokens, kind) for a in ablated], axis=1)  # [resamples, blocks]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(full[:, None] > 0, (full[:, None] - skipped) / full[:, None], np.nan)


def interval(values: list[float], alpha: float) -> list[float] | None:
    kept = [v for v in values if v is not None and np.isfinite(v)]
    if not kept:
        return None
    return [float(v) for v in np.quantile(kept, [alpha / 2, 1 - alpha / 2])]


def resample_spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))) or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


def profile_agreement(first: dict[str, Any], second: dict[str, Any], kind: Score, threshold: float,
                      resamples: int = 1000, alpha: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """Spearman of the two drop profiles and Jaccard of their critical sets, each with a (1 - alpha) interval."""
    a, b = per_item(first, kind), per_item(second, kind)
    if a[0].shape != b[0].shape or a[1].shape != b[1].shape:
        raise ValueError(f"profiles of different shapes: {a[1].shape} and {b[1].shape} (same items and depth needed)")
    index = bootstrap_indices(len(a[0]), resamples, seed)
    drops_a, drops_b = resampled_drops(*a, kind, index), resampled_drops(*b, kind, index)
    spearmans = [resample_spearman(x, y) for x, y in zip(drops_a, drops_b, strict=True)]
    jaccards = [metrics.jaccard(np.flatnonzero(x > threshold).tolist(), np.flatnonzero(y > threshold).tolist())
                for x, y in zip(drops_a, drops_b, strict=True)]
    point = None
    if all(d is not None for d in first["drops"]) and all(d is not None for d in second["drops"]):
        point = metrics.spearman(first["drops"], second["drops"])
    return {"spearman": point, "spearman_interval": interval(spearmans, alpha),  # type: ignore[arg-type]
            "critical_jaccard": metrics.jaccard(first["critical"], second["critical"]),
            "jaccard_interval": interval(jaccards, alpha),  # type: ignore[arg-type]
            "critical": [first["critical"], second["critical"]], "resamples": resamples, "alpha": alpha,
            "defined_resamples": {"spearman": sum(v is not None for v in spearmans),
                                  "jaccard": sum(v is not None for v in jaccards)}}
