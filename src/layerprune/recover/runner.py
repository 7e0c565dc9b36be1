"""recover_model(): self-generate with the teacher, train the pruned model with the recipe's method (methods/), save
the merged model and a report."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from layerprune.core import errors
from layerprune.core.errors import LayerpruneError
from layerprune.core.model_card import write_card
from layerprune.core.outputs import atomic_output_dir, check_output_dir, input_paths
from layerprune.core.provenance import collect_provenance
from layerprune.core.reports import write_report
from layerprune.core.settings import RunSettings
from layerprune.models import ModelSource, load_model, resolve_model
from layerprune.models.lineage import PRUNE_REPORT, SourceRecord, read_lineage
from layerprune.models.loading import copy_tokenizer_files, load_tokenizer
from layerprune.models.shards import sliced_config
from layerprune.models.vllm_engine import engine_settings
from layerprune.recover import budget, heldout, memory, selfgen, train
from layerprune.recover import prompts as prompt_sources
from layerprune.recover.job import RecoverJob, TrainResult, release_memory
from layerprune.recover.methods import METHODS, MethodRun, plan_for, prompts_to_answer
from layerprune.recover.report import RECOVER_REPORT, HeldOutLoss, RecoverReport, model_card
from layerprune.recover.schema import RecoverRecipe
from layerprune.recover.student_teacher import materialize_student, plan_recover

log = logging.getLogger(__name__)


def check_runnable(recipe: RecoverRecipe, settings: RunSettings) -> None:
    """Refuse what cannot run here before anything is loaded (the method's own check first: qlora needs CUDA)."""
    check = METHODS.get(recipe.method).check
    if check is not None:
        check(recipe, settings)
    if recipe.train.optimizer in memory.EIGHT_BIT:
        from layerprune.core.extras import require_extra

        require_extra("qlora", f"train.optimizer {recipe.train.optimizer}")
    if recipe.generate.backend == "vllm":
        selfgen.check_vllm()


def dry_run(recipe: RecoverRecipe, job: RecoverJob) -> memory.MemoryPlan:
    """Print the plan (conflicts resolved, memory of the training step); load no weights."""
    recipe, student, teacher, notes = plan_recover(recipe, job.settings)
    config = student_config(recipe, student, job.settings)
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
    return prompt_sources.prompts_data_dir(recipe.prompts, job.data_dir)


def recover_model(recipe: RecoverRecipe, job: RecoverJob) -> RecoverReport:
    """The whole stage; returns the report written to recover_report.json."""
    start = time.perf_counter()
    check_runnable(recipe, job.settings)
    recipe, student, teacher, notes = plan_recover(recipe, job.settings)
    precision = train.pure_bf16_note(recipe, job.settings)
    notes = [*notes, precision] if precision else notes
    for note in notes:
        log.warning("%s", note)
    check_output_dir(job.output, job.overwrite, input_paths(student, teacher))
    refuse_over_bound(recipe, student, teacher, job)
    prompts, exclusion = prompt_sources.load_prompts(recipe.prompts, _data_dir(recipe, job))
    state = distributed_state(job.settings)
    job = replace(job, settings=rank_settings(job.settings, state))
    if not state.is_main_process:  # one voice under `accelerate launch`
        logging.getLogger("layerprune").setLevel(logging.WARNING)
    if state.is_main_process:
        job.work.mkdir(parents=True, exist_ok=True)
        check_fingerprint(recipe, teacher, job.work)
    state.wait_for_everyone()
    answered = prompts_to_answer(recipe, prompts, job.settings.seed)
    with errors.stage("recover (self-generation)", job.work):
        generation = {**generate(recipe, teacher, answered, job, state), "exclusion": exclusion}
    with state.main_process_first():
        student = materialize_student(recipe, student, job.settings, job.work)
    rows = selfgen.responses_for(answered, job.work / "responses.jsonl")
    kept, card = selfgen.filter_responses(rows, recipe.generate)
    with errors.stage(f"recover (training, {recipe.method})", job.work):
        result = METHODS.get(recipe.method).train(MethodRun(recipe, student, teacher, kept, prompts, job))
    report = build_report(recipe, job, student, teacher, generation, card, result, time.perf_counter() - start, notes)
    if state.is_main_process:
        save_snapshots(recipe, job, student, result, report)  # before the run's own output, its completion mark
        save_outputs(recipe, job, student, result, report)
        shutil.rmtree(job.work, ignore_errors=True)
    state.wait_for_everyone()
    return report


def refuse_over_bound(recipe: RecoverRecipe, student: ModelSource, teacher: str, job: RecoverJob) -> None:
    """Under --max-memory, refuse before the teacher is loaded a plan that is over the bound even with one-token
    examples (weights, gradients, optimizer states and the teacher do not depend on the data); the method plans
    again, exactly, on the generated responses."""
    if not job.settings.resolved_max_memory():
        return
    plan_for(recipe, student_config(recipe, student, job.settings), job,
             cuda=job.settings.resolved_device().type == "cuda", seq_len=1, teacher=teacher)


def student_config(recipe: RecoverRecipe, student: ModelSource, settings: RunSettings) -> Any:
    """The config of the model that trains, read without weights: the student's, with the recipe's drop_blocks
    applied as the prune applies them (composite configs such as Gemma-3's and per-layer fields too)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(student.location, trust_remote_code=settings.trust_remote_code)
    return sliced_config(config, recipe.drop_blocks) if recipe.drop_blocks else config


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
            report.held_out_metrics = held_out_on_saved(recipe, job, student, report.teacher, model, result)
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
        write_card(tmp, str(model_card(report, lineage)))
        train.plot_loss_curve(result.curve, tmp / "loss_curve.png", f"recover {recipe.name}: {student.spec}")
    log.info("saved %s (held-out loss %s -> %s)", job.output, _fmt(result.loss_before), _fmt(result.loss_after))


def _fmt(value: float | None) -> str:
    return "n/a (nothing held out)" if value is None else f"{value:.4f}"


def save_snapshots(recipe: RecoverRecipe, job: RecoverJob, student: ModelSource, result: TrainResult,
                   report: RecoverReport) -> None:
    """Each model the run saved on reaching a budget (job.snapshots, budget.Snapshots) as a recovered model of its
    own: merged weights, tokenizer, lineage and a recover_report.json with the counts at that checkpoint and the loss
    curve up to it (held-out metrics are the run end's business: not measured there). Refuse a run that ended before
    a budget or before train.max_tokens: its points would not be the tokens they are labelled with."""
    reached = int(report.tokens_unpadded or 0)
    short = [b for b in job.snapshot_budgets
             if not (job.work / budget.SNAPSHOTS / str(b) / budget.SNAPSHOT_RECORD).is_file()]
    must_reach = job.snapshots or job.reach_budget  # else train.max_tokens is a cap
    if must_reach and recipe.train.max_tokens is not None and reached < recipe.train.max_tokens:
        short.append(recipe.train.max_tokens)
    if short:
        raise LayerpruneError(f"{job.output.name}: the run ended at {reached} target tokens, before the budget "
                              f"{short[0]}; raise train.epochs (or max_steps; local: local.steps, shared out over "
                              "the cut's spans) so that it reaches every budget")
    lineage = read_lineage(Path(student.location))
    for target, output in sorted(job.snapshots.items()):
        folder = job.work / budget.SNAPSHOTS / str(target)
        record = json.loads((folder / budget.SNAPSHOT_RECORD).read_text())
        steps = int(record["optimizer_steps"])
        curve = {name: [p for p in points if p[0] <= steps] for name, points in result.curve.items()}
        note = (f"a checkpoint of {job.output.name} on reaching {target} target tokens (step {steps}, "
                f"{record['tokens_unpadded']} target tokens); held-out metrics not measured here")
        counts = {k: record[k] for k in (*budget.COUNTS, "optimizer_steps", "learning_rate")}
        snapshot = report.model_copy(update={**counts, "loss_curve": curve, "notes": [*report.notes, note],
                                             "held_out_loss": HeldOutLoss(before=None, after=None),
                                             "held_out_metrics": None})
        with atomic_output_dir(output, True) as tmp:
            model = merged_model(recipe, student, job.settings, folder, result.base)
            model.save_pretrained(tmp, safe_serialization=True, max_shard_size=job.settings.max_shard_size)
            copy_tokenizer_files(student, tmp, load_tokenizer(student, job.settings))
            if lineage is not None:
                shutil.copy2(Path(student.location) / PRUNE_REPORT, tmp / PRUNE_REPORT)
            write_report(tmp / RECOVER_REPORT, snapshot)
            write_card(tmp, str(model_card(snapshot, lineage)))
        log.info("saved %s (%s)", output, note)


def held_out_on_saved(recipe: RecoverRecipe, job: RecoverJob, student: ModelSource, teacher: str, model: Any,
                      result: TrainResult) -> dict[str, Any]:
    """held_out_metrics of a method that measured none while training (SFT), as distillation computes them:
    token-weighted CE and KL(teacher || student) of the pruned and the trained model on the teacher's answers to the
    held-out prompts (the teacher loaded once, after training, on the main process)."""
    tokenizer = load_tokenizer(student, job.settings)
    encoded = heldout.encode_rows(tokenizer, result.eval_rows, recipe.generate, recipe.train.max_length)
    if not encoded:
        return heldout.report_metrics(None, None, result.held_ids)
    teacher_model = load_model(teacher, job.settings).model.eval()
    pruned_model = load_model(student, job.settings).model
    side = heldout.HeldOutTeacher(teacher_model, encoded)  # computed once for both, on the CPU
    pruned = heldout.held_out_metrics(pruned_model, side, encoded)
    del pruned_model
    after = heldout.held_out_metrics(model, side, encoded)
    del teacher_model, side
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
