"""The recovery study as data: its recipe (RecoveryStudy), the tasks every model is scored on, its models' labels, and
its stages with their outputs. The runner (recovery.py) and the report (recovery_report.py) read it; it imports
neither."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, ValidationError, model_validator

from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import validation_message
from layerprune.evaluate.calibrated import ProbeCalibration
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import DEFAULT_SUITE
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.pipeline.studies import lr_search
from layerprune.pipeline.studies.cells import (
    CHAT_EVAL,
    Arm,
    check_plain_probes,
    derive_arm_recipe,
    replicate_label,
    suite_tasks,
)
from layerprune.pipeline.studies.comparisons import ComparisonFamily, check_recovery_comparisons
from layerprune.pipeline.studies.lr_search import check_lr_grid, lr_search_file, with_learning_rate
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


BUDGET_KEYS = ("max_steps", "batch_size", "grad_accum", "max_length", "epochs")


CONTROL = "control-"  # the k = 0 control's prefix: control-<label>[@r<r>]


CONTROL_STUDENT = "control-student"  # the original, linked file by file: a student that is not its teacher's folder


NO_CONTROL = "n/a (no cut at k = 0)"


class RecoveryStudy(PipelineRecipe):
    """prune -> evaluate -> (recover with each arm -> evaluate) -> one table and chart."""

    kind: ClassVar[str] = "recovery-study"
    recover: dict[str, Any] = Field(description="Shared recover recipe: {recipe: NAME, overrides: {...}}")
    arms: dict[str, Arm] = Field(min_length=1, description="Recovery methods by label")
    replicates: int = Field(1, ge=1, description="Runs of every arm (and control), replicate r with the run seed + r: "
                                                 "its held-out split, data order, adapter initialisation and sampling")
    controls: bool = Field(False, description="k = 0 controls: every trained arm's recipe also applied to the "
                                              "original (student and teacher the original), one run per replicate, "
                                              "evaluated on the same items (methods that need a cut have none)")
    lr_grid: dict[str, list[float]] = Field(
        default_factory=dict, description="Candidate learning rates by arm label: replicate 0's recipe trained at "
                                          "each, the lowest held-out loss chosen for every replicate and control")
    probes: ProbeCalibration | None = Field(
        None, description="The probe gate: a calibrate-probes stage scores each candidate level on the original "
                          "(calibration stream, never an evaluation item), and every model is scored on evaluate's "
                          "tasks (evaluate.only or evaluate.tasks: the fixed ones) plus the levels it keeps")
    comparisons: dict[str, ComparisonFamily] = Field(
        default_factory=dict, description="Declared comparisons by family (pipeline/studies/comparisons.py): each "
        "contrast {name, a, b, measure, kind, net_of_control} (no k: one cut) sets arm a against arm b, against the "
        "pruned model (b: pruned) or, without b, against 0, and gets its paired interval and its Holm interval over "
        "its family; a family {exploratory: true, contrasts: [...]} was declared after the results were read. None "
        "declared (or only exploratory ones): the default family, every pair of arms on every measure")

    @model_validator(mode="after")
    def _arms_resolve(self) -> RecoveryStudy:
        shared = self.shared_recipe("<pruned>")
        if shared.train.max_steps is None:
            raise ValueError("recover: set train.max_steps so that every arm runs the same number of optimizer steps")
        for label in self.arms:
            if not label.replace("+", "").replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"arm label '{label}' may hold letters, digits, '+', '-' and '_' only")
            if label.startswith(CONTROL) or label in ("baseline", "pruned"):
                raise ValueError(f"arm label '{label}' is taken (baseline, pruned and control-* name other models)")
            try:
                self.arm_recipe(label, "<pruned>")
            except ValidationError as exc:
                raise ValueError(validation_message(exc, f"arm '{label}'")) from None
        check_lr_grid(self.lr_grid, self.arms, lambda label: self.arm_recipe(label, "<pruned>"),
                      shared.train.held_out)
        self._check_probes()
        check_recovery_comparisons(self.comparisons, list(self.arms), lambda label: label in self.controlled())
        return self

    def _check_probes(self) -> None:
        check_plain_probes(self.evaluate, self.shared_recipe("<pruned>"))
        if self.probes is None:
            return
        if not self.evaluate.tasks and self.evaluate.only is None:
            raise ValueError("probes: name the fixed tasks in evaluate.only (or evaluate.tasks); the gate adds the "
                             "levels it keeps")
        if not self.evaluate.tasks:
            suite = self.evaluate.suite or DEFAULT_SUITE
            missing = [t for t in self.probes.candidates if t not in suite_tasks(suite)]
            if missing:
                raise ValueError(f"probes: suite '{suite}' has no level {', '.join(missing)} (a kept level is scored "
                                 "with the suite's settings)")


    def has_control(self, label: str) -> bool:
        """Whether the arm can run on the unpruned model (no replace, merge or local step: those need a cut)."""
        return not self.arm_recipe(label, "<pruned>").needs_cut()

    def controlled(self) -> list[str]:
        """The arms with a k = 0 control in this study."""
        return [label for label in self.arms if self.controls and self.has_control(label)]

    def shared_recipe(self, student: str) -> RecoverRecipe:
        stage = RecoverStage.model_validate(self.recover)
        return stage.resolve(student, self.model)

    def arm_recipe(self, label: str, student: str, learning_rate: float | None = None) -> RecoverRecipe:
        """The shared recipe with the arm's method and section (and learning rate) applied; `learning_rate` (the
        grid's choice) replaces the arm's, as local.learning_rate where the arm has a local step."""
        recipe = derive_arm_recipe(self.shared_recipe(student), self.arms[label], f"{self.name}-{label}",
                                   self.evaluate.probe_seed)
        return with_learning_rate(recipe, learning_rate)


def fixed_tasks(study: RecoveryStudy) -> list[str]:
    """The tasks every model is scored on whatever the gate keeps: evaluate.tasks, else evaluate.only, else the
    suite's."""
    evaluate = study.evaluate
    if evaluate.tasks:
        return list(evaluate.tasks)
    return list(evaluate.only) if evaluate.only is not None else suite_tasks(evaluate.suite or DEFAULT_SUITE)


def _with_tasks(study: RecoveryStudy, tasks: list[str], **update: Any) -> EvalSettings:
    """evaluate's settings scoring `tasks` (as its tasks, or as the suite's `only`)."""
    return study.evaluate.model_copy(update={"tasks" if study.evaluate.tasks else "only": tasks, **update})


def eval_settings(study: RecoveryStudy, root: Path) -> EvalSettings:
    """What every model is scored on: evaluate's settings, plus the levels the gate kept where it ran."""
    if study.probes is None:
        return study.evaluate
    from layerprune.evaluate.calibrated import kept_tasks

    path = calibration_file(root)
    if not path.is_file():
        raise LayerpruneError(f"the study has a probe gate but no {path}: run its calibrate-probes stage first")
    return _with_tasks(study, list(dict.fromkeys([*fixed_tasks(study), *kept_tasks(path)])))


def calibration_file(root: Path) -> Path:
    from layerprune.pipeline.studies.cells import CALIBRATION_FILE

    return root / CALIBRATION_FILE


def scored_probes(study: RecoveryStudy, root: Path) -> list[str]:
    """The probe tasks every model is scored on (the fixed ones and the kept levels)."""
    from layerprune.tasks.probes import probe_tasks

    settings = eval_settings(study, root)
    return [t for t in (settings.tasks or settings.only or fixed_tasks(study)) if t in probe_tasks()]


def both_formats(study: RecoveryStudy) -> bool:
    """Whether the probes are scored in both formats: the recovery data is chat-formatted (generate.chat_template)
    and probes are scored (a fixed probe task, or a gate)."""
    from layerprune.tasks.probes import probe_tasks

    chat = study.shared_recipe("<pruned>").generate.chat_template
    return chat and (study.probes is not None or any(t in probe_tasks() for t in fixed_tasks(study)))


def chat_eval_settings(study: RecoveryStudy, root: Path) -> EvalSettings | None:
    """The probe tasks alone with probe_format chat, the same items (None: no probe task is scored)."""
    probes = scored_probes(study, root)
    return _with_tasks(study, probes, probe_format="chat") if probes else None


def physical_labels(study: RecoveryStudy, label: str) -> list[str]:
    """Every replicate's label of one arm (or of one control, given control-<label>)."""
    return [replicate_label(label, r) for r in range(study.replicates)]


def stage_names(study: RecoveryStudy) -> list[str]:
    """The gate (with `probes`), prune, the two reference evaluations, per arm its lr search, its replicates'
    recoveries and evaluations, the controls and theirs, the report; every evaluation followed by its chat-format
    probe evaluation where the probes are scored in both formats."""
    chat = both_formats(study)

    def evals(name: str) -> list[str]:
        return [f"eval-{name}", *([CHAT_EVAL + name] if chat else [])]

    arms = []
    for label in study.arms:
        arms += [f"lr-{label}"] if label in study.lr_grid else []
        arms += [s for name in physical_labels(study, label) for s in (f"recover-{name}", *evals(name))]
    controls = [s for label in study.controlled() for name in physical_labels(study, CONTROL + label)
                for s in (name, *evals(name))]
    gate = ["calibrate-probes"] if study.probes is not None else []
    return [*gate, "prune", *evals("baseline"), *evals("pruned"), *arms, *controls, "report"]


def stage_output(root: Path, stage: str) -> Path:
    if stage == "calibrate-probes":
        return calibration_file(root)
    if stage.startswith(CHAT_EVAL):
        return root / stage / SUMMARY_FILE
    if stage.startswith("eval-"):
        return root / "eval" / stage.removeprefix("eval-") / SUMMARY_FILE
    if stage.startswith("recover-"):
        return root / "arms" / stage.removeprefix("recover-") / "recover_report.json"
    if stage.startswith(CONTROL):
        return root / "controls" / stage.removeprefix(CONTROL) / "recover_report.json"
    if stage.startswith("lr-"):
        return lr_search_file(root, stage.removeprefix("lr-"))
    return {"prune": root / "pruned" / "prune_report.json", "report": root / "study.md"}[stage]


def model_of(study: RecoveryStudy, root: Path, role: str) -> str | None:
    """The model an evaluation scores: the original, the pruned model, an arm's or a control's run."""
    if role in ("baseline", "pruned"):
        return study.model if role == "baseline" else str(root / "pruned")
    return str(root / "controls" / role.removeprefix(CONTROL) if role.startswith(CONTROL) else root / "arms" / role)


def chosen_lr(study: RecoveryStudy, root: Path, label: str) -> float | None:
    """The learning rate the arm's grid chose (None: the arm has no grid)."""
    return lr_search.chosen(root, label, study.lr_grid)
