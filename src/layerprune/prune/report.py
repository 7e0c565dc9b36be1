"""What a pruned model directory records about how it was made: prune_report.json, model card, chart."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from layerprune.core.reports import read_report, write_report
from layerprune.models.lineage import PRUNE_REPORT, PrunedLineage
from layerprune.prune.recipe import PruneRecipe

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

    from layerprune.models.hub_ids import BaseModelRef


class Timings(BaseModel):
    """Seconds per phase, set as each phase ends: a misspelled phase or a value that is not a number fails where it
    is set. A phase that did not run (no save on a dry run) is left out of the JSON, not written as null."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    load_s: float = Field(description="Loading the model (0 when only its files were read)")
    score_s: float = Field(description="Choosing the blocks")
    save_s: float | None = Field(None, description="Writing the pruned model")
    verify_s: float | None = Field(None, description="Checking the written model")
    total_s: float | None = Field(None, description="The whole run (set after the report file is written)")

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, float]:
        return {key: value for key, value in handler(self).items() if value is not None}


class Verification(BaseModel):
    """The checks of the written model, made as they run (the meta check of a streamed save first, then the bytes
    and the logits): a misspelled key or a wrong type fails where it is made. A check that did not run is left out
    of the JSON, not written as null."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    checked: bool | Literal["meta"] = Field(
        description="True when the logits were compared; 'meta' when only the meta-device check ran; False when none"
    )
    keys: int | str | None = Field(
        None, description="State-dict keys checked against the new config on the meta device, or why not"
    )
    tokens: int | None = Field(None, description="Probe tokens whose logits were compared")
    logits_check: str | None = Field(None, description="whole-model, block-major, or why it was skipped")
    block_major: str | None = Field(None, description="Why the block-major check was not possible")
    max_abs_diff: float | None = Field(None, description="Largest |logit difference| against the skip reference")
    tolerance: float | None = Field(None, description="The largest difference allowed")
    reference_max_abs: float | None = Field(None, description="Largest |logit| of the reference (the scale)")
    per_layer_settings: int | str | None = Field(
        None, description="Per-layer config settings compared block by block, or why not"
    )
    bytes_compared: int | None = Field(None, description="Tensor bytes compared with the source (streamed save)")
    reference_blocks: dict[str, int] | None = Field(
        None, description="Kept blocks of the original run for its logits ('computed') or proven the written block's "
        "function on its very inputs, so its output taken from the written model's forward ('replayed')"
    )
    phase_seconds: dict[str, float] | None = Field(None, description="Seconds per phase of the check")
    seconds: float | None = Field(None, description="Seconds of the whole check")

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class Dtypes(BaseModel):
    """Checkpoint, compute and saved dtypes, made where the save dtype is chosen (strict: a misspelled key or a
    dtype object instead of its name fails there). The file keeps a null checkpoint dtype when none was recorded."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    checkpoint: str | None = Field(description="The checkpoint's stored dtype (None when its files do not say)")
    computed_in: str = Field(description="The dtype the model was loaded and scored in")
    saved: str | None = Field(description="The dtype the weights were written in")
    chosen_by: Literal["--dtype", "checkpoint"] = Field(description="What chose the saved dtype")


class Saved(BaseModel):
    """How the weights were written, set where they are (a streamed save adds its shards, bytes and tensor dtypes;
    what it does not know is left out of the JSON, not written as null)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    how: Literal["streamed from the source safetensors files", "save_pretrained of the model in memory"]
    shards: int | None = Field(None, description="Safetensors shards written")
    bytes: int | None = Field(None, description="Tensor bytes written")
    dtypes: dict[str, int] | None = Field(None, description="Tensors written per dtype")

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


Number = int | float  # an int stays an int in the file (params, bytes), a ratio a float


class TargetRecord(BaseModel):
    """`--target`: the plan's removals, the values it predicts before and after them, and for a speedup target the
    candidates it measured (the chosen one as `measured_speedup`)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    target: str = Field(description="The target as given (params=6.5B, memory=12GiB, kv-cache=0.5x, speedup=1.4x)")
    removals: list[str] = Field(description="What the plan removes, least important first (block or BLOCK.part)")
    predicted: dict[Literal["before", "after"], dict[str, Number]] = Field(
        description="Params, memory bytes, KV-cache bytes per token, FLOPs per token and the predicted speedup")
    measured_speedup: dict[str, Number] | None = Field(description="The measurement of the chosen removals")
    measurements: list[dict[str, Number]] = Field(description="Every candidate measured (speedup targets)")
    weights_as: str | None = Field(None, description="What the memory bytes count: the saved dtype, or the GGUF "
                                   "type `export --outtype` will write (prune --outtype)")


class PruneReport(PrunedLineage):
    """prune_report.json: the lineage every floor reads, plus the scores, the checks and what it cost."""

    model_config = ConfigDict(extra="forbid")

    recipe: PruneRecipe
    scores: list[float | None] = Field(description="Per block, original numbering; None where not scored")
    steps: list[dict[str, Any]] = Field(description="Iterative scoring: the scores after each drop")
    score_details: dict[str, Any] = Field(description="What the score recorded about itself")
    params_before: int
    params_after: int
    config_per_layer: dict[str, dict[str, Any]] = Field(description="Per-layer config fields before and after")
    dtype: Dtypes = Field(description="Checkpoint, compute and saved dtypes")
    timings: Timings = Field(description="Seconds per phase")
    saved: Saved | None = Field(None, description="How the weights were written")
    verification: Verification | None = Field(None, description="The checks of the written model")
    target: TargetRecord | None = Field(None, description="--target: the plan, predicted and measured values")
    scores_png: str | None = Field(None, description="The score chart beside the report")
    removed_sublayers: list[str] | None = Field(
        None,
        description="Attention/MLP sublayers removed (BLOCK.attn, BLOCK.mlp; original numbering); None when whole "
        "blocks were dropped. A block that lost both is in `dropped` too",
    )
    sublayer_scores: dict[str, float | None] | None = Field(
        None, description="Per sublayer of the granularity, its score; None where not scored"
    )
    kv_cache_kept: float | None = Field(
        None, description="Attention sublayers kept over all of them: the fraction of the KV cache left"
    )


def write_prune_report(directory: Path, report: dict[str, Any]) -> PruneReport:
    """prune_report.json through PruneReport (a misspelled or missing field fails here, before anything is kept)."""
    typed = PruneReport.model_validate(report)
    write_report(directory / PRUNE_REPORT, typed)
    return typed


def read_prune_report(directory: Path) -> PruneReport:
    """The prune_report.json of a `layerprune prune` output (one-line error when missing or of another version)."""
    return read_report(Path(directory) / PRUNE_REPORT, PruneReport)


def plot_scores(path: Path, scores: list[float | None], dropped: list[int], protected: list[int], title: str) -> Path:
    """Bar chart of block scores: dropped blocks red, protected hatched, unscored grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, len(scores) * 0.3), 3.2))
    values = [0.0 if s is None else s for s in scores]
    colors = ["#d62728" if i in dropped else "#bbbbbb" if scores[i] is None else "#1f77b4" for i in range(len(scores))]
    bars = ax.bar(range(len(scores)), values, color=colors)
    for i in protected:
        bars[i].set_hatch("//")
    ax.set_xlabel("decoder block (original numbering)")
    ax.set_ylabel("importance score")
    ax.set_title(title, fontsize=10)
    ax.set_xticks(range(len(scores)))
    ax.tick_params(axis="x", labelsize=7)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#1f77b4", label="kept"), Patch(color="#d62728", label="dropped"),
                       Patch(facecolor="white", edgecolor="black", hatch="//", label="protected")], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def model_card(report: PruneReport) -> ModelCard:
    """README.md of a pruned model: hub metadata (the source's hub id as base model, the removals, tags) and how it
    was made."""
    from huggingface_hub import ModelCard, ModelCardData

    from layerprune.core.model_card import card_text
    from layerprune.models.hub_ids import base_model_of

    method, spec = report.method, report.source.spec or report.source.location
    base = base_model_of(report.source)
    data = ModelCardData(base_model=base.hub_id, library_name="transformers", pipeline_tag="text-generation",
                         tags=["layerprune", "pruned"], layerprune=_known({
                             "source": spec, "variant": base.variant, "dropped_blocks": report.dropped,
                             "removed_sublayers": report.removed_sublayers, "score": method.score,
                             "calibration": report.calibration.description if report.calibration else None}))
    lines = [
        f"# {spec} pruned to {report.num_blocks_after} blocks", "",
        f"Made with layerprune {report.provenance.layerprune} from `{spec}`{_base_words(spec, base)}: "
        f"{report.num_blocks_before} -> {report.num_blocks_after} decoder blocks, "
        f"{report.params_before / 1e6:.1f}M -> {report.params_after / 1e6:.1f}M parameters.", "",
        f"- score: `{method.score}`" + (f" (metric {method.metric}, {'iterative' if method.iterative else 'one-shot'})"
                                        if method.score == "ablation" else ""),
        f"- calibration: {report.calibration.description if report.calibration else 'none'}",
        f"- dropped blocks (original numbering): {report.dropped}",
        *([f"- removed sublayers: {', '.join(report.removed_sublayers)}; KV cache kept: {report.kv_cache_kept:.3g}x"]
          if report.removed_sublayers is not None and report.kv_cache_kept is not None else []),
        f"- protected blocks: {method.protect}", "",
        "Pruned models lose generative reasoning first (math, code) even when classification benchmarks hold up; "
        "evaluate with `layerprune evaluate` before use. See `prune_report.json` for every block's score.",
    ]
    if report.scores_png:
        lines += ["", f"![block scores]({report.scores_png})"]
    return ModelCard(card_text(data, lines))


def _known(values: dict[str, Any]) -> dict[str, Any]:
    """The values that are set (the card leaves out what does not apply rather than write null)."""
    return {key: value for key, value in values.items() if value is not None}


def _base_words(spec: str, base: BaseModelRef) -> str:
    """', the variant NAME of HUB_ID' or ' (HUB_ID)' where the spec is not the hub id itself."""
    if base.variant:
        return f", the variant `{base.variant}` of `{base.base_model}`"
    return f" (`{base.base_model}`)" if base.base_model != spec else ""
