"""Evaluate one model: plan the tasks, run each through lm-eval's `simple_evaluate`, cache and save results."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerprune.core import errors
from layerprune.core.errors import LayerpruneError, one_line
from layerprune.core.outputs import atomic_output_dir, check_output_dir, input_paths
from layerprune.core.provenance import collect_provenance
from layerprune.core.settings import RunSettings
from layerprune.evaluate.cache import cache_path, read_cached, task_settings, write_cached
from layerprune.evaluate.handle import (
    ModelHandle,
    applies_chat,
    check_probe_format,
    handle_for,
    has_chat_template,
    make_lm,
    reference_handle,
)
from layerprune.evaluate.lm_eval_results import aggregate_group, merge_samples, summarize
from layerprune.evaluate.offline import lm_eval_configs
from layerprune.evaluate.overlap import calibration_overlap
from layerprune.evaluate.project_tasks import (
    DEFAULT_TEMPERATURE,
    Sampling,
    boxed_config,
    humaneval_config,
    lm_eval_sampling,
    probe_config,
)
from layerprune.evaluate.sandbox import SandboxLimits, isolation_level
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import PlannedTask, plan_tasks
from layerprune.evaluate.summary import EvaluatedModel, Summary, TaskResult
from layerprune.models import LoadedModel, ModelSource
from layerprune.models.identity import model_fingerprint
from layerprune.tasks.data import resolve_data_dir

log = logging.getLogger(__name__)


def task_configs(task: PlannedTask, settings: EvalSettings, data_dir: Path | None, cache_root: Path | None = None,
                 sampling: Sampling | None = None) -> list[dict[str, Any]]:
    """The lm-eval task configs behind one of our tasks (several for a group such as mmlu)."""
    spec = task.spec
    if spec.source == "probe":
        return [probe_config(spec, settings.probe_seed, sampling, settings.probe_format)]
    if spec.source == "humaneval":
        limits = SandboxLimits(timeout_s=settings.sandbox_timeout, memory_mb=settings.sandbox_memory_mb,
                               allow_unsafe=settings.unsafe_code_exec)
        oracle_dir = cache_root / "humaneval_plus" if cache_root is not None else None
        return [humaneval_config(spec, data_dir, limits, oracle_dir, sampling)]
    if spec.source == "boxed":
        return [boxed_config(spec, data_dir)]  # one answer sampled at 0.9 (the study's protocol)
    configs = lm_eval_configs(spec, data_dir, task.fewshot_pool)
    return [lm_eval_sampling(c, sampling) for c in configs] if sampling else configs


def task_sampling(task: PlannedTask, settings: EvalSettings) -> Sampling | None:
    """--samples-per-task for a generative task: N samples at the flag's temperature (or lm-eval's 0.2)."""
    if settings.samples_per_task is None or task.spec.kind != "generative" or task.spec.subtask_field:
        return None
    if task.spec.source == "lm_eval_index":  # a group run by name: its configs are lm-eval's, not ours to change
        return None
    return Sampling(settings.samples_per_task, settings.temperature or DEFAULT_TEMPERATURE)


def build_tasks(manager: Any, configs: list[dict[str, Any]], spec_name: str, data_hint: str) -> list[Any]:
    """lm-eval Task objects for config dicts (this downloads or reads the data)."""
    try:
        tasks = manager.load(configs)["tasks"]
        return [tasks[config["task"]] for config in configs]
    except LayerpruneError:
        raise
    except Exception as exc:  # datasets raises many types for missing files or no network
        raise LayerpruneError(f"could not load the data of task '{spec_name}' ({one_line(exc)[:160]}); "
                              f"{data_hint}") from exc


def run_task(handle: ModelHandle, task: PlannedTask, settings: EvalSettings, chat: bool,
             data_dir: Path | None, cache_root: Path | None = None, sampling: Sampling | None = None) -> dict[str, Any]:
    """One task through `simple_evaluate`; returns lm-eval's results (samples included)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from layerprune.evaluate.lm_eval_env import record_once

    record_once()
    if task.spec.source == "lm_eval_index":
        from layerprune.evaluate.lm_eval_index import load_index_tasks

        manager, lm_tasks = load_index_tasks(task.spec.name, settings.include_path)
    else:
        manager = TaskManager(include_defaults=False)  # configs come whole; no need to index lm-eval's 14k YAMLs
        hint = f"put it at {data_dir or '<data-dir>'}/{task.spec.dataset}/ (--data-dir)"
        lm_tasks = build_tasks(manager, task_configs(task, settings, data_dir, cache_root, sampling), task.spec.name,
                               hint)
    gen = {"max_gen_toks": task.max_gen_toks} if task.max_gen_toks else None
    raw = lm_eval.simple_evaluate(
        model=make_lm(handle, settings), tasks=lm_tasks, num_fewshot=task.num_fewshot, limit=task.limit,
        apply_chat_template=chat, fewshot_as_multiturn=chat, gen_kwargs=gen, log_samples=True,
        confirm_run_unsafe_code=True, task_manager=manager,
    )
    if raw is None:
        raise LayerpruneError(f"lm-eval returned no results for {task.spec.name}")
    if task.spec.subtask_field is not None:
        aggregate_group(task.spec, raw)
    if task.spec.source == "lm_eval_index":
        merge_samples(task.spec.name, raw)
    return raw


def evaluate_task(handle: ModelHandle, task: PlannedTask, settings: EvalSettings, chat: bool,
                  data_dir: Path | None, cache_root: Path, sampling: Sampling | None = None) -> dict[str, Any]:
    """Cached result of one task: {'rows': [...], 'raw': lm-eval results, 'samples': [...]}.

    With `sampling`, the task's N sampled completions per document, scored as pass@k / maj@N (rows not headline).
    """
    key = task_settings(task, settings, handle.run, chat, sampling, handle.precision())
    path = cache_path(cache_root, handle.digest, task.spec.name, key)
    cached = read_cached(path) if settings.reuse else None
    if cached is not None:
        for row in cached["rows"]:
            row["cached"] = True
        return cached
    start = time.perf_counter()
    with errors.stage(f"evaluate ({task.spec.name})"):
        raw = run_task(handle, task, settings, chat, data_dir, cache_root, sampling)
    seconds = time.perf_counter() - start
    samples = raw.pop("samples", {}).get(task.spec.name, [])
    rows = [r.model_dump() for r in summarize(task.spec, raw, key, seconds, sampled=sampling is not None)]
    entry = json.loads(json.dumps({"rows": rows, "raw": raw, "samples": samples}, default=str))
    write_cached(path, entry)
    return entry




def evaluate_model(
    model: str | os.PathLike[str] | LoadedModel | ModelSource | None,
    settings: EvalSettings | None = None,
    run: RunSettings | None = None,
    output_dir: Path | None = None,
    overwrite: bool = False,
    progress: Callable[[str], None] | None = None,
    model_hash_override: str | None = None,
    calibration_from: str | os.PathLike[str] | None = None,
) -> Summary:
    """Evaluate one model on a suite or tasks; results are cached and, given `output_dir`, saved there.

    `model` is a spec (hub id, directory, .gguf, "embedded"), a ModelSource or a LoadedModel (used as is).
    Results are cached by (model hash, task, settings); pass `model_hash_override` for a model changed in memory
    in a way its files and shape do not show, or `EvalSettings(reuse=False)`.
    The evaluated documents are checked against the calibration items recorded by the pruned model directory
    `calibration_from` (default: `model` itself when it is one); an overlap is refused unless `allow_overlap`.
    """
    settings, run = settings or EvalSettings(), run or RunSettings()
    if output_dir is not None:
        check_output_dir(output_dir, overwrite, input_paths(model, calibration_from))
    data_dir = resolve_data_dir(settings.data_dir)
    planned, skipped = plan_tasks(settings, data_dir)
    if any(task.spec.source == "humaneval" for task in planned):
        isolation_level(settings.unsafe_code_exec)  # refuse before the model loads
    overlap = calibration_overlap(planned, settings, data_dir, calibration_from or model)
    if settings.reference_solutions:
        handle, template = reference_handle(planned, data_dir, run), False
        settings = settings.model_copy(update={"reuse": False})  # a check of the machine: always run it
    elif settings.backend == "llamacpp":
        from layerprune.evaluate.llamacpp_lm import llamacpp_handle

        handle = llamacpp_handle(model, run)
        template = bool(handle.lm.template)
    else:
        handle = handle_for(model, run)
        handle.digest = model_hash_override or model_fingerprint(handle.source, run.resolved_cache_dir(), handle.loaded)
        template = has_chat_template(handle)
    entries = evaluate_planned(handle, planned, settings, template, data_dir, progress or log.info)
    summary = Summary(
        model=EvaluatedModel(spec=handle.source.spec, location=handle.source.location, kind=handle.source.kind,
                             identity=handle.source.identity, chat_template=settings.chat_template,
                             has_chat_template=template),
        model_hash=handle.digest, results=[TaskResult(**r) for e in entries.values() for r in e["rows"]],
        provenance=collect_provenance(), skipped=skipped, calibration_overlap=overlap,
    )
    if output_dir is not None:
        from layerprune.evaluate.report import write_model_results

        with atomic_output_dir(output_dir, overwrite) as tmp:
            write_model_results(tmp, summary, entries)
    return summary


def evaluate_planned(handle: ModelHandle, planned: list[PlannedTask], settings: EvalSettings, template: bool,
                     data_dir: Path | None, progress: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Each planned task's cached or fresh entry by name, and "<task>.sampled" for its samples per document."""
    cache_root = handle.run.resolved_cache_dir() / "eval"
    check_probe_format(planned, settings.probe_format, template)
    entries = {}
    for index, task in enumerate(planned, 1):
        chat = applies_chat(task, settings.chat_template, template, settings.probe_format)
        limit = "all" if task.limit is None else f"{task.limit:g}"
        progress(f"[{index}/{len(planned)}] {task.spec.name} (limit {limit}, chat {chat})")
        entries[task.spec.name] = evaluate_task(handle, task, settings, chat, data_dir, cache_root)
        sampling = task_sampling(task, settings)
        if sampling is not None:
            progress(f"[{index}/{len(planned)}] {task.spec.name}: {sampling.n} samples per document "
                     f"at temperature {sampling.temperature:g}")
            entries[f"{task.spec.name}.sampled"] = evaluate_task(handle, task, settings, chat, data_dir, cache_root,
                                                                 sampling)
    return entries
