"""replace: training-free block replacement (replace section): one least-squares linear map per dropped run, fitted
on the teacher's answers and folded into the kept block before it (recover/replace.py); then kd, opd or local."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from layerprune.core.errors import LayerpruneError
from layerprune.models import ModelSource
from layerprune.models.lineage import PRUNE_REPORT, read_lineage
from layerprune.recover import heldout, memory
from layerprune.recover import replace as folding
from layerprune.recover.methods import ChainStep, PlanRequest, recovery_method
from layerprune.recover.methods.distill import plan_surgery, plan_with_teacher, train_with_teacher
from layerprune.recover.schema import Section


class ReplaceSection(Section):
    """Training-free block replacement (method replace): one least-squares linear map per dropped run."""

    calib_samples: int = Field(64, ge=1, description="Teacher responses (prompt + answer) used as calibration text")
    max_length: int = Field(512, ge=8, description="Longest calibration sequence in tokens")
    ridge: float = Field(1e-4, ge=0, description="Ridge term, relative to the mean diagonal of the normal equations")
    then: Literal["none", "kd", "opd", "local"] = Field(
        "none", description="After the fold: distil (kd or opd sections apply) or train the folded block locally")


def fold_replacement(step: ChainStep) -> list[dict[str, Any]]:
    """Fit and fold the per-run maps on calibration text: the teacher's answers to training prompts."""
    recipe = step.recipe
    dropped = dropped_blocks(step.student)
    calib = step.rows[: recipe.replace.calib_samples]
    if not calib:
        raise LayerpruneError("replace needs calibration text: no teacher answers left for training prompts")
    encoded = heldout.encode_rows(step.loaded.tokenizer, calib, recipe.generate, recipe.replace.max_length)
    return folding.replace_blocks(step.loaded.model, step.teacher, dropped, [ids for ids, _ in encoded],
                                  recipe.replace.ridge)


def dropped_blocks(student: ModelSource) -> list[int]:
    lineage = read_lineage(Path(student.location))
    if lineage is None or not lineage.dropped:
        raise LayerpruneError(f"replace needs the dropped blocks: {Path(student.location) / PRUNE_REPORT} is missing "
                              "or lists none")
    return lineage.dropped


def plan_replace(request: PlanRequest) -> tuple[str, memory.MemoryPlan]:
    """Then local: the surgery plan; otherwise planned as kd (the fold alone too: the teacher beside the student)."""
    recipe = request.recipe
    if recipe.trainer_method() is None and any(m.caches_states for m in recipe.chain_methods()):
        return plan_surgery(request)
    return plan_with_teacher(request)


recovery_method("replace", needs_teacher=True, plan=plan_replace, section=("replace", ReplaceSection),
                apply=fold_replacement, lr_section=None, needs_cut=True,
                untrained=lambda recipe: "a least-squares fit on calibration text (forward passes only)")(
    train_with_teacher)
