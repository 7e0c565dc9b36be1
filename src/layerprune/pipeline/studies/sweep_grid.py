"""The pruning-ratio sweep as data: its recipe (SweepStudy), the models its grid expands to (cuts x arms x budgets x
replicates, the k = 0 controls), their labels and budget points; its stages, built from them, are sweep_cells.py's.
What a stage reads from the records before it (its tasks, its cut) is sweep_inputs.py's. The runner (sweep.py), the
dry run (sweep_plan.py) and the reports (sweep_report.py and its sweep_points/sweep_text/sweep_curves,
budget_report.py, sweep_join.py) read it; it imports none of them."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.core.recipe_loading import validation_message
from layerprune.evaluate.calibrated import ProbeCalibration
from layerprune.evaluate.schema import EvalSettings
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.pipeline.studies.cells import (
    Arm,
    check_plain_probes,
    derive_arm_recipe,
    replicate_label,
    suite_tasks,
)
from layerprune.pipeline.studies.comparisons import ComparisonFamily, check_budget_contrasts, check_comparisons
from layerprune.pipeline.studies.grain_grid import GrainCuts, check_grain_cuts
from layerprune.recover.lr_search import check_lr_grid
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


GSM8K = "gsm8k"


TAKEN = ("baseline", "pruned", "recovered", "original")  # arm labels that would name the sweep's other models


CONSTANT = ("constant_with_warmup", "constant")  # schedules whose checkpoint is the model a shorter run would be


class Gsm8kGate(BaseModel):
    """GSM8K is scored only when the original reaches `min_score` on the first `limit` test items."""

    model_config = ConfigDict(extra="forbid")

    min_score: float = Field(0.15, ge=0, le=1, description="The original's GSM8K score (strict match) needed")
    limit: int = Field(20, ge=1, description="GSM8K test items the gate scores the original on")


class SweepStudy(PipelineRecipe):
    """Prune at several ratios from one ranking, recover each, evaluate all on the same items, one report. One ratio
    is a recovery study: one cut recovered by every arm (issue 56)."""

    kind: ClassVar[str] = "sweep-study"
    adds_stages: ClassVar[tuple[str, ...]] = ("replicates", "controls")  # more of them resume the sweep
    ratios: list[int] = Field(min_length=1, description="Blocks dropped at each point of the sweep (k); one k is a "
                              "recovery study at one cut (ratios: [N], N = prune.drop, or the count of prune.layers "
                              "where the cut is given)")
    recover: dict[str, Any] = Field(description="Recover recipe of every k: {recipe: NAME, overrides: {...}}")
    classification: list[str] = Field(default_factory=list, description="Classification tasks of the suite to score")
    fixed: list[str] = Field(default_factory=list, description="Generative tasks of the suite scored on every model "
                             "whatever the gates keep, never gated (a retrieval control such as copy_l7, probe levels "
                             "fixed in advance; gsm8k here is scored without its gate), with the suite's settings "
                             "and reported among the generative tasks")
    probes: ProbeCalibration | None = Field(default_factory=ProbeCalibration, description="probes-calibrated "
                                            "selection (the gate: a calibrate-probes stage adds the levels it keeps); "
                                            "null: no gate, the probe tasks scored are the fixed ones")
    gsm8k_gate: Gsm8kGate | None = Field(default_factory=Gsm8kGate, description="When GSM8K is scored (a gate-gsm8k "
                                         "stage on the original); null: GSM8K is not scored, unless it is fixed")
    replicates: int = Field(1, ge=1, description="Recoveries per point: replicate r runs with seed settings.seed + r "
                            "(held-out split, data order, adapter init, sampled teacher answers), r = 0 as a single "
                            "run, r > 0 in recovered-kK@rR; the report gives the across-run spread")
    controls: bool = Field(False, description="The k = 0 control: the same recovery of the unpruned original "
                           "(recovered-k0, per replicate), scored on the same items (none for merge, replace, local)")
    arms: dict[str, Arm] | None = Field(None, min_length=1, description="Recovery methods by label, each applied at "
                                        "every k (model ARM-kK): the shared recover recipe with the arm's method and "
                                        "section; none: the recover recipe alone")
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
    arm_generate: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="By arm label (one with arm_prompts), the generate fields its own prompts "
        "are answered and trained in: chat_template false for probe prompts answered as the probe evaluation asks "
        "them (plain few-shot text, to the line's end)")
    budgets: list[int] | None = Field(
        None, description="Training budgets in unpadded target tokens (recover/budget.py's unit), increasing: every "
        "recovery at k > 0 trains to the largest (train.max_tokens) and a trainer's run saves its model when its "
        "counted target tokens first reach each smaller one (model ARM-kK@<budget>[@rR], e.g. sft-k2@32k@r1, scored "
        "as every model is); local, which has no trainer, trains each budget as a run of its own; the k = 0 "
        "controls at the largest budget only, lr_grid searched at the smallest. The rate must be constant after "
        "warmup (lr_scheduler constant or constant_with_warmup), so a checkpoint is the model a run of that budget "
        "would be")
    arm_budgets: dict[str, list[int]] = Field(
        default_factory=dict, description="By arm label, the budgets it trains to where not all of budgets: the "
        "smallest, then any others of them in order, its largest its runs' and its k = 0 control's end (a positive "
        "control whose short answers make each target token costly, scored on the same axis)")
    dedicated_at: int | None = Field(
        None, description="One of budgets below the largest at which every trainer arm also trains a run of its own "
        "at k = lr_at (model ARM-kK@<budget>-dedicated[@rR], each replicate): the report pairs it with the checkpoint "
        "of that budget, which it should match within its interval")
    run_order: list[int] | None = Field(
        None, description="The cuts in the order their stages run, each with every replicate before the next (0: the "
        "k = 0 controls), e.g. [2, 0, 4]: the first cut's comparisons whole before the others start; none: replicate "
        "by replicate (a run in parts holds whole replicates of the design). When a stage runs, never what it does: "
        "no fingerprint holds it, so a run in progress takes a new order as it resumes")
    grains: GrainCuts | None = Field(None, description="Finer grains cut beside the block cut at each k, at "
                                     "matched savings (pipeline/studies/grain_grid.py): every cell recovered by the "
                                     "one arm, the grain report (grain.md) instead of the sweep's; none: blocks only")
    comparisons: dict[str, ComparisonFamily] = Field(
        default_factory=dict, description="Declared comparisons by family (pipeline/studies/comparisons.py): each "
        "contrast {name, a, at, b, b_at, measure, kind, net_of_control} gets its paired interval and its Holm interval "
        "over its family; a family {exploratory: true, contrasts: [...]} was declared after the results were read. "
        "None declared (or only exploratory ones): every pair of arms at every k, one family per measure")

    @model_validator(mode="after")
    def _one_ranking(self) -> SweepStudy:
        if sorted(set(self.ratios)) != self.ratios or self.ratios[0] < 1:
            raise ValueError(f"ratios must be distinct block counts >= 1 in increasing order, not {self.ratios}")
        self._check_cut()
        self._check_tasks()
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
        self._check_run_order()
        if self.grains is not None:
            check_grain_cuts(self)
        if set(self.arm_prompts) - set(self.arms or {}):
            raise ValueError(f"arm_prompts: {', '.join(sorted(set(self.arm_prompts) - set(self.arms or {})))} "
                             "not among the arms")
        if set(self.arm_generate) - set(self.arm_prompts):  # the others share the teacher answers
            raise ValueError(f"arm_generate: {', '.join(sorted(set(self.arm_generate) - set(self.arm_prompts)))} "
                             "has no prompts of its own (arm_prompts): it shares the teacher answers")
        for arm in self.arm_generate:
            self.arm_recipe(arm, "<pruned>")  # its fields, checked before any stage runs
        return self

    def _check_cut(self) -> None:
        if self.prune.iterative:
            raise ValueError("the sweep cuts one one-shot ranking: set prune.drop and score (not iterative)")
        if self.prune.layers is not None:
            if len(self.ratios) != 1 or self.ratios[0] != len(self.prune.layers):
                raise ValueError(f"prune.layers gives one cut: set ratios: [{len(self.prune.layers)}] (a sweep of "
                                 "several k cuts one scoring pass: set prune.drop and score)")
        elif self.prune.drop != self.ratios[-1]:
            raise ValueError(f"prune.drop must be the largest ratio ({self.ratios[-1]}): one scoring pass ranks them")

    def _check_tasks(self) -> None:
        if self.evaluate.suite is None:
            raise ValueError("evaluate.suite: name the suite whose settings every task is scored with")
        if self.evaluate.only is not None or self.evaluate.tasks:
            raise ValueError("evaluate.only / evaluate.tasks: a sweep scores its classification and fixed tasks and "
                             "the levels its gate keeps; name them there")
        if self.grains is None and not self.classification:
            raise ValueError("classification: name at least one classification task (the sweep reports what "
                             "recovery brings back of classification against generative tasks)")
        if not (self.classification or self.fixed):
            raise ValueError("grains: name the instrument, classification and/or fixed tasks")
        known = suite_tasks(self.evaluate.suite)
        candidates = self.probes.candidates if self.probes is not None else []
        missing = [t for t in [*self.classification, *self.fixed, *candidates] if t not in known]
        if missing:
            raise ValueError(f"evaluate.suite '{self.evaluate.suite}' has no task {', '.join(missing)} (every "
                             "classification task, fixed task and probe candidate is scored with the suite's "
                             "settings)")
        twice = [t for t in self.fixed if t in self.classification or t in candidates]
        if twice or len(set(self.fixed)) != len(self.fixed):
            raise ValueError(f"fixed: {', '.join(twice) or 'a task named twice'}: a fixed task is scored whatever "
                             "the gate keeps; name it once, not also in classification or probes.candidates")

    def _check_run_order(self) -> None:
        if self.run_order is None:
            return
        if self.grains is not None:
            raise ValueError("run_order: a grain study runs replicate by replicate")
        cuts = [*self.ratios, *([0] if self.controls else [])]
        if sorted(self.run_order) != sorted(cuts):
            raise ValueError(f"run_order: every cut once ({', '.join(map(str, cuts))}"
                             f"{'; 0: the k = 0 controls' if self.controls else ''}), not {self.run_order}")

    @property
    def given_cut(self) -> bool:
        """Whether the one cut is given (prune.layers): no scoring pass ranks the blocks."""
        return self.prune.layers is not None

    def _check_budgets(self) -> None:
        if self.budgets is None:
            if self.dedicated_at is not None or self.arm_budgets:
                raise ValueError(f"{'dedicated_at' if self.dedicated_at is not None else 'arm_budgets'}: name the "
                                 "budgets it is drawn from")
            return
        if len(self.budgets) < 2 or sorted(set(self.budgets)) != self.budgets or self.budgets[0] < 1:
            raise ValueError(f"budgets must be two or more distinct target-token counts >= 1 in increasing order, not "
                             f"{self.budgets}")
        for arm in arm_names(self):
            recipe, name = self.arm_recipe(arm, "<pruned>"), f"arm '{arm}'" if arm else "the recovery"
            if recipe.lr_section() is None:  # no step trains (a fold or merge alone)
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
        for arm, own in self.arm_budgets.items():
            if arm not in (self.arms or {}):
                raise ValueError(f"arm_budgets: '{arm}' is not among the arms")
            if len(own) < 2 or own[0] != self.budgets[0] or sorted(set(own)) != own or set(own) - set(self.budgets):
                raise ValueError(f"arm_budgets.{arm}: two or more of budgets in order, the smallest "
                                 f"({self.budgets[0]}: the lr search's and every rise's) first, not {own}")

    def budgets_of(self, arm: str | None) -> list[int]:
        """The budgets an arm trains to (arm_budgets, else budgets; none without budgets)."""
        return list(self.arm_budgets.get(arm or "", self.budgets or []))

    @model_validator(mode="after")
    def _declared_comparisons(self) -> SweepStudy:
        check_comparisons(self.comparisons, list(self.arms) if self.arms else None, self.ratios,
                          lambda arm: has_control(self, arm))
        check_budget_contrasts(self.comparisons, self.budgets, self.budgets_of)
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
        shared one (cells.derive_arm_recipe)."""
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
        layer = {"prompts": {**self.arm_prompts[arm], "exclude_probe_seeds": seeds},
                 **({"generate": self.arm_generate[arm]} if arm in self.arm_generate else {})}
        return RecoverRecipe.model_validate(merge_layers(dumped, layer))

    def answers_file(self, arm: str | None, recipe: RecoverRecipe, replicate: int) -> str:
        """The teacher-answer file a run shares (recovery.teacher_answers), one of its own for an arm with
        arm_prompts."""
        from layerprune.pipeline.studies.cells import teacher_answers

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


def point_label(arm: str | None, k: int, replicate: int, tag: str = "") -> str:
    """A recovered point's physical label: recovered-kK or ARM-kK, its budget tag (@32k, @8k-dedicated; none at the
    largest budget), then @rR for replicate r > 0 (a replicate suffix last: a point's replicates are one logical
    label)."""
    return replicate_label(recovered_label(arm, k) + tag, replicate)


def recovered(study: SweepStudy, k: int, arm: str | None = None) -> list[str]:
    """The physical labels of every replicate of the arm's recovered point at k (k = 0: its control)."""
    return [point_label(arm, k, r) for r in range(study.replicates)]


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
    """The physical labels of the arm's recovered point at k at every budget below the largest (point_label),
    budget by budget; none without budgets or at k = 0 (the controls train to the largest budget only)."""
    if not study.budgets or k == 0:
        return []
    return [point_label(arm, k, r, f"@{budget_tag(b)}") for b in study.budgets_of(arm)[:-1]
            for r in range(study.replicates)]


DEDICATED = "-dedicated"  # the tag of a budget point trained as a run of its own beside a trainer's checkpoint


def dedicated_points(study: SweepStudy, k: int, arm: str | None = None) -> list[str]:
    """The physical labels of a trainer arm's dedicated runs at dedicated_at (k = lr_k only), replicate by
    replicate; none otherwise (local's budget points are all runs of their own)."""
    if study.dedicated_at not in study.budgets_of(arm)[:-1] or k != study.lr_k or trains_each_budget(study, arm):
        return []  # also an arm whose largest budget is dedicated_at: its run is the dedicated one
    return [point_label(arm, k, r, f"@{budget_tag(study.dedicated_at)}{DEDICATED}") for r in range(study.replicates)]


def trains_each_budget(study: SweepStudy, arm: str | None) -> bool:
    """Whether the arm's budget points are runs of their own (local: no trainer to save checkpoints), not
    checkpoints of the run to the largest budget."""
    return bool(study.budgets) and study.arm_recipe(arm, "<pruned>").trainer_method() is None


def both_formats(study: SweepStudy) -> bool:
    """Whether the probe levels are scored in both formats, plain few-shot text and through the chat template: the
    recovery data is chat-formatted (generate.chat_template) and probes are scored (a gate, or a fixed probe
    task); a grain study scores its fixed instrument in one format, plain."""
    chat = study.shared_recipe("<pruned>").generate.chat_template
    return chat and study.grains is None and (study.probes is not None or bool(fixed_probes(study)))


def gsm8k_gated(study: SweepStudy) -> bool:
    """Whether GSM8K waits on its gate (a gate-gsm8k stage): not where it is a fixed task, nor without a gate."""
    return study.gsm8k_gate is not None and GSM8K not in study.fixed


def instrument(study: SweepStudy) -> SweepStudy:
    """The study evaluating only the tasks it can score (its classification and fixed tasks, the probe gate's
    candidate levels, GSM8K behind its gate), not the rest of its suite: what the dry run lists and the run checks
    the data of."""
    candidates = study.probes.candidates if study.probes is not None else []
    tasks = [*study.classification, *study.fixed, *candidates, *([GSM8K] if gsm8k_gated(study) else [])]
    return study.model_copy(update={"evaluate": study.eval_settings(list(dict.fromkeys(tasks)))})


def fixed_probes(study: SweepStudy) -> list[str]:
    """The fixed tasks that are probe tasks (scored in both formats with chat-formatted recovery data)."""
    from layerprune.tasks.probes import probe_tasks

    return [t for t in study.fixed if t in probe_tasks()]
