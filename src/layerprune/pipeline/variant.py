"""`layerprune variant-study RECIPE`: post-train a variant of a model with our own recovery code, then compare the
importance profiles of the original and the variant (Spearman of the drops, Jaccard of the critical sets, with
bootstrap intervals over the shared items). The study's claim in small: do critical blocks stay critical?

Stages, each skipped when its output is complete: variant/ (recover, the unpruned model learning from its own
answers), importance/ (analyze importance on [original, variant]), then variant.json, variant.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.errors import LayerpruneError
from layerprune.pipeline.recipe import RecoverStage
from layerprune.recipe_loading import build_from_recipe, validation_message
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
STUDY_OWNED = ("models", "output", "overwrite", "dry_run", "tokenizers")  # importance fields the study sets itself


class VariantStudy(BaseModel):
    """Original vs its post-trained variant: the same importance analysis on both, compared block by block."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Study name (default output: runs/<name>)")
    description: str = Field("", description="What this study shows")
    model: str = Field("embedded", description="The original model: hub id, local directory, .gguf or embedded[:NAME]")
    variant: RecoverStage = Field(description="How the variant is made: a recover recipe and overrides, run on the "
                                              "unpruned model with itself as the teacher")
    importance: dict[str, Any] = Field(default_factory=dict, description="`analyze importance` fields (tasks, "
                                                                         "metric, samples, ...) used for both models")
    resamples: int = Field(1000, ge=100, description="Bootstrap resamples of the items for the agreement intervals")
    alpha: float = Field(0.05, gt=0, lt=1, description="The intervals are (1 - alpha) percentile intervals")
    output: Path | None = Field(None, description="Study directory")

    @model_validator(mode="after")
    def _sections_are_valid(self) -> VariantStudy:
        owned = sorted(set(self.importance) & set(STUDY_OWNED))
        if owned:
            raise ValueError(f"importance sets {owned}, which the study sets itself")
        try:
            self.importance_config(Path("<variant>"))
            self.recover_recipe()
        except ValidationError as exc:
            raise ValueError(validation_message(exc, "variant study section")) from None
        return self

    def run_dir(self) -> Path:
        return self.output or Path("runs") / self.name

    def recover_recipe(self) -> Any:
        """The recover recipe that makes the variant: the original model learns from its own answers."""
        return self.variant.resolve(self.model, self.model)

    def importance_config(self, variant_dir: Path) -> ImportanceAnalysis:
        return ImportanceAnalysis.model_validate({**self.importance, "models": [self.model, str(variant_dir)]})


def load_variant_study(name_or_path: str, output: Path | None = None) -> VariantStudy:
    """Read and validate a variant-study recipe (a shipped name or a YAML path); `output` replaces its directory."""
    return build_from_recipe(VariantStudy, "variant-study", name_or_path,
                             {"output": str(output)} if output is not None else {})


def student_copy(study: VariantStudy, settings: RunSettings, root: Path) -> Path:
    """The original's files linked (or copied) into root/student: recover trains that directory, with the original
    as its teacher (recover refuses a model that is its own teacher by location)."""
    import os
    import shutil

    from layerprune.models import resolve_model

    source = resolve_model(study.model, settings)
    location = Path(source.location)
    if source.kind == "hub":  # the checkpoint's own files at its resolved commit (no consolidated copy)
        from layerprune.models.hub import download_checkpoint, resolve_revision

        location = download_checkpoint(source.location, resolve_revision(source))
    target = root / "student"
    if not (target / "config.json").is_file():
        tmp = root / ".student.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for file in location.iterdir():
            if file.is_file():
                try:
                    os.link(file.resolve(), tmp / file.name)
                except OSError:
                    shutil.copy2(file, tmp / file.name)
        tmp.replace(target)
    return target


def make_variant(study: VariantStudy, settings: RunSettings, root: Path) -> Path:
    from layerprune.recover.report import read_recover_report
    from layerprune.recover.runner import RecoverJob, recover_model

    target = root / "variant"
    recipe = study.variant.resolve(str(root / "student"), study.model)
    if (target / "recover_report.json").is_file():
        if read_recover_report(target).recipe != recipe:
            raise LayerpruneError(f"{target} was made by another variant recipe; choose another --output, or delete "
                                  "it to make the variant again")
        return target
    student_copy(study, settings, root)
    data_dir = study.importance.get("data_dir")
    recover_model(recipe, RecoverJob(output=target, settings=settings, data_dir=data_dir, resume=True))
    return target


def score_both(study: VariantStudy, settings: RunSettings, root: Path, variant: Path) -> dict[str, Any]:
    import json

    from layerprune.analyze.importance import analyze_importance
    from layerprune.outputs import atomic_output_dir

    target = root / "importance"
    config = study.importance_config(variant)
    done = target / "importance.json"
    if not done.is_file() or json.loads(done.read_text())["config"] != config.model_dump(mode="json") \
            or json.loads(done.read_text())["run"]["settings"].get("seed") != settings.seed:
        with atomic_output_dir(target, overwrite=True) as tmp:  # missing, or made with other settings: (re)made
            analyze_importance(config, settings, tmp)
    return json.loads(done.read_text())


def compare(study: VariantStudy, report: dict[str, Any], seed: int) -> dict[str, Any]:
    """Per task: the agreement of the original's and the variant's profiles, with intervals."""
    from layerprune.analyze.agreement import profile_agreement

    kind = "probability" if report["config"]["metric"] == "nll" else "mean"
    threshold = report["config"]["threshold"]
    out = {}
    for task, per_model in report["tasks"].items():
        original, variant = per_model.values()
        out[task] = {"base_scores": [original["base_score"], variant["base_score"]],
                     **profile_agreement(original, variant, kind, threshold, study.resamples, study.alpha, seed)}
    return out


def run_variant_study(study: VariantStudy, settings: RunSettings) -> Path:
    """Every incomplete stage; returns variant.md."""
    from layerprune.analyze.records import write_json
    from layerprune.extras import require_extra

    require_extra("analyze", "the variant study")  # before the variant is trained

    root = study.run_dir()
    root.mkdir(parents=True, exist_ok=True)
    log.info("variant study %s: making the variant", study.name)
    variant = make_variant(study, settings, root)
    log.info("variant study %s: importance of the original and the variant", study.name)
    report = compare(study, score_both(study, settings, root, variant), settings.seed)
    write_json(root / "variant.json", {"study": study.model_dump(mode="json"), "tasks": report})
    (root / "variant.md").write_text(variant_table(study, report), encoding="utf-8")
    return root / "variant.md"


def _fmt(value: float | None, interval: list[float] | None = None) -> str:
    text = "n/a" if value is None else f"{value:.2f}"
    return text + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")


def variant_table(study: VariantStudy, tasks: dict[str, Any]) -> str:
    level = f"{1 - study.alpha:.0%}"
    lines = [f"# Variant study: {study.name}", "", *([study.description, ""] if study.description else []),
             f"Original `{study.model}` vs its variant (variant/). Drops per block from importance/ (heatmap: "
             f"importance/heatmap.png). Intervals: {level} paired bootstrap over the items ({study.resamples} "
             "resamples); a resample's critical set is the blocks above the threshold.", "",
             "| task | full score (original / variant) | Spearman of drops | Jaccard of critical sets | "
             "critical (original) | critical (variant) |", "|---|---|---|---|---|---|"]
    for task, row in tasks.items():
        base = " / ".join(_fmt(v) for v in row["base_scores"])
        lines.append(f"| {task} | {base} | {_fmt(row['spearman'], row['spearman_interval'])} | "
                     f"{_fmt(row['critical_jaccard'], row['jaccard_interval'])} | {row['critical'][0]} | "
                     f"{row['critical'][1]} |")
    return "\n".join(lines) + "\n"


def dry_run(study: VariantStudy, settings: RunSettings) -> str:
    """The plan: how the variant is made, and the importance analysis (rendered prompts, budgets); no work."""
    from layerprune.analyze.plan import dry_run_text

    recipe = study.recover_recipe()
    length = f"{recipe.train.max_steps} steps" if recipe.train.max_steps else f"{recipe.train.epochs:g} epoch(s)"
    lines = [f"variant study '{study.name}' -> {study.run_dir()}",
             f"variant: recover recipe '{study.variant.recipe}' on {study.model} (teacher: itself), method "
             f"{recipe.method}, {recipe.prompts.samples or 'all'} {recipe.prompts.source} {recipe.prompts.split} "
             f"prompts answered at temperature {recipe.generate.temperature:g} (<= {recipe.generate.max_new_tokens} "
             f"tokens), {length} of "
             f"{recipe.train.batch_size} x {recipe.train.grad_accum} at lr {recipe.train.learning_rate:g}",
             "importance (the variant is scored the same way; its tokenizer is the original's):"]
    config = ImportanceAnalysis.model_validate({**study.importance, "models": [study.model]})
    lines.append(dry_run_text(config, settings))
    return "\n".join(lines)
