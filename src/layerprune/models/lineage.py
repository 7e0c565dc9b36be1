"""Where a pruned model directory came from: the part of its prune_report.json that every floor relies on.

`prune` writes the whole report (prune/report.PruneReport, a subclass of PrunedLineage with its scores, timings and
checks); `recover` writes a lineage alone when its recipe drops blocks itself. Readers outside prune (model loading,
the evaluation's calibration-overlap check, recover's teacher and dropped blocks) read the lineage and ignore the
rest of the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from layerprune.core.provenance import Provenance
from layerprune.core.reports import read_report

if TYPE_CHECKING:
    from layerprune.models.loading import ModelSource

PRUNE_REPORT = "prune_report.json"
VARIANT_REPORT = "variant_report.json"  # how `layerprune variant` made a model, and from which


class SourceRecord(BaseModel):
    """The model that was pruned, as it was resolved."""

    model_config = ConfigDict(extra="forbid")

    spec: str | None = Field(description="What the user named (hub id, directory, embedded:NAME)")
    location: str = Field(description="Where it was read from")
    kind: str = Field(description="embedded, gguf, local or hub")
    identity: dict[str, Any] = Field(default_factory=dict, description="What identifies that exact version")

    @classmethod
    def of(cls, source: ModelSource) -> SourceRecord:
        return cls(spec=source.spec, location=source.location, kind=source.kind, identity=source.identity)


class PruneMethod(BaseModel):
    """How the dropped blocks were chosen."""

    model_config = ConfigDict(extra="forbid")

    score: str = Field(description="Importance score, or 'explicit' for blocks named by index")
    metric: str | None = Field(None, description="Ablation metric")
    iterative: bool = Field(False, description="Whether ablation rescored after each drop")
    protect: list[int] = Field(default_factory=list, description="Blocks that could not be dropped")
    seed: int | None = Field(None, description="Random seed")


class CalibrationRecord(BaseModel):
    """The calibration data that chose the blocks, item by item (the evaluation refuses to score on them)."""

    model_config = ConfigDict(extra="forbid")

    description: str
    samples: int
    seq_len: int
    fallback: str | None = None
    items: list[dict[str, str]] = Field(description="Each item: {text} or {prompt, answer}")

    def texts(self) -> list[str]:
        return ["\n".join(item.values()) for item in self.items]


class PrunedLineage(BaseModel):
    """Source, method and the blocks dropped (original numbering) of a pruned model directory."""

    model_config = ConfigDict(extra="ignore")  # a view: the full report (prune/report.PruneReport) has more

    source: SourceRecord
    method: PruneMethod
    calibration: CalibrationRecord | None = Field(description="None when no data chose the blocks")
    dropped: list[int]
    kept: list[int]
    num_blocks_before: int
    num_blocks_after: int
    provenance: Provenance
    removed_sublayers: list[str] | None = None  # a sublayer prune's removals (BLOCK.attn, BLOCK.mlp); None: blocks
    kv_cache_kept: float | None = None

    def removal(self) -> str:
        """What the prune removed, in words: the blocks dropped, or the sublayers (and the KV cache kept)."""
        if self.removed_sublayers is None:
            return f"dropped blocks (original numbering): {self.dropped}"
        kv = f"; KV cache kept: {self.kv_cache_kept:.3g}x" if self.kv_cache_kept is not None else ""
        return (f"removed sublayers (original numbering): {', '.join(self.removed_sublayers) or 'none'}; whole blocks "
                f"gone: {self.dropped or 'none'}{kv}")


class SublayerLineage(BaseModel):
    """The attention / MLP sublayers a sublayer prune removed (BLOCK.attn, BLOCK.mlp; original numbering), None when
    whole blocks were dropped: what recover's local reads to find the blocks that lost one sublayer."""

    model_config = ConfigDict(extra="ignore")

    removed_sublayers: list[str] | None = None


def read_removed_sublayers(directory: Path) -> list[str]:
    """The sublayers `directory`'s prune_report.json says were removed ([] when none, or no report)."""
    path = Path(directory) / PRUNE_REPORT
    return (read_report(path, SublayerLineage).removed_sublayers or []) if path.is_file() else []


def read_lineage(directory: Path) -> PrunedLineage | None:
    """The lineage recorded in `directory`, or None when it has no prune_report.json (one-line error when bad)."""
    path = Path(directory) / PRUNE_REPORT
    return read_report(path, PrunedLineage) if path.is_file() else None
