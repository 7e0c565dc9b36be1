"""grain.md, grain.json and grain.png of a grain study: every cell before and after recovery with paired intervals,
each finer grain against the block arm at the same level, and the verdicts the recipe's gates give.

One clustered paired bootstrap (pipeline/paired_table.py: items drawn within each task, the same draw for every
model; two-level over the replicates where a model has several, replicate r of every cell paired by seed) gives every
figure its 95% interval. The instrument is the unweighted mean of the evaluated tasks' means; retention is
chance-normalised, (model - chance) / (original - chance).

The verdicts (fixed by the recipe's gates before any result): at a level whose block-arm drop (original - pruned
block arm) has an interval above 0, a finer grain "costs less" where (finer - block) lies above +margin, "costs more"
where it lies below -margin (this falsifies "finer grain costs less at matched savings" for that grain and stage), and
"not distinguished" otherwise; a level without a clear drop is "uninformative". Each call is tested at family-wise
level 5% by Holm's step-down over the family of every planned comparison (levels x finer grains x the two stages,
before and after recovery: 8 in grain-embedded), each with its two-sided bootstrap p-value against the margin from the
same resamples that give its interval (`tail_p`); an uninformative or missing comparison stays in the family with p =
1, so the family's size is fixed by the recipe. The k = 0 control fails its gate where its (control - original)
interval lies wholly beyond the control shift.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core import paired
from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.paired import ALPHA, format_interval, holm
from layerprune.pipeline.paired_table import Figures
from layerprune.pipeline.studies.figures import INSTRUMENT, spent_text, study_figures, unpaired
from layerprune.pipeline.studies.grain_grid import CONTROL, PLAN_FILE, cell, grain_arm, logical_models
from layerprune.pipeline.studies.sweep_curves import save_chart
from layerprune.pipeline.studies.sweep_grid import SweepStudy


def grain_figures(study: SweepStudy, root: Path) -> Figures:
    """The paired figures of every evaluated model (the logical labels of `logical_models`, complete ones only);
    models scored on different items, or a task not paired, are refused in one line."""
    runs = {label: names for label, names in logical_models(study).items()
            if all((root / "eval" / n / "summary.json").is_file() for n in names)}
    figures, kinds = study_figures({n: root / "eval" / n for names in runs.values() for n in names}, runs)
    if unpaired(kinds):
        raise LayerpruneError("the grain study's models did not answer the same items: "
                              + "; ".join(f"{t}: {w}" for t, w in unpaired(kinds).items()))
    return figures


def tail_p(draws: np.ndarray, margin: float) -> tuple[float, str]:
    """The two-sided bootstrap p-value of (finer - block) against the margin (`paired.bootstrap_p`) and the side it
    points to: 'costs less' (above +margin) or 'costs more'."""
    p, side = paired.bootstrap_p(draws, margin)
    return p, {"above": "costs less", "below": "costs more"}.get(side, side)


def verdict(p_holm: float, side: str, informative: bool, alpha: float = ALPHA) -> str:
    """'costs less', 'costs more', 'not distinguished' or 'uninformative' from the Holm-adjusted p-value of (finer -
    block) against the margin and the side its tail points to (`tail_p`)."""
    if not informative:
        return "uninformative (no clear drop at this level)"
    return side if p_holm < alpha else "not distinguished"


def family_size(study: SweepStudy) -> int:
    """The comparisons of the Holm family, fixed by the recipe: levels x finer grains x 2 stages."""
    return len(study.ratios) * len(study.grains.compare) * 2


def cell_figures(figures: Figures, name: str, plan: dict[str, Any]) -> dict[str, Any]:
    """One cell's savings and, before (pruned-NAME) and after recovery (NAME), its score, retention and change from
    the original; after recovery also the recovered share of the drop."""
    out: dict[str, Any] = {"cell": name, **{k: plan[k] for k in ("grain", "level", "removals", "params_fraction",
                                                                  "kv_fraction", "gap")},
                           **{k: plan[k] for k in ("speedup", "timed") if k in plan}}
    for stage, label in (("pruned", f"pruned-{name}"), ("recovered", name)):
        if label not in figures.labels:
            continue
        out[stage] = {"score": figures.score(label, INSTRUMENT),
                      "retention": figures.interval(lambda m, a=label: figures.retention(a, INSTRUMENT, m)),
                      "change": figures.difference(label, "baseline", INSTRUMENT),
                      "tasks": {t: figures.score(label, t) for t in figures.tasks}}
    if "recovered" in out and "pruned" in out:
        out["recovered"]["share"] = paired.share_interval(
            figures.boot, figures.difference("baseline", f"pruned-{name}", INSTRUMENT),
            lambda m: figures.share_of(name, f"pruned-{name}", INSTRUMENT, m))
        out["recovered"]["spread"] = figures.spread(name, INSTRUMENT)
    return out


def comparisons(study: SweepStudy, figures: Figures) -> list[dict[str, Any]]:
    """Each finer grain against the block arm at each level, before and after recovery, with its unadjusted 95%
    interval, its bootstrap p-value against the margin, the Holm-adjusted p over the recipe's family
    (`family_size`: a comparison not shown counts p = 1) and its verdict."""
    rows = []
    for level in study.ratios:
        block = cell("block", level)
        if f"pruned-{block}" not in figures.labels:
            continue
        drop = figures.difference("baseline", f"pruned-{block}", INSTRUMENT)
        clear = drop["low"] is not None and drop["low"] > 0
        for grain in study.grains.compare:
            for stage, prefix in (("pruned", "pruned-"), ("recovered", "")):
                finer, ref = f"{prefix}{cell(grain, level)}", f"{prefix}{block}"
                if finer in figures.labels and ref in figures.labels:
                    def gap(m: np.ndarray, a: str = finer, b: str = ref) -> np.ndarray:
                        return figures.mean(m, a, INSTRUMENT) - figures.mean(m, b, INSTRUMENT)

                    p, side = tail_p(gap(figures.boot.resampled), study.grains.gates.margin)
                    rows.append({"level": level, "grain": grain, "stage": stage, "difference": figures.interval(gap),
                                 "block_drop": drop, "informative": clear, "p": p, "side": side})
    called = [r["p"] if r["informative"] else 1.0 for r in rows]
    adjusted = holm(called + [1.0] * (family_size(study) - len(rows)))
    for row, p_holm in zip(rows, adjusted, strict=False):
        row["p_holm"] = p_holm
        row["verdict"] = verdict(p_holm, row.pop("side"), row.pop("informative"))
    return rows


def control_gate(study: SweepStudy, figures: Figures) -> dict[str, Any] | None:
    """The k = 0 control's change of the instrument and whether it passes the gate."""
    if CONTROL not in figures.labels:
        return None
    change = figures.difference(CONTROL, "baseline", INSTRUMENT)
    limit = study.grains.gates.control_shift
    failed = change["low"] is not None and (change["low"] > limit or change["high"] < -limit)
    return {"change": change, "limit": limit, "passed": not failed, "spread": figures.spread(CONTROL, INSTRUMENT)}


def spent(study: SweepStudy, root: Path, label: str) -> list[dict[str, Any]]:
    """What each replicate's recovery of a cell (or of the control) spent: unpadded target tokens, sequences,
    optimizer steps and learning rate (lr_search.budget_spent), replicate by replicate."""
    from layerprune.recover.lr_search import budget_spent

    folder = root / ("controls" if label == CONTROL else "recovered")
    return [budget_spent(folder / name / "recover_report.json") for name in logical_models(study)[label]
            if (folder / name / "recover_report.json").is_file()]


def grain_record(study: SweepStudy, root: Path) -> dict[str, Any]:
    """Everything grain.md shows, as data."""
    figures = grain_figures(study, root)
    plan = json.loads((root / PLAN_FILE).read_text())
    control = control_gate(study, figures)
    if control is not None:
        control["budget"] = spent(study, root, CONTROL)
    return {"name": study.name, "match": study.grains.match, "tolerance": study.grains.tolerance,
            "tasks": figures.tasks, "replicates": study.replicates, "baseline": figures.score("baseline", INSTRUMENT),
            "control": control,
            "cells": [{**cell_figures(figures, name, c), "budget": spent(study, root, name)}
                      for name, c in plan["cells"].items() if f"pruned-{name}" in figures.labels],
            "family": {"method": "holm", "comparisons": family_size(study), "alpha": ALPHA},
            "comparisons": comparisons(study, figures)}


def _pct(ci: dict[str, Any] | str | None) -> str:
    """A percent with its interval, or the string saying why there is none (a share over a drop near 0)."""
    return ci if isinstance(ci, str) else format_interval(ci, digits=1)


def _points(ci: dict[str, Any]) -> str:
    if ci.get("value") is None:
        return "-"
    text = f"{100 * ci['value']:+.1f}"
    return text if ci.get("low") is None else f"{text} [{100 * ci['low']:+.1f}, {100 * ci['high']:+.1f}]"


def format_report(study: SweepStudy, record: dict[str, Any]) -> str:
    """grain.md: the cells table, the comparisons with their verdicts, the control and how to read them."""
    cuts, method = study.grains, study.arms[grain_arm(study)].method
    timed = cuts.match == "speedup"
    head = ["cell", "removed (blocks, or BLOCK.attn / BLOCK.mlp)", "params removed", "KV cache removed",
            *(["measured speedup"] if timed else []), "gap",
            "pruned score", "pruned retention",
            "recovered score", "recovered retention", "recovered share of the drop", "run SD / item SE (points)",
            "spent: unpadded target tokens / steps / lr"]
    lines = [f"# Grain study: {study.name}", "", *([study.description, ""] if study.description else []),
             f"Original on the instrument ({', '.join(record['tasks'])}; unweighted mean of task means): "
             f"{_pct(record['baseline'])}. Savings matched on {cuts.match} within {100 * cuts.tolerance:g}% of the "
             f"block arm's; {study.replicates} recoveries per cell ({method}); 95% intervals from one paired "
             "bootstrap over items" + (" and runs." if study.replicates > 1 else " (one run: training variance not "
                                       "measured)."), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in record["cells"]:
        before, after = c.get("pruned", {}), c.get("recovered", {})
        spread = after.get("spread") or {}
        sd = "-" if not spread else ("not measured" if spread.get("run_sd") is None else
                                     f"{100 * spread['run_sd']:.1f}") + f" / {100 * spread['item_se']:.1f}"
        lines.append("| " + " | ".join([
            c["cell"], ", ".join(map(str, c["removals"])), f"{100 * c['params_fraction']:.1f}%",
            f"{100 * c['kv_fraction']:.1f}%", *([f"{c['speedup']:.3f}x"] if timed else []),
            f"{100 * c['gap']:+.2f}%", _pct(before.get("score")),
            _pct(before.get("retention")), _pct(after.get("score")), _pct(after.get("retention")),
            _pct(after.get("share")), sd, spent_text(c.get("budget") or [])]) + " |")
    lines += ["", "## Finer grain against the block arm at matched savings", "",
              f"Difference = finer - block on the instrument (points, paired 95%, unadjusted); margin "
              f"{100 * cuts.gates.margin:g} points. Each verdict is tested at family-wise level "
              f"{100 * record['family']['alpha']:g}% by Holm's step-down over the family of the "
              f"{record['family']['comparisons']} planned comparisons (levels x finer grains x before/after "
              "recovery), from each one's two-sided bootstrap p-value against the margin (an uninformative or "
              "missing one counts p = 1). 'costs more' falsifies \"finer grain costs less at matched savings\" for "
              "that grain and stage.", "",
              "| level (blocks) | grain | stage | block arm's drop | finer - block | p (Holm-adjusted p) | verdict |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['level']} | {r['grain']} | {r['stage']} | {_points(r['block_drop'])} | "
              f"{_points(r['difference'])} | {r['p']:.3f} ({r['p_holm']:.3f}) | {r['verdict']} |"
              for r in record["comparisons"]]
    control = record["control"]
    lines += ["", "## k = 0 control", ""]
    if control is None:
        lines.append("No k = 0 control ran: what the recovery recipe does to the unpruned model is not separated.")
    else:
        lines.append(f"The recovery applied to the original (spent {spent_text(control.get('budget') or [])}): change "
                     f"{_points(control['change'])} points; gate "
                     f"(wholly beyond ±{100 * control['limit']:g} points) "
                     + ("passed." if control["passed"] else "FAILED: the recipe itself moves the instrument, so "
                        "after-recovery retention is not recovery alone (grain differences share the recipe)."))
    return "\n".join(lines) + "\n"


def plot_grains(record: dict[str, Any], path: Path) -> None:
    """Retention against the parameters removed (matched on speed: against the measured speedup), one line per grain,
    dashed before recovery, solid after; a cell without a retention value (an undefined ratio) is left out, not drawn
    at 0."""
    speed = record.get("match") == "speedup"
    key, origin, scale = ("speedup", 1.0, 1.0) if speed else ("params_fraction", 0.0, 100.0)

    def draw(axes: list[Any]) -> None:
        ax = axes[0]
        for grain, color in (("block", "#d62728"), ("attention", "#1f77b4"), ("mlp", "#2ca02c")):
            points = sorted((c for c in record["cells"] if c["grain"] == grain), key=lambda c: c[key])
            for stage, style in (("pruned", "--"), ("recovered", "-")):
                shown = [c for c in points if c.get(stage, {}).get("retention", {}).get("value") is not None]
                xs = [origin] + [c[key] for c in shown]
                ci = [c[stage]["retention"] for c in shown]
                if not ci:
                    continue
                ys = [1.0] + [r["value"] for r in ci]
                ax.plot([scale * x for x in xs], ys, style, marker="o", color=color, label=f"{grain}, {stage}")
                for x, r in zip(xs[1:], ci, strict=True):
                    if r.get("low") is not None:
                        ax.vlines(scale * x, r["low"], r["high"], color=color, alpha=0.5)
        ax.set(xlabel="measured speedup (x)" if speed else "parameters removed (%)",
               ylabel="retention (chance-normalised)")
        ax.legend(fontsize=8)

    save_chart(path, draw, (6, 4), dpi=120)


def write_grain_report(study: SweepStudy, root: Path) -> Path:
    """grain.json, grain.png and grain.md (last: the report stage's output)."""
    record = grain_record(study, root)
    write_atomic(root / "grain.json", json.dumps(record, indent=1))
    plot_grains(record, root / "grain.png")
    write_atomic(root / "grain.md", format_report(study, record))
    return root / "grain.md"
