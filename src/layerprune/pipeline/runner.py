"""The one stage loop of runs, studies, sweeps and variant studies: numbered, resumable, timed.

A stage is complete when its output (a file every stage writes last and atomically) exists; an interrupted run
starts again at its first incomplete stage. A stage without an output runs every time (its action reuses what it
finds). A `refresh` stage (a report) also runs when an earlier stage of the same call did work.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from layerprune.core import errors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One step of a staged run: printed as `[i/N] name ...`, skipped when `output` exists."""

    name: str
    output: Path | None
    action: Callable[[], object]
    refresh: bool = False  # run again when an earlier stage of this call did work, complete or not
    leftover: Path | None = None  # a work folder the action removes after writing its output: a run stopped between
    # the two leaves it, so it is removed too when the stage is found complete

    def complete(self) -> bool:
        return self.output is not None and self.output.exists()


def run_stages(stages: Sequence[Stage], folder: Path | None = None, dry_run: bool = False) -> list[str]:
    """Run every incomplete stage in order, each named (with `folder`) on an unexpected error; return the names of
    the stages that ran. `dry_run`: say which stages would run and which are complete, and run none."""
    ran: list[str] = []
    total = len(stages)
    for number, stage in enumerate(stages, 1):
        if stage.complete() and not (stage.refresh and ran):
            log.info("[%d/%d] %s: complete, skipped", number, total, stage.name)
            if stage.leftover is not None and stage.leftover.is_dir() and not dry_run:
                shutil.rmtree(stage.leftover)
                log.info("[%d/%d] %s: removed %s, left by an interrupted run", number, total, stage.name,
                         stage.leftover)
            continue
        ran.append(stage.name)
        if dry_run:
            log.info("[%d/%d] %s: would run", number, total, stage.name)
            continue
        log.info("[%d/%d] %s ...", number, total, stage.name)
        start = time.perf_counter()
        with errors.stage(stage.name, folder):
            stage.action()
        log.info("[%d/%d] %s done in %.0f s", number, total, stage.name, time.perf_counter() - start)
    return ran
