"""A sweep's time against its estimate (sweep_plan.py's phases at the measured 2-core rates): what its stages not yet
complete will take, and, where the runner timed stages (pipeline/runner.py: stage_times.json, every attempt of a stage
summed, an interrupted one too), how long the complete ones took beside what the estimate gave them, and the time left
at those ratios.

A phase's work is shared out over the cells that do it: evaluations by model; training and held-out evaluations by
the target tokens of each run (a learning-rate search: its runs at the smallest budget); teacher states by the
forwards of the runs that capture them (one a cut and seed where local's runs read each other's); the gates and each
set of teacher answers whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layerprune.pipeline.runner import stage_seconds
from layerprune.pipeline.studies.recovery_plan import states_seconds
from layerprune.pipeline.studies.sweep import states_folder
from layerprune.pipeline.studies.sweep_cells import Cell, cells
from layerprune.pipeline.studies.sweep_grid import DEDICATED, SweepStudy, arm_names

TRAINS = ("recover", "lr")
FAMILIES = {"eval": "evaluations", "chat": "chat-format evaluations", "recover": "recoveries"}  # the cells compared


def phase_shares(study: SweepStudy, chosen: Callable[[Cell], bool]) -> dict[str, float]:
    """Each phase's share of its work done by the `chosen` cells (teacher answers: the share of answer sets not yet
    on disk, whatever is chosen)."""
    root = study.run_dir()
    grid = [c for c in cells(study, root) if c.step != "report"]

    def tokens(cell: Cell) -> float:  # a run's target tokens (a learning-rate search: its runs at the smallest)
        own = study.budgets_of(cell.arm) or [1]
        return float(cell.budget or own[-1]) if cell.step == "recover" else \
            float(len(study.lr_grid.get(cell.arm or "", [])) * own[0])

    def share(pick: Any, weight: Any = lambda cell: 1.0) -> float:
        mine = [c for c in grid if pick(c)]
        total = sum(weight(c) for c in mine)
        return sum(weight(c) for c in mine if chosen(c)) / total if total else 0.0

    caching = {a for a in arm_names(study) if states_seconds(study, a) > 0}
    captures: dict[tuple[Any, ...], Cell] = {}  # the run that captures each cut and seed's states (the others read)
    for c in grid:
        if c.step == "recover" and c.arm in caching:
            captures.setdefault((c.arm, c.k, c.replicate, DEDICATED in c.name), c)

    def states(cell: Cell) -> float:  # forwards per dropped block, as states_seconds counts them
        if cell.step == "lr":
            return float(study.lr_k * (1 if states_folder(study, root, cell.arm, search=True)
                                       else len(study.lr_grid.get(cell.arm or "", []))))
        return float(cell.k) if captures.get((cell.arm, cell.k, cell.replicate,
                                              DEDICATED in cell.name)) is cell else 0.0

    out = {"calibrate": share(lambda c: c.step == "calibrate"), "gate": share(lambda c: c.step == "gate"),
           "evaluation": share(lambda c: c.step == "eval"), "chat-format probes": share(lambda c: c.step == "chat"),
           "held-out evaluations": share(lambda c: c.step in TRAINS, tokens),
           "teacher states": share(lambda c: c.step in TRAINS and c.arm in caching, states),
           "training": share(lambda c: c.step in TRAINS, tokens)}
    for arm in arm_names(study):
        out[f"training {arm}"] = share(lambda c, arm=arm: c.step in TRAINS and c.arm == arm, tokens)
        recipe = study.arm_recipe(arm, "<pruned>")
        sets = {study.answers_file(arm, recipe, r) for r in range(study.replicates)}  # one set unless sampled
        out["teacher answers" if arm not in study.arm_prompts else f"teacher answers {arm}"] = \
            sum(not (root / name).is_file() for name in sets) / len(sets)
    return out


def left_seconds(study: SweepStudy, seconds: dict[str, float], ratios: dict[str, float] | None = None,
                 among: Callable[[Cell], bool] = lambda cell: True) -> float:
    """The estimate's seconds still to spend (`among` the cells so chosen): each phase's times the share of its work
    whose stages are not complete; `ratios` (measured_ratios): each family's phases scaled by its measured /
    estimated time."""
    left = phase_shares(study, lambda c: not c.output.exists() and among(c))
    return sum(value * left.get(phase, 1.0) * (ratios or {}).get(family_of(phase), 1.0)
               for phase, value in seconds.items())


def order_line(study: SweepStudy, seconds: dict[str, float], ratios: dict[str, float] | None) -> str | None:
    """With run_order: the time left until each cut is whole, in the order the cuts run (None without one)."""
    if study.run_order is None:
        return None
    parts = []
    for index, k in enumerate(study.run_order):
        through = set(study.run_order[:index + 1])
        left = left_seconds(study, seconds, ratios, lambda c, through=through: c.cut is None or c.cut in through)
        parts.append(f"{'the k = 0 controls' if k == 0 else f'k = {k}'} whole after about {left / 60:.0f} min")
    return "in run order (run_order" + (", at the measured ratios" if ratios else "") + "): " + ", ".join(parts)


def family_of(phase: str) -> str:
    """The family of cells whose time measures a phase ('' where none does)."""
    if phase == "evaluation":
        return "eval"
    if phase == "chat-format probes":
        return "chat"
    return "recover" if phase.startswith("training") or phase in ("held-out evaluations", "teacher states") else ""


def measured(study: SweepStudy, seconds: dict[str, float]) -> dict[str, tuple[int, float, float]]:
    """Per family of cells (FAMILIES) complete and timed to their end by the runner: (how many, the seconds measured,
    the seconds the estimate gives them); families with none left out."""
    timed = stage_seconds(study.run_dir())
    complete = [c for c in cells(study, study.run_dir()) if c.name in timed and c.output.exists()]
    out = {}
    for family in FAMILIES:
        grid = [c for c in complete if c.step == family]
        if not grid:
            continue
        names = {c.name for c in grid}
        shares = phase_shares(study, lambda c, names=names: c.name in names)
        estimate = sum(v * shares.get(phase, 0.0) for phase, v in seconds.items() if family_of(phase) == family)
        out[family] = (len(grid), sum(timed[name] for name in names), estimate)
    return out


def measured_line(study: SweepStudy, seconds: dict[str, float]) -> str | None:
    """The dry run's lines on the stages the runner timed and the time left at their ratios, and with run_order the
    time until each cut is whole (None: neither)."""
    found = measured(study, seconds)
    ratios = {family: spent / estimate for family, (_, spent, estimate) in found.items() if estimate > 0}
    order = order_line(study, seconds, ratios)
    if not found:
        return order
    parts = [f"{FAMILIES[family]} {n} ({spent / 60:.0f} min; the estimate {estimate / 60:.0f} min"
             + (f", x{ratios[family]:.2f})" if family in ratios else ")")
             for family, (n, spent, estimate) in found.items()]
    left = left_seconds(study, seconds, ratios)
    return ("timed by the runner (stage_times.json, every attempt; a recovery's time holds the teacher answers it "
            f"made): {'; '.join(parts)}; left at these ratios about {left / 60:.0f} min") + (f"\n{order}" if order
                                                                                             else "")
