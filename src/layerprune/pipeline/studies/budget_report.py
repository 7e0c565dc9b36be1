"""budget.md of a sweep with `budgets` (issue 58): the share of the drop won back against the training budget, per
arm, k and task, and a saturating fit per curve.

Every budget point of an arm (ARM-kK@<budget>, the largest ARM-kK itself; replicates one logical label) is scored on
the same items as the original and the pruned model, so the sweep's one paired bootstrap (items within each task,
two-level over replicates) gives every share its interval, and the fit share = a (1 - exp(-tokens / t)) is made on
the data and on every resample alike: a's interval is the percentile interval of its refits. The tokens a curve needs
for 25% and 50% of the drop are read off the fit where the fit reaches them within the largest budget.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core import paired
from layerprune.core.outputs import write_atomic
from layerprune.core.paired import format_interval
from layerprune.pipeline.paired_table import Figures, load_matrix

LIMIT_TASK = "arith_2d_sub"  # the drop whose limit the study asks about (the positive control must win half of it)
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


def tokens_for(a: float, t: float, share: float, largest: int) -> float | None:
    """The tokens at which the fit reaches `share` (None: not within the largest budget, or never)."""
    if not (np.isfinite(a) and np.isfinite(t)) or a <= share:
        return None
    needed = -t * np.log(1.0 - share / a)
    return float(needed) if needed <= largest else None


def budget_labels(study: Any, arm: str | None, k: int) -> list[tuple[int, str]]:
    """(budget, logical label) of an arm's points at k, budget by budget (the largest: the recovered label itself)."""
    from layerprune.pipeline.studies.sweep_grid import budget_tag, recovered_label

    label = recovered_label(arm, k)
    return [(b, f"{label}@{budget_tag(b)}") for b in study.budgets[:-1]] + [(study.budgets[-1], label)]


def curve(figures: Figures, study: Any, arm: str | None, k: int, task: str) -> dict[str, Any] | None:
    """One arm's curve at k on one task: the drop, the share at each budget (or why none can be stated), the fit's
    a (with its interval) and t, the tokens for TARGETS, and whether the share still rises at the largest budget."""
    points = [(b, label) for b, label in budget_labels(study, arm, k) if label in figures.labels]
    if len(points) != len(study.budgets) or not figures.has(task):
        return None
    base, pruned = "baseline", f"pruned-k{k}"
    drop = figures.difference(base, pruned, task)
    out: dict[str, Any] = {"arm": arm, "k": k, "task": task, "drop": drop}
    state = paired.share_state(drop)
    if state is not None:
        return {**out, "shares": {str(b): state for b, _ in points}, "state": state}

    def shares(m: np.ndarray) -> np.ndarray:
        return np.stack([figures.share_of(label, pruned, task, m, base) for _, label in points], axis=-1)

    tokens = np.array([b for b, _ in points], dtype=np.float64)
    out["shares"] = {str(b): figures.interval(lambda m, i=i: shares(m)[..., i]) for i, (b, _) in enumerate(points)}
    out["asymptote"] = figures.interval(lambda m: saturating_fit(tokens, shares(m))[0])
    a, t = (float(v) for v in saturating_fit(tokens, shares(figures.boot.point)))
    out["scale"] = t
    out["tokens_for"] = {str(p): tokens_for(a, t, p, int(tokens[-1])) for p in TARGETS}
    out["rising"] = figures.interval(lambda m: shares(m)[..., -1] - shares(m)[..., -2])
    return out


def verdict(arm_curve: dict[str, Any] | None, control: dict[str, Any] | None) -> str:
    """The protocol's verdict on an arm's curve of LIMIT_TASK, given the positive control's: 'limit structural at
    this scale' (a's upper end below 50% and the control at 50% or more at the largest budget), 'budget-bound' (the
    share still rises at the largest budget and a is undetermined: its interval open or reaching past 100%), else
    'not shown'."""
    if not arm_curve or "asymptote" not in arm_curve:
        return "not shown"
    upper = arm_curve["asymptote"].get("high")
    largest = list(control["shares"].values())[-1] if control and "shares" in control else None
    control_ok = isinstance(largest, dict) and (largest.get("value") or 0) >= 0.5
    if upper is not None and upper < 0.5 and control_ok:
        return "limit structural at this scale"
    rising = (arm_curve["rising"].get("low") or 0) > 0
    if rising and (upper is None or upper > 1.0):
        return "budget-bound"
    return "not shown"


def budget_figures(study: Any, root: Path) -> tuple[Figures, list[str]]:
    """The sweep's paired figures with every task its own group."""
    from layerprune.pipeline.studies.cells import split_label
    from layerprune.pipeline.studies.sweep_report import evaluated

    labels, matrices, chance, _ = load_matrix(evaluated(study, root))
    replicates: dict[str, list[str]] = {}
    for label in labels:
        replicates.setdefault(split_label(label)[0], []).append(label)
    return Figures(labels, matrices, chance, {t: [t] for t in matrices}, replicates=replicates), list(matrices)


def write_budget_report(study: Any, root: Path, control_arm: str | None = None) -> Path:
    """budget.md and budget.json: every arm's curve per k and task, the fits and the verdicts; `control_arm`: the
    positive control (default: the arm with its own prompts, study.arm_prompts, if there is one)."""
    from layerprune.pipeline.studies.sweep_grid import arm_names

    figures, tasks = budget_figures(study, root)
    control_arm = control_arm or next(iter(getattr(study, "arm_prompts", {}) or {}), None)
    curves = [c for k in study.ratios for arm in arm_names(study) for task in tasks
              if (c := curve(figures, study, arm, k, task)) is not None]
    by = {(c["arm"], c["k"], c["task"]): c for c in curves}
    verdicts = {f"{arm}-k{k}": verdict(by.get((arm, k, LIMIT_TASK)), by.get((control_arm, k, LIMIT_TASK)))
                for k in study.ratios for arm in arm_names(study)
                if arm != control_arm and any(key[:2] == (arm, k) for key in by)}
    write_atomic(root / "budget.json", json.dumps({"budgets": study.budgets, "control_arm": control_arm,
                                                   "curves": curves, "verdicts": verdicts}, indent=1, default=str))
    plot_curves(curves, study.budgets, root / "budget.png")
    text = format_budget(study, curves, verdicts, control_arm) + ["", "![budget curves](budget.png)"]
    write_atomic(root / "budget.md", "\n".join(text) + "\n")
    return root / "budget.md"


def plot_curves(curves: list[dict[str, Any]], budgets: list[int], path: Path) -> None:
    """One panel per task: each arm's share (per k) against the budget on a log axis, its interval as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stated = [c for c in curves if all(isinstance(s, dict) and s.get("value") is not None
                                       for s in c["shares"].values())]
    tasks = sorted({c["task"] for c in stated})
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(4.5 * max(1, len(tasks)), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks or [""], strict=True):
        for c in (c for c in stated if c["task"] == task):
            shares = list(c["shares"].values())
            values = [s["value"] for s in shares]
            low = [s["value"] - (s["low"] if s.get("low") is not None else s["value"]) for s in shares]
            high = [(s["high"] if s.get("high") is not None else s["value"]) - s["value"] for s in shares]
            ax.errorbar(budgets, values, yerr=[low, high], marker="o", capsize=3, label=f"{c['arm']} k={c['k']}")
        ax.set_xscale("log")
        ax.axhline(0.5, color="grey", lw=0.8, ls="--")
        ax.set_title(task or "no share could be stated")
        ax.set_xlabel("unpadded target tokens")
        ax.set_ylabel("share of the drop won back")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_budget(study: Any, curves: list[dict[str, Any]], verdicts: dict[str, str],
                  control_arm: str | None) -> list[str]:
    """The curve table (arm x k x task, a share column per budget), the fits and the verdicts."""
    from layerprune.pipeline.studies.sweep_grid import budget_tag

    tags = [budget_tag(b) for b in study.budgets]
    lines = [f"# Budget curves: {study.name}", "",
             "Share of the drop won back, (recovered - pruned) / (original - pruned), at each budget of unpadded "
             "target tokens, with its paired interval (items, and replicates where there are several); the fit "
             "share = a (1 - exp(-tokens / t)) per curve, a's interval from the same bootstrap; the tokens for 25% "
             "and 50% of the drop from the fit, where it reaches them within the largest budget.", "",
             "| arm | k | task | drop | " + " | ".join(tags) + " | a (fit) | t | 25% at | 50% at |",
             "|" + "---|" * (8 + len(tags))]
    for c in curves:
        shares = [format_interval(s) if isinstance(s, dict) else str(s) for s in c["shares"].values()]
        fit = c.get("tokens_for", {})
        lines.append(f"| {c['arm'] or 'recovered'} | {c['k']} | {c['task']} | {format_interval(c['drop'])} | "
                     + " | ".join(shares) + f" | {_asymptote(c)} | "
                     + (f"{c['scale']:.3g}" if "scale" in c else "-") + " | "
                     + " | ".join(_tokens(fit.get(str(p))) for p in TARGETS) + " |")
    lines += ["", f"## Verdicts (on {LIMIT_TASK}; positive control: {control_arm or 'none declared'})", ""]
    lines += [f"- {label}: {text}" for label, text in verdicts.items()]
    for c in curves:
        if c["arm"] == control_arm and c["task"] == LIMIT_TASK:
            last = list(c["shares"].values())[-1]
            reached = isinstance(last, dict) and (last.get("value") or 0) >= 0.5
            share = format_interval(last) if isinstance(last, dict) else last
            lines.append(f"- positive control {control_arm} at k = {c['k']}: {share} of the {LIMIT_TASK} drop won "
                         f"back at {tags[-1]}" + ("" if reached else
                                                  ": under half, so the instrument cannot show a limit at this k"))
    return lines


def _asymptote(c: dict[str, Any]) -> str:
    """a with its interval, or 'undetermined' where the fit is still linear (t at the grid's end)."""
    if "scale" in c and c["scale"] >= SCALES[-1]:
        return "undetermined (still linear)"
    return format_interval(c.get("asymptote"))


def _tokens(value: float | None) -> str:
    return "not reached" if value is None else f"{value / 1000:.0f}k"
