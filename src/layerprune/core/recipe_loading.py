"""Recipes as data: find a shipped recipe by name, read its YAML, merge layers with one precedence rule.

Precedence (one rule, tested): schema defaults < recipe file < explicit overrides (CLI flags, a run's overrides).
Each recipe kind has its files under `layerprune/recipes/` (`RECIPE_FILES`, here) and a pydantic schema; this base
floor finds and reads recipes by kind and names no schema: a caller passes its schema class (`build_from_recipe`),
and the kind -> schema table for checking any file lives on the top floor (`layerprune.cli.recipe_kinds`). A new
kind is one line in each table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import unknown_name_message

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class RecipeFiles:
    """Where the recipes of one kind live: a folder under recipes/ and the files of it that are theirs."""

    folder: str
    glob: str = "*.yaml"
    exclude: str | None = None  # a glob of files in the folder that belong to another kind

    def directory(self) -> Path:
        return RECIPES_DIR / self.folder

    def files(self) -> list[Path]:
        found = sorted(self.directory().glob(self.glob)) if self.directory().is_dir() else []
        return [path for path in found if self.exclude is None or not path.match(self.exclude)]


# kind -> where its recipes live (its schema: layerprune.cli.recipe_kinds.RECIPE_SCHEMAS, same kinds, same order)
RECIPE_FILES: dict[str, RecipeFiles] = {
    "recover": RecipeFiles("recover"),
    "prune": RecipeFiles("prune"),
    "evaluate": RecipeFiles("evaluate"),
    "run": RecipeFiles("."),
    "study": RecipeFiles("studies", "limits-*.yaml", "limits-sweep-*.yaml"),
    "sweep-study": RecipeFiles("studies", "limits-sweep-*.yaml"),
    "importance": RecipeFiles("studies", "importance-*.yaml"),
    "recovery-study": RecipeFiles("studies", "recovery-*.yaml"),
    "variant-study": RecipeFiles("studies", "variant-*.yaml"),
    "grain-study": RecipeFiles("studies", "grain-*.yaml"),
    "variant": RecipeFiles("variant"),
}


def shipped_recipes(kind: str | None = None) -> dict[tuple[str, str], Path]:
    """(kind, name) -> file of every shipped recipe (of one kind, or all)."""
    kinds = [kind] if kind else list(RECIPE_FILES)
    return {(k, path.stem): path for k in kinds for path in RECIPE_FILES[k].files()}


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
    for kind, spec in RECIPE_FILES.items():
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
