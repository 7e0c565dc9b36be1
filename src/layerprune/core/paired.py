"""Paired statistics of models that answered the same items (Miller 2024, "Adding Error Bars to Evals").

Every model's per-item scores of one task form one row of a [models, items] matrix; the same items, in the same order,
for every model. Differences are taken item by item (a paired comparison: several times more sensitive than two
independent standard errors when the models agree on most items), their mean gets the paired standard error
sd(d) / sqrt(n), and every figure gets a percentile interval from one seeded bootstrap that draws the same items for
every model. Over several tasks the bootstrap draws items within each task (clustered by task) and averages task
means, so a task with many items does not outweigh one with few. A model trained several times under other seeds
(replicates) is one logical model, the mean of its replicates: the bootstrap then draws the replicates too (two-level,
see `bootstrap`; `pool_replicate_draws` for a statistic that is not an item mean, such as paper A's agreement
ratio), and `spread` gives its run-to-run SD beside its item SE.

For 0/1 scores a difference also gets its discordant counts (b: right before and wrong after, c: the reverse) and
McNemar's exact two-sided p-value.

This is the project's one statistics module: every report takes its intervals from here. Besides the paired bootstrap
it holds the refusal to pair models scored on different items (`check_same_items`), the family-wise adjustment of
declared comparisons (`holm_intervals`, `holm`), the recovered share that is stated only where its drop is bounded
away from 0 (`share_interval`, `SHARE_MARGIN`), the run-variance share of a replicated model (`run_variance`), paper
A's verdict from paired differences of agreement ratios (`ratio_comparison`, `invariance_verdict`), and the
per-block drops of an ablation with their intervals (`block_statistics`, for `analyze importance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Literal

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


def differing_items(first: Sequence[tuple[str, str]], other: Sequence[tuple[str, str]]) -> int:
    """How many items two models' per-item records do not share, each record a sequence of (item id, its check: the
    doc hash and prompt hash): ids in one record only, ids whose checks differ, and ids recorded a different number
    of times (a record with an item twice pairs no row with certainty)."""
    mine: dict[str, list[str]] = {}
    theirs: dict[str, list[str]] = {}
    for record, into in ((first, mine), (other, theirs)):
        for key, check in record:
            into.setdefault(key, []).append(check)
    return sum(sorted(mine.get(key, [])) != sorted(theirs.get(key, [])) for key in mine.keys() | theirs.keys())


def check_same_items(task: str, records: dict[str, Sequence[tuple[str, str]]]) -> None:
    """Raise LayerpruneError (one line naming the models, the task and how many items differ) unless every model's
    per-item record of `task` (see `differing_items`) holds the same items as the first model's: a paired comparison
    is taken item by item, so it is refused rather than drawn on a subset or on rows that do not match."""
    if not records:
        return
    first, *others = records
    for other in others:
        count = differing_items(records[first], records[other])
        if count:
            raise LayerpruneError(f"models scored on different items: {first} and {other} on {task} differ in "
                                  f"{count} item(s) (doc ids, or doc and prompt hashes); a paired comparison needs "
                                  "the same items for every model")


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

    def draws(self, statistic: Callable[[np.ndarray], np.ndarray | float]) -> tuple[float, np.ndarray]:
        """statistic(task means [..., models, tasks]) on the data and on every resample ([R])."""
        return float(statistic(self.point)), np.asarray(statistic(self.resampled), dtype=np.float64).reshape(-1)

    def interval(self, statistic: Callable[[np.ndarray], np.ndarray | float],
                 alpha: float | None = None) -> dict[str, float | None]:
        """statistic(task means [..., models, tasks]) on the data and its percentile interval over the resamples
        (at level 1 - alpha; the bootstrap's own alpha by default).

        A statistic that is undefined on a resample (nan, a ratio over a zero drop) leaves that resample out; the
        share of resamples left out is returned as `undefined`."""
        return percentile_interval(*self.draws(statistic), self.alpha if alpha is None else alpha)

    def family(self, statistics: dict[Any, Callable[[np.ndarray], np.ndarray | float]],
               alpha: float | None = None) -> dict[Any, dict[str, Any]]:
        """Each statistic's Holm interval over the family of all of them (`holm_intervals`)."""
        return holm_intervals({key: self.draws(f) for key, f in statistics.items()},
                              self.alpha if alpha is None else alpha)


def percentile_interval(value: float, draws: np.ndarray, alpha: float = ALPHA) -> dict[str, float | None]:
    """The value and the (1 - alpha) percentile interval of its resampled draws, the non-finite draws left out
    (`undefined`: their share)."""
    draws = np.asarray(draws, dtype=np.float64).reshape(-1)
    finite = draws[np.isfinite(draws)]
    if not math.isfinite(value) or len(finite) == 0:
        return {"value": value if math.isfinite(value) else None, "low": None, "high": None, "undefined": 1.0}
    low, high = np.quantile(finite, [alpha / 2, 1 - alpha / 2])
    return {"value": value, "low": float(low), "high": float(high), "undefined": float(1 - len(finite) / len(draws))}


def checked_interval(value: float | None, draws: np.ndarray, alpha: float = ALPHA) -> dict[str, Any]:
    """The value and the (1 - alpha) percentile interval of its resampled draws, given only where it can be read: for
    a statistic that resampling moves to one side (the Spearman of two noisy drop profiles, the Jaccard of their
    critical sets, paper A's ratios of them), a percentile interval can lie beside its own estimate (paper A's
    Jaccard ratio 0.42 with [0.43, 0.52]). Where the value lies outside the central (1 - alpha) of its finite draws,
    or over alpha of the draws are undefined (a ratio whose ceiling resampling takes to 0), the interval is None and
    `undetermined` says why; otherwise it holds the value. `bias`: the draws' median less the value. Measured against
    a known truth (bench/bench_agreement_coverage.py), this interval covers paper A's ratios 91-95% (Spearman and, at
    400 items, Jaccard) with no wrong verdict, where Efron's bias-corrected one covers 83-97% and gives 2-3% wrong
    verdicts; the Jaccard at 150 items covers 69%."""
    plain = percentile_interval(math.nan if value is None else value, draws, alpha)
    if plain["low"] is None:
        return {**plain, "bias": None}
    draws = np.asarray(draws, dtype=np.float64).reshape(-1)
    finite = draws[np.isfinite(draws)]
    out: dict[str, Any] = {**plain, "low": None, "high": None, "bias": float(np.median(finite) - plain["value"])}
    if out["undefined"] > alpha:  # a ratio over a ceiling that resampling takes to 0 or below
        out["undetermined"] = (f"undefined on {100 * out['undefined']:.1f}% of the resamples, over {100 * alpha:g}%: "
                               "the bootstrap cannot bound it")
        return out
    below = (np.sum(finite < out["value"]) + 0.5 * np.sum(finite == out["value"])) / len(finite)
    if below < alpha / 2 or below > 1 - alpha / 2:
        out["undetermined"] = (f"{100 * max(below, 1 - below):.1f}% of the resampled values lie "
                               f"{'above' if below < 0.5 else 'below'} the estimate: the bootstrap is too biased to "
                               "bound it")
        return out
    return {**out, "low": plain["low"], "high": plain["high"]}


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
    width (5 replicates; 1.14 times with s) and covered 1.00. At 3 replicates, as the sweeps run (the test's
    studies: 300, run SD 0 and 0.5 logit), the recovered share covered 0.963 / 0.937 and an arm difference 0.960 /
    0.980, where the plain two-level bootstrap (c = s = 1) covered 0.977 / 0.86 and 0.993 / 0.88: too wide without
    run variance, too narrow with it.
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


def pool_replicate_draws(values: Sequence[float | None], draws: Sequence[np.ndarray], seed: int = SEED,
                         alpha: float = ALPHA) -> tuple[float | None, np.ndarray]:
    """One logical model's statistic from its n replicates (a variant made under n seeds): its value, the mean of the
    replicates' values (None where any is undefined), and its two-level resampled draws [R], from each replicate's
    item-resampled draws ([R] each, resample r drawing the same items for every replicate, as a seeded
    `relative_agreement_draws` or `bootstrap_indices` does), for a statistic that is not an item mean (an agreement
    ratio, a score shift over NLL).

    The same construction as `bootstrap`'s for replicate groups: resample r draws n replicate positions with
    replacement (the replicate stream of `bootstrap` for the same seed) and moves the replicates' mean on its items by
    c(n) * s times the drawn replicates' mean deviation from it. s^2 is the share of the variance of the replicates'
    values that is run variance (method of moments, floored at 0): their variance less what the item draw already
    gives it, the mean over the replicates of the resampled variance of each one's deviation from the replicates'
    mean (for item means, exactly the interaction mean square over items that `bootstrap` subtracts). Replicates that
    agree up to item noise get the item-only interval; replicates that disagree widen it toward the Student t interval
    of their values. One replicate: its own value and draws, unchanged."""
    point = np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    runs = np.stack([np.asarray(d, dtype=np.float64).reshape(-1) for d in draws], axis=1)  # [R, n]
    if runs.shape[1] != len(point):
        raise LayerpruneError(f"{len(point)} replicate values but {runs.shape[1]} replicates' draws")
    value = float(point.mean()) if np.isfinite(point).all() else None
    n = len(point)
    if n == 1:
        return value, runs[:, 0]
    pick = _replicate_draws([n], len(runs), seed)[n]
    centre = runs.mean(axis=1)
    drawn = np.take_along_axis(runs, pick, axis=1).mean(axis=1)
    return value, centre + run_inflation(n, alpha) * _draws_run_share(point, runs, centre) * (drawn - centre)


def _draws_run_share(point: np.ndarray, runs: np.ndarray, centre: np.ndarray) -> float:
    """sqrt of the run-variance share of n replicates' values `point` [n], the item noise of their differences read
    from their resampled draws `runs` [R, n] (resamples where any is undefined left out); 0 where none is left."""
    finite = np.isfinite(runs).all(axis=1)
    if not np.isfinite(point).all() or finite.sum() < 2:
        return 0.0
    total = point.var(ddof=1)
    noise = (runs[finite] - centre[finite, None]).var(axis=0, ddof=1).sum() / (len(point) - 1)
    return math.sqrt(max(0.0, total - noise) / total) if total > 0 else 0.0


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
    `replicates`: their number. With two replicates or more, also `run_variance` (see `run_variance`)."""
    index = range(len(tasks)) if task_index is None else task_index
    chosen = [np.asarray(tasks[t], dtype=np.float64)[list(rows)] for t in index]
    if not chosen or not len(rows):
        raise LayerpruneError("spread needs at least one task and one replicate row")
    scores = np.mean([m.mean(axis=1) for m in chosen], axis=0)
    se = np.sqrt(sum(m.var(axis=1, ddof=1) / m.shape[1] if m.shape[1] > 1 else 0.0 for m in chosen)) / len(chosen)
    out: dict[str, Any] = {"run_sd": float(scores.std(ddof=1)) if len(rows) > 1 else None,
                           "item_se": float(se.mean()), "replicates": len(rows)}
    if len(rows) > 1:
        out["run_variance"] = run_variance(chosen)
    return out


def run_variance(runs: Sequence[np.ndarray]) -> dict[str, Any]:
    """The run-variance share s^2 that the two-level bootstrap gives one replicated model on each task (`_run_share`:
    the share of the variance of its replicate means that is run variance, not replicate x item noise; method of
    moments, floored at 0), from its replicates' [n, items] scores per task. `share`: the mean over tasks; `zero`: the
    tasks where it is estimated at 0, on which the interval holds no run variance at all (a floor, not a finding
    that the runs agree: with few replicates the estimate is often 0); `tasks`: their number."""
    shares = [_run_share(np.asarray(m, dtype=np.float64)) ** 2 for m in runs]
    return {"share": float(np.mean(shares)), "zero": sum(v == 0.0 for v in shares), "tasks": len(shares)}


def run_variance_note(spread_row: dict[str, Any]) -> str:
    """'0.42', or '0 (estimated at 0 on 2 of 3 tasks: no run variance in the interval there)', '-' without one."""
    rv = spread_row.get("run_variance")
    if not rv:
        return "-"
    if rv["zero"]:
        return (f"{rv['share']:.2f} (estimated at 0 on {rv['zero']} of {rv['tasks']} task(s): no run variance in the "
                "interval there)")
    return f"{rv['share']:.2f}"


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


def normalised(value: np.ndarray, base: np.ndarray, chance: np.ndarray | float) -> np.ndarray:
    """Chance-normalised retention (value - chance) / (base - chance), nan where the original is not above chance."""
    head = np.asarray(base - chance, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(head > 0, (value - chance) / np.where(head > 0, head, 1.0), np.nan)


def format_estimate(value: float | None, interval: list[float] | None = None) -> str:
    """'0.62 [0.51, 0.75]' (an estimate on its own scale with its interval), '0.62' without one, 'n/a' without a
    value."""
    text = "n/a" if value is None else f"{value:.2f}"
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def format_bounded(value: float | None, interval: list[float] | None) -> str:
    """An estimate with its interval, '[n/a]' where the bootstrap could not bound a defined value."""
    return format_estimate(value, interval) + (" [n/a]" if value is not None and not interval else "")


def format_interval(ci: dict[str, object] | None, digits: int = 1, missing: str = "-") -> str:
    """'55.0% [30.0, 80.0]' (a percent with its interval), '55.0%' without an interval, `missing` without a value."""
    if not ci or ci.get("value") is None:
        return missing
    value = f"{100 * ci['value']:.{digits}f}%"  # type: ignore[operator]
    if ci.get("low") is None:
        return value
    return f"{value} [{100 * ci['low']:.{digits}f}, {100 * ci['high']:.{digits}f}]"  # type: ignore[operator]


def format_signed(ci: dict[str, object]) -> str:
    """An interval with its sign: '+18.0% [9.0, 27.0]' ('undefined' without a value)."""
    text = format_interval(ci, missing="undefined")
    return f"+{text}" if (ci.get("value") or 0) > 0 else text  # type: ignore[operator]


# --- families of declared comparisons ------------------------------------------------------------------------------

def bootstrap_p(draws: np.ndarray, margin: float = 0.0) -> tuple[float, str]:
    """The two-sided bootstrap p-value of a difference against +-margin from its resampled values, and the side it
    points to: twice the share of resamples at or below +margin ('above') or at or above -margin ('below'), whichever
    is smaller, at most 1 (the share at or below +margin is under alpha / 2 about where the percentile interval at
    level 1 - alpha lies above +margin). No finite draw: (1, 'not distinguished')."""
    finite = np.asarray(draws, dtype=np.float64).reshape(-1)
    finite = finite[np.isfinite(finite)]
    if not len(finite):
        return 1.0, "not distinguished"
    less, more = float(np.mean(finite <= margin)), float(np.mean(finite >= -margin))
    return min(1.0, 2 * min(less, more)), "above" if less <= more else "below"


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the given order: the i-th smallest p times (m - i + 1), made
    non-decreasing along that order, at most 1; a hypothesis is rejected at family-wise level alpha where its adjusted
    p is below alpha."""
    m, adjusted, running = len(pvalues), [1.0] * len(pvalues), 0.0
    for rank, index in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[index]))
        adjusted[index] = running
    return adjusted


def holm_intervals(family: dict[Any, tuple[float, np.ndarray]], alpha: float = ALPHA) -> dict[Any, dict[str, Any]]:
    """Holm-adjusted intervals of a family of differences, from each one's (value, resampled draws).

    Holm's step-down (1979) tests the comparisons in order of their bootstrap p-values (`bootstrap_p` against 0): the
    j-th (from 0) at level alpha / (m - j), as long as every earlier one was declared. Each comparison's interval here
    is its percentile interval at the level Holm tests it at: 1 - alpha / (m - j) for the declared ones, and for the
    rest the level of the first comparison the step-down stopped at (at least as wide as that one's, so none of them
    excludes 0). So a comparison is declared (`declared`: its interval excludes 0) exactly where Holm rejects, and
    the family-wise error rate of the declarations is at most alpha. Why these and not Bonferroni-width intervals
    with Holm decisions: the interval then says the same as the decision beside it (a Bonferroni interval can hold 0
    beside a Holm rejection). These are not simultaneous intervals (no interval consistent with Holm's step-down is
    both simultaneous and informative: Strassburger and Bretz 2008); the first one tested is Bonferroni's.
    A difference undefined on every resample is not declared and its interval is None. `level`: the interval's
    coverage level; `family`: m; `p`: the unadjusted bootstrap p; `p_holm`: Holm's adjusted p."""
    keys = list(family)
    m = len(keys)
    pvalues = [bootstrap_p(family[k][1])[0] for k in keys]
    adjusted = holm(pvalues)
    out: dict[Any, dict[str, Any]] = {}
    level, stopped = alpha / max(m, 1), False
    for rank, i in enumerate(sorted(range(m), key=lambda i: pvalues[i])):
        level = level if stopped else alpha / (m - rank)
        ci = percentile_interval(*family[keys[i]], level)
        declared = not stopped and ci["low"] is not None and (ci["low"] > 0 or ci["high"] < 0)  # type: ignore[operator]
        stopped = not declared
        out[keys[i]] = {**ci, "level": 1 - level, "family": m, "p": pvalues[i], "p_holm": adjusted[i],
                        "declared": bool(declared)}
    return {k: out[k] for k in keys}


def differ_text(holm_ci: dict[str, Any] | None) -> str:
    """What a family-wise interval says of two arms: 'differ (Holm)' where it excludes 0, else 'not shown to differ'."""
    if not holm_ci or holm_ci.get("low") is None:
        return "not shown to differ"
    return "differ (Holm)" if holm_ci.get("declared") else "not shown to differ"


# --- the recovered share -------------------------------------------------------------------------------------------

SHARE_MARGIN = 0.02  # a share is stated only where the drop's interval stays this far above 0 (2 points of a 0-1 score)
NO_CLEAR_DROP = "n/a (no clear drop)"  # the drop's interval holds 0: no share of it to speak of


def share(base: np.ndarray, pruned: np.ndarray, other: np.ndarray) -> np.ndarray:
    """(other - pruned) / (base - pruned), nan where the drop is not positive."""
    drop = np.asarray(base - pruned, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(drop > 0, (other - pruned) / np.where(drop > 0, drop, 1.0), np.nan)


def share_state(drop: dict[str, Any] | None, margin: float = SHARE_MARGIN) -> str | None:
    """None where a share of the drop can be stated; else why not: NO_CLEAR_DROP where the drop's interval holds 0
    (or there is none), 'unbounded ...' where its lower end comes within `margin` of 0.

    A ratio over a drop whose interval nearly reaches 0 has no useful interval (Fieller 1954: the ratio's confidence
    set is bounded only where the denominator's excludes 0, and it widens without limit as the denominator's lower
    end nears 0): its percentile interval then reads as a finding ('won back 11.8% [-150.0, 66.7]') where there is
    none. So such a share is printed as unbounded, with the drop's interval, not as a ratio."""
    if not drop or drop.get("low") is None or drop["low"] <= 0:
        return NO_CLEAR_DROP
    if drop["low"] < margin:
        return (f"unbounded (the drop's interval [{100 * drop['low']:.1f}, {100 * drop['high']:.1f}] comes within "
                f"{100 * margin:g} points of 0)")
    return None


def share_interval(boot: Bootstrap, drop: dict[str, Any] | None, statistic: Callable[[np.ndarray], np.ndarray],
                   margin: float = SHARE_MARGIN) -> dict[str, Any] | str:
    """The share's interval where its drop is bounded away from 0 (`share_state`), else the string saying why not."""
    state = share_state(drop, margin)
    return state if state is not None else boot.interval(statistic)


# --- paper A: agreement ratios against the ceiling and the control -------------------------------------------------

MEASURES_A = ("spearman", "jaccard")  # the agreement measures of paper A's verdict

def ratio_comparison(value: float | None, draws: np.ndarray, control: tuple[float | None, np.ndarray] | None,
                     alpha: float = ALPHA) -> dict[str, Any]:
    """An agreement ratio (agreement / split-half ceiling) against the ceiling, ratio - 1, and against the positive
    control's ratio on the same resamples, ratio - control (paired: both drawn with the same halves and items), each
    with its checked percentile interval (`checked_interval`), and the control's own ratio - 1
    (`control_vs_ceiling`); None where undefined."""
    out: dict[str, Any] = {"ratio": value, "vs_ceiling": None, "vs_control": None, "control_vs_ceiling": None}
    if control is not None and control[0] is not None:
        out["control_vs_ceiling"] = checked_interval(control[0] - 1.0, np.asarray(control[1]) - 1.0, alpha)
    if value is None:
        return out
    out["vs_ceiling"] = checked_interval(value - 1.0, np.asarray(draws) - 1.0, alpha)
    if control is not None and control[0] is not None:
        out["vs_control"] = checked_interval(value - control[0], np.asarray(draws) - np.asarray(control[1]), alpha)
    return out


def invariance_verdict(shift: dict[str, Any] | None, measures: dict[str, dict[str, Any]], has_control: bool,
                       min_shift: float = 0.10, bar: float = 0.9, undefined: list[str] | None = None,
                       control_undefined: str | None = None) -> dict[str, Any]:
    """Paper A's verdict, 'invariant', 'different' or 'not shown', with the reasons, from paired differences with
    intervals (`measures`: per measure the `ratio_comparison` of the variant's ratio).

    The bar is a margin below the ceiling: agreement at or above `bar` of the ceiling counts as the ceiling's.
    'different': on some measure the interval of ratio - 1 lies wholly below bar - 1 (the variant is shown to agree
    less than the margin allows). 'invariant', with no measure different: on some measure the interval of ratio - 1
    lies wholly at or above bar - 1 (shown within the margin), the interval of ratio - control lies above 0 (the
    variant agrees more than the positive control does) and the control is not itself shown within the margin (so the
    comparison could have failed); the target score rose
    by at least `min_shift` with its interval above 0 (a variant worse at its target did not learn it); and the
    control has drops. Anything else, including an interval that reaches across the margin, is 'not shown'.
    `undefined`: why either model has no drops (then 'not shown'); `control_undefined`: the same of the control."""
    if undefined:
        return {"verdict": "not shown", "reasons": [f"no drops to compare: {why}" for why in undefined]}
    defined = {m: measures[m] for m in sorted(measures)
               if measures[m].get("vs_ceiling") and measures[m]["vs_ceiling"].get("low") is not None}
    below = [m for m, c in defined.items() if c["vs_ceiling"]["high"] < bar - 1]
    if below:
        return {"verdict": "different", "reasons": [_below_reason(m, defined[m], bar) for m in below]}
    reasons = [] if defined else ["no defined agreement ratio"]
    reasons += [f"{m} ratio {measures[m]['ratio']:.2f}: {measures[m]['vs_ceiling']['undetermined']}"
                for m in sorted(measures)
                if m not in defined and (measures[m].get("vs_ceiling") or {}).get("undetermined")]
    within = [m for m, c in defined.items() if c["vs_ceiling"]["low"] >= bar - 1]
    if defined and not within:
        reasons += [f"{m} ratio {_ratio_text(c)}: its interval reaches across {bar:g} of the ceiling, so neither "
                    "invariance nor a difference is shown" for m, c in defined.items()]
    reasons += _shift_reasons(shift, min_shift)
    if not has_control:
        reasons.append("no positive control")
    elif control_undefined:
        reasons.append(f"the positive control has no drops ({control_undefined}): it cannot show that the comparison "
                       "can fail")
    elif within and not any(_can_fail(defined[m], bar) for m in within):
        reasons.append(f"the positive control is not shown below {bar:g} of the ceiling and below the variant (control "
                       "- 1, ratio - control: " + "; ".join(
                           f"{m} {_signed_ci(defined[m].get('control_vs_ceiling'))}, "
                           f"{_signed_ci(defined[m].get('vs_control'))}" for m in within)
                       + "): the comparison cannot fail")
    return {"verdict": "not shown" if reasons else "invariant", "reasons": reasons}


def _can_fail(c: dict[str, Any], bar: float) -> bool:
    """Whether the control shows the comparison can fail on a measure: the variant's ratio above the control's
    (paired) and the control not itself shown within the margin."""
    control, own = c.get("vs_control"), c.get("control_vs_ceiling")
    return bool(control and control.get("low") is not None and control["low"] > 0 and own
                and own.get("low") is not None and own["low"] < bar - 1)


def _signed_ci(ci: dict[str, Any] | None) -> str:
    if not ci or ci.get("value") is None:
        return "n/a"
    bounds = " [n/a]" if ci.get("low") is None else f" [{ci['low']:+.2f}, {ci['high']:+.2f}]"
    return f"{ci['value']:+.2f}{bounds}"


def _ratio_text(c: dict[str, Any]) -> str:
    ci = c["vs_ceiling"]
    return f"{c['ratio']:.2f} [{1 + ci['low']:.2f}, {1 + ci['high']:.2f}]"


def _below_reason(measure: str, c: dict[str, Any], bar: float) -> str:
    control = c.get("vs_control")
    than = ("" if not control or control.get("low") is None else
            "; below the control too" if control["high"] < 0 else
            "; above the control" if control["low"] > 0 else "; not told apart from the control")
    return (f"{measure} ratio {_ratio_text(c)} < {bar:g} (ratio - 1 {_signed_ci(c['vs_ceiling'])}; ratio - control "
            f"{_signed_ci(control)}{than})")


def _shift_reasons(shift: dict[str, Any] | None, min_shift: float) -> list[str]:
    if shift is None:
        return ["no target score"]
    low, high = shift["interval"] or (0.0, 0.0)
    if shift["shift"] < min_shift or low <= 0:
        return [f"target moved {100 * shift['shift']:+.1f} points [{100 * low:+.1f}, {100 * high:+.1f}]"
                f"; needs >= +{100 * min_shift:g} with the interval above 0"]
    return []


# --- block ablation: each block's drop with its interval (analyze importance) --------------------------------------

Score = Literal["mean", "probability"]


def score(values: np.ndarray, tokens: np.ndarray | None, kind: Score) -> np.ndarray:
    """Score over the last axis: mean (per-item correctness) or exp(-sum NLL / sum tokens) (per-item NLL sums)."""
    if kind == "mean":
        return values.mean(axis=-1)
    assert tokens is not None
    return np.exp(-values.sum(axis=-1) / np.maximum(tokens.sum(axis=-1), 1))


def bootstrap_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n] item indices drawn with replacement (the first task's draw of `bootstrap` for the same seed)."""
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
    """Per-item statistics of block ablation: each block's relative drop with its paired bootstrap interval (items
    resampled, the same resample for the full and the skipped model) and p-value, and the critical blocks (drop above
    the threshold AND significant: the interval's lower end above 0). Below `min_base_score` the drops are undefined
    (None), not 0: there is nothing to lose."""
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
