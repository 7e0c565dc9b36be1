"""Build argparse flags from pydantic fields, so help text lives only in the field descriptions.

Precedence (one rule, tested): schema defaults < recipe file < explicit CLI flag.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ValidationError

from layerprune.errors import LayerpruneError


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _list_parser(item_type: type) -> Any:
    def parse(text: str) -> list[Any]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            return [item_type(p) for p in parts]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {item_type.__name__}: {text}") from exc

    return parse


def flag_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse keyword arguments (type, choices or action) for a field annotation."""
    annotation = _strip_optional(annotation)
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin in (list, tuple):
        (item,) = typing.get_args(annotation)[:1]
        return {"type": _list_parser(item if item in (int, float, str) else str)}
    if annotation in (int, float, str, Path):
        return {"type": annotation}
    return {"type": str}


def add_schema_args(parser: argparse.ArgumentParser, schema: type[BaseModel], skip: Iterable[str] = (),
                    group: str | None = None, aliases: dict[str, list[str]] | None = None) -> None:
    """One `--kebab-case` flag per field; unset flags stay absent from the namespace."""
    target = parser.add_argument_group(group) if group else parser
    for name, field in schema.model_fields.items():
        if name in skip:
            continue
        default = field.default if field.default is not None else None
        help_text = (field.description or "").replace("%", "%%")
        if default not in (None, [], ()) and not callable(default):
            help_text += f" (default: {default})".replace("%", "%%")
        flags = ["--" + name.replace("_", "-"), *(aliases or {}).get(name, [])]
        target.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=help_text, **flag_kwargs(field.annotation))


def explicit_values(args: argparse.Namespace, schema: type[BaseModel]) -> dict[str, Any]:
    """The flags the user actually typed, for this schema."""
    return {name: value for name, value in vars(args).items() if name in schema.model_fields}


def build_schema(schema: type[BaseModel], *layers: dict[str, Any]) -> Any:
    """Merge layers left to right (later wins) and validate; errors become one line naming the field."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    try:
        return schema.model_validate(merged)
    except ValidationError as exc:
        raise LayerpruneError(validation_message(exc, schema.__name__)) from exc


def validation_message(exc: ValidationError, what: str) -> str:
    """'invalid PruneRecipe: drop: Input should be greater than or equal to 1'."""
    parts = []
    for error in exc.errors()[:3]:
        loc = ".".join(str(p) for p in error["loc"]) or "value"
        msg = error["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if error["type"] != "extra_forbidden" else f"unknown key '{loc}'")
    return f"invalid {what}: " + "; ".join(parts)
