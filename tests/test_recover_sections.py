"""Recovery methods own their recipe sections (as scores own ScoreParams) and say by attributes what chains, studies
and reports ask of them: a toy method with its own section is one file (toy_method.py) and runs in a tiny study."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from helpers import run_cli
from layerprune.cli.flags import add_schema_flags
from layerprune.pipeline.studies.sweep_grid import SweepStudy, has_control
from layerprune.recover.lr_search import lr_section_of, with_learning_rate
from layerprune.recover.methods import METHODS
from layerprune.recover.schema import RecoverRecipe, rebuild_recipe

BEFORE = json.loads((Path(__file__).parent / "data" / "recover_recipe_before_sections.json").read_text())


@pytest.fixture
def toy(monkeypatch):
    """tests/toy_method.py imported for this test only: its method and its recipe section are gone afterwards."""
    monkeypatch.setattr(METHODS, "_items", dict(METHODS._items))
    fields, annotations = dict(RecoverRecipe.__pydantic_fields__), dict(RecoverRecipe.__annotations__)
    sys.modules.pop("toy_method", None)
    yield importlib.import_module("toy_method")
    sys.modules.pop("toy_method", None)
    RecoverRecipe.__pydantic_fields__ = fields
    RecoverRecipe.__annotations__.clear()
    RecoverRecipe.__annotations__.update(annotations)
    rebuild_recipe()


def test_the_recipe_built_from_the_registry_is_the_one_the_fixed_fields_made():
    """The defaults, the section order and the `recover` flags, as captured from the recipe with fixed sections."""
    assert RecoverRecipe().model_dump(mode="json") == BEFORE["default_dump"]
    assert list(RecoverRecipe.model_fields) == BEFORE["field_order"]
    parser = argparse.ArgumentParser()
    add_schema_flags(parser, RecoverRecipe)
    flags = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help")
    assert flags == BEFORE["recipe_flags"]
    recipe = RecoverRecipe.model_validate({"method": "merge", "merge": {"threshold": 0.5, "then": "local"},
                                           "local": {"learning_rate": 1e-3}})
    assert recipe.merge.threshold == 0.5 and recipe.local.learning_rate == 1e-3  # attribute access as before
    with pytest.raises(ValueError, match="Extra inputs"):
        RecoverRecipe.model_validate({"local": {"lerning_rate": 1e-3}})
    with pytest.raises(ValueError, match="mixed on-policy"):  # opd's own cross-section check
        RecoverRecipe.model_validate({"method": "replace", "replace": {"then": "opd"},
                                      "opd": {"lmbda": 0.5, "temperature": 2.0}})


@pytest.mark.parametrize(("recipe", "chain", "lr_section", "needs_cut"), [
    ({"method": "lora"}, "lora", "train", False),
    ({"method": "kd"}, "kd", "train", False),
    ({"method": "replace"}, "replace", None, True),
    ({"method": "merge"}, "merge", None, True),
    ({"method": "local"}, "local", "local", True),
    ({"method": "replace", "replace": {"then": "local"}}, "replace+local", "local", True),
    ({"method": "merge", "merge": {"then": "opd"}}, "merge+opd", "train", True),
    ({"method": "local", "local": {"then": "kd"}}, "local+kd", "local", True),
])
def test_the_chain_says_by_its_methods_attributes_what_it_trains_and_whether_it_needs_a_cut(recipe, chain,
                                                                                            lr_section, needs_cut):
    recovery = RecoverRecipe.model_validate(recipe)
    assert recovery.chain_name() == chain and recovery.lr_section() == lr_section
    assert recovery.needs_cut() == needs_cut
    assert lr_section_of(recovery.model_dump(mode="json")) == (lr_section or "train")  # a recorded recipe
    rated = with_learning_rate(recovery, 3e-3) if lr_section else None
    if rated is not None:
        assert getattr(rated, lr_section).learning_rate == 3e-3


def test_a_toy_method_owns_its_section_and_the_study_asks_its_attributes(toy, tiny_llama):
    recipe = RecoverRecipe.model_validate({"method": "toy", "toy": {"factor": 3.0}})
    assert isinstance(recipe.toy, toy.ToySection) and recipe.toy.factor == 3.0 and recipe.lr_section() == "toy"
    assert RecoverRecipe().toy.factor == 2.0 and not recipe.needs_cut()
    assert with_learning_rate(recipe, 1e-3).toy.learning_rate == 1e-3  # the grid sets the method's own section
    parser = argparse.ArgumentParser()
    add_schema_flags(parser, RecoverRecipe)
    assert "--toy-factor" in {o for a in parser._actions for o in a.option_strings}
    study = {"name": "s", "model": str(tiny_llama), "output": "x", "ratios": [2], "prune": {"layers": [2, 3]},
             "recover": {"recipe": "demo", "overrides": {"train": {"max_steps": 2}}},
             "arms": {"toy": {"method": "toy", "toy": {"factor": 3.0}}}, "controls": True,
             "classification": ["arc_easy"], "fixed": ["arith_1dc"], "probes": None,
             "evaluate": {"suite": "sweep-cpu"}}
    parsed = SweepStudy.model_validate(study)
    assert parsed.arm_recipe("toy", "<pruned>").toy.factor == 3.0 and has_control(parsed, "toy")
    with pytest.raises(ValueError, match="arm key 'tyo' is neither"):
        SweepStudy.model_validate({**study, "arms": {"toy": {"method": "toy", "tyo": {"factor": 3.0}}}})


def test_a_toy_method_with_its_own_section_runs_as_an_arm_of_a_tiny_study(toy, capsys, tiny_llama, tmp_path,
                                                                         monkeypatch):
    """Its section set per arm, its learning-rate grid on toy.learning_rate (its lr_section), scored and tabled."""
    monkeypatch.setenv("LAYERPRUNE_CACHE", str(tmp_path / "cache"))
    data = {
        "name": "toy-study", "model": str(tiny_llama), "output": str(tmp_path / "study"), "ratios": [2],
        "prune": {"layers": [2, 3]},
        "recover": {"recipe": "demo", "overrides": {
            "prompts": {"source": "probes:arith_2d_add", "samples": 8},
            "generate": {"max_new_tokens": 6, "batch_size": 4, "chat_template": False},
            "train": {"max_steps": 2, "max_length": 256, "held_out": 0.25}}},
        "arms": {"toy": {"method": "toy", "toy": {"factor": 3.0}}},
        "lr_grid": {"toy": [0.1, 0.2]}, "classification": ["arc_easy"], "fixed": ["arith_1dc"], "probes": None,
        "gsm8k_gate": None, "evaluate": {"suite": "sweep-cpu", "limit": 4, "batch_size": "4", "max_gen_toks": 4},
    }
    recipe = tmp_path / "study.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, _, err = run_cli(capsys, ["study", str(recipe), "--device", "cpu", "-q"])
    assert code == 0, err
    root = tmp_path / "study"
    search = json.loads((root / "lr_search" / "toy.json").read_text())
    assert {c["learning_rate"] for c in search["candidates"]} == {0.1, 0.2} and search["chosen"] in (0.1, 0.2)
    report = json.loads((root / "toy-k2" / "recover_report.json").read_text())
    assert report["recipe"]["method"] == "toy" and report["recipe"]["toy"] == {"factor": 3.0,
                                                                               "learning_rate": search["chosen"]}
    assert report["data"]["scaled"] == 3.0
    pruned, toyed = load_file(root / "pruned-k2" / "model.safetensors"), load_file(root / "toy-k2" /
                                                                                   "model.safetensors")
    assert (toyed["model.norm.weight"] == 3.0 * pruned["model.norm.weight"]).all()
    points = json.loads((root / "sweep.json").read_text())["points"]
    assert [(p["k"], p["arm"]) for p in points] == [(2, "toy")]
    assert (root / "eval" / "toy-k2" / "summary.json").is_file()
    assert "| 2 | toy | generative |" in (root / "sweep.md").read_text()


def test_what_a_chain_trains_comes_from_the_method_or_its_section():
    from layerprune.recover.train import trains_all_weights

    cases = [({"method": "lora"}, True, False), ({"method": "qlora"}, True, False), ({"method": "full"}, False, True),
             ({"method": "kd"}, True, False), ({"method": "opd", "opd": {"adapter": "full"}}, False, True),
             ({"method": "replace"}, False, False),
             ({"method": "replace", "replace": {"then": "kd"}, "kd": {"adapter": "full"}}, False, True)]
    for data, lora, every_weight in cases:
        recipe = RecoverRecipe.model_validate(data)
        assert (recipe.uses_lora(), trains_all_weights(recipe)) == (lora, every_weight), data
