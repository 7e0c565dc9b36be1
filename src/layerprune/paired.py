"""Paired statistics of models that answered the same items (Miller 2024, "Adding Error Bars to Evals").

Every model's per-item scores of one task form one row of a [models, items] matrix; the same items, in the same order,
for every model. Differences are taken item by item (a paired comparison: several times more sensitive than two
independent standard errors when the models agree on most items), their mean gets the paired standard error
sd(d) / sqrt(n), and every figure gets a percentile interval from one seeded bootstrap that draws the same items for
every model. Over several tasks the bootstrap draws items within each task (clustered by task) and averages task
means, so a task with many items does not outweigh one with few.

For 0/1 scores a difference also gets its discordant counts (b: right before and wrong after, c: the reverse) and
McNemar's exact two-sided p-value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0
ALPHA = 0.05


def mcnemar_exact(b: int, c: int) -> float:
    """McNemar's exact two-sided p-value for b and c discordant pairs: 2 * P(X <= min(b, c)), X ~ Bin(b + c, 1/2)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def paired_se(before: np.ndarray, after: np.ndarray) -> float:
    """Standard error of the mean per-item difference after - before: sd(d, ddof=1) / sqrt(n) (0 for one item)."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else 0.0


def is_binary(*rows: np.ndarray) -> bool:
    return all(np.isin(np.asarray(r), (0.0, 1.0)).all() for r in rows)


@dataclass(frozen=True)
class Bootstrap:
    """Task means of every model on the full data (`point`: [models, tasks]) and on each resample ([R, models,
    tasks]); items drawn within each task, the same draw for every model."""

    point: np.ndarray
    resampled: np.ndarray
    resamples: int
    seed: int
    alpha: float = ALPHA

    def interval(self, statistic: Callable[[np.ndarray], np.ndarray | float]) -> dict[str, float | None]:
        """statistic(task means [..., models, tasks]) on the data and its percentile interval over the resamples.

        A statistic that is undefined on a resample (nan, a ratio over a zero drop) leaves that resample out; the
        share of resamples left out is returned as `undefined`."""
        value = float(statistic(self.point))
        draws = np.asarray(statistic(self.resampled), dtype=np.float64).reshape(-1)
        finite = draws[np.isfinite(draws)]
        if not math.isfinite(value) or len(finite) == 0:
            return {"value": value if math.isfinite(value) else None, "low": None, "high": None, "undefined": 1.0}
        low, high = np.quantile(finite, [self.alpha / 2, 1 - self.alpha / 2])
        return {"value": value, "low": float(low), "high": float(high),
                "undefined": float(1 - len(finite) / len(draws))}


def bootstrap(tasks: Sequence[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED,
              alpha: float = ALPHA) -> Bootstrap:
    """The clustered paired bootstrap of per-task [models, items] matrices (same models, in the same order)."""
    rng = np.random.default_rng(seed)
    point, draws = [], []
    for matrix in tasks:
        values = np.asarray(matrix, dtype=np.float64)
        index = rng.integers(0, values.shape[1], size=(resamples, values.shape[1]))
        point.append(values.mean(axis=1))
        draws.append(values[:, index].mean(axis=2).T)  # [R, models]
    return Bootstrap(np.stack(point, axis=-1), np.stack(draws, axis=-1), resamples, seed, alpha)


def difference(before: np.ndarray, after: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED,
               alpha: float = ALPHA) -> dict[str, object]:
    """after - before on the same items: mean, paired SE, bootstrap interval, within-noise (the interval holds 0), and
    for 0/1 scores the discordant counts and McNemar's exact p."""
    a, b = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired scores need two equal-length item vectors, got {a.shape} and {b.shape}")
    boot = bootstrap([np.stack([a, b])], resamples, seed, alpha)
    ci = boot.interval(lambda m: m[..., 1, 0] - m[..., 0, 0])
    out: dict[str, object] = {"diff": ci["value"], "se": paired_se(a, b), "low": ci["low"], "high": ci["high"],
                              "n": len(a), "paired": True, "resamples": resamples, "seed": seed,
                              "within_noise": bool(ci["low"] <= 0 <= ci["high"])}  # type: ignore[operator]
    if is_binary(a, b):
        lost, won = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
        out.update({"b": lost, "c": won, "mcnemar_p": mcnemar_exact(lost, won)})
    return out


def holds_zero(ci: dict[str, float | None]) -> bool | None:
    """Whether a percentile interval includes 0 (None: no interval)."""
    if ci.get("low") is None or ci.get("high") is None:
        return None
    return ci["low"] <= 0 <= ci["high"]  # type: ignore[operator]


def share(base: np.ndarray, pruned: np.ndarray, other: np.ndarray) -> np.ndarray:
    """(other - pruned) / (base - pruned), nan where the drop is not positive."""
    drop = np.asarray(base - pruned, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(drop > 0, (other - pruned) / np.where(drop > 0, drop, 1.0), np.nan)


def normalised(value: np.ndarray, base: np.ndarray, chance: np.ndarray | float) -> np.ndarray:
    """Chance-normalised retention (value - chance) / (base - chance), nan where the original is not above chance."""
    head = np.asarray(base - chance, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(head > 0, (value - chance) / np.where(head > 0, head, 1.0), np.nan)


def format_interval(ci: dict[str, object] | None, digits: int = 1, missing: str = "-") -> str:
    """'55.0% [30.0, 80.0]' (a percent with its interval), '55.0%' without an interval, `missing` without a value."""
    if not ci or ci.get("value") is None:
        return missing
    value = f"{100 * ci['value']:.{digits}f}%"  # type: ignore[operator]
    if ci.get("low") is None:
        return value
    return f"{value} [{100 * ci['low']:.{digits}f}, {100 * ci['high']:.{digits}f}]"  # type: ignore[operator]
