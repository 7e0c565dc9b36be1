"""`layerprune recipes list|show|validate|cp`: the shipped recipes (loading them: `layerprune.core.recipe_loading`).

A grid file's cells are recipes like any other: `list` names each, `show` and `cp` give a cell as the recipe it
resolves to (its grid's fields and its labels' merged), `validate` checks every cell."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from layerprune.cli.recipe_kinds import RECIPE_SCHEMAS, validate_recipe
from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.core.recipe_loading import find_recipe, load_recipe, shipped_command, shipped_grids, shipped_recipes


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="list the shipped recipes")
    listing.add_argument("--kind", choices=list(RECIPE_SCHEMAS), help="only recipes of this kind")
    show = sub.add_parser("show", help="print a recipe file")
    show.add_argument("recipe", help="recipe name or path")
    show.add_argument("--kind", choices=list(RECIPE_SCHEMAS), help="recipe kind when a name is ambiguous")
    validate = sub.add_parser("validate", help="check recipes against their schema (default: every shipped one)")
    validate.add_argument("recipes", nargs="*", help="recipe names or paths")
    validate.add_argument("--kind", choices=list(RECIPE_SCHEMAS), help="schema to check against")
    copy = sub.add_parser("cp", help="copy a shipped recipe to edit it")
    copy.add_argument("recipe", help="recipe name")
    copy.add_argument("destination", type=Path, nargs="?", help="file or directory to copy to (or -o)")
    copy.add_argument("-o", "--output", type=Path, help="file or directory to copy to")
    copy.add_argument("--kind", choices=list(RECIPE_SCHEMAS), help="recipe kind when a name is ambiguous")
    copy.add_argument("--overwrite", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    return {"list": _list, "show": _show, "validate": _validate, "cp": _copy}[args.recipes_command](args)


def _list(args: argparse.Namespace) -> int:
    grids = {grid for _, grid in shipped_grids(args.kind)}
    for (kind, name), path in shipped_recipes(args.kind).items():
        grid = f"  [grid {path.stem}]" if path.stem in grids else ""
        print(f"{kind:14s} {name:40s} {shipped_command(kind, name)}{grid}")
    return 0


def _show(args: argparse.Namespace) -> int:
    kind, path = find_recipe(args.recipe, args.kind)
    print(_text(args.recipe, kind, path), end="")
    return 0


def _text(recipe: str, kind: str | None, path: Path) -> str:
    """A recipe file as written, or a grid's cell as the recipe it resolves to."""
    if path.stem == recipe or Path(recipe).is_file():
        return path.read_text(encoding="utf-8")
    data, _ = load_recipe(recipe, kind)
    return (f"# {recipe}: a cell of the grid {path.name}, resolved\n"
            + yaml.safe_dump({"kind": kind, **data}, sort_keys=False, width=118))


def _validate(args: argparse.Namespace) -> int:
    targets = [(r, None) for r in args.recipes] or [
        (name, kind) for (kind, name) in shipped_recipes(args.kind)]
    for recipe, kind in targets:
        found_kind, _ = validate_recipe(recipe, kind or args.kind)
        print(f"ok  {found_kind:14s} {recipe}")
    return 0


def _copy(args: argparse.Namespace) -> int:
    if (args.destination is None) == (args.output is None):
        raise LayerpruneError("recipes cp: give the destination once (DESTINATION or -o/--output)")
    destination = args.destination or args.output
    kind, path = find_recipe(args.recipe, args.kind)
    name = f"{args.recipe}.yaml" if path.stem != args.recipe else path.name
    target = destination / name if destination.is_dir() else destination
    if target.exists() and not args.overwrite:
        raise LayerpruneError(f"{target} already exists; pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, _text(args.recipe, kind, path))
    print(f"copied {args.recipe} to {target}")
    return 0
