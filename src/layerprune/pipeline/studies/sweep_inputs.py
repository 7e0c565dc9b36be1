"""What each of a sweep's stages is given when it runs, read from the records of the stages before it (the grid and
its labels are sweep_grid.py's): the tasks an eval stage scores (the probe gate's kept levels, GSM8K where the original
passed its gate), the blocks a prune stage drops (the scoring pass's ranking), and the tasks whose prompts the recovery
trained on."""

from __future__ import annotations

from pathlib import Path

from layerprune.pipeline.studies.cells import CALIBRATION_FILE
from layerprune.pipeline.studies.sweep_cells import gate_summary
from layerprune.pipeline.studies.sweep_grid import (
    GSM8K,
    SweepStudy,
    fixed_probes,
    gsm8k_gated,
)


def evaluated_tasks(study: SweepStudy, root: Path) -> list[str]:
    """Classification tasks, the fixed tasks, the kept probe levels, and GSM8K where the original passed the gate
    (or where it is fixed)."""
    from layerprune.evaluate.summary import read_summary

    tasks = [*study.classification, *study.fixed, *kept_levels(study, root)]
    if not gsm8k_gated(study):
        return tasks
    gate = read_summary(gate_summary(root)).headlines()[GSM8K]
    assert study.gsm8k_gate is not None
    return tasks + ([GSM8K] if gate.value >= study.gsm8k_gate.min_score else [])


def kept_levels(study: SweepStudy, root: Path) -> list[str]:
    """The probe levels the gate kept ([] without a gate)."""
    from layerprune.evaluate.calibrated import kept_tasks

    return kept_tasks(root / CALIBRATION_FILE) if study.probes is not None else []


def chat_tasks(study: SweepStudy, root: Path) -> list[str]:
    """The probe tasks every model is scored on: the fixed probe tasks and the kept levels."""
    return list(dict.fromkeys([*fixed_probes(study), *kept_levels(study, root)]))


def ranking(root: Path, ratios: list[int], layers: list[int] | None = None) -> dict[int, list[int]]:
    """The blocks each k drops: the k lowest of the one scoring pass (the largest k is what the pass dropped); the
    given cut (`layers`, prune.layers of a one-k sweep) as it is."""
    from layerprune.prune.metrics import select_lowest
    from layerprune.prune.report import read_prune_report

    if layers is not None:
        return {ratios[0]: sorted(layers)}
    report = read_prune_report(root / "scored")
    cuts = {k: select_lowest(report.scores, k, report.method.protect) for k in ratios}
    assert cuts[ratios[-1]] == sorted(report.dropped), "the scoring pass dropped other blocks than its ranking's lowest"
    return cuts


def trained_tasks(study: SweepStudy, root: Path) -> frozenset[str]:
    """The scored tasks whose own prompts were in the shared recovery data (prompts.source), task by task: the probe
    tasks a `probes:a+b` source names, GSM8K for a GSM8K source; where the teacher's answers are kept (the shared
    file of replicate 0), only the tasks at least one kept prompt came from (a task whose prompts were all
    evaluation items, such as a shallow brackets depth, trained nothing). An arm trained on prompts of its own
    (arm_prompts) is not split by them: the split is the shared data's."""
    from layerprune.recover.prompts import is_gsm8k, probe_task_names, prompts_of_task
    from layerprune.tasks.data import iter_jsonl

    recipe = study.shared_recipe("<pruned>")
    source, names = recipe.prompts.source, probe_task_names(recipe.prompts.source)
    if names is None:
        return frozenset({GSM8K}) if is_gsm8k(source) else frozenset()
    from layerprune.pipeline.studies.cells import teacher_answers

    answers = root / teacher_answers(recipe, 0)
    if not answers.is_file():
        return frozenset(names)
    kept = {str(row["prompt"]) for row in iter_jsonl(answers)}
    return frozenset(n for n in names if kept & prompts_of_task(n, len(kept)))
