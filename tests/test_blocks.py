"""Dropping blocks: the saved model equals the in-memory model with those blocks skipped, per architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import skip_reference_logits
from layerprune.models import drop_blocks, find_decoder_stack, skipped_blocks
from layerprune.prune.api import prune_model
from layerprune.prune.recipe import PruneRecipe
from tiny import ARCHS

DROP = [1, 3]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_saved_model_matches_skip_reference(arch, tiny_models, tmp_path):
    source = tiny_models(arch, 6)
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = skip_reference_logits(original, ids, DROP)

    prune_model(str(source), PruneRecipe(layers=DROP), output=tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_hidden_layers == 4
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, use_cache=False).logits, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generation_with_kv_cache_matches_skipped_original(arch, tiny_models, tmp_path):
    source = tiny_models(arch, 6)
    prune_model(str(source), PruneRecipe(layers=DROP), output=tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = reloaded.generate(ids, use_cache=True, **kwargs)
        uncached = reloaded.generate(ids, use_cache=False, **kwargs)
        with skipped_blocks(original, DROP):
            skipped = original.generate(ids, use_cache=True, **kwargs)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, skipped)


def test_layer_types_are_sliced_by_kept_indices_not_truncated(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("gemma3_text", 6))
    before = list(model.config.layer_types)
    kept = drop_blocks(model, [0, 2])
    assert kept == [1, 3, 4, 5]
    assert model.config.layer_types == [before[i] for i in kept]
    assert model.config.layer_types != before[:4]


def test_qwen2_max_window_layers_counts_kept_full_attention_blocks(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("qwen2", 6))
    assert model.config.max_window_layers == 3
    drop_blocks(model, [1, 4])
    assert model.config.max_window_layers == 2
    assert model.config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]


def test_layer_idx_is_reindexed(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama", 6))
    drop_blocks(model, [0, 4])
    assert [block.self_attn.layer_idx for block in find_decoder_stack(model).layers] == [0, 1, 2, 3]


def test_skipped_blocks_restores_the_model(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("gemma3_text", 6)).eval()
    ids = torch.randint(3, 300, (1, 8))
    with torch.no_grad():
        before = model(ids).logits
        with skipped_blocks(model, [1, 2]):
            assert model.config.num_hidden_layers == 4
        after = model(ids).logits
    assert model.config.num_hidden_layers == 6 and len(model.config.layer_types) == 6
    assert [b.self_attn.layer_idx for b in find_decoder_stack(model).layers] == list(range(6))
    torch.testing.assert_close(before, after)
