"""The grain cut as data: a sweep (sweep_grid.SweepStudy) with `grains` cuts, at each k, the block cut and each finer
grain's prefix that saves about as much (prune/matched.py), every cell recovered by the sweep's one arm. Here: its
section of the recipe (GrainCuts and its gates), what the section asks of the rest of the recipe, and its cells' labels
(pruned-GRAIN-kK before recovery, GRAIN-kK[@rR] after, control[@rR] for the k = 0 control). The steps (grain.py), the
stages (sweep_cells.py), the dry run (grain_plan.py) and the report (grain_report.py) read it; it imports none of them
and no sweep module (the sweep's schema imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from layerprune.core.recipe_loading import validation_message
from layerprune.pipeline.studies.cells import replicate_label
from layerprune.prune.matched import cut_label

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


class GrainCuts(BaseModel):
    """Finer grains cut beside the block cut at each k, at matched savings: the sweep's ratios are the blocks the
    block cut removes, and each finer grain removes the prefix of its own one-shot ranking that saves about as much."""

    model_config = ConfigDict(extra="forbid")

    compare: list[Literal["attention", "mlp"]] = Field(
        ["attention", "mlp"], min_length=1, description="The finer grains compared with the block cut, each once")
    match: Match = Field("params", description="The matched saving: parameters removed, KV-cache bytes per token, or "
                                               "the speedup measured at the plan stage (prefill and decode, the "
                                               "smaller ratio, on the device the study runs on)")
    tolerance: float = Field(0.05, gt=0, le=0.5, description="Largest relative gap between a finer grain's savings "
                                                             "and the block cut's at the same k (for speedup: of the "
                                                             "speed gained, speedup - 1); beyond it the cell is "
                                                             "refused")
    speed_repeats: int = Field(5, ge=1, description="match speedup: timings of each candidate and of the original "
                                                    "(alternately, the fastest kept)")
    gates: GrainGates = Field(default_factory=GrainGates, description="The grain report's gates")


def check_grain_cuts(study: Any) -> None:
    """What a sweep with `grains` asks of the rest of its recipe (ValueError, one line): one arm that trains the kept
    weights of any layout within train.max_steps, one one-shot ranking score that ranks sublayers, the instrument
    fixed (no probe or GSM8K gate, no budgets, learning-rate grid or prompts of an arm's own)."""
    cuts: GrainCuts = study.grains
    if len(set(cuts.compare)) != len(cuts.compare):
        raise ValueError(f"grains.compare: attention and/or mlp, each once (not {cuts.compare})")
    if cuts.match == "kv-cache" and "mlp" in cuts.compare:
        raise ValueError("grains.match kv-cache: an MLP sublayer saves no KV cache; match params, or leave mlp out")
    prune = study.prune
    if prune.layers is not None or prune.target is not None or prune.granularity != "block":
        raise ValueError("prune: give score, metric and calibration only (drop: the largest k); each grain is "
                         "ranked by one one-shot pass and cut here (no layers, target or granularity)")
    if prune.score not in RANKED_SCORES:
        raise ValueError(f"prune.score '{prune.score}' ranks no sublayers one by one; use {', '.join(RANKED_SCORES)}")
    if study.arms is None or len(study.arms) != 1:
        raise ValueError("grains: name the one recovery every cell and control gets in arms (one arm)")
    if study.probes is not None or study.gsm8k_gate is not None:
        raise ValueError("grains: the instrument is fixed (classification and fixed tasks); set probes: null and "
                         "gsm8k_gate: null")
    if study.budgets or study.lr_grid or study.arm_prompts:
        raise ValueError("grains: every cell gets the same recovery at one budget (no budgets, lr_grid or "
                         "arm_prompts)")
    if study.comparisons:
        raise ValueError("grains: the grain report's comparisons are fixed (each finer grain against the block cut "
                         "at each k, before and after recovery, Holm over them all); leave comparisons out")
    try:
        recipe = study.arm_recipe(grain_arm(study), "<pruned>")
    except ValidationError as exc:
        raise ValueError(validation_message(exc, "arms")) from None
    if recipe.surgery_steps() or recipe.trainer_method() is None:
        raise ValueError(f"arms: {recipe.chain_name()} does not train the kept weights of every layout; use lora, "
                         "full, qlora or kd")
    if recipe.train.max_steps is None:
        raise ValueError("recover: set train.max_steps so that every cell runs the same optimizer steps at most")


def grain_arm(study: Any) -> str:
    """The one arm's label."""
    return next(iter(study.arms))


def grain_names(study: Any) -> list[str]:
    """The grains compared, the block cut first (the reference every cell matches)."""
    return ["block", *study.grains.compare]


@dataclass(frozen=True)
class Matching:
    """What prune/matched.py's plan is asked (its MatchSpec): the grains, block first, the levels (the sweep's
    ratios), the matched saving and the largest relative gap."""

    grains: list[str]
    levels: list[int]
    match: str
    tolerance: float


def matching(study: Any) -> Matching:
    return Matching(grain_names(study), list(study.ratios), study.grains.match, study.grains.tolerance)


def score_file(root: Path, grain: str) -> Path:
    """A grain's one-shot scoring record (scored/GRAIN.json)."""
    return root / "scored" / f"{grain}.json"


def cell(grain: str, level: int) -> str:
    """A cell's label: GRAIN-kK (its recovered model; pruned-GRAIN-kK before recovery), as prune/matched.py plans it."""
    return cut_label(grain, level)


def cells(study: Any) -> list[str]:
    return [name for name, _ in cell_levels(study)]


def cell_levels(study: Any) -> list[tuple[str, int]]:
    """Every cell's label and its level (the k of the block cut it is matched to), level by level."""
    return [(cell(grain, level), level) for level in study.ratios for grain in grain_names(study)]


def replicas(study: Any, label: str) -> list[str]:
    """Every replicate's label of a recovered cell or of the control."""
    return [replicate_label(label, r) for r in range(study.replicates)]


def logical_models(study: Any) -> dict[str, list[str]]:
    """Each evaluated logical model and its physical labels (replicates), in report order."""
    out: dict[str, list[str]] = {"baseline": ["baseline"]}
    if study.controls:
        out[CONTROL] = replicas(study, CONTROL)
    for name in cells(study):
        out[f"pruned-{name}"] = [f"pruned-{name}"]
        out[name] = replicas(study, name)
    return out
