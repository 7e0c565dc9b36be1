"""`layerprune recipes` and the recover recipe schema."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from layerprune.cli import main
from layerprune.cli.recipe_kinds import RECIPE_SCHEMAS, validate_recipe
from layerprune.core import recipe_loading as recipes
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import RECIPE_FILES, RecipeFiles, find_recipe, shipped_recipes
from layerprune.recover.schema import LoraSection, RecoverRecipe

EXPECTED = {"selfgen-gsm8k", "selfgen-dolly", "selfgen-alpaca", "kd-gsm8k", "demo"}


def test_every_expected_recover_recipe_is_shipped():
    assert EXPECTED <= {name for kind, name in shipped_recipes("recover")}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_recipe_validates_and_shows_its_command(name):
    kind, path = find_recipe(name, "recover")
    assert kind == "recover"
    _, recipe = validate_recipe(path, kind)
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
    (tmp_path / "recover").mkdir()
    (tmp_path / "other").mkdir()
    for folder in ("recover", "other"):
        (tmp_path / folder / "same.yaml").write_text("name: same\n")
    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path)
    monkeypatch.setitem(RECIPE_FILES, "other", RecipeFiles("other"))
    monkeypatch.setitem(RECIPE_SCHEMAS, "other", RecoverRecipe)
    assert main(["recipes", "show", "same"]) == 2
    assert "pass --kind" in capsys.readouterr().err
    assert find_recipe("same", "other")[0] == "other"


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


def test_every_recipe_kind_has_its_files_and_its_schema():
    """The base floor's where-table and the top floor's schema table name the same kinds, in the same order."""
    assert list(RECIPE_SCHEMAS) == list(RECIPE_FILES)
    assert all(isinstance(schema, type) and issubclass(schema, BaseModel) for schema in RECIPE_SCHEMAS.values())


def test_a_new_recipe_kind_is_one_entry_in_each_table(tmp_path, monkeypatch):
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "one.yaml").write_text("# layerprune run --recipe one\nname: one\n")
    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path)
    monkeypatch.setitem(RECIPE_FILES, "toy", RecipeFiles("toy"))
    monkeypatch.setitem(RECIPE_SCHEMAS, "toy", LoraSection)
    monkeypatch.setitem(RECIPE_FILES, "recover", RecipeFiles("missing"))
    kind, path = find_recipe("one")
    assert kind == "toy"
    with pytest.raises(LayerpruneError, match="unknown key 'name'"):
        validate_recipe(path, kind)
