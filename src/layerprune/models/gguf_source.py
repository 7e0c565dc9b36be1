"""Which GGUF file a model was read from: an embedded model's, a .gguf spec, or the one a folder converted by
layerprune's loader records. The export carries that file's tokenizer; a k-quant memory target is priced from it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layerprune.models.embedded import EMBEDDED_MODELS, gguf_path

SOURCE_FILE = "source.json"  # written by models/loading.convert_gguf beside the converted safetensors


def converted_from(directory: Path) -> str | None:
    """The GGUF a folder converted by layerprune's loader came from (its source.json), else None."""
    source = Path(directory) / SOURCE_FILE
    return json.loads(source.read_text())["gguf"] if source.is_file() else None


def recorded_gguf(kind: str | None, spec: str | None, identity: Mapping[str, Any], cache_dir: Path) -> Path | None:
    """The GGUF file a model source names (an embedded model's, or a .gguf spec that exists), else None."""
    if kind == "embedded" and identity.get("embedded") in EMBEDDED_MODELS:
        return gguf_path(EMBEDDED_MODELS[identity["embedded"]], cache_dir)
    if kind == "gguf" and spec and Path(spec).expanduser().is_file():
        return Path(spec).expanduser()
    return None
