"""The hub id a model card names as `base_model`: the hub's model tree links a card to its source by it.

An embedded model is the hub model its GGUF was converted from, a `variant:NAME` (or a variant's folder) is its
source's hub id with the variant recorded beside it, a pruned folder is what it was pruned from; a local path only
when no hub id is known.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.models import embedded
from layerprune.models.lineage import PRUNE_REPORT, VARIANT_REPORT, SourceRecord

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
DEPTH = 8  # a variant of a pruned variant of ...: records point back this far at most


@dataclass(frozen=True)
class BaseModelRef:
    """What a card names as its base model, and the variant of it that was pruned or trained (None: the model
    itself)."""

    base_model: str
    on_hub: bool
    variant: str | None = None

    @property
    def hub_id(self) -> str | None:
        """What a card's `base_model` holds: the hub id, or None for a local path (the hub takes ids only)."""
        return self.base_model if self.on_hub else None


def base_model_of(source: SourceRecord) -> BaseModelRef:
    """The base model of a recorded source (a prune's, a recovery's student, a variant's)."""
    return _resolve(source.spec, source.location, source.kind, source.identity, DEPTH)


def base_model_of_spec(spec: str, identity: dict[str, Any] | None = None) -> BaseModelRef:
    """The base model of what a user named (hub id, embedded:NAME, variant:NAME, a folder), with the identity its
    load recorded where known."""
    return _resolve(spec, spec, "", identity or {}, DEPTH)


def _resolve(spec: str | None, location: str, kind: str, identity: dict[str, Any], depth: int) -> BaseModelRef:
    variant = identity.get("variant")
    made = variant and identity.get("variant_made") is not False  # a planned variant points at its source
    base = _variant_source(identity.get("path") or location, depth) if made else None
    base = base or _embedded(spec, identity) or _hub(spec, location, kind, identity) \
        or _pruned_from(identity, depth) or _recorded_folder(spec or location, depth)
    if base is None:
        return BaseModelRef(spec or location, on_hub=False, variant=variant)
    return BaseModelRef(base.base_model, base.on_hub, variant or base.variant)


def _embedded(spec: str | None, identity: dict[str, Any]) -> BaseModelRef | None:
    name = identity.get("embedded")
    if name is None and spec is not None and (spec == "embedded" or spec.startswith("embedded:")):
        try:
            name = embedded.embedded_name(spec)
        except LayerpruneError:
            return None
    model = embedded.EMBEDDED_MODELS.get(name) if name else None
    return BaseModelRef(model.hub_id, on_hub=True) if model else None


def _hub(spec: str | None, location: str, kind: str, identity: dict[str, Any]) -> BaseModelRef | None:
    named = identity.get("hub_id") or (location if kind == "hub" else None)
    unrecorded = not kind and "path" not in identity  # a spec typed by a user, not a load's record
    if named is None and unrecorded and spec and HUB_ID.match(spec) and not Path(spec).expanduser().exists():
        named = spec
    return BaseModelRef(named, on_hub=True) if named else None


def _pruned_from(identity: dict[str, Any], depth: int) -> BaseModelRef | None:
    record = identity.get("pruned_from")
    if not isinstance(record, dict) or depth <= 0:
        return None
    return _resolve(record.get("spec"), record.get("location", ""), record.get("kind", ""),
                    record.get("identity") or {}, depth - 1)


def _recorded_folder(path: str, depth: int) -> BaseModelRef | None:
    """A folder layerprune made: a variant's (its source model) or a pruned one's (what it was pruned from)."""
    folder = Path(path).expanduser()
    if depth <= 0 or not folder.is_dir():
        return None
    variant = _variant_source(str(folder), depth)
    if variant is not None:
        report = _json(folder / VARIANT_REPORT)
        return BaseModelRef(variant.base_model, variant.on_hub, variant.variant or _variant_name(report))
    pruned = _json(folder / PRUNE_REPORT)
    source = pruned.get("source") if pruned else None
    if not isinstance(source, dict):
        return None
    return _resolve(source.get("spec"), source.get("location", ""), source.get("kind", ""),
                    source.get("identity") or {}, depth - 1)


def _variant_source(location: str, depth: int) -> BaseModelRef | None:
    """The base model of the model a variant's folder was trained from (its variant_report.json)."""
    report = _json(Path(location) / VARIANT_REPORT)
    if report is None or depth <= 0 or not report.get("source_model"):
        return None
    return _resolve(report["source_model"], report["source_model"], "", report.get("source_identity") or {},
                    depth - 1)


def _variant_name(report: dict[str, Any] | None) -> str | None:
    if report is None:
        return None
    return (report.get("recipe") or {}).get("name") or report.get("kind")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
