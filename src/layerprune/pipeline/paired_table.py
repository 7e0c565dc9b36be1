"""Several models' per-item scores on the same tasks, and figures over task groups with paired intervals: the shared
instrument of the sweep and the recovery study reports.

One clustered paired bootstrap over every task (items drawn within each task, the same draw for every model) gives
every figure its 95% interval; a group's score is the unweighted mean of its tasks' means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from layerprune import paired
from layerprune.evaluate.summary import SUMMARY_FILE, read_summary


def load_matrix(folders: dict[str, Path]) -> tuple[list[str], dict[str, np.ndarray], dict[str, float], dict[str, str]]:
    """Labels, per-task [models, items] scores, per-task mean chance and per-task kind ("classification" or
    "generative"; "unpaired: why" for a task the models did not answer on the same items), for the headline tasks
    of the first folder's summary."""
    from layerprune.evaluate.items import align, read_items

    labels = list(folders)
    heads = read_summary(folders[labels[0]] / SUMMARY_FILE).headlines()
    matrices, chance, kinds = {}, {}, {}
    for task, result in heads.items():
        aligned = align({m: read_items(folders[m], task, result.metric, result.kind) for m in labels})
        if isinstance(aligned, str):
            kinds[task] = f"unpaired: {aligned}"
            continue
        matrices[task], chance[task], kinds[task] = aligned[0], float(aligned[1].mean()), result.kind
    return labels, matrices, chance, kinds


class Figures:
    """Statistics of several models over named groups of tasks, each with its paired bootstrap interval."""

    def __init__(self, labels: list[str], matrices: dict[str, np.ndarray], chance: dict[str, float],
                 groups: dict[str, list[str]], resamples: int = paired.RESAMPLES, seed: int = paired.SEED) -> None:
        self.labels, self.tasks = labels, list(matrices)
        self.boot = paired.bootstrap([matrices[t] for t in self.tasks], resamples, seed)
        self.groups = {name: [self.tasks.index(t) for t in tasks if t in matrices] for name, tasks in groups.items()}
        self.chance = {name: float(np.mean([chance[self.tasks[i]] for i in idx])) if idx else 0.0
                       for name, idx in self.groups.items()}

    def has(self, group: str) -> bool:
        return bool(self.groups.get(group))

    def mean(self, m: np.ndarray, label: str, group: str) -> np.ndarray:
        return m[..., self.labels.index(label), :][..., self.groups[group]].mean(axis=-1)

    def interval(self, statistic: Any) -> dict[str, Any]:
        return self.boot.interval(statistic)

    def score(self, label: str, group: str) -> dict[str, Any]:
        return self.interval(lambda m: self.mean(m, label, group))

    def difference(self, high: str, low: str, group: str) -> dict[str, Any]:
        return self.interval(lambda m: self.mean(m, high, group) - self.mean(m, low, group))

    def retention(self, label: str, group: str, m: np.ndarray, base: str = "baseline") -> np.ndarray:
        return paired.normalised(self.mean(m, label, group), self.mean(m, base, group), self.chance[group])

    def share_of(self, label: str, pruned: str, group: str, m: np.ndarray, base: str = "baseline") -> np.ndarray:
        return paired.share(self.mean(m, base, group), self.mean(m, pruned, group), self.mean(m, label, group))
