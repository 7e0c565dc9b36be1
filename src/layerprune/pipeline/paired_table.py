"""Several models' per-item scores on the same tasks, and figures over task groups with paired intervals: the shared
instrument of the sweep and the recovery study reports.

One clustered paired bootstrap over every task (items drawn within each task, the same draw for every model) gives
every figure its 95% interval; a group's score is the unweighted mean of its tasks' means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from layerprune.core import paired
from layerprune.core.errors import LayerpruneError
from layerprune.evaluate.summary import SUMMARY_FILE, read_summary


def load_matrix(folders: dict[str, Path], common: bool = False) -> tuple[list[str], dict[str, np.ndarray],
                                                                      dict[str, float], dict[str, str]]:
    """Labels, per-task [models, items] scores, per-task mean chance and per-task kind ("classification" or
    "generative"; "unpaired: why" for a task the models did not answer on the same items), for the headline tasks
    of the first folder's summary. `common`: on the items every model answered (evaluate.items.align)."""
    from layerprune.evaluate.items import align, read_items

    labels = list(folders)
    heads = read_summary(folders[labels[0]] / SUMMARY_FILE).headlines()
    matrices, chance, kinds = {}, {}, {}
    for task, result in heads.items():
        aligned = align({m: read_items(folders[m], task, result.metric, result.kind) for m in labels}, common)
        if isinstance(aligned, str):
            kinds[task] = f"unpaired: {aligned}"
            continue
        matrices[task], chance[task], kinds[task] = aligned[0], float(aligned[1].mean()), result.kind
    return labels, matrices, chance, kinds


def logical_labels(labels: list[str],
                   replicates: dict[str, list[str]] | None) -> tuple[list[str], dict[str, list[int]]]:
    """Logical labels in order of first appearance among the physical `labels`, and each one's rows (a group's in its
    own order, the seed order); a label in no replicate group is its own logical label with one row."""
    owner: dict[str, str] = {}
    for logical, members in (replicates or {}).items():
        for member in members or [None]:
            if member not in labels or member in owner:
                raise LayerpruneError(f"replicates of {logical!r}: {member!r} is not an evaluated model, or is in two "
                                      f"groups, or the group is empty (models: {', '.join(labels)})")
            owner[member] = logical
    clash = [label for label in labels if label not in owner and label in (replicates or {})]
    if clash:
        raise LayerpruneError(f"{clash[0]!r} names both a replicate group and a model outside it")
    groups = {logical: [labels.index(m) for m in members] for logical, members in (replicates or {}).items()}
    rows: dict[str, list[int]] = {}
    for i, label in enumerate(labels):
        logical = owner.get(label, label)
        rows.setdefault(logical, groups.get(logical, [i]))
    return list(rows), rows


class Figures:
    """Statistics of several models over named groups of tasks, each with its paired bootstrap interval.

    `replicates` maps a logical label to its physical labels (as `load_matrix` returns them, one per evaluated
    folder), in seed order; a physical label in no group is a logical label of its own. `labels` are then the
    logical labels, in order of first appearance, and every statistic takes them; the bootstrap is two-level over
    replicates and items (`paired.bootstrap`). Without `replicates`, one model per label, as before."""

    def __init__(self, labels: list[str], matrices: dict[str, np.ndarray], chance: dict[str, float],
                 groups: dict[str, list[str]], resamples: int = paired.RESAMPLES, seed: int = paired.SEED,
                 replicates: dict[str, list[str]] | None = None) -> None:
        self.physical, self.tasks = labels, list(matrices)
        self.matrices = [matrices[t] for t in self.tasks]
        self.labels, self.rows = logical_labels(labels, replicates)
        self.boot = paired.bootstrap(self.matrices, resamples, seed,
                                     replicates=None if replicates is None else list(self.rows.values()))
        self.groups = {name: [self.tasks.index(t) for t in tasks if t in matrices] for name, tasks in groups.items()}
        self.chance = {name: float(np.mean([chance[self.tasks[i]] for i in idx])) if idx else 0.0
                       for name, idx in self.groups.items()}

    def spread(self, label: str, group: str) -> dict[str, Any]:
        """Across-run SD and item SE of a logical label's score on a group (`paired.spread`)."""
        return paired.spread(self.matrices, self.rows[label], self.groups[group])

    def has(self, group: str) -> bool:
        return bool(self.groups.get(group))

    def seeds(self, label: str) -> tuple[str, ...]:
        """The replicates a logical label's rows are, as suffixes of their physical labels ('' is replicate 0's,
        '@r2' replicate 2's): the points of one run (its checkpoints) pair replicate by replicate only when these are
        the same (the replicate draws are shared by position)."""
        return tuple(sorted(self.physical[i][len(label):] for i in self.rows[label]))

    def mean(self, m: np.ndarray, label: str, group: str) -> np.ndarray:
        return m[..., self.labels.index(label), :][..., self.groups[group]].mean(axis=-1)

    def interval(self, statistic: Any) -> dict[str, Any]:
        return self.boot.interval(statistic)

    def family(self, statistics: dict[Any, Any]) -> dict[Any, dict[str, Any]]:
        """Holm intervals over a declared family of statistics (`paired.holm_intervals`); a None statistic (a
        comparison that cannot be stated) counts in the family and is never declared."""
        undefined = (float("nan"), np.full(1, np.nan))
        return paired.holm_intervals({key: undefined if f is None else self.boot.draws(f)
                                      for key, f in statistics.items()}, self.boot.alpha)

    def score(self, label: str, group: str) -> dict[str, Any]:
        return self.interval(lambda m: self.mean(m, label, group))

    def difference(self, high: str, low: str, group: str) -> dict[str, Any]:
        return self.interval(lambda m: self.mean(m, high, group) - self.mean(m, low, group))

    def retention(self, label: str, group: str, m: np.ndarray, base: str = "baseline") -> np.ndarray:
        return paired.normalised(self.mean(m, label, group), self.mean(m, base, group), self.chance[group])

    def share_of(self, label: str, pruned: str, group: str, m: np.ndarray, base: str = "baseline") -> np.ndarray:
        return paired.share(self.mean(m, base, group), self.mean(m, pruned, group), self.mean(m, label, group))
