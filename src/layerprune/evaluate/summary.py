"""The evaluation summary (summary.json): what one model scored and what identifies the model and the settings.

One schema for the writer (`evaluate`) and every reader (the comparison, a run's report.md, a study's study.md):
strict, so a misspelled or missing key is refused with one line instead of read as a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.provenance import Provenance
from layerprune.core.recipe_loading import validation_message

SUMMARY_FILE = "summary.json"


class TaskResult(BaseModel):
    """One metric of one task for one model."""

    model_config = ConfigDict(extra="forbid", strict=True)

    task: str
    kind: Literal["classification", "generative"]
    metric: str
    value: float
    stderr: float | None
    n: int
    headline: bool
    settings: dict[str, Any]
    seconds: float
    cached: bool = False
    statuses: dict[str, int] | None = None  # sandbox outcomes (passed, failed, timeout, ...) of a code task


class EvaluatedModel(BaseModel):
    """Which model was evaluated, and whether its chat template was used."""

    model_config = ConfigDict(extra="forbid", strict=True)

    spec: str  # what the user typed (hub id, directory, .gguf, embedded)
    location: str
    kind: str  # embedded | gguf | local | hub | reference
    identity: dict[str, Any] = {}
    chat_template: Literal["auto", "on", "off"] = "auto"
    has_chat_template: bool = False


class Summary(BaseModel):
    """Everything one model scored, and what identifies the model and the settings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: EvaluatedModel
    model_hash: str
    results: list[TaskResult]
    provenance: Provenance | None = None  # None only in summaries built by hand (tests)
    skipped: dict[str, str] = {}
    calibration_overlap: dict[str, Any] | None = None  # evaluated documents found in a pruned model's calibration

    def headlines(self) -> dict[str, TaskResult]:
        """task -> its headline metric."""
        return {r.task: r for r in self.results if r.headline}


def write_summary(folder: Path, summary: Summary) -> Path:
    """`folder`/summary.json, written whole or not at all."""
    path = folder / SUMMARY_FILE
    write_atomic(path, summary.model_dump_json(indent=1))
    return path


def read_summary(path: Path) -> Summary:
    """A summary.json as `evaluate` wrote it; anything else is a one-line LayerpruneError naming the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise LayerpruneError(f"cannot read the evaluation summary {path}: {exc.strerror or exc}") from exc
    try:
        return Summary.model_validate_json(text)
    except ValidationError as exc:
        raise LayerpruneError(f"{path}: {validation_message(exc, 'evaluation summary')}") from exc
