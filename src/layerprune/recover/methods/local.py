"""local: span-local training after LLM-Streamline (local section): per dropped span, the kept block next to the cut
learns the span's map on the teacher's hidden states (recover/local.py); then kd or opd."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from layerprune.recover import chain, heldout
from layerprune.recover import local as streamline
from layerprune.recover.methods import ChainStep, recovery_method
from layerprune.recover.methods.distill import plan_chain, train_with_teacher
from layerprune.recover.schema import Section


class LocalSection(Section):
    """Span-local training (method local, after LLM-Streamline): per dropped span, only the kept block next to the cut
    learns to map the teacher's hidden state entering it to the teacher's state leaving the span (MSE), on the
    training text (the teacher's answers to the prompts), its states cached one span at a time."""

    block: Literal["before", "after"] = Field(
        "before", description="Train the kept block before the span (input: the teacher's state entering that block, "
        "target: its state after the span) or the one after it (input: the state entering the span, target: the state "
        "after that block)")
    steps: int | None = Field(None, ge=1, description="Optimizer steps, shared out over the spans (default: "
                              "train.max_steps, else one pass over the training text)")
    learning_rate: float | None = Field(None, gt=0, description="AdamW learning rate (default: train.learning_rate)")
    max_length: int = Field(512, ge=8, description="Longest training sequence in tokens")
    then: Literal["none", "kd", "opd"] = Field("none", description="Distil after the local step (kd or opd sections)")


def local_step(step: ChainStep) -> list[dict[str, Any]]:
    """Train one kept block per dropped span (and, after a sublayer prune, each block that lost one sublayer) on the
    training answers; what each one's training did."""
    recipe, loaded = step.recipe, step.loaded
    dropped, partial = chain.removals_of(step.student, step.teacher, recipe.method)
    encoded = heldout.encode_rows(loaded.tokenizer, step.rows, recipe.generate, recipe.local.max_length)
    budget = chain.local_budget(recipe, len(encoded))
    fits = streamline.train_spans(loaded.model, step.teacher, dropped, [ids for ids, _ in encoded], recipe.local.block,
                                  budget, [len(ids) - start for ids, start in encoded], partial, step.states)
    return [{**fit, "learning_rate": budget.learning_rate} for fit in fits]


LOCAL_CONTROL_NOTE = ("With nothing removed, local's target (the original's hidden states after the cut) is what the "
                      "kept block already computes: its loss and gradient are zero, so its control would be the "
                      "original itself.")

recovery_method("local", needs_teacher=True, plan=plan_chain, section=("local", LocalSection), apply=local_step,
                lr_section="local", needs_cut=True, caches_states=True, reload_check=True,
                control_note=LOCAL_CONTROL_NOTE)(train_with_teacher)
