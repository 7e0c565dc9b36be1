"""Which model is the student (the pruned one) and which is the teacher (the original)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.provenance import collect_provenance
from layerprune.core.reports import write_report
from layerprune.core.settings import RunSettings
from layerprune.models import ModelSource, drop_blocks, load_model, resolve_model
from layerprune.models.lineage import PRUNE_REPORT, PrunedLineage, PruneMethod, SourceRecord, read_lineage
from layerprune.models.loading import copy_tokenizer_files
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


def resolve_student(recipe: RecoverRecipe, settings: RunSettings) -> ModelSource:
    """The model to recover, as given (a prune output directory, or any model with drop_blocks)."""
    if recipe.model is None:
        raise LayerpruneError("no model to recover: pass --model (a `layerprune prune` output directory)")
    source = resolve_model(recipe.model, settings)
    if recipe.drop_blocks is None and source.kind != "local":
        raise LayerpruneError(f"{recipe.model} is not a pruned model directory; pass the output of `layerprune prune` "
                              "(or set drop_blocks in the recipe)")
    return source


def plan_recover(recipe: RecoverRecipe, settings: RunSettings) -> tuple[RecoverRecipe, ModelSource, str, list[str]]:
    """Student, teacher and the recipe as it will run, with every recipe/model/teacher conflict found from configs
    alone (before anything loads): a pruned model's drop_blocks is ignored, impossible ones are errors."""
    notes: list[str] = []
    student = resolve_student(recipe, settings)
    if recipe.drop_blocks is not None and (Path(student.location) / PRUNE_REPORT).is_file():
        notes.append(f"{recipe.model} is already pruned (it has a {PRUNE_REPORT}): the recipe's drop_blocks "
                     f"{recipe.drop_blocks} is ignored and its source model is the teacher")
        recipe = recipe.model_copy(update={"drop_blocks": None})
    teacher = teacher_spec(recipe, student)
    check_conflicts(recipe, student, teacher, settings)
    return recipe, student, teacher, notes


def check_conflicts(recipe: RecoverRecipe, student: ModelSource, teacher: str, settings: RunSettings) -> None:
    """Refuse a student that is its own teacher, drop_blocks past the model's end and KD across vocabularies."""
    config = _config(student.location, settings)
    if recipe.drop_blocks is not None and config is not None:
        blocks = config.get_text_config().num_hidden_layers
        indices = sorted(set(recipe.drop_blocks))
        if indices[-1] >= blocks or len(indices) >= blocks:
            raise LayerpruneError(f"drop_blocks {indices} does not fit {recipe.model}, which has {blocks} blocks")
    teacher_source = _resolved(teacher, settings)
    if recipe.drop_blocks is None and teacher_source is not None and \
            Path(teacher_source.location).resolve() == Path(student.location).resolve():
        raise LayerpruneError(f"the teacher {teacher} is the model being recovered; pass the unpruned model as "
                              "--teacher (or set drop_blocks to prune it first)")
    teacher_config = _config(teacher_source.location, settings) if teacher_source is not None else None
    if recipe.method == "kd" and config is not None and teacher_config is not None:
        vocab, teacher_vocab = config.get_text_config().vocab_size, teacher_config.get_text_config().vocab_size
        if vocab != teacher_vocab:
            raise LayerpruneError(f"method kd needs one vocabulary: the student has {vocab} tokens, the teacher "
                                  f"{teacher} {teacher_vocab}; use --method lora or full")


def _resolved(spec: str, settings: RunSettings) -> ModelSource | None:
    try:
        return resolve_model(spec, settings)
    except LayerpruneError:
        return None


def _config(location: str, settings: RunSettings) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(location, trust_remote_code=settings.trust_remote_code)
    except (OSError, ValueError):
        return None


def teacher_spec(recipe: RecoverRecipe, student: ModelSource) -> str:
    """--teacher, else the unpruned --model (drop_blocks), else the source named in prune_report.json."""
    if recipe.teacher:
        return recipe.teacher
    if recipe.drop_blocks is not None:
        return student.spec
    lineage = read_lineage(Path(student.location))
    if lineage is None:
        raise LayerpruneError(f"no teacher known: {student.spec} has no {PRUNE_REPORT} naming its source model; "
                              "pass --teacher MODEL")
    source = lineage.source
    for candidate in (source.spec, source.location):
        if candidate and _resolvable(candidate):
            return str(candidate)
    raise LayerpruneError(f"the teacher named in {Path(student.location) / PRUNE_REPORT} ({source.spec}) cannot be "
                          "found; pass --teacher")


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
    if _saved_drops(target) != indices:
        save_dropped(student, indices, settings, target)
    return resolve_model(str(target), settings)


def _saved_drops(target: Path) -> list[int] | None:
    """The blocks an earlier run dropped into `target` (None when there is none, or an older version's)."""
    try:
        lineage = read_lineage(target)
    except LayerpruneError:
        return None
    return lineage.dropped if lineage is not None else None


def save_dropped(source: ModelSource, indices: list[int], settings: RunSettings, target: Path) -> PrunedLineage:
    """`source` minus the blocks `indices`, saved to `target` with the lineage a prune output records."""
    from layerprune.core.outputs import atomic_output_dir

    loaded = load_model(source, settings.model_copy(update={"device": "cpu", "dtype": "float32"}))
    before = loaded.model.config.num_hidden_layers
    if max(indices) >= before or len(indices) >= before:
        raise LayerpruneError(f"drop_blocks {indices} does not fit a model with {before} blocks")
    kept = drop_blocks(loaded.model, indices)
    log.info("dropped blocks %s of %s (%d -> %d blocks)", indices, source.spec, before, len(kept))
    lineage = PrunedLineage(source=SourceRecord.of(source), method=PruneMethod(score="explicit", seed=settings.seed),
                            calibration=None, dropped=indices, kept=list(kept), num_blocks_before=before,
                            num_blocks_after=len(kept), provenance=collect_provenance())
    with atomic_output_dir(target, overwrite=True) as tmp:
        loaded.model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer_files(source, tmp, loaded.tokenizer)
        write_report(tmp / PRUNE_REPORT, lineage)
    return lineage
