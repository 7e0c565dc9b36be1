"""What the streamed prune's verification costs: its forward on a handful of tokens runs on as many CPU threads as
its products are worth (one for a small model), and the caller's thread count is left as it was; each written weight
is hashed as its module is about to use it; the source and written models are built once each."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from transformers import AutoConfig

import layerprune.models.blocks as blocks
import layerprune.models.copy_check as copy_check
import layerprune.models.verify_blockwise as verify_blockwise
from layerprune.core.settings import RunSettings
from layerprune.models.blockwise import empty_model
from layerprune.models.shards import sliced_config
from layerprune.models.verify_blockwise import READ_ROWS, THREAD_WORK, built_from, check_threads
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from test_shards import bf16_model

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():  # noqa: ANN201
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_streamed_check_runs_a_small_model_on_one_thread_and_restores_the_count(tiny_llama, tmp_path,
                                                                                    monkeypatch, two_threads):
    seen: list[int] = []
    real = verify_blockwise.block_major_logits

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(verify_blockwise, "block_major_logits", counted)
    report = prune_model(str(tiny_llama), PruneRecipe(layers=[1, 3]), RunSettings(), output=tmp_path / "out").report
    assert report["verification"]["checked"] is True
    assert seen == [1, 1]  # the written forward and the reference
    assert torch.get_num_threads() == 2


def test_check_threads_grows_with_the_largest_product(two_threads):
    with torch.device("meta"):
        small, large = nn.Linear(1024, 4096), nn.Linear(8192, 8192)  # no memory: shapes only
    with check_threads(small, CPU, 16) as count:
        assert count == 1 == torch.get_num_threads()
    assert 8192 * 8192 * READ_ROWS // THREAD_WORK >= 2
    with check_threads(large, CPU, 4) as count:  # few rows cost what reading the weight costs
        assert count == 2 == torch.get_num_threads()
    with check_threads(large, torch.device("meta"), 16) as count:  # not a CPU: left alone
        assert count == 2
    assert torch.get_num_threads() == 2


@pytest.fixture
def events(monkeypatch):  # noqa: ANN001, ANN201
    """("hash", tensor name) as the byte check hashes a written tensor; ("run", module class) as a module runs."""
    events: list[tuple[str, str]] = []
    real = copy_check.CopyCheck.tensor

    def hashed(self, name, value):  # noqa: ANN001, ANN202
        events.append(("hash", name))
        return real(self, name, value)

    monkeypatch.setattr(copy_check.CopyCheck, "tensor", hashed)
    handle = register_module_forward_pre_hook(lambda module, args: events.append(("run", type(module).__name__)))
    yield events
    handle.remove()


def test_each_written_weight_is_hashed_just_before_the_module_that_uses_it(tiny_llama, tmp_path, events):
    """The written bytes are hashed where the product that follows finds them in the CPU cache: not the whole block
    as it loads (each weight then read from memory twice), but each weight as its module is about to run."""
    report = prune_model(str(tiny_llama), PruneRecipe(layers=[1, 3]), output=tmp_path / "out").report
    assert report["verification"]["checked"] is True
    products = [i for i, (kind, name) in enumerate(events) if kind == "hash" and name.endswith("_proj.weight")]
    assert len(products) == 4 * 7  # every weight of a product in the 4 written blocks
    assert all(events[i - 1] == ("run", "Linear") for i in products)  # as its Linear starts (module hooks run last)
    first_block = [name for kind, name in events if kind == "hash" and name.startswith("model.layers.0.")]
    assert first_block[0] == "model.layers.0.input_layernorm.weight"  # in the order the forward uses them


def test_a_weight_no_module_runs_is_hashed_when_its_block_returns(tiny_llama, tmp_path, monkeypatch, events):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: x)  # its three weights load, unused
    report = prune_model(str(tiny_llama), PruneRecipe(layers=[1, 3]), output=tmp_path / "out").report
    hashed = [name for kind, name in events if kind == "hash"]
    assert {f"model.layers.{j}.mlp.{p}_proj.weight" for j in range(4) for p in ("gate", "up", "down")} <= set(hashed)
    assert report["verification"]["checked"] is True and report["verification"]["bytes_compared"] > 0


def test_a_streamed_prune_builds_the_source_and_the_written_model_once_each(tiny_llama, tmp_path, monkeypatch):
    """The surgery runs on the empty source model the verification then uses (undone in between), and the config
    check builds the written model from the config as written, which the verification uses too."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    built: list[int] = []
    real = LlamaForCausalLM.__init__

    def counted(self, config, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        built.append(config.num_hidden_layers)
        real(self, config, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "__init__", counted)
    report = prune_model(str(tiny_llama), PruneRecipe(layers=[1, 3]), output=tmp_path / "out").report
    assert report["verification"]["checked"] is True and report["verification"]["max_abs_diff"] == 0.0
    assert sorted(built) == [4, 6]


def test_a_model_built_from_another_config_or_dtype_is_not_reused(tiny_llama):
    config = AutoConfig.from_pretrained(tiny_llama)
    model = empty_model(AutoConfig.from_pretrained(tiny_llama), torch.float32)
    assert built_from(model, config, torch.float32)
    assert not built_from(model, config, torch.bfloat16)
    config.rms_norm_eps = 0.5
    assert not built_from(model, config, torch.float32)


def test_undoing_the_surgery_removes_a_config_field_it_added(tiny_llama, monkeypatch):
    """The streamed prune runs the surgery on the source model it verifies with: undone, the model's config must be
    the source's again, not the source's plus what the surgery wrote."""
    real = blocks.slice_layer_config

    def adds_a_field(config, kept, depth, force):  # noqa: ANN001, ANN202
        real(config, kept, depth, force)
        config.written_only = len(kept)

    monkeypatch.setattr(blocks, "slice_layer_config", adds_a_field)
    model = empty_model(AutoConfig.from_pretrained(tiny_llama), torch.float32)
    before = model.config.to_dict()
    with blocks.skipped_blocks(model, [1, 3]):
        assert model.config.written_only == 4
    assert model.config.to_dict() == before and not hasattr(model.config, "written_only")


def test_the_written_config_is_the_sliced_source_config_whatever_the_check_computes_in(tmp_path):
    source = bf16_model(tmp_path / "src", "llama")
    expected = tmp_path / "expected"
    sliced_config(AutoConfig.from_pretrained(source), [1, 3]).save_pretrained(expected)
    for settings in (RunSettings(), RunSettings(block_major=True, dtype="float32")):
        out = tmp_path / f"out-{settings.dtype}"
        report = prune_model(str(source), PruneRecipe(layers=[1, 3]), settings, output=out).report
        assert report["verification"]["checked"] is True
        written = json.loads((out / "config.json").read_text())
        assert written == json.loads((expected / "config.json").read_text()) and written["dtype"] == "bfloat16"
