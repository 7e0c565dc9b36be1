"""The Nemotron-NAS (DeciLM) layout: sublayer-pruned Llama, Qwen2 and Mistral models save, reload (layerprune's class
and plain transformers with trust_remote_code) and equal the skip reference; what the layout cannot carry is refused."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from layerprune.core.errors import LayerpruneError
from layerprune.models.loading import load_model
from layerprune.models.nas_surgery import check_expressible, ffn_mult, save_nas, skip_reference, to_nas
from layerprune.models.nemotron_nas import LAYOUT_FILES, DeciLMConfig, DeciLMForCausalLM
from layerprune.models.sublayers import Sublayer, skipped_sublayers
from tiny import tiny_config, tiny_tokenizer

# hidden 64 and intermediate 256: ffn_mult 6.0 reproduces it (the layout rounds to multiples of 256)
EXPRESSIBLE = {
    "llama": {},
    "qwen2": {"use_sliding_window": False, "layer_types": ["full_attention"] * 6, "tie_word_embeddings": True},
    "mistral": {"sliding_window": None},
}
ATTENTION = [Sublayer(1, "attn"), Sublayer(3, "attn")]
MLP = [Sublayer(2, "mlp"), Sublayer(5, "mlp")]
MIXED = [Sublayer(1, "attn"), Sublayer(2, "mlp"), Sublayer(4, "attn"), Sublayer(4, "mlp")]  # block 4 goes whole
IDS = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46, 47], [1, 50, 60, 70, 80, 90, 100, 110, 120]])


def tiny_source(arch: str, **changes) -> torch.nn.Module:
    config = tiny_config(arch, 6)
    for key, value in {"intermediate_size": 256, **EXPRESSIBLE[arch], **changes}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, torch.Tensor, dict]]:
    """(arch, removal) -> (folder, skip-reference logits on IDS, save_nas's record), saved once."""
    root = tmp_path_factory.mktemp("nas")
    cases = {(arch, name): removed for arch in EXPRESSIBLE
             for name, removed in (("attention", ATTENTION), ("mlp", MLP), ("mixed", MIXED))}
    out = {}
    for (arch, name), removed in cases.items():
        model = tiny_source(arch)
        record = save_nas(model, tiny_tokenizer(), removed, root / f"{arch}-{name}", torch.float32)
        out[arch, name] = (root / f"{arch}-{name}", skip_reference(model, removed, IDS, None), record)
    return out


@pytest.mark.parametrize("case", [(arch, name) for arch in EXPRESSIBLE for name in ("attention", "mlp", "mixed")])
def test_saved_layout_reloads_with_layerprune_and_equals_the_skip_reference(saved, case):
    folder, reference, record = saved[case]
    assert record["verification"]["max_abs_diff"] <= 1e-5
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas" and config["architectures"] == ["DeciLMForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_decilm.DeciLMForCausalLM"
    assert (folder / "modeling_decilm.py").is_file() and (folder / "configuration_decilm.py").is_file()
    removed = {"mixed": MIXED, "attention": ATTENTION, "mlp": MLP}[case[1]]
    assert config["num_hidden_layers"] == 6 - (case[1] == "mixed")
    assert sum(b["attention"]["no_op"] for b in config["block_configs"]) == sum(
        s.part == "attn" for s in removed if s.block != 4 or case[1] != "mixed")
    loaded = load_model(str(folder))  # layerprune's own loader: no trust_remote_code
    assert type(loaded.model).__module__ == "layerprune.models.nemotron_nas.modeling_decilm"
    with torch.inference_mode():
        logits = loaded.model(IDS).logits.float()
    assert torch.allclose(logits, reference, atol=1e-5)


@pytest.mark.parametrize("case", [("llama", "mixed"), ("qwen2", "mixed"), ("mistral", "mixed")])
def test_plain_transformers_loads_the_saved_folder_with_trust_remote_code(saved, case):
    """The copied modeling files, loaded as transformers loads remote code (AutoModelForCausalLM with
    trust_remote_code=True does this; in this process layerprune's registered class would win), need nothing but
    torch and transformers and give the skip reference."""
    folder, reference, _ = saved[case]
    for name in LAYOUT_FILES:
        tree = ast.parse((folder / name).read_text())
        roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        roots |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert roots <= {"copy", "dataclasses", "inspect", "typing", "torch", "transformers"}, (name, roots)
    config = get_class_from_dynamic_module("configuration_decilm.DeciLMConfig", folder).from_pretrained(folder)
    model_class = get_class_from_dynamic_module("modeling_decilm.DeciLMForCausalLM", folder)
    assert model_class.__module__.startswith("transformers_modules.")
    model = model_class.from_pretrained(folder, config=config).eval()
    with torch.inference_mode():
        assert torch.allclose(model(IDS).logits.float(), reference, atol=1e-5)


def test_a_fresh_interpreter_loads_the_folder_through_auto_model_with_trust_remote_code(saved, tmp_path):
    """What a user without layerprune does: AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) in
    an interpreter that never imported layerprune gives the skip reference's logits."""
    import os
    import subprocess
    import sys

    folder, reference, _ = saved["mistral", "mixed"]
    torch.save({"ids": IDS, "reference": reference}, tmp_path / "ref.pt")
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)\n"
        "assert 'layerprune' not in sys.modules, 'layerprune was imported'\n"
        "assert type(model).__module__.startswith('transformers_modules.'), type(model).__module__\n"
        "ref = torch.load(sys.argv[2])\n"
        "with torch.inference_mode():\n"
        "    logits = model.eval()(ref['ids']).logits.float()\n"
        "print((logits - ref['reference']).abs().max().item())\n")
    done = subprocess.run([sys.executable, "-c", script, str(folder), str(tmp_path / "ref.pt")], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_with_no_op_attention_blocks_matches_the_skip_reference(arch):
    """The KV cache holds only the attention blocks; a cached greedy continuation is the skipped original's."""
    model = tiny_source(arch)
    removed = [Sublayer(1, "attn"), Sublayer(2, "attn"), Sublayer(3, "mlp"), Sublayer(5, "attn"), Sublayer(5, "mlp")]
    nas = to_nas(model, removed)
    prompt = IDS[:1]
    with skipped_sublayers(model, removed):
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    found = nas.generate(prompt, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt))
    assert found.tolist() == expected.tolist()


def test_cached_generation_of_a_model_whose_first_block_has_no_attention():
    """layerprune never writes one (vLLM refuses it), but published checkpoints may: the cache still counts tokens."""
    blocks = [{"attention": {"no_op": attn, "n_heads_in_group": None if attn else 2},
               "ffn": {"no_op": ffn, "ffn_mult": None if ffn else 6.0}}
              for attn, ffn in [(True, False), (False, False), (True, False), (False, True)]]
    config = DeciLMConfig(vocab_size=384, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_hidden_layers=4, block_configs=blocks)
    torch.manual_seed(0)
    model = DeciLMForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    found = model.generate(IDS[:1], max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(IDS[:1]))
    expected = IDS[:1]
    with torch.inference_mode():
        for _ in range(10):
            step = model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, step], dim=1)
    assert found.tolist() == expected.tolist()
    cache = DynamicCache()  # a plain forward with a cache and no positions: the positions come from the cache
    with torch.inference_mode():
        model(expected[:, :-3], cache=cache, use_cache=True)
        length = expected.shape[1]
        steps = [model(expected[:, n : n + 1], cache=cache, use_cache=True).logits for n in range(length - 3, length)]
        full = model(expected, use_cache=False).logits[:, -3:]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


def test_to_nas_shares_the_kept_weights_and_leaves_the_model_running():
    model = tiny_source("llama")
    before = model(IDS).logits
    nas = to_nas(model, MIXED)
    new, old = nas.model.layers, model.model.layers
    assert new[0].self_attn.q_proj.weight.data_ptr() == old[0].self_attn.q_proj.weight.data_ptr()
    assert new[4].mlp.up_proj.weight.data_ptr() == old[5].mlp.up_proj.weight.data_ptr()
    assert not hasattr(nas.model.layers[1], "self_attn") and not hasattr(nas.model.layers[1], "input_layernorm")
    assert not hasattr(nas.model.layers[2], "mlp") and not hasattr(nas.model.layers[2], "post_attention_layernorm")
    assert torch.equal(model(IDS).logits, before)


def test_any_save_of_a_layout_model_carries_the_modeling_files(saved, tmp_path):
    """A recovered or merged model saved with plain save_pretrained stays loadable with trust_remote_code."""
    loaded = load_model(str(saved["llama", "mixed"][0]))
    loaded.model.save_pretrained(tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"] == "configuration_decilm.DeciLMConfig"
    assert all((tmp_path / "again" / name).is_file() for name in LAYOUT_FILES)


def test_save_runs_finish_inside_the_folder_before_it_appears(tmp_path):
    seen = []

    def finish(tmp: Path, record: dict) -> None:
        seen.append(not (tmp_path / "out").exists())
        (tmp / "report.json").write_text(json.dumps(record))

    save_nas(tiny_source("llama"), tiny_tokenizer(), ATTENTION, tmp_path / "out", torch.float32, finish=finish)
    assert seen == [True]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["removed"] == ["1.attn", "3.attn"]


def test_tied_embeddings_are_written_once_and_qwen2_gets_a_zero_output_bias(saved):
    folder = saved["qwen2", "mixed"][0]
    with safe_open(folder / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
        assert not handle.get_tensor("model.layers.0.self_attn.o_proj.bias").any()
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_proj.bias" in names
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["attention_bias"] is True


def test_ffn_mult_reproduces_what_the_layout_can_and_refuses_the_rest():
    assert ffn_mult(1536, 576) == 4.0  # SmolLM2-135M
    assert ffn_mult(14336, 4096) == 5.25  # Llama-3-8B
    with pytest.raises(LayerpruneError, match="multiple of 256"):
        ffn_mult(128, 64)


def test_block_configs_read_published_extras_and_refuse_unknown_keys():
    block = {"attention": {"no_op": False, "replace_with_linear": False, "n_heads_in_group": 8,
                           "window_length": None, "num_sink_tokens": None, "unshifted_sink": False,
                           "use_prefill_window_in_sink_attention": False, "sparsify": None},
             "ffn": {"no_op": False, "replace_with_linear": False, "ffn_mult": 5.25, "sparsify": None}}
    config = DeciLMConfig(num_hidden_layers=1, block_configs=[block])
    assert config.block_configs[0].attention.n_heads_in_group == 8
    assert config.to_dict()["block_configs"][0]["attention"] == {"no_op": False, "replace_with_linear": False,
                                                                 "n_heads_in_group": 8}
    with pytest.raises(ValueError, match="unknown keys"):
        DeciLMConfig(num_hidden_layers=1, block_configs=[{"attention": {"no_opp": True}, "ffn": {}}])


REFUSED = {
    "family": (lambda: tiny_config("phi3", 6), [Sublayer(1, "attn")], "Llama, Qwen2 and Mistral"),
    "mistral window": (lambda: _config("mistral", sliding_window=8), [Sublayer(1, "attn")], "sliding-window"),
    "qwen2 window": (lambda: _config("qwen2", use_sliding_window=True, layer_types=["full_attention"] * 3
                                     + ["sliding_attention"] * 3), [Sublayer(1, "attn")], "sliding-window"),
    "intermediate": (lambda: _config("llama", intermediate_size=128), [Sublayer(1, "attn")], "multiple of 256"),
    "activation": (lambda: _config("llama", hidden_act="gelu"), [Sublayer(1, "attn")], "SiLU"),
    "rope": (lambda: _config("llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
             [Sublayer(1, "attn")], "rope type 'yarn'"),
    "head_dim": (lambda: _config("llama", head_dim=32), [Sublayer(1, "attn")], "head_dim"),
    "no attention": (lambda: _config("llama"), [Sublayer(b, "attn") for b in range(6)], "every attention"),
    "first block": (lambda: _config("llama"), [Sublayer(0, "mlp"), Sublayer(0, "attn"), Sublayer(1, "attn")],
                    "first kept block \\(1\\)"),
}


def _config(arch: str, **changes):
    config = tiny_config(arch, 6)
    for key, value in {"intermediate_size": 256, **EXPRESSIBLE[arch], **changes}.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_layout_cannot_express_is_refused_in_one_line(case):
    make, removed, message = REFUSED[case]
    with pytest.raises(LayerpruneError, match=message) as caught:
        check_expressible(make(), removed)
    assert "\n" not in str(caught.value)


def test_a_refused_save_writes_nothing(tmp_path):
    model = tiny_source("mistral", sliding_window=8)
    with pytest.raises(LayerpruneError, match="sliding-window"):
        save_nas(model, tiny_tokenizer(), [Sublayer(1, "attn")], tmp_path / "out", torch.float32)
    assert list(tmp_path.iterdir()) == []


def test_token_ids_that_are_none_stay_none_in_the_layout():
    """A source without a BOS token must not come out with LlamaConfig's default 1 (or EOS 2)."""
    model = tiny_source("llama", bos_token_id=None, eos_token_id=None)
    config = to_nas(model, [Sublayer(1, "attn")]).config
    assert config.bos_token_id is None and config.eos_token_id is None


def test_whole_block_surgery_and_timing_of_a_layout_model_are_refused(tmp_path):
    """Its KV slots count attention blocks only: block surgery would renumber them by block and break the cache."""
    from layerprune.models.blocks import drop_blocks
    from layerprune.models.speed import SpeedBench, measure_speed

    nas = to_nas(tiny_source("llama"), [Sublayer(1, "attn")])
    with pytest.raises(LayerpruneError, match="Nemotron-NAS"):
        drop_blocks(nas, [3])
    assert len(nas.model.layers) == 6
    speed = measure_speed(nas, SpeedBench(prompt_len=8, new_tokens=2, repeats=1))  # the decode timer reads its cache
    assert speed.decode_tokens_per_s > 0


def test_the_modeling_file_calls_transformers_5_0s_causal_mask_as_5_0_takes_it(monkeypatch):
    """transformers 5.0's create_causal_mask takes (input_embeds, cache_position, past_key_values); the saved
    modeling file must run there too (bench/bench_nas_transformers_floor.py checks it on a real 5.0): called the
    5.0 way, a cached greedy continuation is the skipped original's."""
    from layerprune.models.nemotron_nas import modeling_decilm

    real = modeling_decilm.create_causal_mask
    seen = []

    def five_oh(config, input_embeds, attention_mask, cache_position, past_key_values, position_ids=None):
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        assert cache_position.tolist() == list(range(past, past + input_embeds.shape[1]))
        seen.append(len(cache_position))
        return real(config, input_embeds, attention_mask, past_key_values, position_ids=position_ids)

    monkeypatch.setattr(modeling_decilm, "create_causal_mask", five_oh)
    monkeypatch.setattr(modeling_decilm, "MASK_TAKES_CACHE_POSITION", True)
    model = tiny_source("llama")
    nas = to_nas(model, MIXED)
    with skipped_sublayers(model, MIXED):
        expected = model.generate(IDS[:1], max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(IDS[:1]))
    found = nas.generate(IDS[:1], max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(IDS[:1]))
    assert found.tolist() == expected.tolist() and seen[0] == IDS.shape[1] and set(seen[1:]) == {1}


def test_the_configuration_reads_block_dicts_set_after_construction():
    """transformers 5.0 builds configurations by keywords (no __post_init__): the blocks are read there too."""
    blocks = [{"attention": {"no_op": False, "n_heads_in_group": 2}, "ffn": {"no_op": False, "ffn_mult": 6.0}}] * 2
    config = DeciLMConfig(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          num_hidden_layers=2)
    config.block_configs = blocks
    config._read_blocks()
    assert [b.attention.n_heads_in_group for b in config.block_configs] == [2, 2]
    assert config.to_dict()["block_configs"][0]["ffn"]["ffn_mult"] == 6.0
    config.block_configs = blocks[:1]
    with pytest.raises(ValueError, match="1 entries for 2 hidden layers"):
        config._read_blocks()
