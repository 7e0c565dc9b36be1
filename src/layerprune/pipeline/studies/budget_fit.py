"""The budget study's curve maths (budget_report.py): the saturating fit share = a (1 - exp(-tokens / t)) of the share
of the drop won back against the training budget, the tokens it needs for a share, and whether its asymptote is
determined; with the study's fixed targets (the task whose limit it asks about, the positive control's gate)."""

from __future__ import annotations

from typing import Any

import numpy as np

LIMIT_TASK = "arith_2d_sub"  # the drop whose limit the study asks about (the positive control must win half of it)
GATE = 0.5  # the share of LIMIT_TASK's drop the positive control must win back at the largest budget
TARGETS = (0.25, 0.5)  # shares of the drop whose token cost is read off each fit
SCALES = np.geomspace(1e2, 1e8, 241)  # the fit's t grid (tokens); a t at the top end: still linear, a undetermined


def saturating_fit(tokens: np.ndarray, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares a and t of share = a (1 - exp(-tokens / t)) along the last axis of `shares` ([..., budgets]):
    for each t of SCALES the best a in closed form, the t of least squared error kept; nan where a share is nan."""
    g = 1.0 - np.exp(-np.asarray(tokens, dtype=np.float64)[None, :] / SCALES[:, None])  # [T, B]
    y = np.asarray(shares, dtype=np.float64)
    a = np.einsum("...b,tb->...t", y, g) / (g * g).sum(axis=1)  # [..., T]
    error = ((y[..., None, :] - a[..., :, None] * g) ** 2).sum(axis=-1)
    best = np.nanargmin(np.where(np.isnan(error), np.inf, error), axis=-1)
    chosen_a = np.take_along_axis(a, best[..., None], axis=-1)[..., 0]
    chosen_t = SCALES[best]
    undefined = np.isnan(y).any(axis=-1)
    return np.where(undefined, np.nan, chosen_a), np.where(undefined, np.nan, chosen_t)


def needed_tokens(a: Any, t: Any, share: float, largest: int) -> np.ndarray:
    """The tokens at which fits (a, t) reach `share`: inf where not within the largest budget, or never; nan where
    the fit is undefined."""
    a, t = np.asarray(a, dtype=np.float64), np.asarray(t, dtype=np.float64)
    reaches = np.isfinite(a) & np.isfinite(t) & (a > share)
    with np.errstate(divide="ignore", invalid="ignore"):
        needed = np.where(reaches, -t * np.log1p(-share / np.where(reaches, a, 1.0)), np.inf)
    needed = np.where(needed > largest, np.inf, needed)
    return np.where(np.isfinite(a) & np.isfinite(t), needed, np.nan)


def tokens_for(a: float, t: float, share: float, largest: int) -> float | None:
    """The tokens at which the fit reaches `share` (None: not within the largest budget, or never)."""
    needed = float(needed_tokens(a, t, share, largest))
    return needed if np.isfinite(needed) else None


def tokens_interval(a: float, t: float, draws: tuple[np.ndarray, np.ndarray], share: float, largest: int,
                    alpha: float) -> dict[str, float | None]:
    """The tokens at which the fit reaches `share` with its percentile interval over the refits on every resample
    (`draws`: their a and t): a refit that does not reach it within the largest budget counts as beyond it, so an
    end there is None (not reached); a resample whose fit is undefined is left out."""
    value = tokens_for(a, t, share, largest)
    needed = needed_tokens(*draws, share, largest).reshape(-1)
    defined = needed[~np.isnan(needed)]
    if not defined.size:
        return {"value": value, "low": None, "high": None}
    ends = np.quantile(defined, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")  # a draw: inf stays inf
    low, high = (float(q) for q in ends)
    return {"value": value, "low": low if np.isfinite(low) else None, "high": high if np.isfinite(high) else None}


def undetermined(arm_curve: dict[str, Any]) -> bool:
    """Whether a curve's asymptote is undetermined: the fit still linear (t at the grid's end), or a's interval open
    or reaching past 100% of the drop."""
    upper = arm_curve["asymptote"].get("high")
    return arm_curve["scale"] >= SCALES[-1] or upper is None or upper > 1.0

