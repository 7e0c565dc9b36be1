"""recover on the real embedded SmolLM2-135M (slow: minutes on a CPU)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import SMALL_DEMO
from layerprune.cli import main


@pytest.mark.slow
def test_demo_recipe_lowers_held_out_loss_and_the_merged_model_generates(shared_data, tmp_path):
    out = tmp_path / "demo"
    assert main(["recover", *SMALL_DEMO, "--data-dir", str(shared_data), "-o", str(out)]) == 0
    report = json.loads((out / "recover_report.json").read_text())
    assert report["held_out_loss"]["after"] < report["held_out_loss"]["before"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 24
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    assert model.generate(**ids, max_new_tokens=8, do_sample=False).shape[1] > ids["input_ids"].shape[1]

