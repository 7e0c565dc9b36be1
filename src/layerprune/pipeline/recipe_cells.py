"""The recipes one command runs: one recipe, or a grid named by its file (every cell, or the cells named), each on
the recipe's model or on the user's (`--model X`, layerprune.pipeline.on_model)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import GridCell, build_schema, grid_expansion, load_grid, load_recipe
from layerprune.core.registry import unknown_name_message
from layerprune.core.settings import RunSettings
from layerprune.pipeline.on_model import Target, grid_on_model, leaves, model_axis, recipe_on_model, target_model

Schema = TypeVar("Schema", bound=BaseModel)
PROSE = ("name", "description", "output")


@dataclass(frozen=True)
class Selection:
    """What a command was asked to run: its cells (one for a plain recipe or a named cell), the grid file when the
    recipe names a whole grid, and what --model decided."""

    recipe: str
    path: Path
    cells: list[GridCell]
    grid: str | None = None
    notes: list[str] = field(default_factory=list)

    def varying(self) -> list[str]:
        """The fields (dotted) whose values differ between the cells, name, description and output left out."""
        flat = [dict(leaves(cell.data)) for cell in self.cells]
        keys = sorted({key for leaf in flat for key in leaf if key[0] not in PROSE})
        return [".".join(key) for key in keys if len({repr(leaf.get(key)) for leaf in flat}) > 1]

    def build(self, schema: type[Schema], cell: GridCell, *overrides: dict[str, Any]) -> Schema:
        """A cell validated against its kind's schema: defaults < the cell < each override."""
        what = f"{getattr(schema, 'kind', schema.__name__)} recipe {self.path}" + (
            f" (cell {cell.name})" if self.grid else "")
        return build_schema(schema, cell.data, *overrides, what=what)

    def listing(self) -> str:
        """The grid's cells, one line each (name and labels), then the fields that vary and each cell's values."""
        varying = self.varying()
        axes = " x ".join(self.cells[0].labels) if self.cells and self.cells[0].labels else "none"
        count = f"{len(self.cells)} cell" + ("s" if len(self.cells) != 1 else "")
        lines = [f"grid '{self.grid}' ({self.path.name}): {count} over {axes}", *self.notes]
        lines.append(f"varying: {', '.join(varying) or 'nothing'}")
        for cell in self.cells:
            flat = dict(leaves(cell.data))
            labels = " ".join(f"{axis}={label}" for axis, label in cell.labels.items())
            values = "; ".join(f"{key}={_short(flat[tuple(key.split('.'))])}" for key in varying
                               if flat.get(tuple(key.split("."))) is not None)
            lines.append(f"  {cell.name}  [{labels}]" + (f"  {values}" if values else ""))
        return "\n".join(lines)

    def dry_run(self, plans: Sequence[str]) -> str:
        """The dry run: a grid's listing, then each cell's plan under its name; a single recipe's plan alone."""
        if not self.grid:
            return "\n".join([*self.notes, *plans])
        sections = [f"\n== cell {i}/{len(plans)}: {cell.name}\n{plan}"
                    for i, (cell, plan) in enumerate(zip(self.cells, plans, strict=True), 1)]
        return self.listing() + "\n" + "\n".join(sections)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 48 else text[:45] + "..."


def select_cells(recipe: str, kind: str | None, settings: RunSettings, model: str | None = None,
                 drop: int | None = None, names: Sequence[str] = ()) -> Selection:
    """The cells a command runs: a plain recipe or one named cell alone; a grid's every cell, or the ones named;
    with `model`, on the user's model (a grid's model axis collapsed to it)."""
    if drop is not None and model is None:
        raise LayerpruneError("--drop sets how many blocks the model --model names loses: give it with --model")
    target = target_model(model, drop, settings) if model is not None else None
    found = load_grid(recipe, kind)
    if found is None:
        if names:
            raise LayerpruneError(f"--cell: '{recipe}' is one recipe, not a grid")
        data, path = load_recipe(recipe, kind)
        data = recipe_on_model(data, target, recipe) if target else data
        return Selection(recipe, path, [GridCell(str(data.get("name", path.stem)), {}, data)],
                         notes=_notes([data], target))
    data, path, cell = found
    if cell is not None and names:
        raise LayerpruneError(f"--cell: '{recipe}' is already one cell of the grid {path.stem}; name the grid")
    cells, target = _picked(grid_expansion(data, path), [cell] if cell else list(names), target, data, path,
                            settings, recipe)
    return Selection(recipe, path, cells, None if cell else path.stem, _notes([c.data for c in cells], target))


def _picked(cells: list[GridCell], names: list[str], target: Target | None, data: Mapping[str, Any], path: Path,
            settings: RunSettings, recipe: str) -> tuple[list[GridCell], Target | None]:
    """The named cells (all where none is named), on the user's model where one is given (with the count it
    takes). A name is a cell of the grid as shipped, or, with --model, one of the cells on the user's model (as its
    dry run lists them)."""
    shipped = {cell.name: cell for cell in cells}
    if target is None:
        _check_names(names, shipped, path)
        return [cell for cell in cells if not names or cell.name in names], None  # in the grid's order
    named = [shipped[name] for name in names if name in shipped]
    mapped, axis, target = grid_on_model(data, _axis_labels(data, named) if named else None, target, settings,
                                         recipe)
    moved = grid_expansion(mapped, path)
    _check_names([n for n in names if n not in shipped], {c.name: c for c in moved} | shipped, path)
    wanted = {_others(cell.labels, axis) for cell in named}
    picked = [c for c in moved if not names or c.name in names or _others(c.labels, axis) in wanted]
    return _own_outputs(picked, cells, target), target


def _check_names(names: Sequence[str], known: Mapping[str, GridCell], path: Path) -> None:
    for name in names:
        if name not in known:
            raise LayerpruneError(f"--cell: {unknown_name_message(f'cell of {path.stem}', name, known)}")


def _axis_labels(data: Mapping[str, Any], named: list[GridCell]) -> list[str] | None:
    """The model axis's labels the named cells take (None: the grid has no model axis)."""
    axis = model_axis(data["grid"])
    return None if axis is None else list(dict.fromkeys(cell.labels[axis] for cell in named))


def _others(labels: Mapping[str, str], axis: str | None) -> tuple[tuple[str, str], ...]:
    return tuple((a, label) for a, label in labels.items() if a != axis)


def _own_outputs(picked: list[GridCell], shipped: list[GridCell], target: Target) -> list[GridCell]:
    """No cell on the user's model writes where a shipped cell does (its output, else runs/<name>)."""
    taken = {_run_dir(cell.data) for cell in shipped}
    return [GridCell(cell.name, cell.labels, {**cell.data, "output": f"{_run_dir(cell.data)}--{target.slug}"})
            if _run_dir(cell.data) in taken else cell for cell in picked]


def _run_dir(data: Mapping[str, Any]) -> str:
    return str(Path(str(data.get("output") or Path("runs") / str(data.get("name")))))


def _notes(cells: list[dict[str, Any]], target: Target | None) -> list[str]:
    """What --model decided, said once: the model, its blocks, the count each cell removes."""
    if target is None:
        return []
    blocks = f"{target.depth} blocks" if target.depth is not None else "blocks not read"
    drops = sorted({str((c.get("prune") or {}).get("drop")) for c in cells})
    return [f"on model {target.model} ({blocks}): prune.drop {', '.join(drops)} "
            f"({target.rule or 'the recipe fixes it for every model'})"]
