"""Stage 2 for the distillation family: kd (TRL GKD, lmbda 0), opd (TRL DistillationTrainer), replace (+ kd/opd).

All three hold the teacher next to the student, split the prompts (not the filtered answers) into train and
held-out with the run's seed, and measure held-out cross-entropy and KL(teacher || student) on the teacher's answers
to the held-out prompts before, during and after training (heldout.py): one yardstick for every method.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from layerprune.errors import LayerpruneError
from layerprune.models import ModelSource, load_model
from layerprune.models.lineage import PRUNE_REPORT, read_lineage
from layerprune.recover import budget, chain, heldout, kd, replace, selfgen, train
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)
DISTILL_METHODS = ("kd", "opd", "replace", "merge", "local")


def held_out_ids(prompts: list[selfgen.Prompt], held_out: float, seed: int) -> set[str]:
    """Ids of the held-out prompts, the same for every method (heldout.held_out_ids)."""
    return heldout.held_out_ids([p.id for p in prompts], held_out, seed)


def generation_prompts(recipe: RecoverRecipe, prompts: list[selfgen.Prompt], seed: int) -> list[selfgen.Prompt]:
    """The prompts the teacher must answer: all, or (fully on-policy opd: no answers to train on) the held-out ones."""
    if recipe.method != "opd" or recipe.opd.lmbda < 1:
        return prompts
    held = held_out_ids(prompts, recipe.train.held_out, seed)
    return [p for p in prompts if p.id in held]


def distill(recipe: RecoverRecipe, student: ModelSource, teacher_spec: str, rows: list[dict[str, Any]],
            prompts: list[selfgen.Prompt], job: Any) -> Any:
    """Train a method that reads the teacher's logits (kd, opd; for replace, first fold the maps, then its `then`);
    returns the runner's TrainResult (the weights saved through the trainer on every rank, written by the main one)."""
    from accelerate import PartialState

    from layerprune.recover.runner import TrainResult, plan_for, prepare_trainer_dir

    start = time.perf_counter()
    held = held_out_ids(prompts, recipe.train.held_out, job.settings.seed)
    train_rows = budget.order([r for r in rows if r["id"] not in held], job.settings.seed)  # every arm's order
    eval_rows = [r for r in rows if r["id"] in held]
    train_prompts = [p.text for p in budget.order([p for p in prompts if p.id not in held], job.settings.seed,
                                                  key=lambda p: p.id)]
    loaded = load_model(student, train.student_settings(recipe, job.settings))  # float32 master weights if full
    teacher = load_model(teacher_spec, job.settings).model.eval()
    device = job.settings.resolved_device()
    optimizer, plan = plan_for(recipe, loaded.model.config, job, cuda=device.type == "cuda")
    encoded = heldout.encode_rows(loaded.tokenizer, eval_rows, recipe.generate, recipe.train.max_length)
    metrics: dict[str, Any] = {"pruned": heldout.held_out_metrics(loaded.model, teacher, encoded) if encoded else None}
    data: dict[str, Any] = {"train_examples": len(train_rows), "train_prompts": len(train_prompts),
                            "held_out_examples": len(eval_rows), "held_out_tokens": sum(len(i) - s for i, s in encoded)}
    if recipe.method == "replace":
        data["replace"] = fold_replacement(recipe, loaded, teacher, student, train_rows)
    data.update(chain.run_steps(recipe, loaded, teacher, student, train_rows))  # merge, local (chain.py)
    if recipe.surgery_steps():
        metrics["replaced"] = heldout.held_out_metrics(loaded.model, teacher, encoded) if encoded else None
    method = recipe.trainer_method()
    model, curve, tokens, steps, trained = loaded.model, {"train": [], "held_out": []}, 0, 0, None
    saved, base = job.work / "final", None
    state = PartialState()
    if method is not None:
        if recipe.surgery_steps() and recipe.adapter_of(method) == "lora":  # the adapter merges into the surgery
            base = job.work / "replaced"
            if state.is_main_process:  # a whole checkpoint: the merge loads the model and its tokenizer from here
                loaded.model.save_pretrained(base, safe_serialization=True)
                loaded.tokenizer.save_pretrained(base)
            state.wait_for_everyone()
        trainer_dir = job.work / "trainer"
        resume_from = prepare_trainer_dir(trainer_dir, job.resume)
        callback = heldout.HeldOutCallback(teacher, encoded)
        trainer = make_trainer(recipe, method, loaded, teacher, train_rows, train_prompts, job, optimizer, trainer_dir,
                               callback)
        counter = budget.attach(trainer, recipe.train.max_tokens)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        model, steps = trainer.model, trainer.state.global_step
        trained = counter.summary(steps)
        curve = training_curve(trainer.state.log_history, callback.points, metrics)
        tokens = tokens_trained(trainer)
        data["trainer"] = type(trainer).__name__
    metrics["after"] = heldout.held_out_metrics(model, teacher, encoded) if encoded else None
    steps += chain.local_steps(data)
    data.update(steps=steps, held_out_metrics=metrics)
    before, after = (metrics["pruned"] or {}).get("ce"), (metrics["after"] or {}).get("ce")
    log.info("held-out CE %s -> %s, KL %s -> %s", _f(before), _f(after), _f((metrics["pruned"] or {}).get("kl")),
             _f((metrics["after"] or {}).get("kl")))
    if method is not None:  # every rank: the trainer gathers FSDP / ZeRO-3 shards, the main process writes
        trainer.save_model(str(saved))  # an adapter alone where one was trained: merged on the main process
        trainer.accelerator.wait_for_everyone()
    elif state.is_main_process:  # surgery alone (replace, merge, local): the weights, as every rank holds them whole
        model.save_pretrained(saved, safe_serialization=True)
        loaded.tokenizer.save_pretrained(saved)
        if any(step in chain.NEW_STEPS for step in recipe.surgery_steps()):
            data["verified"] = chain.verify_saved(model, saved, [ids for ids, _ in encoded])
    state.wait_for_everyone()
    tokens += chain.local_tokens(data)
    if method is None and data.get("local"):  # no trainer: the curve is the local step's span MSE, span after span
        curve = {"local_mse": chain.local_curve(data)}
    held_out = heldout.report_metrics(metrics["pruned"], metrics["after"], held,
                                      **({"replaced": metrics["replaced"]} if "replaced" in metrics else {}))
    return TrainResult(saved, before, after, curve, plan, optimizer, data, time.perf_counter() - start, tokens,
                       held_out=held_out, base=base, training=budget.combine(chain.local_training(data), trained))


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def fold_replacement(recipe: RecoverRecipe, loaded: Any, teacher: Any, student: ModelSource,
                     rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fit and fold the per-run maps on calibration text: the teacher's answers to training prompts."""
    dropped = dropped_blocks(student)
    calib = rows[: recipe.replace.calib_samples]
    if not calib:
        raise LayerpruneError("replace needs calibration text: no teacher answers left for training prompts")
    encoded = heldout.encode_rows(loaded.tokenizer, calib, recipe.generate, recipe.replace.max_length)
    return replace.replace_blocks(loaded.model, teacher, dropped, [ids for ids, _ in encoded], recipe.replace.ridge)


def dropped_blocks(student: ModelSource) -> list[int]:
    lineage = read_lineage(Path(student.location))
    if lineage is None or not lineage.dropped:
        raise LayerpruneError(f"replace needs the dropped blocks: {Path(student.location) / PRUNE_REPORT} is missing "
                              "or lists none")
    return lineage.dropped


def make_trainer(recipe: RecoverRecipe, method: str, loaded: Any, teacher: Any, rows: list[dict[str, Any]],
                 prompts: list[str], job: Any, optimizer: str, trainer_dir: Path, callback: Any) -> Any:
    """GKD for kd (lmbda 0) and mixed opd (lmbda < 1); DistillationTrainer for on-policy opd; else train.py's KD."""
    device = job.settings.resolved_device()
    adapter = recipe.adapter_of(method)
    peft_config = train.lora_config(recipe.lora) if adapter == "lora" else None
    common = train.training_arguments(recipe, trainer_dir, device, optimizer, job.settings.seed)
    loaded.model.train()
    if method == "opd" and recipe.opd.lmbda == 1.0:
        return kd.opd_trainer(recipe, loaded.model, teacher, loaded.tokenizer, common, prompts, peft_config, [callback])
    if method == "opd" or kd.gkd_agrees(recipe):
        lmbda, beta = (recipe.opd.lmbda, recipe.opd.beta) if method == "opd" else (0.0, 0.0)
        return kd.gkd_trainer(recipe, loaded.model, teacher, loaded.tokenizer, common, rows, lmbda, beta, peft_config,
                              [callback])
    kd_recipe = recipe.model_copy(update={"method": "kd", "kd": recipe.kd.model_copy(update={"adapter": adapter})})
    args = train.sft_config(kd_recipe, trainer_dir, device, optimizer, job.settings.seed, has_eval=False)
    trainer = train.make_trainer(kd_recipe, loaded.model, loaded.tokenizer, args,
                                 train.to_dataset(rows, recipe.generate, loaded.tokenizer, recipe.train.max_length),
                                 None, teacher)
    trainer.add_callback(callback)
    return trainer


def training_curve(log_history: list[dict[str, Any]], points: list[dict[str, float]],
                   metrics: dict[str, Any]) -> dict[str, list[list[float]]]:
    """Train loss (the method's own divergence) and held-out CE/KL (step 0: before training)."""
    start = metrics.get("replaced") or metrics.get("pruned")
    first = [{"step": 0, **start}] if start else []
    return {"train": [[e["step"], e["loss"]] for e in log_history if "loss" in e],
            "held_out_ce": heldout.curve_points(first + points, "ce"),
            "held_out_kl": heldout.curve_points(first + points, "kl")}


def tokens_trained(trainer: Any) -> int:
    """Tokens the student was trained on (prompt + completion), as the trainer counted them."""
    seen = int(getattr(trainer.state, "num_input_tokens_seen", 0) or 0)
    counted = [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]
    return max(seen, int(counted[-1]) if counted else 0)
