"""sweep.md of a pruning-ratio sweep: retention against k for classification and generative reasoning, pruned and
recovered, with paired intervals; a table, the loss curves, and verdicts computed from the intervals.

Every model answered the same items, so one clustered paired bootstrap (items drawn within each task, the same draw for
every model) gives every figure its interval: drops, chance-normalised retention (model - chance) / (original -
chance), the recovered share (recovered - pruned) / (original - pruned), and the differences the verdicts test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.paired import format_interval
from layerprune.pipeline.paired_table import Figures, load_matrix

KINDS = ("classification", "generative")
NO_CLEAR_DROP = "n/a (no clear drop)"  # the drop's interval holds 0: no share of it to speak of


def point(study: Any, figures: Figures, k: int) -> dict[str, Any]:
    """One k of the sweep: per kind the scores, drop, chance-normalised retention, recovered share; and the gap."""
    out: dict[str, Any] = {"k": k}
    for kind in KINDS:
        if not figures.has(kind):
            continue
        row = {"baseline": figures.score("baseline", kind), "pruned": figures.score(f"pruned-k{k}", kind),
               "drop": figures.difference("baseline", f"pruned-k{k}", kind)}
        row["retention_pruned"] = figures.interval(lambda m, kind=kind: figures.retention(f"pruned-k{k}", kind, m))
        if f"recovered-k{k}" in figures.labels:
            row["recovered"] = figures.score(f"recovered-k{k}", kind)
            row["retention_recovered"] = figures.interval(
                lambda m, kind=kind: figures.retention(f"recovered-k{k}", kind, m))
            row["recovered_share"] = figures.interval(lambda m, kind=kind: _share(figures, k, kind, m)) \
                if _above(row["drop"]) else NO_CLEAR_DROP
            row["gain"] = figures.difference(f"recovered-k{k}", f"pruned-k{k}", kind)
        out[kind] = row
    if all(figures.has(kind) for kind in KINDS) and f"recovered-k{k}" in figures.labels:
        out["gap_recovered"] = figures.interval(
            lambda m: figures.retention(f"recovered-k{k}", "classification", m)
            - figures.retention(f"recovered-k{k}", "generative", m))
    out["costs"] = any(_above(out.get(kind, {}).get("drop")) for kind in KINDS)
    return out


def _above(ci: dict[str, Any] | None) -> bool:
    return bool(ci and ci.get("low") is not None and ci["low"] > 0)


def verdicts(study: Any, figures: Figures, points: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """(a) after recovery, classification retention above generative at every k where pruning costs something,
    the gap's interval above 0; (b) the recovered share of the generative drop larger at the smallest k with a clear
    generative drop than at the largest such k, the difference's interval above 0. Said with the numbers either
    way."""
    lines, tests = [], {}
    costly = [p for p in points if p["costs"] and "gap_recovered" in p]
    if costly:
        held = [p["k"] for p in costly if _above(p["gap_recovered"])]
        verdict = "HOLDS" if len(held) == len(costly) else "does NOT hold"
        gaps = "; ".join(f"k={p['k']}: {_ci_pct(p['gap_recovered'])}" for p in costly)
        lines.append(f"(a) After recovery, classification keeps more of its margin above chance than generative "
                     f"reasoning at every k where pruning costs something: {verdict} (gap in chance-normalised "
                     f"retention, classification - generative, 95% paired interval: {gaps}).")
        tests["a"] = {"holds": len(held) == len(costly), "ks": [p["k"] for p in costly], "held_at": held}
    else:
        lines.append("(a) cannot be tested: no k has a drop whose interval is above 0, or a kind was not scored.")
    clear = [p["k"] for p in points if isinstance(p.get("generative", {}).get("recovered_share"), dict)]
    if len(clear) >= 2:
        small, large = clear[0], clear[-1]
        diff = figures.interval(lambda m: _share(figures, small, "generative", m) - _share(figures, large, "generative",
                                                                                        m))
        holds = _above(diff)
        lines.append(f"(b) The recovered share of the generative drop is larger at k={small} than at k={large}: "
                     f"{'HOLDS' if holds else 'does NOT hold'} (shares {_ci_pct(_point_share(points, small))} and "
                     f"{_ci_pct(_point_share(points, large))}; difference {_ci_pct(diff)}).")
        tests["b"] = {"holds": holds, "small": small, "large": large, "difference": diff}
    else:
        lines.append(f"(b) cannot be tested: the generative drop is clear (interval above 0) at {len(clear)} k "
                     f"({', '.join(map(str, clear)) or 'none'}), and two are needed.")
    return lines, tests


def _share(figures: Figures, k: int, kind: str, m: np.ndarray) -> np.ndarray:
    return figures.share_of(f"recovered-k{k}", f"pruned-k{k}", kind, m)


def _point_share(points: list[dict[str, Any]], k: int) -> dict[str, Any]:
    return next(p for p in points if p["k"] == k)["generative"]["recovered_share"]


def _ci_pct(ci: dict[str, Any] | str | None) -> str:
    return ci if isinstance(ci, str) else format_interval(ci, missing="undefined")


def format_table(points: list[dict[str, Any]]) -> str:
    head = ["k", "kind", "original (%)", "pruned (%)", "drop (points)", "recovered (%)", "gain (points)",
            "retention pruned (chance-norm.)", "retention recovered (chance-norm.)", "recovered share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in points:
        for kind in KINDS:
            row = p.get(kind)
            if row is None:
                continue
            cells = [str(p["k"]), kind, _ci_pct(row["baseline"]), _ci_pct(row["pruned"]), _ci_pct(row["drop"]),
                     _ci_pct(row.get("recovered")), _ci_pct(row.get("gain")), _ci_pct(row["retention_pruned"]),
                     _ci_pct(row.get("retention_recovered")), _ci_pct(row.get("recovered_share"))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_retention(points: list[dict[str, Any]], depth: int | None, path: Path) -> None:
    """Chance-normalised retention against the pruning ratio: classification and generative, pruned and recovered,
    with 95% paired intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    styles = {("classification", "pruned"): ("tab:blue", "--o"), ("classification", "recovered"): ("tab:blue", "-o"),
              ("generative", "pruned"): ("tab:red", "--s"), ("generative", "recovered"): ("tab:red", "-s")}
    for (kind, role), (color, style) in styles.items():
        series = [(p["k"], p[kind].get(f"retention_{role}")) for p in points if kind in p]
        series = [(k, ci) for k, ci in series if ci and ci.get("value") is not None]
        if not series:
            continue
        xs = [100 * k / depth if depth else k for k, _ in series]
        ys = [100 * ci["value"] for _, ci in series]
        errors = [[100 * (ci["value"] - (ci["low"] if ci["low"] is not None else ci["value"])) for _, ci in series],
                  [100 * ((ci["high"] if ci["high"] is not None else ci["value"]) - ci["value"]) for _, ci in series]]
        ax.errorbar(xs, ys, yerr=errors, fmt=style, color=color, capsize=3, label=f"{kind}, {role}")
    ax.axhline(100, color="grey", lw=0.6)
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel("blocks dropped (% of depth)" if depth else "blocks dropped")
    ax.set_ylabel("retention above chance (%)")
    ax.set_title("Retention against pruning ratio (95% paired intervals)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_curves(study: Any, root: Path) -> dict[int, dict[str, Any]]:
    """Per k: the held-out loss curve, tokens trained and optimizer steps from its recover report."""
    from layerprune.recover.report import RECOVER_REPORT, read_recover_report

    out = {}
    for k in study.ratios:
        folder = root / f"recovered-k{k}"
        if (folder / RECOVER_REPORT).is_file():
            report = read_recover_report(folder)
            out[k] = {"held_out": report.loss_curve.get("held_out", []), "tokens": report.tokens_seen,
                      "steps": report.data.get("steps"), "seconds": report.seconds.training,
                      "answers": report.data.get("filter", {})}
    return out


def flattening(curve: list[list[float | None]]) -> str:
    """How much the held-out loss still fell over the last quarter of training (relative to its whole fall)."""
    values = [(s, v) for s, v in curve if v is not None]
    if len(values) < 3:
        return "too few held-out points"
    first, last = values[0][1], values[-1][1]
    quarter = [v for s, v in values if s >= 0.75 * values[-1][0]]
    fall = first - last
    late = quarter[0] - last if quarter else 0.0
    share = late / fall if fall > 0 else float("nan")
    return f"{first:.3f} -> {last:.3f}; the last quarter of the steps gave {100 * share:.0f}% of the fall"


def plot_losses(curves: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, info in curves.items():
        points = [(s, v) for s, v in info["held_out"] if v is not None]
        ax.plot([s for s, _ in points], [v for _, v in points], "-o", ms=3, label=f"k={k}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out loss (teacher answers)")
    ax.set_title("Recovery: held-out loss per k")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep_report(study: Any, root: Path) -> Path:
    """sweep.md, sweep.json, sweep.png (retention against k) and sweep_loss.png in the sweep directory."""
    from layerprune.pipeline.sweep import CALIBRATION_FILE, models, ranking

    folders = {m: root / "eval" / m for m in models(study) if (root / "eval" / m / SUMMARY_FILE).is_file()}
    labels, matrices, chance, kinds = load_matrix(folders)
    figures = Figures(labels, matrices, chance, {kind: [t for t in matrices if kinds[t] == kind] for kind in KINDS})
    points = [point(study, figures, k) for k in study.ratios if f"pruned-k{k}" in labels]
    lines, tests = verdicts(study, figures, points)
    depth = _depth(root)
    plot_retention(points, depth, root / "sweep.png")
    curves = loss_curves(study, root)
    plot_losses(curves, root / "sweep_loss.png")
    calibration = json.loads((root / CALIBRATION_FILE).read_text())
    items = {t: int(m.shape[1]) for t, m in matrices.items()}
    unpaired = {t: why for t, why in kinds.items() if why.startswith("unpaired")}
    (root / "sweep.json").write_text(json.dumps(paired_json({"points": points, "verdicts": tests, "items": items,
                                                             "unpaired": unpaired, "curves": curves,
                                                             "calibration": calibration, "ranking": ranking(
                                                                 root, study.ratios)}), indent=1))
    text = [f"# Pruning-ratio sweep: {study.name}", "", study.description, "", *[f"- {v}" for v in lines], "",
            "![retention against pruning ratio](sweep.png)", "", format_table(points), "",
            *_method_lines(study, root, figures, items, calibration, curves, unpaired, depth), "",
            "![held-out loss per k](sweep_loss.png)", "",
            f"Rerun: `layerprune study {study.name} --output {root}` (complete stages are skipped)."]
    (root / "sweep.md").write_text("\n".join(text) + "\n")
    return root / "sweep.md"


def _depth(root: Path) -> int | None:
    from layerprune.prune.report import read_prune_report

    return read_prune_report(root / "scored").num_blocks_before


def _method_lines(study: Any, root: Path, figures: Figures, items: dict[str, int], calibration: dict[str, Any],
                  curves: dict[int, dict[str, Any]], unpaired: dict[str, str], depth: int | None) -> list[str]:
    from layerprune.pipeline.sweep import ranking

    cuts = ranking(root, study.ratios)
    kept = ", ".join(f"{t} ({100 * r['score']:.0f}%)" for t, r in calibration["levels"].items() if r["kept"])
    left = ", ".join(f"{t} ({r['why']})" for t, r in calibration["levels"].items() if not r["kept"])
    groups = {kind: [figures.tasks[i] for i in idx] for kind, idx in figures.groups.items()}
    groups = {kind: groups.get(kind, []) for kind in KINDS}
    lines = [f"Blocks dropped at each k (one {study.prune.score} ranking, original numbering, of {depth}): "
             + "; ".join(f"k={k}: {v}" for k, v in cuts.items()) + ".",
             f"Items per task (the same for every model): {', '.join(f'{t} {n}' for t, n in items.items())}. "
             f"Classification: {', '.join(groups['classification']) or 'none'} (chance "
             f"{100 * figures.chance['classification']:.0f}%); generative: "
             f"{', '.join(groups['generative']) or 'none'} (chance 0).",
             f"probes-calibrated (calibration stream, {calibration['settings']['items']} items a level, kept "
             f"{100 * calibration['settings']['low']:.0f}-{100 * calibration['settings']['high']:.0f}%, at most "
             f"{calibration['settings']['per_family']} a family): kept {kept or 'none'}; left out {left or 'none'}.",
             "Every scored skill is unseen by the recovery data: the teacher answered generic instructions "
             f"({study.shared_recipe('<pruned>').prompts.source}), no probe, GSM8K or classification prompt.",
             "Recovery budget per k: " + "; ".join(
                 f"k={k}: {c['tokens']} tokens, {c['steps']} steps, {c['seconds']:.0f} s, held-out loss "
                 f"{flattening(c['held_out'])}" for k, c in curves.items()) + ".",
             f"Intervals: 95% percentile intervals of one clustered paired bootstrap ({figures.boot.resamples} "
             f"resamples, seed {figures.boot.seed}; items drawn within each task, the same draw for every model). "
             "Retention is chance-normalised, (model - chance) / (original - chance); the recovered share is "
             "(recovered - pruned) / (original - pruned), undefined on resamples without a drop."]
    if unpaired:
        lines.append("Left out (could not be paired): " + "; ".join(f"{t}: {w}" for t, w in unpaired.items()))
    return lines


def paired_json(value: Any) -> Any:
    """JSON-safe: numpy numbers as floats, NaN as null, int keys as strings."""
    if isinstance(value, dict):
        return {str(k): paired_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [paired_json(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if not np.isfinite(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value
