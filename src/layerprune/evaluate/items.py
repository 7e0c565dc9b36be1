"""Per-item scores from the samples `evaluate` writes, and the pairing of several models on the same items.

Each model's folder holds lm-eval's own per-document logs (samples/<task>.jsonl). An item is one document of one
(sub)task; its score is the headline metric's value under the headline's filter. Two models are paired on a task
only when they answered exactly the same items with the same prompts (lm-eval's doc_hash and prompt_hash): every
report that pairs models refuses models scored on different items (`check_scored_items`, `check_same_records`: one
LayerpruneError line, issue 56); `align` says in one line why a task cannot be paired (no records, another item set).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from layerprune.core import paired
from layerprune.evaluate.summary import SUMMARY_FILE, read_summary

SAMPLES_DIR = "samples"


@dataclass(frozen=True)
class Items:
    """One model's scores on one task, item by item: keys (subtask/doc_id), values, the prompt checks and each item's
    chance score (1 / number of choices for multiple choice, 0 for a generated answer)."""

    keys: tuple[str, ...]
    values: np.ndarray
    checks: tuple[str, ...]
    chance: np.ndarray


def _metric_and_filter(metric: str) -> tuple[str, str]:
    name, _, filter_name = metric.partition(",")
    return name, filter_name or "none"


def n_arguments(sample: dict) -> int:
    """How many requests lm-eval built for a sample (a multiple-choice item's number of choices); packed records
    (pipeline/records.py) keep the count without the prompts."""
    if "arguments" in sample:
        return len(sample["arguments"] or [])
    return int(sample.get("n_arguments") or 0)


def read_items(folder: Path, task: str, metric: str, kind: str = "generative") -> Items | None:
    """`folder`/samples/`task`.jsonl as item scores of `metric` ("acc_norm", "exact_match,strict-match"); None when the
    file or the metric is not there."""
    path = folder / SAMPLES_DIR / f"{task}.jsonl"
    if not path.is_file():
        return None
    name, filter_name = _metric_and_filter(metric)
    keys, values, checks, chance = [], [], [], []
    with path.open() as handle:
        for line in handle:
            sample = json.loads(line)
            if sample.get("filter", "none") != filter_name or name not in sample:
                continue
            value = sample[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return None  # not a per-item number (a list of sampled answers, a status)
            keys.append(f"{sample.get('subtask', '')}/{sample['doc_id']}")
            values.append(float(value))
            checks.append(f"{sample.get('doc_hash', '')}:{sample.get('prompt_hash', '')}")
            choices = n_arguments(sample) if kind == "classification" else 0
            chance.append(1.0 / choices if choices else 0.0)
    if not keys:
        return None
    return Items(tuple(keys), np.asarray(values), tuple(checks), np.asarray(chance))


def check_same_records(task: str, scored: Mapping[str, Items | None]) -> None:
    """Refuse (LayerpruneError, one line: `paired.check_same_items`) to pair models whose per-item records of `task`
    hold different items (doc ids, or doc and prompt hashes; an item recorded twice included); a model without
    records (None) is left to the caller (it cannot be paired, and says so)."""
    paired.check_same_items(task, {label: list(zip(items.keys, items.checks, strict=True))
                                   for label, items in scored.items() if items is not None})


def check_scored_items(folders: Mapping[str, Path]) -> None:
    """`check_same_records` of every headline task of the first folder's summary, each model's records read from
    `folder`/samples/<task>.jsonl: the one check of every report that pairs evaluation folders."""
    if not folders:
        return
    heads = read_summary(next(iter(folders.values())) / SUMMARY_FILE).headlines()
    for task, result in heads.items():
        check_same_records(task, {label: read_items(folder, task, result.metric, result.kind)
                                  for label, folder in folders.items()})


def align(items: dict[str, Items | None], common: bool = False) -> tuple[np.ndarray, np.ndarray] | str:
    """The [models, items] matrix of several models' scores on the same items (in the first model's order) and the
    per-item chance, or one line saying why they cannot be paired. `common`: pair on the items every model answered
    (runs scored on different item counts, the first N of one list) instead of refusing different sets."""
    missing = [role for role, found in items.items() if found is None]
    if missing:
        return f"no per-item samples for {', '.join(missing)}"
    first_role, first = next(iter(items.items()))
    assert first is not None
    if common:
        shared = set(first.keys).intersection(*(set(other.keys) for other in items.values() if other is not None))
        if not shared:
            return f"the models answered no item in common ({', '.join(items)})"
        keep = [i for i, key in enumerate(first.keys) if key in shared]
        first = Items(tuple(first.keys[i] for i in keep), first.values[keep], tuple(first.checks[i] for i in keep),
                      first.chance[keep])
    rows = []
    for role, other in items.items():
        assert other is not None
        if not common and set(other.keys) != set(first.keys):
            only = len(set(other.keys) ^ set(first.keys))
            return f"{first_role} and {role} answered different items ({only} in one set only)"
        order = {key: i for i, key in enumerate(other.keys)}
        index = [order[key] for key in first.keys]
        if any(other.checks[i] != check for i, check in zip(index, first.checks, strict=True)):
            return f"{first_role} and {role} were asked different prompts for the same items"
        rows.append(other.values[index])
    return np.stack(rows), first.chance
