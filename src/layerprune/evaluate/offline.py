"""Point lm-eval's own task configs (prompts, metrics) at local JSONL files laid out like the hub."""

from __future__ import annotations

import collections
import functools
import importlib.metadata
import json
import logging
from pathlib import Path
from typing import Any

import yaml

from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.task_specs import TaskSpec
from layerprune.tasks.data import DATA_ENV, hub_offline

log = logging.getLogger(__name__)
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def split_path(data_dir: Path, dataset: str, split: str) -> Path:
    return data_dir / dataset / f"{split}.jsonl"


def default_fewshot(spec: TaskSpec) -> int:
    """The shots lm-eval's task config asks for when --num-fewshot is not given (0 where it gives none)."""
    return 0 if spec.lm_eval_yaml is None else _yaml_fewshot(spec.name, spec.lm_eval_yaml)


@functools.cache
def _yaml_fewshot(name: str, relative: str) -> int:
    from lm_eval.tasks._yaml_loader import load_yaml

    path = lm_eval_tasks_dir() / relative
    if path.is_dir():  # a group of subtasks (mmlu): they share one template
        path = sorted(path.glob(f"{name}_*.yaml"))[0]
    return int(load_yaml(path, resolve_func=False).get("num_fewshot") or 0)


def needed_splits(spec: TaskSpec, pool: str | None = None) -> list[str]:
    """The scored split, then the split few-shot examples are drawn from (see `fewshot_pool`)."""
    return [spec.eval_split] + ([pool] if pool is not None and pool != spec.eval_split else [])


def missing_splits(spec: TaskSpec, data_dir: Path | None, pool: str | None = None) -> list[Path]:
    """The local files this task needs that are not there (all of them when there is no data dir)."""
    assert spec.dataset is not None
    root = data_dir if data_dir is not None else Path(f"${DATA_ENV}")
    paths = [split_path(root, spec.dataset, split) for split in needed_splits(spec, pool)]
    return [p for p in paths if data_dir is None or not p.is_file()]


def fewshot_pool(spec: TaskSpec, data_dir: Path | None, shots: int, from_eval_split: bool) -> str | None:
    """The split few-shot examples come from: lm-eval's own choice for the task (its fewshot_split, else its
    training split, else validation), or the scored split when that file is missing and `from_eval_split`
    allows it; None for zero-shot. Without the own pool's file and without the permission: an error."""
    if shots <= 0 or spec.dataset is None or spec.fixed_shots:
        return None
    own = spec.fewshot_split
    if data_dir is None or missing_splits(spec, data_dir) or split_path(data_dir, spec.dataset, own).is_file():
        return own  # lm-eval reads the hub, or the mirror has the pool lm-eval would use
    if from_eval_split:
        return spec.eval_split
    raise LayerpruneError(
        f"--num-fewshot {shots} for '{spec.name}': lm-eval draws its examples from the {own} split, and "
        f"{split_path(data_dir, spec.dataset, own)} is missing; add it (the hub's rows as JSONL), or pass "
        f"--fewshot-from-eval-split to draw them from the {spec.eval_split} split (never a document itself)")


def local_files(spec: TaskSpec, data_dir: Path | None, pool: str | None = None) -> list[Path]:
    """The local files the task will read."""
    if data_dir is None or spec.dataset is None:
        return []
    paths = [split_path(data_dir, spec.dataset, split) for split in needed_splits(spec, pool)]
    return [p for p in paths if p.is_file()]


def require_data(spec: TaskSpec, data_dir: Path | None, pool: str | None = None) -> list[Path]:
    """The local files the task lacks (the hub has to supply them); an error when the hub is offline too."""
    missing = missing_splits(spec, data_dir, pool)
    if missing and hub_offline():
        raise LayerpruneError(
            f"no data for task '{spec.name}' (dataset '{spec.dataset}') and the hub is offline: looked for "
            f"{missing[0]}; put the hub's rows there as JSONL (--data-dir or ${DATA_ENV})"
        )
    return missing


def check_local_data(spec: TaskSpec, data_dir: Path | None) -> bool:
    """True when the task reads local files; False to use the hub; an error when neither can work."""
    missing = require_data(spec, data_dir)
    if not missing:
        return True
    log.warning("%s: no local file at %s; reading %s from the hub", spec.name, missing[0], spec.dataset)
    return False


def local_overrides(spec: TaskSpec, data_dir: Path, pool: str | None = None) -> dict[str, Any]:
    """The config keys that swap the hub dataset for local JSONL files: the scored split and the few-shot pool.

    Splits keep lm-eval's names; a split whose file is not used is unset. When the pool is the scored split
    (--fewshot-from-eval-split), the keys are set so that lm-eval's rule for a shared split applies: it leaves
    the document out of its own examples (as it does when the few-shot split is the test split, or when no
    split is named and the pool falls back to the validation split).
    """
    assert spec.dataset is not None
    used = {spec.eval_split} | ({pool} if pool is not None else set())
    files = {split: str(split_path(data_dir, spec.dataset, split).resolve()) for split in sorted(used)}
    overrides: dict[str, Any] = {key: spec.splits.get(key) if spec.splits.get(key) in used else None
                                 for key in SPLIT_KEYS}
    if pool is not None and pool == spec.eval_split != spec.fewshot_split:
        overrides["fewshot_split"] = pool if overrides["test_split"] == pool else None
    overrides.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": files})
    return overrides


def lm_eval_config(spec: TaskSpec, data_dir: Path | None, pool: str | None = None) -> dict[str, Any]:
    """lm-eval's task config for `spec` (functions resolved), with local files when there are some."""
    assert spec.lm_eval_yaml is not None and spec.subtask_field is None
    config = _load_config(lm_eval_tasks_dir() / spec.lm_eval_yaml)
    if spec.dataset is not None and check_local_data(spec, data_dir):
        assert data_dir is not None
        config.update(local_overrides(spec, data_dir, pool))
    return config


def lm_eval_configs(spec: TaskSpec, data_dir: Path | None, pool: str | None = None) -> list[dict[str, Any]]:
    """One config per lm-eval task behind `spec`: itself, or every subtask of a group such as mmlu."""
    if spec.subtask_field is None:
        return [lm_eval_config(spec, data_dir, pool)]
    assert spec.lm_eval_yaml is not None
    local = check_local_data(spec, data_dir)
    configs = []
    for path in sorted((lm_eval_tasks_dir() / spec.lm_eval_yaml).glob(f"{spec.name}_*.yaml")):
        config = _load_config(path)
        if local:
            assert data_dir is not None
            subset = config["dataset_name"]  # the hub config of this subject is the value of the split column
            config.update(local_overrides(spec, data_dir, pool))
            config["process_docs"] = functools.partial(only_rows_where, field=spec.subtask_field, value=subset)
        configs.append(config)
    if not configs:
        raise LayerpruneError(f"lm-eval {importlib.metadata.version('lm_eval')} has no {spec.name} subtasks in "
                              f"{spec.lm_eval_yaml}")
    return configs


def only_rows_where(dataset: Any, field: str, value: str) -> Any:
    """The rows of one subtask (one MMLU subject) out of a file that holds them all."""
    return dataset.filter(_field_is, fn_kwargs={"field": field, "value": value})


def _field_is(row: dict[str, Any], field: str, value: str) -> bool:
    return bool(row[field] == value)


def _load_config(path: Path) -> dict[str, Any]:
    from lm_eval.tasks._yaml_loader import load_yaml

    config: dict[str, Any] = load_yaml(path, resolve_func=True)
    for key in ("tag", "group"):
        config.pop(key, None)
    return config


def write_task_yaml(spec: TaskSpec, data_dir: Path, folder: Path, pool: str | None = None) -> Path:
    """A task YAML for lm-eval's own CLI (`--include_path folder`): include lm-eval's file, swap the data."""
    assert spec.lm_eval_yaml is not None
    folder.mkdir(parents=True, exist_ok=True)
    body = {"include": str(lm_eval_tasks_dir() / spec.lm_eval_yaml), "task": spec.name, "tag": []}
    body.update(local_overrides(spec, data_dir, pool))
    path = folder / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def count_rows(path: Path) -> int:
    with path.open(encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def check_fewshot_pool(spec: TaskSpec, data_dir: Path | None, num_fewshot: int, pool: str | None) -> None:
    """Refuse more few-shot examples than the split they are drawn from holds (minus the question)."""
    if num_fewshot <= 0 or data_dir is None or spec.dataset is None or pool is None:
        return
    path = split_path(data_dir, spec.dataset, pool)
    if not path.is_file():
        return
    if spec.subtask_field is None:
        rows, where = count_rows(path), f"{path}"
    else:  # each subtask draws from its own rows: the smallest one bounds the shots
        with path.open(encoding="utf-8") as handle:
            counts = collections.Counter(json.loads(line)[spec.subtask_field] for line in handle if line.strip())
        smallest, rows = min(counts.items(), key=lambda item: item[1]) if counts else ("", 0)
        where = f"{path}, {spec.subtask_field} '{smallest}'"
    pool_size = rows - (pool == spec.eval_split)
    if num_fewshot > pool_size:
        raise LayerpruneError(f"--num-fewshot {num_fewshot} is larger than the few-shot pool of '{spec.name}' "
                              f"({pool_size} examples in {where})")
