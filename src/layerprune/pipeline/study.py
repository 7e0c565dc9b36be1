"""The recovery study: prune once, recover the same pruned model with several methods at one budget, compare.

Every arm shares the recover recipe's prompts, generation settings and optimisation budget (train section: the same
optimizer steps, batch size and grad_accum); an arm may change only the method and that method's own section. The
teacher answers the prompts once; later arms reuse the answers. Each arm is evaluated on the same tasks, and
study.md holds one table (study_report.py) and a chart. Stages are skipped when their output is complete.

Replicates: replicate r of an arm runs with the run seed + r (held-out split, data order, adapter initialisation,
the trainer's and the teacher's sampling); replicate 0 keeps the run seed and the folders arms/<label>/ and
eval/<label>/, replicate r > 0 writes arms/<label>@r<r>/ and eval/<label>@r<r>/. Greedy teacher answers (temperature
0) are shared by every replicate; sampled ones are drawn once per replicate (selfgen@r<r>.jsonl). k = 0 controls
(`controls`): each trained arm's recipe applied to the original itself (student and teacher the original), one run
per replicate, in controls/<label>[@r<r>]/ and eval/control-<label>[@r<r>]/; methods that need a cut (replace, merge,
local) have none. A learning-rate grid (`lr_grid`) trains replicate 0's recipe at each candidate first and keeps the
lowest held-out loss (lr_search/<label>.json) for every replicate and the control.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune import errors
from layerprune.data import iter_jsonl
from layerprune.errors import LayerpruneError
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.recipe_loading import merge_layers, validation_message
from layerprune.recover.schema import RecoverRecipe
from layerprune.settings import RunSettings

log = logging.getLogger(__name__)
BUDGET_KEYS = ("max_steps", "batch_size", "grad_accum", "max_length", "epochs")
CONTROL = "control-"  # the k = 0 control's prefix: control-<label>[@r<r>]
CONTROL_STUDENT = "control-student"  # the original, linked file by file: a student that is not its teacher's folder
NO_CONTROL = "n/a (no cut at k = 0)"


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
    replicates: int = Field(1, ge=1, description="Runs of every arm (and control), replicate r with the run seed + r: "
                                                 "its held-out split, data order, adapter initialisation and sampling")
    controls: bool = Field(False, description="k = 0 controls: every trained arm's recipe also applied to the "
                                              "original (student and teacher the original), one run per replicate, "
                                              "evaluated on the same items (methods that need a cut have none)")
    lr_grid: dict[str, list[float]] = Field(
        default_factory=dict, description="Candidate learning rates by arm label: replicate 0's recipe trained at "
                                          "each, the lowest held-out loss chosen for every replicate and control")

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
        self._check_lr_grid(shared)
        return self

    def _check_lr_grid(self, shared: RecoverRecipe) -> None:
        for label, rates in self.lr_grid.items():
            if label not in self.arms:
                raise ValueError(f"lr_grid: '{label}' is no arm (arms: {', '.join(self.arms)})")
            if not rates or any(rate <= 0 for rate in rates):
                raise ValueError(f"lr_grid.{label}: give one or more learning rates > 0")
            recipe = self.arm_recipe(label, "<pruned>")
            if recipe.trainer_method() is None and "local" not in recipe.surgery_steps():
                raise ValueError(f"lr_grid.{label}: arm '{label}' ({recipe.chain_name()}) trains nothing")
        if self.lr_grid and not shared.train.held_out:
            raise ValueError("lr_grid: the choice reads the held-out loss; set recover train.held_out > 0")

    def has_control(self, label: str) -> bool:
        """Whether the arm can run on the unpruned model (no replace, merge or local step: those need a cut)."""
        return not self.arm_recipe(label, "<pruned>").surgery_steps()

    def controlled(self) -> list[str]:
        """The arms with a k = 0 control in this study."""
        return [label for label in self.arms if self.controls and self.has_control(label)]

    def shared_recipe(self, student: str) -> RecoverRecipe:
        stage = RecoverStage.model_validate(self.recover)
        return stage.resolve(student, self.model)

    def arm_recipe(self, label: str, student: str, learning_rate: float | None = None) -> RecoverRecipe:
        """The shared recipe with the arm's method and section (and learning rate) applied; `learning_rate` (the
        grid's choice) replaces the arm's, as local.learning_rate where the arm has a local step."""
        if learning_rate is not None:
            recipe = self.arm_recipe(label, student)
            section = "local" if "local" in recipe.surgery_steps() else "train"
            return RecoverRecipe.model_validate(merge_layers(recipe.model_dump(mode="json"),
                                                             {section: {"learning_rate": learning_rate}}))
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


def replicate_label(label: str, replicate: int) -> str:
    """The folder and stage name of an arm's replicate: the label itself for replicate 0, else label@r<r>."""
    return label if replicate == 0 else f"{label}@r{replicate}"


def physical_labels(study: RecoveryStudy, label: str) -> list[str]:
    """Every replicate's label of one arm (or of one control, given control-<label>)."""
    return [replicate_label(label, r) for r in range(study.replicates)]


def stage_names(study: RecoveryStudy) -> list[str]:
    """prune, the two reference evaluations, per arm its lr search, its replicates' recoveries and evaluations, the
    controls and theirs, the report."""
    arms = []
    for label in study.arms:
        arms += [f"lr-{label}"] if label in study.lr_grid else []
        arms += [s for name in physical_labels(study, label) for s in (f"recover-{name}", f"eval-{name}")]
    controls = [s for label in study.controlled() for name in physical_labels(study, CONTROL + label)
                for s in (name, f"eval-{name}")]
    return ["prune", "eval-baseline", "eval-pruned", *arms, *controls, "report"]


def stage_output(root: Path, stage: str) -> Path:
    if stage.startswith("eval-"):
        return root / "eval" / stage.removeprefix("eval-") / SUMMARY_FILE
    if stage.startswith("recover-"):
        return root / "arms" / stage.removeprefix("recover-") / "recover_report.json"
    if stage.startswith(CONTROL):
        return root / "controls" / stage.removeprefix(CONTROL) / "recover_report.json"
    if stage.startswith("lr-"):
        return lr_search_file(root, stage.removeprefix("lr-"))
    return {"prune": root / "pruned" / "prune_report.json", "report": root / "study.md"}[stage]


def lr_search_file(root: Path, label: str) -> Path:
    return root / "lr_search" / f"{label}.json"


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
    """One stage of the study: prune, an evaluation, an lr search, a recovery (arm or control), or the report."""
    from layerprune.pipeline.stages import run_eval, run_prune

    if stage == "prune":
        run_prune(study, settings, paths)  # type: ignore[arg-type]
    elif stage.startswith("eval-"):
        role = stage.removeprefix("eval-")
        model = {"baseline": study.model, "pruned": str(paths.pruned)}.get(role) or str(
            paths.root / "controls" / role.removeprefix(CONTROL) if role.startswith(CONTROL)
            else paths.root / "arms" / role)
        run_eval(study, settings, paths, role, model)  # type: ignore[arg-type]
    elif stage.startswith("recover-"):
        run_arm(study, settings, paths.root, stage.removeprefix("recover-"))
    elif stage.startswith(CONTROL):
        run_control(study, settings, paths.root, stage.removeprefix(CONTROL))
    elif stage.startswith("lr-"):
        run_lr_search(study, settings, paths.root, stage.removeprefix("lr-"))
    else:
        from layerprune.pipeline.study_report import write_study_report

        write_study_report(study, paths.root)


def split_label(name: str) -> tuple[str, int]:
    """'sft@r2' -> ('sft', 2); 'sft' -> ('sft', 0)."""
    label, _, replicate = name.partition("@r")
    return label, int(replicate or 0)


def run_arm(study: RecoveryStudy, settings: RunSettings, root: Path, name: str) -> None:
    """Recover the pruned model with one replicate of an arm (at the grid's learning rate where it has one)."""
    label, replicate = split_label(name)
    recipe = study.arm_recipe(label, str(root / "pruned"), chosen_lr(study, root, label))
    recover_replicate(study, settings, recipe, root / "arms" / name, root, replicate)


def run_control(study: RecoveryStudy, settings: RunSettings, root: Path, name: str) -> None:
    """One replicate of an arm's k = 0 control: the arm's recipe (and learning rate) on the original itself."""
    label, replicate = split_label(name)
    if not study.has_control(label):
        raise LayerpruneError(f"arm '{label}' has no k = 0 control: {NO_CONTROL}")
    student = control_student(study, settings, root)
    recipe = study.arm_recipe(label, str(student), chosen_lr(study, root, label))
    recover_replicate(study, settings, recipe, root / "controls" / name, root, replicate)


def control_student(study: RecoveryStudy, settings: RunSettings, root: Path) -> Path:
    """The original model as a student: a folder of links to its files (recover refuses a student whose folder is
    its teacher's; nothing is copied)."""
    from layerprune.models import resolve_model

    target = root / CONTROL_STUDENT
    if target.is_dir():
        return target
    source = resolve_model(study.model or "embedded", settings)
    location = Path(source.location)
    if not location.is_dir():
        raise LayerpruneError(f"a k = 0 control needs the original as a model folder; {source.spec} is {location}")
    work = root / f".{CONTROL_STUDENT}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for entry in location.iterdir():
        (work / entry.name).symlink_to(entry.resolve())
    work.rename(target)
    return target


def recover_replicate(study: RecoveryStudy, settings: RunSettings, recipe: RecoverRecipe, output: Path, root: Path,
                      replicate: int) -> None:
    """One recovery run under replicate `replicate`'s seed (the run seed + replicate), sharing its teacher answers."""
    import transformers

    from layerprune.recover.runner import RecoverJob

    seeded = replicate_settings(settings, replicate)
    transformers.set_seed(seeded.seed)  # what no recover seed reaches (the adapters' initialisation) follows it too

    job = RecoverJob(output=output, settings=seeded, overwrite=True,
                     data_dir=study.evaluate.data_dir or study.prune.data_dir)
    recover_sharing_answers(recipe, job, answers_file(study, root, replicate))


def replicate_settings(settings: RunSettings, replicate: int) -> RunSettings:
    """Replicate r's run settings: the run seed + r (replicate 0: the run seed itself)."""
    return settings.model_copy(update={"seed": settings.seed + replicate})


def answers_file(study: RecoveryStudy, root: Path, replicate: int) -> Path:
    """The teacher answers a replicate shares with the other runs: greedy answers are the same for every replicate,
    sampled ones are drawn with each replicate's seed."""
    greedy = study.shared_recipe("<pruned>").generate.temperature == 0
    return root / ("selfgen.jsonl" if greedy or replicate == 0 else f"selfgen@r{replicate}.jsonl")


def chosen_lr(study: RecoveryStudy, root: Path, label: str) -> float | None:
    """The learning rate the arm's grid chose (None: the arm has no grid)."""
    if label not in study.lr_grid:
        return None
    path = lr_search_file(root, label)
    if not path.is_file():
        raise LayerpruneError(f"arm '{label}' has an lr_grid but no {path}: run its lr-{label} stage first")
    return float(json.loads(path.read_text())["chosen"])


def run_lr_search(study: RecoveryStudy, settings: RunSettings, root: Path, label: str) -> None:
    """Replicate 0's recipe at each candidate learning rate (a candidate already trained is kept); the lowest
    held-out loss (token-weighted CE on the teacher's held-out answers, never an evaluation item) is chosen, and its
    run becomes replicate 0 (arms/<label>/)."""
    rows = []
    for index, rate in enumerate(study.lr_grid[label]):
        output = root / "lr_search" / label / f"lr{index}"
        if not (output / "recover_report.json").is_file():
            recipe = study.arm_recipe(label, str(root / "pruned"), rate)
            recover_replicate(study, settings, recipe, output, root, 0)
        rows.append({"learning_rate": rate, "held_out_loss": held_out_loss(output),
                     "folder": str(output.relative_to(root))})
    measured = [r for r in rows if r["held_out_loss"] is not None]
    if not measured:
        raise LayerpruneError(f"lr search of '{label}': no candidate reported a held-out loss")
    best = min(measured, key=lambda r: r["held_out_loss"])
    arm = root / "arms" / label
    if not arm.exists():  # the chosen candidate is replicate 0's run (same recipe, seed and answers): kept, not redone
        arm.parent.mkdir(parents=True, exist_ok=True)
        (root / best["folder"]).rename(arm)
        best["folder"] = str(arm.relative_to(root))
    path = lr_search_file(root, label)
    record = {"arm": label, "chosen": best["learning_rate"], "criterion": "held-out CE after training (lowest)",
              "candidates": rows}
    path.with_suffix(".tmp").write_text(json.dumps(record, indent=1))
    path.with_suffix(".tmp").rename(path)


def held_out_loss(output: Path) -> float | None:
    """The held-out loss after training in a recover_report.json: the token-weighted CE every method reports, else
    the trainer's evaluation loss."""
    report = json.loads((output / "recover_report.json").read_text())
    after = ((report.get("held_out_metrics") or {}).get("after") or {}).get("ce")
    return after if after is not None else (report.get("held_out_loss") or {}).get("after")


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
    return "\n".join([*lines, *plan_lines(study)])


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
