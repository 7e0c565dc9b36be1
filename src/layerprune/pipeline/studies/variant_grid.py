"""The variant study as data: its recipe (VariantStudy: the model, its posttrain variant or recover recipe, the seeds
it is made under, the importance analysis, the control), read by the runner (variant.py) and the report
(variant_report.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from layerprune.analyze.schemas import ImportanceAnalysis, NmiAnalysis
from layerprune.core.outputs import run_folder
from layerprune.core.recipe_loading import build_from_recipe, merge_layers, validation_message
from layerprune.pipeline.recipe import RecoverStage
from layerprune.posttrain.schema import VariantRecipe
from layerprune.posttrain.spec import VARIANT_SEED

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


STUDY_OWNED = ("models", "output", "overwrite", "dry_run", "tokenizers")  # importance fields the study sets itself


NMI_OWNED = ("model", "output", "overwrite", "critical_from", "critical_task")  # and its nmi fields


class PosttrainVariant(BaseModel):
    """The variant made by a posttrain recipe (sft, rft, grpo, distill) from the study's model."""

    model_config = ConfigDict(extra="forbid")

    posttrain: str = Field(description="Variant recipe: a shipped name (layerprune recipes list --kind variant) or a "
                                       "YAML path; its model is replaced by the study's")
    overrides: dict[str, Any] = Field(default_factory=dict, description="Variant-recipe fields to change (nested by "
                                                                        "section)")

    def resolve(self, model: str) -> VariantRecipe:
        return build_from_recipe(VariantRecipe, "variant", self.posttrain, merge_layers(self.overrides,
                                                                                          {"model": model}))


class ControlSpec(BaseModel):
    """The positive control: a model whose critical blocks must differ, so that the comparison can fail."""

    model_config = ConfigDict(extra="forbid")

    skip_block: Literal["critical", "critical-alive"] | int = Field(
        "critical", description="The original's block dropped to make the control (compared with the original on "
        "the remaining blocks): 'critical' (the largest drop on the target task), 'critical-alive' (the largest "
        "drop among the blocks whose removal leaves the original above the analysis's min_base_score on every "
        "task, so the control has drops to compare) or a block index")


class VariantStudy(BaseModel):
    """Original vs its post-trained variant: the same importance analysis on both, compared block by block."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Study name (default output: runs/<name>)")
    description: str = Field("", description="What this study shows")
    model: str = Field("embedded", description="The original model: hub id, local directory, .gguf or embedded[:NAME]")
    variant: RecoverStage | PosttrainVariant = Field(
        description="How the variant is made: {recipe, overrides}, a recover recipe run on the unpruned model with "
        "itself as the teacher; or {posttrain, overrides}, a posttrain variant recipe")
    variant_seeds: list[int] = Field(
        default_factory=lambda: [VARIANT_SEED], min_length=1,
        description="Seeds the posttrain variant is made under, each made once (cached) and scored on the same "
        "items: the report gives the make-to-make SD of the variant's scores, and with two or more the verdict's "
        "intervals resample the seeds, then the items (default: the one seed `variant:NAME` names)")
    importance: dict[str, Any] = Field(default_factory=dict, description="`analyze importance` fields (tasks, "
                                                                         "metric, samples, ...) used for both models")
    resamples: int = Field(1000, ge=100, description="Bootstrap resamples of the items for the agreement intervals")
    alpha: float = Field(0.05, gt=0, lt=1, description="The intervals are (1 - alpha) percentile intervals")
    target: str | None = Field(None, description="The task whose unablated score the variant must move (paired, "
                                                 "on the importance items) for the verdict to be 'invariant'")
    min_shift: float = Field(0.10, gt=0, le=1,
                             description="The least rise of the target score (0.10: 10 points), its interval above 0")
    bar: float = Field(0.9, gt=0, le=1, description="'invariant' needs agreement / ceiling at least this")
    splits: int = Field(4, ge=1, description="Random halvings of the items the split-half ceiling averages over")
    control: ControlSpec | None = Field(None, description="The positive control (none: the verdict is 'not shown')")
    nmi: dict[str, Any] | None = Field(None, description="`analyze nmi` fields (calib, samples, k, ...) run on both "
                                       "models, each with its critical blocks on the target task from the importance "
                                       "report (paper A's NMI near the critical blocks); none: not run")
    output: Path | None = Field(None, description="Study directory")

    @model_validator(mode="after")
    def _sections_are_valid(self) -> VariantStudy:
        owned = sorted(set(self.importance) & set(STUDY_OWNED))
        if owned:
            raise ValueError(f"importance sets {owned}, which the study sets itself")
        owned = sorted(set(self.nmi or {}) & set(NMI_OWNED))
        if owned:
            raise ValueError(f"nmi sets {owned}, which the study sets itself")
        try:
            config = self.importance_config(Path("<variant>"))
            if isinstance(self.variant, RecoverStage):
                self.recover_recipe()
        except ValidationError as exc:
            raise ValueError(validation_message(exc, "variant study section")) from None
        if self.nmi is not None:
            self.nmi_config("original", Path("<importance.json>"), "<task>")
        if self.target is not None and self.target not in config.tasks:
            raise ValueError(f"target {self.target!r} is not one of the importance tasks {config.tasks}")
        if isinstance(self.control, ControlSpec) and isinstance(self.control.skip_block, int) \
                and self.control.skip_block < 0:
            raise ValueError("control.skip_block must be 'critical' or a block index >= 0")
        self._check_seeds()
        return self

    def _check_seeds(self) -> None:
        if len(set(self.variant_seeds)) != len(self.variant_seeds) or min(self.variant_seeds) < 0:
            raise ValueError(f"variant_seeds must be distinct seeds >= 0, got {self.variant_seeds}")
        if isinstance(self.variant, RecoverStage) and self.variant_seeds != [VARIANT_SEED]:
            raise ValueError("variant_seeds needs a posttrain variant ({posttrain: ...}); a recover variant is made "
                             "under the run's --seed")

    def replicated(self) -> bool:
        """Whether the variant is made under several seeds (the report's intervals then resample them)."""
        return len(self.variant_seeds) > 1

    def importance_dir(self, seed: int) -> str:
        """The folder of the importance analysis of the variant made under `seed`: importance/ for the first seed
        (the one a study of one seed has), importance-seed<N>/ for the others."""
        return "importance" if seed == self.variant_seeds[0] else f"importance-seed{seed}"

    def record(self) -> dict[str, Any]:
        """The study as variant.json keeps it; variant_seeds only where it is not the default, so a study of the one
        default seed is recorded (and fingerprinted by `layerprune records`) as it was before the field."""
        default = self.variant_seeds == [VARIANT_SEED]
        return self.model_dump(mode="json", exclude={"variant_seeds"} if default else None)

    def target_task(self, tasks: list[str]) -> str:
        return self.target or tasks[0]

    def run_dir(self) -> Path:
        return self.output or run_folder(self.name)

    def recover_recipe(self) -> Any:
        """The recover recipe that makes the variant: the original model learns from its own answers."""
        assert isinstance(self.variant, RecoverStage)
        return self.variant.resolve(self.model, self.model)

    def posttrain_recipe(self) -> VariantRecipe:
        assert isinstance(self.variant, PosttrainVariant)
        return self.variant.resolve(self.model)

    def importance_config(self, variant_dir: Path) -> ImportanceAnalysis:
        return ImportanceAnalysis.model_validate({**self.importance, "models": [self.model, str(variant_dir)]})

    def nmi_config(self, model: str, report: Path, task: str) -> NmiAnalysis:
        """`analyze nmi` on one model, its critical blocks read from the study's importance report on `task`."""
        data_dir = self.importance.get("data_dir")
        try:
            return NmiAnalysis.model_validate({**({"data_dir": data_dir} if data_dir else {}), **(self.nmi or {}),
                                               "model": model, "critical_from": str(report), "critical_task": task})
        except ValidationError as exc:
            raise ValueError(validation_message(exc, "variant study nmi section")) from None


def load_variant_study(name_or_path: str, output: Path | None = None) -> VariantStudy:
    """Read and validate a variant-study recipe (a shipped name or a YAML path); `output` replaces its directory."""
    return build_from_recipe(VariantStudy, "variant-study", name_or_path,
                             {"output": str(output)} if output is not None else {})
