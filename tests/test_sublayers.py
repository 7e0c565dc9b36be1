"""Sublayer names and the skip reference: skipping a block's attention and its MLP is skipping the block."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerprune.core.errors import LayerpruneError
from layerprune.models.blocks import skipped_blocks
from layerprune.models.sublayers import Sublayer, parse_sublayers, skipped_sublayers, whole_blocks


def test_parse_names_sorts_and_refuses():
    assert parse_sublayers(["3.mlp", "1.attn", " 3.attn "], depth=6) == [
        Sublayer(1, "attn"), Sublayer(3, "attn"), Sublayer(3, "mlp")]
    assert str(Sublayer(12, "attn")) == "12.attn"
    with pytest.raises(LayerpruneError, match="BLOCK.attn"):
        parse_sublayers(["3.ffn"], depth=6)
    with pytest.raises(LayerpruneError, match="out of range"):
        parse_sublayers(["6.mlp"], depth=6)
    with pytest.raises(LayerpruneError, match="twice"):
        parse_sublayers(["2.mlp", "2.mlp"], depth=6)
    assert whole_blocks(parse_sublayers(["1.attn", "1.mlp", "2.mlp"], depth=6)) == [1]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_skipping_both_sublayers_is_skipping_the_block(tiny_models, arch):
    model = AutoModelForCausalLM.from_pretrained(tiny_models(arch), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2, 8, 40, 41]])
    with torch.inference_mode():
        full = model(ids).logits
        with skipped_blocks(model, [2]):
            block = model(ids).logits
        with skipped_sublayers(model, [Sublayer(2, "attn"), Sublayer(2, "mlp")]):
            both = model(ids).logits
        with skipped_sublayers(model, [Sublayer(2, "attn")]):
            attn = model(ids).logits
        after = model(ids).logits
    torch.testing.assert_close(both, block)
    assert not torch.allclose(attn, block) and not torch.allclose(attn, full)
    torch.testing.assert_close(after, full)
