"""Typed JSON reports: written through their pydantic model, read back through it with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from layerprune.core.errors import LayerpruneError

Report = TypeVar("Report", bound=BaseModel)


def write_report(path: Path, report: BaseModel) -> Path:
    """`report` as indented JSON at `path`."""
    path.write_text(report.model_dump_json(indent=2) + "\n")
    return path


def read_report(path: Path, model: type[Report]) -> Report:
    """The report at `path` as `model`; a missing, unknown or mistyped field is one line naming file and field."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayerpruneError(f"{path} is not a readable {model.__name__} ({exc})") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise LayerpruneError(f"{path}: {field_problem(exc)} (made by another layerprune version?)") from exc


def field_problem(exc: ValidationError) -> str:
    """The first problem of a validation error as 'field a.b missing' / 'unknown field a.b' / 'field a.b: why'."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    if error["type"] == "missing":
        return f"field '{where}' missing{more}"
    if error["type"] == "extra_forbidden":
        return f"unknown field '{where}'{more}"
    return f"field '{where}': {error['msg']}{more}"
