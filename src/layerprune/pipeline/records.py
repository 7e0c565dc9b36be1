"""A run's per-item records, packed to keep beside its report (in a repository, without document text) and unpacked to
redo any paired comparison later.

`pack_records(run, archive)` writes one gzip tar of:
- every evaluation's per-item samples under `run` (lm-eval's `samples/<task>.jsonl`) with the document text taken out:
  `doc`, `arguments` and `target` go; the item's hashes (doc, prompt, target), every metric, the model's own responses
  and the number of arguments (`n_arguments`, which sets a multiple-choice item's chance score) stay;
- lm-eval's own results files (`results/<task>.json`) without their `configs` (which carry a custom task's dataset);
- the run's small report files (JSON, Markdown, CSV, YAML and PNG of at most `MAX_FILE` bytes); of a folder that
  holds model weights, only its `*report*.json`. Other JSONL files (teacher answers, generations: prompts and all)
  are left out.
The archive is reproducible: sorted members, no owners, times or gzip stamp, so packing the same run twice gives the
same bytes. `unpack_records(archive, out)` gives the tree back, which `evaluate.items.read_items` and the paired
tables read as they read the run itself.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import atomic_output_dir, check_output_dir
from layerprune.evaluate.items import SAMPLES_DIR

MAX_FILE = 2 * 2**20
REPORT_SUFFIXES = (".json", ".md", ".csv", ".yaml", ".png")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
TEXT_FIELDS = ("doc", "arguments", "target")  # the document's own text, and the prompts built from it
RESULTS_DIR = "results"  # lm-eval's results per task, beside samples/ (evaluate/report.py)


@dataclass(frozen=True)
class Packed:
    """What `pack_records` wrote: the archive, its sample files and items, its other files, its size."""

    archive: Path
    sample_files: int
    items: int
    other_files: int
    bytes: int


def strip_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """One lm-eval sample without the document's text: its hashes, metrics and the model's responses stay."""
    kept = {key: value for key, value in sample.items() if key not in TEXT_FIELDS}
    if isinstance(sample.get("arguments"), list):
        kept["n_arguments"] = len(sample["arguments"])
    return kept


def _holds_weights(folder: Path) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir() if p.is_file())


def _is_sample_file(path: Path) -> bool:
    return path.parent.name == SAMPLES_DIR and path.suffix == ".jsonl"


def _is_results_file(path: Path) -> bool:
    return path.parent.name == RESULTS_DIR and path.suffix == ".json" and (path.parent.parent / SAMPLES_DIR).is_dir()


def _kept_file(path: Path, weights: bool) -> bool:
    if weights:
        return path.suffix == ".json" and "report" in path.name
    return path.suffix in REPORT_SUFFIXES and path.stat().st_size <= MAX_FILE


def record_files(run: Path) -> tuple[list[Path], list[Path]]:
    """The sample files and the other kept files under `run`, each sorted, symlinks and hidden entries left out."""
    samples, others = [], []
    weights: dict[Path, bool] = {}
    for path in sorted(run.rglob("*")):
        relative = path.relative_to(run)
        if path.is_symlink() or not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if _is_sample_file(path):
            samples.append(path)
        elif _is_results_file(path) or _kept_file(path, weights.setdefault(path.parent, _holds_weights(path.parent))):
            others.append(path)
    return samples, others


def _stripped(path: Path) -> tuple[bytes, int]:
    lines = []
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LayerpruneError(f"{path}: line {number} is not JSON ({exc.msg})") from exc
            lines.append(json.dumps(strip_sample(sample), sort_keys=True))
    return ("\n".join(lines) + "\n").encode() if lines else b"", len(lines)


def _results_without_configs(path: Path) -> bytes:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LayerpruneError(f"{path}: not JSON ({exc.msg})") from exc
    if isinstance(raw, dict):
        raw.pop("configs", None)
    return json.dumps(raw, indent=1, sort_keys=True).encode()


def _member(path: Path) -> tuple[bytes, int]:
    """A kept file's bytes in the archive, and its number of per-item samples."""
    if _is_sample_file(path):
        return _stripped(path)
    if _is_results_file(path):
        return _results_without_configs(path), 0
    return path.read_bytes(), 0


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0
    tar.addfile(info, io.BytesIO(data))


def pack_records(run: Path, archive: Path, overwrite: bool = False) -> Packed:
    """Pack `run`'s per-item records and small reports into `archive` (.tar.gz), written whole or not at all."""
    if not run.is_dir():
        raise LayerpruneError(f"{run}: not a run directory")
    if archive.exists() and not overwrite:
        raise LayerpruneError(f"{archive} already exists; pass --overwrite to replace it")
    if archive.resolve().is_relative_to(run.resolve()):
        raise LayerpruneError(f"{archive} is inside the run {run}; write it elsewhere")
    samples, others = record_files(run)
    if not samples:
        raise LayerpruneError(f"{run}: no per-item samples ({SAMPLES_DIR}/*.jsonl) to pack")
    buffer, items = io.BytesIO(), 0
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        for path in sorted([*samples, *others]):
            data, count = _member(path)
            items += count
            _add(tar, path.relative_to(run).as_posix(), data)
    _write_whole(archive, buffer.getvalue())
    return Packed(archive, len(samples), items, len(others), archive.stat().st_size)


def _write_whole(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise LayerpruneError(f"could not write {path}: {exc}") from exc


def unpack_records(archive: Path, output: Path, overwrite: bool = False) -> list[str]:
    """The tree `pack_records` packed, under `output` (whole or not at all); returns the member names."""
    if not archive.is_file():
        raise LayerpruneError(f"{archive}: no such records archive")
    check_output_dir(output, overwrite)
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            names = tar.getnames()
            with atomic_output_dir(output, overwrite) as tmp:
                tar.extractall(tmp, filter="data")
    except (tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
        raise LayerpruneError(f"{archive}: not a records archive ({exc})") from exc
    return names
