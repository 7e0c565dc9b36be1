"""study.md of a recovery study: one row per method, each number with its standard error, and a chart.

Per model: the probe average (the algorithmic probes), GSM8K, and the classification average, each a mean of
headline metrics with the standard error of that mean (tasks independent: sqrt(sum se^2) / k). Retention is the
model's value over the original's. The recovered share of the generative drop is (arm - pruned) / (original -
pruned) on the probe average, and 'n/a (no clear drop)' when the drop is within two standard errors of zero.

Each arm is reported twice more: on the trained skills (probe tasks whose own prompts were in the recovery data) and
on the unseen ones (every other probe task; GSM8K and classification are marked too). The split is by task, not by
family: prompts of brackets_d6 do not make brackets_d5 a trained skill, since its items are other questions of
another depth.

With a probe gate, study.md lists every candidate level with its family (arithmetic, brackets, or retrieval: copy
and the list families), its calibration score, interval and why it was kept or left out. Where the probes are scored
in both formats (chat-formatted recovery data), the probe figures are given for each format, labelled.

Arms are set against each other only in the comparisons (issue 56): the recipe's declared families (`comparisons:`,
pipeline/studies/comparisons.py), each contrast with its paired interval (two-level over runs and items with
replicates) and its Holm interval over exactly its family; where none is confirmatory, the default family, every pair
of arms on every measure (`default_family`). Two arms are said to differ only where that Holm interval of their paired
difference excludes 0. Models whose per-item records hold different items are refused, not paired on a subset.
"""

from __future__ import annotations

import json
import math
from itertools import combinations
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core import paired
from layerprune.core.paired import format_interval
from layerprune.evaluate.summary import SUMMARY_FILE, read_summary
from layerprune.pipeline.studies.cells import CHAT_EVAL
from layerprune.pipeline.studies.comparisons import (
    NO_ARMS,
    ComparisonFamily,
    Contrast,
    check_scored_items,
    draw_families,
    format_families,
    uses_default_family,
)
from layerprune.pipeline.studies.lr_search import lr_lines
from layerprune.pipeline.studies.recovery_grid import CONTROL, NO_CONTROL, calibration_file
from layerprune.tasks.probes import distinct_items, family_label, probe_tasks

if TYPE_CHECKING:
    from layerprune.pipeline.paired_table import Figures

GSM8K = "gsm8k"
GENERATIVE = "generative"  # a contrast's kind: in a recovery study, the probe average (the group `probes`)


def mean_with_se(results: list[Any]) -> tuple[float, float | None] | None:
    """Mean of headline values and the standard error of that mean (None when there are none; the SE is unknown,
    None, when any task's is)."""
    if not results:
        return None
    mean = sum(r.value for r in results) / len(results)
    if any(r.stderr is None for r in results):
        return mean, None
    return mean, math.sqrt(sum(r.stderr**2 for r in results)) / len(results)


def trained_tasks(source: str, kept: list[str] | None = None) -> frozenset[str]:
    """Evaluation tasks whose own prompts were in the recovery data (`prompts.source`), task by task; given the
    prompts the recovery kept (`kept`), only the tasks at least one of them came from (a task whose prompts were all
    evaluation items, such as a shallow brackets depth, trained nothing)."""
    from layerprune.recover.prompts import is_gsm8k, probe_task_names, prompts_of_task

    names = probe_task_names(source)
    if names is not None:
        if kept is None:
            return frozenset(names)
        texts = set(kept)
        return frozenset(n for n in names if texts & prompts_of_task(n, len(texts)))
    return frozenset({GSM8K}) if is_gsm8k(source) and (kept is None or kept) else frozenset()


def kept_prompts(root: Path, labels: list[str]) -> list[str] | None:
    """The prompts of the teacher answers the first trained arm learned from (None before any arm ran)."""
    from layerprune.tasks.data import iter_jsonl

    for label in labels:
        path = root / "arms" / label / "data" / "responses.jsonl"
        if path.is_file():
            return [str(row["prompt"]) for row in iter_jsonl(path)]
    return None


def measures(summary: Any, trained: frozenset[str] = frozenset()) -> dict[str, Any]:
    """probe average (all, trained tasks, unseen tasks), GSM8K and classification average of one model, each
    (value, se)."""
    heads = list(summary.headlines().values())
    probes = [r for r in heads if r.task in probe_tasks()]
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
    if base[1] is None or pruned[1] is None:
        return "n/a (standard error unknown)"
    drop, se = base[0] - pruned[0], math.hypot(base[1], pruned[1])
    if drop <= 2 * se:
        return "n/a (no clear drop)"
    return (arm[0] - pruned[0]) / drop


SHARES = {"recovered_share": "probes", "recovered_share_trained": "probes_trained",
          "recovered_share_unseen": "probes_unseen"}
CLS_SHARE = "recovered_share_classification"  # the classification tasks are never trained on: unseen
ALL_SHARES = {**SHARES, CLS_SHARE: "classification"}


def study_rows(root: Path, labels: list[str], trained: frozenset[str] = frozenset(),
               replicates: dict[str, list[str]] | None = None, evals: str = "eval") -> list[dict[str, Any]]:
    """One row per model (original, pruned, each arm, each control) with its measures, retention, shares, time and
    tokens. `replicates` maps a label to its replicates' folders under `evals`/ (default: the label alone); a row's
    measures are the means over the replicates evaluated. `evals`: eval (every task), or eval-chat (the probes in
    chat format)."""
    return study_tables(root, labels, trained, replicates, evals)[0]


def study_tables(root: Path, labels: list[str], trained: frozenset[str] = frozenset(),
                 replicates: dict[str, list[str]] | None = None,
                 evals: str = "eval") -> tuple[list[dict[str, Any]], Figures | None]:
    """`study_rows`, and the paired figures they were drawn from (None where the models cannot be paired: the
    rows' `pairing` says why), from which the report draws its comparisons."""
    runs = {label: [name for name in (replicates or {}).get(label, [label])
                    if (root / evals / name / SUMMARY_FILE).is_file()] for label in ["baseline", "pruned", *labels]}
    values = {label: _mean_measures([measures(read_summary(root / evals / n / SUMMARY_FILE), trained) for n in names])
              for label, names in runs.items() if names}
    base, pruned = values.get("baseline", {}), values.get("pruned", {})
    rows = []
    for label, m in values.items():
        row: dict[str, Any] = {"model": label, **m, "replicates": len(runs[label])}
        for key in ("probes", "gsm8k", "classification"):
            row[f"retention_{key}"] = _ratio(m.get(key), base.get(key))
        for share, key in ALL_SHARES.items():
            row[share] = recovered_share(base.get(key), pruned.get(key), m.get(key)) \
                if label not in ("baseline", "pruned") and not label.startswith(CONTROL) else None
        folder = root / "controls" / label.removeprefix(CONTROL) if label.startswith(CONTROL) else root / "arms" / label
        row.update(_arm_cost(folder))
        rows.append(row)
    figures = apply_paired(rows, root, trained, {label: names for label, names in runs.items() if names}, evals)
    # the pruned model's own held-out CE / KL (every arm measured it on the same held-out prompts' answers)
    before = next((r for r in rows if r.get("held_out_ce_pruned") is not None), None)
    pruned_row = next((r for r in rows if r["model"] == "pruned"), None)
    if pruned_row is not None and before is not None:
        pruned_row["held_out_ce"], pruned_row["held_out_kl"] = before["held_out_ce_pruned"], \
            before.get("held_out_kl_pruned")
    return rows, figures


def _mean_measures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's measures averaged over its replicates: each (value, se) the mean value and the mean item SE
    (the same items every run: their item noise does not average out)."""
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, tuple):
            pairs = [r[key] for r in runs if r.get(key) is not None]
            ses = [p[1] for p in pairs]
            merged[key] = (sum(p[0] for p in pairs) / len(pairs),
                           None if any(se is None for se in ses) else sum(ses) / len(ses))
    return merged


def _ratio(value: Any, base: Any) -> float | None:
    return value[0] / base[0] if value and base and abs(base[0]) > 1e-12 else None


def _arm_cost(arm: Path) -> dict[str, Any]:
    from layerprune.recover.chain import local_steps
    from layerprune.recover.report import RECOVER_REPORT, read_recover_report

    if not (arm / RECOVER_REPORT).is_file():
        return {}
    report = read_recover_report(arm)
    metrics = report.held_out_metrics or {}  # one yardstick for every method: the same held-out prompts, token-weighted
    after = metrics.get("after") or {"ce": None, "kl": None}
    method = report.recipe.chain_name().replace("+", " then ")
    return {"method": method, "seconds": report.seconds.training,
            "generation_seconds": report.seconds.generation, "tokens": report.tokens_seen,
            "steps": report.data.get("steps") or local_steps(report.data),  # reports before the local steps counted
            "held_out_ce": after.get("ce"), "held_out_kl": after.get("kl"),
            "held_out_ce_pruned": (metrics.get("pruned") or {}).get("ce"),
            "held_out_kl_pruned": (metrics.get("pruned") or {}).get("kl"), **budget_spent(arm / RECOVER_REPORT)}


def budget_spent(path: Path) -> dict[str, Any]:
    """Unpadded target tokens, sequences and optimizer steps a recovery spent (None where its report predates those
    fields) and the learning rate it trained at (the section the chain trains at: local's own where it has a local
    step)."""
    raw = json.loads(path.read_text())
    data, recipe = raw.get("data") or {}, raw.get("recipe") or {}
    section = lr_section_of(recipe)
    rate = ((recipe.get(section) or {}).get("learning_rate") if section != "train" else None) or \
        (recipe.get("train") or {}).get("learning_rate")
    return {"learning_rate": raw.get("learning_rate") or rate, **{key: raw.get(key, data.get(key)) for key in
                                      ("tokens_unpadded", "sequences", "optimizer_steps")}}


def lr_section_of(recipe: dict[str, Any]) -> str:
    """The section whose learning_rate a recorded recipe trained at ('train' where it cannot be read today)."""
    from layerprune.recover.schema import RecoverRecipe

    try:
        return RecoverRecipe.model_validate(recipe).lr_section() or "train"
    except ValueError:
        return "train"


GROUPS = ("probes", "probes_trained", "probes_unseen", "gsm8k", "classification")


def apply_paired(rows: list[dict[str, Any]], root: Path, trained: frozenset[str],
                 replicates: dict[str, list[str]] | None = None, evals: str = "eval") -> Figures | None:
    """Where every model answered the same items, each measure gets its paired 95% interval and each arm's recovered
    share is taken from one clustered paired bootstrap; with replicates, a two-level one (items, then runs), each
    figure the mean over the arm's replicates. Returns those figures (None: the models cannot be paired, and each
    row's `pairing` says why). Models whose per-item records hold different items are refused (LayerpruneError), not
    paired on a subset. Arms are set against each other only in the declared comparisons (`draw_comparisons`)."""
    from layerprune.pipeline.paired_table import load_matrix

    labels = [r["model"] for r in rows]
    runs = {label: (replicates or {}).get(label, [label]) for label in labels}
    if "baseline" not in labels or "pruned" not in labels:
        return None
    folders = {n: root / evals / n for label in labels for n in runs[label]}
    try:
        check_scored_items(folders)
        names, matrices, chance, kinds = load_matrix(folders)
    except (OSError, KeyError, ValueError):
        return None
    probes = [t for t in matrices if t in probe_tasks()]
    groups = {"probes": probes, "probes_trained": [t for t in probes if t in trained],
              "probes_unseen": [t for t in probes if t not in trained], "gsm8k": [t for t in matrices if t == GSM8K],
              "classification": [t for t in matrices if kinds[t] == "classification"]}
    if not matrices or any(kinds[t].startswith("unpaired") for t in kinds):
        for row in rows:
            row["pairing"] = "unpaired: " + "; ".join(f"{t}: {w}" for t, w in kinds.items() if w.startswith("unp"))
        return None
    figures = _figures(names, matrices, chance, {**groups, GENERATIVE: probes, **{f"task:{t}": [t] for t in matrices}},
                       runs)
    arms = [label for label in labels if label not in ("baseline", "pruned") and not label.startswith(CONTROL)]
    for row in rows:
        row["pairing"] = "paired"
        row["intervals"] = {g: figures.score(row["model"], g) for g in GROUPS if figures.has(g)}
        row["spread"] = {g: figures.spread(row["model"], g) for g in GROUPS if figures.has(g)}
        if row["model"] not in arms:
            continue
        for share_key, group in ALL_SHARES.items():
            if figures.has(group):
                row[share_key] = _paired_share(figures, row["model"], group)
        if row["model"] != arms[0] and figures.has("classification"):  # the goal's own criterion (goal_line)
            row[f"classification_vs_{arms[0]}"] = figures.difference(row["model"], arms[0], "classification")
        if CONTROL + row["model"] in labels:
            row.update(control_figures(figures, row["model"], CONTROL + row["model"]))
        row["skills_lost"] = lost_skills(figures, row["model"], list(matrices))
    return figures


# --- comparisons: the recipe's declared families, or the default family --------------------------------------------

DEFAULT_MEASURES = (("share", GENERATIVE), ("share", "probes_trained"), ("share", "probes_unseen"),
                    ("share", "classification"), ("score", "classification"))
KIND_NAMES = {GENERATIVE: "probe average", "probes_trained": "trained probe tasks",
              "probes_unseen": "unseen probe tasks", "gsm8k": "GSM8K", "classification": "classification average"}
DEFAULT_FAMILY = "default"


def default_family(arms: list[str], figures: Figures) -> dict[str, ComparisonFamily]:
    """The family drawn where the recipe declares no confirmatory one: every pair of arms (first - second, in the
    recipe's order) on every measure of DEFAULT_MEASURES the figures have (the recovered share of the probe average,
    of the trained and the unseen probe tasks and of the classification drop; the classification score); {} with
    fewer than two arms."""
    contrasts = [Contrast(name=f"{a}-vs-{b}-{measure}-{KIND_NAMES[kind].replace(' ', '-')}", a=a, b=b,
                          measure=measure, kind=kind)
                 for measure, kind in DEFAULT_MEASURES if figures.has(kind) for a, b in combinations(arms, 2)]
    return {DEFAULT_FAMILY: ComparisonFamily(contrasts=contrasts)} if contrasts else {}


def point_label(arm: str | None, k: int | None) -> str:
    """A recovery study's model for a contrast's side: the arm (or `pruned`) itself; at k = 0, its control."""
    name = arm or NO_ARMS
    return CONTROL + name if k == 0 else name


def draw_comparisons(study: Any, figures: Figures | None) -> dict[str, Any]:
    """The default family (drawn where no confirmatory family is declared) and the declared families, each contrast
    with its paired interval and its Holm interval over exactly its family (`comparisons.draw_families`); both {}
    without paired figures."""
    if figures is None:
        return {"default": {}, "declared": {}}
    default = default_family(list(study.arms), figures) if uses_default_family(study.comparisons) else {}
    return {"default": draw_families(default, figures, point_label, pruned=lambda _: "pruned"),
            "declared": draw_families(study.comparisons, figures, point_label, pruned=lambda _: "pruned")}


def comparison_lines(study: Any, drawn: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The comparisons section of study.md: how the family was chosen, then every family's contrasts."""
    lines = ["## Comparisons", ""]
    if not drawn["default"] and not drawn["declared"]:
        why = next((r["pairing"] for r in rows if str(r.get("pairing", "")).startswith("unpaired")), None)
        return lines + [("No comparison is drawn: the models cannot be paired item by item (" + why.removeprefix(
            "unpaired: ") + "), so no arm is said to differ from another." if why else
            "No comparison is drawn: fewer than two arms and none declared (`comparisons:`)." if len(study.arms) < 2
            else "No comparison is drawn: no paired figures (the models' per-item records are missing)."), ""]
    if drawn["default"]:
        lines += ["The recipe declares no confirmatory comparison (`comparisons:`), so the default family is drawn: "
                  "every pair of arms (first - second, in the recipe's order) on each measure, the recovered share "
                  "of the probe average, of the trained and of the unseen probe tasks and of the classification drop, "
                  "and the classification score (those scored), on the plain-format evaluation; Holm over the whole "
                  "family. Two arms are said to differ only where the Holm interval of their paired difference "
                  "excludes 0.", "", *format_families(drawn["default"], study.replicates, False, KIND_NAMES)]
    return lines + format_families(drawn["declared"], study.replicates, kinds=KIND_NAMES)


def _figures(names: list[str], matrices: dict[str, Any], chance: dict[str, float], groups: dict[str, list[str]],
             runs: dict[str, list[str]]) -> Any:
    """The paired figures over the models' labels: the two-level bootstrap over runs and items, each figure the mean
    over a model's runs (one run each: exactly the item-only figures)."""
    from layerprune.pipeline.paired_table import Figures

    return Figures(names, matrices, chance, groups, replicates=runs)


def _net_share(figures: Any, m: Any, arm: str, control: str, group: str) -> Any:
    base, pruned = figures.mean(m, "baseline", group), figures.mean(m, "pruned", group)
    return paired.share(base, pruned, figures.mean(m, arm, group) - (figures.mean(m, control, group) - base))


def control_figures(figures: Any, arm: str, control: str) -> dict[str, Any]:
    """What the arm's recipe does to the unpruned model, per group (control - baseline, paired), and the arm's
    recovered share net of it: (arm - pruned - (control - baseline)) / (baseline - pruned)."""
    out: dict[str, Any] = {"control_change": {g: figures.difference(control, "baseline", g)
                                              for g in GROUPS if figures.has(g)}}
    for share_key, group in ALL_SHARES.items():
        if not figures.has(group):
            continue
        drop = figures.difference("baseline", "pruned", group)
        state = paired.share_state(drop)
        out[f"{share_key}_net"] = state if state is not None else \
            figures.interval(lambda m, g=group: _net_share(figures, m, arm, control, g))
    return out


def lost_skills(figures: Any, arm: str, tasks: list[str]) -> list[dict[str, Any]]:
    """The tasks on which the arm scores below the pruned model it started from, the paired interval of the
    difference entirely below 0: recovery that costs a skill."""
    lost = []
    for task in tasks:
        diff = figures.difference(arm, "pruned", f"task:{task}")
        if diff.get("high") is not None and diff["high"] < 0:
            lost.append({"task": task, **diff})
    return lost


def _paired_share(figures: Any, arm: str, group: str) -> dict[str, Any] | str:
    drop = figures.difference("baseline", "pruned", group)
    return paired.share_interval(figures.boot, drop, lambda m: figures.share_of(arm, "pruned", group, m))


def _pm(value: tuple[float, float | None] | None) -> str:
    if value is None:
        return "-"
    return f"{100 * value[0]:.1f} ± " + ("?" if value[1] is None else f"{100 * value[1]:.1f}")


def _pct(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return format_interval(value, digits=0, missing="undefined")
    return value if isinstance(value, str) else f"{100 * value:.0f}%"


def format_table(rows: list[dict[str, Any]], gsm8k_trained: bool = False) -> str:
    gsm = "GSM8K, trained (%)" if gsm8k_trained else "GSM8K, unseen (%)"
    head = ["model", "method", "probe avg (%)", "trained probes (%)", "unseen probes (%)", gsm,
            "classification avg, unseen (%)", "retention probes / cls",
            "recovered share of the probe drop: all / trained / unseen", "recovered share of the classification drop",
            "held-out CE / KL", "train time (s)", "tokens", "steps", "runs", "probe avg run SD / item SE (points)",
            "unpadded target tokens", "sequences", "optimizer steps", "learning rate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        held = "-" if r.get("held_out_ce") is None else f"{r['held_out_ce']:.3f} / " + (
            "-" if r.get("held_out_kl") is None else f"{r['held_out_kl']:.3f}")
        shares = " / ".join(_pct(r.get(share)) for share in SHARES)
        cells = [r["model"], r.get("method", "-"), _pm(r["probes"]), _pm(r.get("probes_trained")),
                 _pm(r.get("probes_unseen")), _pm(r["gsm8k"]), _pm(r["classification"]),
                 f"{_pct(r['retention_probes'])} / {_pct(r['retention_classification'])}", shares,
                 _pct(r.get(CLS_SHARE)), held, "-" if r.get("seconds") is None else f"{r['seconds']:.0f}",
                 str(r.get("tokens", "-")), str(r.get("steps", "-")), str(r.get("replicates", 1)), _spread(r),
                 *[_cell(r.get(key)) for key in ("tokens_unpadded", "sequences", "optimizer_steps")],
                 "-" if r.get("learning_rate") is None else f"{r['learning_rate']:g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _spread(row: dict[str, Any]) -> str:
    """'1.2 / 3.4': the probe average's SD across runs beside its item SE; 'not measured' with one run."""
    spread = (row.get("spread") or {}).get("probes")
    if not spread:
        return "-"
    untrained = row["model"] in ("baseline", "pruned")  # no training: no run-to-run variance to measure
    run = "-" if untrained else "not measured" if spread.get("run_sd") is None else f"{100 * spread['run_sd']:.1f}"
    return f"{run} / {100 * spread['item_se']:.1f}"


def replicate_line(rows: list[dict[str, Any]]) -> str:
    """Whether the intervals hold the training noise: measured with two runs or more of every arm."""
    arms = [r for r in rows if r["model"] not in ("baseline", "pruned") and not r["model"].startswith(CONTROL)]
    counts = sorted({r.get("replicates", 1) for r in arms})
    if not arms or counts == [1]:
        return ("One run per arm: the intervals hold the item noise only; the run-to-run (training) variance is not "
                "measured (replicates: N, or --replicates N).")
    return (f"Runs per arm: {', '.join(map(str, counts))} (replicate r trains with the run seed + r: its held-out "
            "split, data order, adapter initialisation and sampling). Each arm's figures are means over its runs and "
            "their paired intervals come from a two-level bootstrap (items, then runs), so they include the "
            "run-to-run variance; 'run SD' is the SD of the probe average across runs, beside its item SE.")


def control_lines(rows: list[dict[str, Any]], controls: bool, no_control: list[str]) -> list[str]:
    """Each arm's k = 0 control: what its recipe does to the unpruned model per group (control - baseline), and its
    recovered share net of that change."""
    if not controls:
        return ["No k = 0 controls (controls: false): what a recovery recipe does to the unpruned model (format drift "
                "included) is not separated from what it wins back of the pruning loss."]
    lines = ["k = 0 controls: each trained arm's recipe applied to the original itself (student and teacher the "
             "original), evaluated on the same items. Control change = control - original (paired 95%, points); net "
             "share = (arm - pruned - (control - original)) / (original - pruned)."]
    for row in rows:
        if row["model"] in no_control:
            lines.append(f"- {row['model']}: {NO_CONTROL}")
        elif "control_change" in row:
            change = ", ".join(f"{g} {_points(ci)}" for g, ci in row["control_change"].items())
            net = ", ".join(f"{g} {_share_text(row.get(f'{key}_net'))}" for key, g in ALL_SHARES.items()
                            if f"{key}_net" in row)
            lines.append(f"- {row['model']}: control change {change}; net recovered share {net or '-'}")
    return lines


def _share_text(value: Any) -> str:
    """A share with its interval and, where some resamples had no drop, the fraction undefined."""
    text = _pct(value)
    if isinstance(value, dict) and value.get("undefined"):
        text += f" (undefined in {100 * value['undefined']:.0f}% of resamples)"
    return text


def plot_study(rows: list[dict[str, Any]], path: Path) -> None:
    """Bars of the measures per model, each with its paired 95% interval (two-level where the model has replicates,
    so run-to-run variance is in it); a model with no interval for a measure gets +-1 SE, said in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    named = (("probes", "probe avg"), ("probes_trained", "trained probes"), ("probes_unseen", "unseen probes"),
             ("gsm8k", "GSM8K"), ("classification", "classification avg"))
    keys = [(k, name) for k, name in named if any(r.get(k) for r in rows)]  # a measure no model has: left out, not 0
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows)), 4))
    width = 0.8 / max(len(keys), 1)
    fallback = False
    for i, (key, name) in enumerate(keys):
        xs = [x + i * width for x in range(len(rows))]
        heights, below, above = [], [], []
        for row in rows:
            mean, se = row.get(key) or (math.nan, math.nan)
            ci = (row.get("intervals") or {}).get(key) or {}
            if ci.get("low") is not None and ci.get("high") is not None:
                low, high = ci["low"], ci["high"]
            else:
                low, high, fallback = mean - se, mean + se, fallback or not math.isnan(mean)
            heights.append(100 * mean)
            below.append(100 * max(mean - low, 0.0))
            above.append(100 * max(high - mean, 0.0))
        ax.bar(xs, heights, width, yerr=[below, above], capsize=2, label=name)
    ax.set_title("95% paired intervals (runs, then items)" + ("; +-1 SE where none" if fallback else ""), fontsize=9)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], [r["model"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("score (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def closing_note(rows: list[dict[str, Any]]) -> list[str]:
    """Which arm recovered most of the probe drop (all, trained and unseen tasks), and whether it reached half
    (the goal) or three quarters (the aim) of it."""
    arms = [r for r in rows if r["model"] not in ("baseline", "pruned") and not r["model"].startswith(CONTROL)]
    if not arms:
        return ["No recovery arm finished."]
    named = {"recovered_share": "the probe average", "recovered_share_trained": "the trained probe tasks",
             "recovered_share_unseen": "the unseen probe tasks"}
    return ([_verdict(arms, share, what) for share, what in named.items()] + classification_lines(arms)
            + [goal_line(arms)] + skill_flags(arms))


def classification_lines(arms: list[dict[str, Any]]) -> list[str]:
    """Each arm's share of the classification drop (arms are set against each other in the comparisons only)."""
    shares = [f"{r['model']} {_pct(r.get(CLS_SHARE))}" for r in arms if r.get(CLS_SHARE) is not None]
    return ["Share of the classification drop recovered (unseen, paired 95%): " + ", ".join(shares) + "."] \
        if shares else []


def goal_line(arms: list[dict[str, Any]]) -> str:
    """The goal as the recovery-transfer issue states it: at least half of the generative drop on held-out skills
    won back (the point estimate), its paired interval above 25%, classification no worse than the first arm's
    (the paired difference's interval reaches 0 or above)."""
    first = arms[0]["model"]
    cells = []
    for r in arms:
        share = r.get("recovered_share_unseen")
        value, low = _value(share), share.get("low") if isinstance(share, dict) else None
        if value is None:
            continue
        cls = r.get(f"classification_vs_{first}")
        cls_ok = r["model"] == first or (isinstance(cls, dict) and cls.get("high") is not None and cls["high"] >= 0)
        met = value >= 0.5 and low is not None and low > 0.25 and cls_ok
        cells.append(f"{r['model']} {'meets it' if met else 'falls short'} ({_pct(share)}"
                     + ("" if r["model"] == first else f"; classification vs {first} {_points(cls)}") + ")")
    return ("Goal (half of the generative drop on unseen skills won back, its paired interval above 25%, "
            f"classification no worse than {first}'s): " + ("; ".join(cells) or "no arm has a measured share") + ".")


def skill_flags(arms: list[dict[str, Any]]) -> list[str]:
    """A line per arm that loses a skill: scores below the pruned model it started from, paired."""
    return [f"FLAG: {r['model']} loses skills the pruned model had: "
            + ", ".join(f"{s['task']} {_points(s)}" for s in r["skills_lost"]) + " (arm minus pruned)."
            for r in arms if r.get("skills_lost")]


def _points(ci: Any) -> str:
    if not isinstance(ci, dict) or ci.get("value") is None:
        return "-"
    low, high = ci.get("low"), ci.get("high")
    bounds = "" if low is None or high is None else f" [{100 * low:.1f}, {100 * high:.1f}]"
    return f"{100 * ci['value']:+.1f}{bounds}"


def _value(share: Any) -> float | None:
    if isinstance(share, dict):
        return share.get("value")
    return share if isinstance(share, float) else None


def _verdict(arms: list[dict[str, Any]], share: str, what: str) -> str:
    """The arm with the highest share (its point estimate: no claim that it differs from the others); a threshold
    counts as reached only when the share's paired interval clears it (the point estimate where no interval is
    known)."""
    shares = [r for r in arms if _value(r.get(share)) is not None]
    if not shares:
        return (f"On {what} the drop from pruning is not clear (its interval holds 0, or it is within two standard "
                "errors, or missing), so no recovered share is reported; evaluate on more probe items to measure one.")
    best = max(shares, key=lambda r: _value(r[share]))  # type: ignore[arg-type, return-value]
    ci = best[share] if isinstance(best[share], dict) else {"value": best[share], "low": None}
    floor = ci["low"] if ci.get("low") is not None else ci["value"]
    by = "its interval's lower end" if ci.get("low") is not None else "its point estimate (no interval)"
    verdict = ("reaches three quarters of the drop (the aim)" if floor >= 0.75 else
               "reaches half of the drop (the goal), not three quarters" if floor >= 0.5 else
               "does NOT reach half of the drop (the goal)")
    return (f"Highest share on {what}: {best['model']} ({best.get('method', '-')}), {_pct(best[share])} of the "
            f"drop recovered; judged by {by}, it {verdict} (whether two arms differ: the comparisons below). Tried: "
            + ", ".join(f"{r['model']} ({_pct(r.get(share))})" for r in arms) + ".")


def probe_items_text(items: dict[str, int]) -> str:
    """'arith_1dc 100, ..., brackets_d2 9 (all there are), ...': a task with few distinct questions (shallow
    brackets) is evaluated exhaustively, with fewer items than the others."""
    return ", ".join(f"{task} {n}" + (" (all there are)" if n == distinct_items(task) else "")
                     for task, n in items.items()) or "none"


def gate_lines(root: Path, fixed: list[str]) -> list[str]:
    """The probe gate's record: every candidate level with its family, calibration score, 95% interval and why it
    was kept or left out; the fixed probe tasks labelled by family ([] without a gate)."""
    from layerprune.evaluate.calibrated import level_lines

    path = calibration_file(root)
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    levels, gate = record["levels"], record.get("settings") or {}
    band = f"{100 * gate.get('low', 0):.0f}-{100 * gate.get('high', 1):.0f}%"
    lines = ["## Probe levels: the gate", "",
             "calibrate-probes scored every candidate level on the original, on calibration-stream items (never an "
             f"evaluation item): a level is kept when its score is in the band {band}, at "
             f"most {gate.get('per_family', '-')} per family (nearest the band's middle). Kept: "
             f"{', '.join(record['kept']) or 'none'}.", ""]
    lines += [f"- [{family_label(task)}] {line}" for task, line in zip(levels, level_lines(levels), strict=True)]
    probes = [t for t in fixed if t in probe_tasks()]
    if probes:
        retrieval = any(family_label(t).startswith("retrieval") for t in probes)
        lines += ["", "Fixed probe tasks, scored whatever the gate keeps: " + ", ".join(
            f"{t} ({family_label(t)})" for t in probes) + "." + (
            " A retrieval task is a labelled control: it repeats or reorders what the prompt holds, so it measures "
            "retrieval, not arithmetic or brackets." if retrieval else "")]
    return [*lines, ""]


def _ci(ci: Any) -> str:
    if not isinstance(ci, dict) or ci.get("low") is None or ci.get("high") is None:
        return "-"
    return f"[{100 * ci['low']:.1f}, {100 * ci['high']:.1f}]"


def probe_table(rows: list[dict[str, Any]]) -> str:
    """The probe figures of one format: scores (mean ± SE, paired 95% interval), the shares of the drop recovered
    with their paired intervals, each arm's control change and net share."""
    head = ["model", "probe avg (%)", "paired 95%", "trained probes (%)", "unseen probes (%)",
            "recovered share: all / trained / unseen", "control change, probe avg (points)", "net share, unseen"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        change = (r.get("control_change") or {}).get("probes")
        cells = [r["model"], _pm(r.get("probes")), _ci((r.get("intervals") or {}).get("probes")),
                 _pm(r.get("probes_trained")), _pm(r.get("probes_unseen")),
                 " / ".join(_pct(r.get(share)) for share in SHARES), _points(change) if change else "-",
                 _share_text(r["recovered_share_unseen_net"]) if "recovered_share_unseen_net" in r else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_lines(rows: list[dict[str, Any]], chat_rows: list[dict[str, Any]]) -> list[str]:
    """The probe figures in both formats, labelled ([] where the probes were scored in one)."""
    if not chat_rows:
        return []
    lines = ["## Probes in both formats", "",
             "The recovery data is chat-formatted (generate.chat_template: the answers trained on follow the chat "
             "template), while the probes are asked as plain few-shot text; so every model's probe tasks are scored "
             "both ways, on the same items. plain: the few-shot examples and the question as one text (the table "
             f"above); chat: through the model's chat template, each example a user and an assistant turn "
             f"({CHAT_EVAL}<model>). Scores: mean ± SE and the paired 95% interval; shares of the drop recovered "
             "(all / trained / unseen probe tasks) with their paired 95% intervals (two-level where an arm has "
             "replicates); control change: control - original on the probe average; net share: on the unseen probe "
             "tasks, net of the control change.", ""]
    for name, format_rows in (("plain", rows), ("chat", chat_rows)):
        lines += [f"Probe format: {name}", "", probe_table(format_rows), ""]
    return lines


def write_study_report(study: Any, root: Path) -> Path:
    """study.md, study.json (the rows), study_comparisons.json (the comparisons drawn) and study.png in the study
    directory."""
    source = study.shared_recipe(str(root / "pruned")).prompts.source
    trained = trained_tasks(source, kept_prompts(root, list(study.arms)))
    from layerprune.pipeline.audit_report import audit_section
    from layerprune.pipeline.studies.recovery_grid import fixed_tasks, physical_labels

    controlled = [CONTROL + label for label in study.controlled()]
    runs = {label: physical_labels(study, label) for label in [*study.arms, *controlled]}
    rows, figures = study_tables(root, [*study.arms, *controlled], trained, runs)
    chat = CHAT_EVAL.rstrip("/")
    chat_rows = study_rows(root, [*study.arms, *controlled], trained, runs, chat) \
        if (root / chat / "baseline" / SUMMARY_FILE).is_file() else []
    drawn = draw_comparisons(study, figures)
    plot_study(rows, root / "study.png")
    (root / "study.json").write_text(json.dumps(rows, indent=1, default=str))
    (root / "study_comparisons.json").write_text(json.dumps(drawn, indent=1, default=str))
    if chat_rows:
        (root / "study_chat.json").write_text(json.dumps(chat_rows, indent=1, default=str))
    items = rows[0].get("probe_items", {}) if rows else {}
    split = rows[0] if rows else {}
    lines = [f"# Recovery study: {study.name}", "", study.description, "", format_table(rows, GSM8K in trained), "",
             *closing_note(rows), "", *comparison_lines(study, drawn, rows), replicate_line(rows), "",
             *control_lines(rows, study.controls, [a for a in study.arms if not study.has_control(a)]), "",
             *lr_lines(root, list(study.lr_grid), "every replicate and the control trained at it"), "",
             *gate_lines(root, fixed_tasks(study)), *format_lines(rows, chat_rows),
             f"Trained skills: the evaluated probe tasks whose own prompts were in the recovery data ({source}): "
             f"{', '.join(split.get('trained_tasks', [])) or 'none'}. Unseen skills: the other probe tasks "
             f"({', '.join(split.get('unseen_tasks', [])) or 'none'}), "
             + ("" if GSM8K in trained else "GSM8K, ") + "and the classification tasks. Split by task, not family.",
             "",
             f"Probe average: the unweighted mean over {rows[0]['probe_tasks'] if rows else 0} probe tasks of their "
             f"accuracies; items per task: {probe_items_text(items)} (the first items of each task under the "
             "evaluation seed; no recovery prompt is one of them: measured in 'Held out, measured' below). Values are "
             "means ± one standard error. GSM8K is "
             "scored with the evaluation suite's protocol (lm-eval's gsm8k).",
             "Every arm ran the same optimizer steps on the same prompts; train time excludes the teacher's answers, "
             "generated once and shared. Held-out CE / KL: token-weighted, on the teacher's answers to the same "
             "held-out prompts for every arm (KL(teacher || student)); the pruned row before any recovery.",
             "", "![study](study.png)", *audit_section(root), "",
             f"Rerun: `layerprune study {study.name} --output {root}` (complete stages are skipped)."]
    (root / "study.md").write_text("\n".join(lines) + "\n")
    return root / "study.md"
