"""The Nemotron-NAS layout as llama.cpp's deci architecture: per-layer arrays, the zero FFN, permutes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from layerprune.errors import LayerpruneError
from layerprune.export.deci import ZERO_FFN, DeciLayer, deci_extra, deci_fix, deci_layers
from layerprune.export.families import permute_rope


def block(attention: bool = True, ffn: bool = True, group: int = 2, mult: float = 4.0) -> dict:
    return {"attention": {"no_op": not attention, "replace_with_linear": False,
                          "n_heads_in_group": group if attention else None},
            "ffn": {"no_op": not ffn, "replace_with_linear": False, "ffn_mult": mult if ffn else None}}


def config(*blocks: dict) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=4, hidden_size=192, block_configs=list(blocks), num_hidden_layers=len(
        blocks), head_dim=48)


def test_per_layer_arrays_and_the_zero_ffn_of_an_mlp_removed_block():
    layers = deci_layers(config(block(), block(attention=False), block(ffn=False), block(group=4, mult=1.5)))
    assert layers == [DeciLayer(4, 2, 512), DeciLayer(0, 0, 512), DeciLayer(4, 2, ZERO_FFN, zero_ffn=True),
                      DeciLayer(4, 1, 256)]
    extra = dict(deci_extra(config(block(), block(ffn=False))))
    assert sorted(extra) == [f"model.layers.1.{name}.weight" for name in
                             ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm")]
    assert extra["model.layers.1.mlp.down_proj.weight"].shape == (192, ZERO_FFN)
    assert not extra["model.layers.1.mlp.down_proj.weight"].any()  # adds exactly nothing to the residual stream


def test_q_and_k_are_permuted_with_their_blocks_own_head_counts():
    cfg = config(block(), block(group=4))
    k = np.arange(48 * 192, dtype=np.float32).reshape(48, 192)
    np.testing.assert_array_equal(deci_fix("model.layers.1.self_attn.k_proj.weight", k, cfg), permute_rope(k, 1))
    assert not np.array_equal(permute_rope(k, 1), permute_rope(k, 2))
    v = np.ones((48, 192), dtype=np.float32)
    assert deci_fix("model.layers.1.self_attn.v_proj.weight", v, cfg) is v


def test_layouts_llama_cpp_cannot_run_are_refused():
    with pytest.raises(LayerpruneError, match="last DeciLM block does nothing"):
        deci_layers(config(block(), block(attention=False, ffn=False)))
    linear = block()
    linear["attention"]["replace_with_linear"] = True
    with pytest.raises(LayerpruneError, match="replaced with linear"):
        deci_layers(config(linear))
