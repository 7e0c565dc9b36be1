"""The Nemotron-NAS layout as llama.cpp's deci architecture: per-layer arrays, the zero FFN, permutes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from layerprune.core.errors import LayerpruneError
from layerprune.export import export_gguf
from layerprune.export.deci import ZERO_FFN, DeciLayer, deci_extra, deci_fix, deci_layers, rope_factors
from layerprune.export.families import permute_rope
from layerprune.models.nas_surgery import save_nas
from layerprune.models.sublayers import Sublayer
from test_export import smollm_gguf


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


def llama_cpp_logits(path: Path, count: int) -> tuple[list[int], np.ndarray]:
    """`count` random token ids and llama.cpp's logits at every one of them (skips without llama-cpp-python)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp check needs llama-cpp-python (make bench-engines builds it)")
    from llama_cpp import Llama

    ids = torch.randint(10, 49152, (count,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = Llama(model_path=str(path), n_ctx=2 * count + 8, logits_all=True, verbose=False, n_threads=1)
    llm.eval(ids)
    return ids, np.asarray(llm.scores[: len(ids)])


def test_layouts_llama_cpp_cannot_run_are_refused():
    with pytest.raises(LayerpruneError, match="last DeciLM block does nothing"):
        deci_layers(config(block(), block(attention=False, ffn=False)))
    linear = block()
    linear["attention"]["replace_with_linear"] = True
    with pytest.raises(LayerpruneError, match="replaced with linear"):
        deci_layers(config(linear))


@pytest.fixture(scope="module")
def nas_sourced(tmp_path_factory) -> Path:
    """A tiny random llama with SmolLM2's vocabulary minus 1.attn and 2.mlp, saved in the Nemotron-NAS layout and
    recorded as converted from SmolLM2's GGUF (the export carries the tokenizer from there)."""
    source = smollm_gguf()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    directory = tmp_path_factory.mktemp("nas-gguf") / "tiny"
    save_nas(model, tokenizer, [Sublayer(1, "attn"), Sublayer(2, "mlp")], directory, torch.float32)
    (directory / "source.json").write_text(json.dumps({"gguf": str(source)}))
    return directory


def test_a_sublayer_pruned_model_exports_as_deci_and_reads_back_tensor_by_tensor(nas_sourced, tmp_path):
    report = export_gguf(nas_sourced, tmp_path / "m.gguf", "f32")
    assert report.architecture == "DECI"
    assert report.per_layer["attention.head_count"] == [4, 0, 4, 4]
    assert report.per_layer["attention.head_count_kv"] == [2, 0, 2, 2]
    assert report.per_layer["feed_forward_length"] == [256, 256, ZERO_FFN, 256]
    back = report.readback
    assert back["missing"] == [] and back["unexpected"] == [] and back["tokens_equal"]
    assert back["tensors_compared"] == 2 + 9 + 4 + (5 + 4) + 9  # embeddings and norm; per block, 2.mlp zero-FFN
    assert back["max_relative_error"] == 0.0
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp check needs llama-cpp-python (make bench-engines builds it)")
    from layerprune.export.llamacpp import compare_with_transformers

    ran = compare_with_transformers(tmp_path / "m.gguf", nas_sourced)
    assert ran["top1_agreement"].split("/")[0] == ran["top1_agreement"].split("/")[1]
    assert ran["continuations"]["equal"] == ran["continuations"]["of"]


def test_a_q8_export_reads_back_within_its_rounding(nas_sourced, tmp_path):
    back = export_gguf(nas_sourced, tmp_path / "q.gguf", "q8_0").readback
    assert back["missing"] == [] and back["unexpected"] == []
    assert 0 < back["max_relative_error"] < 0.02


@pytest.mark.slow
def test_a_sublayer_pruned_smollm2_exports_and_llama_cpp_continues_it_as_transformers(tmp_path, capsys):
    """The embedded SmolLM2-135M minus five attention and two MLP sublayers (one block whole), F16 GGUF: read back
    tensor by tensor, and run by llama.cpp with transformers' greedy tokens where llama-cpp-python is installed."""
    from layerprune.cli import main

    pruned = tmp_path / "pruned"
    removed = "20.attn,22.attn,24.attn,25.mlp,27.attn,27.mlp,28.attn"
    assert main(["-q", "prune", "--model", "embedded", "--granularity", "sublayer", "--layers", removed,
                 "--dtype", "float32", "-o", str(pruned)]) == 0
    report = export_gguf(pruned, tmp_path / "m.gguf", "f16")
    assert report.per_layer["block_count"] == 29 and report.per_layer["attention.head_count"].count(0) == 4
    assert report.readback["missing"] == [] and report.readback["unexpected"] == []
    assert report.readback["max_relative_error"] < 1e-3 and report.readback["tokens_equal"]
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama.cpp check needs llama-cpp-python (make bench-engines builds it)")
    from layerprune.export.llamacpp import compare_with_transformers

    ran = compare_with_transformers(tmp_path / "m.gguf", pruned)
    assert ran["tokenization_equal"] == "4/4"
    same, total = map(int, ran["top1_agreement"].split("/"))
    assert same >= 0.95 * total and ran["continuations"]["equal"] >= 3


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # a short original context: the scaling bites within 60 tokens


def llama3_config(**fields) -> LlamaConfig:
    values = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "tie_word_embeddings": True,
              "rope_scaling": dict(LLAMA3), "rope_theta": 10000.0, **fields}
    return LlamaConfig(**values)


def test_llama3_rope_factors_are_transformers_own_frequency_divisors():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama3_config()
    plain = LlamaRotaryEmbedding(config=llama3_config(rope_scaling=None)).inv_freq
    scaled = LlamaRotaryEmbedding(config=config).inv_freq
    factors = rope_factors(config)
    np.testing.assert_allclose(factors, (plain / scaled).numpy(), rtol=1e-6)
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0  # high, low and smoothed between
    assert rope_factors(llama3_config(rope_scaling=None)) is None
    with pytest.raises(LayerpruneError, match="rope type 'yarn' is not exported"):
        rope_factors(SimpleNamespace(rope_parameters={"rope_type": "yarn", "factor": 4.0}))


@pytest.fixture(scope="module")
def nas_llama3(tmp_path_factory) -> Path:
    """`nas_sourced`'s tiny llama with llama3 RoPE (weights larger, so positions matter), minus 1.attn and 2.mlp."""
    source = smollm_gguf()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama3_config()).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    directory = tmp_path_factory.mktemp("nas-llama3") / "tiny"
    save_nas(model, tokenizer, [Sublayer(1, "attn"), Sublayer(2, "mlp")], directory, torch.float32)
    (directory / "source.json").write_text(json.dumps({"gguf": str(source)}))
    return directory


def test_llama3_rope_exports_its_rope_freqs_and_llama_cpp_gives_transformers_logits(nas_llama3, tmp_path):
    import gguf

    report = export_gguf(nas_llama3, tmp_path / "m.gguf", "f32")
    back = report.readback
    assert back["missing"] == [] and back["unexpected"] == [] and back["max_relative_error"] == 0.0
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    model = AutoModelForCausalLM.from_pretrained(nas_llama3, dtype=torch.float32).eval()
    np.testing.assert_array_equal(stored["rope_freqs.weight"], rope_factors(model.config))
    ids, got = llama_cpp_logits(tmp_path / "m.gguf", 60)
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([ids])).logits[0].numpy()
        model.model.rotary_emb = type(model.model.rotary_emb)(config=llama3_config(rope_scaling=None))
        unscaled = model(input_ids=torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(want).max()  # llama.cpp keeps its KV cache in f16: about 1e-3 of the largest logit apart
    assert np.abs(got - want).max() < 5e-3 * scale and (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(unscaled - got).max() > 0.05 * scale  # without the factors llama.cpp could not match


def test_a_qwen2_source_exports_its_qkv_biases_and_llama_cpp_gives_transformers_logits(tmp_path):
    """Qwen2's q/k/v biases (random, large enough to matter) go through the deci export as attn_q/k/v biases with the
    layout's zero o_proj bias; llama.cpp's deci loader runs them with transformers' logits."""
    from transformers import Qwen2Config

    source = smollm_gguf()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=49152, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                param.normal_(0.0, 2.0)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    directory = tmp_path / "tiny"
    save_nas(model, tokenizer, [Sublayer(1, "attn"), Sublayer(2, "mlp")], directory, torch.float32)
    (directory / "source.json").write_text(json.dumps({"gguf": str(source)}))
    report = export_gguf(directory, tmp_path / "m.gguf", "f32")
    back = report.readback
    assert back["missing"] == [] and back["unexpected"] == [] and back["max_relative_error"] == 0.0
    import gguf

    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert {f"blk.{b}.attn_{p}.bias" for b in (0, 2, 3) for p in "qkv"} <= names and "blk.1.attn_q.bias" not in names
    ids, got = llama_cpp_logits(tmp_path / "m.gguf", 40)
    saved = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = saved(input_ids=torch.tensor([ids])).logits[0].numpy()
        for layer in saved.model.layers:  # the same model without its q/k/v biases: they must matter here
            attention = getattr(layer, "self_attn", None)
            for proj in ("q_proj", "k_proj", "v_proj"):
                if attention is not None and getattr(attention, proj).bias is not None:
                    getattr(attention, proj).bias.zero_()
        unbiased = saved(input_ids=torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 5e-3 * scale and (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(unbiased - got).max() > 0.05 * scale  # without the biases llama.cpp could not match
