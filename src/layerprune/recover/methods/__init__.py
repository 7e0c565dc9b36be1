"""Recovery methods: one small module each, registered by name (the recipe's `method:`).

A method declares whether the teacher sits in memory beside the student while it trains (`needs_teacher`), its memory
plan, the recipe section it owns (if it has one: `section=(key, SectionModel)` adds it to RecoverRecipe, as a score
declares its ScoreParams), what chains, studies and reports ask of it (`lr_section`, `needs_cut`, ...: no caller
names a method) and the function that trains; runner.py runs the stages around it
(self-generation, then the merge and save). Chains (replace then kd, merge then local...) run in distill.py: the
block-changing steps' `apply` in chain order, then the trainer's `trainer` (kd, opd).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import Registry
from layerprune.core.settings import RunSettings
from layerprune.models import ModelSource, resolve_model
from layerprune.recover import heldout, memory, train
from layerprune.recover.job import RecoverJob, TrainResult
from layerprune.recover.schema import RecoverRecipe, Section, add_section
from layerprune.recover.selfgen import Prompt


@dataclass
class MethodRun:
    """What a method trains from: the recipe, the student and the teacher, the teacher's answers the filter kept, and
    every prompt (the held-out split goes by prompt id, the same for every method)."""

    recipe: RecoverRecipe
    student: ModelSource
    teacher: str
    rows: list[dict[str, Any]]
    prompts: list[Prompt]
    job: RecoverJob


@dataclass(frozen=True)
class PlanRequest:
    """What a memory plan is computed from: the recipe, the student's shape (and the teacher's where the method holds
    it and its config was readable), the longest training sequence and the precision the weights train in."""

    recipe: RecoverRecipe
    shape: memory.ModelShape
    teacher: memory.ModelShape | None
    job: RecoverJob
    cuda: bool
    seq_len: int
    weight_bytes: int  # 4: float32 weights (master weights, or a float32 run); 2: 16-bit
    master: bool  # float32 master weights in a 16-bit run (bf16 autocast's activations, a 16-bit teacher beside them)


@dataclass
class ChainStep:
    """A block-changing step of a chain (replace, merge, local) gets the loaded student (model and tokenizer), the
    teacher model, the student's source (its prune_report.json names the dropped blocks) and the training answers."""

    recipe: RecoverRecipe
    loaded: Any
    teacher: Any
    student: ModelSource
    rows: list[dict[str, Any]]
    states: Path | None = None  # where the teacher's hidden states are kept for a study's other runs (RecoverJob)


@dataclass
class TrainerInputs:
    """What a distillation trainer (kd, opd) is built from, after the chain's block-changing steps."""

    recipe: RecoverRecipe
    loaded: Any
    teacher: Any
    rows: list[dict[str, Any]]  # the training answers
    prompts: list[str]  # the training prompts (on-policy: the student writes the completions)
    args: dict[str, Any]  # train.training_arguments
    peft_config: Any  # None: every weight trains
    callbacks: list[Any]
    job: RecoverJob
    optimizer: str
    trainer_dir: Path


Train = Callable[[MethodRun], TrainResult]
Plan = Callable[[PlanRequest], tuple[str, memory.MemoryPlan]]


@dataclass(frozen=True)
class RecoveryMethod:
    """A registered method: how it trains, its memory plan, its recipe section, and what the runner, chains, studies
    and reports ask of it (attributes, so that no caller names a method)."""

    name: str
    train: Train
    plan: Plan  # the optimizer and the peak memory of one training step, from configs alone
    needs_teacher: bool  # the teacher sits in memory beside the student while it trains
    section: str | None = None  # the RecoverRecipe section it owns and reads (kd, opd, replace, merge, local)
    check: Callable[[RecoverRecipe, RunSettings], None] | None = None  # refuse what cannot run here, before loading
    validate: Callable[[RecoverRecipe], None] | None = None  # a cross-section check of a chain it is in (ValueError)
    answers: Callable[[RecoverRecipe, list[Prompt], int], list[Prompt]] | None = None  # the prompts the teacher answers
    apply: Callable[[ChainStep], Any] | None = None  # a block-changing step of a chain: what it did, for the report
    trainer: Callable[[TrainerInputs], Any] | None = None  # the trainer a chain ends with (kd, opd)
    adapter: str | None = None  # what it trains (lora, full) where no section of it says (its section's `adapter`)
    lr_section: str | None = "train"  # the section whose learning_rate it trains at (None: it trains nothing)
    needs_cut: bool = False  # it changes the blocks around a cut: no k = 0 control on the unpruned model
    caches_states: bool = False  # it trains a block on the teacher's cached hidden states (chain.plan counts them)
    reload_check: bool = False  # its weights are reloaded and checked after saving (a chain without a trainer)
    untrained: Callable[[RecoverRecipe], str] | None = None  # a study's line for it alone, where it trains nothing
    control_note: str = ""  # why a k = 0 control of a chain ending in it would say nothing (reports)

    @property
    def changes_blocks(self) -> bool:
        """Whether it is a block-changing step of a chain (a section's `then` may follow it), not a trainer."""
        return self.apply is not None


METHODS: Registry[RecoveryMethod] = Registry("method")


def recovery_method(name: str, *, needs_teacher: bool, plan: Plan, section: tuple[str, type[Section]] | None = None,
                    **hooks: Any) -> Callable[[Train], Train]:
    """Register the decorated train function as method `name` (hooks: RecoveryMethod's optional fields); `section`:
    the recipe section it owns, (key, its Section model), added to RecoverRecipe (schema.add_section)."""

    def add(function: Train) -> Train:
        if name in METHODS:
            raise ValueError(f"method '{name}' registered twice")
        if section is not None:
            add_section(*section)
        METHODS.register(name)(RecoveryMethod(name, function, plan, needs_teacher,
                                              section=section[0] if section else None, **hooks))
        return function

    return add


def cut_methods() -> str:
    """The registered methods that need a cut, in words ('local, merge, replace'): they have no k = 0 control."""
    return ", ".join(name for name in METHODS.names() if METHODS.get(name).needs_cut)


def held_out_ids(prompts: list[Prompt], held_out: float, seed: int) -> set[str]:
    """Ids of the held-out prompts, the same for every method (heldout.held_out_ids)."""
    return heldout.held_out_ids([p.id for p in prompts], held_out, seed)


def prompts_to_answer(recipe: RecoverRecipe, prompts: list[Prompt], seed: int) -> list[Prompt]:
    """The prompts the teacher must answer: all, or those the method asks for (fully on-policy opd: the held-out)."""
    hook = METHODS.get(recipe.method).answers
    return hook(recipe, prompts, seed) if hook else prompts


def sharded_training() -> bool:
    """Whether `accelerate launch` set up FSDP or DeepSpeed (optimizer states sharded across processes)."""
    return any(os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true" for name in ("FSDP", "DEEPSPEED"))


def plan_for(
    recipe: RecoverRecipe,
    config: Any,
    job: RecoverJob,
    cuda: bool,
    seq_len: int | None = None,
    teacher: str | None = None,
    teacher_config: Any = None,
) -> tuple[str, memory.MemoryPlan]:
    """The memory plan and optimizer of the recipe's method for the student's config (bf16 weights on CUDA unless told
    otherwise).

    `seq_len`: the longest tokenized training example (default train.max_length); where the method holds the teacher,
    its own config (`teacher_config`, or read from `teacher`) sizes its weights and logits.
    """
    method = METHODS.get(recipe.method)
    shape = memory.model_shape(config)
    dtype = job.settings.dtype
    sixteen = dtype in ("bfloat16", "float16") or (dtype == "auto" and cuda)
    master = sixteen and train.trains_all_weights(recipe) and not recipe.train.pure_bf16  # float32 master weights
    teacher_shape = None
    if method.needs_teacher:
        teacher_config = teacher_config or (_config_of(teacher, job.settings) if teacher else None)
        teacher_shape = memory.model_shape(teacher_config) if teacher_config is not None else None
    request = PlanRequest(recipe, shape, teacher_shape, job, cuda, seq_len or recipe.train.max_length,
                          4 if master or not sixteen else 2, master)
    return method.plan(request)


def plan_training(request: PlanRequest, method: str, with_teacher: bool = False) -> tuple[str, memory.MemoryPlan]:
    """The plan of a trainer's step (memory.choose_optimizer), planned as `method` (lora, qlora, full; kd for any
    trainer with the teacher beside the student, `with_teacher`) and named as the recipe's method."""
    recipe, job = request.recipe, request.job
    teacher = (request.teacher or request.shape) if with_teacher else None
    optimizer, plan = memory.choose_optimizer(
        request.shape,
        method,
        recipe.train.optimizer,
        request.cuda,
        sharded=sharded_training(),
        seq_len=request.seq_len,
        batch_size=recipe.train.batch_size,
        weight_bytes=request.weight_bytes,
        lora_r=recipe.lora.r if recipe.uses_lora() else 0,
        gradient_checkpointing=recipe.train.gradient_checkpointing,
        teacher=teacher,
        budget_gb=job.memory_budget,
        act_bytes=2 if request.master and recipe.train.bf16 else None,  # the bf16 autocast's activations
        teacher_weight_bytes=2 if request.master else None,  # the teacher keeps the run's 16-bit dtype
        max_memory=job.settings.resolved_max_memory(),  # --max-memory: a bound the plan enforces before loading
    )
    if with_teacher and request.teacher is None:
        plan.notes.append("teacher counted at the student's size (its config was not readable)")
    plan.method = recipe.method
    return optimizer, plan


def _config_of(spec: str, settings: RunSettings) -> Any:
    from transformers import AutoConfig

    try:
        location = resolve_model(spec, settings).location
        return AutoConfig.from_pretrained(location, trust_remote_code=settings.trust_remote_code)
    except (LayerpruneError, OSError, ValueError):
        return None


# registration, in the recipe's section order (kd, opd, replace, merge, local)
from layerprune.recover.methods import kd, opd, replace, merge, local, sft  # noqa: E402,F401,I001
