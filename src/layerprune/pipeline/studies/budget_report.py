"""budget.md of a sweep with `budgets` (issue 58): the share of the drop won back against the training budget, per
arm, k and task, a saturating fit per curve, the comparisons of the curves (paired and family-wise), the dedicated
runs against their checkpoints, and the verdicts on the limit.

Every budget point of an arm (ARM-kK@<budget>, the largest ARM-kK itself; replicates one logical label) is scored on
the same items as the original and the pruned model, so the sweep's one paired bootstrap (items within each task,
two-level over replicates) gives every share its interval, and the fit share = a (1 - exp(-tokens / t)) is made on
the data and on every resample alike: a's interval is the percentile interval of its refits. The tokens a curve needs
for 25% and 50% of the drop are read off the fit where the fit reaches them within the largest budget.

The comparisons are the recipe's budget families (`comparisons`, contrasts naming a task or a budget:
pipeline/studies/comparisons.py), or, where it declares no confirmatory one, the default family of each task
(`default_families`): each arm's share at the largest budget against the smallest, every pair of arms at the largest
budget, each arm's share net of its k = 0 control against 0; each contrast with its paired interval and its Holm
interval over its family. A study runs in parts: what is not scored yet is listed, and every figure is drawn from the
cells that are there (a fit from a complete curve only); models scored on different items are refused in one line
before anything is written (figures.study_figures). The fit: budget_fit.py; the text and the chart: budget_text.py.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core import paired
from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.pipeline.paired_table import Figures
from layerprune.pipeline.studies.budget_fit import (
    GATE,
    LIMIT_TASK,
    TARGETS,
    saturating_fit,
    tokens_interval,
    undetermined,
)
from layerprune.pipeline.studies.budget_text import format_budget, plot_curves
from layerprune.pipeline.studies.comparisons import (
    NO_ARMS,
    ComparisonFamily,
    Contrast,
    check_budget_contrasts,
    draw_families,
    uses_default_family,
)
from layerprune.pipeline.studies.figures import evaluated, study_figures, unpaired

STRUCTURAL, BOUND, NOT_SHOWN = "limit structural at this scale", "budget-bound", "not shown"
NOT_SCORED = "not scored"


def budget_labels(study: Any, arm: str | None, k: int) -> list[tuple[int, str]]:
    """(budget, logical label) of an arm's points at k, budget by budget (the largest: the recovered label itself)."""
    from layerprune.pipeline.studies.sweep_grid import budget_tag, recovered_label

    label, own = recovered_label(arm, k), study.budgets_of(arm)
    return [(b, f"{label}@{budget_tag(b)}") for b in own[:-1]] + [(own[-1], label)]


def at_budget(study: Any, arm: str | None, k: int, budget: int) -> str:
    """The logical label of an arm's point at k and a budget (one of budgets; else an error naming them)."""
    labels = dict(budget_labels(study, arm, k))
    if budget not in labels:
        raise LayerpruneError(f"budget {budget} is not one of {arm or 'the recovery'}'s budgets "
                              f"({', '.join(map(str, labels))})")
    return labels[budget]


def curve(figures: Figures, study: Any, arm: str | None, k: int, task: str) -> dict[str, Any] | None:
    """One arm's curve at k on one task (None: no point of it scored): the drop, the share at each budget (or why none
    can be stated), and, on a complete curve (every budget scored on the same replicates: its points are one run's
    checkpoints, paired seed by seed), the fit's a (with its interval) and t, the tokens for TARGETS; with the two
    largest budgets scored on the same replicates, whether the share still rises at the largest."""
    points = budget_labels(study, arm, k)
    present = [(b, label) for b, label in points if label in figures.labels]
    if not present or not figures.has(task):
        return None
    base, pruned = "baseline", f"pruned-k{k}"
    out: dict[str, Any] = {"arm": arm, "k": k, "task": task}
    absent = [m for m in (base, pruned) if m not in figures.labels]
    state = f"n/a ({', '.join(absent)} {NOT_SCORED})" if absent else None
    if state is None:
        out["drop"] = figures.difference(base, pruned, task)
        state = paired.share_state(out["drop"])
    if state is not None:
        return {**out, "shares": {str(b): state for b, _ in points}, "state": state}

    def share(label: str) -> Any:
        return lambda m: figures.share_of(label, pruned, task, m, base)

    out["shares"] = {str(b): figures.interval(share(label)) if (b, label) in present else NOT_SCORED
                     for b, label in points}
    out["no_run_variance"] = [b for b, label in present if len(figures.rows[label]) > 1
                              and figures.spread(label, task)["run_variance"]["zero"]]  # its interval holds none
    if len(points) < 3:  # two points: a and t pass through them, nothing tests the curve's form
        out["fit"] = f"none: {len(points)} budget{'s' * (len(points) > 1)} for the fit's 2 parameters"
    elif len(present) < len(points):
        out["fit"] = f"waits for {', '.join(str(b) for b, label in points if (b, label) not in present)}"
    elif len({figures.seeds(label) for _, label in points}) > 1:  # one run's checkpoints pair replicate by replicate
        out["fit"] = f"waits for the same replicates at every budget ({_replicates(figures, points)})"
    else:
        out.update(_fit(figures, [share(label) for _, label in points], [b for b, _ in points]))
        out["replicates"] = len(figures.seeds(points[-1][1]))
    if len(points) > 1 and all(p in present for p in points[-2:]) \
            and figures.seeds(points[-2][1]) == figures.seeds(points[-1][1]):
        before, last = (share(label) for _, label in points[-2:])
        out["rising"] = figures.interval(lambda m: last(m) - before(m))
    return out


def _replicates(figures: Figures, points: list[tuple[int, str]]) -> str:
    """'8000: r0, r1; 32000: r0, r1, r2; ...': the replicates scored at each budget of a curve."""
    def named(label: str) -> str:
        return ", ".join(f"r{seed.removeprefix('@r') or 0}" for seed in figures.seeds(label))

    return "; ".join(f"{b}: {named(label)}" for b, label in points)


def _fit(figures: Figures, shares: list[Any], budgets: list[int]) -> dict[str, Any]:
    """The saturating fit of a complete curve: a's interval from the refits on every resample, t, the tokens for
    TARGETS."""
    tokens = np.array(budgets, dtype=np.float64)

    def stacked(m: np.ndarray) -> np.ndarray:
        return np.stack([s(m) for s in shares], axis=-1)

    a, t = (float(v) for v in saturating_fit(tokens, stacked(figures.boot.point)))
    draws = saturating_fit(tokens, stacked(figures.boot.resampled))  # the same refits give a's interval and the tokens'
    alpha = figures.boot.alpha
    return {"asymptote": paired.percentile_interval(a, draws[0], alpha), "scale": t,
            "tokens_for": {str(p): tokens_interval(a, t, draws, p, int(tokens[-1]), alpha) for p in TARGETS}}



def control_gate(figures: Figures, study: Any, control_arm: str | None, k: int) -> dict[str, Any]:
    """The positive control's share of LIMIT_TASK's drop at the largest budget at k, and whether it reached GATE
    (its point estimate, on every replicate of the design): without it at GATE the instrument cannot show a limit.
    `pending`: not judged yet (a model or a replicate not scored), which is not a failure."""
    from layerprune.pipeline.studies.sweep_grid import recovered_label

    out: dict[str, Any] = {"arm": control_arm, "k": k, "share": None, "reached": False, "pending": False,
                           "budget": study.budgets_of(control_arm)[-1] if control_arm else None}
    if control_arm is None:
        return {**out, "why": "no positive control declared (an arm with arm_prompts)"}
    label, pruned = recovered_label(control_arm, k), f"pruned-k{k}"
    absent = [m for m in ("baseline", pruned, label) if m not in figures.labels]
    if absent or not figures.has(LIMIT_TASK):
        return {**out, "pending": True, "why": f"{', '.join(absent) or LIMIT_TASK} {NOT_SCORED} yet"}
    state = paired.share_state(figures.difference("baseline", pruned, LIMIT_TASK))
    if state is not None:
        return {**out, "why": f"the {LIMIT_TASK} drop: {state}"}
    out["share"] = figures.interval(lambda m: figures.share_of(label, pruned, LIMIT_TASK, m))
    held = len(figures.seeds(label))
    if held < study.replicates:
        return {**out, "pending": True, "why": f"{label} holds {held} of its {study.replicates} replicates yet"}
    out["reached"] = (out["share"]["value"] or 0) >= GATE
    return {**out, "why": "" if out["reached"] else f"won back under {GATE:.0%} of the drop"}


def verdict(arm_curve: dict[str, Any] | None, gate: dict[str, Any], replicates: int) -> tuple[str, str]:
    """The protocol's verdict on an arm's curve of LIMIT_TASK and why, given only on a fit over all `replicates` of
    the design (fewer: the run-to-run variance in a's interval is not yet measured): 'limit structural at this scale'
    (a's upper end below 50%, a determined: a fit still linear at the largest budget extrapolates a, it does not
    measure it, the share not shown to rise at the largest budget: a curve still climbing there, by a step a
    doubling say, fits the form with a just above its last point, and the positive control at 50% or more of the
    drop at the largest budget, `control_gate`),
    'budget-bound' (the share still rises at the largest budget, its paired step from the budget before above 0, and
    a undetermined), else 'not shown'."""
    if not arm_curve:
        return NOT_SHOWN, f"its {LIMIT_TASK} curve is {NOT_SCORED} yet"
    if "asymptote" not in arm_curve:
        fit = arm_curve.get("fit", "waits")
        return NOT_SHOWN, arm_curve.get("state") or (f"no fit: {fit.removeprefix('none: ')}" if fit.startswith(
            "none: ") else f"no fit yet: it {fit}")
    if arm_curve.get("replicates", 0) < replicates:
        return NOT_SHOWN, (f"the fit holds {arm_curve.get('replicates', 0)} of the {replicates} replicates: no verdict "
                           "before every run is in its interval")
    upper = arm_curve["asymptote"].get("high")
    rising = "rising" in arm_curve and (arm_curve["rising"].get("low") or 0) > 0
    if upper is not None and upper < GATE and not undetermined(arm_curve):  # a still linear fit: a extrapolated
        if rising:  # a curve still climbing at the largest budget fits the form with a just above its last point
            return NOT_SHOWN, (f"a's upper end {100 * upper:.1f}% < 50%, but the share still rises at the largest "
                               "budget (its paired step from the budget before above 0): the plateau is the fit's "
                               "form, not measured")
        if gate["reached"]:
            return STRUCTURAL, f"a's upper end {100 * upper:.1f}% < 50%, the positive control reached 50%"
        if gate.get("pending"):
            return NOT_SHOWN, (f"a's upper end {100 * upper:.1f}% < 50%, but the positive control is not judged yet "
                               f"({gate['why']})")
        return NOT_SHOWN, (f"a's upper end {100 * upper:.1f}% < 50%, but the positive control: {gate['why']}, so the "
                           "instrument cannot show a limit")
    if rising and undetermined(arm_curve):
        return BOUND, "the share still rises at the largest budget and a is undetermined"
    return NOT_SHOWN, ("a is undetermined but the share is not shown to rise at the largest budget" if
                       undetermined(arm_curve) else "a's upper end reaches 50% and a is determined")


def missing_cells(study: Any, folders: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """The design's models not scored yet: logical label -> {replicates: those missing, of: how many it has}."""
    from layerprune.pipeline.studies.cells import split_label
    from layerprune.pipeline.studies.sweep_grid import models

    design: dict[str, list[tuple[int, bool]]] = {}
    for model in models(study):
        logical, replicate = split_label(model)
        design.setdefault(logical, []).append((replicate, model in folders))
    return {label: {"replicates": [r for r, scored in runs if not scored], "of": len(runs)}
            for label, runs in design.items() if not all(scored for _, scored in runs)}


def spent(study: Any, root: Path) -> list[dict[str, Any]]:
    """What each point's recoveries spent, replicate by replicate (lr_search.budget_spent: unpadded target tokens,
    sequences, optimizer steps, learning rate): a row per arm and k, then the dedicated runs (at dedicated_at only)
    and the k = 0 controls (at the largest budget only), a list of runs per budget; a checkpoint's counts are those
    at its budget."""
    from layerprune.pipeline.studies.cells import split_label
    from layerprune.pipeline.studies.sweep_cells import model_dir
    from layerprune.pipeline.studies.sweep_grid import arm_names, dedicated_points, has_control, models, recovered_label
    from layerprune.recover.lr_search import budget_spent

    runs: dict[str, list[dict[str, Any]]] = {}
    for model in models(study):
        report = model_dir(root, model) / "recover_report.json"
        if report.is_file():
            runs.setdefault(split_label(model)[0], []).append(budget_spent(report))

    def only(budget: int, label: str) -> list[list[dict[str, Any]]]:  # a row with one budget's column filled
        return [runs.get(label, []) if b == budget else [] for b in study.budgets]

    def columns(arm: str | None, k: int) -> list[list[dict[str, Any]]]:  # a column per budget; empty: not its own
        own = dict(budget_labels(study, arm, k))
        return [runs.get(own[b], []) if b in own else [] for b in study.budgets]

    rows = [{"arm": arm, "k": k, "points": columns(arm, k)} for arm in arm_names(study) for k in study.ratios]
    rows += [{"arm": arm, "k": f"{study.lr_k} (dedicated)", "points": only(study.dedicated_at, split_label(own[0])[0])}
             for arm in arm_names(study) if (own := dedicated_points(study, study.lr_k, arm))]
    return rows + [{"arm": arm, "k": "0 (control)", "points": only(study.budgets_of(arm)[-1], recovered_label(arm, 0))}
                   for arm in arm_names(study) if has_control(study, arm)]


def default_families(study: Any, tasks: list[str]) -> dict[str, ComparisonFamily]:
    """One family per task where the recipe declares no budget family: each arm's share at its largest budget
    against its smallest (does it rise?), every pair of arms at the largest budget both have (none where they share
    none), each arm's share net of its k = 0 control (where it has one) against 0; at every k."""
    from layerprune.pipeline.studies.sweep_grid import arm_names, has_control

    arms = [(arm or NO_ARMS, has_control(study, arm)) for arm in arm_names(study)]
    own = {a: study.budgets_of(None if a == NO_ARMS else a) for a, _ in arms}

    def at(a: str, b: str) -> int | None:  # the largest budget both arms have (None: the study's largest)
        common = max(set(own[a]) & set(own[b]))
        return None if common == study.budgets[-1] else common

    def end(a: str) -> int | None:  # an arm's largest budget where it is not the study's (None: the study's)
        return None if own[a][-1] == study.budgets[-1] else own[a][-1]

    out = {}
    for task in tasks:
        rise = [Contrast(name=f"{a}-k{k}-rise-{task}", a=a, at=k, budget=end(a), b_budget=own[a][0], task=task)
                for k in study.ratios for a, _ in arms if len(own[a]) > 1]
        pairs = [Contrast(name=f"{a}-vs-{b}-k{k}-{task}", a=a, b=b, at=k, task=task, budget=at(a, b))
                 for k in study.ratios for (a, _), (b, _) in combinations(arms, 2) if set(own[a]) & set(own[b])]
        net = [Contrast(name=f"{a}-k{k}-net-{task}", a=a, at=k, net_of_control=True, task=task)
               for k in study.ratios for a, controlled in arms if controlled]
        out[task] = ComparisonFamily(contrasts=[*rise, *pairs, *net])
    return out


def draw_budget_families(study: Any, figures: Figures,
                         tasks: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The default families drawn where the recipe declares no confirmatory budget family (else none), and the
    recipe's budget families drawn."""
    from layerprune.pipeline.studies.sweep_grid import recovered_label

    def label(arm: str | None, k: int, budget: int) -> str:
        return at_budget(study, arm, k, budget)

    default = default_families(study, tasks) if uses_default_family(study.comparisons, budget=True) else {}
    return (draw_families(default, figures, recovered_label, label),
            draw_families(study.comparisons, figures, recovered_label, label))


def agreement(figures: Figures, study: Any, arm: str | None, tasks: list[str],
              folders: dict[str, Path]) -> dict[str, Any] | None:
    """A trainer arm's dedicated run at dedicated_at (k = lr_k) against the checkpoint of that budget: per task the
    paired difference of their scores, dedicated - checkpoint, on the replicates both have (paired by seed), with its
    interval and its Holm interval over the tasks, and 'agrees' (the Holm interval holds 0) or 'differs'. None: the
    arm has no dedicated run. `identical`: every pair is the same weights (the model hashes their evaluations in
    `folders` recorded): with a constant rate after warmup and a deterministic run, the run to a budget and the
    longer run's checkpoint there are one model, and the difference is 0 by construction, not by chance."""
    from layerprune.evaluate.summary import SUMMARY_FILE, read_summary
    from layerprune.pipeline.studies.cells import replicate_label, split_label
    from layerprune.pipeline.studies.sweep_grid import dedicated_points

    runs = dedicated_points(study, study.lr_k, arm)
    if not runs:
        return None
    own = split_label(runs[0])[0]
    checkpoint = at_budget(study, arm, study.lr_k, study.dedicated_at)
    pairs = [(replicate_label(checkpoint, r), run) for run in runs for r in [split_label(run)[1]]
             if run in figures.physical and replicate_label(checkpoint, r) in figures.physical]
    out: dict[str, Any] = {"arm": arm, "k": study.lr_k, "budget": study.dedicated_at, "dedicated": own,
                           "checkpoint": checkpoint, "replicates": [split_label(run)[1] for _, run in pairs]}
    if not pairs:
        return {**out, "why": f"no replicate of {own} with its checkpoint scored yet"}
    pair = _pair_figures(figures, {checkpoint: [c for c, _ in pairs], own: [d for _, d in pairs]})

    def gap(task: str) -> Any:
        return lambda m: pair.mean(m, own, task) - pair.mean(m, checkpoint, task)

    holm = pair.family({task: gap(task) for task in tasks})  # over the tasks: one check of the checkpoint, not one each
    rows = {}
    for task in tasks:
        holds = paired.holds_zero(holm[task])
        rows[task] = {"difference": pair.interval(gap(task)), "holm": holm[task],
                      "verdict": NOT_SHOWN if holds is None else "agrees" if holds else "differs"}
    weights = {m: read_summary(folders[m] / SUMMARY_FILE).model_hash for pair in pairs for m in pair}  # scored ones
    return {**out, "tasks": rows, "identical": all(weights[c] == weights[d] for c, d in pairs)}


def _pair_figures(figures: Figures, groups: dict[str, list[str]]) -> Figures:
    """Figures of a few physical models of `figures` only, grouped into logical ones (replicates in seed order)."""
    physical = [m for members in groups.values() for m in members]
    index = [figures.physical.index(m) for m in physical]
    matrices = {t: np.asarray(m)[index] for t, m in zip(figures.tasks, figures.matrices, strict=True)}
    return Figures(physical, matrices, {t: figures.chance[t] for t in figures.tasks}, {t: [t] for t in figures.tasks},
                   replicates=groups)


def write_budget_report(study: Any, root: Path, control_arm: str | None = None) -> Path:
    """budget.md and budget.json: every arm's curve per k and task, the fits, the comparisons, the dedicated runs
    against their checkpoints, the verdicts, and the cells not scored yet; `control_arm`: the positive control
    (default: the arm with its own prompts, study.arm_prompts, if there is one)."""
    try:
        check_budget_contrasts(study.comparisons, study.budgets, study.budgets_of)
    except ValueError as exc:
        raise LayerpruneError(str(exc)) from None
    folders = evaluated(study, root)
    control_arm = control_arm or next(iter(getattr(study, "arm_prompts", {}) or {}), None)
    record: dict[str, Any] = {"budgets": study.budgets, "control_arm": control_arm,
                              "missing": missing_cells(study, folders), "spent": spent(study, root),
                              **_drawn(study, folders, control_arm)}
    write_atomic(root / "budget.json", json.dumps(record, indent=1, default=str))
    plot_curves(record["curves"], root / "budget.png")
    text = format_budget(study, record, root) + ["", "![budget curves](budget.png)"]
    write_atomic(root / "budget.md", "\n".join(text) + "\n")
    return root / "budget.md"


def _drawn(study: Any, folders: dict[str, Path], control_arm: str | None) -> dict[str, Any]:
    """Every figure the scored cells support (all empty where nothing is scored yet)."""
    from layerprune.pipeline.studies.sweep_grid import arm_names

    if not folders:
        return {"curves": [], "verdicts": {}, "verdict_reasons": {}, "gates": [], "default_families": {},
                "families": {}, "dedicated": [], "unpaired": {}}
    figures, kinds = study_figures(folders)
    tasks = figures.tasks
    curves = [c for k in study.ratios for arm in arm_names(study) for task in tasks
              if (c := curve(figures, study, arm, k, task)) is not None]
    by = {(c["arm"], c["k"], c["task"]): c for c in curves}
    gates = {k: control_gate(figures, study, control_arm, k) for k in study.ratios}
    judged = {f"{arm or NO_ARMS}-k{k}": verdict(by.get((arm, k, LIMIT_TASK)), gates[k], study.replicates)
              for k in study.ratios for arm in arm_names(study)
              if arm != control_arm and any(key[:2] == (arm, k) for key in by)}  # the rest: not scored yet
    default, declared = draw_budget_families(study, figures, tasks)
    dedicated = [a for arm in arm_names(study) if (a := agreement(figures, study, arm, tasks, folders)) is not None]
    return {"curves": curves, "verdicts": {label: v for label, (v, _) in judged.items()},
            "verdict_reasons": {label: why for label, (_, why) in judged.items()}, "gates": list(gates.values()),
            "default_families": default, "families": declared, "dedicated": dedicated, "unpaired": unpaired(kinds)}
