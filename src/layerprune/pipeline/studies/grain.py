"""The grain study: whole blocks, attention sublayers or MLP sublayers removed at matched savings, before and after one
recovery, every model scored on the same items.

Matched savings: at each level k the block arm removes the k lowest-ranked blocks (its own one-shot ranking); each finer
grain removes the shortest prefix of its own ranking (attention sublayers only, or MLP sublayers only, in
`servable_order`: every prefix one the Nemotron-NAS layout serves) whose removed parameters (or KV-cache bytes per
token, `match: kv-cache`) come closest to the block arm's, and the cell is refused in one line when even that prefix
is more than `tolerance` of the block arm's savings away; a level no servable prefix can reach is refused before any
scoring (`check_reachable`, from the block order). Costs are the model's own
parameters (prune/target.py's `model_sizes`: a sublayer owns its module and the norm in front of it).
`match: speedup` matches the measured speed instead: the plan stage loads the original, times the block arm's cut
against it (prefill and decode on the device the study runs on, the smaller ratio, as `--target speedup=` counts;
blocks dropped as a standard checkpoint runs, sublayers as the Nemotron-NAS layout runs them) and gives each finer
grain the prefix whose measured speedup is nearest (`matched_speed_prefix`), its gap counted on the speed gained
(speedup - 1); every measurement is kept in the plan.

Stages (each skipped when its output is complete): score-GRAIN (one scoring pass per grain, nothing saved:
scored/GRAIN.json), plan (grain_plan.json: every cell's removals and savings), prune-GRAIN-kK (pruned/GRAIN-kK/: whole
blocks cut from the files, sublayers saved in the Nemotron-NAS layout), eval-baseline, the k = 0 controls
(recover-control[@rR], eval-control[@rR]: the recovery applied to the original itself), per cell eval-pruned-GRAIN-kK
and, per replicate, recover-GRAIN-kK[@rR] and eval-GRAIN-kK[@rR] (recovered/GRAIN-kK[@rR]/), and the report
(grain_report.py: grain.md, grain.json, grain.png). Replicate r trains with the run seed + r; greedy teacher answers
are generated once and shared by every recovery.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.settings import RunSettings
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.studies.cells import data_dir_of, recover_replicate
from layerprune.pipeline.studies.grain_grid import (
    CONTROL,
    PARTS,
    PLAN_FILE,
    GrainStudy,
    cell,
    cells,
    replicas,
)
from layerprune.recover.job import leftover_of

if TYPE_CHECKING:
    from layerprune.prune.target import ModelSizes, Removal

log = logging.getLogger(__name__)
Speed = Callable[[list["Removal"]], float]  # a prefix's speedup over the original: measured, or the FLOP model's


# --- matched savings -------------------------------------------------------------------------------------------------

def quantity(cost: Any, match: str) -> int:
    """The matched quantity of a Cost: parameters, or KV-cache bytes per token."""
    return int(cost.params if match == "params" else cost.kv_bytes_per_token)


def matched_prefix(ranked: Sequence[Removal], sizes: ModelSizes, goal: int, match: str,
                   tolerance: float) -> list[Removal]:
    """The prefix of `ranked` (least important first) whose removed quantity is closest to `goal` (the shorter on a
    tie); a one-line error when its gap is above `tolerance` x goal."""
    best: list[Removal] = []
    gap = goal
    for n in range(1, len(ranked) + 1):
        got = quantity(sizes.removed(ranked[:n]), match)
        if abs(got - goal) < gap:
            best, gap = list(ranked[:n]), abs(got - goal)
        if got >= goal:
            break
    if goal <= 0 or gap > tolerance * goal:
        near = quantity(sizes.removed(best), match)
        raise LayerpruneError(f"cannot match {goal:,} {match} removed within {100 * tolerance:g}%: the nearest of "
                              f"{len(ranked)} candidates, {len(best)} removals, takes {near:,}; change levels or "
                              "tolerance")
    return best


def matched_speed_prefix(ranked: Sequence[Removal], sizes: ModelSizes, goal: float, speed: Speed,
                         tolerance: float) -> tuple[list[Removal], dict[int, float]]:
    """The timed prefix of `ranked` whose speedup (`speed`) is nearest `goal` (the shorter on a tie), and every prefix
    length timed. The search starts where the FLOP model predicts the goal, goes up while the speedup falls short or
    down while the shorter prefix still reaches it, so it times the prefixes on both sides of the goal; a noisy
    timing out of order is still compared. A one-line error when the gap, counted on the speed gained (goal - 1), is
    above `tolerance`."""
    if goal <= 1:
        raise LayerpruneError(f"the block arm measured {goal:.3f}x: no speed gained to match (raise the level)")
    timed: dict[int, float] = {}

    def at(n: int) -> float:
        if n not in timed:
            timed[n] = speed(list(ranked[:n]))
        return timed[n]

    n = next((n for n in range(1, len(ranked) + 1) if sizes.predicted(ranked[:n])["speedup"] >= goal), len(ranked))
    if at(n) >= goal:
        while n > 1 and at(n - 1) >= goal:
            n -= 1
    else:
        while at(n) < goal and n < len(ranked):
            n += 1
    best = min(timed, key=lambda c: (abs(timed[c] - goal), c))
    gap = (at(best) - goal) / (goal - 1)
    if abs(gap) > tolerance:
        raise LayerpruneError(f"cannot match the block arm's {goal:.3f}x within {100 * tolerance:g}% of its speed "
                              f"gain: the nearest of {len(ranked)} candidates, {best} removals, measured "
                              f"{at(best):.3f}x; change levels or tolerance")
    return list(ranked[:best]), timed


def plan_cells(study: GrainStudy, sizes: ModelSizes, rankings: dict[str, list[Removal]],
               speed: Speed | None = None) -> dict[str, Any]:
    """Every cell's removals and savings: the block arm's k lowest-ranked blocks, each finer grain's matched prefix
    (`match: speedup`: matched on `speed`, the FLOP model's prediction where none is given)."""
    out: dict[str, Any] = {}
    for level in study.levels:
        blocks = rankings["block"][:level]
        if len(blocks) < level:
            raise LayerpruneError(f"level {level}: only {len(blocks)} blocks can be removed")
        if study.match == "speedup":
            out.update(_speed_cells(study, sizes, rankings, level, speed or _predicted_speed(sizes)))
            continue
        goal = quantity(sizes.removed(blocks), study.match)
        for grain in study.grains:
            chosen = blocks if grain == "block" else matched_prefix(rankings[grain], sizes, goal, study.match,
                                                                    study.tolerance)
            out[cell(grain, level)] = {**_savings(sizes, grain, level, chosen),
                                       "gap": (quantity(sizes.removed(chosen), study.match) - goal) / goal}
    return out


def _speed_cells(study: GrainStudy, sizes: ModelSizes, rankings: dict[str, list[Removal]], level: int,
                 speed: Speed) -> dict[str, Any]:
    blocks = rankings["block"][:level]
    goal = speed(list(blocks))
    out = {cell("block", level): {**_savings(sizes, "block", level, blocks), "speedup": goal, "gap": 0.0}}
    for grain in study.grains[1:]:
        chosen, timed = matched_speed_prefix(rankings[grain], sizes, goal, speed, study.tolerance)
        out[cell(grain, level)] = {**_savings(sizes, grain, level, chosen), "speedup": timed[len(chosen)],
                                   "gap": (timed[len(chosen)] - goal) / (goal - 1),
                                   "timed": {str(n): v for n, v in sorted(timed.items())}}
    return out


def _savings(sizes: ModelSizes, grain: str, level: int, chosen: Sequence[Removal]) -> dict[str, Any]:
    total, removed = sizes.total, sizes.removed(chosen)
    return {"grain": grain, "level": level,
            "removals": [r if isinstance(r, int) else str(r) for r in sorted(chosen, key=_order)],
            "params_removed": removed.params, "params_fraction": removed.params / total.params,
            "kv_fraction": removed.kv_bytes_per_token / max(total.kv_bytes_per_token, 1),
            "predicted_speedup": sizes.predicted(chosen)["speedup"]}


def _predicted_speed(sizes: ModelSizes) -> Speed:
    return lambda removals: float(sizes.predicted(removals)["speedup"])


def measured_speed(study: GrainStudy, settings: RunSettings) -> tuple[Speed, dict[str, Any]]:
    """The original loaded once; a prefix's speedup over it timed on `--target speedup=`'s benchmark with 32 decode
    steps (prefill and decode, the smaller ratio, alternately with the original, the fastest of `speed_repeats`). On
    a CPU: this process's CPU seconds on one thread (other loads do not count; timed on two threads, the CPU clock
    put 24 attention sublayers at 1.12x where one thread or the wall clock gives 1.29-1.31x, most likely by counting
    the threads' spin-waits); on an accelerator: the wall clock. Returns the speed function and the benchmark as the
    plan records it."""
    import dataclasses

    import torch

    from layerprune.models import load_model
    from layerprune.models.speed import SpeedBench, measured_removal_speedup

    model = load_model(study.model, settings).model.eval()
    cpu = model.device.type == "cpu"
    bench = SpeedBench(new_tokens=32, repeats=study.speed_repeats, clock="cpu" if cpu else "wall")

    def speed(removals: list[Removal]) -> float:
        with _threads(1 if cpu else None):
            return measured_removal_speedup(model, removals, bench)["speedup"]

    return speed, {**dataclasses.asdict(bench), "device": str(model.device),
                   "threads": 1 if cpu else torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype)}


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `count` for the block (None: as they are), restored after."""
    import torch

    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _order(removal: Removal) -> tuple[int, str]:
    return (removal, "") if isinstance(removal, int) else (removal.block, removal.part)


def order_rankings(study: GrainStudy, depth: int, protected: Sequence[int]) -> dict[str, list[Removal]]:
    """Every grain's candidates in the order a tie leaves them (later block first), each sublayer grain cut where the
    Nemotron-NAS layout stops serving its prefix (`servable_order`): the dry run's stand-in for the scores, exact in
    count wherever the blocks are alike."""
    from layerprune.models.sublayers import Sublayer
    from layerprune.prune.sublayer_scores import servable_order

    order = [b for b in reversed(range(depth)) if b not in protected]
    return {grain: list(order) if grain == "block"  # type: ignore[misc]
            else servable_order({Sublayer(b, PARTS[grain]): 0.0 for b in order}, depth)  # type: ignore[arg-type]
            for grain in study.grains}


def check_reachable(study: GrainStudy, settings: RunSettings) -> None:
    """Refuse, before any scoring or pruning, a level that no servable prefix of a finer grain matches: the plan from
    the block order (`order_rankings`), one line from `matched_prefix` where it fails."""
    sizes = study_sizes(study, settings)
    depth = len({r for r in sizes.costs if isinstance(r, int)})
    plan_cells(study, sizes, order_rankings(study, depth, study.prune.protected_blocks(depth)))


def study_sizes(study: GrainStudy, settings: RunSettings) -> ModelSizes:
    """Per-removal costs of the original, from its config on the meta device (no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from layerprune.pipeline.plan import model_config
    from layerprune.prune.target import model_sizes

    config, note = model_config(study.model, settings)
    if config is None:
        raise LayerpruneError(f"the grain study prices removals from the config: {note}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model_sizes(model, torch.bfloat16)


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
    speed, bench = measured_speed(study, settings) if study.match == "speedup" else (None, None)
    plan = plan_cells(study, study_sizes(study, settings), {g: read_ranking(root, g) for g in study.grains}, speed)
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


