"""The result cache: what can change a task's score (its key), the identity of its data, and where a result is kept.

A result is kept under <cache>/eval/<model fingerprint>/<task>-<settings key>.json, written whole or not at all.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

from layerprune.core.outputs import write_atomic
from layerprune.core.settings import RunSettings
from layerprune.core.version import package_version
from layerprune.evaluate.humaneval import GT_TIME_LIMIT_FACTOR, MIN_TIME_LIMIT
from layerprune.evaluate.project_tasks import Sampling
from layerprune.evaluate.sandbox import isolation_level
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import PlannedTask
from layerprune.evaluate.task_specs import TASKS, TaskSpec
from layerprune.models.identity import Memo, file_sha256
from layerprune.tasks.data import resolve_data_dir
from layerprune.tasks.probes import PROBE_VERSION

__version__ = package_version()  # in every cache key: a new release invalidates cached scores

TASK_FILE_SUFFIXES = (".yaml", ".yml", ".py", ".jsonl", ".json", ".csv", ".txt")


def task_settings(task: PlannedTask, settings: EvalSettings, run: RunSettings, chat: bool,
                  sampling: Sampling | None = None, precision: tuple[str, str] | None = None) -> dict[str, Any]:
    """Everything that can change a task's score; the cache key and the record in the summary (`precision`: the
    model's (dtype, device type) where it is already loaded; else the run's)."""
    dtype, device = precision or (str(run.resolved_dtype()), run.resolved_device().type)
    source = task.spec.source
    sandbox = [settings.sandbox_timeout, settings.sandbox_memory_mb, GT_TIME_LIMIT_FACTOR, MIN_TIME_LIMIT, "evalplus"]
    return {
        "task": task.spec.name, "limit": task.limit, "num_fewshot": task.num_fewshot,
        "fewshot_split": task.fewshot_pool, "fewshot_from_eval_split": _from_eval_split(task),
        "max_gen_toks": task.max_gen_toks, "chat_template": chat, "backend": settings.backend,
        "batch_size": settings.batch_size, "dtype": dtype, "device": device,
        "probe_seed": settings.probe_seed if source == "probe" else None,
        "sandbox": sandbox + [isolation_level(settings.unsafe_code_exec)] if source == "humaneval" else None,
        "sampling": [sampling.n, sampling.temperature] if sampling else None,
        "lm_eval": importlib.metadata.version("lm_eval"), "data": data_identity(task, settings),
        "layerprune": __version__, "probe_version": PROBE_VERSION if source == "probe" else None,
        "task_files": task_files_identity(task, settings),
        **({"probe_format": "chat"} if source == "probe" and settings.probe_format == "chat" else {}),
    }


def _from_eval_split(task: PlannedTask) -> bool:
    """Few-shot examples drawn from the scored split in place of lm-eval's own pool (--fewshot-from-eval-split)."""
    spec = task.spec
    return task.fewshot_pool is not None and task.fewshot_pool == spec.eval_split != spec.fewshot_split


def task_files_identity(task: PlannedTask, settings: EvalSettings) -> str | None:
    """For a task that is not layerprune's own: a hash of the user's task folder and of the local data files its
    YAML names, so an edited task never serves a stale result (lm-eval's own files are pinned by its version)."""
    spec = task.spec
    if spec.name in TASKS and TASKS.get(spec.name) is spec:
        return None
    files = sorted(Path(settings.include_path).rglob("*")) if settings.include_path is not None else []
    files += _local_data_files(spec)
    digest = hashlib.sha256()
    for path in files:
        if path.is_file() and path.suffix in TASK_FILE_SUFFIXES:
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


_DATA_HASHES: Memo = {}  # the data files' hashes, for this process


def data_identity(task: PlannedTask, settings: EvalSettings) -> str | None:
    """The content hashes of the task's local data files ("hub" when it reads the hub)."""
    if task.spec.source == "probe" or task.spec.dataset is None:
        return None
    data_dir = resolve_data_dir(settings.data_dir)
    if data_dir is None:
        return "hub"
    folder = data_dir / task.spec.dataset
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    return ";".join(f"{p.name}:{file_sha256(p, _DATA_HASHES)[:16]}" for p in files) or "hub"


def settings_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(cache_root: Path, model_digest: str, task: str, settings: dict[str, Any]) -> Path:
    return cache_root / model_digest[:20] / f"{task}-{settings_key(settings)}.json"


def read_cached(path: Path) -> dict[str, Any] | None:
    """A cached result, or None when there is none or it cannot be read whole."""
    try:
        entry = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("rows"), list) else None


def write_cached(path: Path, entry: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(entry, indent=1, default=str))
