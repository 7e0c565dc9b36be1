"""Any task, group or tag lm-eval knows, and the user's own task YAMLs (--include-path), run by name as lm-eval runs it.

A plain YAML task becomes a TaskSpec over its own file, so it reads the local mirror where the mirror holds its
dataset (the same hub dataset as one of the registered tasks); groups, tags and Python tasks go to lm-eval's
TaskManager by name and read the hub.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.evaluate.task_specs import TASKS, Kind, TaskSpec

SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' loaders of local files


@functools.cache
def task_manager(include_path: str | None, defaults: bool = True) -> Any:
    """lm-eval's TaskManager over its own tasks (defaults) and the user's folder; indexing takes seconds."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise LayerpruneError(f"--include-path {include_path} is not a folder")
    return TaskManager(include_path=include_path, include_defaults=defaults)


def include_folder(include_path: Path | None) -> str | None:
    return None if include_path is None else str(Path(include_path).resolve())


def user_entry(name: str, include_path: Path | None) -> Any:
    """The entry of `name` in the user's own folder (their task wins over a same-named one, as in lm-eval)."""
    if include_path is None:
        return None
    return task_manager(include_folder(include_path), defaults=False).task_index.get(name)


def index_entry(name: str, include_path: Path | None) -> Any:
    return task_manager(include_folder(include_path)).task_index.get(name)


@functools.cache
def mirror_datasets() -> dict[tuple[str, str | None], str]:
    """(hub dataset_path, dataset_name) -> mirror folder, for the datasets the registered tasks read."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from layerprune.evaluate.offline import lm_eval_tasks_dir

    found = {}
    for name in TASKS.names():
        spec = TASKS.get(name)
        if spec.source == "lm_eval" and spec.subtask_field is None and spec.lm_eval_yaml and spec.dataset:
            config = load_yaml(lm_eval_tasks_dir() / spec.lm_eval_yaml, resolve_func=False)
            found[(config["dataset_path"], config.get("dataset_name"))] = spec.dataset
    return found


def _kind(entry: Any, index: dict[str, Any], depth: int = 0) -> Kind:
    """generative when the task (or a group's first task) generates text, else classification."""
    from lm_eval.tasks._index import Kind as EntryKind

    config = entry.cfg or {}
    if entry.kind in (EntryKind.TASK, EntryKind.PY_TASK) or depth > 4:
        return "generative" if config.get("output_type") == "generate_until" else "classification"
    members = sorted(entry.tags) if entry.kind == EntryKind.TAG else config.get("task") or []
    for member in members:
        child = member.get("task") if isinstance(member, dict) else member
        if isinstance(child, str) and child in index:
            return _kind(index[child], index, depth + 1)
    return "classification"


def yaml_task_spec(name: str, entry: Any, kind: Kind) -> TaskSpec:
    """A plain YAML task: its own file, its own splits, and the mirror folder of its hub dataset if there is one."""
    from lm_eval.tasks._yaml_loader import load_yaml

    config = load_yaml(entry.yaml_path, resolve_func=False)
    splits = {key: config[key] for key in SPLIT_KEYS if config.get(key)}
    dataset = mirror_datasets().get((config.get("dataset_path"), config.get("dataset_name")))
    fixed = bool((config.get("fewshot_config") or {}).get("samples")) and "fewshot_split" not in splits
    if dataset is not None and not (splits.get("test_split") or splits.get("validation_split")):
        dataset = None  # no split we know how to score locally: lm-eval reads the hub
    return TaskSpec(name, kind, "lm_eval", (), dataset if splits else None, str(entry.yaml_path), splits,
                    fixed_shots=fixed)


def lm_eval_task_spec(name: str, include_path: Path | None) -> TaskSpec | None:
    """The spec of a name lm-eval knows (the user's folder first, then lm-eval's own index), or None."""
    from lm_eval.tasks._index import Kind as EntryKind

    entry = user_entry(name, include_path)
    index = task_manager(include_folder(include_path), defaults=entry is None).task_index
    entry = entry or index.get(name)
    if entry is None:
        return None
    if entry.kind == EntryKind.TASK and entry.yaml_path is not None:
        return yaml_task_spec(name, entry, _kind(entry, index))
    return TaskSpec(name, _kind(entry, index), "lm_eval_index", ())


def manager_for(name: str, include_path: Path | None) -> Any:
    """The user's folder alone when it defines `name` and all it names; else lm-eval's own tasks as well."""
    entry = user_entry(name, include_path)
    if entry is not None:
        user = task_manager(include_folder(include_path), defaults=False)
        members = sorted(entry.tags) if entry.cfg is None else (entry.cfg.get("task") or [])
        names = [m.get("task") or m.get("group") if isinstance(m, dict) else m for m in members]
        if isinstance(members, list) and all(n in user.task_index for n in names):
            return user
    return task_manager(include_folder(include_path))


def load_index_tasks(name: str, include_path: Path | None) -> tuple[Any, list[Any]]:
    """A group, tag or Python task by name, built by lm-eval's TaskManager as its CLI does (this reads the data)."""
    manager = manager_for(name, include_path)
    try:
        loaded = manager.load([name])
    except Exception as exc:  # datasets raises many types for missing files or no network
        raise LayerpruneError(f"could not load lm-eval task '{name}' ({one_line(exc)[:200]})") from exc
    top = loaded["groups"].get(name) or loaded["tasks"].get(name)
    return manager, [top] if top is not None else list(loaded["tasks"].values())


def expand_patterns(names: list[str], ours: list[str], include_path: Path | None) -> list[str]:
    """Glob patterns ('leaderboard_bbh_*') expanded over layerprune's names and lm-eval's index, as its CLI does."""
    out: list[str] = []
    for name in names:
        if not any(char in name for char in "*?["):
            out.append(name)
            continue
        known = [*ours, *task_manager(include_folder(include_path)).all_tasks]
        matches = sorted(set(fnmatch.filter(known, name)))
        if not matches:
            raise LayerpruneError(f"no task matches '{name}' (lm-eval ls tasks lists them)")
        out += matches
    return list(dict.fromkeys(out))


def require_reachable(spec: TaskSpec, include_path: Path | None) -> None:
    """With the hub offline, refuse at planning (before any model loads) a task of lm-eval's that reads the hub."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from layerprune.tasks.data import hub_offline

    if not hub_offline() or user_entry(spec.name, include_path) is not None:
        return  # the user's own tasks may read local files; lm-eval reports what it cannot load
    if spec.source == "lm_eval":
        path = load_yaml(Path(str(spec.lm_eval_yaml)), resolve_func=False).get("dataset_path")
        if path is None or path in LOCAL_BUILDERS or Path(str(path)).exists():
            return
        where = f"'{path}'"
    else:
        where = "its data"
    raise LayerpruneError(f"lm-eval task '{spec.name}' reads {where} from the hub, and the hub is offline "
                          f"(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)")


def unknown_task_message(name: str, ours: list[str], include_path: Path | None) -> str:
    """'unknown task ...; did you mean: ...?' over layerprune's names and lm-eval's whole index."""
    known = [*ours, *task_manager(include_folder(include_path)).all_tasks]
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    hint = f"; did you mean: {', '.join(dict.fromkeys(close))}?" if close else ""
    return (f"unknown task '{name}'{hint} (layerprune's: {', '.join(sorted(ours))}; and any task, group or tag "
            f"lm-eval knows: `lm-eval ls tasks`, or your own YAMLs with --include-path)")
