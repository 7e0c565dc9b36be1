"""What a recover run is given (RecoverJob) and what a method's training hands back to it (TrainResult)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from layerprune.core.settings import RunSettings
from layerprune.recover.memory import MemoryPlan


@dataclass
class RecoverJob:
    """Everything one recover run needs besides the recipe."""

    output: Path
    settings: RunSettings = field(default_factory=RunSettings)
    overwrite: bool = False
    resume: bool = False
    data_dir: Path | None = None
    memory_budget: float = 80.0
    snapshots: dict[int, Path] = field(default_factory=dict)  # budget (target tokens) -> the model saved on reaching it
    states: Path | None = None  # a folder where a block-training step (local) keeps the teacher's hidden states for
    # other runs of a study on the same teacher and sequences (recover/local.span_states); None: not kept
    reach_budget: bool = False  # train.max_tokens is the run's budget, not a cap (a study's budget point): a run that
    # ends before it is refused before its output is written (a point labelled with tokens it did not train on)

    @property
    def snapshot_budgets(self) -> list[int]:
        """The budgets (target tokens, budget.py's unit) at which the run saves a model besides its end's."""
        return sorted(self.snapshots)

    @property
    def work(self) -> Path:
        """Responses and checkpoints live here until the output is complete (kept for resuming)."""
        return work_folder(self.output)


def work_folder(output: Path) -> Path:
    """The work folder of a recovery into `output`: OUTPUT.work beside it."""
    return output.parent / f"{output.name}.work"


def leftover_of(report: Path) -> Path | None:
    """The work folder a recovery whose report is `report` (FOLDER/recover_report.json) removes after writing it (a
    staged run removes it too when it finds the stage complete); None for any other file."""
    return work_folder(report.parent) if report.name == "recover_report.json" else None


@dataclass
class TrainResult:
    """What fine-tuning produced: the trained weights as the trainer saved them (gathered from every rank)."""

    saved: Path
    loss_before: float | None
    loss_after: float | None
    curve: dict[str, list[list[float]]]
    plan: MemoryPlan
    optimizer: str
    data: dict[str, Any]
    seconds: float
    tokens_seen: int
    held_out: dict[str, Any] | None = None  # heldout.report_metrics (None: measured on the saved weights when saving)
    base: Path | None = None  # what a trained adapter merges into (None: the student; replace: the folded weights)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)  # the held-out teacher answers
    held_ids: set[str] = field(default_factory=set)
    training: dict[str, Any] = field(default_factory=dict)  # the report's tokens_unpadded ... learning_rate


def release_memory() -> None:
    """Free what a model or trainer held before the next one loads."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
