"""local: span-local training after LLM-Streamline (local section): per dropped span, the kept block next to the cut
learns the span's map on the teacher's hidden states (recover/local.py); then kd or opd."""

from __future__ import annotations

from typing import Any

from layerprune.recover import chain, heldout
from layerprune.recover import local as streamline
from layerprune.recover.methods import ChainStep, recovery_method
from layerprune.recover.methods.distill import plan_chain, train_with_teacher


def local_step(step: ChainStep) -> list[dict[str, Any]]:
    """Train one kept block per dropped span (and, after a sublayer prune, each block that lost one sublayer) on the
    training answers; what each one's training did."""
    recipe, loaded = step.recipe, step.loaded
    dropped, partial = chain.removals_of(step.student, step.teacher, recipe.method)
    encoded = heldout.encode_rows(loaded.tokenizer, step.rows, recipe.generate, recipe.local.max_length)
    budget = chain.local_budget(recipe, len(encoded))
    fits = streamline.train_spans(loaded.model, step.teacher, dropped, [ids for ids, _ in encoded], recipe.local.block,
                                  budget, [len(ids) - start for ids, start in encoded], partial)
    return [{**fit, "learning_rate": budget.learning_rate} for fit in fits]


recovery_method("local", needs_teacher=True, plan=plan_chain, section="local", apply=local_step)(train_with_teacher)
