"""How much two models' importance profiles agree, with bootstrap intervals over the shared items.

Both models were scored on the same items (same task, seed and count). Items are resampled with replacement,
the same resample for both models and for every block; on each resample both drop profiles are recomputed, then
their Spearman correlation and the Jaccard overlap of the blocks whose drop is above the threshold. The point
values are the analysis's own (its critical sets also ask for significance; a resample asks only for the threshold).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from scipy.stats import spearmanr

from layerprune.analyze import metrics
from layerprune.core.paired import Score, bootstrap_indices, checked_interval, score


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
    """[resamples, blocks] relative drops on each resample of the items (index [resamples, k]: the items drawn; nan
    where the full score is 0): `weighted_drops` on each item's count in the resample."""
    counts = np.zeros((len(index), len(base)))
    np.add.at(counts, (np.arange(len(index))[:, None], index), 1.0)
    return weighted_drops(base, ablated, tokens, kind, counts)


def weighted_drops(base: np.ndarray, ablated: np.ndarray, tokens: np.ndarray | None, kind: Score,
                   weights: np.ndarray) -> np.ndarray:
    """[rows, blocks] relative drops on each row of item weights [rows, items] (an item's multiplicity in a
    resample, 0 outside the half taken; nan where the full score is 0 or the row holds no item)."""
    total = weights.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "mean":
            full, skipped = weights @ base / total, (weights @ ablated.T) / total[:, None]
        else:
            assert tokens is not None
            count = np.maximum(weights @ tokens, 1)
            full, skipped = np.exp(-(weights @ base) / count), np.exp(-(weights @ ablated.T) / count[:, None])
        return np.where((full[:, None] > 0) & (total[:, None] > 0), (full[:, None] - skipped) / full[:, None],
                        np.nan)


def interval(values: list[float], alpha: float) -> list[float] | None:
    """The (1 - alpha) percentile interval of resampled values (None left out), for a smooth statistic (a score
    shift)."""
    kept = [v for v in values if v is not None and np.isfinite(v)]
    if not kept:
        return None
    return [float(v) for v in np.quantile(kept, [alpha / 2, 1 - alpha / 2])]


def agreement_interval(value: float | None, values: list[float | None] | np.ndarray,
                       alpha: float) -> list[float] | None:
    """The (1 - alpha) checked percentile interval (`core.paired.checked_interval`) of an agreement (a Spearman of
    drops, a Jaccard of critical sets, a ratio of them to their ceiling), which resampling moves to one side; None
    where it is undefined or the bootstrap cannot bound it."""
    drawn = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    ci = checked_interval(value, drawn, alpha)
    return None if ci["low"] is None else [ci["low"], ci["high"]]


def resample_spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))) or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b).statistic)


def profile_agreement(first: dict[str, Any], second: dict[str, Any], kind: Score, threshold: float,
                      resamples: int = 1000, alpha: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """Spearman of the two drop profiles and Jaccard of their critical sets, each with a (1 - alpha) interval."""
    undefined = [r["undefined"] for r in (first, second) if r.get("undefined")]
    if undefined or not all(d is not None for d in [*first["drops"], *second["drops"]]):
        # a model below the analysis's min_base_score has no drops and so no critical set: nothing to compare (its
        # empty set is not a set of 0 critical blocks), however the resamples fall
        return {"spearman": None, "spearman_interval": None, "critical_jaccard": None, "jaccard_interval": None,
                "critical": [first["critical"], second["critical"]], "resamples": resamples, "alpha": alpha,
                "undefined": "; ".join(undefined) or "undefined drops", "defined_resamples": None}
    a, b = per_item(first, kind), per_item(second, kind)
    if a[0].shape != b[0].shape or a[1].shape != b[1].shape:
        raise ValueError(f"profiles of different shapes: {a[1].shape} and {b[1].shape} (same items and depth needed)")
    index = bootstrap_indices(len(a[0]), resamples, seed)
    drops_a, drops_b = resampled_drops(*a, kind, index), resampled_drops(*b, kind, index)
    spearmans = [resample_spearman(x, y) for x, y in zip(drops_a, drops_b, strict=True)]
    jaccards = [metrics.jaccard(np.flatnonzero(x > threshold).tolist(), np.flatnonzero(y > threshold).tolist())
                for x, y in zip(drops_a, drops_b, strict=True)]
    rho, overlap = metrics.spearman(first["drops"], second["drops"]), metrics.jaccard(first["critical"],
                                                                                       second["critical"])
    return {"spearman": rho, "spearman_interval": agreement_interval(rho, spearmans, alpha),
            "critical_jaccard": overlap, "jaccard_interval": agreement_interval(overlap, jaccards, alpha),
            "critical": [first["critical"], second["critical"]], "resamples": resamples, "alpha": alpha,
            "defined_resamples": {"spearman": sum(v is not None for v in spearmans),
                                  "jaccard": sum(v is not None for v in jaccards)}}


Matrix = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # per_item's (base, ablated, tokens)
MEASURES = ("spearman", "jaccard")


def row_spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman of each row of x [rows, blocks] with the same row of y (ties share their mean rank); nan where a
    row has an undefined drop or is constant."""
    from scipy.stats import rankdata

    ok = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
    rx, ry = rankdata(np.nan_to_num(x), axis=1), rankdata(np.nan_to_num(y), axis=1)
    rx, ry = rx - rx.mean(axis=1, keepdims=True), ry - ry.mean(axis=1, keepdims=True)
    den = np.sqrt((rx ** 2).sum(axis=1) * (ry ** 2).sum(axis=1))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok & (den > 0), (rx * ry).sum(axis=1) / den, np.nan)


def row_jaccard(x: np.ndarray, y: np.ndarray, threshold: float) -> np.ndarray:
    """Jaccard of each row's critical set (drop above the threshold) in x and y; nan where both are empty or a row
    has an undefined drop."""
    ok = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
    a, b = x > threshold, y > threshold
    union = (a | b).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok & (union > 0), (a & b).sum(axis=1) / union, np.nan)


def half_splits(n: int, splits: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`splits` seeded random partitions of n items into two disjoint halves of n // 2 items (odd n: one left out)."""
    if n < 4:
        raise ValueError(f"a split-half comparison needs at least 4 items, got {n}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(splits):
        order = rng.permutation(n)
        out.append((np.sort(order[: n // 2]), np.sort(order[n // 2: 2 * (n // 2)])))
    return out


def half_masks(n: int, halves: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each split's halves as 0/1 item weights [1, n]."""
    def mask(part: np.ndarray) -> np.ndarray:
        out = np.zeros((1, n))
        out[0, part] = 1.0
        return out
    return [(mask(a), mask(b)) for a, b in halves]


def cross_half(first: Matrix, second: Matrix, kind: Score, threshold: float, a: np.ndarray,
               b: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of the item weights a [rows, n] and b [rows, n] (two halves: disjoint items): first's profile on a
    against second's on b and first's on b against second's on a, averaged; {measure: [rows]}."""
    fa, fb = weighted_drops(*first, kind, a), weighted_drops(*first, kind, b)
    sa, sb = weighted_drops(*second, kind, a), weighted_drops(*second, kind, b)
    with warnings.catch_warnings():  # nanmean of two nan rows
        warnings.simplefilter("ignore", RuntimeWarning)
        return {"spearman": np.nanmean([row_spearman(fa, sb), row_spearman(fb, sa)], axis=0),
                "jaccard": np.nanmean([row_jaccard(fa, sb, threshold), row_jaccard(fb, sa, threshold)], axis=0)}


def _value(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None


def split_half_agreement(first: Matrix, second: Matrix, kind: Score, threshold: float, splits: int = 4,
                         seed: int = 0) -> dict[str, Any]:
    """Spearman of the drops and Jaccard of the critical sets of first's profile on one half of the items against
    second's on the other half (both ways), averaged over `splits` seeded random halvings (undefined ones left
    out). With first == second it is the split-half reliability: the agreement a model has with itself when only
    the items change, the ceiling any comparison at half the items can reach. No Spearman-Brown step-up: both
    sides of every comparison built on it are measured at the same half size."""
    per: dict[str, list[float | None]] = {m: [] for m in MEASURES}
    n = len(first[0])
    for a, b in half_masks(n, half_splits(n, splits, seed)):
        values = cross_half(first, second, kind, threshold, a, b)
        for m in MEASURES:
            per[m].append(_value(values[m][0]))
    out: dict[str, Any] = {}
    for m in MEASURES:
        kept = [v for v in per[m] if v is not None]
        out[m] = float(np.mean(kept)) if kept else None
    return {**out, "per_split": per, "splits": splits, "half_items": len(first[0]) // 2}


def _split_means(original: Matrix, variant: Matrix, kind: Score, threshold: float,
                 halves: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, dict[str, np.ndarray]]:
    """{measure: {cross, original, variant: [rows]}}: each averaged over the splits (undefined splits left out)."""
    parts: dict[str, dict[str, list[np.ndarray]]] = {m: {"cross": [], "original": [], "variant": []}
                                                     for m in MEASURES}
    for a, b in halves:
        for name, (x, y) in (("cross", (original, variant)), ("original", (original, original)),
                             ("variant", (variant, variant))):
            values = cross_half(x, y, kind, threshold, a, b)
            for m in MEASURES:
                parts[m][name].append(values[m])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return {m: {name: np.nanmean(v, axis=0) for name, v in per.items()} for m, per in parts.items()}


def _ratio(means: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(ceiling, agreement / ceiling): the ceiling is the geometric mean of both models' split-half reliabilities
    (classical disattenuation), nan where either is not positive."""
    product = means["original"] * means["variant"]
    with np.errstate(divide="ignore", invalid="ignore"):
        ceiling = np.where(product > 0, np.sqrt(np.where(product > 0, product, 1.0)), np.nan)
        return ceiling, means["cross"] / ceiling


def relative_agreement(original: Matrix, variant: Matrix, kind: Score, threshold: float, splits: int = 4,
                       resamples: int = 1000, alpha: float = 0.05, seed: int = 0) -> dict[str, Any]:
    """`relative_agreement_draws` without the resampled ratios."""
    return relative_agreement_draws(original, variant, kind, threshold, splits, resamples, alpha, seed)[0]


def relative_agreement_draws(original: Matrix, variant: Matrix, kind: Score, threshold: float, splits: int = 4,
                             resamples: int = 1000, alpha: float = 0.05,
                             seed: int = 0) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The two models' agreement as a fraction of its reliability ceiling, like for like at half the items.

    On each of `splits` seeded halvings of the shared items, the original's profile on one half is compared with
    the variant's on the other (both ways; `cross`), and each model with itself across the halves (its split-half
    reliability). ratio = cross / sqrt(reliability_original * reliability_variant), per measure (Spearman of the
    drops, Jaccard of the critical sets). Interval: (1 - alpha) checked percentile, over `resamples` bootstrap resamples
    of the items, one resample shared by every split and each item's copies kept in its half (so the halves stay
    disjoint), the whole ratio recomputed. (Resampling each split's halves on their own draws, as this did before,
    averages out the splits' shared item noise: its intervals were about 35% too narrow on the Spearman,
    bench/bench_agreement_coverage.py.) Also returns each
    measure's resampled ratios [resamples]: two calls on the same number of items with the same seed draw the same
    halves and items, so their ratios are paired resample by resample (the variant's against the control's)."""
    n = len(original[0])
    if original[1].shape != variant[1].shape:
        raise ValueError(f"profiles of different shapes: {original[1].shape} and {variant[1].shape} (same items and "
                         "depth needed)")
    masks = half_masks(n, half_splits(n, splits, seed))
    point = _split_means(original, variant, kind, threshold, masks)
    # one resample of the items shared by every split (an item's copies stay in its half): the splits' estimates
    # share their items as the estimate's do, so their average varies as the estimate does
    copies = np.random.default_rng(seed + 1).multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)
    boot = _split_means(original, variant, kind, threshold, [(copies * a, copies * b) for a, b in masks])
    out: dict[str, Any] = {"splits": splits, "half_items": n // 2, "resamples": resamples, "alpha": alpha}
    draws = {}
    for m in MEASURES:
        ceiling, ratio = _ratio(point[m])
        draws[m] = _ratio(boot[m])[1]
        out[m] = {"agreement": _value(point[m]["cross"][0]), "ceiling": _value(ceiling[0]),
                  "reliability": [_value(point[m]["original"][0]), _value(point[m]["variant"][0])],
                  "ratio": _value(ratio[0]), "ratio_interval": agreement_interval(_value(ratio[0]), draws[m], alpha)}
    return out, draws


def score_shift(original: Matrix, variant: Matrix, kind: Score, resamples: int = 1000, alpha: float = 0.05,
                seed: int = 0) -> dict[str, Any]:
    """The unablated scores of both models on the shared items, variant - original, with a (1 - alpha) paired
    bootstrap interval (the same resample of the items for both)."""
    return score_shift_draws(original, variant, kind, resamples, alpha, seed)[0]


def score_shift_draws(original: Matrix, variant: Matrix, kind: Score, resamples: int = 1000, alpha: float = 0.05,
                      seed: int = 0) -> tuple[dict[str, Any], np.ndarray]:
    """`score_shift` and its resampled shifts [resamples] (the same items on resample r for any variant scored on
    the same number of items with the same seed)."""
    if original[0].shape != variant[0].shape:
        raise ValueError(f"scores on different items: {original[0].shape} and {variant[0].shape}")
    index = bootstrap_indices(len(original[0]), resamples, seed)
    before, after = score(original[0], original[2], kind), score(variant[0], variant[2], kind)
    diffs = score(variant[0][index], None if variant[2] is None else variant[2][index], kind) \
        - score(original[0][index], None if original[2] is None else original[2][index], kind)
    return {"before": float(before), "after": float(after), "shift": float(after - before),
            "interval": interval(diffs.tolist(), alpha)}, diffs
