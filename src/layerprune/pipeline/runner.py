"""The one stage loop of runs, studies, sweeps and variant studies: numbered, resumable, timed.

A stage is complete when its output (a file every stage writes last and atomically) exists; an interrupted run
starts again at its first incomplete stage. A stage without an output runs every time (its action reuses what it
finds). A `refresh` stage (a report) also runs when an earlier stage of the same call did work. With `times`, every
attempt at a stage (finished, failed or interrupted) adds its seconds to that JSON file (TIMES in the run folder of a
study run in parts: what its stages took, all parts together).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from layerprune.core import errors
from layerprune.core.outputs import write_atomic

log = logging.getLogger(__name__)

TIMES = "stage_times.json"


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


def run_stages(stages: Sequence[Stage], folder: Path | None = None, dry_run: bool = False,
               times: Path | None = None) -> list[str]:
    """Run every incomplete stage in order, each named (with `folder`) on an unexpected error; return the names of
    the stages that ran. `dry_run`: say which stages would run and which are complete, and run none. `times`: the
    file each attempt's seconds are added to (`record_attempt`)."""
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
        start, done = time.perf_counter(), False
        try:
            with errors.stage(stage.name, folder):
                stage.action()
            done = True
        finally:
            elapsed = time.perf_counter() - start
            if times is not None:
                record_attempt(times, stage.name, elapsed, done)
        log.info("[%d/%d] %s done in %.0f s", number, total, stage.name, elapsed)
    return ran


def record_attempt(path: Path, name: str, seconds: float, done: bool) -> None:
    """Add one attempt at a stage to `path` ({"attempts": [{stage, seconds, done, ended}]}); a file that cannot be
    read is started again with a warning, and one that cannot be written is left as it is (a warning): the timing
    never stops a run."""
    try:
        attempts = json.loads(path.read_text())["attempts"] if path.is_file() else []
        if not isinstance(attempts, list):
            raise TypeError(f"attempts is a {type(attempts).__name__}, not a list")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: unreadable (%s): started again", path, exc)
        attempts = []
    attempts.append({"stage": name, "seconds": round(seconds, 1), "done": done,
                     "ended": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    try:
        write_atomic(path, json.dumps({"attempts": attempts}, indent=1))
    except OSError as exc:
        log.warning("%s: not written (%s)", path, exc)


def stage_seconds(folder: Path) -> dict[str, float]:
    """Each stage's seconds to its last completion, from the folder's TIMES: the attempts since the one before that
    ended done (its interrupted and failed attempts too; a stage made again, its output removed, counts its last
    making only); {} where there is none, or it cannot be read."""
    running: dict[str, float] = {}
    made: dict[str, float] = {}
    try:
        for a in json.loads((folder / TIMES).read_text())["attempts"]:
            running[a["stage"]] = running.get(a["stage"], 0.0) + float(a["seconds"])
            if a.get("done"):
                made[a["stage"]] = running.pop(a["stage"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    return made
