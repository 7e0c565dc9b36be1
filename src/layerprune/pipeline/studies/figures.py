"""What every study report draws from: the models it scored (their eval folders), their per-item scores as one
`Figures` (pipeline/paired_table.py: one clustered paired bootstrap, two-level over a label's replicates) over named
task groups, where each model's per-item records lie, and the report's JSON.

The groups are the same for every report: each task under its own name, each kind of KINDS, INSTRUMENT (every paired
task: the unweighted mean of their means), and where the recovery data trained some generative tasks, SPLIT (those
and the other generative tasks). A report reads the groups it needs; none changes a figure of another (the bootstrap
draws items within tasks, whatever the groups).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.items import SAMPLES_DIR, check_scored_items
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.paired_table import Figures, load_matrix
from layerprune.pipeline.studies.cells import split_label
from layerprune.pipeline.studies.sweep_grid import models

KINDS = ("classification", "generative")
SPLIT = ("trained", "unseen")  # generative tasks whose own prompts the recovery data held, and the others
INSTRUMENT = "instrument"


def evaluated(study: Any, root: Path, evals: str = "eval") -> dict[str, Path]:
    """The eval folder of every model of the grid scored so far (physical labels: replicates apart); `evals`: eval,
    or eval-chat (the probe levels through the chat template)."""
    return {m: root / evals / m for m in models(study) if (root / evals / m / SUMMARY_FILE).is_file()}


def study_figures(folders: dict[str, Path], replicates: dict[str, list[str]] | None = None, common: bool = False,
                  trained: frozenset[str] = frozenset()) -> tuple[Figures, dict[str, str]]:
    """The paired figures of the scored models and each task's kind ('unpaired: why' for a task left out: no per-item
    records to pair). `replicates`: logical label -> its physical labels (default: by the '@rR' suffix of each
    label); `common`: on the items every model answered (sweeps joined across runs, which say so), else models scored
    on different items (an item recorded twice included) are refused in one line (`check_scored_items`), not left
    out. `trained`: the tasks whose own prompts were in the recovery data (the SPLIT groups)."""
    if not common:
        check_scored_items(folders)
    labels, matrices, chance, kinds = load_matrix(folders, common)
    if not matrices:
        raise LayerpruneError("no task pairs across the models (" + "; ".join(
            f"{task}: {why}" for task, why in kinds.items()) + ")")
    if replicates is None:
        replicates = {}
        for label in labels:
            replicates.setdefault(split_label(label)[0], []).append(label)
    groups = {**{t: [t] for t in matrices}, **{kind: [t for t in matrices if kinds[t] == kind] for kind in KINDS},
              INSTRUMENT: list(matrices)}
    if set(groups["generative"]) & trained:
        groups.update(trained=[t for t in groups["generative"] if t in trained],
                      unseen=[t for t in groups["generative"] if t not in trained])
    return Figures(labels, matrices, chance, groups, replicates=replicates), kinds


def unpaired(kinds: dict[str, str]) -> dict[str, str]:
    """The tasks left out of the figures, and why."""
    return {task: why for task, why in kinds.items() if why.startswith("unpaired")}


def items_of(figures: Figures) -> dict[str, int]:
    """Items per paired task (the same for every model)."""
    return {task: int(m.shape[1]) for task, m in zip(figures.tasks, figures.matrices, strict=True)}


def records(root: Path, folders: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """Where each scored model's per-item records lie (relative to the study directory): its eval folder and the
    samples/*.jsonl that pair it with the others; `missing` when its samples are gone."""
    out = {}
    for label, folder in folders.items():
        files = sorted(p.relative_to(root).as_posix() for p in (folder / SAMPLES_DIR).glob("*.jsonl"))
        out[label] = {"folder": folder.relative_to(root).as_posix(), "samples": files, "missing": not files}
    return out


def records_line(kept: dict[str, dict[str, Any]]) -> str:
    """The sentence that says where the per-item records are, and which are missing."""
    missing = [label for label, r in kept.items() if r["missing"]]
    return ("Per-item records (kept, listed in sweep.json `records`, so any comparison can be redone paired): "
            "eval/MODEL/samples/*.jsonl for " + ", ".join(kept) + "."
            + (f" MISSING for {', '.join(missing)}: those models could not be paired." if missing else ""))


def spent_text(runs: list[dict[str, Any]]) -> str:
    """'7,980-8,012 / 31-32 / 0.0005': the spread over a point's recoveries of the unpadded target tokens, optimizer
    steps and learning rates they spent (lr_search.budget_spent), '-' where none is recorded."""
    def span(key: str, form: str) -> str:
        values = sorted({r[key] for r in runs if r.get(key) is not None})
        return "-" if not values else format(values[0], form) + ("" if len(values) == 1 else
                                                                 "-" + format(values[-1], form))
    return "-" if not runs else f"{span('tokens_unpadded', ',')} / {span('optimizer_steps', 'd')} / " \
                                f"{span('learning_rate', 'g')}"


def paired_json(value: Any) -> Any:
    """JSON-safe: numpy numbers as floats, NaN as null, int keys as strings."""
    if isinstance(value, dict):
        return {str(k): paired_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [paired_json(v) for v in value]
    if isinstance(value, (np.floating, float)):
        return None if not np.isfinite(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value
