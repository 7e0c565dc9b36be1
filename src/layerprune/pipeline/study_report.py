"""study.md of a recovery study: one row per method, each number with its standard error, and a chart.

Per model: the probe average (the algorithmic probes), GSM8K, and the classification average, each a mean of
headline metrics with the standard error of that mean (tasks independent: sqrt(sum se^2) / k). Retention is the
model's value over the original's. The recovered share of the generative drop is (arm - pruned) / (original -
pruned) on the probe average, and 'n/a (no clear drop)' when the drop is within two standard errors of zero.

Each arm is reported twice more: on the trained skills (probe tasks whose own prompts were in the recovery data) and
on the unseen ones (every other probe task; GSM8K and classification are marked too). The split is by task, not by
family: prompts of brackets_d6 do not make brackets_d5 a trained skill, since its items are other questions of
another depth.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from layerprune.evaluate.summary import SUMMARY_FILE, Summary, read_summary
from layerprune.probes import distinct_items

PROBE_PREFIXES = ("arith_", "brackets_")
GSM8K = "gsm8k"


def _summary(path: Path) -> Summary | None:
    return read_summary(path) if path.is_file() else None


def mean_with_se(results: list[Any]) -> tuple[float, float] | None:
    """Mean of headline values and the standard error of that mean (None when there are none)."""
    if not results:
        return None
    se = math.sqrt(sum((r.stderr or 0.0) ** 2 for r in results)) / len(results)
    return sum(r.value for r in results) / len(results), se


def trained_tasks(source: str) -> frozenset[str]:
    """Evaluation tasks whose own prompts were in the recovery data (`prompts.source`), task by task."""
    from layerprune.recover.prompts import is_gsm8k, probe_task_names

    names = probe_task_names(source)
    if names is not None:
        return frozenset(names)
    return frozenset({GSM8K}) if is_gsm8k(source) else frozenset()


def measures(summary: Any, trained: frozenset[str] = frozenset()) -> dict[str, Any]:
    """probe average (all, trained tasks, unseen tasks), GSM8K and classification average of one model, each
    (value, se)."""
    heads = list(summary.headlines().values())
    probes = [r for r in heads if r.task.startswith(PROBE_PREFIXES)]
    gsm = [r for r in heads if r.task == GSM8K]
    cls = [r for r in heads if r.kind == "classification"]
    return {"probes": mean_with_se(probes), "gsm8k": mean_with_se(gsm), "classification": mean_with_se(cls),
            "probes_trained": mean_with_se([r for r in probes if r.task in trained]),
            "probes_unseen": mean_with_se([r for r in probes if r.task not in trained]),
            "trained_tasks": sorted(r.task for r in probes if r.task in trained),
            "unseen_tasks": sorted(r.task for r in probes if r.task not in trained),
            "probe_tasks": len(probes), "probe_items": {r.task: r.n for r in probes}}


def recovered_share(base: tuple[float, float] | None, pruned: tuple[float, float] | None,
                    arm: tuple[float, float] | None) -> float | str | None:
    """(arm - pruned) / (base - pruned), or 'n/a (no clear drop)' when base - pruned is within 2 SE."""
    if base is None or pruned is None or arm is None:
        return None
    drop, se = base[0] - pruned[0], math.hypot(base[1], pruned[1])
    if drop <= 2 * se:
        return "n/a (no clear drop)"
    return (arm[0] - pruned[0]) / drop


SHARES = {"recovered_share": "probes", "recovered_share_trained": "probes_trained",
          "recovered_share_unseen": "probes_unseen"}


def study_rows(root: Path, labels: list[str], trained: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """One row per model (original, pruned, each arm) with its measures, retention, shares, time and tokens."""
    found = {label: _summary(root / "eval" / label / SUMMARY_FILE) for label in ["baseline", "pruned", *labels]}
    values = {label: measures(s, trained) for label, s in found.items() if s is not None}
    base, pruned = values.get("baseline", {}), values.get("pruned", {})
    rows = []
    for label, m in values.items():
        row: dict[str, Any] = {"model": label, **m}
        for key in ("probes", "gsm8k", "classification"):
            row[f"retention_{key}"] = _ratio(m.get(key), base.get(key))
        for share, key in SHARES.items():
            row[share] = recovered_share(base.get(key), pruned.get(key), m.get(key)) \
                if label not in ("baseline", "pruned") else None
        row.update(_arm_cost(root / "arms" / label))
        rows.append(row)
    # the pruned model's own held-out CE / KL (every distilling arm measured it on the same held-out answers)
    before = next((r for r in rows if r.get("held_out_ce_pruned") is not None), None)
    pruned_row = next((r for r in rows if r["model"] == "pruned"), None)
    if pruned_row is not None and before is not None:
        pruned_row["held_out_ce"], pruned_row["held_out_kl"] = before["held_out_ce_pruned"], \
            before.get("held_out_kl_pruned")
    return rows


def _ratio(value: Any, base: Any) -> float | None:
    return value[0] / base[0] if value and base and abs(base[0]) > 1e-12 else None


def _arm_cost(arm: Path) -> dict[str, Any]:
    from layerprune.recover.report import RECOVER_REPORT, read_recover_report

    if not (arm / RECOVER_REPORT).is_file():
        return {}
    report = read_recover_report(arm)
    metrics = report.data.get("held_out_metrics") or {}
    after = metrics.get("after") or {"ce": report.held_out_loss.after, "kl": None}  # SFT: CE on its own split
    method = report.recipe.method
    if method == "replace" and report.recipe.replace.then != "none":
        method += f" then {report.recipe.replace.then}"
    return {"method": method, "seconds": report.seconds.training,
            "generation_seconds": report.seconds.generation, "tokens": report.tokens_seen,
            "steps": report.data.get("steps"), "held_out_ce": after.get("ce"), "held_out_kl": after.get("kl"),
            "held_out_ce_pruned": (metrics.get("pruned") or {}).get("ce"),
            "held_out_kl_pruned": (metrics.get("pruned") or {}).get("kl")}


def _pm(value: tuple[float, float] | None) -> str:
    return "-" if value is None else f"{100 * value[0]:.1f} ± {100 * value[1]:.1f}"


def _pct(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{100 * value:.0f}%"


def format_table(rows: list[dict[str, Any]], gsm8k_trained: bool = False) -> str:
    gsm = "GSM8K, trained (%)" if gsm8k_trained else "GSM8K, unseen (%)"
    head = ["model", "method", "probe avg (%)", "trained probes (%)", "unseen probes (%)", gsm,
            "classification avg, unseen (%)", "retention probes / cls",
            "recovered share of the probe drop: all / trained / unseen", "held-out CE / KL", "train time (s)", "tokens",
            "steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        held = "-" if r.get("held_out_ce") is None else f"{r['held_out_ce']:.3f} / " + (
            "-" if r.get("held_out_kl") is None else f"{r['held_out_kl']:.3f}")
        shares = " / ".join(_pct(r.get(share)) for share in SHARES)
        cells = [r["model"], r.get("method", "-"), _pm(r["probes"]), _pm(r.get("probes_trained")),
                 _pm(r.get("probes_unseen")), _pm(r["gsm8k"]), _pm(r["classification"]),
                 f"{_pct(r['retention_probes'])} / {_pct(r['retention_classification'])}", shares,
                 held, "-" if r.get("seconds") is None else f"{r['seconds']:.0f}", str(r.get("tokens", "-")),
                 str(r.get("steps", "-"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_study(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of the three measures per model, with 1-SE error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = (("probes", "probe avg"), ("probes_trained", "trained probes"), ("probes_unseen", "unseen probes"),
             ("gsm8k", "GSM8K"), ("classification", "classification avg"))
    keys = [(k, name) for k, name in named if any(r.get(k) for r in rows)]  # a measure no model has: left out, not 0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4))
    width = 0.8 / max(len(keys), 1)
    for i, (key, name) in enumerate(keys):
        xs = [x + i * width for x in range(len(rows))]
        vals = [(r.get(key) or (math.nan, math.nan)) for r in rows]
        ax.bar(xs, [100 * v[0] for v in vals], width, yerr=[100 * v[1] for v in vals], capsize=2, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [r["model"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("score (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def closing_note(rows: list[dict[str, Any]]) -> list[str]:
    """Which arm recovered most of the probe drop (all, trained and unseen tasks), and whether it reached half
    (the goal) or three quarters (the aim) of it."""
    arms = [r for r in rows if r["model"] not in ("baseline", "pruned")]
    if not arms:
        return ["No recovery arm finished."]
    named = {"recovered_share": "the probe average", "recovered_share_trained": "the trained probe tasks",
             "recovered_share_unseen": "the unseen probe tasks"}
    return [_verdict(arms, share, what) for share, what in named.items()]


def _verdict(arms: list[dict[str, Any]], share: str, what: str) -> str:
    shares = [r for r in arms if isinstance(r.get(share), float)]
    if not shares:
        return (f"On {what} the drop from pruning is within two standard errors (or missing), so no recovered share "
                "is reported; evaluate on more probe items to measure one.")
    best = max(shares, key=lambda r: r[share])
    verdict = ("reaches three quarters of the drop (the aim)" if best[share] >= 0.75 else
               "reaches half of the drop (the goal), not three quarters" if best[share] >= 0.5 else
               "does NOT reach half of the drop (the goal)")
    return (f"Best arm on {what}: {best['model']} ({best.get('method', '-')}), {100 * best[share]:.0f}% of the drop "
            "recovered; "
            f"it {verdict}. Tried: " + ", ".join(f"{r['model']} ({_pct(r.get(share))})" for r in arms) + ".")


def probe_items_text(items: dict[str, int]) -> str:
    """'arith_1dc 100, ..., brackets_d2 9 (all there are), ...': a task with few distinct questions (shallow
    brackets) is evaluated exhaustively, with fewer items than the others."""
    return ", ".join(f"{task} {n}" + (" (all there are)" if n == distinct_items(task) else "")
                     for task, n in items.items()) or "none"


def write_study_report(study: Any, root: Path) -> Path:
    """study.md, study.json and study.png in the study directory."""
    source = study.shared_recipe(str(root / "pruned")).prompts.source
    trained = trained_tasks(source)
    rows = study_rows(root, list(study.arms), trained)
    plot_study(rows, root / "study.png")
    (root / "study.json").write_text(json.dumps(rows, indent=1, default=str))
    items = rows[0].get("probe_items", {}) if rows else {}
    split = rows[0] if rows else {}
    lines = [f"# Recovery study: {study.name}", "", study.description, "", format_table(rows, GSM8K in trained), "",
             *closing_note(rows), "",
             f"Trained skills: the evaluated probe tasks whose own prompts were in the recovery data ({source}): "
             f"{', '.join(split.get('trained_tasks', [])) or 'none'}. Unseen skills: the other probe tasks "
             f"({', '.join(split.get('unseen_tasks', [])) or 'none'}), "
             + ("" if GSM8K in trained else "GSM8K, ") + "and the classification tasks. Split by task, not family.",
             "",
             f"Probe average: the unweighted mean over {rows[0]['probe_tasks'] if rows else 0} probe tasks of their "
             f"accuracies; items per task: {probe_items_text(items)} (the first items of each task under the "
             "evaluation seed; no recovery prompt is one of them). Values are means ± one standard error. GSM8K is "
             "scored with the evaluation suite's protocol (lm-eval's gsm8k).",
             "Every arm ran the same optimizer steps on the same prompts; train time excludes the teacher's answers, "
             "generated once and shared. Held-out CE / KL: on the teacher's answers to the held-out prompts, the "
             "pruned row before any recovery (SFT: cross-entropy on its own held-out split of the answers, no KL).",
             "", "![study](study.png)", "",
             f"Rerun: `layerprune study {study.name} --output {root}` (complete stages are skipped)."]
    (root / "study.md").write_text("\n".join(lines) + "\n")
    return root / "study.md"
