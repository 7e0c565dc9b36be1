"""merge: LaCo layer collapse (merge section): each dropped span folded into the kept block before it, kept while the
last hidden states stay close to the teacher's (recover/merge.py); then kd, opd or local."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from layerprune.recover import chain, heldout
from layerprune.recover import merge as laco
from layerprune.recover.methods import ChainStep, recovery_method
from layerprune.recover.methods.distill import plan_chain, train_with_teacher
from layerprune.recover.schema import RecoverRecipe, Section


class MergeSection(Section):
    """Layer collapse after LaCo (method merge, arXiv 2402.11187): each dropped span's attention and MLP parameter
    differences added to the kept block before it (RDSC: anchor <- anchor + sum over the span of (block - anchor), the
    source model's weights, norms left as they are), kept only while the mean cosine similarity of the model's last
    hidden states with the teacher's on calibration text stays above the threshold (else that span stays a plain
    drop). Unlike LaCo, the spans are the prune stage's, not found by LaCo's own top-down search."""

    threshold: float = Field(0.65, ge=-1, le=1, description="LaCo's T: a span's merge is kept only if the mean cosine "
                             "similarity of the last hidden states with the teacher's exceeds it (0.65: the paper's "
                             "value for Llama2-7B; -1 keeps every merge, 1 none)")
    calib_samples: int = Field(5, ge=1, description="Teacher responses (prompt + answer) on which the similarity is "
                               "measured (LaCo: 5 sentences)")
    max_length: int = Field(512, ge=8, description="Longest calibration sequence in tokens")
    weight: float = Field(1.0, ge=0, description="Not part of LaCo: per-span weight w of the summed differences (1, "
                          "the default: LaCo's RDSC; 0: plain pruning)")
    span_weights: list[float] | None = Field(None, description="Not part of LaCo: one weight per dropped span, in "
                                             "block order (overrides weight)")
    then: Literal["none", "kd", "opd", "local"] = Field(
        "none", description="After the merge: distil (kd or opd sections apply) or train the merged block locally")

    @field_validator("span_weights")
    @classmethod
    def _non_negative(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and (not weights or min(weights) < 0):
            raise ValueError("merge.span_weights must list one weight >= 0 per dropped span")
        return weights


def merge_step(step: ChainStep) -> list[dict[str, Any]]:
    """Merge every dropped span on calibration text (the first merge.calib_samples training answers)."""
    recipe, loaded = step.recipe, step.loaded
    dropped = chain.dropped_of(step.student, step.teacher, recipe.method)
    calib = heldout.encode_rows(loaded.tokenizer, step.rows[: recipe.merge.calib_samples], recipe.generate,
                                recipe.merge.max_length)
    return laco.merge_blocks(loaded.model, step.teacher, dropped, [ids for ids, _ in calib], recipe.merge.threshold,
                             recipe.merge.weight, recipe.merge.span_weights)


def describe_merge(recipe: RecoverRecipe) -> str:
    """A study's line for a merge that nothing trains after."""
    return ("LaCo's merge of each dropped span's attention and MLP differences into the block before it, kept above "
            f"cosine similarity {recipe.merge.threshold}")


recovery_method("merge", needs_teacher=True, plan=plan_chain, section=("merge", MergeSection), apply=merge_step,
                lr_section=None, needs_cut=True, reload_check=True, untrained=describe_merge)(train_with_teacher)
