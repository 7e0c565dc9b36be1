"""The one exception type the CLI turns into a one-line error and exit code 2."""

from __future__ import annotations


class LayerpruneError(Exception):
    """A problem with the user's input or environment, reported as one line."""

    exit_code = 2


def one_line(message: object) -> str:
    """Collapse a message onto one line."""
    return " ".join(str(message).split())
