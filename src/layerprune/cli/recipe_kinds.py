"""Recipe kind -> the schema its files follow: the one table of kinds, on the top floor, the one floor that may name
every stage's and the pipeline's schemas.

A recipe file says its kind (`kind: NAME`); the base floor (`layerprune.core.recipe_loading`) finds and reads recipes by
that kind and names no schema (a pipeline or stage caller passes its own schema class to `build_from_recipe`). A file
that says no kind is tried against each schema in this table's order.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import find_recipe, load_recipe, validation_message
from layerprune.core.registry import unknown_name_message
from layerprune.evaluate.schema import EvalSettings
from layerprune.pipeline.recipe import RunRecipe
from layerprune.pipeline.studies.sweep_grid import SweepStudy
from layerprune.pipeline.studies.variant_grid import VariantStudy
from layerprune.posttrain.schema import VariantRecipe
from layerprune.prune.recipe import PruneRecipe
from layerprune.recover.schema import RecoverRecipe

RECIPE_SCHEMAS: dict[str, type[BaseModel]] = {
    "recover": RecoverRecipe,  # first tried for a file of unknown kind
    "prune": PruneRecipe,
    "evaluate": EvalSettings,
    "run": RunRecipe,
    "sweep-study": SweepStudy,
    "importance": ImportanceAnalysis,
    "variant-study": VariantStudy,
    "variant": VariantRecipe,
}


def check_kind(kind: str | None, path: Path) -> None:
    """One line for a kind this table does not hold (a file's `kind:` misspelled), with the close ones."""
    if kind is not None and kind not in RECIPE_SCHEMAS:
        raise LayerpruneError(f"{path.name}: " + unknown_name_message("recipe kind", kind, set(RECIPE_SCHEMAS)))


def validate_recipe(recipe: str | Path, kind: str | None) -> tuple[str, BaseModel]:
    """Validate one recipe (a file, or a shipped name: a grid's cell too) against its kind's schema, or each kind's in
    turn when it says none: (kind, recipe)."""
    found_kind, path = find_recipe(recipe, kind)
    check_kind(found_kind, path)
    kind = kind or found_kind
    data, _ = load_recipe(recipe, kind)
    errors = []
    for candidate in [kind] if kind else list(RECIPE_SCHEMAS):
        schema = RECIPE_SCHEMAS[candidate]
        try:
            return candidate, schema.model_validate(data)
        except ValidationError as exc:
            errors.append(validation_message(exc, f"{schema.__name__} in {path.name}"))
    raise LayerpruneError("; ".join(errors))
