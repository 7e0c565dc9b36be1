"""recover_model(): self-generate with the teacher, fine-tune the pruned model, save the merged model and a report."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from layerprune import errors
from layerprune.data import resolve_data_dir
from layerprune.errors import LayerpruneError
from layerprune.models import ModelSource, load_model, resolve_model
from layerprune.models.lineage import PRUNE_REPORT, SourceRecord, read_lineage
from layerprune.models.loading import copy_tokenizer_files, load_tokenizer
from layerprune.models.vllm_engine import engine_settings
from layerprune.outputs import atomic_output_dir, check_output_dir
from layerprune.provenance import collect_provenance
from layerprune.recover import budget, chain, heldout, memory, methods, selfgen, train
from layerprune.recover import prompts as prompt_sources
from layerprune.recover.report import RECOVER_REPORT, HeldOutLoss, RecoverReport, model_card
from layerprune.recover.schema import RecoverRecipe
from layerprune.recover.student_teacher import materialize_student, plan_recover
from layerprune.reports import write_report
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)


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
    if recipe.method == "qlora" or recipe.train.optimizer in memory.EIGHT_BIT:
        from layerprune.extras import require_extra

        require_extra(
            "qlora", "method qlora" if recipe.method == "qlora" else f"train.optimizer {recipe.train.optimizer}"
        )
    if recipe.generate.backend == "vllm":
        selfgen.check_vllm()


def dry_run(recipe: RecoverRecipe, job: RecoverJob) -> memory.MemoryPlan:
    """Print the plan (conflicts resolved, memory of the training step); load no weights."""
    from transformers import AutoConfig

    recipe, student, teacher, notes = plan_recover(recipe, job.settings)
    config = AutoConfig.from_pretrained(student.location, trust_remote_code=job.settings.trust_remote_code)
    if recipe.drop_blocks:
        config.num_hidden_layers -= len(set(recipe.drop_blocks))
    seq_len, how = dry_run_length(recipe, student, job)
    optimizer, plan = plan_for(recipe, config, job, cuda=True, seq_len=seq_len, teacher=teacher)
    plan.notes.insert(0, how)
    print(f"student: {student.spec}\nteacher: {teacher}")
    for note in notes:
        print(f"note: {note}")
    print(memory.format_plan(plan, student.spec))
    return plan


CHARS_PER_TOKEN = 3  # a cautious rate (English runs ~4) for sizing prompts when no tokenizer is at hand
TEMPLATE_TOKENS = 64  # chat-template and system-prompt allowance of that estimate


def dry_run_length(recipe: RecoverRecipe, student: ModelSource, job: RecoverJob) -> tuple[int, str]:
    """The longest training example: from the responses already generated, else prompts + max_new_tokens
    (prompts counted by the tokenizer, or estimated from their characters where it cannot be loaded)."""
    cap = recipe.train.max_length
    responses = job.work / "responses.jsonl"
    try:
        rows = (
            selfgen.read_responses(responses)
            if responses.is_file()
            else [
                {"prompt": p.text, "response": ""} for p in selfgen.load_prompts(recipe.prompts, _data_dir(recipe, job))
            ]
        )
    except LayerpruneError as exc:
        return cap, f"sequence length train.max_length (prompts not readable here: {exc})"
    extra = 0 if responses.is_file() else recipe.generate.max_new_tokens
    where = f"the {len(rows)} responses generated so far" if responses.is_file() else "longest prompt + max_new_tokens"
    try:
        tokenizer = load_tokenizer(student, job.settings)
    except LayerpruneError:
        chars = max(len(r["prompt"]) + len(r["response"]) for r in rows)
        longest = chars // CHARS_PER_TOKEN + TEMPLATE_TOKENS + extra
        return min(
            longest, cap
        ), f"sequence length ~{longest} from {where} ({CHARS_PER_TOKEN} chars a token: no tokenizer)"
    longest = train.longest_example(tokenizer, rows, recipe.generate) + extra
    return min(longest, cap), f"sequence length {longest} from {where}"


def _data_dir(recipe: RecoverRecipe, job: RecoverJob) -> Path | None:
    return resolve_data_dir(job.data_dir) if not recipe.prompts.source.endswith(".jsonl") else None


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
    """The memory plan and optimizer for the student's config (bf16 weights on CUDA unless told otherwise).

    `seq_len`: the longest tokenized training example (default train.max_length); for kd the teacher's own
    config (`teacher_config`, or read from `teacher`) sizes its weights and logits.
    """
    shape = memory.model_shape(config)
    dtype = job.settings.dtype
    sixteen = dtype in ("bfloat16", "float16") or (dtype == "auto" and cuda)
    master = sixteen and train.trains_all_weights(recipe) and not recipe.train.pure_bf16  # float32 master weights
    weight_bytes = 4 if master or not sixteen else 2
    distil = recipe.needs_teacher_model()  # kd, opd and replace plan like kd: the teacher sits beside the student
    teacher_shape = None
    if distil:
        teacher_config = teacher_config or (_config_of(teacher, job.settings) if teacher else None)
        teacher_shape = memory.model_shape(teacher_config) if teacher_config is not None else shape
    if recipe.trainer_method() is None and any(step in chain.NEW_STEPS for step in recipe.surgery_steps()):
        return "none", chain.plan(recipe, shape, teacher_shape or shape, weight_bytes, job.memory_budget,
                                  seq_len or recipe.train.max_length)
    optimizer, plan = memory.choose_optimizer(
        shape,
        "kd" if distil else recipe.method,
        recipe.train.optimizer,
        cuda,
        sharded=sharded_training(),
        seq_len=seq_len or recipe.train.max_length,
        batch_size=recipe.train.batch_size,
        weight_bytes=weight_bytes,
        lora_r=recipe.lora.r if recipe.uses_lora() else 0,
        gradient_checkpointing=recipe.train.gradient_checkpointing,
        teacher=teacher_shape,
        budget_gb=job.memory_budget,
        act_bytes=2 if master and recipe.train.bf16 else None,  # the bf16 autocast's activations
        teacher_weight_bytes=2 if master else None,  # the teacher keeps the run's 16-bit dtype
        max_memory=job.settings.resolved_max_memory(),  # --max-memory: a bound the plan enforces before loading
    )
    if distil and teacher_config is None:
        plan.notes.append("teacher counted at the student's size (its config was not readable)")
    plan.method = recipe.method  # planned as kd when a teacher sits beside the student, named as the recipe's
    return optimizer, plan


def _config_of(spec: str, settings: RunSettings) -> Any:
    from transformers import AutoConfig

    try:
        location = resolve_model(spec, settings).location
        return AutoConfig.from_pretrained(location, trust_remote_code=settings.trust_remote_code)
    except (LayerpruneError, OSError, ValueError):
        return None


def recover_model(recipe: RecoverRecipe, job: RecoverJob) -> RecoverReport:
    """The whole stage; returns the report written to recover_report.json."""
    start = time.perf_counter()
    check_runnable(recipe, job.settings)
    recipe, student, teacher, notes = plan_recover(recipe, job.settings)
    precision = train.pure_bf16_note(recipe, job.settings)
    notes = [*notes, precision] if precision else notes
    for note in notes:
        log.warning("%s", note)
    check_output_dir(job.output, job.overwrite, inputs=(Path(student.location),) if student.is_local else ())
    prompts, exclusion = prompt_sources.load_prompts(recipe.prompts, _data_dir(recipe, job))
    state = distributed_state(job.settings)
    job = replace(job, settings=rank_settings(job.settings, state))
    if not state.is_main_process:  # one voice under `accelerate launch`
        logging.getLogger("layerprune").setLevel(logging.WARNING)
    if state.is_main_process:
        job.work.mkdir(parents=True, exist_ok=True)
        check_fingerprint(recipe, teacher, job.work)
    state.wait_for_everyone()
    answered = methods.generation_prompts(recipe, prompts, job.settings.seed)
    with errors.stage("recover (self-generation)", job.work):
        generation = {**generate(recipe, teacher, answered, job, state), "exclusion": exclusion}
    with state.main_process_first():
        student = materialize_student(recipe, student, job.settings, job.work)
    rows = selfgen.responses_for(answered, job.work / "responses.jsonl")
    kept, card = selfgen.filter_responses(rows, recipe.generate)
    with errors.stage(f"recover (training, {recipe.method})", job.work):
        if recipe.method in methods.DISTILL_METHODS:
            result = methods.distill(recipe, student, teacher, kept, prompts, job)
        else:
            result = train_sft(recipe, student, teacher, kept, prompts, job)
    report = build_report(recipe, job, student, teacher, generation, card, result, time.perf_counter() - start, notes)
    if state.is_main_process:
        save_outputs(recipe, job, student, result, report)
        shutil.rmtree(job.work, ignore_errors=True)
    state.wait_for_everyone()
    return report


def rank_settings(settings: RunSettings, state: Any) -> RunSettings:
    """Under `accelerate launch` on GPUs each process loads models onto its own device, not the first one."""
    if state.num_processes > 1 and state.device.type != "cpu":
        return settings.model_copy(update={"device": str(state.device)})
    return settings


def distributed_state(settings: RunSettings) -> Any:
    """accelerate's process state: one process, or several under `accelerate launch`/`torchrun` (gloo on CPUs)."""
    from accelerate import PartialState

    return PartialState(cpu=settings.resolved_device().type == "cpu")


def check_fingerprint(recipe: RecoverRecipe, teacher: str, work: Path, write: bool = True) -> None:
    """Cached responses must come from the same teacher and sampling settings."""
    gen = recipe.generate
    current = {
        "teacher": teacher,
        "system_prompt": gen.system_prompt,
        "temperature": gen.temperature,
        "top_p": gen.top_p,
        "max_new_tokens": gen.max_new_tokens,
        "backend": gen.backend,
        **({} if gen.chat_template else {"chat_template": False, "stop": gen.stop}),
    }
    path = work / "generation.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached != current:
            changed = sorted(k for k in current if cached.get(k) != current[k])
            raise LayerpruneError(
                f"{work} holds responses generated with other settings ({', '.join(changed)}); delete it to start over"
            )
    if write:
        path.write_text(json.dumps(current, indent=2))


def generate(
    recipe: RecoverRecipe, teacher: str, prompts: list[selfgen.Prompt], job: RecoverJob, state: Any
) -> dict[str, Any]:
    """Stage 1: every process answers its own share of the prompts not yet answered (resumable per process), then
    the main process merges the shares into responses.jsonl."""
    path = job.work / "responses.jsonl"
    done = selfgen.done_ids(path)
    resumed = sum(p.id in done for p in prompts)
    state.wait_for_everyone()  # everyone has read what was there before anyone writes
    mine = prompts[state.process_index :: state.num_processes]
    target = path if state.num_processes == 1 else selfgen.shard_path(path, state.process_index)
    seconds = 0.0
    if any(p.id not in done for p in mine):
        seconds = answer(recipe, teacher, mine, job, target, done)
    state.wait_for_everyone()
    if state.is_main_process:
        selfgen.merge_shards(path)
    state.wait_for_everyone()
    return {
        "prompts": len(prompts),
        "resumed_from": resumed,
        "generated": len(prompts) - resumed,
        "processes": state.num_processes,
        "seconds": seconds,
    }


def answer(
    recipe: RecoverRecipe, teacher: str, prompts: list[selfgen.Prompt], job: RecoverJob, target: Path, done: set[str]
) -> float:
    """Load the teacher (or start vLLM) and answer these prompts into `target`; the seconds it took."""
    seed = job.settings.seed
    if recipe.generate.backend == "vllm":
        source = resolve_model(teacher, job.settings)
        tokenizer = load_tokenizer(source, job.settings)
        engine = engine_settings(job.settings)  # the dtype the HF path would load the teacher in
        return selfgen.generate_responses(
            source.location, tokenizer, prompts, recipe.generate, target, seed, engine, done
        )["seconds"]
    log.info("loading the teacher %s", teacher)
    loaded = load_model(teacher, job.settings)
    stats = selfgen.generate_responses(
        loaded.model, loaded.tokenizer, prompts, recipe.generate, target, seed, done=done
    )
    del loaded
    release_memory()
    return stats["seconds"]


@dataclass
class TrainResult:
    """What fine-tuning produced: the trained weights as the trainer saved them (gathered from every rank)."""

    saved: Path
    loss_before: float | None
    loss_after: float | None
    curve: dict[str, list[list[float]]]
    plan: memory.MemoryPlan
    optimizer: str
    data: dict[str, Any]
    seconds: float
    tokens_seen: int
    held_out: dict[str, Any] | None = None  # heldout.report_metrics (SFT: measured on the main process when saving)
    base: Path | None = None  # what a trained adapter merges into (None: the student; replace: the folded weights)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # the held-out teacher answers
    held_ids: set[str] = field(default_factory=set)
    training: dict[str, Any] = field(default_factory=dict)  # the report's tokens_unpadded ... learning_rate


def train_sft(
    recipe: RecoverRecipe, student: ModelSource, teacher: str, rows: list[dict[str, Any]],
    prompts: list[selfgen.Prompt], job: RecoverJob
) -> TrainResult:
    """Stage 2 with TRL on the prompts every method trains on (the same held-out prompt ids); the weights saved
    through the trainer on every rank. The held-out CE/KL are measured when saving (held_out_report)."""
    from transformers import AutoConfig

    start = time.perf_counter()
    held = methods.held_out_ids(prompts, recipe.train.held_out, job.settings.seed)
    train_rows = budget.order([r for r in rows if r["id"] not in held], job.settings.seed)
    eval_rows = [r for r in rows if r["id"] in held]
    if not train_rows:
        raise LayerpruneError(
            "no responses left to train on after holding some out; add prompts or lower train.held_out"
        )
    device = job.settings.resolved_device()
    config = AutoConfig.from_pretrained(student.location, trust_remote_code=job.settings.trust_remote_code)
    tokenizer = load_tokenizer(student, job.settings)
    longest = train.longest_example(tokenizer, train_rows + eval_rows, recipe.generate)
    optimizer, plan = plan_for(
        recipe, config, job, cuda=device.type == "cuda", seq_len=min(longest, recipe.train.max_length), teacher=teacher
    )
    for note in plan.notes:
        log.warning("memory plan: %s", note)
    if optimizer in memory.EIGHT_BIT:  # the plan switched to it
        from layerprune.extras import require_extra

        require_extra("qlora", f"the memory plan's optimizer {optimizer}")
    trainer_dir = job.work / "trainer"
    resume_from = prepare_trainer_dir(trainer_dir, job.resume)
    # the KD teacher is used whole on every process: loaded before the training config, so ZeRO-3 leaves it alone
    teacher_model = load_model(teacher, job.settings).model if recipe.method == "kd" else None
    # the training config before the student: under DeepSpeed ZeRO-3 it makes from_pretrained partition the weights
    args = train.sft_config(
        recipe,
        trainer_dir,
        device,
        optimizer,
        job.settings.seed,
        has_eval=bool(eval_rows),
        eval_on_start=resume_from is None,
    )
    loaded = load_student(recipe, student, job.settings)
    gen, cap = recipe.generate, recipe.train.max_length
    eval_set = train.to_dataset(eval_rows, gen, loaded.tokenizer, cap) if eval_rows else None
    train_set = train.to_dataset(train_rows, gen, loaded.tokenizer, cap)
    trainer = train.make_trainer(recipe, loaded.model, loaded.tokenizer, args, train_set, eval_set, teacher_model)
    counter = budget.attach(trainer, recipe.train.max_tokens)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    before = train.loss_before(trainer.state.log_history) if eval_set is not None else None
    after = trainer.evaluate()["eval_loss"] if eval_set is not None else None
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
    result = TrainResult(
        saved,
        before,
        after,
        train.loss_curve(trainer.state.log_history, before),
        plan,
        optimizer,
        data,
        time.perf_counter() - start,
        int(trainer.state.num_input_tokens_seen or 0),
        eval_rows=eval_rows,
        held_ids=held,
        training=counter.summary(trainer.state.global_step),
    )
    del trainer, loaded, teacher_model
    release_memory()
    return result


def release_memory() -> None:
    """Free what the trainer held before the merge loads the weights again."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
        loaded = load_model(student, train.student_settings(recipe, settings))
        loaded.model.train()
        return loaded
    from peft import prepare_model_for_kbit_training

    loaded = load_model(
        student,
        settings.model_copy(update={"dtype": "bfloat16"}),
        quantization_config=train.quantization_config(),
        device_map={"": settings.resolved_device()},
    )
    loaded.model = prepare_model_for_kbit_training(
        loaded.model, use_gradient_checkpointing=recipe.train.gradient_checkpointing
    )
    return loaded


def build_report(
    recipe: RecoverRecipe,
    job: RecoverJob,
    student: ModelSource,
    teacher: str,
    generation: dict[str, Any],
    card: dict[str, int],
    result: TrainResult,
    seconds: float,
    notes: list[str],
) -> RecoverReport:
    """recover_report.json: how the model was made and what the training did."""
    return RecoverReport(
        recipe=recipe,
        settings=job.settings,
        student=SourceRecord.of(student),
        teacher=teacher,
        data={"generation": generation, "filter": card, **result.data},
        held_out_loss={"before": result.loss_before, "after": result.loss_after},
        held_out_metrics=result.held_out,
        loss_curve=result.curve,
        tokens_seen=result.tokens_seen,
        **budget.combine(result.training),
        optimizer=result.optimizer,
        memory_plan=result.plan.as_dict(),
        seconds={"total": round(seconds, 1), "generation": generation["seconds"], "training": round(result.seconds, 1)},
        notes=notes,
        provenance=collect_provenance(),
    )


def save_outputs(
    recipe: RecoverRecipe, job: RecoverJob, student: ModelSource, result: TrainResult, report: RecoverReport
) -> None:
    """Merged safetensors model, adapter, report, loss curve and the data, all at once (main process only)."""
    with atomic_output_dir(job.output, job.overwrite) as tmp:
        model = merged_model(recipe, student, job.settings, result.saved, result.base)
        if report.held_out_metrics is None:  # SFT: measured here, on the saved weights, as distillation measures
            report.held_out_metrics = sft_held_out(recipe, job, student, report.teacher, model, result)
            pruned, after = report.held_out_metrics["pruned"], report.held_out_metrics["after"]
            report.held_out_loss = HeldOutLoss(before=pruned and pruned["ce"], after=after and after["ce"])
        model.save_pretrained(tmp, safe_serialization=True, max_shard_size=job.settings.max_shard_size)
        adapter = result.saved if (result.saved / "adapter_config.json").is_file() else result.saved / "adapter"
        if recipe.uses_lora() and (adapter / "adapter_config.json").is_file():
            (tmp / "adapter").mkdir()
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy2(adapter / name, tmp / "adapter" / name)
        copy_tokenizer_files(student, tmp, load_tokenizer(student, job.settings))
        lineage = read_lineage(Path(student.location))
        if lineage is not None:
            shutil.copy2(Path(student.location) / PRUNE_REPORT, tmp / PRUNE_REPORT)
        (tmp / "data").mkdir()
        shutil.copy2(job.work / "responses.jsonl", tmp / "data" / "responses.jsonl")
        (tmp / "data" / "card.json").write_text(json.dumps(report.data, indent=2))
        write_report(tmp / RECOVER_REPORT, report)
        model_card(report, lineage).save(tmp / "README.md")
        train.plot_loss_curve(result.curve, tmp / "loss_curve.png", f"recover {recipe.name}: {student.spec}")
    log.info("saved %s (held-out loss %s -> %s)", job.output, _fmt(result.loss_before), _fmt(result.loss_after))


def sft_held_out(recipe: RecoverRecipe, job: RecoverJob, student: ModelSource, teacher: str, model: Any,
                 result: TrainResult) -> dict[str, Any]:
    """held_out_metrics of an SFT arm, as distillation computes them: token-weighted CE and KL(teacher || student)
    of the pruned and the trained model on the teacher's answers to the held-out prompts (the teacher loaded once,
    after training, on the main process)."""
    tokenizer = load_tokenizer(student, job.settings)
    encoded = heldout.encode_rows(tokenizer, result.eval_rows, recipe.generate, recipe.train.max_length)
    if not encoded:
        return heldout.report_metrics(None, None, result.held_ids)
    teacher_model = load_model(teacher, job.settings).model.eval()
    pruned_model = load_model(student, job.settings).model
    pruned = heldout.held_out_metrics(pruned_model, teacher_model, encoded)
    del pruned_model
    after = heldout.held_out_metrics(model, teacher_model, encoded)
    del teacher_model
    release_memory()
    log.info("held-out CE %.4f -> %.4f, KL %.4f -> %.4f", pruned["ce"], after["ce"], pruned["kl"], after["kl"])
    return heldout.report_metrics(pruned, after, result.held_ids)


def merged_model(recipe: RecoverRecipe, student: ModelSource, settings: RunSettings, saved: Path,
                 base_dir: Path | None = None) -> Any:
    """The trained model from what the trainer saved (gathered from every rank): the full weights as they are, or
    the adapter merged into a fresh load of the student, or of `base_dir` (replace's folded weights) where given
    (QLoRA: a bf16 load, not the 4-bit one)."""
    if not recipe.uses_lora() or not (saved / "adapter_config.json").is_file():
        return load_model(str(saved), settings).model
    from peft import PeftModel

    dtype = {"dtype": "bfloat16"} if recipe.method == "qlora" else {}
    base = load_model(str(base_dir) if base_dir else student, settings.model_copy(update=dtype)).model
    return PeftModel.from_pretrained(base, str(saved)).merge_and_unload()
