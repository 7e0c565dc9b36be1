"""Evaluate one model: plan the tasks, run each through lm-eval's `simple_evaluate`, cache and save results."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from layerprune import __version__
from layerprune.data import resolve_data_dir
from layerprune.errors import LayerpruneError, one_line
from layerprune.evaluate.humaneval import GT_TIME_LIMIT_FACTOR, MIN_TIME_LIMIT, reference_lm
from layerprune.evaluate.offline import lm_eval_configs
from layerprune.evaluate.overlap import calibration_overlap
from layerprune.evaluate.project_tasks import (DEFAULT_TEMPERATURE, Sampling, boxed_config, humaneval_config,
                                               humaneval_rows, lm_eval_sampling, probe_config)
from layerprune.evaluate.results import (aggregate_group, cache_path, file_sha256, model_hash, read_cached,
                                         summarize, write_cached)
from layerprune.evaluate.sandbox import SandboxLimits, isolation_level
from layerprune.evaluate.schema import EvalSettings, Summary, TaskResult
from layerprune.evaluate.registry import TASKS, TaskSpec
from layerprune.evaluate.suites import PlannedTask, plan_tasks
from layerprune.models import LoadedModel, ModelSource, load_model, resolve_model
from layerprune.models.loading import load_tokenizer
from layerprune.outputs import atomic_output_dir, check_output_dir
from layerprune.probes import PROBE_VERSION
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
CPU_BATCH = 32


@dataclass
class ModelHandle:
    """A model that is loaded only when some task is not cached."""

    source: ModelSource
    run: RunSettings
    loaded: LoadedModel | None = None
    lm: Any = None
    digest: str = ""

    def get(self) -> LoadedModel:
        if self.loaded is None:
            log.info("loading %s", self.source.spec)
            self.loaded = load_model(self.source, self.run)
        return self.loaded


def has_chat_template(handle: ModelHandle) -> bool:
    tokenizer = handle.loaded.tokenizer if handle.loaded else load_tokenizer(handle.source, handle.run)
    return bool(getattr(tokenizer, "chat_template", None))


def applies_chat(task: PlannedTask, mode: str, template: bool) -> bool:
    """--chat-template: on = every task (when the model has a template), auto = where the task calls for it."""
    if mode == "off" or not template:
        return False
    return mode == "on" or task.spec.chat_protocol


def task_settings(task: PlannedTask, settings: EvalSettings, run: RunSettings, chat: bool,
                  sampling: Sampling | None = None) -> dict[str, Any]:
    """Everything that can change a task's score; the cache key and the record in the summary."""
    source = task.spec.source
    sandbox = [settings.sandbox_timeout, settings.sandbox_memory_mb, GT_TIME_LIMIT_FACTOR, MIN_TIME_LIMIT, "evalplus"]
    return {
        "task": task.spec.name, "limit": task.limit, "num_fewshot": task.num_fewshot,
        "fewshot_split": task.fewshot_pool, "fewshot_from_eval_split": _from_eval_split(task),
        "max_gen_toks": task.max_gen_toks, "chat_template": chat, "backend": settings.backend,
        "batch_size": settings.batch_size, "dtype": str(run.resolved_dtype()), "device": run.resolved_device().type,
        "probe_seed": settings.probe_seed if source == "probe" else None,
        "sandbox": sandbox + [isolation_level(settings.unsafe_code_exec)] if source == "humaneval" else None,
        "sampling": [sampling.n, sampling.temperature] if sampling else None,
        "lm_eval": importlib.metadata.version("lm_eval"), "data": _data_identity(task, settings),
        "layerprune": __version__, "probe_version": PROBE_VERSION if source == "probe" else None,
        "task_files": _task_files_identity(task, settings),
    }


def _task_files_identity(task: PlannedTask, settings: EvalSettings) -> str | None:
    """For a task that is not layerprune's own: a hash of the user's task folder and of the local data files its
    YAML names, so an edited task never serves a stale result (lm-eval's own files are pinned by its version)."""
    spec = task.spec
    if spec.name in TASKS and TASKS.get(spec.name) is spec:
        return None
    files = sorted(Path(settings.include_path).rglob("*")) if settings.include_path is not None else []
    files += _local_data_files(spec)
    digest = hashlib.sha256()
    for path in files:
        if path.is_file() and path.suffix in (".yaml", ".yml", ".py", ".jsonl", ".json", ".csv", ".txt"):
            digest.update(f"{path}:".encode() + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def _local_data_files(spec: TaskSpec) -> list[Path]:
    if spec.lm_eval_yaml is None or spec.dataset is not None:
        return []
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(Path(spec.lm_eval_yaml), resolve_func=False)
    named = (config.get("dataset_kwargs") or {}).get("data_files") or []
    values = named.values() if isinstance(named, dict) else [named] if isinstance(named, str) else named
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [Path(v) for v in flat if isinstance(v, str) and Path(v).is_file()]


def _from_eval_split(task: PlannedTask) -> bool:
    """Few-shot examples drawn from the scored split in place of lm-eval's own pool (--fewshot-from-eval-split)."""
    spec = task.spec
    return task.fewshot_pool is not None and task.fewshot_pool == spec.eval_split != spec.fewshot_split


_FILE_HASHES: dict[str, Any] = {}  # (path, size, mtime) -> sha256, for this process


def _data_identity(task: PlannedTask, settings: EvalSettings) -> str | None:
    """The content hashes of the task's local data files ("hub" when it reads the hub)."""
    if task.spec.source == "probe" or task.spec.dataset is None:
        return None
    data_dir = resolve_data_dir(settings.data_dir)
    if data_dir is None:
        return "hub"
    folder = data_dir / task.spec.dataset
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    return ";".join(f"{p.name}:{file_sha256(p, _FILE_HASHES)[:16]}" for p in files) or "hub"


def task_configs(task: PlannedTask, settings: EvalSettings, data_dir: Path | None, cache_root: Path | None = None,
                 sampling: Sampling | None = None) -> list[dict[str, Any]]:
    """The lm-eval task configs behind one of our tasks (several for a group such as mmlu)."""
    spec = task.spec
    if spec.source == "probe":
        return [probe_config(spec, settings.probe_seed, sampling)]
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


def make_lm(handle: ModelHandle, settings: EvalSettings) -> Any:
    """lm-eval's model wrapper: HFLM around the loaded model, or vLLM given the model's location."""
    if handle.lm is not None:
        return handle.lm
    batch: int | str = settings.batch_size if settings.batch_size == "auto" else int(settings.batch_size)
    if settings.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise LayerpruneError("--backend vllm needs vLLM (pip install 'layerprune[vllm]' on a CUDA machine)")
        from lm_eval.models.vllm_causallms import VLLM

        handle.lm = VLLM(pretrained=handle.source.location, batch_size=batch,
                         dtype=str(handle.run.resolved_dtype()).removeprefix("torch."), seed=handle.run.seed)
        return handle.lm
    from lm_eval.models.huggingface import HFLM

    loaded = handle.get()
    if batch == "auto" and loaded.model.device.type == "cpu":
        batch = CPU_BATCH
    handle.lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch, max_batch_size=64)
    return handle.lm


def run_task(handle: ModelHandle, task: PlannedTask, settings: EvalSettings, chat: bool,
             data_dir: Path | None, cache_root: Path | None = None, sampling: Sampling | None = None) -> dict[str, Any]:
    """One task through `simple_evaluate`; returns lm-eval's results (samples included)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    if task.spec.source == "lm_eval_index":
        manager, lm_tasks = index_tasks(task, settings)
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


def index_tasks(task: PlannedTask, settings: EvalSettings) -> tuple[Any, list[Any]]:
    """A group, tag or Python task by name, built by lm-eval's TaskManager as its CLI does (this reads the data)."""
    from layerprune.evaluate.lm_eval_index import manager_for

    manager = manager_for(task.spec.name, settings.include_path)
    try:
        loaded = manager.load([task.spec.name])
    except Exception as exc:  # datasets raises many types for missing files or no network
        raise LayerpruneError(f"could not load lm-eval task '{task.spec.name}' ({one_line(exc)[:200]})") from exc
    top = loaded["groups"].get(task.spec.name) or loaded["tasks"].get(task.spec.name)
    return manager, [top] if top is not None else list(loaded["tasks"].values())


def merge_samples(name: str, raw: dict[str, Any]) -> None:
    """A group's or tag's samples under its own name, each marked with its subtask."""
    samples = raw.get("samples", {})
    subs = sorted(key for key in samples if key != name)
    if subs:
        merged = [{**sample, "subtask": sub} for sub in subs for sample in samples.pop(sub)]
        samples[name] = samples.pop(name, []) + merged


def evaluate_task(handle: ModelHandle, task: PlannedTask, settings: EvalSettings, chat: bool,
                  data_dir: Path | None, cache_root: Path, sampling: Sampling | None = None) -> dict[str, Any]:
    """Cached result of one task: {'rows': [...], 'raw': lm-eval results, 'samples': [...]}.

    With `sampling`, the task's N sampled completions per document, scored as pass@k / maj@N (rows not headline).
    """
    key = task_settings(task, settings, handle.run, chat, sampling)
    path = cache_path(cache_root, handle.digest, task.spec.name, key)
    cached = read_cached(path) if settings.reuse else None
    if cached is not None:
        for row in cached["rows"]:
            row["cached"] = True
        return cached
    start = time.perf_counter()
    raw = run_task(handle, task, settings, chat, data_dir, cache_root, sampling)
    seconds = time.perf_counter() - start
    samples = raw.pop("samples", {}).get(task.spec.name, [])
    rows = [r.model_dump() for r in summarize(task.spec, raw, key, seconds, sampled=sampling is not None)]
    entry = json.loads(json.dumps({"rows": rows, "raw": raw, "samples": samples}, default=str))
    write_cached(path, entry)
    return entry


def versions() -> dict[str, str]:
    names = ("layerprune", "lm_eval", "torch", "transformers", "datasets")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def fingerprint(handle: ModelHandle, cache_root: Path) -> str:
    """The weight files' hash plus the block count (a model with blocks dropped in memory differs from its files)."""
    digest = model_hash(handle.source, cache_root)
    if handle.loaded is not None:
        layers = handle.loaded.model.config.get_text_config().num_hidden_layers
    else:
        config = Path(handle.source.location) / "config.json"
        body = json.loads(config.read_text()) if config.is_file() else {}
        layers = body.get("num_hidden_layers", body.get("text_config", {}).get("num_hidden_layers"))
    return hashlib.sha256(f"{digest}:{layers}".encode()).hexdigest()


def reference_handle(planned: list[PlannedTask], data_dir: Path | None, run: RunSettings) -> ModelHandle:
    """A stand-in model that answers each HumanEval+ prompt with the dataset's canonical solution."""
    others = [t.spec.name for t in planned if t.spec.source != "humaneval"]
    if others:
        raise LayerpruneError(f"--reference-solutions scores HumanEval+ only; not {', '.join(others)} "
                              "(--tasks humaneval_plus)")
    source = ModelSource("reference-solutions", "", "reference", {"dataset": "humaneval_plus canonical_solution"})
    handle = ModelHandle(source, run, lm=reference_lm(humaneval_rows(data_dir)))
    handle.digest = hashlib.sha256(b"reference-solutions").hexdigest()
    return handle


def _handle_for(model: str | os.PathLike[str] | LoadedModel | ModelSource | None, run: RunSettings) -> ModelHandle:
    if isinstance(model, LoadedModel):
        return ModelHandle(model.source, run, loaded=model)
    source = model if isinstance(model, ModelSource) else resolve_model(model, run)
    return ModelHandle(source, run)


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
        check_output_dir(output_dir, overwrite)
    data_dir = resolve_data_dir(settings.data_dir)
    planned, skipped = plan_tasks(settings, data_dir)
    if any(task.spec.source == "humaneval" for task in planned):
        isolation_level(settings.unsafe_code_exec)  # refuse before the model loads
    overlap = calibration_overlap(planned, settings, data_dir, calibration_from or model)
    cache_root = run.resolved_cache_dir() / "eval"
    if settings.reference_solutions:
        handle, template = reference_handle(planned, data_dir, run), False
        settings = settings.model_copy(update={"reuse": False})  # a check of the machine: always run it
    else:
        handle = _handle_for(model, run)
        handle.digest = model_hash_override or fingerprint(handle, cache_root)
        template = has_chat_template(handle)
    entries = {}
    for index, task in enumerate(planned, 1):
        chat = applies_chat(task, settings.chat_template, template)
        limit = "all" if task.limit is None else f"{task.limit:g}"
        (progress or log.info)(f"[{index}/{len(planned)}] {task.spec.name} (limit {limit}, chat {chat})")
        entries[task.spec.name] = evaluate_task(handle, task, settings, chat, data_dir, cache_root)
        sampling = task_sampling(task, settings)
        if sampling is not None:
            (progress or log.info)(f"[{index}/{len(planned)}] {task.spec.name}: {sampling.n} samples per document "
                                   f"at temperature {sampling.temperature:g}")
            entries[f"{task.spec.name}.sampled"] = evaluate_task(handle, task, settings, chat, data_dir, cache_root,
                                                                 sampling)
    summary = Summary(
        model={"spec": handle.source.spec, "location": handle.source.location, "kind": handle.source.kind,
               "identity": handle.source.identity, "chat_template": settings.chat_template,
               "has_chat_template": template},
        model_hash=handle.digest, results=[TaskResult(**r) for e in entries.values() for r in e["rows"]],
        versions=versions(), skipped=skipped, calibration_overlap=overlap,
    )
    if output_dir is not None:
        from layerprune.evaluate.report import write_model_results

        with atomic_output_dir(output_dir, overwrite) as tmp:
            write_model_results(tmp, summary, entries)
    return summary
