"""Recipes that say their kind, inherit from a `base`, and expand a `grid` into cells (core/recipe_loading.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerprune.cli import main
from layerprune.cli.recipe_kinds import validate_recipe
from layerprune.core import recipe_loading as recipes
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import RECIPES_DIR, load_recipe, shipped_grids, shipped_recipes

BEFORE = Path(__file__).parent / "data" / "recipes_before_grids.json"  # recipes/studies/*.yaml as of 362eb87


@pytest.fixture(autouse=True)
def _fresh_index():
    recipes.forget_shipped()
    yield
    recipes.forget_shipped()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def shipped_in(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setattr(recipes, "RECIPES_DIR", folder)
    recipes.forget_shipped()


@pytest.mark.parametrize("name", sorted(json.loads(BEFORE.read_text())))
def test_every_folded_study_resolves_to_the_recipe_it_ran_under(name):
    """Each study recipe of the old files (46, now 19 files) is a name that resolves to the same fields; only the 18
    paper-B descriptions are drawn from a template now."""
    before = json.loads(BEFORE.read_text())[name]
    now, _ = load_recipe(name, None)
    if name.startswith(("limits-llama31", "limits-mistral-7b-", "limits-qwen25")):
        assert before.pop("description") and now.pop("description")
    now.pop("comparisons", None)  # declared comparisons (issue 56) shape the report, not the run (not fingerprinted)
    if name.startswith("recovery-"):  # a recovery study, now a sweep of one k (issue 56): the same protocol
        now = as_recovery_study(now, before)
    if name.startswith("grain-"):  # a grain study, now a sweep with grains (issue 56): the same protocol
        now = as_grain_study(now, before)
    assert now == before


def as_recovery_study(sweep: dict, before: dict) -> dict:
    """A one-k sweep's fields as the recovery study they were: its one k the cut, its classification and fixed tasks
    evaluate.only (or every task of the suite, where the study named none), no gate where it says probes: null, and
    GSM8K scored only where it is fixed, as the study's tasks had it."""
    from layerprune.pipeline.studies.cells import suite_tasks

    study = dict(sweep)
    assert study.pop("ratios") == [study["prune"].get("drop") or len(study["prune"]["layers"])]
    tasks = [*study.pop("classification"), *study.pop("fixed")]
    only = before["evaluate"].get("only")
    assert tasks == only if only else sorted(tasks) == sorted(suite_tasks(before["evaluate"]["suite"]))
    study["evaluate"] = {**study["evaluate"], **({"only": only} if only else {})}
    if study.get("probes", {}) is None:
        del study["probes"]
    gate = study.pop("gsm8k_gate", "default")
    assert (gate is None) == ("gsm8k" not in tasks)  # never a GSM8K the study did not score
    return study


def as_grain_study(sweep: dict, before: dict) -> dict:
    """A sweep with grains as the grain study it was: its ratios the levels, its grains section the grains (block
    first), match, tolerance, speed_repeats and gates, its one arm the arm, no probe or GSM8K gate, and its
    classification and fixed tasks the evaluation's tasks: evaluate.only of sweep-cpu where the study named the suite,
    evaluate.tasks where it named none (planned identically: the same tasks, settings and items at limit 100)."""
    study = dict(sweep)
    cuts = study.pop("grains")
    study.update(levels=study.pop("ratios"), grains=["block", *cuts.pop("compare")], **cuts)
    ((label, arm),) = study.pop("arms").items()
    assert label == arm["method"]  # the recovery's name, {study}-{method}, as it was
    study["arm"] = arm
    assert study.pop("probes") is None and study.pop("gsm8k_gate") is None
    tasks = [*study.pop("classification", []), *study.pop("fixed")]
    evaluate = dict(study["evaluate"])
    if "suite" in before["evaluate"]:
        evaluate["only"] = tasks
    else:
        assert evaluate.pop("suite") == "sweep-cpu"
        evaluate["tasks"] = tasks
    study["evaluate"] = evaluate
    return study


def test_recipes_studies_has_at_most_20_files_and_paper_b_is_one_grid():
    assert len(list((RECIPES_DIR / "studies").glob("*.yaml"))) <= 20
    cells = shipped_grids("run")[("run", "limits-paper-b")]
    assert len(cells) == 18 and "limits-qwen25-7b-bi7-gsm8k-full" in cells


def test_every_shipped_cell_validates():
    cells = [(kind, name) for (kind, grid), names in shipped_grids().items() for name in names]
    assert len(cells) >= 35
    for kind, name in cells:
        assert validate_recipe(name, kind)[0] == kind


def test_a_base_is_merged_under_at_every_depth_and_its_kind_is_kept(tmp_path):
    write(tmp_path / "a.yaml", "kind: recover\nname: a\ntrain: {learning_rate: 0.001, max_steps: 4}\n")
    child = write(tmp_path / "b.yaml", "base: a.yaml\nname: b\ntrain: {max_steps: 9}\n")
    data, _ = load_recipe(child, None)
    assert data == {"name": "b", "train": {"learning_rate": 0.001, "max_steps": 9}}
    assert validate_recipe(child, None)[0] == "recover"


def test_a_base_may_name_a_shipped_recipe(tmp_path):
    child = write(tmp_path / "mine.yaml", "base: selfgen-dolly\nname: mine\nprompts: {samples: 7}\n")
    data, _ = load_recipe(child, "recover")
    shipped, _ = load_recipe("selfgen-dolly", "recover")
    assert data["prompts"] == {**shipped["prompts"], "samples": 7} and data["generate"] == shipped["generate"]


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "base: b.yaml\nname: a\n", "b.yaml": "base: a.yaml\nname: b\n"}, "circular base (a -> b -> a)"),
    ({"a.yaml": "base: a.yaml\nname: a\n"}, "circular base (a -> a)"),
    ({"a.yaml": "base: gone.yaml\nname: a\n"}, "base file not found"),
    ({"a.yaml": "base: selfgen-dolyl\nname: a\n"}, "did you mean: selfgen-dolly"),
    ({"a.yaml": "kind: prune\nbase: selfgen-dolly\nname: a\n"}, "its base 'selfgen-dolly' is a recover recipe"),
])
def test_a_bad_base_is_one_line_before_anything_runs(tmp_path, capsys, files, message):
    for name, text in files.items():
        write(tmp_path / name, text)
    assert main(["recipes", "validate", str(tmp_path / "a.yaml")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


GRID = """\
kind: recover
name: toy-{size}-{data}
description: rank {lora.r} of {name}
lora: {alpha: 16}
grid:
  size:
    small: {lora: {r: 4}}
    large: {lora: {r: 8}}
  data:
    dolly: {tag: d, prompts: {source: dolly}}
    alpaca: {tag: a, prompts: {source: alpaca}}
"""


def test_a_grid_expands_to_named_cells_in_axis_order(tmp_path, monkeypatch):
    write(tmp_path / "recover" / "toys.yaml", GRID)
    shipped_in(monkeypatch, tmp_path)
    assert shipped_grids() == {("recover", "toys"): ["toy-small-d", "toy-small-a", "toy-large-d", "toy-large-a"]}
    assert set(shipped_recipes("recover")) == {("recover", n) for n in ("toy-small-d", "toy-small-a", "toy-large-d",
                                                                         "toy-large-a")}
    cell, _ = load_recipe("toy-large-a", "recover")
    assert cell == {"name": "toy-large-a", "description": "rank 8 of toy-large-a",
                    "lora": {"alpha": 16, "r": 8}, "prompts": {"source": "alpaca"}}
    assert validate_recipe("toy-small-d", None)[1].lora.r == 4


def test_a_grid_named_whole_lists_its_cells_in_one_line(tmp_path, monkeypatch, capsys):
    write(tmp_path / "recover" / "toys.yaml", GRID)
    shipped_in(monkeypatch, tmp_path)
    with pytest.raises(LayerpruneError, match="is a grid of 4 recipes; name one: toy-small-d, toy-small-a"):
        load_recipe("toys", "recover")


@pytest.mark.parametrize("edit, message", [
    (("name: toy-{size}-{data}", "name: toy-{size}"), "two cells are named 'toy-small'"),
    (("description: rank {lora.r}", "description: rank {lora.rank}"), "'{lora.rank}' names no axis"),
    (("  size:\n", "  size: 3\n  other:\n"), "grid must map each axis"),
])
def test_a_bad_grid_is_one_line(tmp_path, capsys, edit, message):
    path = write(tmp_path / "toys.yaml", GRID.replace(*edit))
    assert main(["recipes", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_show_and_cp_give_a_cell_as_the_recipe_it_resolves_to(tmp_path, capsys):
    assert main(["recipes", "show", "limits-qwen25-7b-bi7"]) == 0
    shown = capsys.readouterr().out
    assert "kind: run" in shown and "drop: 7" in shown and "grid:" not in shown
    assert main(["recipes", "cp", "limits-qwen25-7b-bi7", str(tmp_path)]) == 0
    copied = tmp_path / "limits-qwen25-7b-bi7.yaml"
    assert load_recipe(copied, None)[0] == load_recipe("limits-qwen25-7b-bi7", None)[0]


def test_a_variant_recipe_names_its_method_and_reads_old_records():
    """`kind:` is the recipe's kind; the variant's method (once `kind`) reads from records as before, and dumps as
    `kind` so every variant's fingerprint is unchanged."""
    from layerprune.posttrain.schema import VariantRecipe

    recipe = validate_recipe("grpo-math-embedded", None)[1]
    assert recipe.method == "grpo"
    assert recipe.model_dump(mode="json")["kind"] == "grpo"
    assert VariantRecipe.model_validate(recipe.model_dump(mode="json")) == recipe
