"""kd: distil the teacher's token distribution on its own answers, into LoRA adapters or every weight (kd section).

TRL's GKD (lmbda 0, beta 0: forward KL) where it computes the recipe's loss (kd.temperature 1, kd.weight 1), else the
KD loss of train.py (temperature and a cross-entropy share). Also the trainer of replace, merge and local's `then: kd`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from layerprune.recover import kd as trl_kd
from layerprune.recover import train
from layerprune.recover.methods import TrainerInputs, recovery_method
from layerprune.recover.methods.distill import plan_with_teacher, train_with_teacher
from layerprune.recover.schema import Section


class KdSection(Section):
    """Knowledge distillation from the teacher's token distribution (method kd)."""

    temperature: float = Field(1.0, gt=0, description="Softmax temperature of teacher and student")
    weight: float = Field(1.0, ge=0, le=1, description="Loss = weight * forward KL + (1 - weight) * cross-entropy")
    adapter: Literal["lora", "full"] = Field("lora", description="Train LoRA adapters or all weights")


def kd_trainer(inputs: TrainerInputs) -> Any:
    """GKD on the teacher's answers where it agrees with the recipe, else SFTTrainer with train.py's KD loss."""
    recipe, loaded = inputs.recipe, inputs.loaded
    if trl_kd.gkd_agrees(recipe):
        return trl_kd.gkd_trainer(recipe, loaded.model, inputs.teacher, loaded.tokenizer, inputs.args, inputs.rows,
                                  0.0, 0.0, inputs.peft_config, inputs.callbacks)
    adapter = recipe.adapter_of("kd")
    kd_recipe = recipe.model_copy(update={"method": "kd", "kd": recipe.kd.model_copy(update={"adapter": adapter})})
    job = inputs.job
    args = train.sft_config(kd_recipe, inputs.trainer_dir, job.settings.resolved_device(), inputs.optimizer,
                            job.settings.seed, has_eval=False)
    dataset = train.to_dataset(inputs.rows, recipe.generate, loaded.tokenizer, recipe.train.max_length)
    trainer = train.make_trainer(kd_recipe, loaded.model, loaded.tokenizer, args, dataset, None, inputs.teacher)
    for callback in inputs.callbacks:
        trainer.add_callback(callback)
    return trainer


recovery_method("kd", needs_teacher=True, plan=plan_with_teacher, section=("kd", KdSection), trainer=kd_trainer)(
    train_with_teacher)
