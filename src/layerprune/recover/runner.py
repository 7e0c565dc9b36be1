"""recover(): self-generate with the teacher, fine-tune the pruned model, save the merged model and a report."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerprune import __version__
from layerprune.data import resolve_data_dir
from layerprune.errors import LayerpruneError
from layerprune.models import ModelSource, load_model, resolve_model
from layerprune.models.loading import copy_tokenizer_files, load_tokenizer
from layerprune.outputs import atomic_output_dir, check_output_dir
from layerprune.recover import memory, methods, selfgen, train
from layerprune.recover import prompts as prompt_sources
from layerprune.recover.models import PRUNE_REPORT, materialize_student, resolve_student, teacher_spec
from layerprune.recover.schema import RecoverRecipe
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
REPORT = "recover_report.json"


@dataclass
class RecoverJob:
    """Everything one recover run needs besides the recipe."""

    output: Path
    settings: RunSettings = field(default_factory=RunSettings)
    overwrite: bool = False
    resume: bool = False
    data_dir: Path | None = None
    memory_budget: float = 80.0

    @property
    def work(self) -> Path:
        """Responses and checkpoints live here until the output is complete (kept for resuming)."""
        return self.output.parent / f"{self.output.name}.work"


def check_runnable(recipe: RecoverRecipe, settings: RunSettings) -> None:
    """Refuse what cannot run here before anything is loaded."""
    import torch

    device = settings.resolved_device()
    if recipe.method == "qlora" and (device.type != "cuda" or not torch.cuda.is_available()):
        raise LayerpruneError("method qlora needs a CUDA GPU (bitsandbytes 4-bit); on this machine use --method lora")
    if recipe.generate.backend == "vllm":
        selfgen.check_vllm()


def dry_run(recipe: RecoverRecipe, job: RecoverJob) -> memory.MemoryPlan:
    """Print the memory plan of the recipe's training step for the student model; load no weights."""
    from transformers import AutoConfig

    student = resolve_student(recipe, job.settings)
    config = AutoConfig.from_pretrained(student.location, trust_remote_code=job.settings.trust_remote_code)
    if recipe.drop_blocks:
        config.num_hidden_layers -= len(set(recipe.drop_blocks))
    optimizer, plan = plan_for(recipe, config, job, cuda=True)
    print(memory.format_plan(plan, student.spec))
    return plan


def plan_for(recipe: RecoverRecipe, config: Any, job: RecoverJob, cuda: bool) -> tuple[str, memory.MemoryPlan]:
    """The memory plan and optimizer for the student's config (bf16 weights on CUDA unless told otherwise)."""
    shape = memory.model_shape(config)
    dtype = job.settings.dtype
    weight_bytes = 4 if dtype == "float32" or (dtype == "auto" and not cuda) else 2
    distil = recipe.needs_teacher_model()  # kd, opd and replace plan like kd: the teacher sits beside the student
    optimizer, plan = memory.choose_optimizer(
        shape, "kd" if distil else recipe.method, recipe.train.optimizer, cuda, seq_len=recipe.train.max_length,
        batch_size=recipe.train.batch_size, weight_bytes=weight_bytes,
        lora_r=recipe.lora.r if recipe.uses_lora() else 0,
        gradient_checkpointing=recipe.train.gradient_checkpointing,
        teacher_params=shape.params if distil else 0, budget_gb=job.memory_budget)
    if distil:
        plan.notes.append("teacher counted at the student's size; the unpruned teacher is larger")
    return optimizer, plan


def recover(recipe: RecoverRecipe, job: RecoverJob) -> dict[str, Any]:
    """The whole stage; returns the report written to recover_report.json."""
    start = time.perf_counter()
    check_runnable(recipe, job.settings)
    student = resolve_student(recipe, job.settings)
    teacher = teacher_spec(recipe, student)
    check_output_dir(job.output, job.overwrite, inputs=(Path(student.location),) if student.is_local else ())
    data_dir = resolve_data_dir(job.data_dir) if not recipe.prompts.source.endswith(".jsonl") else None
    prompts, exclusion = prompt_sources.load_prompts(recipe.prompts, data_dir)
    state = distributed_state(job.settings)
    if not state.is_main_process:  # one voice under `accelerate launch`
        logging.getLogger("layerprune").setLevel(logging.WARNING)
    with state.main_process_first():  # under `accelerate launch` the main process generates, the others reuse it
        job.work.mkdir(parents=True, exist_ok=True)
        check_fingerprint(recipe, teacher, job.work, write=state.is_main_process)
        answered = methods.generation_prompts(recipe, prompts, job.settings.seed)
        generation = {**generate(recipe, teacher, answered, job), "exclusion": exclusion}
        student = materialize_student(recipe, student, job.settings, job.work)
    rows = selfgen.responses_for(answered, job.work / "responses.jsonl")
    kept, card = selfgen.filter_responses(rows, recipe.generate)
    if recipe.method in methods.DISTILL_METHODS:
        result = methods.fine_tune(recipe, student, teacher, kept, prompts, job)
    else:
        result = fine_tune(recipe, student, teacher, kept, job)
    report = build_report(recipe, job, student, teacher, generation, card, result, time.perf_counter() - start)
    if state.is_main_process:
        save_outputs(recipe, job, student, result, report)
        shutil.rmtree(job.work, ignore_errors=True)
    state.wait_for_everyone()
    return report


def distributed_state(settings: RunSettings) -> Any:
    """accelerate's process state: one process, or several under `accelerate launch`/`torchrun` (gloo on CPUs)."""
    from accelerate import PartialState

    return PartialState(cpu=settings.resolved_device().type == "cpu")


def check_fingerprint(recipe: RecoverRecipe, teacher: str, work: Path, write: bool = True) -> None:
    """Cached responses must come from the same teacher and sampling settings."""
    gen = recipe.generate
    current = {"teacher": teacher, "system_prompt": gen.system_prompt, "temperature": gen.temperature,
               "top_p": gen.top_p, "max_new_tokens": gen.max_new_tokens, "backend": gen.backend}
    path = work / "generation.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached != current:
            changed = sorted(k for k in current if cached.get(k) != current[k])
            raise LayerpruneError(f"{work} holds responses generated with other settings ({', '.join(changed)}); "
                                  "delete it to start over")
    if write:
        path.write_text(json.dumps(current, indent=2))


def generate(recipe: RecoverRecipe, teacher: str, prompts: list[selfgen.Prompt], job: RecoverJob) -> dict[str, Any]:
    """Stage 1, skipping the prompts already answered in the work directory."""
    path = job.work / "responses.jsonl"
    if not {p.id for p in prompts} - selfgen.done_ids(path):
        return {"prompts": len(prompts), "resumed_from": len(prompts), "generated": 0, "seconds": 0.0}
    if recipe.generate.backend == "vllm":
        source = resolve_model(teacher, job.settings)
        tokenizer = load_tokenizer(source, job.settings)
        return selfgen.generate_responses(source.location, tokenizer, prompts, recipe.generate, path)
    log.info("loading the teacher %s", teacher)
    loaded = load_model(teacher, job.settings)
    stats = selfgen.generate_responses(loaded.model, loaded.tokenizer, prompts, recipe.generate, path)
    del loaded
    return stats


@dataclass
class TrainResult:
    """What fine-tuning produced, before it is written out."""

    model: Any
    tokenizer: Any
    loss_before: float | None
    loss_after: float | None
    curve: dict[str, list[list[float]]]
    plan: memory.MemoryPlan
    optimizer: str
    data: dict[str, Any]
    seconds: float
    tokens_seen: int


def fine_tune(recipe: RecoverRecipe, student: ModelSource, teacher: str, rows: list[dict[str, Any]],
              job: RecoverJob) -> TrainResult:
    """Stage 2 with TRL; held-out loss before and after."""
    start = time.perf_counter()
    train_rows, eval_rows = train.split_rows(rows, recipe.train.held_out, job.settings.seed)
    if not train_rows:
        raise LayerpruneError("no responses left to train on after holding some out; add prompts or lower train.held_out")
    loaded = load_student(recipe, student, job.settings)
    device = job.settings.resolved_device()
    optimizer, plan = plan_for(recipe, loaded.model.config, job, cuda=device.type == "cuda")
    for note in plan.notes:
        log.warning("memory plan: %s", note)
    teacher_model = load_model(teacher, job.settings).model if recipe.method == "kd" else None
    trainer_dir = job.work / "trainer"
    resume_from = prepare_trainer_dir(trainer_dir, job.resume)
    args = train.sft_config(recipe, trainer_dir, device, optimizer, job.settings.seed, has_eval=bool(eval_rows))
    system = recipe.generate.system_prompt
    eval_set = train.to_dataset(eval_rows, system) if eval_rows else None
    trainer = train.make_trainer(recipe, loaded.model, loaded.tokenizer, args, train.to_dataset(train_rows, system),
                                 eval_set, teacher_model)
    before = trainer.evaluate()["eval_loss"] if eval_set is not None else None
    log.info("held-out loss before training: %s", _fmt(before))
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    after = trainer.evaluate()["eval_loss"] if eval_set is not None else None
    log.info("held-out loss after training: %s (before %s)", _fmt(after), _fmt(before))
    data = {"train_examples": len(train_rows), "held_out_examples": len(eval_rows),
            "train_response_tokens": sum(r.get("tokens", 0) for r in train_rows), "steps": trainer.state.global_step}
    return TrainResult(trainer.model, loaded.tokenizer, before, after, train.loss_curve(trainer.state.log_history, before),
                       plan, optimizer, data, time.perf_counter() - start, int(trainer.state.num_input_tokens_seen or 0))


def _fmt(value: float | None) -> str:
    return "n/a (nothing held out)" if value is None else f"{value:.4f}"


def prepare_trainer_dir(directory: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (with --resume), else a clean trainer directory."""
    last = train.last_checkpoint(directory)
    if resume:
        if last is None:
            log.warning("--resume: no checkpoint in %s; training from the start", directory)
        else:
            log.info("resuming from %s", last)
        return last
    if directory.exists():
        shutil.rmtree(directory)
    return None


def load_student(recipe: RecoverRecipe, student: ModelSource, settings: RunSettings) -> Any:
    """The pruned model for training (4-bit NF4 for qlora)."""
    if recipe.method != "qlora":
        loaded = load_model(student, settings)
        loaded.model.train()
        return loaded
    from peft import prepare_model_for_kbit_training

    loaded = load_model(student, settings.model_copy(update={"dtype": "bfloat16"}),
                        quantization_config=train.quantization_config(), device_map={"": settings.resolved_device()})
    loaded.model = prepare_model_for_kbit_training(loaded.model, use_gradient_checkpointing=recipe.train.gradient_checkpointing)
    return loaded


def build_report(recipe: RecoverRecipe, job: RecoverJob, student: ModelSource, teacher: str, generation: dict[str, Any],
                 card: dict[str, int], result: TrainResult, seconds: float) -> dict[str, Any]:
    """recover_report.json: how the model was made and what the training did."""
    import peft
    import torch
    import transformers
    import trl

    return {
        "recipe": recipe.model_dump(mode="json"), "settings": job.settings.model_dump(mode="json"),
        "student": {"spec": student.spec, "location": student.location, "identity": student.identity},
        "teacher": teacher,
        "data": {"generation": generation, "filter": card, **result.data},
        "held_out_loss": {"before": result.loss_before, "after": result.loss_after},
        "loss_curve": result.curve, "tokens_seen": result.tokens_seen, "optimizer": result.optimizer,
        "memory_plan": result.plan.as_dict(),
        "seconds": {"total": round(seconds, 1), "generation": generation["seconds"], "training": round(result.seconds, 1)},
        "versions": {"layerprune": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "trl": trl.__version__, "peft": peft.__version__},
    }


def save_outputs(recipe: RecoverRecipe, job: RecoverJob, student: ModelSource, result: TrainResult,
                 report: dict[str, Any]) -> None:
    """Merged safetensors model, adapter, report, loss curve and the data, all at once."""
    with atomic_output_dir(job.output, job.overwrite) as tmp:
        model = result.model
        if recipe.uses_lora():
            model.save_pretrained(tmp / "adapter", safe_serialization=True)
            model = merged_model(recipe, model, student, job.settings, tmp / "adapter")
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=job.settings.max_shard_size)
        copy_tokenizer_files(student, tmp, result.tokenizer)
        if (Path(student.location) / PRUNE_REPORT).is_file():
            shutil.copy2(Path(student.location) / PRUNE_REPORT, tmp / PRUNE_REPORT)
        (tmp / "data").mkdir()
        shutil.copy2(job.work / "responses.jsonl", tmp / "data" / "responses.jsonl")
        (tmp / "data" / "card.json").write_text(json.dumps(report["data"], indent=2))
        (tmp / REPORT).write_text(json.dumps(report, indent=2, default=str))
        train.plot_loss_curve(result.curve, tmp / "loss_curve.png", f"recover {recipe.name}: {student.spec}")
    log.info("saved %s (held-out loss %s -> %s)", job.output, _fmt(result.loss_before), _fmt(result.loss_after))


def merged_model(recipe: RecoverRecipe, model: Any, student: ModelSource, settings: RunSettings, adapter: Path) -> Any:
    """The adapter merged into the weights (QLoRA: into a bf16 reload of the base, not the 4-bit one)."""
    if recipe.method != "qlora":
        return model.merge_and_unload()
    from peft import PeftModel

    base = load_model(student, settings.model_copy(update={"dtype": "bfloat16"})).model
    return PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
