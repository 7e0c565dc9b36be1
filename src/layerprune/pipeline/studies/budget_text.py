"""budget.md's text and budget.png of a sweep with `budgets` (budget_report.py draws the figures, this writes them):
the cells not scored yet, the curve table with each fit, the positive control and the verdicts, the dedicated runs
against their checkpoints and the comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core.paired import format_interval
from layerprune.pipeline.studies.budget_fit import GATE, LIMIT_TASK, SCALES, TARGETS, undetermined
from layerprune.pipeline.studies.comparisons import format_families
from layerprune.pipeline.studies.figures import spent_text
from layerprune.pipeline.studies.sweep_curves import error_bars, save_chart


def plot_curves(curves: list[dict[str, Any]], path: Path) -> None:
    """One panel per task: each arm's share (per k) against the budget on a log axis, its interval as error bars
    (the budgets scored so far), and its saturating fit dashed where it has one."""
    stated = [c for c in curves if any(_stated(s) for s in c["shares"].values())]
    tasks = sorted({c["task"] for c in stated})

    def draw(axes: list[Any]) -> None:
        for ax, task in zip(axes, tasks or [""], strict=True):
            for c in (c for c in stated if c["task"] == task):
                points = [(int(b), s) for b, s in c["shares"].items() if _stated(s)]  # an arm's own budgets
                values, errors = error_bars([s for _, s in points])
                drawn = ax.errorbar([b for b, _ in points], values, yerr=errors, marker="o", capsize=3,
                                    label=f"{c['arm'] or 'recovered'} k={c['k']}")
                if (c.get("asymptote") or {}).get("value") is not None:  # its fit, dashed, over its budgets
                    x = np.geomspace(points[0][0], points[-1][0], 50)
                    ax.plot(x, c["asymptote"]["value"] * -np.expm1(-x / c["scale"]), ls="--", lw=1,
                            color=drawn.lines[0].get_color())
            ax.set_xscale("log")
            ax.axhline(GATE, color="grey", lw=0.8, ls="--")
            ax.set(title=task or "no share could be stated", xlabel="unpadded target tokens",
                   ylabel="share of the drop won back")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)

    save_chart(path, draw, (4.5 * max(1, len(tasks)), 3.6), max(1, len(tasks)))


def _stated(share: Any) -> bool:
    return isinstance(share, dict) and share.get("value") is not None


def format_budget(study: Any, record: dict[str, Any], root: Path) -> list[str]:
    """budget.md: what is not scored yet, the curve table (arm x k x task, a share column per budget), the fits, the
    positive control, the verdicts, the dedicated runs, the comparisons, and what each point spent (tokens, steps,
    learning rate) with the command that reproduces it."""
    from layerprune.pipeline.studies.sweep_grid import budget_tag

    tags = [budget_tag(b) for b in study.budgets]
    lines = [f"# Budget curves: {study.name}", "", *_format_missing(record["missing"]),
             "Share of the drop won back, (recovered - pruned) / (original - pruned), at each budget of unpadded "
             "target tokens, with its paired interval (items, and replicates where there are several); the fit "
             "share = a (1 - exp(-tokens / t)) per complete curve, a's interval from the same bootstrap; the tokens "
             "for 25% and 50% of the drop from the fit, where it reaches them within the largest budget, with their "
             f"interval over the same refits ('<= {tags[0]}': at or under the smallest budget, below any measured "
             "point). 'no run variance': the budgets where the run-to-run variance of the replicates is estimated "
             "at 0 (method of moments, floored), so that share's interval holds item variance alone there (with 3 "
             "replicates a frequent floor, not a finding that the runs agree). A "
             "fit needs 3 budgets, a verdict every replicate of the design; a is undetermined where the fit is "
             "still linear (t at the top of its grid) or a's interval is open or reaches past 100% of the drop. "
             "Arms and "
             "budgets are compared below only through their paired differences, never by setting two intervals side "
             "by side.", "",
             "| arm | k | task | drop | " + " | ".join(tags) + " | a (fit) | t | 25% at | 50% at | no run variance |",
             "|" + "---|" * (9 + len(tags))]
    for c in record["curves"]:
        shares = [format_interval(s) if isinstance(s, dict) else str(s)  # '-': not one of the arm's budgets
                  for s in (c["shares"].get(str(b), "-") for b in study.budgets)]
        fit = c.get("tokens_for", {})
        lines.append(f"| {c['arm'] or 'recovered'} | {c['k']} | {c['task']} | {format_interval(c.get('drop'))} | "
                     + " | ".join(shares) + f" | {_asymptote(c)} | "
                     + (f"{c['scale']:.3g}" if "scale" in c else "-") + " | "
                     + " | ".join(_tokens(fit.get(str(p)), study.budgets_of(c["arm"])[0]) if fit else "-"
                                  for p in TARGETS)
                     + f" | {', '.join(budget_tag(b) for b in c.get('no_run_variance', [])) or '-'} |")
    lines += [f"- {task}: left out, {why}" for task, why in record["unpaired"].items()]
    lines += ["", *_format_verdicts(record, tags[-1]), *_format_dedicated(record["dedicated"], study)]
    lines += _format_comparisons(record, study.replicates)
    return lines + _format_spent(study, tags, record.get("spent") or [], root)


def _format_spent(study: Any, tags: list[str], rows: list[dict[str, Any]], root: Path) -> list[str]:
    """What every point spent (its budget: unpadded target tokens, optimizer steps, learning rate, the spread over
    its replicates; a column per budget, `tags`), how each rate was chosen, and the command that reproduces it."""
    from layerprune.recover.lr_search import lr_lines

    head = ["arm", "k", *tags]
    lines = ["## What each point spent", "",
             "Unpadded target tokens / optimizer steps / learning rate of each point's recoveries (the spread over "
             "its replicates; a checkpoint's counts at its budget; a dedicated run trains to its budget alone, the "
             "k = 0 control to the largest only).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [f"| {row['arm'] or 'recovered'} | {row['k']} | "
              + " | ".join(spent_text(runs) for runs in row["points"]) + " |" for row in rows]
    rates = lr_lines(root, list(study.lr_grid), f"each candidate trained to the smallest budget, {tags[0]}; every "
                     "k, replicate and control of the arm trained at the rate chosen (its own runs never scored)")
    return [*lines, "", *rates, *([""] if rates else []),
            f"Rerun: `layerprune study {study.name} --output {root}` (complete stages are skipped)."]


def _format_missing(missing: dict[str, dict[str, Any]]) -> list[str]:
    if not missing:
        return ["Every cell of the design is scored.", ""]
    cells = [label + ("" if len(m["replicates"]) == m["of"] else f" (replicate{'s' * (len(m['replicates']) > 1)} "
                                                                 f"{', '.join(map(str, m['replicates']))})")
             for label, m in missing.items()]
    return [f"Not scored yet ({len(cells)} cells; every figure below is drawn from the cells that are): "
            + ", ".join(cells) + ".", ""]


def _format_verdicts(record: dict[str, Any], largest: str) -> list[str]:
    control = record["control_arm"]
    lines = [f"## Verdicts (on {LIMIT_TASK}; positive control: {control or 'none declared'})", ""]
    for gate in record["gates"]:
        share = format_interval(gate["share"]) if gate["share"] else "-"
        from layerprune.pipeline.studies.sweep_grid import budget_tag

        own = budget_tag(gate["budget"]) if gate.get("budget") else largest
        said = (f"{share} of the {LIMIT_TASK} drop won back at {own}" if gate["share"] else gate["why"])
        lines.append(f"- positive control {control or '-'} at k = {gate['k']}: {said}" + (
            "" if gate["reached"] else (": not judged yet" if gate.get("pending") else
                                        ": the instrument cannot show a limit at this k")
            + (f" ({gate['why']})" if gate["share"] else "")))
    lines += [f"- {label}: {text} ({record['verdict_reasons'][label]})" for label, text in record["verdicts"].items()]
    return lines + [""]


def _format_dedicated(rows: list[dict[str, Any]], study: Any) -> list[str]:
    if study.dedicated_at is None:
        return []
    lines = [f"## Dedicated runs against their checkpoints ({study.dedicated_at} tokens, k = {study.lr_k})", "",
             "Score of the run trained to this budget alone minus that of the checkpoint of the longer run, paired by "
             "item and seed (the replicates both have), 95% interval and, after it, the Holm interval over the tasks "
             "(one check of the checkpoint, not one per task); 'agrees' where the Holm interval holds 0.", ""]
    for row in rows:
        head = f"- {row['dedicated']} - {row['checkpoint']}"
        if "tasks" not in row:
            lines.append(f"{head}: {row['why']}")
            continue
        reps = f"replicates {', '.join(map(str, row['replicates']))}"
        lines.append(f"{head} ({reps}): " + "; ".join(
            f"{task} {format_interval(t['difference'])} (Holm {format_interval(t['holm'])}) {t['verdict']}"
            for task, t in row["tasks"].items()) + ("; the same weights in every pair (the model hashes of their "
                                                    "evaluations are equal: a difference of 0 by construction)"
                                                    if row.get("identical") else ""))
    return lines + [""]


def _format_comparisons(record: dict[str, Any], replicates: int) -> list[str]:
    default, declared = record["default_families"], record["families"]
    if not (default or declared):
        return []
    lines = ["## Comparisons", "", "A contrast that names no budget is at the largest budget (an arm with budgets "
             "of its own, arm_budgets: at its largest; its k = 0 control ends there too).", ""]
    if default:
        lines += ["The recipe declares no confirmatory budget comparison (contrasts naming a task or a budget), so "
                  "each task's default family is drawn: each arm's share at the largest budget minus at the smallest "
                  "(its rise), every pair of arms at the largest budget, and each arm's share net of its k = 0 "
                  "control against 0 (arms with one), at every k; Holm over each task's family.", "",
                  *format_families(default, replicates, declared=False)]
    return lines + format_families(declared, replicates)


def _asymptote(c: dict[str, Any]) -> str:
    """a with its interval, or 'undetermined' where the fit is still linear (t at the grid's end)."""
    if "scale" not in c:
        return c.get("fit", "-")
    if c["scale"] >= SCALES[-1]:
        return "undetermined (still linear)"
    lost = (c.get("asymptote") or {}).get("undefined") or 0  # refits on resamples whose share is undefined
    return format_interval(c.get("asymptote")) + (" (undetermined)" if undetermined(c) else "") + (
        f" ({100 * lost:.1f}% of refits undefined, left out)" if lost else "")


def _tokens(at: dict[str, Any] | None, smallest: int) -> str:
    """The tokens for a share with its interval ('not reached': not within the largest budget; at or under the
    smallest budget: read off the fit below any measured point, so only a bound)."""
    def said(value: float | None) -> str:
        return "not reached" if value is None else f"<= {smallest / 1000:.0f}k" if value <= smallest else \
            f"{value / 1000:.0f}k"

    if not at or (at.get("value") is None and at.get("low") is None):
        return "not reached"
    return f"{said(at.get('value'))} [{said(at.get('low'))}, {said(at.get('high'))}]"
