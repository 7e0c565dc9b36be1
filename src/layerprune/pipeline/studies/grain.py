"""The grain study: whole blocks, attention sublayers or MLP sublayers removed at matched savings, before and after one
recovery, every model scored on the same items.

Matched savings (prune/matched.py): at each level k the block arm removes the k lowest-ranked blocks (its own one-shot
ranking) and each finer grain the prefix of its own ranking that saves about as much (parameters, KV-cache bytes per
token, or the speedup measured at the plan stage); a level no servable prefix can reach is refused before any scoring
(`check_reachable`, from the block order); every measurement is kept in the plan.

Stages (each skipped when its output is complete): score-GRAIN (one scoring pass per grain, nothing saved:
scored/GRAIN.json), plan (grain_plan.json: every cell's removals and savings), prune-GRAIN-kK (pruned/GRAIN-kK/: whole
blocks cut from the files, sublayers saved in the Nemotron-NAS layout), eval-baseline, the k = 0 controls
(recover-control[@rR], eval-control[@rR]: the recovery applied to the original itself), per cell eval-pruned-GRAIN-kK
and, per replicate, recover-GRAIN-kK[@rR] and eval-GRAIN-kK[@rR] (recovered/GRAIN-kK[@rR]/), and the report
(grain_report.py: grain.md, grain.json, grain.png). Replicate r trains with the run seed + r; greedy teacher answers
are generated once and shared by every recovery.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.settings import RunSettings
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.studies.cells import data_dir_of, recover_replicate
from layerprune.pipeline.studies.grain_grid import CONTROL, PLAN_FILE, GrainStudy, cells, replicas
from layerprune.prune.matched import config_sizes, measured_speed, order_rankings, plan_matched
from layerprune.recover.job import leftover_of

if TYPE_CHECKING:
    from layerprune.prune.target import ModelSizes, Removal

log = logging.getLogger(__name__)


# --- matched savings (prune/matched.py plans them) ----------------------------------------------------------------

def check_reachable(study: GrainStudy, settings: RunSettings) -> None:
    """Refuse, before any scoring or pruning, a level that no servable prefix of a finer grain matches: the plan from
    the block order (`order_rankings`), one line from `matched_prefix` where it fails."""
    sizes = study_sizes(study, settings)
    depth = len({r for r in sizes.costs if isinstance(r, int)})
    plan_matched(study, sizes, order_rankings(study.grains, depth, study.prune.protected_blocks(depth)))


def study_sizes(study: GrainStudy, settings: RunSettings) -> ModelSizes:
    """Per-removal costs of the original, from its config (the hub's, or a known public shape offline)."""
    from layerprune.pipeline.plan import model_config

    config, note = model_config(study.model, settings)
    if config is None:
        raise LayerpruneError(f"the grain study prices removals from the config: {note}")
    return config_sizes(config)


# --- stages ----------------------------------------------------------------------------------------------------------

def score_file(root: Path, grain: str) -> Path:
    return root / "scored" / f"{grain}.json"


def score_grain(study: GrainStudy, settings: RunSettings, root: Path, grain: str) -> None:
    """One one-shot scoring pass of every candidate at `grain` (nothing saved): scored/GRAIN.json."""
    from layerprune.prune.api import prune_model

    fields = study.prune.model_dump(exclude={"drop", "layers", "granularity"})
    recipe = study.prune.model_validate({**fields, "granularity": grain, "drop": 1})
    report = prune_model(study.model, recipe, settings, None, dry_run=True).report
    scores = report["scores"] if grain == "block" else report["sublayer_scores"]
    named = {str(i): s for i, s in enumerate(scores)} if grain == "block" else dict(scores)
    record = {"grain": grain, "score": study.prune.score, "scores": named,
              "protect": report["method"]["protect"], "depth": report["num_blocks_before"]}
    write_atomic(score_file(root, grain), json.dumps(record, indent=1))


def read_ranking(root: Path, grain: str) -> list[Removal]:
    """A grain's candidates least important first, protected blocks left out: blocks by score (ties: the later block
    first); sublayers in `servable_order`, so that every prefix is one the Nemotron-NAS layout serves (none longer)."""
    from layerprune.models.sublayers import parse_sublayer
    from layerprune.prune.sublayer_scores import servable_order
    from layerprune.prune.target import rank_removals

    record = json.loads(score_file(root, grain).read_text())
    removals = [int(k) if grain == "block" else parse_sublayer(k) for k in record["scores"]]
    protected = set(record["protect"])
    kept = [(s, r) for s, r in zip(record["scores"].values(), removals, strict=True)
            if (r if isinstance(r, int) else r.block) not in protected]
    if grain == "block":
        return rank_removals([s for s, _ in kept], [r for _, r in kept])
    return servable_order({r: s for s, r in kept}, record["depth"])  # type: ignore[misc]


def make_plan(study: GrainStudy, settings: RunSettings, root: Path) -> None:
    """grain_plan.json: every cell's removals and savings from the rankings."""
    speed, bench = measured_speed(study.model, settings, study.speed_repeats) if study.match == "speedup" \
        else (None, None)
    plan = plan_matched(study, study_sizes(study, settings), {g: read_ranking(root, g) for g in study.grains}, speed)
    write_atomic(root / PLAN_FILE, json.dumps({"match": study.match, "tolerance": study.tolerance,
                                               **({"timing": bench} if bench else {}), "cells": plan}, indent=1))


def read_plan(root: Path) -> dict[str, Any]:
    return json.loads((root / PLAN_FILE).read_text())


def prune_cell(study: GrainStudy, settings: RunSettings, root: Path, name: str) -> None:
    """The cell's planned removals cut from the original (whole blocks, or sublayers in the Nemotron-NAS layout)."""
    from layerprune.prune.api import prune_model

    planned = read_plan(root)["cells"][name]
    fields = study.prune.model_dump(exclude={"drop", "layers", "granularity"})
    recipe = study.prune.model_validate({**fields, "granularity": planned["grain"], "layers": planned["removals"]})
    prune_model(study.model, recipe, settings, root / "pruned" / name, overwrite=True)


def model_path(study: GrainStudy, root: Path, label: str) -> str | None:
    """The model behind an evaluated label."""
    if label == "baseline":
        return study.model
    if label.startswith("pruned-"):
        return str(root / "pruned" / label.removeprefix("pruned-"))
    return str(root / ("controls" if label.split("@")[0] == CONTROL else "recovered") / label)


def evaluate_label(study: GrainStudy, settings: RunSettings, root: Path, label: str) -> None:
    from layerprune.evaluate.runner import evaluate_model

    first = root / "pruned" / cells(study)[0]  # the calibration items every pruned model records
    name = label.removeprefix("pruned-").split("@")[0]
    folder = root / "pruned" / name if (root / "pruned" / name).is_dir() else first
    evaluate_model(model_path(study, root, label), study.evaluate, settings, root / "eval" / label, overwrite=True,
                   progress=lambda message: log.info("  %s: %s", label, message), calibration_from=folder)


def recover_label(study: GrainStudy, settings: RunSettings, root: Path, label: str, replicate: int) -> None:
    """One replicate of the recovery of a cell (or, for the control, of the original), sharing the teacher answers."""
    logical = label.split("@")[0]
    if logical == CONTROL:
        from layerprune.pipeline.student import original_as_student

        student, output = original_as_student(study.model, settings, root / "control-student"), root / "controls"
    else:
        student, output = root / "pruned" / logical, root / "recovered"
    recover_replicate(study.arm_recipe(str(student)), output / label, root, settings, replicate, data_dir_of(study))


def study_stages(study: GrainStudy, settings: RunSettings, root: Path) -> list[Stage]:
    """Every stage in order, each complete when its output exists; the report is redrawn after any work."""
    def stage(name: str, output: Path, action: Any, *args: Any) -> Stage:
        return Stage(name, output, functools.partial(action, study, settings, root, *args), refresh=name == "report",
                     leftover=leftover_of(output))

    def evaluation(label: str) -> Stage:
        return stage(f"eval-{label}", root / "eval" / label / SUMMARY_FILE, evaluate_label, label)

    def recoveries(logical: str, folder: str) -> list[Stage]:
        return [s for r, label in enumerate(replicas(study, logical)) for s in (
            stage(f"recover-{label}", root / folder / label / "recover_report.json", recover_label, label, r),
            evaluation(label))]

    return [*(stage(f"score-{g}", score_file(root, g), score_grain, g) for g in study.grains),
            stage("plan", root / PLAN_FILE, make_plan),
            *(stage(f"prune-{name}", root / "pruned" / name / "prune_report.json", prune_cell, name)
              for name in cells(study)),
            evaluation("baseline"),
            *(recoveries(CONTROL, "controls") if study.controls else []),
            *(s for name in cells(study) for s in (evaluation(f"pruned-{name}"), *recoveries(name, "recovered"))),
            stage("report", root / "grain.md", write_report)]


def write_report(study: GrainStudy, settings: RunSettings, root: Path) -> None:
    from layerprune.pipeline.studies.grain_report import write_grain_report

    write_grain_report(study, root)


def run_study(study: GrainStudy, settings: RunSettings, overwrite: bool = False) -> Path:
    """Run every incomplete stage in order; return grain.md."""
    from layerprune.pipeline.plan import validate_data
    from layerprune.pipeline.stages import RunPaths, claim_run_dir

    root = study.run_dir()
    pending = overwrite or not (root / PLAN_FILE).exists()
    if pending:
        check_reachable(study, settings)
    validate_data(study, settings, prune_pending=pending)
    claim_run_dir(RunPaths(root), study, overwrite)
    run_stages(study_stages(study, settings, root), root)
    return root / "grain.md"


# --- the dry run -----------------------------------------------------------------------------------------------------


