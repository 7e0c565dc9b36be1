"""`layerprune recipes list|show|validate|cp`: the shipped recipes, as data.

Each recipe kind lives in its own folder under `layerprune/recipes/` and has a pydantic schema; a new kind is
one line in `RECIPE_KINDS`.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from layerprune.errors import LayerpruneError
from layerprune.registry import unknown_name_message

RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


@dataclass(frozen=True)
class RecipeKind:
    """A family of recipes: a folder under recipes/ and the schema its files follow ('module:Class')."""

    folder: str
    schema: str
    glob: str = "*.yaml"

    def directory(self) -> Path:
        return RECIPES_DIR / self.folder

    def load_schema(self) -> type[BaseModel]:
        module, name = self.schema.split(":")
        return getattr(importlib.import_module(module), name)

    def files(self) -> list[Path]:
        return sorted(self.directory().glob(self.glob)) if self.directory().is_dir() else []


# kind -> where its recipes live and which schema validates them
RECIPE_KINDS: dict[str, RecipeKind] = {
    "recover": RecipeKind("recover", "layerprune.recover.schema:RecoverRecipe"),
    "run": RecipeKind(".", "layerprune.pipeline.recipe:RunRecipe"),
    "study": RecipeKind("studies", "layerprune.pipeline.recipe:RunRecipe", "limits-*.yaml"),
    "importance": RecipeKind("studies", "layerprune.analyze.schemas:ImportanceAnalysis", "importance-*.yaml"),
    "recovery-study": RecipeKind("studies", "layerprune.pipeline.study:RecoveryStudy", "recovery-*.yaml"),
    "variant-study": RecipeKind("studies", "layerprune.pipeline.variant:VariantStudy", "variant-*.yaml"),
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
        if resolved.parent == spec.directory().resolve() and resolved.match(spec.glob):
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
            from layerprune.schema_cli import validation_message

            errors.append(validation_message(exc, f"{schema.__name__} in {path.name}"))
    raise LayerpruneError("; ".join(errors))


def load_recipe(name_or_path: str | Path, kind: str) -> tuple[dict[str, Any], Path]:
    """The raw mapping and file of a recipe of `kind` (validated by the caller, after CLI overrides)."""
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


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="list the shipped recipes")
    listing.add_argument("--kind", choices=list(RECIPE_KINDS), help="only recipes of this kind")
    show = sub.add_parser("show", help="print a recipe file")
    show.add_argument("recipe", help="recipe name or path")
    show.add_argument("--kind", choices=list(RECIPE_KINDS), help="recipe kind when a name is ambiguous")
    validate = sub.add_parser("validate", help="check recipes against their schema (default: every shipped one)")
    validate.add_argument("recipes", nargs="*", help="recipe names or paths")
    validate.add_argument("--kind", choices=list(RECIPE_KINDS), help="schema to check against")
    copy = sub.add_parser("cp", help="copy a shipped recipe to edit it")
    copy.add_argument("recipe", help="recipe name")
    copy.add_argument("destination", type=Path, help="file or directory to copy to")
    copy.add_argument("--kind", choices=list(RECIPE_KINDS), help="recipe kind when a name is ambiguous")
    copy.add_argument("--overwrite", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    return {"list": _list, "show": _show, "validate": _validate, "cp": _copy}[args.recipes_command](args)


def _list(args: argparse.Namespace) -> int:
    for (kind, name), path in shipped_recipes(args.kind).items():
        print(f"{kind:10s} {name:18s} {first_comment(path)}")
    return 0


def _show(args: argparse.Namespace) -> int:
    _, path = find_recipe(args.recipe, args.kind)
    print(path.read_text(encoding="utf-8"), end="")
    return 0


def _validate(args: argparse.Namespace) -> int:
    targets = [find_recipe(r, args.kind) for r in args.recipes] or [(k, p) for (k, _), p in shipped_recipes(args.kind).items()]
    for kind, path in targets:
        found_kind, _ = validate_recipe(path, kind)
        print(f"ok  {found_kind:10s} {path}")
    return 0


def _copy(args: argparse.Namespace) -> int:
    _, path = find_recipe(args.recipe, args.kind)
    target = args.destination / path.name if args.destination.is_dir() else args.destination
    if target.exists() and not args.overwrite:
        raise LayerpruneError(f"{target} already exists; pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, target)
    print(f"copied {path.name} to {target}")
    return 0
