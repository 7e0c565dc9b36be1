"""Streaming prune: drop blocks from the safetensors files without loading the model, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import skip_reference_logits
from layerprune.core.errors import LayerpruneError
from layerprune.core.settings import RunSettings
from layerprune.models import drop_blocks
from layerprune.models.shards import block_prefix, read_checkpoint, rename_map
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from tiny import make_tiny_model

DROP = [1, 3]


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def bf16_model(directory: Path, arch: str) -> Path:
    make_tiny_model(directory, arch, 6)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def in_memory_prune(source: Path, drop: list[int], target: Path) -> Path:
    """The old path: load the whole model in its dtype, drop blocks, save_pretrained."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    drop_blocks(model, drop)
    model.save_pretrained(target, safe_serialization=True)
    return target


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen2"])
def test_streamed_prune_is_bit_identical_to_the_in_memory_path(arch, tmp_path, monkeypatch):
    source = bf16_model(tmp_path / "src", arch)
    reference = in_memory_prune(source, DROP, tmp_path / "ref")

    def no_loading(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("--layers must not load the model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_loading)
    # --no-verify: nothing loads (the config is still checked on the meta device); with verification the written
    # model's logits are compared with the original's when both fit in memory
    result = prune_model(str(source), PruneRecipe(layers=DROP, verify=False), output=tmp_path / "out")
    monkeypatch.undo()
    assert result.report["verification"]["checked"] == "meta"
    assert result.loaded is None and result.report["saved"]["dtypes"] == {"bfloat16": len(all_tensors(reference))}
    assert_same_tensors(all_tensors(tmp_path / "out"), all_tensors(reference))
    streamed, expected = (json.loads((d / "config.json").read_text()) for d in (tmp_path / "out", reference))
    for key in ("num_hidden_layers", "layer_types", "max_window_layers", "dtype"):
        assert streamed.get(key) == expected.get(key), key


def test_sharded_stream_loads_and_matches_the_skip_reference(tiny_llama, tmp_path):
    settings = RunSettings(max_shard_size="60KB")
    result = prune_model(str(tiny_llama), PruneRecipe(layers=DROP), settings, output=tmp_path / "out")
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) == result.report["saved"]["shards"] > 2
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    big = max(t.numel() * t.element_size() for t in all_tensors(out).values())
    assert all(s.stat().st_size <= max(60_000, big) + 10_000 for s in shards)
    original = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.num_hidden_layers == 4
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, use_cache=False).logits,
                                   skip_reference_logits(original, ids, DROP), rtol=1e-5, atol=1e-5)


def test_scored_prune_saves_the_source_tensors_not_a_float32_copy(tmp_path):
    source = bf16_model(tmp_path / "src", "llama")
    recipe = PruneRecipe(drop=2, score="block-influence", calib="arithmetic", calib_samples=4, batch_size=4)
    result = prune_model(str(source), recipe, RunSettings(), output=tmp_path / "out")
    assert result.loaded is not None and result.loaded.model.dtype == torch.float32
    reference = in_memory_prune(source, result.report["dropped"], tmp_path / "ref")
    assert_same_tensors(all_tensors(tmp_path / "out"), all_tensors(reference))


def test_rename_map_renumbers_blocks_and_shifts_extra_blocks_past_the_stack():
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.1.a", "model.layers.2.a",
             "model.layers.2.mlp.experts.7.w", "model.layers.3.mtp.w", "model.norm.weight"]
    renamed = rename_map(names, "model.layers", kept=[0, 2], depth=3)
    assert renamed == {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.0.a": "model.layers.0.a",
        "model.layers.2.a": "model.layers.1.a",
        "model.layers.2.mlp.experts.7.w": "model.layers.1.mlp.experts.7.w",
        "model.layers.3.mtp.w": "model.layers.2.mtp.w",
        "model.norm.weight": "model.norm.weight",
    }


def test_block_prefix_finds_the_stack_and_refuses_to_guess():
    names = [f"model.layers.{i}.w" for i in range(4)] + [f"vision.blocks.{i}.w" for i in range(2)]
    assert block_prefix(names, 4) == "model.layers"
    with pytest.raises(LayerpruneError, match="cannot tell"):
        block_prefix(names, 5)


def test_read_checkpoint_reports_a_missing_shard(tiny_llama, tmp_path):
    prune_model(str(tiny_llama), PruneRecipe(layers=[1]), RunSettings(max_shard_size="60KB"), output=tmp_path / "out")
    next((tmp_path / "out").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(LayerpruneError, match="lacks shard"):
        read_checkpoint(tmp_path / "out")
