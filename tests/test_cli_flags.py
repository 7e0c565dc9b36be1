"""The one config-to-flags layer, and one precedence rule for every stage: defaults < recipe file < explicit flag."""

from __future__ import annotations

import argparse

import pytest

from layerprune.analyze.schemas import ImportanceAnalysis
from layerprune.cli.flags import add_schema_flags, typed_layer
from layerprune.core.errors import LayerpruneError
from layerprune.core.recipe_loading import build_schema
from layerprune.pipeline.studies.cells import Arm
from layerprune.prune.recipe import PruneRecipe
from layerprune.recover.schema import RecoverRecipe


def parser_for(schema, **kwargs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_schema_flags(parser, schema, **kwargs)
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return parser_for(PruneRecipe).parse_args(list(argv))


def test_cli_false_beats_recipe_true_and_unset_flags_keep_the_recipe():
    recipe = {"drop": 4, "iterative": True, "calib_samples": 99}
    merged = build_schema(PruneRecipe, recipe, typed_layer(parse("--no-iterative", "--protect", "0,-1"), PruneRecipe))
    assert merged.iterative is False and merged.calib_samples == 99 and merged.protect == [0, -1]
    assert merged.score == "ablation"  # schema default


def test_lists_take_spaces_and_commas_and_choices_are_checked():
    assert typed_layer(parse("--layers", "3,1", "--metric", "accuracy"), PruneRecipe) == {"layers": [3, 1],
                                                                                          "metric": "accuracy"}
    assert typed_layer(parse("--layers", "3", "1,5"), PruneRecipe) == {"layers": [3, 1, 5]}
    assert typed_layer(parse("--layers", "3,12.attn"), PruneRecipe) == {"layers": [3, "12.attn"]}  # the recipe checks
    for bad in (["--metric", "f1"], ["--protect", "two"]):
        with pytest.raises(SystemExit):
            parse(*bad)


def test_sections_get_prefixed_flags_aliases_and_a_nested_layer():
    parser = parser_for(RecoverRecipe, skip=("name", "description"), aliases={"prompts.samples": ["--samples"]})
    layer = typed_layer(parser.parse_args(["--no-train-bf16", "--lora-r", "4", "--samples", "9", "--method", "full"]),
                        RecoverRecipe)
    assert layer == {"train": {"bf16": False}, "lora": {"r": 4}, "prompts": {"samples": 9}, "method": "full"}
    recipe = build_schema(RecoverRecipe, {"train": {"bf16": True, "max_steps": 7}}, layer)
    assert recipe.train.bf16 is False and recipe.train.max_steps == 7  # a flag replaces one field of its section
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "x"])


def test_help_comes_from_the_field_descriptions_and_mappings_get_no_flag():
    text = " ".join(parser_for(ImportanceAnalysis).format_help().split())
    assert " ".join(ImportanceAnalysis.model_fields["min_base_score"].description.split()) in text
    assert "--per-model" not in text and "(default: 16)" in text  # per_model is a mapping: a recipe's business
    arm = parser_for(Arm).format_help()
    assert "--method" in arm and "--lora" not in arm and "PydanticUndefined" not in arm  # required: no default


def test_unknown_recipe_key_names_it():
    with pytest.raises(LayerpruneError, match="unknown key 'dorp'"):
        build_schema(PruneRecipe, {"drop": 2, "dorp": 3}, {})
