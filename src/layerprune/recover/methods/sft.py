"""Supervised fine-tuning on the teacher's answers with TRL's SFTTrainer: lora, qlora (4-bit NF4 base, CUDA) and full.

No teacher in memory while training; the held-out CE and KL(teacher || student) are measured when saving, on the
saved weights (runner.save_outputs), as the distillation family measures them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import ModelSource, load_model
from layerprune.models.loading import device_map_kwargs, load_tokenizer
from layerprune.recover import budget, memory, train
from layerprune.recover.job import TrainResult, release_memory
from layerprune.recover.methods import MethodRun, PlanRequest, held_out_ids, plan_for, plan_training, recovery_method
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


def check_qlora(recipe: RecoverRecipe, settings: RunSettings) -> None:
    """qlora needs a CUDA GPU and bitsandbytes."""
    import torch

    if settings.resolved_device().type != "cuda" or not torch.cuda.is_available():
        raise LayerpruneError("method qlora needs a CUDA GPU (bitsandbytes 4-bit); on this machine use --method lora")
    from layerprune.core.extras import require_extra

    require_extra("qlora", "method qlora")


def plan_sft(request: PlanRequest) -> tuple[str, memory.MemoryPlan]:
    """The trainer's step as the recipe's method (lora, qlora, full) plans it."""
    return plan_training(request, request.recipe.method)


@recovery_method("full", needs_teacher=False, plan=plan_sft, adapter="full")
@recovery_method("qlora", needs_teacher=False, plan=plan_sft, check=check_qlora, adapter="lora")
@recovery_method("lora", needs_teacher=False, plan=plan_sft, adapter="lora")
def train_sft(run: MethodRun) -> TrainResult:
    """Stage 2 with TRL on the prompts every method trains on (the same held-out prompt ids); the weights saved
    through the trainer on every rank. The held-out CE/KL are measured when saving (runner.held_out_on_saved)."""
    from transformers import AutoConfig

    recipe, job = run.recipe, run.job
    start = time.perf_counter()
    held = held_out_ids(run.prompts, recipe.train.held_out, job.settings.seed)
    train_rows = budget.order([r for r in run.rows if r["id"] not in held], job.settings.seed)
    eval_rows = [r for r in run.rows if r["id"] in held]
    if not train_rows:
        raise LayerpruneError(
            "no responses left to train on after holding some out; add prompts or lower train.held_out"
        )
    device = job.settings.resolved_device()
    config = AutoConfig.from_pretrained(run.student.location, trust_remote_code=job.settings.trust_remote_code)
    tokenizer = load_tokenizer(run.student, job.settings)
    longest = train.longest_example(tokenizer, train_rows + eval_rows, recipe.generate)
    optimizer, plan = plan_for(recipe, config, job, cuda=device.type == "cuda",
                               seq_len=min(longest, recipe.train.max_length), teacher=run.teacher)
    for note in plan.notes:
        log.warning("memory plan: %s", note)
    if optimizer in memory.EIGHT_BIT:  # the plan switched to it
        from layerprune.core.extras import require_extra

        require_extra("qlora", f"the memory plan's optimizer {optimizer}")
    trainer_dir = job.work / "trainer"
    resume_from = train.prepare_trainer_dir(trainer_dir, job.resume, train.made_by(job))
    # the training config before the student: under DeepSpeed ZeRO-3 it makes from_pretrained partition the weights
    args = train.sft_config(recipe, trainer_dir, device, optimizer, job.settings.seed, has_eval=bool(eval_rows),
                            eval_on_start=resume_from is None)
    loaded = load_student(recipe, run.student, job.settings)
    gen, cap = recipe.generate, recipe.train.max_length
    eval_set = train.to_dataset(eval_rows, gen, loaded.tokenizer, cap) if eval_rows else None
    train_set = train.to_dataset(train_rows, gen, loaded.tokenizer, cap)
    trainer = train.make_trainer(recipe, loaded.model, loaded.tokenizer, args, train_set, eval_set)
    counter = budget.attach(trainer, recipe.train.max_tokens)
    budget.attach_snapshots(trainer, counter, job.snapshot_budgets, job.work / budget.SNAPSHOTS,
                            fresh=resume_from is None)
    budget.train(trainer, resume_from)
    before = train.loss_before(trainer.state.log_history) if eval_set is not None else None
    after = train.loss_after(trainer) if eval_set is not None else None
    log.info("held-out loss after training: %s (before %s)", _fmt(after), _fmt(before))
    saved = job.work / "final"
    trainer.save_model(str(saved))  # every rank: gathers FSDP / ZeRO-3 shards; the main process writes
    trainer.accelerator.wait_for_everyone()
    data = {
        "train_examples": len(train_rows),
        "held_out_examples": len(eval_rows),
        "train_response_tokens": sum(r.get("tokens", 0) for r in train_rows),
        "steps": trainer.state.global_step,
        "resumed_from_step": int(resume_from.name.split("-")[-1]) if resume_from else 0,
    }
    result = TrainResult(saved, before, after, train.loss_curve(trainer.state.log_history, before), plan, optimizer,
                         data, time.perf_counter() - start, int(trainer.state.num_input_tokens_seen or 0),
                         eval_rows=eval_rows, held_ids=held, training=counter.summary(trainer.state.global_step))
    del trainer, loaded
    release_memory()
    return result


def _fmt(value: float | None) -> str:
    return "n/a (nothing held out)" if value is None else f"{value:.4f}"


def load_student(recipe: RecoverRecipe, student: ModelSource, settings: RunSettings) -> Any:
    """The pruned model for training (4-bit NF4 for qlora)."""
    if recipe.method != "qlora":
        loaded = load_model(student, train.student_settings(recipe, settings))
        loaded.model.train()
        return loaded
    from peft import prepare_model_for_kbit_training

    loaded = load_model(
        student,
        settings.model_copy(update={"dtype": "bfloat16"}),
        quantization_config=train.quantization_config(),
        **device_map_kwargs(settings, whole=True),
    )
    loaded.model = prepare_model_for_kbit_training(
        loaded.model, use_gradient_checkpointing=recipe.train.gradient_checkpointing
    )
    return loaded
