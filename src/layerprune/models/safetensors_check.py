"""Cheap integrity checks of safetensors files before loading them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from layerprune.errors import LayerpruneError


def check_safetensors_file(path: Path) -> None:
    """Fail with one line when the header is unreadable or the file is shorter than it says."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise LayerpruneError(f"corrupt safetensors file {path}: too short to hold a header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len <= 0 or 8 + header_len > size:
            raise LayerpruneError(f"corrupt safetensors file {path}: header length {header_len} exceeds file size {size}")
        try:
            header = json.loads(handle.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LayerpruneError(f"corrupt safetensors file {path}: unreadable header ({exc})") from exc
    end = max((_data_end(path, key, meta) for key, meta in _entries(path, header)), default=0)
    if 8 + header_len + end > size:
        raise LayerpruneError(
            f"truncated safetensors file {path}: tensors need {8 + header_len + end} bytes, file has {size}"
        )


def _entries(path: Path, header: object) -> list[tuple[str, object]]:
    if not isinstance(header, dict):
        raise LayerpruneError(f"corrupt safetensors file {path}: header is JSON but not an object "
                              f"({type(header).__name__})")
    return [(key, meta) for key, meta in header.items() if key != "__metadata__"]


def _data_end(path: Path, key: str, meta: object) -> int:
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise LayerpruneError(f"corrupt safetensors file {path}: tensor '{key}' has no valid data_offsets")
    return offsets[1]


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
