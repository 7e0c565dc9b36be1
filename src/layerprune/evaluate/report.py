"""Tables and charts: one model's results, and the baseline / pruned / recovered comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from layerprune.core.outputs import write_atomic
from layerprune.evaluate.summary import Summary, TaskResult, write_summary

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
    write_summary(folder, summary)
    (folder / "table.md").write_text(format_table(summary) + "\n")


NOISE_SE = 2.0  # a difference below this many combined standard errors is "within noise"
# settings whose difference between roles makes their scores incomparable
COMPARED_SETTINGS = ("limit", "num_fewshot", "chat_template", "max_gen_toks", "data", "probe_seed", "sandbox",
                     "sampling", "layerprune", "probe_version", "dtype", "backend", "device")
NO_CLEAR_DROP = "n/a (no clear drop)"


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or abs(den) < 1e-12:
        return None
    return num / den


def combined_se(*errors: float | None) -> float | None:
    """sqrt of the sum of squares (independent estimates); None when any is unknown."""
    if any(e is None for e in errors):
        return None
    return math.sqrt(sum(float(e) ** 2 for e in errors))  # type: ignore[arg-type]


def difference(row: dict[str, Any], high: str, low: str) -> dict[str, Any] | None:
    """row[high] - row[low] with its combined (unpaired) standard error and whether it is within noise (< 2 SE)."""
    if row.get(high) is None or row.get(low) is None:
        return None
    diff = row[high] - row[low]
    se = combined_se(row.get(f"{high}_stderr"), row.get(f"{low}_stderr"))
    return {"diff": diff, "se": se, "within_noise": None if se is None else abs(diff) < NOISE_SE * se,
            "paired": False}


def settings_differ(results: dict[str, TaskResult]) -> dict[str, dict[str, Any]]:
    """setting -> {role: value} for each compared setting whose value is not the same for every role."""
    out = {}
    for key in COMPARED_SETTINGS:
        values = {role: r.settings.get(key) for role, r in results.items()}
        if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) > 1:
            out[key] = values
    return out


Aligned = tuple[Any, Any]  # ([roles, items] scores, per-item chance) of one task


def comparison_rows(summaries: dict[str, Summary], folders: dict[str, Path] | None = None
                    ) -> tuple[list[dict[str, Any]], dict[str, Aligned]]:
    """Per task: each role's headline value and standard error, the differences between roles with their noise,
    retention and the recovered share of the drop where the drop is clear; paired item by item where every role's
    folder holds the same items (`folders`), else unpaired with the reason. Also returns the paired matrices."""
    heads = [s.headlines() for s in summaries.values()]
    tasks = [t for t in heads[0] if all(t in h for h in heads)] if heads else []
    rows, matrices = [], {}
    for task in tasks:
        results = dict(zip(summaries, (h[task] for h in heads), strict=False))
        aligned = paired_items(results, folders)
        rows.append(role_row(task, results, aligned))
        if not isinstance(aligned, str) and not rows[-1]["settings_differ"]:
            matrices[task] = aligned
    return rows, matrices


def paired_items(results: dict[str, TaskResult], folders: dict[str, Path] | None) -> Aligned | str:
    """The roles' per-item scores of one task on the same items, or why they cannot be paired (no per-item samples,
    or settings that differ: that row is flagged as not comparable). Roles run with the same settings but scored on
    different items are refused (LayerpruneError, one line: `items.check_same_records`), not paired on a subset nor
    quietly unpaired."""
    from layerprune.evaluate.items import align, check_same_records, read_items

    if folders is None or set(folders) < set(results):
        return "no per-item samples were given"
    scored = {role: read_items(folders[role], r.task, r.metric, r.kind) for role, r in results.items()}
    if not settings_differ(results):
        check_same_records(next(iter(results.values())).task, scored)
    return align(scored)


def sampled_rows(summaries: dict[str, Summary]) -> list[dict[str, Any]]:
    """Per task: each role's pass@k / maj@N from --samples-per-task, where every role has that metric."""
    values = [{(r.task, r.metric): r for r in s.results if r.metric.endswith(" sampled")} for s in summaries.values()]
    keys = [k for k in values[0] if all(k in v for v in values)] if values else []
    return [role_row(f"{task} ({metric})", dict(zip(summaries, (v[(task, metric)] for v in values), strict=False)))
            for task, metric in keys]


def role_row(label: str, results: dict[str, TaskResult], aligned: Aligned | str = "no per-item samples were given"
             ) -> dict[str, Any]:
    """One comparison row: each role's value and standard error, its document count, the settings that differ
    between roles, and what follows (differences, retention, recovered share), paired where `aligned` holds the
    items."""
    first = next(iter(results.values()))
    row: dict[str, Any] = {"task": label, "kind": first.kind, "metric": first.metric,
                           "n": {role: r.n for role, r in results.items()}, "settings_differ": settings_differ(results)}
    for role, result in results.items():
        row[role], row[f"{role}_stderr"] = result.value, result.stderr
    if row["settings_differ"]:
        aligned = "the roles ran with different settings"
    row.update(_derived(row) if isinstance(aligned, str) else _paired(row, list(results), [aligned]))
    if isinstance(aligned, str):
        row["pairing"] = f"unpaired: {aligned}"
    return row


def _paired(row: dict[str, Any], roles: list[str], tasks: list[Aligned]) -> dict[str, Any]:
    """The paired figures of one task or of several (their mean), flattened into the row's keys: the differences,
    clear_drop (the drop's interval above 0), retention and the recovered share as values, with `intervals`."""
    from layerprune.evaluate.paired_figures import task_figures

    figures = task_figures(roles, tasks)
    out: dict[str, Any] = {key: figures.get(key) for key in ("pruned_vs_baseline", "recovered_vs_pruned",
                                                             "recovered_vs_baseline")}
    out["clear_drop"] = figures.get("clear_drop")
    out["pairing"] = f"paired ({figures['items']} items, {figures['resamples']} resamples, seed {figures['seed']})"
    out["chance"] = figures["chance"]
    intervals = {k: v for k, v in figures.items() if k.startswith(("retention", "recovered_share"))}
    out["intervals"] = intervals
    clear = bool(out["clear_drop"])
    for key in ("retention_pruned", "retention_recovered", "recovered_share"):
        stated = clear and isinstance(intervals.get(key), dict)
        out[key] = intervals[key]["value"] if stated else None
    if clear and isinstance(intervals.get("recovered_share"), str):  # the drop's interval nearly reaches 0
        out["recovered_share_note"] = intervals["recovered_share"]
    return out


def _derived(row: dict[str, Any]) -> dict[str, Any]:
    """Unpaired: differences with their noise; retention and recovered share only where baseline - pruned > 2 SE."""
    drop, recovery = difference(row, "baseline", "pruned"), difference(row, "recovered", "pruned")
    out: dict[str, Any] = {"pruned_vs_baseline": difference(row, "pruned", "baseline"), "recovered_vs_pruned": recovery,
                           "recovered_vs_baseline": difference(row, "recovered", "baseline")}
    clear = (drop is not None and drop["se"] is not None and not row.get("settings_differ")
             and drop["diff"] > NOISE_SE * drop["se"])
    out["clear_drop"] = clear if drop is not None else None
    base, pruned, rec = row.get("baseline"), row.get("pruned"), row.get("recovered")
    out["retention_pruned"] = _ratio(pruned, base) if clear else None
    out["retention_recovered"] = _ratio(rec, base) if clear else None
    out["recovered_share"] = _ratio(rec - pruned, base - pruned) if clear and rec is not None else None
    return out


def average_rows(rows: list[dict[str, Any]], roles: list[str], matrices: dict[str, Aligned] | None = None
                 ) -> list[dict[str, Any]]:
    """Means over classification tasks and over generative tasks, each kind on its own. Paired where every task of
    the kind is (items resampled within tasks); else the mean's standard error is sqrt(sum of SE^2) / count. Rows
    whose roles ran with different settings are left out, and so are metrics outside [0, 1]."""
    matrices = matrices or {}
    out = []
    for kind in ("classification", "generative"):
        group = [r for r in rows if r["kind"] == kind and not r["settings_differ"] and _in_unit_range(r, roles)]
        if not group:
            continue
        avg: dict[str, Any] = {"task": f"average ({kind}, {len(group)} tasks)", "kind": kind, "metric": "mean",
                               "n": {role: sum(r["n"][role] for r in group) for role in roles}, "settings_differ": {}}
        for role in roles:
            avg[role] = sum(r[role] for r in group) / len(group)
            se = combined_se(*(r[f"{role}_stderr"] for r in group))
            avg[f"{role}_stderr"] = None if se is None else se / len(group)
        unpaired = [r["task"] for r in group if r["task"] not in matrices]
        if unpaired:
            avg.update(_derived(avg))
            avg["pairing"] = f"unpaired: no paired items for {', '.join(unpaired)}"
        else:
            avg.update(_paired(avg, roles, [matrices[r["task"]] for r in group]))
        out.append(avg)
    return out


def _in_unit_range(row: dict[str, Any], roles: list[str]) -> bool:
    return all(row.get(role) is not None and 0.0 <= row[role] <= 1.0 for role in roles)


def _cell(value: Any, se: float | None = None) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" + (f" ± {se:.4f}" if se is not None else " ± ?")


def _diff_cell(diff: dict[str, Any] | None) -> str:
    if diff is None:
        return "-"
    se = "?" if diff["se"] is None else f"{diff['se']:.4f}"
    mark = " (SE unknown)" if diff["within_noise"] is None else " (within noise)" if diff["within_noise"] else ""
    if diff.get("low") is None:
        return f"{diff['diff']:+.4f} ± {se}{mark}"
    mcnemar = f"; b/c {diff['b']}/{diff['c']}, McNemar p {diff['mcnemar_p']:.3g}" if "mcnemar_p" in diff else ""
    return f"{diff['diff']:+.4f} ± {se} [{diff['low']:+.4f}, {diff['high']:+.4f}]{mcnemar}{mark}"


def _share_cell(row: dict[str, Any], column: str) -> str:
    if row["settings_differ"]:
        return "n/a (settings differ)"
    intervals = row.get("intervals") or {}
    if column.startswith("retention_norm"):
        return _interval_pct(intervals.get(column))
    if not row.get("clear_drop"):
        return NO_CLEAR_DROP
    if column == "recovered_share" and row.get("recovered_share_note"):
        return str(row["recovered_share_note"])
    value = row.get(column)
    if value is None:
        return "-"
    ci = intervals.get(column)
    return _interval_pct(ci) if ci else f"{100 * value:.1f}%"


def _interval_pct(ci: dict[str, Any] | None) -> str:
    from layerprune.core.paired import format_interval

    return format_interval(ci)


def format_comparison(rows: list[dict[str, Any]], roles: list[str]) -> str:
    """Markdown: value ± SE per role, the differences (marked "within noise" under 2 combined SE), retention."""
    diffs = [c for c, title in DIFF_COLUMNS if any(r.get(c) is not None for r in rows)]
    judged = any(r.get("clear_drop") is not None for r in rows)
    extra = [c for c in ("retention_pruned", "retention_norm_pruned", "retention_recovered", "retention_norm_recovered",
                         "recovered_share")
             if judged and ("pruned" in c or "recovered" in roles)
             and (not c.startswith("retention_norm") or any(r.get("intervals") for r in rows))]
    head = ["task", "metric", "n", *roles, *(dict(DIFF_COLUMNS)[c] for c in diffs),
            *(EXTRA_TITLES[c] for c in extra)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        counts = sorted(set(row["n"].values()))
        task = f"**{row['task']} (SETTINGS DIFFER)**" if row["settings_differ"] else row["task"]
        cells = [task, row["metric"], "/".join(str(c) for c in counts),
                 *(_cell(row.get(r), row.get(f"{r}_stderr")) for r in roles),
                 *(_diff_cell(row.get(c)) for c in diffs), *(_share_cell(row, c) for c in extra)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


EXTRA_TITLES = {"retention_pruned": "retention pruned", "retention_norm_pruned": "retention pruned (chance-norm.)",
                "retention_recovered": "retention recovered",
                "retention_norm_recovered": "retention recovered (chance-norm.)", "recovered_share": "recovered share"}
DIFF_COLUMNS = [("pruned_vs_baseline", "pruned - baseline"), ("recovered_vs_pruned", "recovered - pruned")]


def pairing_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line naming each row that could not be paired, and why (its figures are the unpaired ones)."""
    lines = [f"- {r['task']}: {r['pairing']}" for r in rows if str(r.get("pairing", "")).startswith("unpaired")]
    return ["Not paired (unpaired standard errors used):", *lines] if lines else []


def settings_warning(rows: list[dict[str, Any]]) -> list[str]:
    """Loud lines naming each task whose roles were evaluated with different settings."""
    out = []
    for row in rows:
        for key, values in row["settings_differ"].items():
            shown = ", ".join(f"{role} {json.dumps(v, default=str)}" for role, v in values.items())
            out.append(f"**WARNING: {row['task']} was evaluated with different {key} ({shown}); its scores are not "
                       "comparable and it is left out of the averages.**")
    return out


NOISE_NOTE = ("Values are shown ± one standard error. Where every model answered the same items (the usual case) a "
              "difference is paired: the mean per-item difference ± its paired SE, its 95% paired bootstrap interval "
              "[low, high] (2000 resamples, seed 0; averages resample items within each task) and, for 0/1 scores, "
              "the discordant counts b/c (right before and wrong after / the reverse) with McNemar's exact p; it is "
              "\"within noise\" when the interval holds 0. Retention is model / baseline; chance-normalised retention "
              "is (model - chance) / (baseline - chance), chance being 1/choices for multiple choice and 0 for exact "
              "match. Retention and the recovered share (recovered - pruned) / (baseline - pruned) are shown with "
              "their intervals only where the drop is clear (its interval above 0), else \"n/a (no clear drop)\"; "
              "the share is printed as \"unbounded\" where the drop's interval comes within 2 points of 0 (a ratio "
              "over a drop that may be nearly 0 has no useful interval). A "
              "row that cannot be paired says why and falls back to the unpaired rule: within noise under twice the "
              "combined standard error sqrt(SE1^2 + SE2^2).")


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
            errors = [r.get(f"{role}_stderr") or 0.0 for r in group]
            ax.bar([x + i * width for x in range(len(group))], [r[role] for r in group], width, label=role,
                   yerr=errors, capsize=2)
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


def compare(summaries: dict[str, Summary], output_dir: Path | None = None,
            folders: dict[str, Path] | None = None) -> dict[str, Any]:
    """Compare models by role (baseline, pruned, recovered, or any labels); returns the table and file paths.

    With `folders` (each role's evaluation folder, holding samples/<task>.jsonl) the differences are paired item by
    item, and roles run with the same settings but scored on different items are refused (LayerpruneError, one line,
    before anything is written: `paired_items`); with `output_dir`, writes comparison.md, comparison.json and PNG
    charts into it (created if needed).
    """
    roles = [r for r in ROLES if r in summaries] + [r for r in summaries if r not in ROLES]
    ordered = {role: summaries[role] for role in roles}
    rows, matrices = comparison_rows(ordered, folders)
    averages = average_rows(rows, roles, matrices)
    rows += sampled_rows(ordered)  # pass@k / maj@N next to the greedy headline, outside the averages
    warnings = settings_warning(rows)
    table = "\n\n".join([*warnings, format_comparison(rows + averages, roles), *pairing_notes(rows + averages),
                          NOISE_NOTE])
    result: dict[str, Any] = {"table": table, "rows": rows, "averages": averages, "warnings": warnings, "paths": {}}
    if output_dir is None:
        return result
    output_dir.mkdir(parents=True, exist_ok=True)
    overlap = {r: s.calibration_overlap for r, s in ordered.items() if s.calibration_overlap}
    write_atomic(output_dir / "comparison.md", "# Comparison\n\n" + table + "\n" + "".join(
        f"\n{role}: evaluated documents found in the calibration data (--allow-overlap): {o['tasks']}\n"
        for role, o in overlap.items() if o["tasks"]))
    models = {role: s.model.model_dump() for role, s in ordered.items()}
    write_atomic(output_dir / "comparison.json", json.dumps(
        {"rows": rows, "averages": averages, "warnings": warnings, "noise_rule": NOISE_NOTE,
         "calibration_overlap": overlap, "models": models}, indent=1, default=str))
    charts = [p.name for p in plot_comparison(rows, averages, roles, output_dir)]
    names = ["comparison.md", "comparison.json", *charts]
    result["paths"] = {name: output_dir / name for name in names}
    return result
