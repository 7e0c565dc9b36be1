"""`layerprune recipes` and the recover recipe schema."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from layerprune.cli import main
from layerprune.cli.recipe_kinds import RECIPE_SCHEMAS, validate_recipe
from layerprune.core import recipe_loading as recipes
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import find_recipe, shipped_recipes
from layerprune.recover.schema import LoraSection, RecoverRecipe

EXPECTED = {"selfgen-gsm8k", "selfgen-dolly", "selfgen-alpaca", "kd-gsm8k", "demo"}


def test_every_expected_recover_recipe_is_shipped():
    assert EXPECTED <= {name for kind, name in shipped_recipes("recover")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_recipe_validates_and_shows_its_command(name):
    kind, path = find_recipe(name, "recover")
    assert kind == "recover"
    _, recipe = validate_recipe(name, kind)
    assert recipe.name == name
    assert path.read_text().startswith(f"# recover --recipe {name}")


def test_validate_all_list_show_cp(capsys, tmp_path):
    assert main(["recipes", "validate"]) == 0
    assert main(["recipes", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in EXPECTED)
    assert main(["recipes", "show", "demo", "--kind", "recover"]) == 0
    assert "drop_blocks" in capsys.readouterr().out
    assert main(["recipes", "cp", "demo", str(tmp_path), "--kind", "recover"]) == 0
    assert (tmp_path / "demo.yaml").is_file()
    assert main(["recipes", "validate", str(tmp_path / "demo.yaml"), "--kind", "recover"]) == 0
    assert main(["recipes", "cp", "demo", str(tmp_path), "--kind", "recover"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_a_name_shared_by_two_kinds_asks_for_the_kind(capsys, monkeypatch, tmp_path):
    for folder, kind in (("recover", "recover"), ("other", "prune")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "same.yaml").write_text(f"kind: {kind}\nname: same\n")
    use_recipes_dir(monkeypatch, tmp_path)
    assert main(["recipes", "show", "same"]) == 2
    assert "pass --kind" in capsys.readouterr().err
    assert find_recipe("same", "prune")[0] == "prune"


def use_recipes_dir(monkeypatch: pytest.MonkeyPatch, path) -> None:
    """Shipped recipes read from `path` (the index is cached: cleared before and after)."""
    monkeypatch.setattr(recipes, "RECIPES_DIR", path)
    recipes.forget_shipped()
    monkeypatch.setattr(recipes, "RECIPES_DIR", path)


@pytest.fixture(autouse=True)
def _fresh_index():
    recipes.forget_shipped()
    yield
    recipes.forget_shipped()


def test_unknown_recipe_suggests_close_names(capsys):
    assert main(["recipes", "show", "selfgen-gsm"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown recipe 'selfgen-gsm'; did you mean: selfgen-gsm8k")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("data, bad", [
    ({"methd": "lora"}, "methd"),
    ({"lora": {"rank": 8}}, "lora.rank"),
    ({"train": {"learning_rate": -1}}, "train.learning_rate"),
    ({"method": "dora"}, "method"),
])
def test_schema_rejects_unknown_keys_and_bad_values(data, bad):
    with pytest.raises(Exception) as info:
        RecoverRecipe.model_validate(data)
    assert bad in str(info.value)


def test_validate_names_the_bad_field_in_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ngenerate:\n  temprature: 0.7\n")
    assert main(["recipes", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'generate.temprature'" in err and len(err.strip().splitlines()) == 1


def test_filter_correct_needs_known_answers():
    with pytest.raises(ValueError, match="known answers"):
        RecoverRecipe.model_validate({"prompts": {"source": "dolly"}, "generate": {"filter": "correct"}})


def test_every_shipped_recipe_says_a_kind_of_the_one_table():
    """The kind is written in each file (no filename globs); the top floor's table holds every kind used."""
    kinds = {kind for kind, _ in shipped_recipes()}
    assert kinds <= set(RECIPE_SCHEMAS)
    assert all(isinstance(schema, type) and issubclass(schema, BaseModel) for schema in RECIPE_SCHEMAS.values())


def test_a_new_recipe_kind_is_one_entry_in_the_table(tmp_path, monkeypatch):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "one.yaml").write_text("# layerprune run --recipe one\nkind: toy\nname: one\n")
    use_recipes_dir(monkeypatch, tmp_path)
    monkeypatch.setitem(RECIPE_SCHEMAS, "toy", LoraSection)
    kind, _ = find_recipe("one")
    assert kind == "toy"
    with pytest.raises(LayerpruneError, match="unknown key 'name'"):
        validate_recipe("one", kind)


def test_a_misspelled_kind_is_one_line_with_the_close_ones(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("kind: recovr\nname: r\n")
    with pytest.raises(LayerpruneError, match="unknown recipe kind 'recovr'.*recover"):
        validate_recipe(path, None)
