"""A run's per-item records, packed to keep beside its report (in a repository, without document text) and unpacked to
redo any paired comparison later.

`pack_records(run, archive)` writes one gzip tar of:
- every evaluation's per-item samples under `run` (lm-eval's `samples/<task>.jsonl`), each sample cut to an allowlist:
  its ids and filter, the item's hashes (doc, prompt, target), the model's own responses, the number of arguments
  (`n_arguments`, which sets a multiple-choice item's chance score) and every metric whose value is a number (a
  corpus metric such as BLEU logs its reference text per item: left out);
- the run's JSON files (reports, summaries, lm-eval's results), each scrubbed (`scrub`): `configs` (a custom task's
  dataset) dropped, and the value of every key that holds data text (calibration items' prompts and answers, the
  teacher's responses, an importance analysis's item prompts and answers, ...) replaced by a hash of it; an
  importance analysis's `importance.json` holds its per-item records (each item's score with every block skipped) and
  is packed whatever its size;
- its other small report files (Markdown, CSV, YAML, PNG); every kept file at most `MAX_FILE` bytes (the ones over it
  are listed, not packed); of a folder that holds model weights, only its `*report*.json`. Other JSONL files
  (teacher answers, generations: prompts and all) are left out;
- `records-manifest.json`: what packed it (the layerprune version and commit of the code that packed it) and what
  the run was (its recipe's name and fingerprint and the commit it ran at, from run.json or a variant study's record).
The archive is reproducible: sorted members, no owners, times or gzip stamp, so packing the same run twice gives the
same bytes. `unpack_records(archive, out)` gives the tree back, which `evaluate.items.read_items` and the paired
tables read as they read the run itself.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import atomic_output_dir, check_output_dir, write_atomic
from layerprune.evaluate.items import SAMPLES_DIR, n_arguments

MAX_FILE = 2 * 2**20
REPORT_SUFFIXES = (".json", ".md", ".csv", ".yaml", ".png")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
SAMPLE_FIELDS = ("doc_id", "subtask", "filter", "metrics", "resps", "filtered_resps", "n_arguments")
# keys whose values are data text (a prune report's `target` is its --target, not data; lm-eval's per-item `target`
# goes with the sample allowlist)
TEXT_KEYS = frozenset({"text", "prompt", "answer", "question", "response", "instruction", "context", "completion",
                       "doc", "arguments", "shots", "examples", "prompts", "answers"})
ANALYSIS_RECORDS = "importance.json"  # `analyze importance`: every item's score with each block skipped, per model
DROPPED_KEYS = frozenset({"configs"})  # lm-eval's task configs: a custom task carries its dataset inline
MANIFEST = "records-manifest.json"


@dataclass(frozen=True)
class Packed:
    """What `pack_records` wrote: the archive, its sample files and items, its other files, its size, and the files
    left out for their size."""

    archive: Path
    sample_files: int
    items: int
    other_files: int
    bytes: int
    too_large: tuple[str, ...] = ()


def strip_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """One lm-eval sample cut to the allowlist: ids, filter, hashes, responses, the argument count and the metrics
    whose values are numbers."""
    kept = {key: sample[key] for key in SAMPLE_FIELDS if key in sample}
    kept.update({key: value for key, value in sample.items() if key.endswith("_hash") and isinstance(value, str)})
    kept.update({name: sample[name] for name in sample.get("metrics") or []
                 if isinstance(sample.get(name), (int, float, bool))})
    if "arguments" in sample:
        kept["n_arguments"] = n_arguments(sample)
    return kept


def scrub(value: Any, keep: frozenset[str] = frozenset()) -> Any:
    """A JSON value with `DROPPED_KEYS` removed and every string under a `TEXT_KEYS` key replaced by its hash; the
    values of the keys in `keep` as they are."""
    if isinstance(value, dict):
        return {key: item if key in keep else _hashed(item) if key in TEXT_KEYS else scrub(item, keep)
                for key, item in value.items() if key not in DROPPED_KEYS}
    if isinstance(value, list):
        return [scrub(item, keep) for item in value]
    return value


def _hashed(value: Any) -> Any:
    if isinstance(value, str):
        return "sha256:" + hashlib.sha256(value.encode()).hexdigest()[:16]
    if isinstance(value, dict):
        return {key: _hashed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_hashed(item) for item in value]
    return value


def _holds_weights(folder: Path) -> bool:
    return any(p.suffix in WEIGHT_SUFFIXES for p in folder.iterdir() if p.is_file())


def is_sample_file(path: Path) -> bool:
    """Whether `path` is an evaluation's per-item samples (lm-eval's JSONL under its samples folder)."""
    return path.parent.name == SAMPLES_DIR and path.suffix == ".jsonl"


def _kept_file(path: Path, weights: bool) -> bool:
    if weights:
        return path.suffix == ".json" and "report" in path.name
    return path.suffix in REPORT_SUFFIXES


def record_files(run: Path) -> tuple[list[Path], list[Path]]:
    """The sample files and the other kept files under `run`, each sorted, symlinks and hidden entries left out."""
    samples, others = [], []
    weights: dict[Path, bool] = {}
    for path in sorted(run.rglob("*")):
        relative = path.relative_to(run)
        if path.is_symlink() or not path.is_file() or any(part.startswith(".") for part in relative.parts) \
                or relative.as_posix() == MANIFEST:  # an unpacked archive's: a new one is written
            continue
        if path.parent not in weights:
            weights[path.parent] = _holds_weights(path.parent)
        if is_sample_file(path):
            samples.append(path)
        elif _kept_file(path, weights[path.parent]):
            others.append(path)
    return samples, others


def stripped_samples(path: Path) -> tuple[bytes, int]:
    """A sample file's bytes cut to the allowlist (`strip_sample`), and its number of samples."""
    from layerprune.tasks.data import read_jsonl

    lines = [json.dumps(strip_sample(sample), sort_keys=True) for sample in (read_jsonl(path) if path.stat().st_size
                                                                             else [])]
    return ("\n".join(lines) + "\n").encode() if lines else b"", len(lines)


def scrubbed_json(path: Path, keep: frozenset[str] = frozenset()) -> bytes:
    """A JSON file's bytes scrubbed of data text (`scrub`), the values of the keys in `keep` verbatim."""
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LayerpruneError(f"{path}: not JSON ({exc})") from exc
    return json.dumps(scrub(raw, keep), indent=1).encode()  # in its own key order: readers may follow it


def _member(path: Path) -> tuple[bytes, int]:
    """A kept file's bytes in the archive, and its number of per-item records (lm-eval samples, or an importance
    analysis's items per task and model)."""
    if is_sample_file(path):
        return stripped_samples(path)
    if path.suffix == ".json":
        data = scrubbed_json(path)
        return data, _analysis_items(json.loads(data)) if path.name == ANALYSIS_RECORDS else 0
    return path.read_bytes(), 0


def _analysis_items(report: Any) -> int:
    """Items scored per task and model in an importance report (0: not one)."""
    tasks = report.get("tasks") if isinstance(report, dict) else None
    return sum(len((result.get("per_item") or {}).get("base_item_correct") or [])
               for per_model in (tasks or {}).values() if isinstance(per_model, dict)
               for result in per_model.values() if isinstance(result, dict))


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
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
    buffer, items, too_large = io.BytesIO(), 0, []
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        add_member(tar, MANIFEST, json.dumps(manifest(run), indent=1, sort_keys=True).encode())
        for path in sorted([*samples, *others]):
            data, count = _member(path)
            if count == 0 and len(data) > MAX_FILE:
                too_large.append(path.relative_to(run).as_posix())
                continue
            items += count
            add_member(tar, path.relative_to(run).as_posix(), data)
    if items == 0:  # nothing is written
        raise LayerpruneError(f"{run}: no per-item records ({SAMPLES_DIR}/*.jsonl or {ANALYSIS_RECORDS} with items) "
                              "to pack")
    try:
        write_atomic(archive, buffer.getvalue())
    except OSError as exc:
        raise LayerpruneError(f"could not write {archive}: {exc}") from exc
    return Packed(archive, len(samples), items, len(others) - len(too_large), archive.stat().st_size,
                  tuple(too_large))


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_identity(run: Path) -> dict[str, Any]:
    """The run's recipe name and fingerprint and the commit it ran at: run.json's, or for a variant study (which has
    none) the study's name and a hash of the study record in variant.json; {} when neither is there."""
    state, variant = _read(run / "run.json"), _read(run / "variant.json")
    if isinstance(state, dict) and "fingerprint" in state:
        git = ((state.get("provenance") or {}).get("git") or {})
        return {"name": state.get("name"), "fingerprint": state["fingerprint"], "commit": git.get("commit")}
    if isinstance(variant, dict) and isinstance(variant.get("study"), dict):
        canonical = json.dumps(variant["study"], sort_keys=True, separators=(",", ":")).encode()
        digest = hashlib.sha256(canonical).hexdigest()[:16]
        return {"name": variant["study"].get("name"), "fingerprint": f"study:{digest}", "commit": None}
    return {}


def manifest(run: Path) -> dict[str, Any]:
    """What an archive says of itself: the code that packed it and the run it holds."""
    from layerprune.core.provenance import source_checkout
    from layerprune.core.version import package_version

    git = source_checkout()
    return {"format": 1, "packed_by": {"layerprune": package_version(), "commit": git.commit if git else None,
                                       "dirty": git.dirty if git else None}, "run": run_identity(run)}


def records_origin(root: Path) -> list[str]:
    """Lines saying what an unpacked archive was made with (its manifest, else what its run records)."""
    packed = _read(root / MANIFEST)
    run = (packed or {}).get("run") or run_identity(root)
    by = (packed or {}).get("packed_by") or {}
    lines = [f"packed by layerprune {by.get('layerprune')} at commit {by.get('commit') or 'unknown'}"
             + (" (uncommitted changes)" if by.get("dirty") else "") if packed else
             "no commit recorded: the archive has no manifest (packed before manifests)"]
    if run.get("fingerprint"):
        lines.append(f"recipe {run.get('name')}, fingerprint {run['fingerprint']}"
                     + (f", run at commit {run['commit'][:12]}" if run.get("commit") else ""))
    return lines


def unpack_records(archive: Path, output: Path, overwrite: bool = False) -> list[str]:
    """The tree `pack_records` packed, under `output` (whole or not at all); returns the member names."""
    if not archive.is_file():
        raise LayerpruneError(f"{archive}: no such records archive")
    check_output_dir(output, overwrite, inputs=(archive,))
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = tar.getmembers()
            if odd := [m.name for m in members if not (m.isfile() or m.isdir())]:
                raise LayerpruneError(f"{archive}: not a records archive (links or devices: {', '.join(odd[:3])})")
            with atomic_output_dir(output, overwrite) as tmp:
                tar.extractall(tmp, filter="data")
    except (tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
        raise LayerpruneError(f"{archive}: not a records archive ({exc})") from exc
    except TypeError as exc:  # tarfile without the data filter (Python < 3.10.12 / 3.11.4)
        raise LayerpruneError(f"unpacking needs tarfile's data filter (Python >= 3.10.12 or 3.11.4): {exc}") from exc
    return [m.name for m in members]
