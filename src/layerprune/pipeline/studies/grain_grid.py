"""The grain study as data: its recipe (GrainStudy: grains x levels matched in a saving, recovered or not), its cells
and their replicates. The runner (grain.py) and the report (grain_report.py) read it; it imports neither."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.core.recipe_loading import validation_message
from layerprune.pipeline.recipe import PipelineRecipe, RecoverStage
from layerprune.pipeline.studies.cells import Arm, derive_arm_recipe, replicate_label
from layerprune.prune.matched import cut_label
from layerprune.recover.schema import RecoverRecipe

log = logging.getLogger(__name__)


Grain = Literal["block", "attention", "mlp"]


Match = Literal["params", "kv-cache", "speedup"]


CONTROL = "control"  # the k = 0 control's label: control[@rR]


PLAN_FILE = "grain_plan.json"


RANKED_SCORES = ("ablation", "block-influence", "last", "random")  # one-shot scores that rank every candidate


class GrainGates(BaseModel):
    """What the report checks before it reads a difference, fixed in the recipe before any result."""

    model_config = ConfigDict(extra="forbid")

    control_shift: float = Field(0.03, ge=0, le=1, description="The k = 0 control fails when its paired 95% interval "
                                 "of (control - original) on the instrument lies wholly beyond this many points "
                                 "(fraction) either way: the recovery recipe itself moves the instrument, and "
                                 "after-recovery retention is flagged (grain differences share the recipe and stand)")
    margin: float = Field(0.0, ge=0, le=1, description="Finer grain costs less (or more) only where the paired 95% "
                          "interval of (finer - block) on the instrument lies wholly above +margin (below -margin)")


class GrainStudy(PipelineRecipe):
    """score each grain -> matched cells -> prune, evaluate, recover (replicated), evaluate -> one report."""

    kind: ClassVar[str] = "grain-study"
    adds_stages: ClassVar[tuple[str, ...]] = ("replicates", "controls")  # more of them resume the study
    grains: list[Grain] = Field(["block", "attention", "mlp"], min_length=2,
                                description="The grains compared; block first (the reference every cell matches)")
    levels: list[int] = Field(min_length=1, description="Savings levels as the blocks the block arm removes (k); each "
                                                        "finer grain is matched to the block arm's savings at k")
    match: Match = Field("params", description="The matched saving: parameters removed, KV-cache bytes per token, or "
                                               "the speedup measured at the plan stage (prefill and decode, the "
                                               "smaller ratio, on the device the study runs on)")
    tolerance: float = Field(0.05, gt=0, le=0.5, description="Largest relative gap between a finer grain's savings "
                                                             "and the block arm's at the same k (for speedup: of the "
                                                             "speed gained, speedup - 1); beyond it the cell is "
                                                             "refused")
    speed_repeats: int = Field(5, ge=1, description="match speedup: timings of each candidate and of the original "
                                                    "(alternately, the fastest kept)")
    recover: dict[str, Any] = Field(description="Shared recover recipe: {recipe: NAME, overrides: {...}}")
    arm: Arm = Field(description="The one recovery every cell and control gets (lora, full, qlora or kd: methods "
                                 "that train the kept weights of any layout)")
    replicates: int = Field(3, ge=1, description="Recoveries per cell and control, replicate r with the run seed + r")
    controls: bool = Field(True, description="k = 0 controls: the recovery applied to the original itself, one per "
                                             "replicate, scored on the same items")
    gates: GrainGates = Field(default_factory=GrainGates, description="The report's gates")

    @model_validator(mode="after")
    def _cells_resolve(self) -> GrainStudy:
        if self.grains[0] != "block" or len(set(self.grains)) != len(self.grains):
            raise ValueError(f"grains: block first, then attention and/or mlp, each once (not {self.grains})")
        if sorted(set(self.levels)) != self.levels or self.levels[0] < 1:
            raise ValueError(f"levels must be distinct block counts >= 1 in increasing order, not {self.levels}")
        if self.match == "kv-cache" and "mlp" in self.grains:
            raise ValueError("match kv-cache: an MLP sublayer saves no KV cache; match params, or leave mlp out")
        prune = self.prune
        if prune.layers is not None or prune.target is not None or prune.iterative or prune.granularity != "block":
            raise ValueError("prune: give score, metric and calibration only (drop: the largest level); each grain is "
                             "ranked by one one-shot pass and cut here (no layers, target, iterative or granularity)")
        if prune.drop != self.levels[-1]:
            raise ValueError(f"prune.drop must be the largest level ({self.levels[-1]})")
        if prune.score not in RANKED_SCORES:
            raise ValueError(f"prune.score '{prune.score}' ranks no sublayers one by one; use "
                             f"{', '.join(RANKED_SCORES)}")
        try:
            recipe = self.arm_recipe("<pruned>")
        except ValidationError as exc:
            raise ValueError(validation_message(exc, "arm")) from None
        if recipe.surgery_steps() or recipe.trainer_method() is None:
            raise ValueError(f"arm: {recipe.chain_name()} does not train the kept weights of every layout; use lora, "
                             "full, qlora or kd")
        if recipe.train.max_steps is None:
            raise ValueError("recover: set train.max_steps so that every cell runs the same optimizer steps at most")
        return self

    def arm_recipe(self, student: str) -> RecoverRecipe:
        """The recovery of every cell and control: the shared recipe with the arm's method and section."""
        shared = RecoverStage.model_validate(self.recover).resolve(student, self.model)
        return derive_arm_recipe(shared, self.arm, f"{self.name}-{self.arm.method}", self.evaluate.probe_seed)


def cell(grain: str, level: int) -> str:
    """A cell's label: GRAIN-kK (its recovered model; pruned-GRAIN-kK before recovery), as prune/matched.py plans it."""
    return cut_label(grain, level)


def cells(study: GrainStudy) -> list[str]:
    return [cell(grain, level) for level in study.levels for grain in study.grains]


def replicas(study: GrainStudy, label: str) -> list[str]:
    """Every replicate's label of a recovered cell or of the control."""
    return [replicate_label(label, r) for r in range(study.replicates)]


def logical_models(study: GrainStudy) -> dict[str, list[str]]:
    """Each evaluated logical model and its physical labels (replicates), in report order."""
    out: dict[str, list[str]] = {"baseline": ["baseline"]}
    if study.controls:
        out[CONTROL] = replicas(study, CONTROL)
    for name in cells(study):
        out[f"pruned-{name}"] = [f"pruned-{name}"]
        out[name] = replicas(study, name)
    return out
