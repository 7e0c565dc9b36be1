"""Post-training (a stage): make a variant of a model that can reason, the ways paper A compares (SFT on gold
solutions, rejection-sampling fine-tuning, GRPO, distillation from a teacher)."""

from layerprune.posttrain import spec  # noqa: F401  (registers `variant:NAME` model specs)
from layerprune.posttrain.api import dry_run, make_variant
from layerprune.posttrain.schema import VariantRecipe

__all__ = ["VariantRecipe", "dry_run", "make_variant"]
