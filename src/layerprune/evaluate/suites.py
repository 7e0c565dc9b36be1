"""Suites as data (tasks/suites.yaml) and the plan they expand to: tasks with their settings."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import build_schema
from layerprune.core.registry import unknown_name_message
from layerprune.evaluate.offline import (
    check_fewshot_pool,
    default_fewshot,
    fewshot_pool,
    local_files,
    missing_splits,
    require_data,
)
from layerprune.evaluate.schema import EvalSettings, Suite, TaskSettings
from layerprune.evaluate.task_specs import TASKS, TaskSpec
from layerprune.tasks.data import check_jsonl, hub_offline
from layerprune.tasks.probes import PROBE_SHOTS

log = logging.getLogger(__name__)
DEFAULT_SUITE = "quick"


@dataclass(frozen=True)
class PlannedTask:
    """One task with the settings it will run under."""

    spec: TaskSpec
    limit: float | None
    num_fewshot: int | None
    max_gen_toks: int | None
    fewshot_pool: str | None = None  # the split few-shot examples come from (None: zero-shot, or not lm-eval data)


@functools.cache
def load_suites() -> dict[str, Suite]:
    """The shipped suites, validated."""
    text = resources.files("layerprune.evaluate").joinpath("tasks/suites.yaml").read_text()
    return {name: build_schema(Suite, body) for name, body in yaml.safe_load(text).items()}


def get_suite(name: str) -> Suite:
    suites = load_suites()
    if name not in suites:
        raise LayerpruneError(unknown_name_message("suite", name, suites))
    return suites[name]


def expand(name: str, seen: tuple[str, ...] = ()) -> list[tuple[str, list[Suite]]]:
    """Leaf tasks of a suite, each with the chain of suites it came through (outermost first)."""
    if name in seen:
        raise LayerpruneError(f"suite '{name}' includes itself")
    suite = get_suite(name)
    out: list[tuple[str, list[Suite]]] = []
    for item in suite.tasks:
        if item in load_suites():
            out += [(task, [suite, *chain]) for task, chain in expand(item, (*seen, name))]
        else:
            TASKS.get(item)
            out.append((item, [suite]))
    return out


def _suite_settings(spec: TaskSpec, chain: list[Suite]) -> TaskSettings:
    """Innermost suite first, outer suites win (quick's limits beat the algorithmic suite's)."""
    merged: dict[str, object] = {}
    for suite in reversed(chain):
        for layer in (getattr(suite, spec.kind), suite.overrides.get(spec.name)):
            if layer is not None:
                merged.update(layer.model_dump(exclude_none=True))
    return TaskSettings.model_validate(merged)


def resolve_task(name: str, include_path: Path | None = None) -> TaskSpec:
    """A registered task, else (the user's folder first) any task, group or tag lm-eval knows."""
    from layerprune.evaluate.lm_eval_index import lm_eval_task_spec, user_entry

    if user_entry(name, include_path) is not None:
        return lm_eval_task_spec(name, include_path)  # type: ignore[return-value]
    if (error := task_name_error(name, include_path)) is not None:
        raise LayerpruneError(error)
    return TASKS.get(name) if name in TASKS else lm_eval_task_spec(name, include_path)  # type: ignore[return-value]


def task_name_error(name: str, include_path: Path | None = None) -> str | None:
    """Why resolve_task would refuse `name` (None: it would not), found without loading the task.

    lm-eval's index is read only for a name layerprune does not register, or with --include-path.
    """
    from layerprune.evaluate.lm_eval_index import index_entry, unknown_task_message, user_entry

    if any(char in name for char in "*?[") or (include_path is not None and not Path(include_path).is_dir()):
        return None  # patterns expand when planned; plan_tasks names a missing --include-path folder
    if include_path is not None and user_entry(name, include_path) is not None:
        return None
    if name in load_suites() and name not in TASKS:
        return f"'{name}' is a suite; use --suite {name}"
    if name in TASKS or index_entry(name, include_path) is not None:
        return None
    return unknown_task_message(name, [*TASKS.names(), *load_suites()], include_path)


def plan_tasks(settings: EvalSettings, data_dir: Path | None) -> tuple[list[PlannedTask], dict[str, str]]:
    """The tasks to run with their settings, and the optional ones skipped for missing data."""
    if settings.tasks:
        from layerprune.evaluate.lm_eval_index import expand_patterns

        names = expand_patterns(settings.tasks, TASKS.names(), settings.include_path)
        specs = {name: resolve_task(name, settings.include_path) for name in names}
        entries: list[tuple[str, list[Suite]]] = [(name, []) for name in names]
        from_suite = False
    else:
        entries = _only(expand(settings.suite or DEFAULT_SUITE), settings)
        specs = {name: TASKS.get(name) for name, _ in entries}
        from_suite = True
    planned, skipped = [], {}
    for name, chain in dict(entries).items():
        spec = specs[name]
        if from_suite and (reason := _skip_reason(spec, data_dir)):
            skipped[name] = reason
            continue
        planned.append(_plan_one(spec, _suite_settings(spec, chain), settings, data_dir))
    if not planned:
        raise LayerpruneError(f"nothing to evaluate: {'; '.join(f'{k}: {v}' for k, v in skipped.items())}")
    return planned, skipped


def _only(entries: list[tuple[str, list[Suite]]], settings: EvalSettings) -> list[tuple[str, list[Suite]]]:
    """The suite's tasks that `settings.only` names (all without it); a name the suite lacks is an error."""
    if settings.only is None:
        return entries
    names = [name for name, _ in entries]
    missing = [name for name in settings.only if name not in names]
    if missing:
        raise LayerpruneError(f"suite '{settings.suite or DEFAULT_SUITE}' has no task {', '.join(missing)} "
                              f"(--only picks among: {', '.join(names)})")
    return [(name, chain) for name, chain in entries if name in settings.only]


def _skip_reason(spec: TaskSpec, data_dir: Path | None) -> str | None:
    """Why a suite leaves out an optional task: its files are not in the data mirror in use, or the hub is offline.

    Without any mirror (a user with the hub) it is read from the hub like every other task.
    """
    if not spec.optional or spec.dataset is None:
        return None
    missing = missing_splits(spec, data_dir)
    if not missing or (data_dir is None and not hub_offline()):
        return None
    return f"no data at {missing[0]} (--tasks {spec.name} reads it from the hub)"


def _plan_one(spec: TaskSpec, suite: TaskSettings, settings: EvalSettings, data_dir: Path | None) -> PlannedTask:
    fewshot = settings.num_fewshot if settings.num_fewshot is not None else suite.num_fewshot
    shots = (fewshot if fewshot is not None else default_fewshot(spec)) if spec.source == "lm_eval" else 0
    pool = fewshot_pool(spec, data_dir, shots, settings.fewshot_from_eval_split) if spec.source == "lm_eval" else None
    if spec.dataset is not None:  # fails now, naming the missing or bad file, rather than after the model loads
        require_data(spec, data_dir, pool)
        for path in local_files(spec, data_dir, pool):
            check_jsonl(path)
    elif spec.name not in TASKS:
        from layerprune.evaluate.lm_eval_index import require_reachable

        require_reachable(spec, settings.include_path)
    if spec.source in ("probe", "humaneval", "boxed"):
        fewshot = 0  # probes carry their own shots; HumanEval+ and the boxed GSM8K protocol are zero-shot
        if spec.source == "probe" and settings.probe_format == "chat":
            fewshot = PROBE_SHOTS  # each document's own examples, as chat turns (project_tasks.chat_probe_config)
    elif spec.source == "lm_eval":
        check_fewshot_pool(spec, data_dir, shots, pool)
    limit = settings.limit if settings.limit is not None else suite.limit
    tokens = settings.max_gen_toks if settings.max_gen_toks is not None else suite.max_gen_toks
    return PlannedTask(spec, limit, fewshot, tokens if spec.source != "probe" else None, pool)


def describe_suites() -> str:
    """The text `evaluate --list` prints."""
    lines = ["suites:"]
    for name, suite in load_suites().items():
        lines.append(f"  {name:<15} {suite.description}")
        lines.append(f"  {'':<15} tasks: {', '.join(suite.tasks)}")
    lines.append("tasks:")
    for name in TASKS.names():
        spec = TASKS.get(name)
        lines.append(f"  {name:<15} {spec.kind:<15} {', '.join(spec.metrics)}")
    lines.append("  and any task, group or tag lm-eval knows (`lm-eval ls tasks`); your own YAMLs with --include-path")
    return "\n".join(lines)
