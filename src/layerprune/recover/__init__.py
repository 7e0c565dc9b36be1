"""Recover a pruned model: the original model answers prompts, the pruned one is fine-tuned on the answers."""

from layerprune.recover.schema import RecoverRecipe

__all__ = ["RecoverRecipe"]
