"""Run a recipe stage by stage; each stage is skipped when its output is already complete."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import check_can_make, check_not_input, input_paths
from layerprune.core.provenance import Provenance, collect_provenance
from layerprune.core.registry import unknown_name_message
from layerprune.core.reports import read_report, write_report
from layerprune.core.settings import RunSettings
from layerprune.evaluate.summary import SUMMARY_FILE
from layerprune.pipeline.recipe import PipelineRecipe, RunRecipe
from layerprune.pipeline.runner import Stage, run_stages
from layerprune.pipeline.serving import run_export
from layerprune.recover.job import leftover_of

log = logging.getLogger(__name__)
STAGES = ("prune", "eval-baseline", "eval-pruned", "recover", "eval-recovered", "export", "report")


@dataclass(frozen=True)
class RunPaths:
    """Where each stage writes inside one run directory."""

    root: Path

    @property
    def pruned(self) -> Path:
        return self.root / "pruned"

    @property
    def recovered(self) -> Path:
        return self.root / "recovered"

    @property
    def selfgen(self) -> Path:
        return self.root / "selfgen.jsonl"

    @property
    def gguf(self) -> Path:
        return self.root / "gguf"

    @property
    def state(self) -> Path:
        return self.root / "run.json"

    @property
    def report(self) -> Path:
        return self.root / "report.md"

    def eval(self, role: str) -> Path:
        return self.root / "eval" / role

    def stage_output(self, stage: str) -> Path:
        """The file whose presence marks a stage complete (outputs are written atomically)."""
        if stage.startswith("eval-"):
            return self.eval(stage.removeprefix("eval-")) / SUMMARY_FILE
        return {"prune": self.pruned / "prune_report.json", "recover": self.recovered / "recover_report.json",
                "export": self.gguf / "export.json", "report": self.report}[stage]


# What a run directory's fingerprint leaves out: the prose, where it is written, and settings that change no result
UNOWNED: dict[str, Any] = {"description": True, "output": True, "degeneration": True, "comparisons": True,
                           "run_order": True,
                           "prune": {"stack_candidates", "verify", "force"}, "evaluate": {"allow_overlap"}}


def recipe_fingerprint(recipe: BaseModel) -> str:
    """What makes a run directory this recipe's: its fields that differ from their defaults, in a canonical order
    (a field added later at its default changes no fingerprint), less `UNOWNED` and the fields the recipe says only
    add stages (`adds_stages`: a study given more replicates resumes where it stands)."""
    adds = dict.fromkeys(getattr(recipe, "adds_stages", ()), True)
    dumped = recipe.model_dump(mode="json", exclude={**UNOWNED, **adds}, exclude_defaults=True)
    return hashlib.sha256(json.dumps(dumped, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


class RunState(BaseModel):
    """run.json: the recipe a run directory belongs to."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="The recipe's name")
    fingerprint: str = Field(description="recipe_fingerprint of the recipe when the directory was claimed")
    recipe: dict[str, Any] = Field(description="The recipe as it was then")
    provenance: Provenance


def stored_fingerprint(state: RunState, schema: type[BaseModel]) -> str | None:
    """The fingerprint of the recipe a run directory records, by today's rule (a run claimed under an older rule
    keeps its directory)."""
    try:
        return recipe_fingerprint(schema.model_validate(state.recipe))
    except ValueError:
        return None


def owns(state: RunState, recipe: BaseModel) -> bool:
    """Whether a run directory's run.json is this recipe's (by the fingerprint it stored, or its recipe's today)."""
    fingerprint = recipe_fingerprint(recipe)
    return fingerprint in (state.fingerprint, stored_fingerprint(state, type(recipe)))


def _read_state(path: Path, overwrite: bool) -> RunState | None:
    """The run.json there; None when it is unreadable and --overwrite starts the run over anyway."""
    try:
        return read_report(path, RunState)
    except LayerpruneError as exc:
        if overwrite:
            return None
        raise LayerpruneError(f"{exc}; pass --overwrite to start the run over") from exc


def claim_run_dir(paths: RunPaths, recipe: Any, overwrite: bool) -> None:
    """A run directory belongs to one recipe (a pydantic recipe or study with a `name`): refuse another recipe's
    outputs unless --overwrite; never a folder that is, holds or lies in the recipe's model."""
    check_not_input(paths.root, input_paths(getattr(recipe, "model", None)))
    if paths.state.is_file():
        other = _read_state(paths.state, overwrite)
        if other is not None and owns(other, recipe):
            return
        if not overwrite:
            assert other is not None
            raise LayerpruneError(
                f"{paths.root} holds outputs of another recipe ('{other.name}', or this one "
                "changed); pass --overwrite to start it over, or choose another output"
            )
        shutil.rmtree(paths.root)
    elif paths.root.exists() and any(paths.root.iterdir()) and not overwrite:
        raise LayerpruneError(
            f"{paths.root} exists and is not a layerprune run directory; pass --overwrite or choose another"
        )
    elif paths.root.exists() and overwrite:
        shutil.rmtree(paths.root)
    paths.root.mkdir(parents=True, exist_ok=True)
    write_report(
        paths.state,
        RunState(
            name=recipe.name,
            fingerprint=recipe_fingerprint(recipe),
            recipe=recipe.model_dump(mode="json"),
            provenance=collect_provenance(),
        ),
    )


def stages_for(recipe: RunRecipe) -> list[str]:
    return [s for s in STAGES if recipe.recover is not None or s not in ("recover", "eval-recovered")]


def reset_from(paths: RunPaths, recipe: RunRecipe, stage: str) -> None:
    """--from STAGE: forget the outputs of STAGE and every later stage."""
    stages = check_stage(recipe, stage)
    for later in stages[stages.index(stage) :]:
        target = paths.stage_output(later)
        folder = target.parent if later != "report" else target
        if folder.is_dir():
            shutil.rmtree(folder)
        elif folder.exists():
            folder.unlink()
    if stage in ("recover",) and paths.selfgen.exists():
        paths.selfgen.unlink()


def check_stage(recipe: RunRecipe, stage: str) -> list[str]:
    """The run's stages, refusing a --from STAGE not among them."""
    stages = stages_for(recipe)
    if stage not in stages:
        raise LayerpruneError(unknown_name_message("stage", stage, stages))
    return stages


def check_run_target(recipe: RunRecipe, from_stage: str | None = None) -> None:
    """What a run refuses before any cell of it runs (and in its dry run): a name that is no folder name, a run
    folder that is, holds or lies in its model, that is a file or lies under one, a --from stage it does not have."""
    root = recipe.run_dir()
    check_not_input(root, input_paths(recipe.model))
    check_can_make(root)
    if from_stage:
        check_stage(recipe, from_stage)


def run_pipeline(
    recipe: RunRecipe, settings: RunSettings, from_stage: str | None = None, overwrite: bool = False
) -> Path:
    """Run every incomplete stage in order; return the report path."""
    from layerprune.pipeline.plan import validate_data

    paths = RunPaths(recipe.run_dir())
    if from_stage:
        check_stage(recipe, from_stage)  # before the run folder is claimed: nothing written for a misspelled stage
    validate_data(
        recipe,
        settings,
        prune_pending=bool(from_stage == "prune" or overwrite or not paths.stage_output("prune").exists()),
    )
    claim_run_dir(paths, recipe, overwrite)
    if from_stage:
        reset_from(paths, recipe, from_stage)
    run_stages(stages_of_run(recipe, settings, paths), paths.root)
    return paths.report


def stages_of_run(recipe: RunRecipe, settings: RunSettings, paths: RunPaths) -> list[Stage]:
    """The run's stages (stages_for), each complete when its stage_output exists."""
    actions = {
        "prune": lambda: run_prune(recipe, settings, paths),
        "eval-baseline": lambda: run_eval(recipe, settings, paths, "baseline", recipe.model),
        "eval-pruned": lambda: run_eval(recipe, settings, paths, "pruned", str(paths.pruned)),
        "recover": lambda: run_recover(recipe, settings, paths),
        "eval-recovered": lambda: run_eval(recipe, settings, paths, "recovered", str(paths.recovered)),
        "export": lambda: run_export(paths.root, paths.gguf, settings),
        "report": lambda: write_run_report(recipe, settings, paths),
    }
    return [Stage(stage, paths.stage_output(stage), actions[stage], leftover=leftover_of(paths.stage_output(stage)))
            for stage in stages_for(recipe)]


def run_prune(recipe: PipelineRecipe, settings: RunSettings, paths: RunPaths) -> None:
    from layerprune.prune.api import prune_model

    prune_model(recipe.model, recipe.prune, settings, paths.pruned, overwrite=True)


def run_eval(recipe: PipelineRecipe, settings: RunSettings, paths: RunPaths, role: str, model: str | None) -> None:
    from layerprune.evaluate.runner import evaluate_model

    evaluate_model(
        model,
        recipe.evaluate,
        settings,
        paths.eval(role),
        overwrite=True,
        progress=lambda message: log.info("  %s: %s", role, message),
        calibration_from=paths.pruned,
    )


def run_recover(recipe: RunRecipe, settings: RunSettings, paths: RunPaths) -> None:
    from layerprune.recover.job import RecoverJob
    from layerprune.recover.runner import recover_model

    assert recipe.recover is not None
    recover_recipe = recipe.recover.resolve(str(paths.pruned), recipe.model)
    data_dir = recipe.evaluate.data_dir or recipe.prune.data_dir
    recover_model(recover_recipe, RecoverJob(output=paths.recovered, settings=settings, data_dir=data_dir, resume=True))
    responses = paths.recovered / "data" / "responses.jsonl"
    if responses.is_file() and not paths.selfgen.exists():
        try:
            os.link(responses, paths.selfgen)
        except OSError:
            shutil.copy2(responses, paths.selfgen)


def write_run_report(recipe: RunRecipe, settings: RunSettings, paths: RunPaths) -> None:
    from layerprune.pipeline.degeneration import measure_degeneration
    from layerprune.pipeline.report import write_report

    measure_degeneration(recipe, settings, paths)
    write_report(recipe, paths)


BRIEF = 12  # a list of names up to this long is printed whole


def stage_kind(name: str) -> str:
    """A stage's kind: its name up to the first '/' (eval-chat/LABEL), else up to the first '-' (eval-LABEL)."""
    return name.split("/")[0] if "/" in name else name.split("-")[0]


def in_brief(names: list[str], head: int = 6) -> str:
    """A long list of stage or model names as the count per kind, the first `head` in order and the last:
    "304 (eval 117, recover 60, ...; in order: a, b, ..., z)"; a list of up to BRIEF names whole."""
    if len(names) <= BRIEF:
        return f"{len(names)} ({', '.join(names)})"
    kinds: dict[str, int] = {}
    for name in names:
        kinds[stage_kind(name)] = kinds.get(stage_kind(name), 0) + 1
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items(), key=lambda item: -item[1]))
    return f"{len(names)} ({counts}; in order: {', '.join(names[:head])}, ... {names[-1]})"


def first_names(names: list[str], head: int = 8) -> str:
    """Names joined whole up to BRIEF of them, else the first `head` and how many more."""
    shown = names if len(names) <= BRIEF else names[:head]
    return ", ".join(shown) + (f", ... and {len(names) - head} more" if len(names) > BRIEF else "")
