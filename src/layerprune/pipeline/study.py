"""The recovery study: prune once, recover the same pruned model with several methods at one budget, compare.

Every arm shares the recover recipe's prompts, generation settings and optimisation budget (train section: the same
optimizer steps, batch size and grad_accum); an arm may change only the method and that method's own section. The
teacher answers the prompts once; later arms reuse the answers. Each arm is evaluated on the same tasks, and
study.md holds one table (study_report.py) and a chart. Stages are skipped when their output is complete.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune import errors
from layerprune.data import iter_jsonl
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.recipe_loading import merge_layers, validation_message
from layerprune.recover.schema import RecoverRecipe
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
BUDGET_KEYS = ("max_steps", "batch_size", "grad_accum", "max_length", "epochs")


class Arm(BaseModel):
    """One recovery method: the method and its own section; everything else comes from the shared recipe."""

    model_config = ConfigDict(extra="forbid")

    method: str = Field(description="Recover method: lora, full, qlora, kd, opd, replace, merge or local")
    lora: dict[str, Any] = Field(default_factory=dict, description="LoRA fields of this arm")
    kd: dict[str, Any] = Field(default_factory=dict, description="kd fields of this arm")
    opd: dict[str, Any] = Field(default_factory=dict, description="opd fields of this arm")
    replace: dict[str, Any] = Field(default_factory=dict, description="replace fields of this arm")
    merge: dict[str, Any] = Field(default_factory=dict, description="merge fields of this arm")
    local: dict[str, Any] = Field(default_factory=dict, description="local fields of this arm")
    learning_rate: float | None = Field(None, gt=0, description="Peak learning rate of this arm (default: shared)")


class RecoveryStudy(PipelineRecipe):
    """prune -> evaluate -> (recover with each arm -> evaluate) -> one table and chart."""

    kind: ClassVar[str] = "recovery-study"
    recover: dict[str, Any] = Field(description="Shared recover recipe: {recipe: NAME, overrides: {...}}")
    arms: dict[str, Arm] = Field(min_length=1, description="Recovery methods by label")

    @model_validator(mode="after")
    def _arms_resolve(self) -> RecoveryStudy:
        shared = self.shared_recipe("<pruned>")
        if shared.train.max_steps is None:
            raise ValueError("recover: set train.max_steps so that every arm runs the same number of optimizer steps")
        for label in self.arms:
            if not label.replace("+", "").replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"arm label '{label}' may hold letters, digits, '+', '-' and '_' only")
            try:
                self.arm_recipe(label, "<pruned>")
            except ValidationError as exc:
                raise ValueError(validation_message(exc, f"arm '{label}'")) from None
        return self

    def shared_recipe(self, student: str) -> RecoverRecipe:
        stage = RecoverStage.model_validate(self.recover)
        return stage.resolve(student, self.model)

    def arm_recipe(self, label: str, student: str) -> RecoverRecipe:
        """The shared recipe with the arm's method and section (and learning rate) applied."""
        arm = self.arms[label]
        base = self.shared_recipe(student).model_dump(mode="json")
        layer: dict[str, Any] = {"name": f"{self.name}-{label}", "method": arm.method,
                                 **{k: v for k, v in (("lora", arm.lora), ("kd", arm.kd), ("opd", arm.opd),
                                                      ("replace", arm.replace), ("merge", arm.merge),
                                                      ("local", arm.local)) if v}}
        if arm.learning_rate is not None:
            layer["train"] = {"learning_rate": arm.learning_rate}
        seeds = sorted({*base["prompts"]["exclude_probe_seeds"], self.evaluate.probe_seed})
        layer["prompts"] = {"exclude_probe_seeds": seeds}  # never a prompt the evaluation will ask
        return RecoverRecipe.model_validate(merge_layers(base, layer))


def stage_names(study: RecoveryStudy) -> list[str]:
    arms = [s for label in study.arms for s in (f"recover-{label}", f"eval-{label}")]
    return ["prune", "eval-baseline", "eval-pruned", *arms, "report"]


def stage_output(root: Path, stage: str) -> Path:
    if stage.startswith("eval-"):
        return root / "eval" / stage.removeprefix("eval-") / SUMMARY_FILE
    if stage.startswith("recover-"):
        return root / "arms" / stage.removeprefix("recover-") / "recover_report.json"
    return {"prune": root / "pruned" / "prune_report.json", "report": root / "study.md"}[stage]


def run_study(study: RecoveryStudy, settings: RunSettings, overwrite: bool = False) -> Path:
    """Run every incomplete stage in order; return study.md."""
    from layerprune.pipeline.plan import validate_data
    from layerprune.pipeline.stages import RunPaths, claim_run_dir

    paths = RunPaths(study.run_dir())
    pending = overwrite or not stage_output(paths.root, "prune").exists()
    validate_data(study, settings, prune_pending=pending)  # type: ignore[arg-type]  # data checked before any work
    claim_run_dir(paths, study, overwrite)  # type: ignore[arg-type]  # any recipe model with a name
    stages = stage_names(study)
    for number, stage in enumerate(stages, 1):
        if stage_output(paths.root, stage).exists():
            log.info("[%d/%d] %s: complete, skipped", number, len(stages), stage)
            continue
        log.info("[%d/%d] %s ...", number, len(stages), stage)
        start = time.perf_counter()
        with errors.stage(stage, paths.root):
            run_stage(study, settings, paths, stage)
        log.info("[%d/%d] %s done in %.0f s", number, len(stages), stage, time.perf_counter() - start)
    return paths.root / "study.md"


def run_stage(study: RecoveryStudy, settings: RunSettings, paths: Any, stage: str) -> None:
    """One stage of the study: prune, an evaluation, an arm's recovery, or the report."""
    from layerprune.pipeline.stages import run_eval, run_prune

    if stage == "prune":
        run_prune(study, settings, paths)  # type: ignore[arg-type]
    elif stage.startswith("eval-"):
        role = stage.removeprefix("eval-")
        model = {"baseline": study.model, "pruned": str(paths.pruned)}.get(role, str(paths.root / "arms" / role))
        run_eval(study, settings, paths, role, model)  # type: ignore[arg-type]
    elif stage.startswith("recover-"):
        run_arm(study, settings, paths.root, stage.removeprefix("recover-"))
    else:
        from layerprune.pipeline.study_report import write_study_report

        write_study_report(study, paths.root)


def run_arm(study: RecoveryStudy, settings: RunSettings, root: Path, label: str) -> None:
    """Recover the pruned model with one arm, reusing the teacher answers earlier arms generated."""
    from layerprune.recover.runner import RecoverJob

    recipe = study.arm_recipe(label, str(root / "pruned"))
    job = RecoverJob(output=root / "arms" / label, settings=settings, overwrite=True,
                     data_dir=study.evaluate.data_dir or study.prune.data_dir)
    recover_sharing_answers(recipe, job, root / "selfgen.jsonl")


def recover_sharing_answers(recipe: RecoverRecipe, job: Any, shared: Path) -> None:
    """recover_model, starting from the teacher answers in `shared` (an earlier run's), and leaving there the most
    answers any run produced: the teacher answers each prompt once per study."""
    from layerprune.recover.runner import recover_model

    if shared.is_file() and not (job.work / "responses.jsonl").exists():
        job.work.mkdir(parents=True, exist_ok=True)
        shutil.copy2(shared, job.work / "responses.jsonl")
    recover_model(recipe, job)
    produced = job.output / "data" / "responses.jsonl"
    if produced.is_file() and _count(produced) > _count(shared):
        shutil.copy2(produced, shared)


def _count(path: Path) -> int:
    return sum(1 for _ in iter_jsonl(path)) if path.is_file() else 0


def dry_run(study: RecoveryStudy, settings: RunSettings) -> str:
    """The plan: model access, data, and each arm's recipe and memory plan; no work."""
    from layerprune.pipeline.plan import check_data, check_model, model_config
    from layerprune.recover import memory
    from layerprune.recover.runner import RecoverJob, plan_for

    shared = study.shared_recipe("<pruned>")
    lines = [f"recovery study '{study.name}' -> {study.run_dir()}",
             f"model: {check_model(study.model, settings)}",
             *[f"data: {line}" for line in check_data(study)],  # type: ignore[arg-type]
             f"budget (every arm): {shared.train.max_steps} optimizer steps of {shared.train.batch_size} x "
             f"{shared.train.grad_accum} sequences (<= {shared.train.max_length} tokens)"
             + (f", or {shared.train.max_tokens} tokens, whichever comes first" if shared.train.max_tokens else "")
             + f"; prompts "
             f"{shared.prompts.source} ({shared.prompts.samples or 'all'})"]
    config, note = model_config(study.model, settings)
    teacher_config = copy.deepcopy(config)  # the unpruned model distils into every arm that has a teacher
    for label in study.arms:
        recipe = study.arm_recipe(label, "<pruned>")
        chained = recipe.chain_name()
        lines.append(f"arm {label}: method {recipe.method}" + (f" (chain {chained})" if chained != recipe.method
                                                             else ""))
        if recipe.surgery_steps() == ["replace"] and recipe.trainer_method() is None:
            lines.append("  no training: a least-squares fit on calibration text (forward passes only)")
        elif recipe.surgery_steps() == ["merge"] and recipe.trainer_method() is None:
            lines.append("  no training: each dropped span's parameter differences added to the block before it")
        elif config is not None:
            config.num_hidden_layers = teacher_config.num_hidden_layers - study.prune.n_drop
            _, plan = plan_for(recipe, config, RecoverJob(output=study.run_dir() / "arms" / label, settings=settings),
                               cuda=True, teacher_config=teacher_config)
            lines.append("  " + memory.format_plan(plan, f"{study.model or 'embedded'} minus {study.prune.n_drop}"
                                                         " blocks").replace("\n", "\n  "))
    if note:
        lines.append(f"({note})")
    return "\n".join(lines)
