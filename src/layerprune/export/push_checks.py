"""What `push` refuses to share, before the hub is called: a folder whose weights are not whole, a pruned folder its
prune never compared with its source (`--no-verify`), a GGUF file its export did not read back or that changed since;
and what the hub would refuse in a card (a `base_model` that is a local path, not a hub id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.models.hub_ids import HUB_ID
from layerprune.models.lineage import PRUNE_REPORT
from layerprune.models.safetensors_check import check_model_dir_weights

INDEX_FILE = "model.safetensors.index.json"
UNVERIFIED = "pass --allow-unverified to share it as it is"


def check_folder(folder: Path, allow_unverified: bool) -> None:
    """Every weight file readable and as long as its header says, every shard its index names there; a pruned
    folder's record showing a check against the source (its logits, or its bytes for a streamed copy)."""
    check_model_dir_weights(folder, allow_pickle=False)
    index = folder / INDEX_FILE
    if index.is_file():
        shards = set(_json(index).get("weight_map", {}).values())
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise LayerpruneError(f"{folder} is not whole: {INDEX_FILE} names {missing[0]}, which is not there")
    record = folder / PRUNE_REPORT
    if allow_unverified or not record.is_file():
        return
    check = _json(record).get("verification") or {}
    if check.get("checked") is not True and check.get("bytes_compared") is None:
        raise LayerpruneError(f"{folder} was saved without being checked against its source ({PRUNE_REPORT}: "
                              f"verification {check.get('checked', 'missing')!r}, as `prune --no-verify` leaves it); "
                              f"prune it again with the check, or {UNVERIFIED}")


def check_gguf(path: Path, record: dict[str, Any] | None, allow_unverified: bool) -> None:
    """The file is the one its export record describes (same size), and that export read it back."""
    if record is None:
        if allow_unverified:
            return
        raise LayerpruneError(f"{path} has no export record beside it ({path.with_suffix('.export.json').name}): "
                              f"nothing says it was read back against its source; {UNVERIFIED}")
    size = path.stat().st_size
    if record.get("bytes") not in (None, size):
        raise LayerpruneError(f"{path} is {size} bytes, its export record says {record['bytes']}: the file changed "
                              "since it was exported; export it again")
    if not allow_unverified and not record.get("readback"):
        raise LayerpruneError(f"{path} was exported without its read-back (`export --no-verify`); export it again "
                              f"with the check, or {UNVERIFIED}")


def hub_metadata(values: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The card's metadata as the hub takes it: a `base_model` that is not a hub id (a local path) left out, the
    hub's model tree links by id only; and a note saying so (None when nothing was left out)."""
    base = values.get("base_model")
    if base is None or all(isinstance(b, str) and HUB_ID.match(b) and not Path(b).exists()
                           for b in (base if isinstance(base, list) else [base])):
        return values, None
    kept = {key: value for key, value in values.items() if key != "base_model"}
    return kept, f"base_model {base!r} is not a hub id: left out of the card (its source stays in `layerprune`)"


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LayerpruneError(f"cannot read {path}: {one_line(exc)}") from exc
    if not isinstance(data, dict):
        raise LayerpruneError(f"{path} is not a JSON object")
    return data
