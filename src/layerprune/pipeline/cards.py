"""The scores on the model cards: a run's report stage writes each evaluated model's headline scores into its card's
`model-index` with the run's paired table (original / pruned / recovered) in its text; `push --scores` does the same
from an `evaluate` output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.model_card import CARD_FILE, CardScore, with_scores, write_card
from layerprune.evaluate.report import format_table
from layerprune.evaluate.summary import SUMMARY_FILE, Summary, read_summary

CARD_ROLES = ("pruned", "recovered")  # the run's models that have a folder, and so a card
PAIRED_NOTE = ("Every model answered the same items (original: the model before pruning; scores of 0-1 metrics in "
               "percent); where a recovered model was evaluated, 'won back' is the share of the drop it regained, "
               "with its 95% paired interval. Every paired figure: {where}.")


def summary_scores(summary: Summary) -> list[CardScore]:
    """A model's headline score per task, as its card holds them."""
    return [CardScore(task=r.task, metric=r.metric, value=r.value, stderr=r.stderr, n=r.n)
            for r in summary.headlines().values()]


def refresh_run_cards(name: str, folders: dict[str, Path], summaries: dict[str, Summary],
                      comparison: dict[str, Any] | None) -> list[Path]:
    """Rewrite the card of each evaluated model folder of a run (`folders`: role -> folder) with its scores and the
    run's paired table; the cards rewritten."""
    from layerprune.pipeline.report_glance import glance_table

    table = None
    if comparison is not None:
        table = (glance_table(comparison["rows"], comparison["averages"], list(summaries)) + "\n\n"
                 + PAIRED_NOTE.format(where="the run's report.md"))
    written = []
    for role, folder in folders.items():
        card = folder / CARD_FILE
        if role not in summaries or not card.is_file():
            continue
        text = with_scores(card.read_text(encoding="utf-8"), f"{name}-{role}", summary_scores(summaries[role]),
                           table or format_table(summaries[role]))
        written.append(write_card(folder, text))
    return written


def card_with_evaluation(text: str, evaluation: Path, model_name: str, model: Path | None = None) -> str:
    """The card `text` with the scores of an `evaluate` output folder (its summary.json) and their table; with
    `model`, only when those scores are of its weights (check_scored)."""
    path = Path(evaluation)
    path = path / SUMMARY_FILE if path.is_dir() else path
    if not path.is_file():
        raise LayerpruneError(f"--scores {evaluation}: no {SUMMARY_FILE} there (give the folder `layerprune "
                              "evaluate` wrote for this model)")
    summary = read_summary(path)
    if model is not None:
        check_scored(summary, Path(model), evaluation)
    return with_scores(text, model_name, summary_scores(summary), paired_table(path.parent) or format_table(summary))


def check_scored(summary: Summary, model: Path, evaluation: Path) -> None:
    """Refuse scores measured on other weights than `model`'s: the summary's model_hash against the fingerprint of
    `model`'s files (models/identity.py; the file hashes are remembered, so the model evaluated here is not read
    again)."""
    from layerprune.core.settings import RunSettings
    from layerprune.models.identity import model_fingerprint
    from layerprune.models.loading import resolve_model

    settings = RunSettings()
    if model_fingerprint(resolve_model(model, settings), settings.resolved_cache_dir()) != summary.model_hash:
        raise LayerpruneError(f"--scores {evaluation}: those are the scores of {summary.model.spec} (weights "
                              f"{summary.model_hash[:12]}), not of the weights in {model}; give the evaluation of "
                              "this model")


def paired_table(folder: Path) -> str | None:
    """The paired table of the comparison `evaluate --baseline/--pruned` wrote beside a role's folder, or None."""
    import json

    from layerprune.pipeline.report_glance import glance_table

    path = folder.parent / "comparison.json"
    if not path.is_file():
        return None
    comparison = json.loads(path.read_text(encoding="utf-8"))
    roles = list(comparison.get("models") or {})
    if folder.name not in roles:
        return None
    return (glance_table(comparison["rows"], comparison["averages"], roles) + "\n\n"
            + PAIRED_NOTE.format(where="comparison.md of the evaluation"))
