"""The one exception type the CLI turns into a one-line error and exit code 2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class LayerpruneError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = 2


def one_line(message: object) -> str:
    """Collapse a message onto one line."""
    return " ".join(str(message).split())


@contextmanager
def stage(name: str, folder: Path | None = None) -> Iterator[None]:
    """Name the stage (and the run folder) of an unexpected exception escaping this block, for the CLI's one line;
    the innermost stage wins. User errors (LayerpruneError) pass as they are."""
    try:
        yield
    except LayerpruneError:
        raise
    except Exception as exc:
        try:
            if not hasattr(exc, "layerprune_stage"):
                exc.layerprune_stage = name  # type: ignore[attr-defined]
            if folder is not None and getattr(exc, "layerprune_folder", None) is None:
                exc.layerprune_folder = folder  # type: ignore[attr-defined]
        except AttributeError:  # an exception type that takes no attributes: the command names the stage
            pass
        raise
