"""A new importance score is one file: its function, its own parameters and its block-major form, registered
together. The recipe (YAML keys), the CLI (flags), the report and --block-major take it with no edit elsewhere."""

from __future__ import annotations

import json

import pytest
from pydantic import Field

from helpers import assert_one_line_error, run_cli
from layerprune.core.recipe_loading import build_from_recipe
from layerprune.core.settings import RunSettings
from layerprune.prune.api import prune_model
from layerprune.prune.metrics import select_lowest
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.scores import (
    SCORES,
    BlockMajor,
    BlockMajorContext,
    ScoreContext,
    ScoreParams,
    ScoreResult,
    register_score,
)

CALIB = ["--calib", "arithmetic", "--calib-samples", "4", "--batch-size", "4", "--calib-seq-len", "48"]


class StrideParams(ScoreParams):
    stride: int = Field(2, ge=1, description="Test score: block i scores i mod stride")


def stride_result(depth: int, drop: int, protected: list[int], stride: int) -> ScoreResult:
    scores: list[float | None] = [float(i % stride) for i in range(depth)]
    return ScoreResult(scores, select_lowest(scores, drop, protected), details={"stride": stride})


def stride(ctx: ScoreContext) -> ScoreResult:
    return stride_result(ctx.depth, ctx.drop, ctx.protected, ctx.params_of(StrideParams).stride)


def stride_block_major(ctx: BlockMajorContext) -> ScoreResult:
    return stride_result(len(ctx.bw), ctx.drop, ctx.protected, StrideParams.of(ctx.params).stride)


@pytest.fixture
def stride_score():
    register_score("stride", StrideParams, BlockMajor(stride_block_major, lambda depth, drop: 5, "stride"))(stride)
    yield
    SCORES._items.pop("stride")


def test_a_registered_score_takes_its_own_flag_end_to_end(stride_score, capsys, tiny_llama, tmp_path):
    argv = ["prune", "--model", str(tiny_llama), "-o", str(tmp_path / "o"), "--score", "stride", "--drop", "2", *CALIB,
            "--dry-run", "--json"]
    for extra, dropped in (([], [2, 4]), (["--stride", "3"], [3, 4])):  # i mod 3: 0 at block 3, then 1 at 4 and 1
        code, out, err = run_cli(capsys, [*argv, *extra])
        assert code == 0, err
        report = json.loads(out.split("dry run: nothing written\n", 1)[1])
        assert report["dropped"] == dropped and report["recipe"]["stride"] == (3 if extra else 2)
        assert report["recipe"]["angular_tokens"] == "last"  # the shipped scores' parameters are still recorded
    code, _, err = run_cli(capsys, [*argv, "--stride", "0"])
    assert_one_line_error(code, err, "stride", "greater than or equal to 1")


def test_a_registered_score_parameter_is_a_recipe_key(stride_score, tmp_path, tiny_llama):
    path = tmp_path / "stride.yaml"
    path.write_text("score: stride\nstride: 3\ndrop: 2\ncalib: arithmetic\ncalib_samples: 4\nbatch_size: 4\n")
    recipe = build_from_recipe(PruneRecipe, "prune", path)
    assert recipe.score_params["stride"] == 3 and recipe.model_dump()["stride"] == 3
    assert PruneRecipe.model_validate(recipe.model_dump(mode="json")) == recipe
    settings = RunSettings(block_major=True)  # its block-major form, registered with it
    report = prune_model(str(tiny_llama), recipe.model_copy(update={"verify": False}), settings, tmp_path / "o").report
    assert report["dropped"] == [3, 4] and report["score_details"]["memory_plan"]["states"] == 5


def test_shipped_score_parameters_stay_flat_keys_and_context_attributes():
    recipe = PruneRecipe(drop=2, score="angular", angular_tokens="all", stack_candidates=0)
    keys = list(recipe.model_dump())  # flat keys after the recipe's own (fingerprints sort keys: no order to keep)
    assert keys[-2:] == ["stack_candidates", "angular_tokens"] and "score_params" not in keys
    assert recipe.model_dump()["angular_tokens"] == "all" and recipe.model_dump()["stack_candidates"] == 0
    assert "stack_candidates" not in recipe.model_dump(exclude={"stack_candidates"})
    with pytest.raises(ValueError, match="stack_candidates"):
        PruneRecipe(drop=2, stack_candidates=-1)
    ctx = ScoreContext(None, None, None, [], None, 1, [], params=recipe.score_params)
    assert ctx.angular_tokens == "all"
    ctx.angular_tokens = "last"
    assert ctx.params["angular_tokens"] == "last"
    assert recipe.score_params["angular_tokens"] == "all"  # the context's own copy: the recorded recipe unchanged
    assert recipe.model_dump()["angular_tokens"] == "all"
    assert ScoreContext(None, None, None, [], None, 1, []).stack_candidates == 1  # the score's default


def first_blocks(ctx: ScoreContext) -> ScoreResult:  # data-free: block i scores i (the first ones go)
    scores: list[float | None] = [float(i) for i in range(ctx.depth)]
    return ScoreResult(scores, select_lowest(scores, ctx.drop, ctx.protected))


@pytest.fixture
def first_score():
    register_score("first", data_free=True)(first_blocks)
    yield
    SCORES._items.pop("first")


def test_a_score_registered_data_free_reads_no_calibration_and_streams(first_score, monkeypatch, tiny_llama,
                                                                       tmp_path):
    import layerprune.prune.common as common

    recipe = PruneRecipe(drop=2, score="first", protect=[])
    assert not recipe.needs_calibration and PruneRecipe(drop=2).needs_calibration
    monkeypatch.setattr(common, "load_calibration", lambda *a, **k: pytest.fail("a data-free score read calibration"))
    monkeypatch.setattr("layerprune.prune.api.prune_in_memory",
                        lambda *a, **k: pytest.fail("a data-free score loaded the model"))
    result = prune_model(str(tiny_llama), recipe, RunSettings(), tmp_path / "o")
    assert result.report["dropped"] == [0, 1] and result.loaded is None  # streamed from the files, never loaded


def test_a_sublayer_form_registered_by_name_is_accepted_at_a_sublayer_grain():
    from layerprune.prune.sublayer_scores import SUBLAYER_SCORES

    with pytest.raises(ValueError, match="ranks whole blocks only; at --granularity attention use ablation"):
        PruneRecipe(drop=2, score="taylor", granularity="attention")
    SUBLAYER_SCORES.register("taylor")(lambda ctx, parts: None)
    try:
        assert PruneRecipe(drop=2, score="taylor", granularity="attention").score == "taylor"
    finally:
        SUBLAYER_SCORES._items.pop("taylor")
