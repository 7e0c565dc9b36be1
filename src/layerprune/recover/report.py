"""What a recovered model directory records about how it was made: recover_report.json and the model card."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from layerprune.core.provenance import Provenance
from layerprune.core.reports import read_report
from layerprune.core.settings import RunSettings
from layerprune.models.lineage import PrunedLineage, SourceRecord
from layerprune.recover.schema import RecoverRecipe, embeds_recipe

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

RECOVER_REPORT = "recover_report.json"


class HeldOutLoss(BaseModel):
    """Cross-entropy on the held-out teacher answers (None when nothing was held out)."""

    model_config = ConfigDict(extra="forbid")

    before: float | None
    after: float | None


class Seconds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    total: float
    generation: float
    training: float


@embeds_recipe
class RecoverReport(BaseModel):
    """recover_report.json: the recipe as it ran, the data, what the training did, and what it cost."""

    model_config = ConfigDict(extra="forbid")

    recipe: RecoverRecipe
    settings: RunSettings
    student: SourceRecord = Field(description="The pruned model that was trained")
    teacher: str = Field(description="The model whose answers (and logits, for distillation) it learned from")
    data: dict[str, Any] = Field(description="Generation, filter and split counts, optimizer steps, held-out metrics")
    held_out_loss: HeldOutLoss
    held_out_metrics: dict[str, Any] | None = Field(
        None, description="The same yardstick for every method: {pruned: {ce, kl}, after: {ce, kl}, tokens, prompts}: "
        "token-weighted cross-entropy of the teacher's answers to the held-out prompts and forward KL(teacher || "
        "student) per token, for the pruned and the trained model (replace adds 'replaced')")
    loss_curve: dict[str, list[list[float | None]]] = Field(description="[[step, loss], ...] (a non-finite loss: null)")
    tokens_seen: int = Field(description="Tokens as the trainers count them (transformers: every input token of "
                             "each batch, padding included; local: every token through its blocks)")
    tokens_unpadded: int | None = Field(None, description="Target tokens trained on, the unit of train.max_tokens: "
                                        "completion tokens that are neither padding nor masked out, counted from the "
                                        "batches (local: the answer tokens of the sequences one span's block trained "
                                        "on); None in reports made before it was recorded")
    tokens_padded: int | None = Field(None, description="Input tokens of the training batches, padding included "
                                      "(for reference; local: every token through one span's block)")
    sequences: int | None = Field(None, description="Sequences trained on, repeats counted")
    optimizer_steps: int | None = Field(None, description="Optimizer steps (local: over every span)")
    learning_rate: float | None = Field(None, description="Peak learning rate used (0: no step was taken)")
    optimizer: str
    memory_plan: dict[str, Any]
    seconds: Seconds
    notes: list[str] = Field(description="Recipe conflicts resolved before the run")
    provenance: Provenance


def read_recover_report(directory: Path) -> RecoverReport:
    """The recover_report.json of a `layerprune recover` output (one-line error when missing or of another version)."""
    return read_report(Path(directory) / RECOVER_REPORT, RecoverReport)


def model_card(report: RecoverReport, lineage: PrunedLineage | None) -> ModelCard:
    """README.md of a recovered model: hub metadata (the original's hub id as base model, the removals, the recovery
    recipe and teacher, tags) and the same in words."""
    from huggingface_hub import ModelCard, ModelCardData

    from layerprune.core.model_card import card_text
    from layerprune.models.hub_ids import base_model_of

    recipe, student = report.recipe, report.student.spec or report.student.location
    source = lineage.source if lineage is not None else report.student
    original = source.spec or source.location
    base = base_model_of(source)
    data = ModelCardData(base_model=base.hub_id, library_name="transformers", pipeline_tag="text-generation",
                         tags=["layerprune", "pruned", "recovered", f"recover-{recipe.method}"], layerprune={
                             "source": original, "variant": base.variant,
                             "dropped_blocks": lineage.dropped if lineage is not None else None,
                             "removed_sublayers": lineage.removed_sublayers if lineage is not None else None,
                             "score": lineage.method.score if lineage is not None else None,
                             "recover_method": recipe.method, "recover_recipe": recipe.name,
                             "recover_settings": recipe_summary(recipe),
                             "teacher": report.teacher, "teacher_base_model": base_model_of_teacher(report)})
    data.layerprune = {key: value for key, value in data.layerprune.items() if value is not None}
    loss = report.held_out_loss
    named = f"`{base.base_model}`" + (f" (variant `{base.variant}`)" if base.variant else "")
    lines = [
        f"# {original} pruned and recovered with {recipe.method}", "",
        f"Made with layerprune {report.provenance.layerprune}: {named} pruned to `{student}`, then fine-tuned on "
        f"the teacher `{report.teacher}`'s answers with recipe `{recipe.name}` (method {recipe.method}).", "",
        f"- {lineage.removal() if lineage is not None else 'dropped blocks: unknown'}",
        f"- score: {f'`{lineage.method.score}`' if lineage is not None else 'unknown'}",
        f"- recovery: recipe `{recipe.name}`, method {recipe.method}; teacher `{report.teacher}`",
        f"- held-out loss on teacher answers: {_loss(loss.before)} -> {_loss(loss.after)}",
        f"- {_tokens(report)}, {report.data.get('steps', '?')} optimizer steps, "
        f"{report.seconds.total:.0f} s", "",
        "Recovery wins back part of what pruning cost; evaluate with `layerprune evaluate` before use. "
        "See `recover_report.json` for the full recipe, the data and the loss curve.",
    ]
    return ModelCard(card_text(data, lines))


def recipe_summary(recipe: RecoverRecipe) -> dict[str, Any]:
    """The recipe's name and method, its prompts, the method's own section and the training's main settings (all of
    it is in recover_report.json)."""
    dump = recipe.model_dump(mode="json", exclude_none=True)
    train = {key: value for key, value in dump.get("train", {}).items() if key in TRAIN_KEYS}
    own = {recipe.method: dump[recipe.method]} if isinstance(dump.get(recipe.method), dict) else {}
    return {"name": recipe.name, "method": recipe.method, "prompts": dump.get("prompts"), **own, "train": train}


TRAIN_KEYS = ("learning_rate", "epochs", "max_steps", "max_tokens", "batch_size", "grad_accum", "max_length")


def base_model_of_teacher(report: RecoverReport) -> str | None:
    """The teacher's hub id where one is known and it is not named by it (embedded: the hub model), else None."""
    from layerprune.models.hub_ids import base_model_of_spec

    base = base_model_of_spec(report.teacher)
    return base.base_model if base.on_hub and base.base_model != report.teacher else None


def _tokens(report: RecoverReport) -> str:
    if report.tokens_unpadded is None:
        return f"{report.tokens_seen} tokens seen"
    return f"{report.tokens_unpadded} target tokens trained on ({report.sequences} sequences)"


def _loss(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
