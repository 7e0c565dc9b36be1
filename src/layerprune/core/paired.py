"""Paired statistics of models that answered the same items (Miller 2024, "Adding Error Bars to Evals").

Every model's per-item scores of one task form one row of a [models, items] matrix; the same items, in the same order,
for every model. Differences are taken item by item (a paired comparison: several times more sensitive than two
independent standard errors when the models agree on most items), their mean gets the paired standard error
sd(d) / sqrt(n), and every figure gets a percentile interval from one seeded bootstrap that draws the same items for
every model. Over several tasks the bootstrap draws items within each task (clustered by task) and averages task
means, so a task with many items does not outweigh one with few. A model trained several times under other seeds
(replicates) is one logical model, the mean of its replicates: the bootstrap then draws the replicates too (two-level,
see `bootstrap`), and `spread` gives its run-to-run SD beside its item SE.

For 0/1 scores a difference also gets its discordant counts (b: right before and wrong after, c: the reverse) and
McNemar's exact two-sided p-value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from layerprune.core.errors import LayerpruneError

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
    """Task means of every logical model on the full data (`point`: [models, tasks]) and on each resample ([R,
    models, tasks]); items drawn within each task, the same draw for every model; with replicate groups, replicates
    drawn too (see `bootstrap`). `replicates`: each logical model's number of replicates (1: its run-to-run variance
    is unknown and left out, not zero)."""

    point: np.ndarray
    resampled: np.ndarray
    resamples: int
    seed: int
    alpha: float = ALPHA
    replicates: tuple[int, ...] = ()

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


def bootstrap(tasks: Sequence[np.ndarray], resamples: int = RESAMPLES, seed: int = SEED, alpha: float = ALPHA,
              replicates: Sequence[Sequence[int]] | None = None) -> Bootstrap:
    """The clustered paired bootstrap of per-task [rows, items] matrices (same rows, in the same order), one row per
    evaluated model; with `replicates`, two-level over training runs and items.

    `replicates` lists, per logical model, the rows of its replicates (models trained alike but for the seeds), in
    seed order: position k of every group is the k-th seed. Every row belongs to exactly one group. A logical
    model's value on a task is the mean over its replicates of their task means. None: one row per model, one
    replicate each (the item-only bootstrap: each model taken as fixed).

    Each resample draws the items within each task (one draw shared by every row) and, independently, the
    replicates with replacement: one draw of positions per resample, shared by every task and by every logical
    model with the same number of replicates (replicate k of every arm ran with the same seed, so arms stay paired
    by seed). This is the crossed-design ("pigeonhole", Owen 2007) bootstrap, with two corrections. A resampled
    model's value on a task is its replicate mean plus c(n) * s times the mean deviation of the drawn replicates
    from that mean, all on the resampled items:
    - s removes the pigeonhole bootstrap's overcount (Owen 2007): the spread of replicate means holds the replicate
      x item interaction (for 0/1 scores, most of the per-item noise), which the item draw already carries; s^2 is
      the share of the variance of the replicate means that is run variance, by the method of moments
      (var(replicate means) - interaction mean square / items, floored at 0, over var(replicate means)), per model
      and task.
    - c(n) = sqrt(n / (n - 1)) * t(n - 1) / z (`run_inflation`): sqrt(n / (n - 1)) undoes the bootstrap's
      shrinking of the spread of n values (their resampled mean's SD is sqrt((n - 1) / n) of sd / sqrt(n)); t / z
      widens the run part to the Student t interval that a run variance known from n - 1 degrees of freedom needs
      (c = 1.58 for n = 5, 2.69 for n = 3, 9.2 for n = 2): with run variance dominant, the interval is about the t
      interval of the replicate means; with item variance dominant, the extra width is small.
    In simulation (as in tests/test_paired_replicates.py: 0/1 items, logit-normal item difficulty and run effects,
    3, 5 or 10 replicates x 200 items, 300 studies) the 95% interval of an arm's mean covered 0.94-0.96 and of an
    arm-vs-arm difference 0.95-0.98 for run SDs from 0 to 1 logit, where the item-only bootstrap (the replicate mean
    taken as one fixed model) covered down to 0.32. With sqrt(n / (n - 1)) alone the arm's mean fell to 0.90 (5
    replicates, run SD 1 logit); without s, at no run variance, the interval was 1.7 times the item-only one's
    width (5 replicates; 1.14 times with s) and covered 1.00.
    A model with one replicate is not drawn over runs: its run variance is unknown, not zero, and
    `Bootstrap.replicates` says so. Without groups, or with one row per group, the numbers are exactly those of the
    item-only bootstrap for the same seed (the replicate draws use a random stream of their own)."""
    rng = np.random.default_rng(seed)
    point, draws = [], []
    for matrix in tasks:
        values = np.asarray(matrix, dtype=np.float64)
        index = rng.integers(0, values.shape[1], size=(resamples, values.shape[1]))
        point.append(values.mean(axis=1))
        draws.append(values[:, index].mean(axis=2).T)  # [R, models]
    rows, resampled = np.stack(point, axis=-1), np.stack(draws, axis=-1)
    if replicates is None:
        return Bootstrap(rows, resampled, resamples, seed, alpha, (1,) * len(rows))
    groups = _check_groups(replicates, len(rows))
    picks = _replicate_draws(sorted({len(g) for g in groups if len(g) > 1}), resamples, seed)
    pooled = [_pool([np.asarray(m, dtype=np.float64)[g] for m in tasks], resampled[:, g], picks.get(len(g)), alpha)
              for g in groups]
    return Bootstrap(np.stack([rows[g].mean(axis=0) for g in groups]), np.stack(pooled, axis=1), resamples, seed,
                     alpha, tuple(len(g) for g in groups))


def _check_groups(replicates: Sequence[Sequence[int]], rows: int) -> list[list[int]]:
    groups = [[int(r) for r in group] for group in replicates]
    flat = [r for group in groups for r in group]
    if any(not group for group in groups) or sorted(flat) != list(range(rows)):
        raise LayerpruneError(f"replicate groups must share the {rows} rows out, each row in exactly one non-empty "
                              f"group; got {groups}")
    return groups


def _replicate_draws(sizes: Sequence[int], resamples: int, seed: int) -> dict[int, np.ndarray]:
    """Per number of replicates n, the drawn positions [R, n]: a stream apart from the items', so that grouping
    leaves the item draws (and the numbers without replicates) as they were."""
    rng = np.random.default_rng((seed, 1))
    return {n: rng.integers(0, n, size=(resamples, n)) for n in sizes}


def _run_share(runs: np.ndarray) -> float:
    """sqrt of the share of the variance of n replicates' means [n, items] that is run variance, not the replicate x
    item interaction that the item draw already carries (method of moments; 0 where the interaction explains all)."""
    n, items = runs.shape
    if n < 2 or items < 2:
        return 1.0
    means = runs.mean(axis=1)
    total = means.var(ddof=1)
    resid = runs - means[:, None] - runs.mean(axis=0)[None] + runs.mean()
    noise = (resid**2).sum() / ((n - 1) * (items - 1)) / items
    return math.sqrt(max(0.0, total - noise) / total) if total > 0 else 0.0


def _pool(data: list[np.ndarray], runs: np.ndarray, pick: np.ndarray | None, alpha: float) -> np.ndarray:
    """[R, tasks] resampled values of one logical model from its replicates' per-task scores ([n, items] each) and
    resampled task means [R, n, tasks]; `pick`: the drawn replicate positions [R, n] (None: one replicate)."""
    centre = runs.mean(axis=1)
    if pick is None:
        return centre
    shrink = np.array([_run_share(scores) for scores in data])
    drawn = np.take_along_axis(runs, pick[:, :, None], axis=1).mean(axis=1)
    return centre + run_inflation(runs.shape[1], alpha) * shrink * (drawn - centre)


def run_inflation(n: int, alpha: float = ALPHA) -> float:
    """c(n) = sqrt(n / (n - 1)) * t_{n-1}(1 - alpha/2) / z(1 - alpha/2): the factor on the replicates' deviations
    from their mean that makes a percentile bootstrap over n replicates about a Student t interval (1 for n = 1)."""
    if n < 2:
        return 1.0
    return math.sqrt(n / (n - 1)) * t_quantile(1 - alpha / 2, n - 1) / NormalDist().inv_cdf(1 - alpha / 2)


def t_quantile(q: float, df: int) -> float:
    """The q quantile (q > 1/2) of Student's t with an integer number of degrees of freedom, by bisection on the
    closed-form distribution function (Abramowitz and Stegun 26.7.3-4): no scipy in the base install."""
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < q:
        low, high = high, 2 * high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < q else (low, mid)
    return (low + high) / 2


def _t_cdf(t: float, df: int) -> float:
    theta = math.atan(t / math.sqrt(df))
    c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + ... ))
        for k in range(1, (df - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0))
    else:  # even: sin (1 + 1/2 cos^2 + 1.3/(2.4) cos^4 + ...)
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        inside = math.sin(theta) * total
    return 0.5 + inside / 2


def spread(tasks: Sequence[np.ndarray], rows: Sequence[int],
           task_index: Sequence[int] | None = None) -> dict[str, float | int | None]:
    """Run-to-run and item spread of one logical model over one task or the unweighted mean of several.

    `run_sd`: the SD (ddof 1) across its replicates (`rows` of the per-task [rows, items] matrices) of each
    replicate's score (its mean of task means); None with one replicate (unknown, not zero). `item_se`: the mean over
    replicates of the item standard error of that score, sqrt(sum over tasks of sd(items, ddof 1)^2 / items) / tasks.
    `replicates`: their number."""
    index = range(len(tasks)) if task_index is None else task_index
    chosen = [np.asarray(tasks[t], dtype=np.float64)[list(rows)] for t in index]
    if not chosen or not len(rows):
        raise LayerpruneError("spread needs at least one task and one replicate row")
    scores = np.mean([m.mean(axis=1) for m in chosen], axis=0)
    se = np.sqrt(sum(m.var(axis=1, ddof=1) / m.shape[1] if m.shape[1] > 1 else 0.0 for m in chosen)) / len(chosen)
    return {"run_sd": float(scores.std(ddof=1)) if len(rows) > 1 else None, "item_se": float(se.mean()),
            "replicates": len(rows)}


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
