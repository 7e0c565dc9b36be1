"""Model cards (README.md) as the hub reads them: YAML metadata, then text; the scores as `model-index`.

Knows no model: the stages give the metadata and the lines of text (prune/report, recover/report, posttrain), a
layer above gives the scores (pipeline/cards) and `export/push` shares the result. huggingface_hub's ModelCard and
EvalResult read every card written here back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from layerprune.core.outputs import write_atomic

if TYPE_CHECKING:
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

CARD_FILE = "README.md"
TASK_TYPE = "text-generation"
SCORES_HEADING = "## Scores"
_FRONT = re.compile(r"\A---\n(.*?\n)?---\n", re.DOTALL)


class CardScore(BaseModel):
    """One headline score of an evaluated model, as its card's `model-index` holds it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    task: str = Field(description="The task (lm-eval name or probe), the card's dataset name and type")
    metric: str = Field(description="The metric (acc, acc_norm, exact_match, accuracy, ...)")
    value: float = Field(description="The score")
    stderr: float | None = Field(None, description="Its standard error, where known (in the text, not the metadata)")
    n: int | None = Field(None, description="Documents or items scored")


def card_text(data: ModelCardData, lines: list[str]) -> str:
    """README.md: `data` as YAML between the fences, then the lines of text."""
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"


def eval_results(scores: list[CardScore]) -> list[EvalResult]:
    """The scores as huggingface_hub's EvalResult: text generation, the task as the dataset, the metric as named."""
    from huggingface_hub import EvalResult

    return [EvalResult(task_type=TASK_TYPE, dataset_type=s.task, dataset_name=s.task, metric_type=s.metric,
                       metric_value=s.value) for s in scores]


def with_scores(text: str, model_name: str, scores: list[CardScore], table: str) -> str:
    """The card `text` with `scores` as its model-index (under `model_name`) and a Scores section holding `table`
    (replacing the section an earlier evaluation wrote)."""
    from huggingface_hub import ModelCard

    card = ModelCard(text, ignore_metadata_errors=True)
    card.data.model_name = model_name if scores else None  # the hub reads model_name only with model-index
    card.data.eval_results = eval_results(scores) or None
    section = [SCORES_HEADING, "", table.rstrip(), ""]
    return f"---\n{card.data.to_yaml()}\n---\n" + replace_section(card.text, SCORES_HEADING, "\n".join(section))


def replace_section(body: str, heading: str, section: str) -> str:
    """`body` with the section under `heading` (up to the next heading of its level) replaced, or appended."""
    level = heading.split(" ", 1)[0] + " "
    lines = body.rstrip("\n").split("\n")
    if heading not in lines:
        return "\n".join([*lines, "", section]).rstrip("\n") + "\n"
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
    rest = lines[end:]
    return "\n".join([*lines[:start], *section.rstrip("\n").split("\n"), *([""] + rest if rest else [])]) + "\n"


def without_section(body: str, heading: str) -> str:
    """`body` less the section under `heading` (up to the next heading of its level)."""
    lines = body.split("\n")
    if heading not in lines:
        return body
    start, level = lines.index(heading), heading.split(" ", 1)[0] + " "
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith(level)), len(lines))
    return "\n".join([*lines[:start], *lines[end:]])


def read_card(path: Path) -> ModelCard:
    """The card at `path` (metadata read leniently: a card written by hand may bend the hub's schema)."""
    from huggingface_hub import ModelCard

    return ModelCard(Path(path).read_text(encoding="utf-8"), ignore_metadata_errors=True)


def card_metadata(text: str) -> str:
    """The card's YAML metadata between its fences ('' when it has none)."""
    match = _FRONT.match(text)
    return (match.group(1) or "") if match else ""


def write_card(directory: Path, text: str) -> Path:
    """DIRECTORY/README.md, written whole or not at all."""
    path = Path(directory) / CARD_FILE
    write_atomic(path, text)
    return path
