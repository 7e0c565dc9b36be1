"""A sweep's progress without its weights: packed where it travels (a repository, a bucket) and restored on another
machine, where no finished stage runs again. A study that takes longer than a machine is kept runs in parts on
machines whose disks do not last (a cluster's scratch, a lent machine) this way.

`pack_progress(study, root, archive)` writes one reproducible gzip tar of the run folder `root` less:
- model weights (`records.WEIGHT_SUFFIXES`), tokenizer files and figures (PNG: the report draws its own again),
  trainer work folders (`*.work`, their checkpoints), the teacher states
  local's runs share (sweep_cells.STATES) and the control's linked student (`original/`): all made again where needed;
- the teacher answers and other JSONL files (prompts and all: they are made again, greedy answers to the same
  prompts by the same weights; their sha256 is kept in the manifest, and the next pack refuses a run whose answers
  came out otherwise);
- every folder of a model that a stage not yet complete reads (a pruned model a later recovery trains, a checkpoint
  not yet scored), whole: the stage that wrote it runs again (a checkpoint's: the run that saves it), and so, in turn,
  the folders of what that stage reads;
and with each evaluation's per-item samples cut to the records allowlist and every JSON file but the recipes in it
scrubbed of data text (`records.stripped_samples`, `records.scrubbed_json`): no document text travels but the
scored items as the original's evaluation logged them, which the contamination audit reads again with every report
(`audit.scored_tasks`).
`progress-manifest.json` in it names the study (its fingerprint), the stages complete, the weights the run
evaluated (`model_hash` of the original, from its baseline evaluation) and the answers left out.

`restore_progress(archive, root)` unpacks it into a new run folder; `check_same_weights` refuses to resume a run
whose original now resolves to other weights than its finished evaluations scored (a variant made again on another
machine, a hub repo updated): the stages would mix two models.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.pipeline.records import (
    WEIGHT_SUFFIXES,
    add_member,
    is_sample_file,
    scrubbed_json,
    stripped_samples,
    unpack_records,
)
from layerprune.pipeline.studies.sweep_cells import STATES, Cell, cells, model_dir

if TYPE_CHECKING:
    from layerprune.core.settings import RunSettings
    from layerprune.pipeline.studies.sweep_grid import SweepStudy

MANIFEST = "progress-manifest.json"
FORMAT = 1
MADE_AGAIN = ("original",)  # folders made again by the run (the control's linked student)
KEPT_VERBATIM = frozenset({"recipe"})  # JSON keys whose values are recipes: they name data, they hold none
# a model folder's files that are the original's (its tokenizer) or drawn from the others (figures): made again
MADE_FROM_OTHERS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "added_tokens.json", "chat_template.jinja", "tokenizer.model")


def pack_progress(study: SweepStudy, root: Path, archive: Path, overwrite: bool = False) -> dict[str, Any]:
    """Pack `root`'s progress into `archive` (written whole or not at all); return its manifest."""
    if not (root / "run.json").is_file():
        raise LayerpruneError(f"{root}: no sweep run here (no run.json): nothing to pack")
    if archive.exists() and not overwrite:
        raise LayerpruneError(f"{archive} already exists; pass --overwrite to replace it")
    if archive.resolve().is_relative_to(root.resolve()):
        raise LayerpruneError(f"{archive} is inside the run {root}; write it elsewhere")
    if not holds_run_of(root, study):
        raise LayerpruneError(f"{root}: run.json records another recipe than {study.name}'s; nothing was packed")
    grid = cells(study, root)
    dropped = [root / name for name in MADE_AGAIN] + [root / STATES] + dropped_folders(grid, root)
    answers = check_answers(root)
    items = audited_items(root)
    buffer, kept = io.BytesIO(), []
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        for path in sorted(root.rglob("*")):
            relative = path.relative_to(root)
            if not kept_file(path, relative, dropped):
                continue
            add_member(tar, relative.as_posix(), path.read_bytes() if path in items else member(path))
            kept.append(relative.as_posix())
        record = manifest(study, root, grid, dropped, answers, kept)
        add_member(tar, MANIFEST, json.dumps(record, indent=1, sort_keys=True).encode())
    try:
        write_atomic(archive, buffer.getvalue())
    except OSError as exc:
        raise LayerpruneError(f"could not write {archive}: {exc}") from exc
    return record


def dropped_folders(grid: list[Cell], root: Path) -> list[Path]:
    """The model folders left out whole: each one a stage not yet complete reads, with, in turn, the output folder of
    the stage that writes it (a checkpoint: its run's) and what that stage reads, until nothing more is added."""
    writers = {cell.output.parent: cell for cell in grid if cell.step in ("prune", "recover")}
    writers |= {model_dir(root, label): cell for cell in grid for _, label in cell.snapshots}
    pending = [cell for cell in grid if not cell.output.exists()]
    dropped: set[Path] = set()
    while pending:
        cell = pending.pop()
        for folder in (cell.model, cell.output.parent if cell.step in ("prune", "recover") else None):
            if folder is None or folder in dropped:
                continue
            dropped.add(folder)
            writer = writers.get(folder)
            if writer is not None:
                pending.append(writer)
    return sorted(dropped)


def kept_file(path: Path, relative: Path, dropped: list[Path]) -> bool:
    """Whether a file under the run travels: a plain file, not hidden or in a work folder, not weights, a tokenizer,
    a figure or a JSONL file other than samples (answers: made again), not in a folder left out."""
    return (path.is_file() and not path.is_symlink() and not made_by_the_run(relative)
            and path.suffix not in WEIGHT_SUFFIXES and path.name not in MADE_FROM_OTHERS and path.suffix != ".png"
            and (path.suffix != ".jsonl" or is_sample_file(path)) and relative.as_posix() != MANIFEST
            and not any(path.is_relative_to(folder) for folder in dropped))


def made_by_the_run(relative: Path) -> bool:
    """Whether a path under the run is hidden (a lock, a partial write) or in a trainer's work folder."""
    return any(part.startswith(".") or part.endswith(".work") for part in relative.parts)


def audited_items(root: Path) -> set[Path]:
    """The samples the contamination audit reads each scored task's items from (the original's evaluation, drawn
    again with every report): kept whole, their documents with them."""
    from layerprune.evaluate.items import SAMPLES_DIR
    from layerprune.pipeline.audit import scored_tasks

    return {folder / SAMPLES_DIR / f"{task}.jsonl" for task, folder in scored_tasks(root).items()}


def member(path: Path) -> bytes:
    """A kept file's bytes: samples cut to the allowlist, JSON scrubbed of data text but for its recipes."""
    if is_sample_file(path):
        return stripped_samples(path)[0]
    if path.suffix == ".json":
        return scrubbed_json(path, KEPT_VERBATIM)
    return path.read_bytes()


def answer_files(root: Path) -> dict[str, str]:
    """The teacher answers and other JSONL files the pack leaves out (samples aside): path -> sha256."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(
        root.rglob("*.jsonl")) if p.is_file() and not is_sample_file(p) and not made_by_the_run(p.relative_to(root))}


def check_answers(root: Path) -> dict[str, str]:
    """This run's answer files, refused where one left out by the pack it was restored from came out otherwise here
    (recoveries of two parts trained on different answers)."""
    now = answer_files(root)
    before = read_manifest(root).get("answers") or {}
    if changed := sorted(name for name, digest in before.items() if name in now and now[name] != digest):
        raise LayerpruneError(f"{root}: {changed[0]} differs from the one the restored progress was made with "
                              f"({len(changed)} file(s)): this part's recoveries trained on other answers than the "
                              "earlier parts'; nothing was packed")
    return {**before, **now}


def read_manifest(root: Path) -> dict[str, Any]:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def manifest(study: SweepStudy, root: Path, grid: list[Cell], dropped: list[Path], answers: dict[str, str],
             kept: list[str]) -> dict:
    """The archive's manifest; its complete stages are those whose output travels (not one in a folder left out)."""
    from layerprune.pipeline.stages import recipe_fingerprint

    complete = [c.name for c in grid if c.output.exists() and c.step != "report"
                and not any(c.output.is_relative_to(folder) for folder in dropped)]
    return {"format": FORMAT, "study": study.name, "fingerprint": recipe_fingerprint(study), "complete": complete,
            "model_hash": evaluated_hash(root), "answers": answers, "files": len(kept)}


def evaluated_hash(root: Path) -> str | None:
    """The weights the run's finished evaluations of the original scored (its baseline's model_hash)."""
    from layerprune.evaluate.summary import SUMMARY_FILE

    try:
        return str(json.loads((root / "eval" / "baseline" / SUMMARY_FILE).read_text())["model_hash"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_archive_manifest(archive: Path) -> dict[str, Any]:
    """The manifest of a progress archive; anything else is a one-line LayerpruneError."""
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            member = tar.extractfile(MANIFEST)
            record = json.loads(member.read()) if member is not None else None
    except FileNotFoundError as exc:
        raise LayerpruneError(f"{archive}: no such progress archive") from exc
    except KeyError as exc:
        raise LayerpruneError(f"{archive}: not a study's progress (no {MANIFEST})") from exc
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError, ValueError) as exc:
        raise LayerpruneError(f"{archive}: not a study's progress ({exc})") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise LayerpruneError(f"{archive}: not a study's progress of format {FORMAT}")
    return record


def restore_progress(study: SweepStudy, archive: Path, root: Path) -> list[str]:
    """`archive`'s progress of `study` unpacked into the new run folder `root` (whole or not at all); its member
    names (none where `root` holds this study's run already: it resumes as it stands). The archive of another recipe
    (by its fingerprint), or a folder holding anything else, is refused before anything is written."""
    from layerprune.pipeline.stages import recipe_fingerprint

    record = read_archive_manifest(archive)
    if record.get("fingerprint") != recipe_fingerprint(study):
        raise LayerpruneError(f"{archive}: the progress of {record.get('study')} as recipe "
                              f"{record.get('fingerprint')}, not of {study.name} as recipe {recipe_fingerprint(study)}")
    if root.exists() and any(root.iterdir()):
        if holds_run_of(root, study):  # restored before (the same command again): it resumes as it stands
            return []
        raise LayerpruneError(f"{root} already holds another run; progress is restored into a new run folder only "
                              "(pass --output for another)")
    return unpack_records(archive, root, overwrite=root.exists())


def holds_run_of(root: Path, study: SweepStudy) -> bool:
    from layerprune.core.reports import read_report
    from layerprune.pipeline.stages import RunState, owns

    try:
        return owns(read_report(root / "run.json", RunState), study)
    except (LayerpruneError, ValueError):
        return False


def check_same_weights(study: SweepStudy, settings: RunSettings, root: Path) -> None:
    """Refuse to resume `root` when its original now resolves to other weights than its baseline evaluation scored
    (a variant made again, a hub repo updated): its stages would mix two models."""
    recorded = evaluated_hash(root)
    if recorded is None:
        return
    from layerprune.models.identity import model_fingerprint
    from layerprune.models.loading import resolve_model

    now = model_fingerprint(resolve_model(study.model, settings), settings.resolved_cache_dir())
    if now != recorded:
        raise LayerpruneError(f"{root}: its finished evaluations scored {study.model} with weights {recorded[:12]}, "
                              f"and it resolves to weights {now[:12]} here (made again otherwise, or updated): its "
                              "stages would mix two models; bring those weights back or start a new --output")
