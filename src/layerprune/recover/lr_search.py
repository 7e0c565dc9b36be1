"""A learning rate per arm, chosen from a grid fixed in the recipe (`lr_grid`), the same way for every sweep (one k:
a recovery study): the arm's replicate-0 recipe trained at each candidate, the lowest held-out loss
after training chosen (the token-weighted CE on the teacher's held-out answers, prompts that no evaluation scores), the
search written to lr_search/<label>.json, and every replicate and control of the arm trained at the rate chosen.
Also what a finished recovery spent and the rate it trained at, read from its report (`budget_spent`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from layerprune.core.errors import LayerpruneError
from layerprune.core.outputs import write_atomic
from layerprune.recover.schema import RecoverRecipe

CRITERION = "held-out CE after training (lowest)"


def lr_search_file(root: Path, label: str) -> Path:
    return root / "lr_search" / f"{label}.json"


def with_learning_rate(recipe: RecoverRecipe, learning_rate: float | None) -> RecoverRecipe:
    """The recipe trained at `learning_rate` (None: as it is): local.learning_rate where the recipe has a local step,
    train.learning_rate otherwise."""
    if learning_rate is None:
        return recipe
    from layerprune.core.recipe_loading import merge_layers

    section = recipe.lr_section() or "train"
    return RecoverRecipe.model_validate(merge_layers(recipe.model_dump(mode="json"),
                                                     {section: {"learning_rate": learning_rate}}))


def check_lr_grid(grid: dict[str, list[float]], arms: Iterable[str], recipe_of: Callable[[str], RecoverRecipe],
                  held_out: float) -> None:
    """Every grid names an arm that trains, with learning rates > 0, and the recipe holds answers out to choose on."""
    arms = list(arms)
    for label, rates in grid.items():
        if label not in arms:
            raise ValueError(f"lr_grid: '{label}' is no arm (arms: {', '.join(arms)})")
        if not rates or any(rate <= 0 for rate in rates):
            raise ValueError(f"lr_grid.{label}: give one or more learning rates > 0")
        recipe = recipe_of(label)
        if recipe.lr_section() is None:
            raise ValueError(f"lr_grid.{label}: arm '{label}' ({recipe.chain_name()}) trains nothing")
    if grid and not held_out:
        raise ValueError("lr_grid: the choice reads the held-out loss; set recover train.held_out > 0")


def search(root: Path, label: str, rates: list[float], train: Callable[[float, Path], None],
           **context: Any) -> dict[str, Any]:
    """Train at each rate (`train(rate, folder)`; a candidate already trained is kept), choose the lowest held-out
    loss; returns the record (not yet written: the caller may move the chosen run first, then `write_search`)."""
    rows = []
    for index, rate in enumerate(rates):
        output = root / "lr_search" / label / f"lr{index}"
        if not (output / "recover_report.json").is_file():
            train(rate, output)
        rows.append({"learning_rate": rate, "held_out_loss": held_out_loss(output),
                     "folder": str(output.relative_to(root))})
    measured = [r for r in rows if r["held_out_loss"] is not None]
    if not measured:
        raise LayerpruneError(f"lr search of '{label}': no candidate reported a held-out loss")
    best = min(measured, key=lambda r: r["held_out_loss"])
    return {"arm": label, **context, "chosen": best["learning_rate"], "chosen_folder": best["folder"],
            "criterion": CRITERION, "candidates": rows}


def write_search(root: Path, record: dict[str, Any]) -> None:
    write_atomic(lr_search_file(root, record["arm"]), json.dumps(record, indent=1))


def chosen(root: Path, label: str, grid: dict[str, list[float]]) -> float | None:
    """The learning rate the arm's grid chose (None: the arm has no grid)."""
    if label not in grid:
        return None
    path = lr_search_file(root, label)
    if not path.is_file():
        raise LayerpruneError(f"arm '{label}' has an lr_grid but no {path}: run its lr-{label} stage first")
    return float(json.loads(path.read_text())["chosen"])


def held_out_loss(output: Path) -> float | None:
    """The held-out loss after training in a recover_report.json: the token-weighted CE every method reports, else
    the trainer's evaluation loss."""
    report = json.loads((output / "recover_report.json").read_text())
    after = ((report.get("held_out_metrics") or {}).get("after") or {}).get("ce")
    return after if after is not None else (report.get("held_out_loss") or {}).get("after")


def lr_lines(root: Path, labels: list[str], scope: str) -> list[str]:
    """Each learning-rate search: every candidate's held-out loss and the rate chosen; `scope` says who trained at
    it."""
    lines = []
    for label in labels:
        path = lr_search_file(root, label)
        if path.is_file():
            record = json.loads(path.read_text())
            tried = ", ".join(f"{c['learning_rate']:g} -> " + ("-" if c["held_out_loss"] is None
                                                              else f"{c['held_out_loss']:.4f}") + _kl(root, c)
                              for c in record["candidates"])
            where = f" at k = {record['k']}" if "k" in record else ""
            seed = f" (seed + {record['seed_offset']})" if "seed_offset" in record else " (replicate 0's seed)"
            lines.append(f"Learning rate of {label}: {record['chosen']:g}, the lowest held-out CE after training of "
                         f"the arm's recipe{where}{seed} on the teacher's held-out answers (never scored) among "
                         f"{tried}; {scope}." + _edge(record))
    return lines


def _kl(root: Path, candidate: dict[str, Any]) -> str:
    """' (KL 0.1215)': a candidate's held-out KL to the teacher after training, where its report kept it."""
    path = root / str(candidate.get("folder", "")) / "recover_report.json"
    if not candidate.get("folder") or not path.is_file():
        return ""
    kl = ((json.loads(path.read_text()).get("held_out_metrics") or {}).get("after") or {}).get("kl")
    return "" if kl is None else f" (KL {kl:.4f})"


def _edge(record: dict[str, Any]) -> str:
    """A note where the rate chosen is an end of its grid: the best rate may lie beyond the grid."""
    rates = [float(c["learning_rate"]) for c in record["candidates"]]
    if len(rates) < 2 or record["chosen"] not in (min(rates), max(rates)):
        return ""
    end = "highest" if record["chosen"] == max(rates) else "lowest"
    return f" It is the {end} rate of the grid: a better one may lie beyond it, untried."


def budget_spent(path: Path) -> dict[str, Any]:
    """Unpadded target tokens, sequences and optimizer steps a recovery spent (None where its report predates those
    fields) and the learning rate it trained at (the section the chain trains at: local's own where it has a local
    step), from its recover_report.json at `path`."""
    raw = json.loads(path.read_text())
    data, recipe = raw.get("data") or {}, raw.get("recipe") or {}
    section = lr_section_of(recipe)
    rate = ((recipe.get(section) or {}).get("learning_rate") if section != "train" else None) or \
        (recipe.get("train") or {}).get("learning_rate")
    return {"learning_rate": raw.get("learning_rate") or rate, **{key: raw.get(key, data.get(key)) for key in
                                      ("tokens_unpadded", "sequences", "optimizer_steps")}}


def lr_section_of(recipe: dict[str, Any]) -> str:
    """The section whose learning_rate a recorded recipe trained at ('train' where it cannot be read today)."""
    try:
        return RecoverRecipe.model_validate(recipe).lr_section() or "train"
    except ValueError:
        return "train"
