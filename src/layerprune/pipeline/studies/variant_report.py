"""The variant study's report: each variant (or each seed's make) against the original, paper A's verdict from paired
differences of agreement ratios against the split-half ceiling and the control (core/paired.py), and variant.md /
variant.json, drawn from the importance reports a study keeps (`redraw_variant_report` redraws an archive)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from layerprune.core.outputs import write_atomic
from layerprune.core.paired import format_bounded, format_estimate
from layerprune.pipeline.studies.variant_grid import VariantStudy
from layerprune.pipeline.studies.variant_seeds import agreement_row, seeds_lines

if TYPE_CHECKING:
    import numpy as np

    from layerprune.core.paired import Score

log = logging.getLogger(__name__)


def compare(study: VariantStudy, report: dict[str, Any], seed: int, control: tuple[int, dict[str, Any]] | None = None,
            seeds: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per task: the agreement of the original's and the variant's profiles, with intervals; the agreement as a
    fraction of the split-half ceiling, the control's the same way (on the blocks it kept), and the verdict.
    `seeds`: with the variant made under two or more seeds, every seed's importance report by seed (`report` is the
    first's): the variant is then the seeds' mean, see `compare_seeds`."""
    from layerprune.analyze.agreement import per_item, score_shift

    if seeds is not None and len(seeds) > 1:
        return compare_seeds(study, seeds, seed, control)
    kind = "probability" if report["config"]["metric"] == "nll" else "mean"
    threshold = report["config"]["threshold"]
    target = study.target_task(list(report["tasks"]))
    first, second = (per_item(r, kind) for r in report["tasks"][target].values())
    shift = {"task": target, **score_shift(first, second, kind, study.resamples, study.alpha, seed)} \
        if study.target else None
    out = {}
    for task, per_model in report["tasks"].items():
        original, variant = per_model.values()
        row, draws = pair_row(study, original, variant, kind, threshold, seed)
        against = control_row(study, row, original, control, task, kind, threshold, seed)
        undefined = [f"{role}: {r['undefined']}" for role, r in (("original", original), ("variant", variant))
                     if r.get("undefined")]
        out[task] = judged(study, row, draws, against, shift, undefined)
    return {"target": shift, "control_block": control[0] if control else None, "tasks": out}


def pair_row(study: VariantStudy, original: dict[str, Any], variant: dict[str, Any], kind: Score, threshold: float,
             seed: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """One original-variant pair on one task: full scores, agreement with intervals, the agreement against its
    ceiling (`relative`), and the ceiling ratio's resampled draws per measure."""
    from layerprune.analyze.agreement import per_item, profile_agreement, relative_agreement_draws

    relative, draws = relative_agreement_draws(per_item(original, kind), per_item(variant, kind), kind, threshold,
                                               study.splits, study.resamples, study.alpha, seed)
    row = {"base_scores": [original["base_score"], variant["base_score"]],
           **profile_agreement(original, variant, kind, threshold, study.resamples, study.alpha, seed),
           "relative": relative, "control": None}
    return row, draws


def control_row(study: VariantStudy, row: dict[str, Any], original: dict[str, Any],
                control: tuple[int, dict[str, Any]] | None, task: str, kind: Score, threshold: float,
                seed: int) -> Against:
    """The control's agreement with the original on the blocks it kept, set as row["control"]; its ratio's resampled
    draws per measure and why it has no drops (None, None without a control)."""
    import numpy as np

    from layerprune.analyze.agreement import per_item, relative_agreement_draws

    if control is None:
        return None, None
    block, scored = control
    a = per_item(original, kind)
    kept = (a[0], np.delete(a[1], block, axis=0), a[2])
    result = next(iter(scored["tasks"][task].values()))
    row["control"], draws = relative_agreement_draws(kept, per_item(result, kind), kind, threshold, study.splits,
                                                     study.resamples, study.alpha, seed)
    return draws, result.get("undefined")


def judged(study: VariantStudy, row: dict[str, Any], draws: dict[str, np.ndarray], against: Against,
           shift: dict[str, Any] | None, undefined: list[str]) -> dict[str, Any]:
    """The row with its ratio comparisons (against the ceiling and, paired, the control) and its verdict."""
    from layerprune.core.paired import MEASURES_A, invariance_verdict, ratio_comparison

    control_draws, dead = against
    controls = {} if control_draws is None else \
        {m: (row["control"][m]["ratio"], control_draws[m]) for m in MEASURES_A}
    row["comparison"] = {m: ratio_comparison(row["relative"][m]["ratio"], draws[m], controls.get(m), study.alpha)
                         for m in MEASURES_A}
    row["verdict"] = invariance_verdict(shift, row["comparison"], control_draws is not None, study.min_shift,
                                        study.bar, undefined, dead)
    row["control_undefined"] = dead
    return row


def compare_seeds(study: VariantStudy, reports: dict[int, dict[str, Any]], seed: int,
                  control: tuple[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """`compare` with the variant made under several seeds, one logical model: each seed's pair as `compare` makes
    it (`seeds`, all on the same halves and item resamples), the make-to-make spread of the variant's full scores
    (`spread`), and the verdict's quantities for the seeds' mean with two-level intervals (the seeds drawn, then the
    items: `pooled_relative`), so the verdict rests on the variant's training variance too. The original and the
    control are the first seed's report's: the same model on the same items in every report."""
    from layerprune.pipeline.studies.variant_seeds import pooled_relative, score_spread

    first = reports[study.variant_seeds[0]]
    kind = "probability" if first["config"]["metric"] == "nll" else "mean"
    threshold = first["config"]["threshold"]
    target = study.target_task(list(first["tasks"]))
    shift = pooled_shift(study, target, reports, kind, seed) if study.target else None
    out = {}
    for task in first["tasks"]:
        original = _pair(first, task)[0]
        variants = {s: _pair(reports[s], task)[1] for s in study.variant_seeds}
        rows = {s: pair_row(study, original, v, kind, threshold, seed) for s, v in variants.items()}
        relative, draws = pooled_relative({s: r[0]["relative"] for s, r in rows.items()},
                                          {s: r[1] for s, r in rows.items()}, seed, study.alpha)
        spread = score_spread({s: v["base_score"] for s, v in variants.items()})
        row = {"base_scores": [original["base_score"], spread["mean"]], "spread": spread,
               "seeds": {str(s): r[0] for s, r in rows.items()}, "relative": relative, "control": None}
        against = control_row(study, row, original, control, task, kind, threshold, seed)
        undefined = [f"{role}: {r['undefined']}" for role, r in (("original", original), *(
            (f"variant (seed {s})", v) for s, v in variants.items())) if r.get("undefined")]
        out[task] = judged(study, row, draws, against, shift, undefined)
    return {"target": shift, "control_block": control[0] if control else None, "tasks": out,
            "variant_seeds": list(study.variant_seeds)}


def _pair(report: dict[str, Any], task: str) -> tuple[dict[str, Any], dict[str, Any]]:
    original, variant = report["tasks"][task].values()
    return original, variant


def pooled_shift(study: VariantStudy, task: str, reports: dict[int, dict[str, Any]], kind: Score,
                 seed: int) -> dict[str, Any]:
    """The target's full-score shift of the seeds' mean variant over the original (each seed's shift on the same
    item resamples; the interval two-level, seeds then items), with each seed's own shift."""
    import numpy as np

    from layerprune.analyze.agreement import interval, per_item, score_shift_draws
    from layerprune.core.paired import pool_replicate_draws

    original = per_item(_pair(reports[study.variant_seeds[0]], task)[0], kind)
    made = {s: score_shift_draws(original, per_item(_pair(reports[s], task)[1], kind), kind, study.resamples,
                                 study.alpha, seed) for s in study.variant_seeds}
    value, draws = pool_replicate_draws([m[0]["shift"] for m in made.values()], [m[1] for m in made.values()], seed,
                                        study.alpha)
    return {"task": task, "before": made[study.variant_seeds[0]][0]["before"],
            "after": float(np.mean([m[0]["after"] for m in made.values()])), "shift": value,
            "interval": interval(draws.tolist(), study.alpha), "seeds": {str(s): m[0] for s, m in made.items()}}


def write_variant_report(study: VariantStudy, root: Path, variant: Path, result: dict[str, Any],
                         variants: dict[int, Path] | None = None) -> None:
    """variant.json (the study, the variant's folder, with several seeds every seed's, and the comparison) and
    variant.md."""
    from layerprune.analyze.records import write_json

    dirs = {"variant_dirs": {str(s): str(p) for s, p in variants.items()}} if variants else {}
    write_json(root / "variant.json", {"study": study.record(), "variant_dir": str(variant), **dirs, **result})
    write_atomic(root / "variant.md", variant_table(study, result))


def redraw_variant_report(root: Path) -> None:
    """variant.json and variant.md drawn again from a study's records under today's statistics: its importance
    reports (every seed's), the control's, the NMI and the variants' folders as variant.json keeps them."""
    import json

    old = json.loads((root / "variant.json").read_text())
    study = VariantStudy.model_validate(old["study"])
    report = json.loads((root / "importance" / "importance.json").read_text())
    block = old.get("control_block")
    control = None if block is None else (block, json.loads(
        (root / f"importance-control-b{block}" / "importance.json").read_text()))
    result = compare(study, report, report["run"]["settings"]["seed"], control, seed_reports(study, root))
    variants = {int(s): Path(p) for s, p in old["variant_dirs"].items()} if "variant_dirs" in old else None
    write_variant_report(study, root, Path(old["variant_dir"]), {**result, "nmi": old.get("nmi")}, variants)


def _ratio(relative: dict[str, Any] | None, measure: str) -> str:
    if relative is None:
        return "-"
    row = relative[measure]
    return (f"{format_estimate(row['agreement'])} / {format_estimate(row['ceiling'])} = "
            f"{format_bounded(row['ratio'], row['ratio_interval'])}")


def variant_table(study: VariantStudy, result: dict[str, Any]) -> str:
    tasks = result["tasks"]
    level = f"{1 - study.alpha:.0%}"
    lines = [f"# Variant study: {study.name}", "", *([study.description, ""] if study.description else []),
             f"Original `{study.model}` vs its variant. Drops per block from importance/ (heatmap: "
             f"importance/heatmap.png). Intervals: {level} paired bootstrap over the items ({study.resamples} "
             "resamples); a resample's critical set is the blocks above the threshold. A resample is noisier than the "
             "items, so an agreement's resamples lie to one side of it: where the estimate lies outside the central "
             f"{level} of its resamples, or over {study.alpha:.0%} of them are undefined, no interval is given ([n/a]: "
             "the bootstrap cannot bound it). The split-half ratios' resamples share their items across the splits; "
             "their coverage, measured on profiles of known agreement: bench/bench_agreement_coverage.py.", "",
             "| task | full score (original / variant) | Spearman of drops | Jaccard of critical sets | "
             "critical (original) | critical (variant) |", "|---|---|---|---|---|---|"]
    if "variant_seeds" in result:  # several makes of the variant: a row per make, then the makes side by side
        lines += [agreement_row(f"{task} (seed {s})", pair) for task, row in tasks.items()
                  for s, pair in row["seeds"].items()] + seeds_lines(result, level)
    else:
        lines += [agreement_row(task, row) for task, row in tasks.items()]
    return "\n".join(lines + verdict_lines(study, result) + nmi_lines(study, result.get("nmi"))) + "\n"


def verdict_lines(study: VariantStudy, result: dict[str, Any]) -> list[str]:
    shift, block = result["target"], result["control_block"]
    lines = ["", "## Verdict", "",
             f"Agreement against its ceiling, like for like at half the items: on {study.splits} random halvings, "
             "one model's profile on one half against the other's on the other half (agreement), over the geometric "
             "mean of each model's agreement with itself across the halves (ceiling, the split-half reliability; no "
             f"Spearman-Brown step-up, both are at half the items); {1 - study.alpha:.0%} interval: each half "
             "resampled within itself. The ratio is compared with the ceiling (ratio - 1) and with the positive "
             "control's ratio on the same resamples (ratio - control, paired), each with its interval; "
             f"{study.bar:g} of the ceiling is the margin. 'different': on a measure, the interval of ratio - 1 lies "
             f"wholly below {study.bar - 1:+.2f} (the ratio's below {study.bar:g}). 'invariant': on a measure it lies "
             f"wholly at or above {study.bar - 1:+.2f}, ratio - control lies above 0 (the comparison can fail), and "
             f"the target score moved by >= {100 * study.min_shift:g} points up with its interval above 0. Else "
             "'not shown' (an interval that reaches across the margin decides nothing).", ""]
    seeds = result.get("variant_seeds")
    if seeds:
        lines[-2] += (f" The variant is the mean of its {len(seeds)} makes (seeds {', '.join(map(str, seeds))}): "
                      "its ratio, target score and shift are the makes' means, and every interval of them draws the "
                      "makes, then the items (see the section above).")
    if shift is None:
        lines.append("Target: none named (the recipe's `target`), so no verdict can be 'invariant'.")
    else:
        lines.append(f"Target {shift['task']}: {format_estimate(shift['before'])} -> "
                     f"{format_estimate(shift['after'])}, shift {format_estimate(shift['shift'], shift['interval'])} "
                     "(paired, unablated models"
                     + ("; the makes' mean, seeds then items)." if seeds else ")."))
    dead = [task for task, row in result["tasks"].items() if row.get("control_undefined")]
    lines.append("Control: none." if block is None else
                 f"Control: the original with block {block} dropped (control-b{block}/), compared with the original on "
                 "the other blocks." + (f" It is below the analysis's floor on {len(dead)} of {len(result['tasks'])} "
                                        "tasks (a collapsed model, with no drops there): its ratios on those show "
                                        "nothing, and no verdict rests on them." if dead else ""))
    lines += ["", "| task | Spearman: agreement / ceiling = ratio | Jaccard: agreement / ceiling = ratio | "
              "control Spearman | control Jaccard | ratio - 1 (Spearman / Jaccard) | ratio - control (Spearman / "
              "Jaccard) | verdict |", "|---|---|---|---|---|---|---|---|"]
    for task, row in result["tasks"].items():
        verdict = row["verdict"]
        why = f" ({'; '.join(verdict['reasons'])})" if verdict["reasons"] else ""
        lines.append(f"| {task} | {_ratio(row['relative'], 'spearman')} | {_ratio(row['relative'], 'jaccard')} | "
                     f"{_ratio(row['control'], 'spearman')} | {_ratio(row['control'], 'jaccard')} | "
                     f"{_against(row, 'vs_ceiling')} | {_against(row, 'vs_control')} | **{verdict['verdict']}**{why} |")
    return lines


def _against(row: dict[str, Any], key: str) -> str:
    """'-0.22 [-0.35, -0.08] / +0.01 [-0.10, 0.12]': a paired difference of ratios per measure, with its interval."""
    cells = []
    for measure in ("spearman", "jaccard"):
        ci = (row.get("comparison") or {}).get(measure, {}).get(key)
        cells.append("-" if not ci or ci.get("value") is None else f"{ci['value']:+.2f}" + (
            " [n/a]" if ci.get("low") is None else f" [{ci['low']:+.2f}, {ci['high']:+.2f}]"))
    return " / ".join(cells)


def seed_reports(study: VariantStudy, root: Path) -> dict[int, dict[str, Any]] | None:
    """Every variant seed's importance report as the study's folder keeps it, by seed; None with one seed (the
    report is importance/'s alone). For redrawing a study's report from its records."""
    import json

    if not study.replicated():
        return None
    return {s: json.loads((root / study.importance_dir(s) / "importance.json").read_text())
            for s in study.variant_seeds}


def nmi_lines(study: VariantStudy, scored: dict[str, dict[str, Any]] | None) -> list[str]:
    """Paper A's NMI near the critical blocks, per model: where the representation drifts most, and how far that is
    from the blocks the target task needs."""
    if not scored:
        return []
    first = next(iter(scored.values()))
    lines = ["", "## NMI near the critical blocks", "",
             f"`analyze nmi` on {first['config']['calib']} ({first['tokens']} tokens, k = {first['config']['k']}): "
             "NMI of each block's token clusters with the embedding layer's; the elbow is the largest one-block drop "
             f"after block 0, critical blocks are each model's on {first['config']['critical_task']} from importance/ "
             "(nmi-original/, nmi-variant/ hold the curves).", "",
             "| model | critical blocks | elbow block | elbow NMI drop | clustering noise | "
             "elbow to nearest critical | NMI after the last block |", "|---|---|---|---|---|---|---|"]
    for role, r in scored.items():
        lines.append(f"| {role} ({r['model']['label']}) | {r['critical']} | {r['elbow_block']} | "
                     f"{format_estimate(r['elbow_nmi_drop'])} | {format_estimate(r['clustering_noise'])} | "
                     f"{r['elbow_distance_to_critical']} blocks | {format_estimate(r['nmi'][-1])} |")
    return lines


# the control's ratio draws per measure, and why it has no drops
Against: TypeAlias = "tuple[dict[str, np.ndarray] | None, str | None]"
