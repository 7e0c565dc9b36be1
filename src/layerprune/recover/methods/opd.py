"""opd: on-policy distillation (opd section): the student samples, the teacher scores every token.

Fully on-policy (opd.lmbda 1): TRL's DistillationTrainer on the training prompts, and the teacher answers only the
held-out prompts (the yardstick); mixed (lmbda < 1): TRL's GKD on the teacher's answers, that share of batches
replaced by the student's samples. Also the trainer of replace, merge and local's `then: opd`.
"""

from __future__ import annotations

from typing import Any

from layerprune.recover import kd as trl_kd
from layerprune.recover.methods import TrainerInputs, held_out_ids, recovery_method
from layerprune.recover.methods.distill import plan_with_teacher, train_with_teacher
from layerprune.recover.schema import RecoverRecipe
from layerprune.recover.selfgen import Prompt


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


recovery_method("opd", needs_teacher=True, plan=plan_with_teacher, section="opd", trainer=opd_trainer,
                answers=held_out_prompts)(train_with_teacher)
