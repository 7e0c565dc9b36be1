"""Sweeps of one model and one cut compared arm by arm: `layerprune analyze sweeps RUN RUN [...]`.

Two sweeps that prune the same model at the same k (one ranking, so the pruned models are the same weights) but
recover differently, paper B's generic against task-aligned prompts, are one experiment run twice. Their arms are
compared here as one sweep compares its own: per arm and k the scores, drop, recovered share (net of the arm's k = 0
control where it has one) and the run-to-run spread, and every pair of arms paired on the items every run scored,
two-level over runs and items where there are replicates.

The first sweep gives the original and the pruned models. Every other sweep's must be the same weights (the model
hashes of their evaluation summaries are compared) and must have been asked the same prompts (each item's prompt hash,
as any pairing checks); runs scored on different item counts (the first N of one list) pair on the items in common.
Arms keep their names; a sweep without arms is one arm named by its recipe, so names must differ across sweeps.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.paired import format_interval
from layerprune.evaluate.summary import SUMMARY_FILE, read_summary
from layerprune.pipeline.audit import audit_runs
from layerprune.pipeline.audit_report import join_audit_lines
from layerprune.pipeline.paired_table import Figures
from layerprune.pipeline.studies.cells import split_label
from layerprune.pipeline.studies.figures import KINDS, items_of, paired_json, study_figures, unpaired
from layerprune.pipeline.studies.sweep_grid import recovered_label
from layerprune.pipeline.studies.sweep_points import comparisons, control_point, point, verdicts
from layerprune.pipeline.studies.sweep_text import format_comparisons, format_control, format_spread, format_table

SWEEP_FILE = "sweep.json"
RUN_FILE = "run.json"
TAKEN = ("baseline", "pruned", "recovered")  # labels of the original and pruned models (recovered: arm-less sweeps)


@dataclass(frozen=True)
class Sweep:
    """One finished sweep: its folder, recipe name, replicates, and each recovered model's label in the join (its
    folder name, or for a sweep without arms recovered-kK renamed NAME-kK) by its folder name under eval/."""

    root: Path
    name: str
    replicates: int
    arms: tuple[str, ...]
    recovered: dict[str, str]
    own_budget: dict[str, tuple[int, int]] = field(default_factory=dict)  # arm -> (its largest budget, the sweep's)


def read_sweep(root: Path) -> Sweep:
    """A sweep's folder as its report stage left it; anything else is a one-line error naming the folder."""
    path = root / SWEEP_FILE
    if not path.is_file():
        raise LayerpruneError(f"{root}: no {SWEEP_FILE}: not a sweep study's folder, or its report stage has not run "
                              "(layerprune study RECIPE --output DIR finishes it)")
    try:
        sweep = json.loads(path.read_text())
        if "partial" in sweep:
            raise LayerpruneError(f"{root}: its {SWEEP_FILE} was drawn from a run in progress (study --report, "
                                  f"{len(sweep['partial'].get('left') or [])} stages left): finish the run first")
        recipe = json.loads((root / RUN_FILE).read_text())["recipe"]
        name = recipe["name"]
        named = list(sweep.get("arms") or {})
        replicates = int(sweep.get("replicates") or 1)
        budgets, own = list(recipe.get("budgets") or []), dict(recipe.get("arm_budgets") or {})
        short = {arm: (int(own[arm][-1]), int(budgets[-1])) for arm in named
                 if budgets and own.get(arm) and own[arm][-1] != budgets[-1]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise LayerpruneError(f"{root}: cannot read its {SWEEP_FILE} / {RUN_FILE} ({err})") from err
    if not named and name in TAKEN:
        raise LayerpruneError(f"{root}: a sweep without arms is an arm named by its recipe, and {name!r} names the "
                              "original or the pruned models")
    arms = tuple(named or [name])
    recovered = {}
    for folder in sorted(p.name for p in (root / "eval").glob("*") if (p / SUMMARY_FILE).is_file()):
        label, _ = split_label(folder)
        for arm in named or [None]:
            if re.fullmatch(rf"{re.escape(recovered_label(arm, 0)[:-1])}\d+", label):
                recovered[folder] = folder if arm is not None else f"{name}{folder[len('recovered'):]}"
    return Sweep(root, name, replicates, arms, recovered, short)


def k_of(label: str) -> int:
    """'sft-dolly-k4@r1' -> 4."""
    return int(split_label(label)[0].rsplit("-k", 1)[1])


def join(roots: list[Path], evals: str = "eval",
         own: bool = False) -> tuple[list[Sweep], dict[str, Path], list[int]]:
    """The sweeps, the folders of every model in the join (the first sweep's original and pruned models, then every
    sweep's recovered ones at the ks all share, controls included) and those ks. `own`: every sweep's original and
    pruned models are joined too, as NAME:baseline and NAME:pruned-kK (the first sweep's without a prefix), and their
    hashes may differ."""
    if not roots:
        raise LayerpruneError("sweeps: give the sweep folders to compare")
    sweeps = [read_sweep(root) for root in roots]
    seen: dict[str, str] = {}
    for sweep in sweeps:
        for arm in sweep.arms:
            if arm in seen:
                raise LayerpruneError(f"sweeps: arm {arm!r} is in both {seen[arm]} and {sweep.root}: the arms compared "
                                      "need different names")
            seen[arm] = str(sweep.root)
    first = sweeps[0]
    shared = ["baseline"] + [f"pruned-k{k}" for k in _ks(first, evals)]
    ratios = sorted(set.intersection(*(set(_ks(s, evals)) for s in sweeps)))
    if not ratios:
        raise LayerpruneError(f"sweeps: the folders share no pruned k in {evals}/ (" + "; ".join(
            f"{s.root}: {', '.join(map(str, _ks(s, evals))) or 'none'}" for s in sweeps) + ")")
    names = [s.name for s in sweeps]
    if own and len(set(names)) < len(names):
        raise LayerpruneError(f"sweeps: --own-models needs runs of recipes with different names ({', '.join(names)})")
    for sweep in [] if own else sweeps[1:]:
        for label in [label for label in shared if label == "baseline" or k_of(label) in ratios]:
            mine, theirs = _hash(first.root / evals / label), _hash(sweep.root / evals / label)
            if mine != theirs:
                raise LayerpruneError(f"sweeps: {label} of {sweep.root} is not {label} of {first.root} (model hash "
                                      f"{theirs[:12]} against {mine[:12]}): only sweeps of one model and one cut pair "
                                      "(--own-models measures each arm against its own run's models)")
    folders = {}
    for i, sweep in enumerate(sweeps[:len(sweeps) if own else 1]):
        for label in [label for label in shared if label == "baseline" or k_of(label) in ratios]:
            folders[f"{sweep.name}:{label}" if i else label] = sweep.root / evals / label
            _hash(folders[f"{sweep.name}:{label}" if i else label])
    for sweep in sweeps:
        for folder, label in sweep.recovered.items():
            if k_of(label) in [0, *ratios] and (sweep.root / evals / folder / SUMMARY_FILE).is_file():
                folders[label] = sweep.root / evals / folder
    return sweeps, folders, ratios


def _ks(sweep: Sweep, evals: str = "eval") -> list[int]:
    return sorted(int(p.name[len("pruned-k"):]) for p in (sweep.root / evals).glob("pruned-k*")
                  if p.name[len("pruned-k"):].isdigit() and (p / SUMMARY_FILE).is_file())


def _hash(folder: Path) -> str:
    if not (folder / SUMMARY_FILE).is_file():
        raise LayerpruneError(f"sweeps: no {folder / SUMMARY_FILE}")
    return read_summary(folder / SUMMARY_FILE).model_hash


def compare(roots: list[Path], evals: str = "eval", own: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The joined figures (points per arm and k, each arm's control and verdicts, every pair of arms compared) and
    their text; a one-line error when the runs cannot be paired. `own`: each arm against its own run's original and
    pruned models (runs whose models are not the same weights), without the verdicts."""
    sweeps, folders, ratios = join(roots, evals, own)
    figures, kinds = study_figures(folders, common=True)
    arms = [arm for sweep in sweeps for arm in sweep.arms]
    short = {arm: ends for sweep in sweeps for arm, ends in sweep.own_budget.items()}  # as its sweep.md leaves it
    compared = [arm for arm in arms if arm not in short]
    if own:
        points, controls, pairs, originals = own_figures(figures, sweeps, ratios, compared)
        judged: dict[str, tuple[list[str], dict[str, Any]]] = {}
    else:
        points = [point(None, figures, k, arm) for k in ratios for arm in arms]
        points = [p for p in points if any("recovered" in p.get(kind, {}) for kind in KINDS)]
        controls = {arm: control_point(figures, arm) for arm in arms}
        judged = {arm: verdicts(None, figures, [p for p in points if p.get("arm") == arm], arm) for arm in arms}
        pairs, originals = comparisons(figures, points, compared), []
    replicates = min(s.replicates for s in sweeps)
    items, left = items_of(figures), unpaired(kinds)
    data = {"runs": [{"folder": str(s.root), "name": s.name, "arms": list(s.arms), "replicates": s.replicates}
                     for s in sweeps],
            "ratios": ratios, "items": items, "unpaired": left, "points": points, "controls": controls,
            "verdicts": {arm: tests for arm, (_, tests) in judged.items()}, "comparisons": pairs,
            "models": {label: str(folder) for label, folder in folders.items()},
            **({"own_models": originals} if own else {})}
    text = ["Items, paired across every run (the items all of them scored): "
            + ", ".join(f"{task} {n}" for task, n in items.items())
            + (". Unpaired, left out: " + "; ".join(f"{t} ({why})" for t, why in left.items()) if left else "")
            + ".", "",
            *[f"- {arm}: {line}" for arm, (lines, _) in judged.items() for line in lines], *([""] if judged else []),
            *(own_lines(originals) if own else []), format_table(points), ""]
    if short:
        text += ["Rows at a budget of their own (arm_budgets), left out of the arms compared: " + "; ".join(
            f"{arm} at {end:,} target tokens, its sweep's other arms at {largest:,}"
            for arm, (end, largest) in short.items()) + ".", ""]
    text += [line for arm in arms for line in (
        format_control(controls[arm], "", False, arm) if controls[arm] else f"No k = 0 control of arm {arm}.", "")]
    text += ["Run-to-run spread (replicates of every recovery, seeds settings.seed + r):", "",
             format_spread(points, None, controls), "", *format_comparisons(pairs, replicates), ""]
    if own:
        text += ["Shares of arms from different runs are each against the arm's own original and pruned models; where "
                 "both arms have a k = 0 control, the shares compared are net of each arm's own control (so named "
                 "above; `share_net_of_controls` in sweeps.json).", ""]
    return data, text


def own_figures(figures: Figures, sweeps: list[Sweep], ratios: list[int], compared: list[str]) -> tuple[
        list[dict[str, Any]], dict[str, dict[str, Any] | None], list[dict[str, Any]], list[dict[str, Any]]]:
    """Each arm measured against its own run's original and pruned models (one bootstrap draw of the items for all):
    the points and controls as a sweep's, every pair of the `compared` arms' difference of recovered shares (net of
    each arm's control where both have one) and recovered scores, and every later run's original and pruned models
    against the first's (how far apart the runs' models are)."""
    models = {arm: f"{sweep.name}:" if i else "" for i, sweep in enumerate(sweeps) for arm in sweep.arms}
    points = [point(None, figures, k, arm, models[arm]) for arm in models for k in ratios
              if recovered_label(arm, k) in figures.labels]
    controls = {arm: control_point(figures, arm, models[arm]) for arm in models}
    pairs = comparisons(figures, points, [arm for arm in models if arm in compared], models)
    originals = [{"run": sweep.name, "label": label,
                  **{kind: figures.difference(f"{sweep.name}:{label}", label, kind) for kind in KINDS
                     if figures.has(kind)}}
                 for sweep in sweeps[1:] for label in ["baseline", *[f"pruned-k{k}" for k in ratios]]]
    return points, controls, pairs, originals


def own_lines(originals: list[dict[str, Any]]) -> list[str]:
    """How far apart the runs' own original and pruned models are, on the same items."""
    lines = ["The runs' original and pruned models are not the same weights (--own-models): each arm is measured "
             "against its own run's, on the same items and one bootstrap draw. What separates the runs' models is in "
             "every comparison of arms from different runs, and no replicate measures it; here is how far apart they "
             "score (later run - first run, points, 95% paired interval):", "",
             "| run | model | " + " | ".join(KINDS) + " |", "|---|---|" + "---|" * len(KINDS)]
    lines += [f"| {o['run']} | {o['label']} | " + " | ".join(
        format_interval(o[kind]) if kind in o else "-" for kind in KINDS) + " |" for o in originals]
    return [*lines, ""]


def analyze_sweeps(config: Any, settings: Any, out: Path) -> dict[str, Any]:
    """summary.md and sweeps.json in `out`: the plain-format figures, then the probes through the chat template
    where every sweep scored them that way."""
    del settings  # nothing is loaded or run: the sweeps' records are read
    roots = [Path(r) for r in config.runs]
    own = bool(getattr(config, "own_models", False))
    data, text = compare(roots, own=own)
    chat: tuple[dict[str, Any], list[str]] | str | None = None
    if any((root / "eval-chat").is_dir() for root in roots):
        try:
            chat = compare(roots, "eval-chat", own)
        except LayerpruneError as err:
            chat = str(err)
    names = ", ".join(s["name"] for s in data["runs"])
    ks = ", ".join(map(str, data["ratios"]))
    whose = (f"Each arm is measured against its own run's original and pruned models (k = {ks})" if own else
             f"The original and the pruned models (k = {ks}) are {roots[0]}'s; every other run's are the same weights "
             "(model hashes compared)")
    lines = [f"# Sweeps compared: {names}", "", f"{whose}. Arms: "
             + "; ".join(f"{', '.join(r['arms'])} ({r['folder']}, {r['replicates']} replicate(s))"
                         for r in data["runs"]) + ".", "", *text]
    if isinstance(chat, tuple):
        data["chat"] = chat[0]
        lines += ["## Probes through the chat template", "", *chat[1]]
    elif chat is not None:
        lines += ["## Probes through the chat template", "", f"Not compared: {chat}.", ""]
    audits = audit_runs(roots)  # every task scored in every run folder, a folder of later tasks included
    write_atomic(out / "audit.json", json.dumps(audits, indent=1) + "\n")
    lines += join_audit_lines(audits)
    lines += ["Rerun: `layerprune analyze sweeps --runs " + " ".join(map(str, roots))
              + (" --own-models" if own else "") + " --output DIR`."]
    write_atomic(out / "sweeps.json", json.dumps(paired_json(data), indent=1))
    write_atomic(out / "summary.md", "\n".join(lines) + "\n")
    return data
