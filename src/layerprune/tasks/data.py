"""Local data mirrors laid out like the hub (DIR/<dataset>/<split>.jsonl) with the hub as fallback."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError

DATA_ENV = "LAYERPRUNE_DATA_DIR"
DEFAULT_MIRROR = Path("../shared/data")

# dataset folder -> (hub path, hub config name)
HUB_DATASETS: dict[str, tuple[str, str | None]] = {
    "gsm8k": ("openai/gsm8k", "main"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge"),
    "openbookqa": ("allenai/openbookqa", "main"),
    "winogrande": ("allenai/winogrande", "winogrande_xl"),
    "boolq": ("super_glue", "boolq"),
    "piqa": ("ybisk/piqa", None),
    "hellaswag": ("Rowan/hellaswag", None),
    "humaneval": ("openai/openai_humaneval", None),
    "humaneval_plus": ("evalplus/humanevalplus", None),
    "dolly": ("databricks/databricks-dolly-15k", None),
    "alpaca_eval": ("tatsu-lab/alpaca_eval", "alpaca_eval"),
    "triviaqa": ("mandarjoshi/trivia_qa", "rc.nocontext"),  # lm-eval's triviaqa dataset
}


OFFLINE_ENVS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_offline() -> bool:
    """Whether the hub is off limits, read now and as huggingface_hub and datasets read it (1, true, yes or on, in
    any case; huggingface_hub's own constant is read once at import, so tests that set the variable later count)."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    return any(os.environ.get(name, "").upper() in ENV_VARS_TRUE_VALUES for name in OFFLINE_ENVS)


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """--data-dir, else $LAYERPRUNE_DATA_DIR, else ../shared/data when it exists, else None (hub)."""
    if data_dir is not None:
        path = Path(data_dir).expanduser()
        if not path.is_dir():
            raise LayerpruneError(f"data directory not found: {data_dir}")
        return path
    env = os.environ.get(DATA_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise LayerpruneError(f"${DATA_ENV} points at {env}, which is not a directory")
        return path
    return DEFAULT_MIRROR.resolve() if DEFAULT_MIRROR.is_dir() else None


def local_split(data_dir: Path | None, dataset: str, split: str) -> Path | None:
    if data_dir is None:
        return None
    path = data_dir / dataset / f"{split}.jsonl"
    return path if path.is_file() else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; an empty or malformed file is an error naming the line."""
    if not path.is_file():
        raise LayerpruneError(f"file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LayerpruneError(f"{path}:{number}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise LayerpruneError(f"{path}:{number}: expected a JSON object")
            rows.append(row)
    if not rows:
        raise LayerpruneError(f"{path} is empty")
    return rows


_CHECKED: set[tuple[str, int, int]] = set()


def check_jsonl(path: Path) -> None:
    """Fail with one line (file and line number) on an empty file or a line that is not a JSON object."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _CHECKED:
        read_jsonl(path)
        _CHECKED.add(key)


def load_rows(dataset: str, split: str, data_dir: Path | None) -> list[dict[str, Any]]:
    """A split from the local mirror, else from the hub; when neither works, say what to put where."""
    local = local_split(data_dir, dataset, split)
    if local is not None:
        return read_jsonl(local)
    if dataset not in HUB_DATASETS:
        raise LayerpruneError(f"no data for '{dataset}': put {split}.jsonl in <data-dir>/{dataset}/")
    return _load_hub_rows(dataset, split, data_dir)


def _load_hub_rows(dataset: str, split: str, data_dir: Path | None) -> list[dict[str, Any]]:
    hub_path, name = HUB_DATASETS[dataset]
    where = f"{data_dir}/{dataset}/{split}.jsonl" if data_dir else f"<data-dir>/{dataset}/{split}.jsonl"
    instead = f"put it at {where} (--data-dir or ${DATA_ENV})"
    if hub_offline():
        raise LayerpruneError(f"no local data for {dataset}/{split} and the hub is offline: {instead}")
    return hub_dataset_rows(hub_path, name, split, instead)


HUB_SOURCE = "hf:"  # a prompt source read from any hub dataset: hf:OWNER/NAME or hf:OWNER/NAME:CONFIG
HUB_SOURCE_FORM = re.compile(re.escape(HUB_SOURCE) + r"([\w.-]+/[\w.-]+)(?::([\w.-]+))?")


def parse_hub_source(source: str) -> tuple[str, str | None]:
    """'hf:OWNER/NAME[:CONFIG]' -> (repo id, config or None); anything else is an error."""
    found = HUB_SOURCE_FORM.fullmatch(source)
    if found is None:
        raise LayerpruneError(f"'{source}' is not a hub dataset: write hf:OWNER/NAME or hf:OWNER/NAME:CONFIG")
    return found.group(1), found.group(2)


def hub_dataset_rows(repo: str, config: str | None, split: str, instead: str) -> list[dict[str, Any]]:
    """One split of a hub dataset through `datasets`: from the hub, or offline from the `datasets` cache alone;
    `instead` says what to do when neither has it."""
    label = f"{repo}{f':{config}' if config else ''}/{split}"
    try:
        import datasets

        return [dict(row) for row in datasets.load_dataset(repo, config, split=split)]
    except Exception as exc:  # datasets raises many types for a missing repo, config, split or connection
        if hub_offline():
            raise LayerpruneError(f"{label} is a hub dataset, not in the datasets cache, and the hub is offline: "
                                  f"{instead}") from exc
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        raise LayerpruneError(f"could not get {label} from the hub ({type(exc).__name__}: {first[:160]}); "
                              f"{instead}") from exc


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a possibly-missing, possibly-growing JSONL file (a torn last line is skipped)."""
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield row
