"""Recipes as data: find a shipped recipe by name, read its YAML, merge layers with one precedence rule.

Precedence (one rule, tested): schema defaults < recipe file < explicit overrides (CLI flags, a run's overrides).

A recipe file says what it is: `kind: NAME` (the kind -> schema table lives on the top floor,
`layerprune.cli.recipe_kinds.RECIPE_SCHEMAS`; this floor names no schema). Two more keys are read here and never
reach a schema:
- `base: NAME` (a shipped recipe, or a path relative to the file): the file holds only what differs from its base,
  merged over it key by key at any depth; a base may have a base; a missing or circular one is a one-line error.
- `grid: {AXIS: {LABEL: FIELDS}}`: the file is a grid of recipes, one cell per combination of one label from each
  axis (in the file's order), each the file's other fields with its labels' FIELDS merged over them. `name`,
  `output` and `description` are templates: `{AXIS}` is the label (or the label's `tag:` where it sets one) and
  `{a.b}` a field of the resolved cell. A cell is named by its `name`, or by the grid's `cells:` template where the
  schema has no name. A shipped cell is found by its name like a file; the grid's own name (its file) lists them.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from layerprune.core.errors import LayerpruneError
from layerprune.core.registry import unknown_name_message

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
RETIRED_KINDS = {  # a kind that is gone -> what replaces it, said in one line to a file still naming it
    "recovery-study": "kind recovery-study is gone (issue 56): a recovery study is a sweep at one cut, "
                      "`kind: sweep-study` with `ratios: [N]` (N = prune.drop, or the count of prune.layers), "
                      "evaluate.only split into classification and fixed (and probes: null where there is no gate); "
                      "see the shipped recovery-*.yaml recipes",
                 "grain-study": "kind grain-study is gone (issue 56): a grain study is a sweep with a grains section, "
                                "`kind: sweep-study` with `ratios` (the levels), `grains: {compare, match, tolerance, "
                                "speed_repeats, gates}`, the arm in `arms`, evaluate.only split into classification "
                                "and fixed, probes: null and gsm8k_gate: null; see the shipped grain-*.yaml recipes"}
Model = TypeVar("Model", bound=BaseModel)
TEMPLATED = ("name", "output", "description")  # a grid's fields formatted per cell
PLACEHOLDER = re.compile(r"\{([\w.-]+)\}")


@dataclass(frozen=True)
class Shipped:
    """One shipped recipe: its kind, the file it lives in, and its cell when the file is a grid."""

    kind: str
    path: Path
    cell: str | None = None


def shipped_recipes(kind: str | None = None) -> dict[tuple[str, str], Path]:
    """(kind, name) -> file of every shipped recipe, a grid's cells included (of one kind, or all)."""
    return {key: found.path for key, found in _shipped().items() if kind is None or key[0] == kind}


def shipped_grids(kind: str | None = None) -> dict[tuple[str, str], list[str]]:
    """(kind, grid name) -> its cells' names, for every shipped grid file."""
    return {(k, path.stem): list(cells) for (k, _), (path, cells) in _grid_files().items()
            if kind is None or k == kind}


def _grid_files() -> dict[tuple[str, str], tuple[Path, tuple[str, ...]]]:
    """(kind, grid file's name) -> (its file, its cells in order), from the one index of the shipped recipes."""
    found: dict[tuple[str, str], tuple[Path, tuple[str, ...]]] = {}
    for (kind, name), shipped in _shipped().items():
        if shipped.cell is not None:
            path, cells = found.get((kind, shipped.path.stem), (shipped.path, ()))
            found[(kind, shipped.path.stem)] = (path, (*cells, name))
    return found


@functools.cache
def _shipped() -> dict[tuple[str, str], Shipped]:
    found: dict[tuple[str, str], Shipped] = {}
    for path in _recipe_files():
        data = resolved_file(path)
        kind = data.get("kind")
        if not isinstance(kind, str):
            raise LayerpruneError(f"shipped recipe {path} says no `kind:`")
        names = [(name, name) for name in grid_cells(data, path)] if "grid" in data else [(path.stem, None)]
        for name, cell in names:
            if (kind, name) in found:
                raise LayerpruneError(f"two shipped {kind} recipes are named '{name}' ({found[kind, name].path}, "
                                      f"{path})")
            found[(kind, name)] = Shipped(kind, path, cell)
    return found


def forget_shipped() -> None:
    """Read the shipped recipes again on the next look-up (they are indexed once per process)."""
    _shipped.cache_clear()


def _recipe_files() -> list[Path]:
    return sorted(RECIPES_DIR.rglob("*.yaml"))


def find_recipe(name_or_path: str | Path, kind: str | None = None) -> tuple[str | None, Path]:
    """A shipped recipe by name, or a YAML file by path; returns (kind if known, path)."""
    found = _locate(name_or_path, kind)
    return found.kind or None, found.path


def _locate(name_or_path: str | Path, kind: str | None) -> Shipped:
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise LayerpruneError(f"recipe file not found: {name_or_path}")
        return Shipped(kind or str(resolved_file(path).get("kind") or ""), path)
    matches = {key: found for key, found in _shipped().items()
               if key[1] == str(name_or_path) and kind in (None, key[0])}
    grids = {key: path for key, (path, _) in _grid_files().items()
             if key[1] == str(name_or_path) and kind in (None, key[0])}
    if len(matches) + len(grids) > 1:
        kinds = ", ".join(sorted(k for k, _ in [*matches, *grids]))
        raise LayerpruneError(f"recipe '{name_or_path}' exists for several kinds ({kinds}); pass --kind")
    if grids:
        ((found_kind, _), grid), = grids.items()
        return Shipped(found_kind, grid)
    if not matches:
        known = {name for k, name in [*_shipped(), *_grid_files()] if kind in (None, k)}
        raise LayerpruneError(unknown_name_message("recipe", str(name_or_path), known))
    (found,) = matches.values()
    return found


@functools.cache
def unique_key_loader() -> Any:
    """PyYAML's SafeLoader refusing a mapping that names a key twice (safe_load keeps the last one, silently: a
    recipe with `drop: 3` and later `drop: 4` would run 4 with no word); merge keys (`<<`) still override."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError("while reading a mapping", node.start_mark,
                                                            f"the key {key!r} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def read_recipe_dict(path: Path) -> dict[str, Any]:
    """The YAML mapping in a recipe file, as written (one-line error when it is not one, or names a key twice)."""
    import yaml

    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=unique_key_loader())  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        raise LayerpruneError(f"{path} is not valid YAML: {' '.join(str(exc).split())[:200]}") from exc
    except UnicodeDecodeError as exc:
        raise LayerpruneError(f"{path} is not a text file (not UTF-8 at byte {exc.start}); a recipe is YAML") from exc
    except OSError as exc:
        raise LayerpruneError(f"cannot read recipe {path}: {exc.strerror or exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise LayerpruneError(f"{path} must hold a YAML mapping of recipe fields")
    return data


def resolved_file(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file with its `base` chain merged under it (`kind` and `grid` kept, `base` gone)."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.stem for p in (*seen, path))
        raise LayerpruneError(f"recipe {seen[0].name}: circular base ({chain})")
    data = read_recipe_dict(path)
    if data.get("kind") in RETIRED_KINDS:
        raise LayerpruneError(f"{path.name}: {RETIRED_KINDS[data['kind']]}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise LayerpruneError(f"recipe {path.name}: base must name one recipe (a shipped name or a path)")
    parent = resolved_file(_base_path(base, path), (*seen, path))
    if "kind" in data and "kind" in parent and data["kind"] != parent["kind"]:
        raise LayerpruneError(f"recipe {path.name} is a {data['kind']} recipe; its base '{base}' is a "
                              f"{parent['kind']} recipe")
    return deep_merge(parent, data)


def _base_path(base: str, child: Path) -> Path:
    """A base's file: a path beside the child, or a shipped recipe file by name (a grid's file, never one cell)."""
    beside = child.parent / base
    if beside.suffix in (".yaml", ".yml"):
        if not beside.is_file():
            raise LayerpruneError(f"recipe {child.name}: base file not found: {beside}")
        return beside
    files = [path for path in _recipe_files() if path.stem == base]
    if len(files) != 1:
        known = {path.stem for path in _recipe_files()}
        raise LayerpruneError(f"recipe {child.name}: base " + (
            unknown_name_message("recipe", base, known) if not files else
            f"'{base}' names {len(files)} shipped files; give its path relative to {child.name}"))
    return files[0]


def deep_merge(under: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged into `under` at every depth (a mapping over a mapping merges; anything else replaces)."""
    merged = dict(under)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class GridCell:
    """One cell of a grid: its name, the label it takes on each axis (axis -> label), and its recipe mapping."""

    name: str
    labels: dict[str, str]
    data: dict[str, Any]


def grid_cells(data: Mapping[str, Any], path: Path) -> dict[str, dict[str, Any]]:
    """A grid's cells by name, each a recipe mapping (no `kind`, `grid`); in the file's axis order."""
    return {cell.name: cell.data for cell in grid_expansion(data, path)}


def grid_expansion(data: Mapping[str, Any], path: Path) -> list[GridCell]:
    """A grid's cells in the file's axis order, each with its labels (see `grid_cells`)."""
    grid = data["grid"]
    if not isinstance(grid, Mapping) or not grid or not all(
            isinstance(values, Mapping) and values for values in grid.values()):
        raise LayerpruneError(f"recipe {path.name}: grid must map each axis to its labels and their fields")
    common = {key: value for key, value in data.items() if key not in ("kind", "grid", "cells")}
    cells: dict[str, GridCell] = {}
    for combination in itertools.product(*(list(values.items()) for values in grid.values())):
        cell, tags = dict(common), {}
        for axis, (label, fields) in zip(grid, combination, strict=True):
            fields = dict(fields or {})
            tags[axis] = str(fields.pop("tag", label))
            cell = deep_merge(cell, fields)
        cell = _formatted(cell, tags, path)
        name = _cell_name(data.get("cells"), cell, tags, path)
        if name in cells:
            raise LayerpruneError(f"recipe {path.name}: two cells are named '{name}' (the name template must use "
                                  "every axis)")
        labels = {axis: str(label) for axis, (label, _) in zip(grid, combination, strict=True)}
        cells[name] = GridCell(name, labels, cell)
    return list(cells.values())


def load_grid(name_or_path: str | Path, kind: str | None) -> tuple[dict[str, Any], Path, str | None] | None:
    """When a recipe is a grid or one of its cells: the grid file's mapping (its base merged in, `kind` and `grid`
    kept), the file, and the cell named (None: the whole grid). None for a recipe that is no grid."""
    found = _locate(name_or_path, kind)
    data = resolved_file(found.path)
    if "grid" not in data:
        return None
    if kind is not None and data.get("kind", kind) != kind:
        raise LayerpruneError(f"{found.path.name} is a {data['kind']} recipe (its `kind:`), not a {kind} recipe")
    return data, found.path, found.cell


def _cell_name(template: Any, cell: Mapping[str, Any], tags: Mapping[str, str], path: Path) -> str:
    if isinstance(template, str):
        return PLACEHOLDER.sub(lambda m: _placeholder(m.group(1), cell, tags, path), template)
    if isinstance(cell.get("name"), str):
        return str(cell["name"])
    raise LayerpruneError(f"recipe {path.name}: a grid names its cells by a `name` template (or `cells:` where its "
                          "schema has no name)")


def _formatted(cell: dict[str, Any], tags: dict[str, str], path: Path) -> dict[str, Any]:
    for field in TEMPLATED:  # name first: output and description may use {name}
        if isinstance(cell.get(field), str):
            cell[field] = PLACEHOLDER.sub(lambda m: _placeholder(m.group(1), cell, tags, path), cell[field])
    return cell


def _placeholder(key: str, cell: Mapping[str, Any], tags: Mapping[str, str], path: Path) -> str:
    if key in tags:
        return tags[key]
    value: Any = cell
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise LayerpruneError(f"recipe {path.name}: '{{{key}}}' names no axis and no field of the cell")
        value = value[part]
    return str(value)


def load_recipe(name_or_path: str | Path, kind: str | None) -> tuple[dict[str, Any], Path]:
    """The raw mapping and file of one recipe of `kind` (validated by the caller, after its overrides): its base
    merged in, its cell taken from a grid, `kind` gone."""
    found = _locate(name_or_path, kind)
    data = resolved_file(found.path)
    if kind is not None and data.get("kind", kind) != kind:
        raise LayerpruneError(f"{found.path.name} is a {data['kind']} recipe (its `kind:`), not a {kind} recipe")
    if "grid" in data:
        cells = grid_cells(data, found.path)
        if found.cell is None:
            raise LayerpruneError(f"recipe '{name_or_path}' is a grid of {len(cells)} recipes; name one: "
                                  + ", ".join(cells))
        data = cells[found.cell]
    data.pop("kind", None)
    return data, found.path


def shipped_command(kind: str, name: str) -> str:
    """The command a shipped recipe shows in its file's opening comment (a grid's header shows its first cell's: a
    cell shows it with its own name)."""
    path = shipped_recipes(kind)[(kind, name)]
    command = first_comment(path)
    grid = _grid_files().get((kind, path.stem))
    return command.replace(grid[1][0], name, 1) if grid else command


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
