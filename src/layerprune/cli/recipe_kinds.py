"""Recipe kind -> the schema its files follow: the top floor's table, the one floor that may name every stage's
and the pipeline's schemas.

Where a kind's files live is the base floor's `layerprune.core.recipe_loading.RECIPE_FILES`; that floor finds and reads
recipes by kind and names no schema (a pipeline or stage caller passes its own schema class to
`build_from_recipe`). The two tables list the same kinds in the same order (tests/test_recipes.py); the first is
tried first for a file of unknown kind.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import read_recipe_dict, validation_message
from layerprune.evaluate.schema import EvalSettings
from layerprune.pipeline.recipe import RunRecipe
from layerprune.pipeline.studies.grain import GrainStudy
from layerprune.pipeline.studies.recovery import RecoveryStudy
from layerprune.pipeline.studies.sweep import SweepStudy
from layerprune.pipeline.studies.variant import VariantStudy
from layerprune.posttrain.schema import VariantRecipe
from layerprune.prune.recipe import PruneRecipe
from layerprune.recover.schema import RecoverRecipe

RECIPE_SCHEMAS: dict[str, type[BaseModel]] = {
    "recover": RecoverRecipe,  # first tried for a file of unknown kind
    "prune": PruneRecipe,
    "evaluate": EvalSettings,
    "run": RunRecipe,
    "study": RunRecipe,
    "sweep-study": SweepStudy,
    "importance": ImportanceAnalysis,
    "recovery-study": RecoveryStudy,
    "variant-study": VariantStudy,
    "grain-study": GrainStudy,
    "variant": VariantRecipe,
}


def validate_recipe(path: Path, kind: str | None) -> tuple[str, BaseModel]:
    """Validate a recipe file against its kind's schema (or each kind's in turn, when unknown): (kind, recipe)."""
    data = read_recipe_dict(path)
    errors = []
    for candidate in [kind] if kind else list(RECIPE_SCHEMAS):
        schema = RECIPE_SCHEMAS[candidate]
        try:
            return candidate, schema.model_validate(data)
        except ValidationError as exc:
            errors.append(validation_message(exc, f"{schema.__name__} in {path.name}"))
    raise LayerpruneError("; ".join(errors))
