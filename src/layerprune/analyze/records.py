"""Shared bits of every `analyze` output: JSON writing, run record, model labels, model loading loop."""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from layerprune.core.provenance import collect_provenance
from layerprune.core.settings import RunSettings
from layerprune.models import LoadedModel, ModelSource, load_model, resolve_model


def clean_json(value: Any) -> Any:
    """NaN/inf become null, sets become sorted lists, paths become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    if isinstance(value, set):
        return [clean_json(v) for v in sorted(value)]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(clean_json(data), indent=2) + "\n", encoding="utf-8")


def run_record(settings: RunSettings) -> dict[str, Any]:
    """Provenance and settings stored next to every result."""
    return {"provenance": collect_provenance().model_dump(mode="json"), "settings": settings.model_dump(mode="json")}


def model_label(source: ModelSource) -> str:
    """A short readable name: the embedded model's name, a hub id's last part, a directory's name."""
    if "embedded" in source.identity:
        return str(source.identity["embedded"])
    return Path(source.spec.rstrip("/")).name or source.spec


def unique_labels(labels: list[str]) -> list[str]:
    """Append #2, #3 to repeated labels."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def resolve_models(specs: list[str], settings: RunSettings) -> list[tuple[str, ModelSource]]:
    """Resolve every spec first (so a bad one fails before any work), with unique labels."""
    sources = [resolve_model(spec, settings) for spec in specs]
    return list(zip(unique_labels([model_label(s) for s in sources]), sources, strict=False))


def loaded_models(sources: list[tuple[str, ModelSource]], settings: RunSettings) -> Iterator[tuple[str, LoadedModel]]:
    """Load one model at a time and free it before the next."""
    for label, source in sources:
        loaded = load_model(source, settings)
        yield label, loaded
        del loaded
        gc.collect()


class Timer:
    """Named sections: `with timer("load"): ...`; `.seconds` maps name -> wall-clock total, and
    `.cpu_seconds` name -> process CPU time (all threads; steadier than wall time on a shared machine)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    def __call__(self, name: str) -> _Section:
        return _Section(self, name)


class _Section:
    def __init__(self, timer: Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def __exit__(self, *exc: object) -> None:
        wall, cpu = time.perf_counter() - self.start, time.process_time() - self.cpu_start
        self.timer.seconds[self.name] = round(self.timer.seconds.get(self.name, 0.0) + wall, 3)
        self.timer.cpu_seconds[self.name] = round(self.timer.cpu_seconds.get(self.name, 0.0) + cpu, 3)
