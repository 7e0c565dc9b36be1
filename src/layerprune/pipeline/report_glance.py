"""The lead table of a run's report.md: per task what it measures, its items, the three models' scores and the share
of the drop that recovery won back with its paired interval; the full paired columns follow it in the report."""

from __future__ import annotations

from typing import Any

from layerprune.core.paired import format_interval
from layerprune.tasks.probes import family_label, probe_tasks

# lm-eval's generative tasks by what they measure; a probe is named by its family (tasks.probes.family_label)
TASK_KINDS = {"gsm8k": "math word problems", "humaneval": "code", "mbpp": "code"}
ROLE_TITLES = {"baseline": "original", "pruned": "pruned", "recovered": "recovered"}


def task_measure(task: str, kind: str) -> str:
    """What a task measures, in a reader's words: a probe by its family (copying is retrieval, not reasoning), an
    lm-eval generative task by its domain, any other by its kind."""
    if task in probe_tasks():
        return family_label(task)
    base = task.split(" (")[0].split("_")[0]
    return TASK_KINDS.get(base, kind)


def _score(row: dict[str, Any], role: str) -> str:
    value = row.get(role)
    if value is None:
        return "-"
    return f"{100 * value:.1f}" if 0.0 <= value <= 1.0 else f"{value:.3g}"


def _won_back(row: dict[str, Any]) -> str:
    if row.get("settings_differ"):
        return "n/a (settings differ)"
    if not row.get("clear_drop"):
        return "no clear drop"
    if row.get("recovered_share_note"):
        return "unbounded (drop near 0)"
    ci = (row.get("intervals") or {}).get("recovered_share")
    return format_interval(ci) if ci else format_interval({"value": row.get("recovered_share")})


def glance_table(rows: list[dict[str, Any]], averages: list[dict[str, Any]], roles: list[str]) -> str:
    """Markdown: task, what it measures, items, each role's score (percent for 0-1 metrics), and the share of the
    drop won back (recovered - pruned) / (original - pruned) with its 95% paired interval where the drop is clear
    ('unbounded' where the drop's interval comes within core.paired.SHARE_MARGIN of 0)."""
    shown = [r for r in roles if r in ROLE_TITLES] or roles
    won = "recovered" in shown and "pruned" in shown
    head = ["task", "measures", "n", *(ROLE_TITLES.get(r, r) for r in shown), *(["won back [95%]"] if won else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    measured = [(row, task_measure(row["task"], row["kind"])) for row in rows] + [(row, "mean") for row in averages]
    for row, measure in measured:
        counts = "/".join(str(c) for c in sorted(set(row["n"].values())))
        cells = [row["task"], measure, counts, *(_score(row, r) for r in shown), *([_won_back(row)] if won else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
