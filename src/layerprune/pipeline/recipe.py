"""A run recipe: the model, how to prune it, how to recover it, and what to evaluate."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.core.outputs import run_folder
from layerprune.core.recipe_loading import build_from_recipe, load_recipe, merge_layers, validation_message
from layerprune.evaluate.schema import EvalSettings
from layerprune.prune.recipe import PruneRecipe
from layerprune.recover.schema import RecoverRecipe

Recipe = TypeVar("Recipe", bound="PipelineRecipe")


class RecoverStage(BaseModel):
    """Which recover recipe to run on the pruned model, with field overrides."""

    model_config = ConfigDict(extra="forbid")

    recipe: str = Field("demo", description="Recover recipe: a shipped name (layerprune recipes list) or a YAML path")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Recover-recipe fields to change (nested by section)"
    )

    def resolve(self, student: str, teacher: str | None) -> RecoverRecipe:
        """The validated RecoverRecipe for this run's pruned model and original (teacher)."""
        base, _ = load_recipe(self.recipe, "recover")
        fixed = {"model": student, "teacher": teacher or "embedded", "drop_blocks": None}
        return RecoverRecipe.model_validate(merge_layers(base, self.overrides, fixed))


class DegenerationStage(BaseModel):
    """rep-n and self-BLEU of each model's GSM8K answers in report.md (see pipeline/degeneration.py)."""

    model_config = ConfigDict(extra="forbid")

    samples: int = Field(
        0,
        ge=0,
        description="GSM8K test questions each model answers for the degeneration table "
        "when the suite scores no gsm8k (0: only evaluate's gsm8k answers)",
    )
    max_new_tokens: int = Field(192, ge=1, description="Tokens generated per answer (greedy)")
    batch_size: int = Field(8, ge=1, description="Questions per generate call")


class PipelineRecipe(BaseModel):
    """What every pipeline recipe names: one model, its prune stage, the evaluation, and a run directory."""

    model_config = ConfigDict(extra="forbid")
    kind: ClassVar[str] = "run"  # its shipped recipes by name: core.recipe_loading.RECIPE_FILES

    name: str = Field(description="Run name (default output: runs/<name>)")
    description: str = Field("", description="What this run shows")
    model: str | None = Field(None, description="Original model: hub id, local directory, .gguf, or embedded[:NAME]")
    prune: PruneRecipe = Field(description="Prune stage (see `layerprune prune --help`)")
    evaluate: EvalSettings = Field(default_factory=lambda: EvalSettings(suite="quick"), description="Evaluation")
    output: Path | None = Field(None, description="Run directory")

    @classmethod
    def load(cls: type[Recipe], name_or_path: str | Path, output: Path | None = None) -> Recipe:
        """Read and validate a recipe (a shipped name or a YAML path); `output` replaces its run directory."""
        return build_from_recipe(cls, cls.kind, name_or_path, {"output": str(output)} if output is not None else {})

    def run_dir(self) -> Path:
        return self.output or run_folder(self.name)


class RunRecipe(PipelineRecipe):
    """prune -> evaluate -> recover -> evaluate -> report, for one model."""

    recover: RecoverStage | None = Field(default_factory=RecoverStage, description="Recover stage; null skips it")
    degeneration: DegenerationStage = Field(
        default_factory=DegenerationStage, description="Degeneration of the models' GSM8K answers in report.md"
    )

    @model_validator(mode="after")
    def _recover_recipe_is_valid(self) -> RunRecipe:
        if self.recover is not None:
            try:
                self.recover.resolve("<pruned>", self.model)
            except ValidationError as exc:
                raise ValueError(validation_message(exc, f"recover recipe '{self.recover.recipe}'")) from None
            except Exception as exc:  # LayerpruneError from a missing recipe: report it as this field's error
                raise ValueError(f"recover.recipe: {exc}") from None
        return self
