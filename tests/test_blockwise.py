"""Block-major scoring (one block in memory at a time) equals the in-memory scorer; its memory plan."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from helpers import assert_one_line_error, run_cli
from layerprune.core.settings import RunSettings
from layerprune.models import find_decoder_stack
from layerprune.models.blockwise import load_skeleton, loaded_block, memory_plan
from layerprune.prune.api import prune_model
from layerprune.prune.blockwise import score_blockwise
from layerprune.prune.calib import arithmetic_calib, tokenize_calibration
from layerprune.prune.recipe import PruneRecipe
from layerprune.prune.scores import ScoreContext, run_importance_score


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
@pytest.mark.parametrize("score", ["ablation", "block-influence", "angular"])
def test_block_major_scores_equal_the_in_memory_scorer(tiny_models, arch, score):
    path = tiny_models(arch, 6)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    calib = arithmetic_calib(6, 0, None)
    batches = tokenize_calibration(calib, tokenizer, 64, 4)
    ctx = ScoreContext(model=model, tokenizer=tokenizer, stack=find_decoder_stack(model), batches=batches,
                       calib=calib, drop=2, protected=[0])
    expected = run_importance_score(score, ctx)
    bw = load_skeleton(path, AutoConfig.from_pretrained(path), torch.device("cpu"), torch.float32)
    got = score_blockwise(score, bw, batches, 2, [0])
    assert got.drop == expected.drop
    assert [s is None for s in got.scores] == [s is None for s in expected.scores]
    assert [s for s in got.scores if s is not None] == pytest.approx([s for s in expected.scores if s is not None],
                                                                      rel=1e-5, abs=1e-6)
    assert all(p.device.type == "meta" for p in bw.stack.layers.parameters())  # every block freed again


def test_one_block_is_loaded_at_a_time(tiny_llama):
    bw = load_skeleton(tiny_llama, AutoConfig.from_pretrained(tiny_llama), torch.device("cpu"), torch.float32)
    with loaded_block(bw, 2) as block:
        assert all(p.device.type == "cpu" for p in block.parameters())
        assert {i for i, b in enumerate(bw.stack.layers) if any(p.device.type != "meta" for p in b.parameters())} == {2}
    assert all(p.device.type == "meta" for p in bw.stack.layers.parameters())


def test_prune_block_major_never_loads_the_model(tiny_llama, tmp_path, monkeypatch):
    recipe = PruneRecipe(drop=2, score="ablation", calib="arithmetic", calib_samples=6, batch_size=4, calib_seq_len=64)
    expected = prune_model(str(tiny_llama), recipe, output=tmp_path / "ref").report

    def no_loading(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("block-major scoring must not load the whole model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    recipe = recipe.model_copy(update={"verify": False})  # verification reloads the written model when it fits
    report = prune_model(str(tiny_llama), recipe, RunSettings(block_major=True), output=tmp_path / "out").report
    assert report["dropped"] == expected["dropped"]
    assert report["scores"] == pytest.approx(expected["scores"], rel=1e-5, abs=1e-6)
    assert report["score_details"]["memory_plan"]["states"] == 6 + 2
    monkeypatch.undo()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 4


def test_block_major_refuses_scores_it_cannot_do(capsys, tiny_llama, tmp_path):
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--output", str(tmp_path / "o"), "--drop", "1",
                                    "--score", "taylor", "--block-major"])
    assert_one_line_error(code, err, "--block-major supports")
    assert not (tmp_path / "o").exists()


def test_memory_plan_counts_blocks_states_and_embeddings():
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    plan = memory_plan(config, tokens=300, batch_shape=(2, 50), dtype=torch.bfloat16, states=6)
    block = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64)
    assert plan.block_bytes == block
    assert plan.resident_bytes == 2 * (2 * 1000 * 64 + 64)
    assert plan.model_bytes == plan.resident_bytes + 4 * block
    assert plan.state_bytes == 300 * 64 * 2 and plan.peak_bytes > plan.resident_bytes + block + 6 * plan.state_bytes


def test_dry_run_on_a_config_alone_prints_the_plan(capsys, tmp_path):
    LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False).save_pretrained(tmp_path)
    code, out, err = run_cli(capsys, ["prune", "--model", str(tmp_path), "--dry-run", "--drop", "8", "--dtype",
                                      "bfloat16", "--block-major"])
    assert code == 0, err
    assert "80 blocks" in out and "whole model 131.42 GiB" in out and "x 82 alive" in out
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 80


def test_device_map_auto_loads_through_accelerate_and_scores_the_same(tiny_llama, monkeypatch):
    recipe = PruneRecipe(drop=2, score="ablation", calib="arithmetic", calib_samples=6, batch_size=4, calib_seq_len=64)
    plain = prune_model(str(tiny_llama), recipe, dry_run=True)
    calls, load = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(kwargs)
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    mapped = prune_model(str(tiny_llama), recipe, RunSettings(device_map="auto", max_memory=["cpu=1GiB"]), dry_run=True)
    assert calls[0]["device_map"] == "auto" and calls[0]["max_memory"]["cpu"] in ("1GiB", 1 << 30)
    assert mapped.report["scores"] == pytest.approx(plain.report["scores"], rel=1e-5, abs=1e-6)


def test_max_memory_must_be_device_equals_size(capsys, tiny_llama):
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--dry-run", "--drop", "1", "--device-map",
                                    "auto", "--max-memory", "cpu:1GiB"])
    assert_one_line_error(code, err, "DEVICE=SIZE")


def test_memory_plan_counts_a_tied_head_once():
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    plan = memory_plan(config, tokens=10, batch_shape=(1, 10), dtype=torch.float32, states=4)
    assert plan.resident_bytes == 4 * (1000 * 64 + 64)
