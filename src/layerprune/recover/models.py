"""Which model is the student (the pruned one) and which is the teacher (the original)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from layerprune.errors import LayerpruneError
from layerprune.models import ModelSource, drop_blocks, load_model, resolve_model
from layerprune.models.loading import copy_tokenizer_files
from layerprune.recover.schema import RecoverRecipe
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
PRUNE_REPORT = "prune_report.json"


def resolve_student(recipe: RecoverRecipe, settings: RunSettings) -> ModelSource:
    """The model to recover, as given (a prune output directory, or any model with drop_blocks)."""
    if recipe.model is None:
        raise LayerpruneError("no model to recover: pass --model (a `layerprune prune` output directory)")
    source = resolve_model(recipe.model, settings)
    if recipe.drop_blocks is None and source.kind != "local":
        raise LayerpruneError(f"{recipe.model} is not a pruned model directory; pass the output of `layerprune prune` "
                              "(or set drop_blocks in the recipe)")
    return source


def teacher_spec(recipe: RecoverRecipe, student: ModelSource) -> str:
    """--teacher, else the unpruned --model (drop_blocks), else the source named in prune_report.json."""
    if recipe.teacher:
        return recipe.teacher
    if recipe.drop_blocks is not None:
        return student.spec
    report = Path(student.location) / PRUNE_REPORT
    source = _report_source(report)
    for candidate in (source.get("spec"), source.get("location")):
        if candidate and _resolvable(candidate):
            return str(candidate)
    if source.get("spec"):
        raise LayerpruneError(f"the teacher named in {report} ({source['spec']}) cannot be found; pass --teacher")
    raise LayerpruneError(f"no teacher known: {student.spec} has no {PRUNE_REPORT} naming its source model; "
                          "pass --teacher MODEL")


def _report_source(report: Path) -> dict[str, Any]:
    if not report.is_file():
        return {}
    try:
        source = json.loads(report.read_text()).get("source", {})
    except (json.JSONDecodeError, AttributeError) as exc:
        raise LayerpruneError(f"{report} is not a valid prune report; pass --teacher") from exc
    return source if isinstance(source, dict) else {}


def _resolvable(spec: str) -> bool:
    try:
        resolve_model(spec)
    except LayerpruneError:
        return False
    return True


def materialize_student(recipe: RecoverRecipe, student: ModelSource, settings: RunSettings, work: Path) -> ModelSource:
    """With drop_blocks, save the model minus those blocks to work/student once; otherwise the student as is."""
    if recipe.drop_blocks is None:
        return student
    target, indices = work / "student", sorted(set(recipe.drop_blocks))
    if _report_dropped(target / PRUNE_REPORT) != indices:
        _save_dropped(student, indices, settings, target)
    return resolve_model(str(target), settings)


def _report_dropped(report: Path) -> list[int] | None:
    return json.loads(report.read_text()).get("dropped") if report.is_file() else None


def _save_dropped(source: ModelSource, indices: list[int], settings: RunSettings, target: Path) -> None:
    from layerprune.outputs import atomic_output_dir

    loaded = load_model(source, settings.model_copy(update={"device": "cpu", "dtype": "float32"}))
    before = loaded.model.config.num_hidden_layers
    if max(indices) >= before or len(indices) >= before:
        raise LayerpruneError(f"drop_blocks {indices} does not fit a model with {before} blocks")
    kept = drop_blocks(loaded.model, indices)
    log.info("dropped blocks %s of %s (%d -> %d blocks)", indices, source.spec, before, len(kept))
    report = {"source": {"spec": source.spec, "location": source.location, "kind": source.kind,
                         "identity": source.identity},
              "method": {"name": "drop_blocks (recover recipe)"}, "dropped": indices, "kept": list(kept),
              "num_blocks_before": before, "num_blocks_after": len(kept)}
    with atomic_output_dir(target, overwrite=True) as tmp:
        loaded.model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer_files(source, tmp, loaded.tokenizer)
        (tmp / PRUNE_REPORT).write_text(json.dumps(report, indent=2, default=str))
