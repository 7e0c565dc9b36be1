"""The recovery study: prune once, recover the same pruned model with several methods at one budget, compare.

Every arm shares the recover recipe's prompts, generation settings and optimisation budget (train section: the same
optimizer steps, batch size and grad_accum); an arm may change only the method and that method's own section. The
teacher answers the prompts once; later arms reuse the answers. Each arm is evaluated on the same tasks, and
study.md holds one table (recovery_report.py) and a chart. Stages are skipped when their output is complete.

Replicates: replicate r of an arm runs with the run seed + r (held-out split, data order, adapter initialisation,
the trainer's and the teacher's sampling); replicate 0 keeps the run seed and the folders arms/<label>/ and
eval/<label>/, replicate r > 0 writes arms/<label>@r<r>/ and eval/<label>@r<r>/. Greedy teacher answers (temperature
0) are shared by every replicate; sampled ones are drawn once per replicate (selfgen@r<r>.jsonl). k = 0 controls
(`controls`): each trained arm's recipe applied to the original itself (student and teacher the original), one run
per replicate, in controls/<label>[@r<r>]/ and eval/control-<label>[@r<r>]/; methods that need a cut (replace, merge,
local) have none. A learning-rate grid (`lr_grid`) trains replicate 0's recipe at each candidate first and keeps the
lowest held-out loss (lr_search/<label>.json) for every replicate and the control.

The probe gate (`probes`): a calibrate-probes stage scores every candidate level on the original, on the calibration
stream (never an evaluation item; the sweep's stage, probes_calibrated.json), and every model is scored on evaluate's
own tasks (the fixed ones: classification, a retrieval control such as copy_l7) plus the levels it keeps. Probes in
both formats: where the recovery data is chat-formatted (the recover recipe's generate.chat_template) and probes are
scored, every model's probe tasks are also scored with probe_format chat on the same items (stage and folder
eval-chat/<label>), and study.md gives the probe figures in both formats.
"""

from __future__ import annotations

import copy
import functools
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import merge_layers, validation_message
from layerprune.core.settings import RunSettings
from layerprune.evaluate.calibrated import ProbeCalibration
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.suites import DEFAULT_SUITE
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.studies import lr_search
from layerprune.pipeline.studies.lr_search import check_lr_grid, lr_search_file, with_learning_rate
from layerprune.recover.job import leftover_of
from layerprune.recover.schema import RecoverRecipe
from layerprune.tasks.data import iter_jsonl

if TYPE_CHECKING:
    from layerprune.pipeline.stages import RunPaths
    from layerprune.pipeline.studies.grain import GrainStudy
    from layerprune.pipeline.studies.sweep import SweepStudy

log = logging.getLogger(__name__)
BUDGET_KEYS = ("max_steps", "batch_size", "grad_accum", "max_length", "epochs")
CONTROL = "control-"  # the k = 0 control's prefix: control-<label>[@r<r>]
CONTROL_STUDENT = "control-student"  # the original, linked file by file: a student that is not its teacher's folder
NO_CONTROL = "n/a (no cut at k = 0)"
CHAT_EVAL = "eval-chat/"  # the chat-format probe evaluation: stage eval-chat/<label>, folder eval-chat/<label>/


class Arm(BaseModel):
    """One recovery method: the method and its own section; everything else comes from the shared recipe. Besides
    `lora`, an arm may set the fields of any registered method's recipe section under its name (kd, opd, replace,
    merge, local...); any other key is an error."""

    model_config = ConfigDict(extra="allow")

    method: str = Field(description="Recover method: lora, full, qlora, kd, opd, replace, merge or local")
    lora: dict[str, Any] = Field(default_factory=dict, description="LoRA fields of this arm")
    learning_rate: float | None = Field(None, gt=0, description="Peak learning rate of this arm (default: shared)")

    @model_validator(mode="after")
    def _method_sections(self) -> Arm:
        from layerprune.recover.methods import METHODS

        known = sorted(METHODS.get(name).section for name in METHODS if METHODS.get(name).section)
        for key, value in (self.model_extra or {}).items():
            if key not in known:
                raise ValueError(f"arm key '{key}' is neither an arm field nor a method's section ({', '.join(known)})")
            if not isinstance(value, dict):
                raise ValueError(f"arm section '{key}' must be a mapping of that section's fields")
        self.__pydantic_extra__ = {key: value for key, value in (self.model_extra or {}).items() if value}
        return self  # an empty section is the default: it changes no fingerprint

    def sections(self) -> dict[str, dict[str, Any]]:
        """The recipe sections this arm sets (lora and its methods' own), by section name."""
        return {"lora": self.lora, **(self.model_extra or {})}


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


def check_plain_probes(evaluate: EvalSettings, shared: RecoverRecipe) -> None:
    """A study or sweep whose recovery data is chat-formatted scores its probes in both formats itself: a recipe
    asking for chat-format probes is refused."""
    if evaluate.probe_format == "chat" and shared.generate.chat_template:
        raise ValueError("evaluate.probe_format: leave it plain; with chat-formatted recovery data "
                         "(generate.chat_template) the probes are scored in chat format too")


def derive_arm_recipe(shared: RecoverRecipe, arm: Arm, name: str, probe_seed: int) -> RecoverRecipe:
    """The shared recover recipe with an arm's method, its own section and learning rate, named `name`, and never a
    prompt of the evaluation's probe seed (a recovery study's arms and a sweep's alike)."""
    base = shared.model_dump(mode="json")
    layer: dict[str, Any] = {"name": name, "method": arm.method,
                             **{k: v for k, v in arm.sections().items() if v}}
    if arm.learning_rate is not None:
        layer["train"] = {"learning_rate": arm.learning_rate}
    seeds = sorted({*base["prompts"]["exclude_probe_seeds"], probe_seed})
    layer["prompts"] = {"exclude_probe_seeds": seeds}  # never a prompt the evaluation will ask
    return RecoverRecipe.model_validate(merge_layers(base, layer))


def suite_tasks(suite: str) -> list[str]:
    """The leaf tasks of a suite."""
    from layerprune.evaluate.suites import expand

    return [name for name, _ in expand(suite)]


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
    from layerprune.pipeline.studies.sweep import CALIBRATION_FILE

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


def replicate_label(label: str, replicate: int) -> str:
    """The folder and stage name of an arm's replicate: the label itself for replicate 0, else label@r<r>."""
    return label if replicate == 0 else f"{label}@r{replicate}"


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


def run_study(study: RecoveryStudy, settings: RunSettings, overwrite: bool = False) -> Path:
    """Run every incomplete stage in order; return study.md."""
    from layerprune.pipeline.plan import validate_data
    from layerprune.pipeline.stages import RunPaths, claim_run_dir

    paths = RunPaths(study.run_dir())
    pending = overwrite or not stage_output(paths.root, "prune").exists()
    validate_data(study, settings, prune_pending=pending)  # data checked before any work
    if both_formats(study):
        check_chat_template(study.model, settings)
    claim_run_dir(paths, study, overwrite)
    run_stages(study_stages(study, settings, paths), paths.root)
    return paths.root / "study.md"


def study_stages(study: RecoveryStudy, settings: RunSettings, paths: RunPaths) -> list[Stage]:
    """stage_names as stages, each complete when its stage_output exists; the report is redrawn after any work."""
    return [Stage(name, stage_output(paths.root, name), functools.partial(run_stage, study, settings, paths, name),
                  refresh=name == "report", leftover=leftover_of(stage_output(paths.root, name)))
            for name in stage_names(study)]



def check_chat_template(model: str | None, settings: RunSettings) -> str:
    """'chat template: present' where the original's tokenizer has one; an error where it has none (the probes are
    scored in chat format too, and probe_format chat refuses such a model); a note where it cannot be read here."""
    from layerprune.models import resolve_model
    from layerprune.models.loading import load_tokenizer

    source = resolve_model(model or "embedded", settings)
    try:
        tokenizer = load_tokenizer(source, settings)
    except LayerpruneError as exc:
        if source.is_local:
            raise
        return f"chat template: not checked from here ({str(exc)[:80]})"
    if not getattr(tokenizer, "chat_template", None):
        raise LayerpruneError(f"{source.spec} has no chat template: the recovery data is chat-formatted "
                              "(generate.chat_template), so the probes are scored with probe_format chat too, "
                              "which needs one; set generate.chat_template: false or use a model with a template")
    return "chat template: present"


def model_of(study: RecoveryStudy, root: Path, role: str) -> str | None:
    """The model an evaluation scores: the original, the pruned model, an arm's or a control's run."""
    if role in ("baseline", "pruned"):
        return study.model if role == "baseline" else str(root / "pruned")
    return str(root / "controls" / role.removeprefix(CONTROL) if role.startswith(CONTROL) else root / "arms" / role)


def run_stage(study: RecoveryStudy, settings: RunSettings, paths: RunPaths, stage: str) -> None:
    """One stage of the study: the gate, prune, an evaluation (plain, or the probes in chat format), an lr search, a
    recovery (arm or control), or the report."""
    from layerprune.pipeline.stages import run_eval, run_prune

    if stage == "calibrate-probes":
        from layerprune.pipeline.studies.sweep import calibrate

        assert study.probes is not None
        calibrate(study.model, study.probes, settings, paths.root)  # the sweep's gate
    elif stage == "prune":
        run_prune(study, settings, paths)
    elif stage.startswith(CHAT_EVAL):
        run_chat_eval(study, settings, paths.root, stage.removeprefix(CHAT_EVAL))
    elif stage.startswith("eval-"):
        role = stage.removeprefix("eval-")
        gated = study.model_copy(update={"evaluate": eval_settings(study, paths.root)})
        run_eval(gated, settings, paths, role, model_of(study, paths.root, role))
    elif stage.startswith("recover-"):
        run_arm(study, settings, paths.root, stage.removeprefix("recover-"))
    elif stage.startswith(CONTROL):
        run_control(study, settings, paths.root, stage.removeprefix(CONTROL))
    elif stage.startswith("lr-"):
        run_lr_search(study, settings, paths.root, stage.removeprefix("lr-"))
    else:
        from layerprune.pipeline.studies.recovery_report import write_study_report

        write_study_report(study, paths.root)


def run_chat_eval(study: RecoveryStudy, settings: RunSettings, root: Path, role: str) -> None:
    """The probe tasks of one model scored with probe_format chat, the same items, in eval-chat/<role>/ (nothing
    where no probe task is scored)."""
    from layerprune.evaluate.runner import evaluate_model

    chat = chat_eval_settings(study, root)
    if chat is None:
        log.info("  %s%s: no probe task is scored; nothing to score in chat format", CHAT_EVAL, role)
        return
    evaluate_model(model_of(study, root, role), chat, settings, root / CHAT_EVAL / role, overwrite=True,
                   progress=lambda message: log.info("  %s%s: %s", CHAT_EVAL, role, message),
                   calibration_from=root / "pruned")


def split_label(name: str) -> tuple[str, int]:
    """'sft@r2' -> ('sft', 2); 'sft' -> ('sft', 0)."""
    label, _, replicate = name.partition("@r")
    return label, int(replicate or 0)


def run_arm(study: RecoveryStudy, settings: RunSettings, root: Path, name: str) -> None:
    """Recover the pruned model with one replicate of an arm (at the grid's learning rate where it has one)."""
    label, replicate = split_label(name)
    recipe = study.arm_recipe(label, str(root / "pruned"), chosen_lr(study, root, label))
    recover_replicate(recipe, root / "arms" / name, root, settings, replicate, data_dir_of(study))


def run_control(study: RecoveryStudy, settings: RunSettings, root: Path, name: str) -> None:
    """One replicate of an arm's k = 0 control: the arm's recipe (and learning rate) on the original itself."""
    label, replicate = split_label(name)
    if not study.has_control(label):
        raise LayerpruneError(f"arm '{label}' has no k = 0 control: {NO_CONTROL}")
    student = control_student(study, settings, root)
    recipe = study.arm_recipe(label, str(student), chosen_lr(study, root, label))
    recover_replicate(recipe, root / "controls" / name, root, settings, replicate, data_dir_of(study))


def control_student(study: RecoveryStudy, settings: RunSettings, root: Path) -> Path:
    """The original model as a student: its files linked into root/control-student (pipeline/student.py)."""
    from layerprune.pipeline.student import original_as_student

    return original_as_student(study.model, settings, root / CONTROL_STUDENT)


def recover_replicate(recipe: RecoverRecipe, output: Path, root: Path, settings: RunSettings, replicate: int,
                      data_dir: Path | None) -> None:
    """One recovery into `output` under replicate `replicate`'s seed (the run seed + replicate), sharing the teacher
    answers kept in `root` (a recovery study's arms and controls, a sweep's points, a grain study's cells and
    controls, and the lr searches). A run stopped part-way resumes from its last checkpoint (under its own seed); an
    output left without a complete stage is replaced."""
    from layerprune.recover.job import RecoverJob

    job = RecoverJob(output=output, settings=replicate_settings(settings, replicate), overwrite=True, resume=True,
                     data_dir=data_dir)
    recover_sharing_answers(recipe, job, root / teacher_answers(recipe, replicate))


def data_dir_of(study: RecoveryStudy | SweepStudy | GrainStudy) -> Path | None:
    """Where a study's recoveries read their prompts: the evaluation's data folder, else the prune's."""
    return study.evaluate.data_dir or study.prune.data_dir


def replicate_settings(settings: RunSettings, replicate: int) -> RunSettings:
    """Replicate r's run settings: the run seed + r (replicate 0: the run seed itself)."""
    return settings.model_copy(update={"seed": settings.seed + replicate})


def teacher_answers(recipe: RecoverRecipe, replicate: int) -> str:
    """The teacher-answer file a replicate shares with the other runs of a study or sweep: greedy answers
    (temperature 0) are the same for every replicate (one file), sampled ones are drawn with each replicate's seed."""
    return replicate_label("selfgen", replicate if recipe.generate.temperature > 0 else 0) + ".jsonl"


def chosen_lr(study: RecoveryStudy, root: Path, label: str) -> float | None:
    """The learning rate the arm's grid chose (None: the arm has no grid)."""
    return lr_search.chosen(root, label, study.lr_grid)


def run_lr_search(study: RecoveryStudy, settings: RunSettings, root: Path, label: str) -> None:
    """lr_search.search over the arm's grid on the pruned model; the chosen run becomes replicate 0 (arms/<label>/:
    the same recipe, seed and answers, kept, not redone)."""
    def train(rate: float, output: Path) -> None:
        recover_replicate(study.arm_recipe(label, str(root / "pruned"), rate), output, root, settings, 0,
                          data_dir_of(study))

    record = lr_search.search(root, label, study.lr_grid[label], train)
    lr_search.write_search(root, record)  # the choice first: a run stopped after the move below keeps it
    arm = root / "arms" / label
    if not arm.exists():
        arm.parent.mkdir(parents=True, exist_ok=True)
        (root / record["chosen_folder"]).rename(arm)
        for row in record["candidates"]:
            row["folder"] = str(arm.relative_to(root)) if row["folder"] == record["chosen_folder"] else row["folder"]
        record["chosen_folder"] = str(arm.relative_to(root))
        lr_search.write_search(root, record)


def recover_sharing_answers(recipe: RecoverRecipe, job: Any, shared: Path) -> None:
    """recover_model, starting from the teacher answers in `shared` (an earlier run's), and leaving there the most
    answers any run produced: the teacher answers each prompt once per study. The process's random state is seeded
    with the job's seed first: what no recover seed reaches (TRL builds the LoRA adapters, and so draws their
    initialisation, before the trainer seeds itself) follows the replicate's seed too."""
    import transformers

    from layerprune.recover.runner import recover_model

    transformers.set_seed(job.settings.seed)
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
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.methods import plan_for

    shared = study.shared_recipe("<pruned>")
    lines = [f"recovery study '{study.name}' -> {study.run_dir()}",
             f"model: {check_model(study.model, settings)}",
             *[f"data: {line}" for line in check_data(study)],
             f"budget (every arm): {shared.train.max_steps} optimizer steps of {shared.train.batch_size} x "
             f"{shared.train.grad_accum} sequences (<= {shared.train.max_length} tokens)"
             + (f", or {shared.train.max_tokens} target (answer) tokens, whichever comes first"
                if shared.train.max_tokens else "")
             + f"; prompts "
             f"{shared.prompts.source} ({shared.prompts.samples or 'all'})"]
    config, note = model_config(study.model, settings)
    teacher_config = copy.deepcopy(config)  # the unpruned model distils into every arm that has a teacher
    for label in study.arms:
        recipe = study.arm_recipe(label, "<pruned>")
        chained = recipe.chain_name()
        lines.append(f"arm {label}: method {recipe.method}" + (f" (chain {chained})" if chained != recipe.method
                                                             else ""))
        untrained = recipe.chain_methods()[0].untrained if recipe.lr_section() is None else None
        if untrained is not None:
            lines.append(f"  no training: {untrained(recipe)}")
        elif config is not None:
            config.num_hidden_layers = teacher_config.num_hidden_layers - study.prune.n_drop
            _, plan = plan_for(recipe, config, RecoverJob(output=study.run_dir() / "arms" / label, settings=settings),
                               cuda=True, teacher_config=teacher_config)
            lines.append("  " + memory.format_plan(plan, f"{study.model or 'embedded'} minus {study.prune.n_drop}"
                                                         " blocks").replace("\n", "\n  "))
    if note:
        lines.append(f"({note})")
    return "\n".join([*lines, *probe_lines(study, settings), *plan_lines(study)])


def probe_lines(study: RecoveryStudy, settings: RunSettings) -> list[str]:
    """The gate (candidates, band, per family) and the probe formats (both where the recovery data is
    chat-formatted: the model's chat template checked here)."""
    from layerprune.tasks.probes import family_of, probe_tasks

    fixed = fixed_tasks(study)
    lines = []
    if study.probes is not None:
        gate = study.probes
        families = sorted({family_of(task) for task in gate.candidates})
        lines.append(f"probe gate (calibrate-probes, on the original): {len(gate.candidates)} candidate levels x "
                     f"{gate.items} calibration-stream items; keep {100 * gate.low:.0f}-{100 * gate.high:.0f}%, at "
                     f"most {gate.per_family} per family ({', '.join(families)}); every model scored on "
                     f"{', '.join(fixed)} plus the kept levels")
    probes = [t for t in fixed if t in probe_tasks()] + (["the kept levels"] if study.probes is not None else [])
    if not both_formats(study):
        why = "the recovery data is plain text (generate.chat_template: false)" if probes else "no probe task"
        return [*lines, f"probe format: {study.evaluate.probe_format} only ({why})"]
    return [*lines, f"probe formats: plain and chat (the recovery data is chat-formatted, generate.chat_template): "
                    f"{', '.join(probes)} scored both ways on the same items, eval-chat/<model>; "
                    + check_chat_template(study.model, settings)]


def plan_lines(study: RecoveryStudy) -> list[str]:
    """Replicates, controls, learning-rate grids and every stage, in the order they run."""
    no_control = [label for label in study.arms if not study.has_control(label)]
    stages = stage_names(study)
    return [f"replicates: {study.replicates} per arm (replicate r runs with the run seed + r)"
            + ("; one run: the run-to-run variance is not measured" if study.replicates == 1 else ""),
            "controls (k = 0, the recipe on the original): "
            + (", ".join(study.controlled()) or "none") + (f"; {NO_CONTROL}: {', '.join(no_control)}"
                                                           if study.controls and no_control else "")
            + ("" if study.controls else " (controls: false)"),
            *[f"lr search {label}: {', '.join(f'{rate:g}' for rate in rates)} (replicate 0's recipe, lowest held-out "
              "loss)" for label, rates in study.lr_grid.items()],
            f"stages ({len(stages)}): {', '.join(stages)}"]
