"""The pruning-ratio sweep: one scoring pass, the same ranking cut at each k, each pruned model recovered the same way.

Stages (each skipped when its output is complete, so an interrupted sweep resumes stage by stage):
calibrate-probes (which probe levels the original can do, on the calibration stream), score (one ablation pass over
every block: the ranking), gate-gsm8k (GSM8K is scored only where the original reaches the gate), eval-baseline,
with `controls` the k = 0 control (recover-k0, eval-recovered-k0: the same recovery of the unpruned original), then
per k: prune-k (the k lowest-ranked blocks, cut from the files), eval-pruned-k, recover-k (SFT on the original
model's own answers to generic instructions, generated once and shared by every k), eval-recovered-k; each recovery
once per replicate (replicate r > 0: recover-kK@rR with seed settings.seed + r); and the report (sweep_report.py:
paired intervals over the same items for every model, across-run spread over the replicates).

With `arms` (recovery methods by label, as a recovery study's: each arm's recipe is the shared `recover` recipe with
the arm's method and section, pipeline/studies/recovery.py), every k (and the control, for the arms that can have
one) is recovered by every arm: model ARM-kK (replicate r > 0: ARM-kK@rR), its folder and eval folder of that name,
stages recover-ARM-kK and eval-ARM-kK. The teacher answers are shared by every arm and k, as by every k without arms.
A finished sweep given another arm (its other arms unchanged) resumes: only the new arm's stages run.
An arm with a learning-rate grid (`lr_grid`, pipeline/studies/lr_search.py) gets a stage lr-ARM after eval-baseline:
its recipe trained at each rate on the model pruned at k = `lr_at` (default the middle ratio) under seed settings.seed
+ 1000 (no scored replicate's), the lowest held-out loss chosen for every k, replicate and control of the arm; the
search runs are not scored.
"""

from __future__ import annotations

import functools
import json
import re
import logging
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import validation_message
from layerprune.core.reports import read_report, write_report
from layerprune.core.settings import RunSettings
from layerprune.evaluate.calibrated import ProbeCalibration
from layerprune.evaluate.schema import EvalSettings
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.stages import RunPaths, RunState, claim_run_dir, owns, recipe_fingerprint
from layerprune.pipeline.studies import lr_search
from layerprune.pipeline.studies.comparisons import ComparisonFamily, check_comparisons
from layerprune.pipeline.studies.lr_search import check_lr_grid, lr_search_file, with_learning_rate
from layerprune.pipeline.studies.recovery import (
    CHAT_EVAL,
    Arm,
    check_chat_template,
    check_plain_probes,
    data_dir_of,
    derive_arm_recipe,
    replicate_label,
    split_label,
)
from layerprune.recover.job import leftover_of
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)
GSM8K = "gsm8k"
CALIBRATION_FILE = "probes_calibrated.json"
TAKEN = ("baseline", "pruned", "recovered", "original")  # arm labels that would name the sweep's other models
CONSTANT = ("constant_with_warmup", "constant")  # schedules whose checkpoint is the model a shorter run would be
SEARCH_REPLICATE = 1000  # the learning-rate search's seed offset: settings.seed + 1000, no scored replicate's


class Gsm8kGate(BaseModel):
    """GSM8K is scored only when the original reaches `min_score` on the first `limit` test items."""

    model_config = ConfigDict(extra="forbid")

    min_score: float = Field(0.15, ge=0, le=1, description="The original's GSM8K score (strict match) needed")
    limit: int = Field(20, ge=1, description="GSM8K test items the gate scores the original on")


class SweepStudy(PipelineRecipe):
    """Prune at several ratios from one ranking, recover each, evaluate all on the same items, one report."""

    kind: ClassVar[str] = "sweep-study"
    adds_stages: ClassVar[tuple[str, ...]] = ("replicates", "controls")  # more of them resume the sweep
    ratios: list[int] = Field(min_length=2, description="Blocks dropped at each point of the sweep (k)")
    recover: dict[str, Any] = Field(description="Recover recipe of every k: {recipe: NAME, overrides: {...}}")
    classification: list[str] = Field(min_length=1, description="Classification tasks of the suite to score")
    probes: ProbeCalibration = Field(default_factory=ProbeCalibration, description="probes-calibrated selection")
    gsm8k_gate: Gsm8kGate = Field(default_factory=Gsm8kGate, description="When GSM8K is scored")
    replicates: int = Field(1, ge=1, description="Recoveries per point: replicate r runs with seed settings.seed + r "
                            "(held-out split, data order, adapter init, sampled teacher answers), r = 0 as a single "
                            "run, r > 0 in recovered-kK@rR; the report gives the across-run spread")
    controls: bool = Field(False, description="The k = 0 control: the same recovery of the unpruned original "
                           "(recovered-k0, per replicate), scored on the same items (none for merge, replace, local)")
    arms: dict[str, Arm] | None = Field(None, min_length=1, description="Recovery methods by label, each applied at "
                                        "every k (model ARM-kK): the shared recover recipe with the arm's method and "
                                        "section, as a recovery study's arms; none: the recover recipe alone")
    lr_grid: dict[str, list[float]] = Field(
        default_factory=dict, description="Candidate learning rates by arm label: the arm's replicate-0 recipe trained "
        "at each on the model pruned at k = lr_at under a seed of its own (stage lr-ARM, runs in lr_search/, never "
        "scored), the lowest "
        "held-out loss chosen for every k, replicate and control of the arm")
    lr_at: int | None = Field(None, description="The k whose pruned model lr_grid is searched on (default: the "
                              "middle ratio)")
    arm_prompts: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="By arm label, the prompts section of an arm trained on other prompts than "
        "the shared recipe's (a task-aligned positive control, e.g. source: probes:arith_2d_sub, drawn on the "
        "recovery seed stream with the evaluation's items excluded): its own teacher answers (selfgen-ARM.jsonl), "
        "shared by its k, replicates and control")
    budgets: list[int] | None = Field(
        None, description="Training budgets in unpadded target tokens (recover/budget.py's unit), increasing: every "
        "recovery at k > 0 trains to the largest (train.max_tokens) and a trainer's run saves its model when its "
        "counted target tokens first reach each smaller one (model ARM-kK@<budget>[@rR], e.g. sft-k2@32k@r1, scored "
        "as every model is); local, which has no trainer, trains each budget as a run of its own; the k = 0 "
        "controls at the largest budget only, lr_grid searched at the smallest. The rate must be constant after "
        "warmup (lr_scheduler constant or constant_with_warmup), so a checkpoint is the model a run of that budget "
        "would be")
    dedicated_at: int | None = Field(
        None, description="One of budgets below the largest at which every trainer arm also trains a run of its own "
        "at k = lr_at (model ARM-kK@<budget>-dedicated[@rR], each replicate): the report pairs it with the checkpoint "
        "of that budget, which it should match within its interval")
    comparisons: dict[str, ComparisonFamily] = Field(
        default_factory=dict, description="Declared comparisons by family (pipeline/studies/comparisons.py): each "
        "contrast {name, a, at, b, b_at, measure, kind, net_of_control} gets its paired interval and its Holm interval "
        "over its family; a family {exploratory: true, contrasts: [...]} was declared after the results were read. "
        "None declared (or only exploratory ones): every pair of arms at every k, one family per measure")

    @model_validator(mode="after")
    def _one_ranking(self) -> SweepStudy:
        if sorted(set(self.ratios)) != self.ratios or self.ratios[0] < 1:
            raise ValueError(f"ratios must be distinct block counts >= 1 in increasing order, not {self.ratios}")
        if self.prune.layers is not None or self.prune.iterative:
            raise ValueError("the sweep cuts one one-shot ranking: set prune.drop and score (not layers or iterative)")
        if self.prune.drop != self.ratios[-1]:
            raise ValueError(f"prune.drop must be the largest ratio ({self.ratios[-1]}): one scoring pass ranks them")
        if self.evaluate.suite is None:
            raise ValueError("evaluate.suite: name the suite whose settings every task is scored with")
        shared = self.shared_recipe("<pruned>")
        check_plain_probes(self.evaluate, shared)
        for label in self.arms or {}:
            if not label.replace("+", "").replace("-", "").replace("_", "").isalnum() or label in TAKEN:
                raise ValueError(f"arm label '{label}': letters, digits, '+', '-' and '_' only, and none of "
                                 f"{', '.join(TAKEN)} (they name the sweep's other models)")
            try:
                self.arm_recipe(label, "<pruned>")
            except ValidationError as exc:
                raise ValueError(validation_message(exc, f"arm '{label}'")) from None
        self._check_lr_grid(shared)
        self._check_budgets()
        if set(self.arm_prompts) - set(self.arms or {}):
            raise ValueError(f"arm_prompts: {', '.join(sorted(set(self.arm_prompts) - set(self.arms or {})))} "
                             "not among the arms")
        return self

    def _check_budgets(self) -> None:
        if self.budgets is None:
            if self.dedicated_at is not None:
                raise ValueError("dedicated_at: name the budgets it is one of")
            return
        if len(self.budgets) < 2 or sorted(set(self.budgets)) != self.budgets or self.budgets[0] < 1:
            raise ValueError(f"budgets must be two or more distinct target-token counts >= 1 in increasing order, not "
                             f"{self.budgets}")
        for arm in arm_names(self):
            recipe, name = self.arm_recipe(arm, "<pruned>"), f"arm '{arm}'" if arm else "the recovery"
            if recipe.trainer_method() is None and "local" not in recipe.surgery_steps():
                raise ValueError(f"budgets: {name} trains nothing ({recipe.chain_name()}): a budget curve needs "
                                 "training")
            if recipe.train.max_tokens is not None:
                raise ValueError(f"budgets: leave train.max_tokens of {name} unset: each run trains to its budget")
            if self.dedicated_at is not None and self.dedicated_at not in self.budgets[:-1]:
                raise ValueError(f"dedicated_at: one of the budgets below the largest "
                                 f"({', '.join(map(str, self.budgets[:-1]))}), not {self.dedicated_at}")
            if recipe.trainer_method() is not None and recipe.train.lr_scheduler not in CONSTANT:
                raise ValueError(f"budgets: {name} decays its rate (train.lr_scheduler {recipe.train.lr_scheduler}); "
                                 f"a budget point is a checkpoint of one run: use {' or '.join(CONSTANT)}")

    @model_validator(mode="after")
    def _declared_comparisons(self) -> SweepStudy:
        check_comparisons(self.comparisons, list(self.arms) if self.arms else None, self.ratios,
                          lambda arm: has_control(self, arm))
        return self

    def _check_lr_grid(self, shared: RecoverRecipe) -> None:
        if self.lr_grid and self.arms is None:
            raise ValueError("lr_grid: name the recovery methods in arms (a grid is given per arm)")
        if self.lr_at is not None and (not self.lr_grid or self.lr_at not in self.ratios):
            raise ValueError(f"lr_at: one of ratios ({', '.join(map(str, self.ratios))}), with an lr_grid")
        check_lr_grid(self.lr_grid, self.arms or {}, lambda label: self.arm_recipe(label, "<pruned>"),
                      shared.train.held_out)

    @property
    def lr_k(self) -> int:
        """The k the learning-rate grid is searched at: lr_at, else the middle ratio."""
        return self.lr_at if self.lr_at is not None else self.ratios[(len(self.ratios) - 1) // 2]

    def shared_recipe(self, student: str) -> RecoverRecipe:
        return RecoverStage.model_validate(self.recover).resolve(student, self.model)

    def arm_recipe(self, arm: str | None, student: str) -> RecoverRecipe:
        """The recover recipe of one arm (None: the sweep without arms, the shared recipe itself), derived from the
        shared one exactly as a recovery study derives its arms (derive_arm_recipe)."""
        if arm is None:
            return self.shared_recipe(student)
        assert self.arms is not None
        recipe = derive_arm_recipe(self.shared_recipe(student), self.arms[arm], f"{self.name}-{arm}",
                                   self.evaluate.probe_seed)
        if arm not in self.arm_prompts:
            return recipe
        from layerprune.core.recipe_loading import merge_layers

        dumped = recipe.model_dump(mode="json")
        seeds = sorted({*dumped["prompts"]["exclude_probe_seeds"], *self.arm_prompts[arm].get(
            "exclude_probe_seeds", [])})  # the evaluation's probe seed stays excluded
        layer = {"prompts": {**self.arm_prompts[arm], "exclude_probe_seeds": seeds}}
        return RecoverRecipe.model_validate(merge_layers(dumped, layer))

    def answers_file(self, arm: str | None, recipe: RecoverRecipe, replicate: int) -> str:
        """The teacher-answer file a run shares (recovery.teacher_answers), one of its own for an arm with
        arm_prompts."""
        from layerprune.pipeline.studies.recovery import teacher_answers

        shared = teacher_answers(recipe, replicate)
        return shared.replace("selfgen", f"selfgen-{arm}", 1) if arm in self.arm_prompts else shared

    def eval_settings(self, tasks: list[str]) -> EvalSettings:
        return self.evaluate.model_copy(update={"only": tasks})


def arm_names(study: SweepStudy) -> list[str | None]:
    """The arms' labels; [None] for a sweep without arms (its one recovery)."""
    return list(study.arms) if study.arms else [None]


def recovered_label(arm: str | None, k: int) -> str:
    """The logical label of a recovered point: recovered-kK without arms, ARM-kK with (k = 0: the control)."""
    return f"recovered-k{k}" if arm is None else f"{arm}-k{k}"


def has_control(study: SweepStudy, arm: str | None = None) -> bool:
    """Whether the k = 0 control of `arm` (None: the recovery of a sweep without arms) runs: asked for, and a
    recovery that needs no cut (merge, replace, local do)."""
    return study.controls and not study.arm_recipe(arm, "<pruned>").needs_cut()


def recovered(study: SweepStudy, k: int, arm: str | None = None) -> list[str]:
    """The physical labels of every replicate of the arm's recovered point at k (k = 0: its control)."""
    return [replicate_label(recovered_label(arm, k), r) for r in range(study.replicates)]


def models(study: SweepStudy) -> list[str]:
    """The evaluated models' labels: baseline, the controls' replicates (per arm), then pruned-k and each arm's
    recovered-k (each replicate) for each k."""
    control = [m for arm in arm_names(study) if has_control(study, arm) for m in recovered(study, 0, arm)]
    return ["baseline", *control, *(m for k in study.ratios
                                    for m in (f"pruned-k{k}", *recovered_at(study, k)))]


def recovered_at(study: SweepStudy, k: int) -> list[str]:
    """Every arm's replicates at k, arm by arm (with budgets: each arm's smaller budgets' points first)."""
    return [m for arm in arm_names(study)
            for m in (*budget_points(study, k, arm), *recovered(study, k, arm), *dedicated_points(study, k, arm))]


def budget_tag(tokens: int) -> str:
    """A budget in a label: 32000 -> 32k, 32768 -> 32768."""
    return f"{tokens // 1000}k" if tokens % 1000 == 0 else str(tokens)


def budget_points(study: SweepStudy, k: int, arm: str | None = None) -> list[str]:
    """The physical labels of the arm's recovered point at k at every budget below the largest (ARM-kK@<budget>,
    replicate r > 0 ARM-kK@<budget>@rR: a replicate suffix last, so a budget point's replicates are one logical
    label), budget by budget; none without budgets or at k = 0 (the controls train to the largest budget only)."""
    if not study.budgets or k == 0:
        return []
    return [replicate_label(f"{recovered_label(arm, k)}@{budget_tag(b)}", r)
            for b in study.budgets[:-1] for r in range(study.replicates)]


DEDICATED = "-dedicated"  # the tag of a budget point trained as a run of its own beside a trainer's checkpoint


def dedicated_points(study: SweepStudy, k: int, arm: str | None = None) -> list[str]:
    """The physical labels of a trainer arm's dedicated runs at dedicated_at (k = lr_k only), replicate by
    replicate; none otherwise (local's budget points are all runs of their own)."""
    if study.dedicated_at is None or k != study.lr_k or trains_each_budget(study, arm):
        return []
    return [replicate_label(f"{recovered_label(arm, k)}@{budget_tag(study.dedicated_at)}{DEDICATED}", r)
            for r in range(study.replicates)]


def budget_of(study: SweepStudy, label: str) -> tuple[str, int | None]:
    """(the label without its budget, the budget) of a recovered point's label (kK[@B][@rR] or ARM-kK[@B][@rR]):
    without a budget tag, the largest budget (None: the sweep has no budgets)."""
    logical, replicate = split_label(label)
    bare, _, tag = logical.partition("@")
    tag = tag.removesuffix(DEDICATED)
    tags = {budget_tag(b): b for b in study.budgets or []}
    if tag and tag not in tags:
        raise LayerpruneError(f"{label}: no budget {tag} in this sweep's budgets")
    budget = tags[tag] if tag else (study.budgets[-1] if study.budgets else None)
    return replicate_label(bare, replicate), budget


def trains_each_budget(study: SweepStudy, arm: str | None) -> bool:
    """Whether the arm's budget points are runs of their own (local: no trainer to save checkpoints), not
    checkpoints of the run to the largest budget."""
    return bool(study.budgets) and study.arm_recipe(arm, "<pruned>").trainer_method() is None


def both_formats(study: SweepStudy) -> bool:
    """Whether the probe levels are scored in both formats, plain few-shot text and through the chat template: the
    recovery data is chat-formatted (generate.chat_template), as a recovery study decides."""
    return study.shared_recipe("<pruned>").generate.chat_template


def stage_names(study: SweepStudy) -> list[str]:
    chat = both_formats(study)

    def evals(label: str) -> list[str]:
        return [f"eval-{label}", *([CHAT_EVAL + label] if chat else [])]

    def recoveries(labels: list[str]) -> list[str]:
        return [s for label in labels for s in (f"recover-{label.removeprefix('recovered-')}", *evals(label))]

    def arm_at(k: int, arm: str | None) -> list[str]:  # a checkpoint is scored after the run that saves it
        points = budget_points(study, k, arm)
        if trains_each_budget(study, arm):
            return recoveries([*points, *recovered(study, k, arm)])
        return [*recoveries(recovered(study, k, arm)), *(s for m in points for s in evals(m)),
                *recoveries(dedicated_points(study, k, arm))]

    control = recoveries([m for arm in arm_names(study) if has_control(study, arm) for m in recovered(study, 0, arm)])
    per_k = [s for k in study.ratios
             for s in (f"prune-k{k}", *evals(f"pruned-k{k}"), *(s for a in arm_names(study) for s in arm_at(k, a)))]
    grid = [f"lr-{arm}" for arm in study.lr_grid]
    # replicate by replicate (a stable sort: each replicate's cuts, then its controls), so a study run in parts holds
    # whole replicates of the design after each part, not every replicate of its first cells
    cells = sorted([*per_k, *control], key=stage_replicate)
    return ["calibrate-probes", "score", "gate-gsm8k", *evals("baseline"), *grid, *cells, "report"]


def stage_replicate(stage: str) -> int:
    """The replicate a stage belongs to: R of a name ending @rR, else 0."""
    found = re.search(r"@r(\d+)$", stage)
    return int(found.group(1)) if found else 0


def stage_output(root: Path, stage: str) -> Path:
    name = stage.split("-", 1)[1] if "-" in stage else stage
    if stage.startswith("lr-"):
        return lr_search_file(root, name)
    if stage.startswith(CHAT_EVAL):
        return root / CHAT_EVAL / stage.removeprefix(CHAT_EVAL) / SUMMARY_FILE
    if stage.startswith("eval-"):
        return root / "eval" / name / SUMMARY_FILE
    if stage.startswith("prune-"):
        return root / f"pruned-{name}" / "prune_report.json"
    if stage.startswith("recover-"):  # kK[@rR] (no arms): recovered-kK[@rR]; ARM-kK[@rR]: the label itself
        return root / (name if "-" in name else f"recovered-{name}") / "recover_report.json"
    return {"calibrate-probes": root / CALIBRATION_FILE, "gate-gsm8k": root / "eval" / "gate-gsm8k" / SUMMARY_FILE,
            "score": root / "scored" / "prune_report.json", "report": root / "sweep.md"}[stage]


def evaluated_tasks(study: SweepStudy, root: Path) -> list[str]:
    """Classification tasks, the kept probe levels, and GSM8K where the original passed the gate."""
    from layerprune.evaluate.calibrated import kept_tasks
    from layerprune.evaluate.summary import read_summary

    tasks = [*study.classification, *kept_tasks(root / CALIBRATION_FILE)]
    gate = read_summary(stage_output(root, "gate-gsm8k")).headlines()[GSM8K]
    return tasks + ([GSM8K] if gate.value >= study.gsm8k_gate.min_score else [])


def ranking(root: Path, ratios: list[int]) -> dict[int, list[int]]:
    """The blocks each k drops: the k lowest of the one scoring pass (the largest k is what the pass dropped)."""
    from layerprune.prune.metrics import select_lowest
    from layerprune.prune.report import read_prune_report

    report = read_prune_report(root / "scored")
    cuts = {k: select_lowest(report.scores, k, report.method.protect) for k in ratios}
    assert cuts[ratios[-1]] == sorted(report.dropped), "the scoring pass dropped other blocks than its ranking's lowest"
    return cuts


def run_sweep(study: SweepStudy, settings: RunSettings, overwrite: bool = False) -> Path:
    """Run every incomplete stage in order; return sweep.md."""
    from layerprune.pipeline.plan import validate_data
    root = study.run_dir()
    validate_data(study, settings, prune_pending=overwrite or not stage_output(root, "score").exists())
    if both_formats(study):
        check_chat_template(study.model, settings)
    if not overwrite:
        adopt_added_arms(study, RunPaths(root))
    claim_run_dir(RunPaths(root), study, overwrite)
    run_stages(sweep_stages(study, settings, root), root)
    return stage_output(root, "report")


def adopt_added_arms(study: SweepStudy, paths: RunPaths) -> list[str]:
    """A sweep given another arm resumes where it stands: when paths' run.json records this sweep with fewer arms
    (arms_added), run.json is rewritten to this recipe (its provenance kept), so the new arms' stages run and the
    others are skipped. Return the arms added (none: run.json untouched, and claim_run_dir judges the directory as
    before)."""
    found = arms_added(study, paths)
    if found is None:
        return []
    state, added = found
    write_report(paths.state, state.model_copy(update={
        "fingerprint": recipe_fingerprint(study), "recipe": study.model_dump(mode="json")}))
    log.info("%s: arms %s added to the sweep's %s; its stages are kept", paths.root, ", ".join(added),
             ", ".join(a for a in study.arms or {} if a not in added))
    return added


def arms_added(study: SweepStudy, paths: RunPaths) -> tuple[RunState, list[str]] | None:
    """(run.json, the arms this sweep adds) when run.json records this sweep with fewer arms: each recorded arm
    unchanged and, the added arms' learning-rate grids aside, the fingerprint stored there this sweep's; else None."""
    if study.arms is None or not paths.state.is_file():
        return None
    try:
        state = read_report(paths.state, RunState)
        recorded = SweepStudy.model_validate(state.recipe)
    except (LayerpruneError, ValueError):
        return None  # claim_run_dir says what is wrong with it
    kept = recorded.arms or {}
    added = [arm for arm in study.arms if arm not in kept]
    if not kept or not added or any(study.arms.get(arm) != recipe for arm, recipe in kept.items()):
        return None
    before = study.model_copy(update={"arms": kept, "lr_grid": {a: g for a, g in study.lr_grid.items() if a in kept}})
    return (state, added) if owns(state, before) else None


def sweep_stages(study: SweepStudy, settings: RunSettings, root: Path) -> list[Stage]:
    """stage_names as stages, each complete when its stage_output exists; the report is redrawn after any work."""
    return [Stage(name, stage_output(root, name), functools.partial(run_stage, study, settings, root, name),
                  refresh=name == "report", leftover=leftover_of(stage_output(root, name)))
            for name in stage_names(study)]


def run_stage(study: SweepStudy, settings: RunSettings, root: Path, stage: str) -> None:
    kind, _, label = stage.partition("-")
    if stage.startswith(CHAT_EVAL):
        chat_eval(study, settings, root, stage.removeprefix(CHAT_EVAL))
    elif stage == "calibrate-probes":
        calibrate(study.model, study.probes, settings, root)
    elif stage == "gate-gsm8k":
        gate = study.evaluate.model_copy(update={"only": [GSM8K], "limit": study.gsm8k_gate.limit})
        evaluate(study, settings, root, "gate-gsm8k", study.model, gate)
    elif stage == "score":
        from layerprune.prune.api import prune_model

        prune_model(study.model, study.prune, settings, root / "scored", overwrite=True)
    elif kind == "prune":
        prune_at(study, settings, root, int(label.removeprefix("k")))
    elif kind == "eval":
        model = study.model if label == "baseline" else str(root / label)
        evaluate(study, settings, root, label, model, study.eval_settings(evaluated_tasks(study, root)))
    elif kind == "recover":
        recover_at(study, settings, root, label)
    elif kind == "lr":
        search_lr(study, settings, root, label)
    else:
        from layerprune.pipeline.studies.sweep_report import write_sweep_report

        write_sweep_report(study, root)
        if study.budgets:  # the budget curves beside it (pipeline/studies/budget_report.py)
            from layerprune.pipeline.studies.budget_report import write_budget_report

            write_budget_report(study, root)


def calibrate(model: str | None, probes: ProbeCalibration, settings: RunSettings, root: Path) -> None:
    """The probe gate (the sweep's stage, a recovery study's too): which candidate levels the original `model` can
    do, on the calibration stream (less what a variant `model` was trained on), in root/probes_calibrated.json."""
    from layerprune.core.outputs import write_atomic
    from layerprune.evaluate.calibrated import calibrate_probes
    from layerprune.models import load_model
    from layerprune.posttrain.api import trained_questions

    loaded = load_model(model, settings)
    trained = trained_questions(Path(loaded.source.location)) if loaded.source.is_local else frozenset()
    record = calibrate_probes(loaded.model, loaded.tokenizer, probes, lambda m: log.info("  %s", m), trained=trained)
    write_atomic(root / CALIBRATION_FILE, json.dumps(record, indent=1))


def evaluate(study: SweepStudy, settings: RunSettings, root: Path, label: str, model: str | None,
             eval_settings: EvalSettings, evals: str = "eval") -> None:
    from layerprune.evaluate.runner import evaluate_model

    evaluate_model(model, eval_settings, settings, root / evals / label, overwrite=True,
                   progress=lambda message: log.info("  %s/%s: %s", evals, label, message),
                   calibration_from=root / "scored")


def chat_eval(study: SweepStudy, settings: RunSettings, root: Path, label: str) -> None:
    """The kept probe levels of one model scored through the chat template (probe_format chat), the same items, in
    eval-chat/<label>/; nothing where the gate kept no level (the stage then runs again, as a no-op, on resume)."""
    from layerprune.evaluate.calibrated import kept_tasks

    probes = kept_tasks(root / CALIBRATION_FILE)
    if not probes:
        log.info("  %s%s: the gate kept no probe level; nothing to score in chat format", CHAT_EVAL, label)
        return
    model = study.model if label == "baseline" else str(root / label)
    chat = study.evaluate.model_copy(update={"only": probes, "probe_format": "chat"})
    evaluate(study, settings, root, label, model, chat, evals=CHAT_EVAL.rstrip("/"))


def prune_at(study: SweepStudy, settings: RunSettings, root: Path, k: int) -> None:
    """The k lowest-ranked blocks dropped from the original's files (no scoring, no model in memory)."""
    from layerprune.prune.api import prune_model
    from layerprune.prune.recipe import PruneRecipe

    fields = study.prune.model_dump(exclude={"drop", "layers"})
    recipe = PruneRecipe.model_validate({**fields, "layers": ranking(root, study.ratios)[k]})
    prune_model(study.model, recipe, settings, root / f"pruned-k{k}", overwrite=True)


def recover_at(study: SweepStudy, settings: RunSettings, root: Path, label: str) -> None:
    """Recovery of pruned-k (k0: the unpruned original) on the teacher's answers, generated for the first k (and arm)
    and shared by the others. `label` is kK[@rR], or ARM-kK[@rR] with arms (that arm's recipe). Replicate r runs with
    seed settings.seed + r; its teacher answers are replicate 0's at temperature 0 (greedy: the same), its own at a
    temperature above 0. With budgets, the run trains to `label`'s budget (ARM-kK@B: B, local's run of its own; else
    the largest) and a trainer's run at k > 0 saves its checkpoints at the smaller budgets as their points."""
    bare, tokens = budget_of(study, label)
    logical, replicate = split_label(bare)
    arm, _, point = logical.rpartition("-")
    student = original_copy(study, settings, root) if point == "k0" else root / f"pruned-{point}"
    rate = lr_search.chosen(root, arm, study.lr_grid) if arm else None
    recipe = with_budget(with_learning_rate(study.arm_recipe(arm or None, str(student)), rate), tokens)
    snapshots = {} if point == "k0" or bare != label or trains_each_budget(study, arm or None) else {
        b: stage_output(root, f"recover-{budget_label(bare, b)}").parent for b in (study.budgets or [])[:-1]}
    answers = root / study.answers_file(arm or None, recipe, replicate)
    recover_with_snapshots(recipe, stage_output(root, f"recover-{label}").parent, answers, settings, replicate,
                           data_dir_of(study), snapshots)


def budget_label(label: str, tokens: int) -> str:
    """kK[@rR] or ARM-kK[@rR] at a budget: kK@B[@rR], ARM-kK@B[@rR]."""
    logical, replicate = split_label(label)
    return replicate_label(f"{logical}@{budget_tag(tokens)}", replicate)


def with_budget(recipe: RecoverRecipe, tokens: int | None) -> RecoverRecipe:
    """The recipe trained to `tokens` target tokens (train.max_tokens; None: as it is)."""
    if tokens is None:
        return recipe
    from layerprune.core.recipe_loading import merge_layers

    return RecoverRecipe.model_validate(merge_layers(recipe.model_dump(mode="json"), {"train": {"max_tokens": tokens}}))


def recover_with_snapshots(recipe: RecoverRecipe, output: Path, answers: Path, settings: RunSettings, replicate: int,
                           data_dir: Path | None, snapshots: dict[int, Path]) -> None:
    """recovery.recover_replicate with the teacher answers shared in `answers`, its run also saving a model on
    reaching each budget of `snapshots` (budget -> folder)."""
    from layerprune.pipeline.studies import recovery
    from layerprune.recover.job import RecoverJob

    job = RecoverJob(output=output, settings=recovery.replicate_settings(settings, replicate), overwrite=True,
                     resume=True, data_dir=data_dir, snapshots=snapshots)
    recovery.recover_sharing_answers(recipe, job, answers)


def search_lr(study: SweepStudy, settings: RunSettings, root: Path, arm: str) -> None:
    """The arm's learning-rate grid searched on the model pruned at k = lr_k (cut here if its stage has not run): the
    arm's recipe at each rate in lr_search/ARM/lrI under seed settings.seed + SEARCH_REPLICATE (a held-out split,
    data order and initialisation of its own: no scored replicate is a run the choice was made on, and the search's
    runs are never scored), the lowest held-out loss chosen (lr_search/ARM.json)."""
    k = study.lr_k
    if not stage_output(root, f"prune-k{k}").is_file():
        prune_at(study, settings, root, k)
    student = str(root / f"pruned-k{k}")

    def train(rate: float, output: Path) -> None:  # with budgets: at the smallest
        recipe = with_budget(with_learning_rate(study.arm_recipe(arm, student), rate), (study.budgets or [None])[0])
        answers = root / study.answers_file(arm, recipe, SEARCH_REPLICATE)
        recover_with_snapshots(recipe, output, answers, settings, SEARCH_REPLICATE, data_dir_of(study), {})

    record = lr_search.search(root, arm, study.lr_grid[arm], train, k=k, seed_offset=SEARCH_REPLICATE)
    lr_search.write_search(root, record)


def original_copy(study: SweepStudy, settings: RunSettings, root: Path) -> Path:
    """The unpruned original as the control's student: its files linked into `root`/original (pipeline/student.py;
    the recovery refuses a student that is its own teacher)."""
    from layerprune.pipeline.student import original_as_student

    return original_as_student(study.model, settings, root / "original")


RATES = {"classification docs/s": 3.4, "probe items/s": 8.0, "trained tokens/s": 170.0, "gsm8k items/s": 0.14,
         "calibration items/s": 8.0, "teacher tokens/s": 90.0,  # measured on 2 idle cores (docs/benchmarks.md)
         "local tokens/s": 340.0}  # the local step, one block on cached states (recovery-transfer-embedded)


def dry_run(study: SweepStudy, settings: RunSettings) -> str:
    """The plan: model and data, the sweep's points, what each model is scored on, the budget and a time estimate
    from the measured CPU rates; no work."""
    from layerprune.evaluate.suites import plan_tasks
    from layerprune.pipeline.plan import check_data, check_model
    from layerprune.tasks.data import resolve_data_dir
    from layerprune.tasks.probes import family_of

    shared = study.shared_recipe("<pruned>")
    planned, _ = plan_tasks(study.evaluate.model_copy(update={"only": None}), resolve_data_dir(study.evaluate.data_dir))
    limits = {t.spec.name: t.limit for t in planned}
    cls_docs = sum(int(limits[t]) if (limits.get(t) or 0) >= 1 else 0 for t in study.classification)
    probe_limit = int(max((limits.get(t) or 0) for t in study.probes.candidates))
    families = {family_of(task) for task in study.probes.candidates}
    most_probes = len(families) * study.probes.per_family
    per_model = cls_docs / RATES["classification docs/s"] + most_probes * probe_limit / RATES["probe items/s"]
    n_models = len(models(study))
    answers = shared.prompts.samples or 256
    plans = {arm: _training(study.arm_recipe(arm, "<pruned>")) for arm in arm_names(study)}
    runs = {arm: (len(study.ratios) + has_control(study, arm)) * study.replicates
            + len(study.lr_grid.get(arm or "", [])) if not study.budgets else len(budget_runs(study, arm))
            for arm in plans}
    answer_sets = study.replicates if shared.generate.temperature > 0 else 1
    seconds = {"calibrate": len(study.probes.candidates) * study.probes.items / RATES["calibration items/s"],
               "gate": study.gsm8k_gate.limit / RATES["gsm8k items/s"],
               "teacher answers": answer_sets * answers * shared.generate.max_new_tokens / RATES["teacher tokens/s"],
               **{f"teacher answers {arm}": answer_sets * (study.arm_recipe(arm, "<pruned>").prompts.samples or 256)
                  * shared.generate.max_new_tokens / RATES["teacher tokens/s"] for arm in study.arm_prompts},
               **({"training" if arm is None else f"training {arm}": runs[arm] * trained / rate
                   for arm, (trained, _, rate) in plans.items()} if not study.budgets else
                  {"training" if arm is None else f"training {arm}": budget_seconds(study, arm)
                   for arm in plans}),
               "evaluation": n_models * per_model,
               **({"chat-format probes": n_models * most_probes * probe_limit / RATES["probe items/s"]}
                  if both_formats(study) else {})}
    lines = [f"pruning-ratio sweep '{study.name}' -> {study.run_dir()}",
             f"model: {check_model(study.model, settings)}",
             *[f"data: {line}" for line in check_data(study)],
             f"score once: {study.prune.score} ({study.prune.metric}, one-shot) on {study.prune.calib} "
             f"({study.prune.calib_samples} items); cut at k = {', '.join(map(str, study.ratios))} blocks",
             f"probes-calibrated: {len(study.probes.candidates)} candidate levels x {study.probes.items} "
             f"calibration-stream items; keep {100 * study.probes.low:.0f}-{100 * study.probes.high:.0f}%, at most "
             f"{study.probes.per_family} per family ({len(families)} families: {', '.join(sorted(families))})",
             f"gsm8k: scored only if the original reaches {100 * study.gsm8k_gate.min_score:.0f}% on "
             f"{study.gsm8k_gate.limit} items (then {_size(limits.get(GSM8K))} items per model)",
             f"models evaluated: {n_models} ({', '.join(models(study))}) on the same items each: "
             f"{', '.join(f'{t} {_size(limits.get(t))}' for t in study.classification)}; at most {most_probes} "
             f"probe levels x {probe_limit} items",
             ("probe format: plain few-shot text and, as the recovery data is chat-formatted, through the chat "
              "template too (the same items; eval-chat/<model>); " + check_chat_template(study.model, settings)
              if both_formats(study) else
              "probe format: plain few-shot text (the recovery data is plain: generate.chat_template false)"),
             *_recovery_lines(study, shared, plans, runs),
             *budget_lines(study),
             *(f"arm {arm} trains on its own prompts: {study.arm_recipe(arm, '<pruned>').prompts.samples} from "
               f"{study.arm_recipe(arm, '<pruned>').prompts.source} (evaluation probe seeds "
               f"{study.arm_recipe(arm, '<pruned>').prompts.exclude_probe_seeds} excluded, the count in its report), "
               f"answered by the teacher once (selfgen-{arm}.jsonl)" for arm in study.arm_prompts),
             _replicate_line(study, shared, answer_sets),
             f"recoveries: {sum(runs.values())}; stages: {len(stage_names(study))} ({', '.join(stage_names(study))})",
             *(line for arm in plans for line in _memory_lines(study, settings, arm)),
             *progress_lines(study, study.run_dir()),
             _estimate(study, seconds)]
    return "\n".join(lines)


def progress_lines(study: SweepStudy, root: Path) -> list[str]:
    """Where the output already holds a run: how many of the sweep's stages are complete there (a run resumes, so
    they are skipped) and which are left, or that the sweep would be refused there."""
    paths = RunPaths(root)
    if not paths.state.is_file():
        return []
    try:
        owned = owns(read_report(paths.state, RunState), study)
    except LayerpruneError:
        owned = False
    added = arms_added(study, paths)
    if not owned and added is None:
        return [f"{root} holds another recipe's run (or this sweep changed): the sweep would be refused there; "
                "--overwrite starts it over, --output chooses another folder"]
    names = [name for name in stage_names(study) if name != "report"]
    left = [name for name in names if not stage_output(root, name).exists()]
    arms = f"; arms {', '.join(added[1])} would be added to it" if added else ""
    return [f"{root} holds a run of this sweep{arms}: {len(names) - len(left)} of {len(names)} stages complete "
            f"(skipped when it resumes; the estimate below counts them all); left: {', '.join(left) or 'none'}"]


def _training(recipe: RecoverRecipe) -> tuple[float, str, float]:
    """One recovery's plan: the tokens it trains (from max_new_tokens + 60 a teacher answer), its schedule in words,
    and the measured CPU rate it trains at (the local step on cached states has its own)."""
    train, per_answer = recipe.train, recipe.generate.max_new_tokens + 60
    answers = recipe.prompts.samples or 256
    if recipe.trainer_method() is None and recipe.lr_section() is not None:
        # the local step's own budget: local.steps (else train.max_steps, else one pass) of batch x accum
        from layerprune.recover.chain import local_budget

        budget = local_budget(recipe, int(answers * (1 - train.held_out)))
        trained = budget.steps * budget.sequences_per_step * per_answer
        if train.max_tokens is not None:
            trained = min(trained, train.max_tokens)
        return trained, f"{budget.steps} local steps, lr {budget.learning_rate:g}", RATES["local tokens/s"]
    if recipe.trainer_method() is None:
        return 0.0, "no training (forward passes only)", RATES["trained tokens/s"]
    trained = answers * (1 - train.held_out) * per_answer * train.epochs if train.max_steps is None else \
        train.max_steps * train.batch_size * train.grad_accum * per_answer
    return trained, f"{train.epochs:g} epochs, lr {train.learning_rate:g}", RATES["trained tokens/s"]


def _recovery_lines(study: SweepStudy, shared: RecoverRecipe, plans: dict[str | None, tuple[float, str, float]],
                    runs: dict[str | None, int]) -> list[str]:
    """The recovery at every k (without arms), or the shared teacher answers and each arm's method, schedule and
    recoveries."""
    train, gen = shared.train, shared.generate
    answers = f"{shared.prompts.samples or 256} teacher answers to {shared.prompts.source} prompts"
    tail = f"(planned from {gen.max_new_tokens} + 60 tokens per answer; the report counts them)"
    if study.arms is None:
        trained, schedule, _ = plans[None]
        return [f"recovery at every k: {shared.method} on {answers} (generated once; {gen.max_new_tokens} new tokens "
                f"at temperature {gen.temperature:g}), {schedule}, batch {train.batch_size} x {train.grad_accum}, "
                f"held-out {train.held_out:g} every {train.eval_steps} steps: about {trained / 1000:.0f}k trained "
                f"tokens per k {tail}"]
    lines = [f"arms ({len(study.arms)}, each at every k, paired on the same items): {', '.join(study.arms)}; every "
             f"arm{' but ' + ', '.join(study.arm_prompts) if study.arm_prompts else ''} on the same {answers} "
             f"(generated once for every arm and k; {gen.max_new_tokens} new tokens at "
             f"temperature {gen.temperature:g}), batch {train.batch_size} x {train.grad_accum}, held-out "
             f"{train.held_out:g}"]
    for arm, (trained, schedule, _) in plans.items():
        recipe = study.arm_recipe(arm, "<pruned>")
        grid = study.lr_grid.get(arm or "")
        search = (f" (lr from the grid {', '.join(f'{rate:g}' for rate in grid)}: the arm's recipe trained at "
                  f"each on pruned-k{study.lr_k} under a seed of its own, the lowest held-out loss chosen; "
                  f"{len(grid)} of the recoveries are that search, never scored)" if grid else "")
        size = (f"about {trained / 1000:.0f}k trained tokens per k" if not study.budgets else
                "each run to its budget (below)")
        lines.append(f"arm {arm}: {recipe.chain_name()}, {schedule}{search}: {size}; {runs[arm]} recoveries {tail}")
    return lines


def budget_runs(study: SweepStudy, arm: str | None) -> list[int]:
    """The target tokens of every run of an arm with budgets: each replicate at every k to the largest budget (local
    also to each smaller one, a run of its own), the controls to the largest, the lr grid's runs to the smallest."""
    largest, smallest = study.budgets[-1], study.budgets[0]  # type: ignore[index]
    per_point = list(study.budgets or []) if trains_each_budget(study, arm) else [largest]
    points = len(study.ratios) * study.replicates * per_point
    control = [largest] * study.replicates if has_control(study, arm) else []
    dedicated = [study.dedicated_at] * len(dedicated_points(study, study.lr_k, arm)) if study.dedicated_at else []
    return [*points, *control, *dedicated, *[smallest] * len(study.lr_grid.get(arm or "", []))]


def budget_seconds(study: SweepStudy, arm: str | None) -> float:
    """The arm's training time with budgets at the measured rates: a target token planned as (max_new_tokens + 60) /
    max_new_tokens trained tokens (every answer max_new_tokens long; shorter answers cost more a target token)."""
    recipe = study.arm_recipe(arm, "<pruned>")
    new = recipe.generate.max_new_tokens
    rate = RATES["local tokens/s"] if trains_each_budget(study, arm) else RATES["trained tokens/s"]
    return sum(budget_runs(study, arm)) * (new + 60) / new / rate


def budget_lines(study: SweepStudy) -> list[str]:
    """The budget points, how each is made, and where an arm's epochs (local: steps) cannot reach the largest."""
    if not study.budgets:
        return []
    largest = study.budgets[-1]
    lines = [f"budget points (unpadded target tokens): {', '.join(map(str, study.budgets))}; every recovery at k > 0 "
             f"trains to {largest} (train.max_tokens; the k = 0 controls too, their only point), scored at each "
             f"budget as ARM-kK@<budget>[@rR] ({', '.join(budget_tag(b) for b in study.budgets[:-1])}; the largest is "
             f"ARM-kK itself)" + (f"; lr grids searched at {study.budgets[0]}" if study.lr_grid else "")
             + (f"; a dedicated run of every trainer arm at {study.dedicated_at} and k = {study.lr_k} beside its "
                f"checkpoint (ARM-k{study.lr_k}@{budget_tag(study.dedicated_at)}{DEDICATED}[@rR])"
                if study.dedicated_at else "")]
    for arm in arm_names(study):
        recipe, name = study.arm_recipe(arm, "<pruned>"), arm or "the recovery"
        answers = int((recipe.prompts.samples or 256) * (1 - recipe.train.held_out))
        new, train = recipe.generate.max_new_tokens, recipe.train
        if trains_each_budget(study, arm):
            from layerprune.recover.chain import local_budget

            steps = local_budget(recipe, answers)
            reach = steps.steps * steps.sequences_per_step * new
            how, more = "a run of its own per budget (no trainer to save checkpoints)", "local.steps"
        else:
            reach = int(train.epochs * answers * new) if train.max_steps is None else \
                train.max_steps * train.batch_size * train.grad_accum * new
            how = (f"checkpoints of the one run (a trainer callback counts the target tokens of each batch and saves "
                   f"the step that first reaches a budget), lr {train.lr_scheduler} after {train.warmup_steps} warmup "
                   "steps")
            more = "train.epochs" if train.max_steps is None else "train.max_steps"
        runs = budget_runs(study, arm)
        lines.append(f"arm {name}: budget points as {how}; {len(runs)} runs, {sum(runs) / 1000:.0f}k target tokens "
                     f"in all" + ("" if reach >= largest else f"; WARNING: at most {reach} target tokens reachable "
                                  f"({answers} answers of at most {new} tokens): raise {more}"))
    return lines


def _replicate_line(study: SweepStudy, shared: RecoverRecipe, answer_sets: int) -> str:
    """What the replicates vary and the control adds."""
    runs = (f"{study.replicates} replicates of every recovery (seeds settings.seed + 0..{study.replicates - 1}: "
            f"held-out split, data order, adapter init; {answer_sets} teacher answer set(s))"
            if study.replicates > 1 else "1 replicate of every recovery (run-to-run variance not measured)")
    from layerprune.recover.methods import cut_methods

    if not study.controls:
        control = "no k = 0 control (controls: false)"
    elif study.arms is not None:
        cut = [arm for arm in study.arms if not has_control(study, arm)]
        control = (f"k = 0 controls (the arm's recovery of the unpruned original, ARM-k0): "
                   f"{', '.join(a for a in study.arms if a not in cut) or 'none'}"
                   + (f"; none for {', '.join(cut)} (a cut is needed: {cut_methods()})" if cut else ""))
    elif has_control(study):
        control = "k = 0 control: the same recovery of the unpruned original (recovered-k0), scored on the same items"
    else:
        control = f"no k = 0 control: {shared.chain_name()} needs a cut ({cut_methods()} change cut blocks)"
    return f"{runs}; {control}"


def _memory_lines(study: SweepStudy, settings: RunSettings, arm: str | None) -> list[str]:
    """The recovery's (an arm's) memory plan at the smallest k (the largest student: the original itself with the
    control), as the recovery study plans an arm."""
    import copy

    from layerprune.pipeline.plan import model_config
    from layerprune.recover import memory
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.methods import plan_for

    config, note = model_config(study.model, settings)
    if config is None:
        return [f"memory plan: not made ({note or 'the config was not readable'})"]
    teacher = copy.deepcopy(config)
    first = 0 if has_control(study, arm) else study.ratios[0]
    config.num_hidden_layers = teacher.num_hidden_layers - first
    _, plan = plan_for(study.arm_recipe(arm, "<pruned>"), config,
                       RecoverJob(output=study.run_dir() / "recovered-k1", settings=settings), cuda=True,
                       teacher_config=teacher)
    text = memory.format_plan(plan, f"{study.model or 'embedded'} minus {first} blocks")
    return [text if arm is None else f"arm {arm}: {text}"]


def rates_apply(model: str | None) -> bool:
    """The measured 2-core rates hold for the embedded SmolLM2 and for a variant post-trained from it (the same
    architecture)."""
    spec = str(model or "embedded")
    if spec.startswith("variant:"):
        from layerprune.core.recipe_loading import build_from_recipe
        from layerprune.posttrain.schema import VariantRecipe

        spec = build_from_recipe(VariantRecipe, "variant", spec.partition(":")[2], {}).model
    return spec.startswith("embedded")


def _estimate(study: SweepStudy, seconds: dict[str, float]) -> str:
    if not rates_apply(study.model):
        return "time: no estimate (the rates were measured for the embedded model on 2 CPU cores)"
    return ("time estimate at the embedded model's measured 2-core rates (" + ", ".join(
        f"{k} {v:g}" for k, v in RATES.items()) + "): " + ", ".join(f"{k} {v / 60:.0f} min" for k, v in seconds.items())
        + f"; total about {sum(seconds.values()) / 60:.0f} min")


def _size(limit: float | None) -> str:
    return "all" if limit is None else f"{100 * limit:g}%" if limit < 1 else str(int(limit))
