"""opd: on-policy distillation (opd section): the student samples, the teacher scores every token.

Fully on-policy (opd.lmbda 1): TRL's DistillationTrainer on the training prompts, and the teacher answers only the
held-out prompts (the yardstick); mixed (lmbda < 1): TRL's GKD on the teacher's answers, that share of batches
replaced by the student's samples. Also the trainer of replace, merge and local's `then: opd`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from layerprune.recover import kd as trl_kd
from layerprune.recover.methods import TrainerInputs, held_out_ids, recovery_method
from layerprune.recover.methods.distill import plan_with_teacher, train_with_teacher
from layerprune.recover.schema import RecoverRecipe, Section
from layerprune.recover.selfgen import Prompt


class OpdSection(Section):
    """On-policy distillation (method opd): the student samples, the teacher scores every token."""

    beta: float = Field(1.0, ge=0, le=1, description="Divergence: 0 forward KL, 1 reverse KL, between: generalised JSD")
    lmbda: float = Field(1.0, ge=0, le=1, description="Share of batches on the student's own samples (1: all)")
    max_new_tokens: int = Field(128, ge=1, description="Longest student completion in tokens")
    temperature: float = Field(1.0, gt=0, description="Temperature of the student's samples and of "
                               "the divergence (opd.lmbda < 1, TRL GKD, cannot apply it to the divergence: 1 only)")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus top-p of the student's samples "
                       "(both paths)")
    adapter: Literal["lora", "full"] = Field("lora", description="Train LoRA adapters or all weights")


def opd_trainer(inputs: TrainerInputs) -> Any:
    """DistillationTrainer when every batch is the student's own (lmbda 1), else GKD with lmbda and beta."""
    recipe, loaded, opd = inputs.recipe, inputs.loaded, inputs.recipe.opd
    if opd.lmbda == 1.0:
        return trl_kd.opd_trainer(recipe, loaded.model, inputs.teacher, loaded.tokenizer, inputs.args, inputs.prompts,
                                  inputs.peft_config, inputs.callbacks)
    return trl_kd.gkd_trainer(recipe, loaded.model, inputs.teacher, loaded.tokenizer, inputs.args, inputs.rows,
                              opd.lmbda, opd.beta, inputs.peft_config, inputs.callbacks)


def held_out_prompts(recipe: RecoverRecipe, prompts: list[Prompt], seed: int) -> list[Prompt]:
    """Fully on-policy opd trains on no answer: the teacher answers the held-out prompts alone."""
    if recipe.opd.lmbda < 1:
        return prompts
    held = held_out_ids(prompts, recipe.train.held_out, seed)
    return [p for p in prompts if p.id in held]


def check_temperature(recipe: RecoverRecipe) -> None:
    """Mixed on-policy distillation (TRL GKD) samples at opd.temperature but computes its divergence at 1."""
    opd = recipe.opd
    if recipe.trainer_method() == "opd" and opd.lmbda < 1 and opd.temperature != 1:
        raise ValueError(
            f"opd.temperature {opd.temperature} with opd.lmbda {opd.lmbda}: mixed on-policy "
            "distillation (TRL GKD) samples at that temperature but computes its divergence at 1, while the fully "
            "on-policy path applies it to both; use opd.lmbda 1 or opd.temperature 1")


recovery_method("opd", needs_teacher=True, plan=plan_with_teacher, section=("opd", OpdSection), trainer=opd_trainer,
                answers=held_out_prompts, validate=check_temperature)(train_with_teacher)
