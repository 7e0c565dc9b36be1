"""sweep.md of a pruning-ratio sweep: retention against k for classification and generative reasoning, pruned and
recovered, with paired intervals; a table, the loss curves, and verdicts computed from the intervals. The figures and
verdicts are sweep_points.py's, their tables sweep_text.py's, the curves sweep_curves.py's; here they are computed over
the sweep's scored models and put together, with the method lines and the records kept.

One clustered paired bootstrap (items drawn within each task, the same draw for every model) gives every figure its
interval; with arms every figure is given per arm and every pair of arms is compared at every k (sweep_points.py).
The recipe's declared comparisons (`comparisons`, pipeline/studies/comparisons.py) are drawn family by family, each
contrast with its paired interval and its Holm interval over exactly its family; a declared confirmatory family
replaces the every-pair family above, an exploratory one (declared after the results were read) is said so, beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerprune.core.outputs import write_atomic
from layerprune.pipeline.paired_table import Figures
from layerprune.pipeline.studies.comparisons import (
    draw_families,
    format_families,
    uses_default_family,
)
from layerprune.pipeline.studies.figures import (
    KINDS,
    SPLIT,
    evaluated,
    items_of,
    paired_json,
    records,
    records_line,
    study_figures,
    unpaired,
)
from layerprune.pipeline.studies.sweep_curves import budget_text, curve_name, loss_curves, plot_losses, plot_retention
from layerprune.pipeline.studies.sweep_grid import recovered_label
from layerprune.pipeline.studies.sweep_points import comparisons, control_point, point, verdicts
from layerprune.pipeline.studies.sweep_text import format_comparisons, format_control, format_spread, format_table
from layerprune.recover.lr_search import lr_lines


def write_sweep_report(study: Any, root: Path, curves: dict[int | str, dict[str, Any]] | None = None) -> Path:
    """sweep.md, sweep.json, sweep.png (retention against k) and sweep_loss.png in the sweep directory. `curves`: the
    held-out loss curves where the recover reports cannot give them (a records archive's, whose reports are scrubbed);
    else read from them."""
    from layerprune.pipeline.audit_report import audit_section
    from layerprune.pipeline.studies.cells import CALIBRATION_FILE
    from layerprune.pipeline.studies.sweep_grid import arm_names
    from layerprune.pipeline.studies.sweep_inputs import ranking, trained_tasks

    folders = evaluated(study, root)
    trained = trained_tasks(study, root)
    figures, kinds = study_figures(folders, trained=trained)
    arms = arm_names(study)
    points, controls, pairs = arm_figures(study, figures)
    declared = draw_families(study.comparisons, figures, recovered_label)
    judged = {arm: verdicts(study, figures, [p for p in points if p.get("arm") == arm], arm) for arm in arms}
    depth = _depth(study, root)
    plot_retention(points, depth, root / "sweep.png")
    curves = loss_curves(study, root) if curves is None else curves
    plot_losses(curves, root / "sweep_loss.png")
    gate = root / CALIBRATION_FILE
    calibration = json.loads(gate.read_text()) if study.probes is not None and gate.is_file() else None
    items, left = items_of(figures), unpaired(kinds)
    kept = records(root, folders)
    chat, chat_text = chat_figures(study, root, [t for t, kind in kinds.items() if kind == "generative"], trained)
    one = study.arms is None
    write_atomic(root / "sweep.json", json.dumps(paired_json({
        "points": points, "control": controls[None] if one else controls, "replicates": study.replicates,
        "verdicts": judged[None][1] if one else {arm: tests for arm, (_, tests) in judged.items()}, "items": items,
        "unpaired": left, "curves": curves, "calibration": calibration,
        "ranking": ranking(root, study.ratios, study.prune.layers),
        "records": kept, **({"chat": chat} if chat else {}),
        **({} if one else {"arms": {arm: study.arm_recipe(arm, "<pruned>").chain_name() for arm in study.arms},
                           "comparisons": pairs}),
        **({"declared_comparisons": declared} if declared else {})}), indent=1))
    verdict_lines = [f"- {'' if arm is None else f'{arm}: '}{v}" for arm, (lines, _) in judged.items() for v in lines]
    title = "Pruning-ratio sweep" if len(study.ratios) > 1 else f"Recovery at one cut (k = {study.ratios[0]})"
    text = [f"# {title}: {study.name}", "", study.description, "", *verdict_lines, "",
            "![retention against pruning ratio](sweep.png)", "", *table_lines(study, points),
            *_recovery_sections(study, points, controls, pairs, declared), *(chat_text + [""] if chat_text else []),
            *_method_lines(study, root, figures, items, calibration, curves, left, depth), "",
            records_line(kept), "",
            "![held-out loss per k](sweep_loss.png)", *audit_section(root), "",
            f"Rerun: `layerprune study {study.name} --output {root}` (complete stages are skipped)."]
    write_atomic(root / "sweep.md", "\n".join(text) + "\n")
    return root / "sweep.md"


def _recovery_sections(study: Any, points: list[dict[str, Any]], controls: dict[str | None, dict[str, Any] | None],
                       pairs: list[dict[str, Any]], declared: dict[str, dict[str, Any]] | None = None) -> list[str]:
    """The k = 0 control(s), the run-to-run spread, with arms the arms compared pairwise at every k (unless the recipe
    declares a confirmatory family), and the recipe's declared comparisons, family by family."""
    from layerprune.pipeline.studies.sweep_grid import arm_names, has_control

    chains = {arm: study.arm_recipe(arm, "<pruned>").chain_name() for arm in arm_names(study)}
    text = [line for arm in chains for line in (
        format_control(controls[arm], chains[arm], study.controls and not has_control(study, arm), arm), "")] \
        if study.controls or study.arms is None else [format_control(None, "", False), ""]
    text += [f"Run-to-run spread ({study.replicates} replicate(s) of every recovery, seeds settings.seed + r):", "",
             format_spread(points, controls[None]) if study.arms is None else
             format_spread(points, None, {arm: c for arm, c in controls.items() if arm is not None}), ""]
    default = study.arms and uses_default_family(study.comparisons)
    return text + ([*format_comparisons(pairs, study.replicates), ""] if default else []) \
        + format_families(declared or {}, study.replicates)


def table_lines(study: Any, points: list[dict[str, Any]]) -> list[str]:
    """The points' table and, where an arm trains to budgets of its own (arm_budgets), which budget its rows are
    at: a row of a 32k arm beside rows of 256k ones is not a comparison between the arms."""
    own = {arm: study.budgets_of(arm)[-1] for arm in study.arms or []
           if not ends_with_the_others(study, arm) and any(p.get("arm") == arm for p in points)}
    if not own:
        return [format_table(points), ""]
    return [format_table(points), "", "Rows at a budget of their own (arm_budgets): " + "; ".join(
        f"{arm} at {b:,}" for arm, b in own.items()) + f" target tokens, the other arms' at {study.budgets[-1]:,}. "
        "They are left out of the arms compared here; budget.md compares each pair at the largest budget both "
        "have.", ""]


def arm_figures(study: Any, figures: Figures) -> tuple[list[dict[str, Any]], dict[str | None, dict[str, Any] | None],
                                                     list[dict[str, Any]]]:
    """Every k's point per arm, each arm's k = 0 control and, with arms, the arms compared pairwise (today's family:
    drawn unless the recipe declares a confirmatory family of its own)."""
    from layerprune.pipeline.studies.sweep_grid import arm_names

    arms = arm_names(study)
    points = [point(study, figures, k, arm) for k in study.ratios if f"pruned-k{k}" in figures.labels for arm in arms]
    controls = {arm: control_point(figures, arm) for arm in arms}
    default = study.arms and uses_default_family(study.comparisons)
    same = [arm for arm in study.arms or [] if ends_with_the_others(study, arm)]  # one ending at a budget of its own:
    return points, controls, comparisons(figures, points, same) if default else []  # compared in budget.md


def own_prompts(study: Any) -> dict[str, str]:
    """The arms whose teacher answered prompts of their own (arm_prompts), with their source."""
    shared = study.shared_recipe("<pruned>").prompts.source
    return {arm: source for arm in study.arms or [] if (source := study.arm_recipe(arm, "<pruned>").prompts.source)
            != shared}


def ends_with_the_others(study: Any, arm: str) -> bool:
    """Whether an arm's models end at the study's largest budget (arm_budgets may skip budgets below it)."""
    return not study.budgets or study.budgets_of(arm)[-1] == study.budgets[-1]


def chat_figures(study: Any, root: Path, plain_generative: list[str],
                 trained: frozenset[str] = frozenset()) -> tuple[dict[str, Any] | None, list[str]]:
    """The probe levels scored through the chat template (eval-chat/<model>), as the plain figures are: per arm and
    k the scores, drop, retention and recovered share, the controls, the spread and the arms compared; (None, [])
    where the recovery data is plain, (None, a line) where nothing was scored that way. `plain_generative`: the
    generative tasks of the plain figures (GSM8K among them where it passed its gate); `trained`: the tasks the
    recovery data trained (`sweep_inputs.trained_tasks`)."""
    from layerprune.pipeline.studies.sweep_grid import both_formats

    if not both_formats(study):
        return None, []
    folders = evaluated(study, root, "eval-chat")
    if "baseline" not in folders:
        return None, ["Probes through the chat template: not scored (the gate kept no probe level, or the eval-chat "
                      "stages have not run)."]
    figures, _ = study_figures(folders, trained=trained)
    probes = figures.tasks
    plain_more = bool(set(plain_generative) - set(probes))
    points, controls, pairs = arm_figures(study, figures)
    declared = draw_families(study.comparisons, figures, recovered_label)
    data = {"points": points, "control": controls[None] if study.arms is None else controls, "comparisons": pairs,
            "records": records(root, folders), **({"declared_comparisons": declared} if declared else {})}
    plain = [arm for arm in study.arms or [] if not study.arm_recipe(arm, "<pruned>").generate.chat_template]
    text = ["## Probes through the chat template", "",
            "The recovery data is chat-formatted, so every model's kept probe levels (" + ", ".join(probes) + ") were "
            "also scored through the chat template, on the same items (eval-chat/<model>); the figures as above for "
            "those levels" + (" (the plain generative figures above also hold GSM8K, which is scored through the "
                              "chat template either way, so compare the probe levels' own rows in eval/)"
                              if plain_more else "") + ". Where the plain and chat figures part, the recovery moved "
            "the model's format as well as its skill" + (f" (arm{'s' * (len(plain) > 1)} {', '.join(plain)} trained "
                                                         "on plain text instead: for those, the chat rows are the "
                                                         "format they did not train on)" if plain else "") + ".", "",
            *table_lines(study, points), *_recovery_sections(study, points, controls, pairs, declared)]
    return data, text


def _depth(study: Any, root: Path) -> int | None:
    """The original's block count, from the scoring pass's report (a given cut's: its pruned model's)."""
    from layerprune.prune.report import read_prune_report

    return read_prune_report(root / ("scored" if not study.prune.layers else f"pruned-k{study.ratios[0]}")) \
        .num_blocks_before


def gate_line(study: Any, calibration: dict[str, Any] | None) -> str:
    """What the probe gate kept and left out (or that there is none), and the fixed tasks scored beside it."""
    fixed = (f" Fixed tasks, scored on every model whatever the gates keep (never gated): {', '.join(study.fixed)}."
             if getattr(study, "fixed", None) else "")
    if calibration is None:
        return "No probe gate (probes: null): the probe tasks scored are the fixed ones." + fixed
    kept = ", ".join(f"{t} ({100 * r['score']:.0f}%)" for t, r in calibration["levels"].items() if r["kept"])
    left = ", ".join(f"{t} ({r['why']})" for t, r in calibration["levels"].items() if not r["kept"])
    return (f"probes-calibrated (calibration stream, {calibration['settings']['items']} items a level, kept "
            f"{100 * calibration['settings']['low']:.0f}-{100 * calibration['settings']['high']:.0f}%, at most "
            f"{calibration['settings']['per_family']} a family): kept {kept or 'none'}; left out {left or 'none'}."
            + fixed)


def _method_lines(study: Any, root: Path, figures: Figures, items: dict[str, int],
                  calibration: dict[str, Any] | None, curves: dict[int | str, dict[str, Any]],
                  unpaired: dict[str, str], depth: int | None) -> list[str]:
    from layerprune.pipeline.studies.sweep_inputs import ranking

    cuts = ranking(root, study.ratios, study.prune.layers)
    groups = {kind: [figures.tasks[i] for i in idx] for kind, idx in figures.groups.items()}
    groups = {kind: groups.get(kind, []) for kind in KINDS}
    how = "the cut given, prune.layers" if study.prune.layers else f"one {study.prune.score} ranking"
    lines = [f"Blocks dropped at each k ({how}, original numbering, of {depth}): "
             + "; ".join(f"k={k}: {v}" for k, v in cuts.items()) + ".",
             f"Items per task (the same for every model): {', '.join(f'{t} {n}' for t, n in items.items())}. "
             f"Classification: {', '.join(groups['classification']) or 'none'} (chance "
             f"{100 * figures.chance['classification']:.0f}%); generative: "
             f"{', '.join(groups['generative']) or 'none'} (chance 0).",
             gate_line(study, calibration), *_split_line(figures),
             f"The teacher answered generic instructions ({study.shared_recipe('<pruned>').prompts.source})"
             + "".join(f"; arm {arm} its own prompts ({source})" for arm, source in own_prompts(study).items())
             + "; how far each scored skill is held out from them is measured, not assumed (Held out, measured, "
             "below).",
             f"Recovery budget per k{' and arm' if study.arms else ''} (replicate 0): " + "; ".join(
                 f"{curve_name(k)}: {budget_text(c)}" for k, c in curves.items()) + ".",
             *lr_lines(root, list(study.lr_grid), "every k, replicate and control of the arm trained at it (the "
                       "search's own runs are not scored)"),
             f"Intervals: 95% percentile intervals of one clustered paired bootstrap ({figures.boot.resamples} "
             f"resamples, seed {figures.boot.seed}; items drawn within each task, the same draw for every model)"
             + (f"; a recovered point is the mean of its {study.replicates} replicates, its interval two-level "
                "(runs drawn, then items), so it holds the run-to-run variance" if study.replicates > 1 else
                "; one replicate per recovery: the intervals hold item sampling only, run-to-run variance is not "
                "measured") + ". "
             "Retention is chance-normalised, (model - chance) / (original - chance); the recovered share is "
             "(recovered - pruned) / (original - pruned), net of the control (recovered - pruned - (control - "
             "original)) / (original - pruned); a share is undefined on resamples without a drop, and the fraction "
             "of such resamples is printed beside it."]
    if unpaired:
        lines.append("Left out (could not be paired): " + "; ".join(f"{t}: {w}" for t, w in unpaired.items()))
    return lines


def _split_line(figures: Figures) -> list[str]:
    """Which generative tasks the recovery data trained (their own prompts in it) and which it did not, where the
    report splits them."""
    if not figures.has("trained"):
        return []
    named = {g: ", ".join(figures.tasks[i] for i in figures.groups[g]) or "none" for g in SPLIT}
    return [f"Trained skills (their own prompts in the recovery data, task by task): {named['trained']}; unseen "
            f"(every other generative task): {named['unseen']}. The rows 'trained' and 'unseen' give each group's "
            "figures beside the generative ones."]
