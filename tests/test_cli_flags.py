"""One precedence rule for every stage: schema defaults < recipe file < explicit CLI flag."""

from __future__ import annotations

import argparse

import pytest

from layerprune.errors import LayerpruneError
from layerprune.prune.recipe import PruneRecipe
from layerprune.schema_cli import add_schema_args, build_schema, explicit_values


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_schema_args(parser, PruneRecipe)
    return parser.parse_args(list(argv))


def test_cli_false_beats_recipe_true_and_unset_flags_keep_the_recipe():
    recipe = {"drop": 4, "iterative": True, "calib_samples": 99}
    merged = build_schema(PruneRecipe, recipe, explicit_values(parse("--no-iterative", "--protect", "0,-1"), PruneRecipe))
    assert merged.iterative is False and merged.calib_samples == 99 and merged.protect == [0, -1]
    assert merged.score == "ablation"  # schema default


def test_lists_and_choices_are_parsed():
    values = explicit_values(parse("--layers", "3,1", "--metric", "accuracy"), PruneRecipe)
    assert values == {"layers": [3, 1], "metric": "accuracy"}
    with pytest.raises(SystemExit):
        parse("--metric", "f1")


def test_unknown_recipe_key_names_it():
    with pytest.raises(LayerpruneError, match="unknown key 'dorp'"):
        build_schema(PruneRecipe, {"drop": 2, "dorp": 3}, {})
