"""Point lm-eval's own task configs (prompts, metrics) at local JSONL files laid out like the hub."""

from __future__ import annotations

import collections
import functools
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any

import yaml

from layerprune.data import DATA_ENV
from layerprune.errors import LayerpruneError
from layerprune.evaluate.registry import TaskSpec

log = logging.getLogger(__name__)
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


def lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"


def split_path(data_dir: Path, dataset: str, split: str) -> Path:
    return data_dir / dataset / f"{split}.jsonl"


def default_fewshot(spec: TaskSpec) -> int:
    """The few-shot count lm-eval's task config gives (0 where it gives none)."""
    if spec.lm_eval_yaml is None or not spec.lm_eval_yaml.endswith(".yaml"):
        return 0
    return _yaml_fewshot(spec.lm_eval_yaml)


@functools.cache
def _yaml_fewshot(relative: str) -> int:
    body = yaml.safe_load((lm_eval_tasks_dir() / relative).read_text().replace("!function", "")) or {}
    return int(body.get("num_fewshot") or 0)


def needed_splits(spec: TaskSpec, num_fewshot: int | None = None) -> list[str]:
    """The scored split, then the few-shot split where examples are drawn (--num-fewshot, else the task's own)."""
    shots = default_fewshot(spec) if num_fewshot is None else num_fewshot
    splits = [spec.eval_split]
    if shots > 0 and spec.fewshot_split not in splits:
        splits.append(spec.fewshot_split)
    return splits


def missing_splits(spec: TaskSpec, data_dir: Path | None, num_fewshot: int | None = None) -> list[Path]:
    """The local files this task needs that are not there (all of them when there is no data dir)."""
    assert spec.dataset is not None
    root = data_dir if data_dir is not None else Path(f"${DATA_ENV}")
    paths = [split_path(root, spec.dataset, split) for split in needed_splits(spec, num_fewshot)]
    return [p for p in paths if data_dir is None or not p.is_file()]


def local_files(spec: TaskSpec, data_dir: Path | None, num_fewshot: int | None = None) -> list[Path]:
    """The local files the task will read."""
    if data_dir is None or spec.dataset is None:
        return []
    paths = [split_path(data_dir, spec.dataset, split) for split in needed_splits(spec, num_fewshot)]
    return [p for p in paths if p.is_file()]


def require_data(spec: TaskSpec, data_dir: Path | None, num_fewshot: int | None = None) -> list[Path]:
    """The local files the task lacks (the hub has to supply them); an error when the hub is offline too."""
    missing = missing_splits(spec, data_dir, num_fewshot)
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


def local_overrides(spec: TaskSpec, data_dir: Path) -> dict[str, Any]:
    """The config keys that swap the hub dataset for local JSONL files, splits unchanged in name."""
    assert spec.dataset is not None
    paths = {split: split_path(data_dir, spec.dataset, split) for split in set(spec.splits.values())}
    files = {split: str(path.resolve()) for split, path in paths.items() if path.is_file() or split == spec.eval_split}
    overrides: dict[str, Any] = {key: spec.splits.get(key) if spec.splits.get(key) in files else None
                                 for key in SPLIT_KEYS}
    overrides.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": files})
    return overrides


def lm_eval_config(spec: TaskSpec, data_dir: Path | None) -> dict[str, Any]:
    """lm-eval's task config for `spec` (functions resolved), with local files when there are some."""
    assert spec.lm_eval_yaml is not None and spec.subtask_field is None
    config = _load_config(lm_eval_tasks_dir() / spec.lm_eval_yaml)
    if check_local_data(spec, data_dir):
        assert data_dir is not None
        config.update(local_overrides(spec, data_dir))
    return config


def lm_eval_configs(spec: TaskSpec, data_dir: Path | None) -> list[dict[str, Any]]:
    """One config per lm-eval task behind `spec`: itself, or every subtask of a group such as mmlu."""
    if spec.subtask_field is None:
        return [lm_eval_config(spec, data_dir)]
    assert spec.lm_eval_yaml is not None
    local = check_local_data(spec, data_dir)
    configs = []
    for path in sorted((lm_eval_tasks_dir() / spec.lm_eval_yaml).glob(f"{spec.name}_*.yaml")):
        config = _load_config(path)
        if local:
            assert data_dir is not None
            subset = config["dataset_name"]  # the hub config of this subject is the value of the split column
            config.update(local_overrides(spec, data_dir))
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


def write_task_yaml(spec: TaskSpec, data_dir: Path, folder: Path) -> Path:
    """A task YAML for lm-eval's own CLI (`--include_path folder`): include lm-eval's file, swap the data."""
    assert spec.lm_eval_yaml is not None
    folder.mkdir(parents=True, exist_ok=True)
    body = {"include": str(lm_eval_tasks_dir() / spec.lm_eval_yaml), "task": spec.name, "tag": []}
    body.update(local_overrides(spec, data_dir))
    path = folder / f"{spec.name}.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def count_rows(path: Path) -> int:
    with path.open(encoding="utf-8") as handle:
        return sum(1 for line in handle if line.strip())


def check_fewshot_pool(spec: TaskSpec, data_dir: Path | None, num_fewshot: int) -> None:
    """Refuse more few-shot examples than the split they are drawn from holds (minus the question)."""
    if num_fewshot <= 0 or data_dir is None or spec.dataset is None:
        return
    path = split_path(data_dir, spec.dataset, spec.fewshot_split)
    if not path.is_file():
        return
    if spec.subtask_field is None:
        rows, where = count_rows(path), f"{path}"
    else:  # each subtask draws from its own rows: the smallest one bounds the shots
        with path.open(encoding="utf-8") as handle:
            counts = collections.Counter(json.loads(line)[spec.subtask_field] for line in handle if line.strip())
        smallest, rows = min(counts.items(), key=lambda item: item[1]) if counts else ("", 0)
        where = f"{path}, {spec.subtask_field} '{smallest}'"
    pool = rows - (spec.fewshot_split == spec.eval_split)
    if num_fewshot > pool:
        raise LayerpruneError(f"--num-fewshot {num_fewshot} is larger than the few-shot pool of '{spec.name}' "
                              f"({pool} examples in {where})")
