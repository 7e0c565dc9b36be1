"""Plain-dict registries filled by a decorator; a miss suggests close names."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from layerprune.core.errors import LayerpruneError

T = TypeVar("T")


class Registry(Generic[T]):
    """A named mapping of implementations, e.g. importance scores or tasks."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' registered twice")
            self._items[name] = item
            return item

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise LayerpruneError(unknown_name_message(self.kind, name, self._items))
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def unknown_name_message(kind: str, name: str, known: object) -> str:
    """'unknown score 'ablaton'; did you mean: ablation? (known: ...)'."""
    names = sorted(known)  # type: ignore[call-overload]
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    hint = f"; did you mean: {', '.join(close)}?" if close else ""
    return f"unknown {kind} '{name}'{hint} (known: {', '.join(names)})"


def check_name(kind: str, name: str, known: Iterable[str]) -> str:
    """`name` when it is one of `known`; else a ValueError with the close matches (for pydantic field validators)."""
    names = list(known)
    if name not in names:
        raise ValueError(unknown_name_message(kind, name, names))
    return name
