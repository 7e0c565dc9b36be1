"""`layerprune recipes list|show|validate|cp`: the shipped recipes (loading them: `layerprune.core.recipe_loading`)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from layerprune.cli.recipe_kinds import RECIPE_SCHEMAS, validate_recipe
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import RECIPE_FILES, find_recipe, first_comment, shipped_recipes


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recipes_command", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="list the shipped recipes")
    listing.add_argument("--kind", choices=list(RECIPE_FILES), help="only recipes of this kind")
    show = sub.add_parser("show", help="print a recipe file")
    show.add_argument("recipe", help="recipe name or path")
    show.add_argument("--kind", choices=list(RECIPE_FILES), help="recipe kind when a name is ambiguous")
    validate = sub.add_parser("validate", help="check recipes against their schema (default: every shipped one)")
    validate.add_argument("recipes", nargs="*", help="recipe names or paths")
    validate.add_argument("--kind", choices=list(RECIPE_SCHEMAS), help="schema to check against")
    copy = sub.add_parser("cp", help="copy a shipped recipe to edit it")
    copy.add_argument("recipe", help="recipe name")
    copy.add_argument("destination", type=Path, nargs="?", help="file or directory to copy to (or -o)")
    copy.add_argument("-o", "--output", type=Path, help="file or directory to copy to")
    copy.add_argument("--kind", choices=list(RECIPE_FILES), help="recipe kind when a name is ambiguous")
    copy.add_argument("--overwrite", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    return {"list": _list, "show": _show, "validate": _validate, "cp": _copy}[args.recipes_command](args)


def _list(args: argparse.Namespace) -> int:
    for (kind, name), path in shipped_recipes(args.kind).items():
        print(f"{kind:14s} {name:34s} {first_comment(path)}")
    return 0


def _show(args: argparse.Namespace) -> int:
    _, path = find_recipe(args.recipe, args.kind)
    print(path.read_text(encoding="utf-8"), end="")
    return 0


def _validate(args: argparse.Namespace) -> int:
    shipped = [(kind, path) for (kind, _), path in shipped_recipes(args.kind).items()]
    targets = [find_recipe(r, args.kind) for r in args.recipes] or shipped
    for kind, path in targets:
        found_kind, _ = validate_recipe(path, kind)
        print(f"ok  {found_kind:14s} {path}")
    return 0


def _copy(args: argparse.Namespace) -> int:
    if (args.destination is None) == (args.output is None):
        raise LayerpruneError("recipes cp: give the destination once (DESTINATION or -o/--output)")
    destination = args.destination or args.output
    _, path = find_recipe(args.recipe, args.kind)
    target = destination / path.name if destination.is_dir() else destination
    if target.exists() and not args.overwrite:
        raise LayerpruneError(f"{target} already exists; pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, target)
    print(f"copied {path.name} to {target}")
    return 0
