"""Block surgery on mixture-of-experts, hybrid and scaled-logit families: remapped or refused, and verified."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM

from helpers import assert_one_line_error, run_cli, skip_reference_logits
from layerprune.core.errors import LayerpruneError
from layerprune.models import drop_blocks, find_decoder_stack, layer_fields, surgery
from layerprune.prune.api import prune_model
from layerprune.prune.metrics import last_token_mask
from layerprune.prune.recipe import PruneRecipe

DROP = [1, 3]  # kept 0, 2, 4, 5
PRUNED = [
    "qwen3_moe",
    "qwen3_moe_step",
    "mixtral",
    "deepseek_v3",
    "llama4_text",
    "granite",
    "cohere2",
    "jamba",
    "falcon_h1",
    "bamba",
    "zamba",
]
EXPECTED_FIELDS = {
    "qwen3_moe": {"mlp_only_layers": [0], "decoder_sparse_step": 1},  # dense 0 and 3; 3 dropped
    "qwen3_moe_step": {"mlp_only_layers": [0, 1, 2], "decoder_sparse_step": 1},  # sparse 1, 3, 5; only 5 kept
    "deepseek_v3": {"first_k_dense_replace": 1},
    "llama4_text": {"moe_layers": [2], "no_rope_layers": [1, 1, 1, 1]},
    "bamba": {"attn_layer_indices": [2]},
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid", "linear_attention"]},
    "jamba": {"attn_layer_period": 3, "attn_layer_offset": 2, "expert_layer_period": 4, "expert_layer_offset": 3},
}


@pytest.mark.parametrize("arch", PRUNED)
def test_pruned_family_reloads_as_the_skipped_original(arch, tiny_models, tmp_path):
    source = tiny_models(arch, 6)
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = skip_reference_logits(original, ids, DROP)

    result = prune_model(str(source), PruneRecipe(layers=DROP), output=tmp_path / "out")
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = reloaded.config
    assert config.num_hidden_layers == 4
    for name, value in EXPECTED_FIELDS.get(arch, {}).items():
        assert list(getattr(config, name)) == value if isinstance(value, list) else getattr(config, name) == value, name
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded.eval()(input_ids=ids, use_cache=False).logits, reference, rtol=1e-4, atol=1e-4
        )
    assert result.report["verification"]["checked"] is True
    assert result.report["verification"]["max_abs_diff"] <= result.report["verification"]["tolerance"]


@pytest.mark.parametrize("arch", ["granite", "cohere2", "falcon_h1", "gemma2"])
def test_stack_logits_are_the_models_own(arch, tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models(arch, 6)).eval()
    stack = find_decoder_stack(model)
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(2))
    assert stack.check_logits(ids, torch.ones_like(ids)) < 1e-4


def test_stack_logits_mismatch_is_refused(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("granite", 6)).eval()
    stack = find_decoder_stack(model)
    stack.config = type(stack.config).from_dict(
        {**stack.config.to_dict(), "logits_scaling": 1.0}
    )  # a head it does not know
    ids = torch.randint(3, 300, (1, 8))
    with pytest.raises(LayerpruneError, match="differ from its own forward"):
        stack.check_logits(ids, torch.ones_like(ids))


def test_jamba_drop_that_breaks_the_period_is_refused_naming_the_field(tiny_models, tmp_path):
    with pytest.raises(
        LayerpruneError, match="attn_layer_period"
    ):  # attention at 1 and 4: keeping 0,1,4,5 is not periodic
        prune_model(str(tiny_models("jamba", 6)), PruneRecipe(layers=[2, 3]), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gemma3n_is_refused_naming_the_field(tiny_models, tmp_path):
    with pytest.raises(LayerpruneError, match="num_kv_shared_layers|hidden_size_per_layer_input"):
        prune_model(str(tiny_models("gemma3n_text", 6)), PruneRecipe(layers=DROP), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_zamba_left_with_one_hybrid_block_fails_verification_with_nothing_written(tiny_models, tmp_path):
    with pytest.raises(LayerpruneError, match="surgery check failed: the new config does not build"):
        prune_model(str(tiny_models("zamba", 6)), PruneRecipe(layers=[2]), output=tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def _config(model_type, **kwargs):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, num_hidden_layers=6, **kwargs)


def test_mllama_cross_attention_layers_are_renumbered():
    from transformers.models.mllama.configuration_mllama import MllamaTextConfig

    config = MllamaTextConfig(num_hidden_layers=6, cross_attention_layers=[1, 2, 5])
    layer_fields.slice_layer_config(config, [0, 2, 4, 5], 6)
    assert config.cross_attention_layers == [1, 3] and config.num_hidden_layers == 4


def test_deepseek_moe_layer_freq_is_refitted_or_refused():
    config = _config("deepseek_v3", first_k_dense_replace=1)
    config.moe_layer_freq = 2  # remote-code DeepSeek: MoE at blocks >= 1 with i % 2 == 0 -> 2, 4
    layer_fields.slice_layer_config(config, [0, 1, 3, 4], 6)  # MoE kept: old 4 -> new 3
    assert (config.first_k_dense_replace, config.moe_layer_freq) == (3, 1)
    config = _config("deepseek_v3", first_k_dense_replace=0)
    config.moe_layer_freq = 2  # MoE at 0, 2, 4: keeping 0, 1, 2, 4 gives x.x x: no threshold + period fits
    with pytest.raises(LayerpruneError, match="moe_layer_freq"):
        layer_fields.slice_layer_config(config, [0, 1, 2, 4], 6)


def test_refusal_leaves_the_in_memory_model_as_it_was(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("jamba", 6))
    with pytest.raises(LayerpruneError):
        drop_blocks(model, [2, 3])
    assert len(find_decoder_stack(model)) == 6 and model.config.num_hidden_layers == 6


def test_unknown_layer_field_stops_the_prune_unless_forced(tiny_models, tmp_path, capsys):
    source = tiny_models("llama", 6)
    config = json.loads((source / "config.json").read_text())
    odd = tmp_path / "odd"
    odd.mkdir()
    for path in source.iterdir():
        (odd / path.name).write_bytes(path.read_bytes())
    (odd / "config.json").write_text(json.dumps({**config, "global_attn_layers": [2, 5]}))
    code, _, err = run_cli(capsys, ["prune", "--model", str(odd), "--layers", "1,3", "--output", str(tmp_path / "out")])
    assert_one_line_error(code, err, "global_attn_layers", "--force")
    assert not (tmp_path / "out").exists()
    code, out, err = run_cli(
        capsys, ["prune", "--model", str(odd), "--layers", "1,3", "--output", str(tmp_path / "out"), "--force"]
    )
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "prune_report.json").read_text())["verification"]["checked"] is True


def test_looks_layer_related():
    assert layer_fields.looks_layer_related("global_attn_layers", [2, 5], 6)
    assert layer_fields.looks_layer_related("first_dense_layers", 3, 6)
    assert layer_fields.looks_layer_related("pattern", ["a"] * 6, 6)
    assert not layer_fields.looks_layer_related("layer_norm_eps", 1e-5, 6)
    assert not layer_fields.looks_layer_related("use_layer_scale", True, 6)
    assert not layer_fields.looks_layer_related("hidden_layers_size", 4096, 6)


def test_broken_config_rewrite_is_caught_and_nothing_is_written(tiny_models, tmp_path, monkeypatch):
    rule = layer_fields.unaffected("mlp_only_layers", "broken on purpose")
    monkeypatch.setitem(layer_fields.FIELD_RULES, "mlp_only_layers", rule)
    monkeypatch.setitem(layer_fields.FIELD_RULES, "decoder_sparse_step", rule)
    with pytest.raises(LayerpruneError, match="surgery check failed.*(missing|unexpected)"):
        prune_model(str(tiny_models("qwen3_moe", 6)), PruneRecipe(layers=DROP), output=tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_wrong_logits_are_caught_and_no_verify_skips_it(tiny_models, tmp_path, monkeypatch):
    truncate = layer_fields.FieldRule(
        ("layer_types",), "the old bug: truncated", lambda c, kept, depth: {"layer_types": c.layer_types[: len(kept)]}
    )
    monkeypatch.setitem(layer_fields.FIELD_RULES, "layer_types", truncate)
    source = str(tiny_models("gemma3_text", 6))
    with pytest.raises(LayerpruneError, match="surgery check failed"):
        prune_model(source, PruneRecipe(layers=[1, 2]), output=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = prune_model(source, PruneRecipe(layers=[1, 2], verify=False), output=tmp_path / "out")
    assert result.report["verification"]["checked"] == "meta"  # streamed: only the cheap meta-device check ran
    assert "max_abs_diff" not in result.report["verification"]


def _tiny_in(dtype, tiny_models, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama", 6)).to(dtype)
    path = tmp_path / f"src-{dtype}"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tiny_models("llama", 6) / name).read_bytes())
    return path


def _saved_dtypes(path):
    with safe_open(path / "model.safetensors", "pt") as handle:
        return {handle.get_slice(key).get_dtype() for key in handle.keys()}


@pytest.mark.parametrize("dtype,name,tag", [(torch.bfloat16, "bfloat16", "BF16"), (torch.float16, "float16", "F16")])
def test_checkpoint_dtype_is_kept_on_save(dtype, name, tag, tiny_models, tmp_path):
    result = prune_model(str(_tiny_in(dtype, tiny_models, tmp_path)), PruneRecipe(layers=DROP), output=tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == name
    assert _saved_dtypes(tmp_path / "out") == {tag}
    assert result.report["dtype"] == {
        "checkpoint": name,
        "computed_in": "float32",
        "saved": name,
        "chosen_by": "checkpoint",
    }
    assert result.report["verification"]["max_abs_diff"] < 1e-4  # bf16/fp16 -> fp32 -> bf16/fp16 is exact


def test_dtype_flag_overrides_the_checkpoint(tiny_models, tmp_path):
    from layerprune.core.settings import RunSettings

    source = str(_tiny_in(torch.bfloat16, tiny_models, tmp_path))
    result = prune_model(source, PruneRecipe(layers=DROP), RunSettings(dtype="float32"), output=tmp_path / "out")
    assert _saved_dtypes(tmp_path / "out") == {"F32"} and result.report["dtype"]["chosen_by"] == "--dtype"


def test_too_little_free_space_is_one_line_before_writing(tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(surgery.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    code, _, err = run_cli(
        capsys, ["prune", "--model", str(tiny_llama), "--layers", "1,3", "--output", str(tmp_path / "out")]
    )
    assert_one_line_error(code, err, "not enough disk space", str(tmp_path / "out"), "needs about")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_disk_full_during_save_is_one_line(tiny_llama, tmp_path, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    def full_disk(fd, data, offset):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full)
    monkeypatch.setattr("layerprune.models.safetensors_copy._write_all", full_disk)  # the streamed save
    code, _, err = run_cli(
        capsys, ["prune", "--model", str(tiny_llama), "--layers", "1,3", "--output", str(tmp_path / "out")]
    )
    assert_one_line_error(code, err, "no space left on device while writing", str(tmp_path / "out"), "needs about")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_last_token_mask_right_and_left_padding():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]])
    assert last_token_mask(mask).tolist() == [[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 1]]


def test_angular_tokens_default_last_and_recorded(tiny_llama, shared_data, tmp_path):
    common = dict(drop=2, score="angular", calib="arithmetic", calib_samples=8, data_dir=shared_data)
    last = prune_model(str(tiny_llama), PruneRecipe(**common), dry_run=True).report
    every = prune_model(str(tiny_llama), PruneRecipe(**common, angular_tokens="all"), dry_run=True).report
    assert last["recipe"]["angular_tokens"] == "last" and last["score_details"]["tokens"] == "last"
    assert every["score_details"]["tokens"] == "all"
    assert last["scores"] != every["scores"]


@pytest.mark.gpu
def test_gpu_run_keeps_an_fp16_checkpoint_in_fp16(tiny_models, tmp_path):
    from layerprune.core.settings import RunSettings

    source = str(_tiny_in(torch.float16, tiny_models, tmp_path))
    result = prune_model(source, PruneRecipe(layers=DROP), RunSettings(device="cuda"), output=tmp_path / "out")
    assert _saved_dtypes(tmp_path / "out") == {"F16"}
    assert result.report["dtype"]["computed_in"] == "bfloat16" and result.report["verification"]["checked"] is True
