"""Recipes as data: find a shipped recipe by name, read its YAML, merge layers with one precedence rule.

Precedence (one rule, tested): schema defaults < recipe file < explicit overrides (CLI flags, a run's overrides).
Each recipe kind lives in its own folder under `layerprune/recipes/` and has a pydantic schema; a new kind is
one line in `RECIPE_KINDS`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from layerprune.errors import LayerpruneError
from layerprune.registry import unknown_name_message

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"
Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class RecipeKind:
    """A family of recipes: a folder under recipes/ and the schema its files follow ('module:Class')."""

    folder: str
    schema: str
    glob: str = "*.yaml"
    exclude: str | None = None  # a glob of files in the folder that belong to another kind

    def directory(self) -> Path:
        return RECIPES_DIR / self.folder

    def load_schema(self) -> type[BaseModel]:
        module, name = self.schema.split(":")
        return getattr(importlib.import_module(module), name)

    def files(self) -> list[Path]:
        found = sorted(self.directory().glob(self.glob)) if self.directory().is_dir() else []
        return [path for path in found if self.exclude is None or not path.match(self.exclude)]


# kind -> where its recipes live and which schema validates them
RECIPE_KINDS: dict[str, RecipeKind] = {
    "recover": RecipeKind("recover", "layerprune.recover.schema:RecoverRecipe"),  # first tried for unknown kinds
    "prune": RecipeKind("prune", "layerprune.prune.recipe:PruneRecipe"),
    "evaluate": RecipeKind("evaluate", "layerprune.evaluate.schema:EvalSettings"),
    "run": RecipeKind(".", "layerprune.pipeline.recipe:RunRecipe"),
    "study": RecipeKind("studies", "layerprune.pipeline.recipe:RunRecipe", "limits-*.yaml", "limits-sweep-*.yaml"),
    "sweep-study": RecipeKind("studies", "layerprune.pipeline.sweep:SweepStudy", "limits-sweep-*.yaml"),
    "importance": RecipeKind("studies", "layerprune.analyze.schemas:ImportanceAnalysis", "importance-*.yaml"),
    "recovery-study": RecipeKind("studies", "layerprune.pipeline.study:RecoveryStudy", "recovery-*.yaml"),
    "variant-study": RecipeKind("studies", "layerprune.pipeline.variant:VariantStudy", "variant-*.yaml"),
    "variant": RecipeKind("variant", "layerprune.posttrain.schema:VariantRecipe"),
}


def shipped_recipes(kind: str | None = None) -> dict[tuple[str, str], Path]:
    """(kind, name) -> file of every shipped recipe (of one kind, or all)."""
    kinds = [kind] if kind else list(RECIPE_KINDS)
    return {(k, path.stem): path for k in kinds for path in RECIPE_KINDS[k].files()}


def find_recipe(name_or_path: str | Path, kind: str | None = None) -> tuple[str | None, Path]:
    """A shipped recipe by name, or a YAML file by path; returns (kind if known, path)."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise LayerpruneError(f"recipe file not found: {name_or_path}")
        return kind or _kind_of(path), path
    matches = {key: p for key, p in shipped_recipes(kind).items() if key[1] == str(name_or_path)}
    if len(matches) > 1:
        kinds = ", ".join(sorted(k for k, _ in matches))
        raise LayerpruneError(f"recipe '{name_or_path}' exists for several kinds ({kinds}); pass --kind")
    if not matches:
        known = {name for _, name in shipped_recipes(kind)}
        raise LayerpruneError(unknown_name_message("recipe", str(name_or_path), known))
    ((found_kind, _), found), = matches.items()
    return found_kind, found


def _kind_of(path: Path) -> str | None:
    resolved = path.resolve()
    for kind, spec in RECIPE_KINDS.items():
        if resolved.parent == spec.directory().resolve() and resolved.match(spec.glob) and not (
                spec.exclude and resolved.match(spec.exclude)):
            return kind
    return None


def read_recipe_dict(path: Path) -> dict[str, Any]:
    """The YAML mapping in a recipe file (one-line error when it is not one)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise LayerpruneError(f"{path} is not valid YAML: {' '.join(str(exc).split())[:200]}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LayerpruneError(f"{path} must hold a YAML mapping of recipe fields")
    return data


def load_recipe(name_or_path: str | Path, kind: str | None) -> tuple[dict[str, Any], Path]:
    """The raw mapping and file of a recipe of `kind` (validated by the caller, after its overrides)."""
    _, path = find_recipe(name_or_path, kind)
    return read_recipe_dict(path), path


def validate_recipe(path: Path, kind: str | None) -> tuple[str, BaseModel]:
    """Validate a recipe file against its kind's schema (or each kind's, when unknown)."""
    data = read_recipe_dict(path)
    kinds = [kind] if kind else list(RECIPE_KINDS)
    errors = []
    for candidate in kinds:
        schema = RECIPE_KINDS[candidate].load_schema()
        try:
            return candidate, schema.model_validate(data)
        except ValidationError as exc:
            errors.append(validation_message(exc, f"{schema.__name__} in {path.name}"))
    raise LayerpruneError("; ".join(errors))


def first_comment(path: Path) -> str:
    """The command a recipe file shows in its opening comment."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def merge_layers(*layers: dict[str, Any]) -> dict[str, Any]:
    """Merge recipe dicts left to right: later wins, section by section (a section is a nested mapping)."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


def build_schema(schema: type[Model], *layers: dict[str, Any], what: str | None = None) -> Model:
    """Merge layers (later wins) and validate; errors become one line naming the field."""
    try:
        return schema.model_validate(merge_layers(*layers))
    except ValidationError as exc:
        raise LayerpruneError(validation_message(exc, what or schema.__name__)) from exc


def build_from_recipe(schema: type[Model], kind: str | None, recipe: str | Path | None,
                      *overrides: dict[str, Any]) -> Model:
    """Schema defaults < the recipe file (a shipped name or a path; none: defaults only) < each override."""
    named = f"{kind} recipe" if kind else schema.__name__
    if recipe is None:
        return build_schema(schema, *overrides, what=f"{named} (command line)")
    data, path = load_recipe(recipe, kind)
    return build_schema(schema, data, *overrides, what=f"{named} {path}")


def validation_message(exc: ValidationError, what: str) -> str:
    """'invalid PruneRecipe: drop: Input should be greater than or equal to 1'."""
    parts = []
    for error in exc.errors()[:3]:
        loc = ".".join(str(p) for p in error["loc"]) or "value"
        msg = error["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if error["type"] != "extra_forbidden" else f"unknown key '{loc}'")
    return f"invalid {what}: " + "; ".join(parts)
