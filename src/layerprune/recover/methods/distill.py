"""The loop of every method that holds the teacher beside the student (kd, opd, replace, merge, local and their chains):
the block-changing steps in chain order, then the chain's trainer, if any.

Every one splits the prompts (not the filtered answers) into train and held-out with the run's seed, and measures
held-out cross-entropy and KL(teacher || student) on the teacher's answers to the held-out prompts before, during and
after training (heldout.py): one yardstick for every method.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerprune.models import load_model
from layerprune.recover import budget, chain, heldout, memory, train
from layerprune.recover.job import TrainResult
from layerprune.recover.methods import (
    METHODS,
    ChainStep,
    MethodRun,
    PlanRequest,
    TrainerInputs,
    held_out_ids,
    plan_for,
    plan_training,
)
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


def plan_with_teacher(request: PlanRequest) -> tuple[str, memory.MemoryPlan]:
    """A trainer's step with the teacher beside the student (planned as kd: its weights and logits counted)."""
    return plan_training(request, "kd", with_teacher=True)


def plan_surgery(request: PlanRequest) -> tuple[str, memory.MemoryPlan]:
    """A chain that ends without a trainer: the student, the teacher and local's cached states (chain.plan)."""
    return "none", chain.plan(request.recipe, request.shape, request.teacher or request.shape, request.weight_bytes,
                              request.job.memory_budget, request.seq_len)


def plan_chain(request: PlanRequest) -> tuple[str, memory.MemoryPlan]:
    """merge, local: without a trainer after them the surgery plan, else the trainer's with the teacher (as kd)."""
    return plan_surgery(request) if request.recipe.trainer_method() is None else plan_with_teacher(request)


def train_with_teacher(run: MethodRun) -> TrainResult:
    """Train a method that reads the teacher (the chain's block-changing steps, then its trainer); the weights saved
    through the trainer on every rank (or, without one, by the main process), written out by the runner."""
    recipe, job = run.recipe, run.job
    start = time.perf_counter()
    held = held_out_ids(run.prompts, recipe.train.held_out, job.settings.seed)
    train_rows = budget.order([r for r in run.rows if r["id"] not in held], job.settings.seed)  # every arm's order
    eval_rows = [r for r in run.rows if r["id"] in held]
    train_prompts = [p.text for p in budget.order([p for p in run.prompts if p.id not in held], job.settings.seed,
                                                  key=lambda p: p.id)]
    loaded = load_model(run.student, train.student_settings(recipe, job.settings))  # float32 master weights if full
    teacher = load_model(run.teacher, job.settings).model.eval()
    device = job.settings.resolved_device()
    optimizer, plan = plan_for(recipe, loaded.model.config, job, cuda=device.type == "cuda",
                               teacher_config=teacher.config)  # the teacher at its own size, not the student's
    encoded = heldout.encode_rows(loaded.tokenizer, eval_rows, recipe.generate, recipe.train.max_length)
    side = heldout.HeldOutTeacher(teacher, encoded)  # the teacher's held-out side, computed once on the CPU
    metrics: dict[str, Any] = {"pruned": heldout.held_out_metrics(loaded.model, side, encoded) if encoded else None}
    data: dict[str, Any] = {"train_examples": len(train_rows), "train_prompts": len(train_prompts),
                            "held_out_examples": len(eval_rows), "held_out_tokens": sum(len(i) - s for i, s in encoded)}
    data.update(apply_steps(ChainStep(recipe, loaded, teacher, run.student, train_rows, job.states)))
    if recipe.surgery_steps():
        metrics["replaced"] = heldout.held_out_metrics(loaded.model, side, encoded) if encoded else None
    trained = run_trainer(recipe, loaded, teacher, train_rows, train_prompts, job, optimizer, side, metrics, data)
    metrics["after"] = heldout.held_out_metrics(trained.model, side, encoded) if encoded else None
    side.release()  # the run's last evaluation: its memory back before the weights are saved and checked
    data.update(steps=trained.steps + chain.local_steps(data), held_out_metrics=metrics)
    before, after = (metrics["pruned"] or {}).get("ce"), (metrics["after"] or {}).get("ce")
    log.info("held-out CE %s -> %s, KL %s -> %s", _f(before), _f(after), _f((metrics["pruned"] or {}).get("kl")),
             _f((metrics["after"] or {}).get("kl")))
    saved = save_trained(recipe, trained, loaded, job.work / "final", encoded, data)
    curve = trained.curve
    if trained.trainer is None and data.get("local"):  # no trainer: the curve is the local step's span MSE
        curve = {"local_mse": chain.local_curve(data)}
    held_out = heldout.report_metrics(metrics["pruned"], metrics["after"], held,
                                      **({"replaced": metrics["replaced"]} if "replaced" in metrics else {}))
    return TrainResult(saved, before, after, curve, plan, optimizer, data, time.perf_counter() - start,
                       trained.tokens + chain.local_tokens(data), held_out=held_out, base=trained.base,
                       training=budget.combine(chain.local_training(data), trained.training))


def apply_steps(step: ChainStep) -> dict[str, Any]:
    """Run the recipe's block-changing steps on the loaded student, in chain order (replace or merge, then local);
    what each did, under its name."""
    done: dict[str, Any] = {}
    for method in step.recipe.chain_methods():
        if method.apply is None:
            continue  # the chain's trainer: run_trainer
        if method.reload_check and "chain" not in done:
            done["chain"] = step.recipe.chain_name()
        done[method.name] = method.apply(step)
    return done


@dataclass
class Trained:
    """What the chain's trainer left (nothing trained: the loaded model as the steps left it)."""

    model: Any
    trainer: Any = None
    base: Path | None = None  # what the adapter merges into: the steps' weights (None: the student)
    curve: dict[str, list[list[float]]] = field(default_factory=lambda: {"train": [], "held_out": []})
    tokens: int = 0
    steps: int = 0
    training: dict[str, Any] | None = None


def run_trainer(recipe: RecoverRecipe, loaded: Any, teacher: Any, rows: list[dict[str, Any]], prompts: list[str],
                job: Any, optimizer: str, held: heldout.HeldOutTeacher, metrics: dict[str, Any],
                data: dict[str, Any]) -> Trained:
    """Train with the chain's trainer (kd, opd), if it has one, from the checkpoint with --resume."""
    from accelerate import PartialState

    method = recipe.trainer_method()
    if method is None:
        return Trained(loaded.model)
    base = None
    if recipe.surgery_steps() and recipe.adapter_of(method) == "lora":  # the adapter merges into the surgery
        base = job.work / "replaced"
        state = PartialState()
        if state.is_main_process:  # a whole checkpoint: the merge loads the model and its tokenizer from here
            loaded.model.save_pretrained(base, safe_serialization=True)
            loaded.tokenizer.save_pretrained(base)
        state.wait_for_everyone()
    trainer_dir = job.work / "trainer"
    resume_from = train.prepare_trainer_dir(trainer_dir, job.resume, train.made_by(job))
    callback = heldout.HeldOutCallback(held)
    trainer = make_trainer(recipe, method, loaded, teacher, rows, prompts, job, optimizer, trainer_dir, callback)
    counter = budget.attach(trainer, recipe.train.max_tokens)
    budget.attach_snapshots(trainer, counter, job.snapshot_budgets, job.work / budget.SNAPSHOTS,
                            fresh=resume_from is None)
    budget.train(trainer, resume_from)
    data["trainer"] = type(trainer).__name__
    steps = trainer.state.global_step
    return Trained(trainer.model, trainer, base, training_curve(trainer.state.log_history, callback.points, metrics),
                   tokens_trained(trainer), steps, counter.summary(steps))


def save_trained(recipe: RecoverRecipe, trained: Trained, loaded: Any, saved: Path, encoded: list[Any],
                 data: dict[str, Any]) -> Path:
    """The trained weights to `saved`: through the trainer on every rank (it gathers FSDP / ZeRO-3 shards; an adapter
    alone where one was trained, merged by the runner), or, without a trainer, the weights as every rank holds them
    whole, from the main process (and reloaded to check them after merge or local)."""
    from accelerate import PartialState

    state = PartialState()
    if trained.trainer is not None:
        trained.trainer.save_model(str(saved))
        trained.trainer.accelerator.wait_for_everyone()
    elif state.is_main_process:
        trained.model.save_pretrained(saved, safe_serialization=True)
        loaded.tokenizer.save_pretrained(saved)
        if any(method.reload_check for method in recipe.chain_methods()):
            data["verified"] = chain.verify_saved(trained.model, saved, [ids for ids, _ in encoded])
    state.wait_for_everyone()
    return saved


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def make_trainer(recipe: RecoverRecipe, method: str, loaded: Any, teacher: Any, rows: list[dict[str, Any]],
                 prompts: list[str], job: Any, optimizer: str, trainer_dir: Path, callback: Any) -> Any:
    """The trainer the chain ends with, as its method (kd, opd) builds it, with LoRA adapters or every weight."""
    device = job.settings.resolved_device()
    adapter = recipe.adapter_of(method)
    peft_config = train.lora_config(recipe.lora) if adapter == "lora" else None
    args = train.training_arguments(recipe, trainer_dir, device, optimizer, job.settings.seed)
    loaded.model.train()
    build = METHODS.get(method).trainer
    if build is None:
        raise ValueError(f"method {method} has no trainer to end a chain with")
    return build(TrainerInputs(recipe, loaded, teacher, rows, prompts, args, peft_config, [callback], job, optimizer,
                               trainer_dir))


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
