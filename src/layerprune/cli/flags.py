"""The one config-to-flags layer: argparse flags from pydantic fields, so help text lives in the field descriptions.

Every subcommand builds its flags here. A field becomes `--kebab-name` (a section's field `--section-name`, dest
'section.name'); bools get `--x/--no-x`, Literals their choices, lists take space- and/or comma-separated values,
mappings of plain values take KEY=VALUE entries, mappings of settings are recipe-only (no flag). Unset flags stay
absent from the namespace, so `typed_layer` holds only what the user typed: the top layer of defaults < recipe file
< explicit CLI flag (`layerprune.core.recipe_loading`).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

SCALARS = (int, float, str, Path)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _section(annotation: Any) -> type[BaseModel] | None:
    annotation = _strip_optional(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _mapping(annotation: Any) -> bool:
    return typing.get_origin(_strip_optional(annotation)) is dict


def _recipe_only(annotation: Any) -> bool:
    """Mappings of settings (per-model decoding, an arm's section) are written in a recipe, not typed as a flag."""
    return _mapping(annotation) and typing.get_args(_strip_optional(annotation))[1] not in SCALARS


def int_or_str(text: str) -> int | str:
    """The integer where the text is one (a block index), else the text (a name such as 12.attn)."""
    try:
        return int(text)
    except ValueError:
        return text


class ListAction(argparse.Action):
    """`--x a b`, `--x a,b` and `--x a,b c` all give [a, b(, c)], each item converted to the list's item type."""

    def __init__(self, *args: Any, item_type: type = str, **kwargs: Any) -> None:
        super().__init__(*args, nargs="+", **kwargs)
        self.item_type = item_type

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parts = [part.strip() for value in values for part in str(value).split(",") if part.strip()]
        try:
            setattr(namespace, self.dest, [self.item_type(part) for part in parts])
        except ValueError:
            parser.error(f"{option_string}: expected {self.item_type.__name__} values, got {' '.join(values)}")


class MappingAction(argparse.Action):
    """`--x KEY=VALUE KEY=VALUE` gives {KEY: VALUE, ...} (the value after the last '=')."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, nargs="+", metavar="KEY=VALUE", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        pairs = [str(value).rpartition("=") for value in values]
        bad = [value for value, (key, sep, item) in zip(values, pairs, strict=True) if not (key and sep and item)]
        if bad:
            parser.error(f"{option_string}: '{bad[0]}' is not KEY=VALUE")
        setattr(namespace, self.dest, {key: item for key, _, item in pairs})


def flag_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse keyword arguments (type, choices or action) for a field annotation."""
    annotation = _strip_optional(annotation)
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin is dict:
        return {"action": MappingAction}
    if origin in (list, tuple):
        item = typing.get_args(annotation)[0]
        if set(typing.get_args(item)) == {int, str}:
            return {"action": ListAction, "item_type": int_or_str}
        return {"action": ListAction, "item_type": item if item in (int, float) else str}
    return {"type": annotation if annotation in SCALARS else str}


def _help(field: FieldInfo) -> str:
    default = None if field.is_required() else field.get_default(call_default_factory=True)
    text = field.description or ""
    if default not in (None, [], (), "", {}):
        text += f" (default: {default})"
    return text.replace("%", "%%")


def add_schema_flags(parser: argparse.ArgumentParser | Any, schema: type[BaseModel], *, skip: Iterable[str] = (),
                     group: str | None = None, aliases: dict[str, list[str]] | None = None,
                     section: str | None = None) -> None:
    """One flag per field of `schema` (and, with a group each, per field of its sections).

    `skip` names fields (or 'section.field') that get no flag; `aliases` maps a dest ('field' or 'section.field')
    to extra option strings such as '-o' or '--samples'.
    """
    skip, aliases = set(skip), aliases or {}
    target = parser.add_argument_group(group) if group else parser
    for name, field in schema.model_fields.items():
        dest = f"{section}.{name}" if section else name
        if dest in skip or _recipe_only(field.annotation):
            continue
        nested = _section(field.annotation)
        if nested is not None:
            title = f"recipe section '{dest}'" + (f": {nested.__doc__.strip()}" if nested.__doc__ else "")
            add_schema_flags(parser, nested, skip=skip, aliases=aliases, section=dest, group=title)
            continue
        flags = ["--" + dest.replace(".", "-").replace("_", "-"), *aliases.get(dest, [])]
        kwargs = flag_kwargs(field.annotation)
        if section and "choices" not in kwargs and kwargs.get("action") in (None, ListAction):
            kwargs["metavar"] = name.upper()
        target.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, help=_help(field), **kwargs)


def typed_layer(args: argparse.Namespace, schema: type[BaseModel]) -> dict[str, Any]:
    """The fields of `schema` the user typed, nested by section (the top layer of the precedence rule)."""
    layer: dict[str, Any] = {}
    for dest, value in vars(args).items():
        *sections, name = dest.split(".")
        if not sections:
            if name in schema.model_fields and _section(schema.model_fields[name].annotation) is None:
                layer[name] = value
            continue
        node, model = layer, schema
        for part in sections:
            field = model.model_fields.get(part)
            nested = _section(field.annotation) if field is not None else None
            if nested is None:
                break
            node, model = node.setdefault(part, {}), nested
        else:
            if name in model.model_fields:
                node[name] = value
    return layer
