"""Tables and charts: one model's results, and the baseline / pruned / recovered comparison."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerprune.evaluate.schema import Summary

ROLES = ("baseline", "pruned", "recovered")


def format_table(summary: Summary) -> str:
    """Markdown table of every metric of one model."""
    lines = ["| task | metric | value | stderr | n | chat | cached |", "|---|---|---|---|---|---|---|"]
    for r in summary.results:
        stderr = f"{r.stderr:.4f}" if r.stderr is not None else "-"
        lines.append(f"| {r.task} | {r.metric} | {r.value:.4f} | {stderr} | {r.n} | "
                     f"{'on' if r.settings.get('chat_template') else 'off'} | {'yes' if r.cached else 'no'} |")
    for task, why in summary.skipped.items():
        lines.append(f"| {task} | skipped | {why} | | | | |")
    outcomes = [f"{r.task} ({r.metric}): " + ", ".join(f"{k} {v}" for k, v in r.statuses.items())
                for r in summary.results if r.statuses]
    if outcomes:
        lines += ["", "Sandbox outcomes (a timeout is not a wrong answer):", *(f"- {o}" for o in outcomes)]
    return "\n".join(lines)


def write_model_results(folder: Path, summary: Summary, entries: dict[str, dict[str, Any]]) -> None:
    """summary.json, table.md, lm-eval's raw results and samples per task."""
    (folder / "results").mkdir(parents=True, exist_ok=True)
    (folder / "samples").mkdir(exist_ok=True)
    for task, entry in entries.items():
        (folder / "results" / f"{task}.json").write_text(json.dumps(entry["raw"], indent=1, default=str))
        with (folder / "samples" / f"{task}.jsonl").open("w") as handle:
            for sample in entry.get("samples", []):
                handle.write(json.dumps(sample, default=str) + "\n")
    (folder / "summary.json").write_text(summary.model_dump_json(indent=1))
    (folder / "table.md").write_text(format_table(summary) + "\n")


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or abs(den) < 1e-12:
        return None
    return num / den


def comparison_rows(summaries: dict[str, Summary]) -> list[dict[str, Any]]:
    """Per task: each role's headline value, retention (model / baseline) and the recovered share of the drop."""
    heads = {role: s.headlines() for role, s in summaries.items()}
    tasks = [t for t in next(iter(heads.values())) if all(t in h for h in heads.values())]
    rows = []
    for task in tasks:
        first = next(iter(heads.values()))[task]
        row: dict[str, Any] = {"task": task, "kind": first.kind, "metric": first.metric}
        row.update({role: heads[role][task].value for role in heads})
        row.update(_derived(row))
        rows.append(row)
    return rows


def sampled_rows(summaries: dict[str, Summary]) -> list[dict[str, Any]]:
    """Per task: each role's pass@k / maj@N from --samples-per-task, where every role has that metric."""
    values = [{(r.task, r.metric): r for r in s.results if r.metric.endswith(" sampled")} for s in summaries.values()]
    keys = [k for k in values[0] if all(k in v for v in values)] if values else []
    rows = []
    for task, metric in keys:
        kind = values[0][(task, metric)].kind
        row: dict[str, Any] = {"task": f"{task} ({metric})", "kind": kind, "metric": metric}
        row.update({role: v[(task, metric)].value for role, v in zip(summaries, values)})
        row.update(_derived(row))
        rows.append(row)
    return rows


def _derived(row: dict[str, Any]) -> dict[str, Any]:
    base, pruned, rec = row.get("baseline"), row.get("pruned"), row.get("recovered")
    out = {"retention_pruned": _ratio(pruned, base), "retention_recovered": _ratio(rec, base)}
    if base is not None and pruned is not None and rec is not None:
        out["recovered_share"] = _ratio(rec - pruned, base - pruned)
    return out


def average_rows(rows: list[dict[str, Any]], roles: list[str]) -> list[dict[str, Any]]:
    """Means over classification tasks and over generative tasks, each kind on its own."""
    out = []
    for kind in ("classification", "generative"):
        group = [r for r in rows if r["kind"] == kind]
        if not group:
            continue
        avg: dict[str, Any] = {"task": f"average ({kind}, {len(group)} tasks)", "kind": kind, "metric": "mean"}
        avg.update({role: sum(r[role] for r in group) / len(group) for role in roles})
        avg.update(_derived(avg))
        out.append(avg)
    return out


def _cell(value: Any, percent: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if percent else f"{value:.4f}"


def format_comparison(rows: list[dict[str, Any]], roles: list[str]) -> str:
    extra = [c for c in ("retention_pruned", "retention_recovered", "recovered_share")
             if any(r.get(c) is not None for r in rows)]
    head = ["task", "metric", *roles, *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["task"], row["metric"], *(_cell(row.get(r)) for r in roles),
                 *(_cell(row.get(c), percent=True) for c in extra)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_comparison(rows: list[dict[str, Any]], averages: list[dict[str, Any]], roles: list[str],
                    folder: Path) -> list[Path]:
    """Grouped bars per task (one chart per kind) and a chart of the two averages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups = [(f"tasks_{k}", [r for r in rows if r["kind"] == k]) for k in ("classification", "generative")]
    for name, group in [*groups, ("averages", averages)]:
        if not group:
            continue
        fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(group) * len(roles)), 4))
        width = 0.8 / len(roles)
        for i, role in enumerate(roles):
            ax.bar([x + i * width for x in range(len(group))], [r[role] for r in group], width, label=role)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(group))], [r["task"] for r in group],
                      rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("score")
        ax.legend()
        fig.tight_layout()
        path = folder / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def compare(summaries: dict[str, Summary], output_dir: Path | None = None) -> dict[str, Any]:
    """Compare models by role (baseline, pruned, recovered, or any labels); returns the table and file paths.

    With `output_dir`, writes comparison.md, comparison.json and PNG charts into it (created if needed).
    """
    roles = [r for r in ROLES if r in summaries] + [r for r in summaries if r not in ROLES]
    ordered = {role: summaries[role] for role in roles}
    rows = comparison_rows(ordered)
    averages = average_rows(rows, roles)
    rows += sampled_rows(ordered)  # pass@k / maj@N next to the greedy headline, outside the averages
    table = format_comparison(rows + averages, roles)
    result: dict[str, Any] = {"table": table, "rows": rows, "averages": averages, "paths": {}}
    if output_dir is None:
        return result
    output_dir.mkdir(parents=True, exist_ok=True)
    _write_text(output_dir / "comparison.md", "# Comparison\n\n" + table + "\n")
    _write_text(output_dir / "comparison.json", json.dumps(
        {"rows": rows, "averages": averages, "models": {r: s.model for r, s in ordered.items()}}, indent=1, default=str))
    charts = [p.name for p in plot_comparison(rows, averages, roles, output_dir)]
    names = ["comparison.md", "comparison.json", *charts]
    result["paths"] = {name: output_dir / name for name in names}
    return result
