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
from pathlib import Path
from typing import TYPE_CHECKING

from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.studies import lr_search
from layerprune.pipeline.studies.cells import (
    CHAT_EVAL,
    check_chat_template,
    data_dir_of,
    recover_replicate,
    split_label,
)
from layerprune.pipeline.studies.recovery_grid import (
    CONTROL,
    CONTROL_STUDENT,
    NO_CONTROL,
    RecoveryStudy,
    both_formats,
    chat_eval_settings,
    chosen_lr,
    eval_settings,
    fixed_tasks,
    model_of,
    stage_names,
    stage_output,
)
from layerprune.recover.job import leftover_of

if TYPE_CHECKING:
    from layerprune.pipeline.stages import RunPaths

log = logging.getLogger(__name__)


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


def run_stage(study: RecoveryStudy, settings: RunSettings, paths: RunPaths, stage: str) -> None:
    """One stage of the study: the gate, prune, an evaluation (plain, or the probes in chat format), an lr search, a
    recovery (arm or control), or the report."""
    from layerprune.pipeline.stages import run_eval, run_prune

    if stage == "calibrate-probes":
        from layerprune.pipeline.studies.cells import calibrate

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
