"""The comparison's figures from paired items: differences, drop, retention (raw and chance-normalised) and the
recovered share, each with a seeded bootstrap interval; one task, or an average of tasks (clustered by task)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from layerprune.core import paired

PAIRS = (("pruned_vs_baseline", "baseline", "pruned"), ("recovered_vs_pruned", "pruned", "recovered"),
         ("recovered_vs_baseline", "baseline", "recovered"))


def _ci(boot: paired.Bootstrap, statistic: Any) -> dict[str, Any]:
    return boot.interval(statistic)


def _mean_over_tasks(m: np.ndarray, role: int) -> np.ndarray:
    return m[..., role, :].mean(axis=-1)


def task_figures(roles: Sequence[str], tasks: Sequence[tuple[np.ndarray, np.ndarray]],
                 resamples: int = paired.RESAMPLES, seed: int = paired.SEED) -> dict[str, Any]:
    """Paired figures of the roles over one task or several (their unweighted mean), from per-task ([roles, items]
    matrix, per-item chance) pairs: each pair's difference (mean, paired SE, interval, within noise; McNemar for one
    0/1 task), whether the drop is clear (its interval above 0), retention and the recovered share with intervals (the
    share: a string saying why not where the drop's interval holds 0 or comes within `paired.SHARE_MARGIN` of it)."""
    index = {role: i for i, role in enumerate(roles)}
    boot = paired.bootstrap([m for m, _ in tasks], resamples, seed)
    chance = float(np.mean([c.mean() for _, c in tasks]))
    out: dict[str, Any] = {"paired": True, "resamples": resamples, "seed": seed, "tasks": len(tasks),
                           "items": int(sum(m.shape[1] for m, _ in tasks)), "chance": chance}
    for name, low, high in PAIRS:
        if low in index and high in index:
            out[name] = _difference(boot, tasks, index[low], index[high])
    if "baseline" not in index or "pruned" not in index:
        return out
    drop = out["pruned_vs_baseline"]
    out["clear_drop"] = drop["high"] is not None and drop["high"] < 0
    base = index["baseline"]
    for role in ("pruned", "recovered"):
        if role in index:
            r = index[role]
            out[f"retention_{role}"] = _ci(boot, lambda m, r=r: _ratio(_mean_over_tasks(m, r),
                                                                      _mean_over_tasks(m, base)))
            out[f"retention_norm_{role}"] = _ci(boot, lambda m, r=r: paired.normalised(
                _mean_over_tasks(m, r), _mean_over_tasks(m, base), chance))
    if "recovered" in index:
        p, rec = index["pruned"], index["recovered"]
        lost = {"low": None if drop["high"] is None else -drop["high"],
                "high": None if drop["low"] is None else -drop["low"]}  # baseline - pruned
        out["recovered_share"] = paired.share_interval(boot, lost, lambda m: paired.share(
            _mean_over_tasks(m, base), _mean_over_tasks(m, p), _mean_over_tasks(m, rec)))
    return out


def _ratio(value: np.ndarray, base: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(base > 0, value / np.where(base > 0, base, 1.0), np.nan)


def _difference(boot: paired.Bootstrap, tasks: Sequence[tuple[np.ndarray, np.ndarray]], low: int,
                high: int) -> dict[str, Any]:
    """high - low over the tasks' mean: the interval from the clustered bootstrap, the SE from the tasks' paired SEs
    (independent tasks: sqrt(sum se^2) / k); one task also gets McNemar's b, c and exact p where scores are 0/1."""
    if len(tasks) == 1:
        matrix = tasks[0][0]
        one = paired.difference(matrix[low], matrix[high], boot.resamples, boot.seed)
        return {key: one[key] for key in ("diff", "se", "low", "high", "within_noise", "n", "b", "c", "mcnemar_p")
                if key in one}
    ci = boot.interval(lambda m: (m[..., high, :] - m[..., low, :]).mean(axis=-1))
    se = math.sqrt(sum(paired.paired_se(m[low], m[high]) ** 2 for m, _ in tasks)) / len(tasks)
    return {"diff": ci["value"], "se": se, "low": ci["low"], "high": ci["high"],
            "within_noise": paired.holds_zero(ci), "n": int(sum(m.shape[1] for m, _ in tasks))}
