"""Evaluated documents against the calibration items that chose a pruned model's blocks (prune_report.json)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import PlannedTask
from layerprune.models.lineage import PRUNE_REPORT, read_lineage
from layerprune.tasks.data import load_rows

log = logging.getLogger(__name__)
MIN_FIELD_CHARS = 25  # a data row's text fields this long or longer identify it; shorter ones (labels, ids) do not


def normalize(text: str) -> str:
    return " ".join(text.split())


def recorded_calibration(model: Any) -> tuple[Path, list[str]] | None:
    """The calibration texts a pruned model directory records, or None (not a pruned directory, or no data chose
    its blocks). A .gguf that `layerprune export` wrote answers for the directory it was exported from."""
    if model is None or not isinstance(model, (str, os.PathLike)):
        return None
    directory = Path(model)
    record = directory.with_suffix(".export.json")
    if directory.suffix == ".gguf" and record.is_file():
        directory = Path(json.loads(record.read_text()).get("model") or directory)
    lineage = read_lineage(directory)
    if lineage is None or lineage.calibration is None:
        return None
    return directory / PRUNE_REPORT, lineage.calibration.texts()


def evaluated_rows(task: PlannedTask, settings: EvalSettings, data_dir: Path | None) -> list[list[str]]:
    """Per evaluated document (the first `limit`, as lm-eval takes them), the texts that identify it."""
    spec = task.spec
    if spec.source == "probe":
        from layerprune.evaluate.project_tasks import probe_rows

        return [[p.question] for p in _first(probe_rows(spec, settings.probe_seed), task.limit)]
    assert spec.dataset is not None
    rows = load_rows(spec.dataset, spec.eval_split, data_dir)
    if spec.subtask_field is not None:  # a group: the limit applies to each subtask
        groups: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            groups.setdefault(str(row.get(spec.subtask_field)), []).append(row)
        rows = [row for group in groups.values() for row in _first(group, task.limit)]
    else:
        rows = _first(rows, task.limit)
    return [[v for v in row.values() if isinstance(v, str) and len(normalize(v)) >= MIN_FIELD_CHARS] for row in rows]


def _first(rows: list[Any], limit: float | None) -> list[Any]:
    if limit is None:
        return rows
    return rows[: int(math.ceil(len(rows) * limit)) if limit < 1 else int(limit)]


def contains(haystack: str, needle: str) -> bool:
    """`needle` inside `haystack`, not as part of a longer word or number ('12 + 3' is not in '112 + 3')."""
    start = haystack.find(needle)
    while start >= 0:
        end = start + len(needle)
        before = haystack[start - 1] if start else " "
        after = haystack[end] if end < len(haystack) else " "
        if not (before.isalnum() and needle[0].isalnum()) and not (after.isalnum() and needle[-1].isalnum()):
            return True
        start = haystack.find(needle, start + 1)
    return False


def count_overlap(docs: list[list[str]], texts: list[str]) -> int:
    """How many documents have an identifying text inside some calibration text."""
    haystack = "\x00".join(normalize(t) for t in texts)
    return sum(any(contains(haystack, normalize(key)) for key in keys if key.strip()) for keys in docs)


def calibration_overlap(planned: list[PlannedTask], settings: EvalSettings, data_dir: Path | None,
                        model: Any) -> dict[str, Any] | None:
    """{'calibration': report path, 'tasks': {task: overlapping documents}, 'allowed': bool}, or None.

    Refuses (one line, naming each task and its count) unless `settings.allow_overlap`.
    """
    found = recorded_calibration(model)
    if found is None:
        return None
    report, texts = found
    counts = {}
    for task in planned:
        try:
            docs = evaluated_rows(task, settings, data_dir)
        except LayerpruneError as exc:
            log.warning("%s: calibration overlap not checked (%s)", task.spec.name, exc)
            continue
        if count := count_overlap(docs, texts):
            counts[task.spec.name] = count
    if counts and not settings.allow_overlap:
        listed = ", ".join(f"{task} ({count} documents)" for task, count in counts.items())
        raise LayerpruneError(f"evaluated documents appear in the calibration data that chose the blocks of "
                              f"{report.parent} ({report.name}): {listed}; pass --allow-overlap to evaluate anyway")
    if counts:
        log.warning("calibration overlap allowed (--allow-overlap): %s", counts)
    return {"calibration": str(report), "tasks": counts, "allowed": settings.allow_overlap}
