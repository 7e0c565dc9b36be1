"""merge: LaCo layer collapse (merge section): each dropped span folded into the kept block before it, kept while the
last hidden states stay close to the teacher's (recover/merge.py); then kd, opd or local."""

from __future__ import annotations

from typing import Any

from layerprune.recover import chain, heldout
from layerprune.recover import merge as laco
from layerprune.recover.methods import ChainStep, recovery_method
from layerprune.recover.methods.distill import plan_chain, train_with_teacher


def merge_step(step: ChainStep) -> list[dict[str, Any]]:
    """Merge every dropped span on calibration text (the first merge.calib_samples training answers)."""
    recipe, loaded = step.recipe, step.loaded
    dropped = chain.dropped_of(step.student, step.teacher, recipe.method)
    calib = heldout.encode_rows(loaded.tokenizer, step.rows[: recipe.merge.calib_samples], recipe.generate,
                                recipe.merge.max_length)
    return laco.merge_blocks(loaded.model, step.teacher, dropped, [ids for ids, _ in calib], recipe.merge.threshold,
                             recipe.merge.weight, recipe.merge.span_weights)


recovery_method("merge", needs_teacher=True, plan=plan_chain, section="merge", apply=merge_step)(train_with_teacher)
