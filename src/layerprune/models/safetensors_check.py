"""Integrity checks of safetensors files before loading them, by safetensors' own reader.

`safe_open` refuses a header that is too short, too long for the file, not UTF-8 JSON or not a table of
tensors, tensors whose offsets do not match their shapes, and a file whose data does not fill it to the end;
`open_safetensors` turns that refusal into one line naming the file.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError, one_line

NOT_AN_OBJECT = re.compile(r"invalid type: (.+?), expected struct HashMetadata")


@contextlib.contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open(path, "pt")`; a file it refuses is a one-line LayerpruneError."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(path, "pt")
    except SafetensorError as exc:
        raise LayerpruneError(f"corrupt safetensors file {path}: {_reason(exc)}") from exc
    with handle:
        yield handle


def _reason(exc: Exception) -> str:
    message = one_line(exc).removeprefix("Error while deserializing header: ")
    if match := NOT_AN_OBJECT.search(message):  # serde's words for a top-level value that is not a table
        return f"header is valid JSON but not an object (a {match[1]})"
    return message


def check_safetensors_file(path: Path) -> None:
    """Fail with one line when safetensors cannot read the header or the file is not as long as it says."""
    with open_safetensors(path):
        pass


def check_model_dir_weights(path: Path, allow_pickle: bool) -> None:
    """Require safetensors weights (pickle only with allow_pickle) and check each file."""
    tensors = sorted(path.glob("*.safetensors"))
    pickles = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt")) + sorted(path.glob("*.pth"))
    if not tensors and pickles and not allow_pickle:
        raise LayerpruneError(
            f"{path} holds only pickle weights ({pickles[0].name}); pickle can run code when loaded: "
            "convert to safetensors or pass --allow-pickle if you trust it"
        )
    if not tensors and not pickles:
        raise LayerpruneError(f"{path} holds no model weights (*.safetensors)")
    for file in tensors:
        check_safetensors_file(file)
