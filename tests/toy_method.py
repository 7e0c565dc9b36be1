"""A toy recovery method with its own recipe section: this module and its one `recovery_method` line are all it takes
(no edit to recover/schema.py, the study engine or the reports). It multiplies the final norm's weight by
`toy.factor` and trains nothing; `toy.learning_rate` is the rate a study's lr_grid sets (its `lr_section`)."""

from __future__ import annotations

from pydantic import Field

from layerprune.models import load_model
from layerprune.recover.job import TrainResult
from layerprune.recover.memory import MemoryPlan
from layerprune.recover.methods import MethodRun, PlanRequest, held_out_ids, plan_for, plan_training, recovery_method
from layerprune.recover.schema import Section


class ToySection(Section):
    """Toy scaling (method toy): the final norm's weight times a factor."""

    factor: float = Field(2.0, gt=0, description="Multiply the final norm's weight by this")
    learning_rate: float | None = Field(None, gt=0, description="The rate a study's lr_grid sets (recorded only)")


def plan_toy(request: PlanRequest) -> tuple[str, MemoryPlan]:
    return plan_training(request, "full")


def scale_norm(run: MethodRun) -> TrainResult:
    """Scale the student's final norm by toy.factor and save it (the runner measures the held-out loss)."""
    import torch

    loaded = load_model(run.student, run.job.settings)
    with torch.no_grad():
        loaded.model.model.norm.weight.mul_(run.recipe.toy.factor)
    saved = run.job.work / "final"
    loaded.model.save_pretrained(saved)
    loaded.tokenizer.save_pretrained(saved)
    optimizer, plan = plan_for(run.recipe, loaded.model.config, run.job, cuda=False)
    held = held_out_ids(run.prompts, run.recipe.train.held_out, run.job.settings.seed)
    return TrainResult(saved, None, None, {"train": []}, plan, optimizer, {"scaled": run.recipe.toy.factor}, 0.0, 0,
                       eval_rows=[r for r in run.rows if r["id"] in held], held_ids=held)


recovery_method("toy", needs_teacher=False, plan=plan_toy, section=("toy", ToySection), lr_section="toy")(scale_norm)
