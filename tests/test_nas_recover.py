"""Recovery of a sublayer-pruned (Nemotron-NAS) student: LoRA and kd train it and save the layout again; local trains
each block that lost a sublayer on the teacher's states around it; merge, which works on dropped blocks, refuses it
in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import assert_one_line_error, run_cli
from layerprune.cli import main
from layerprune.models.nemotron_nas import carries_our_layout
from test_recover import FAST
from tiny import tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def nas_student(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("nas-recover")
    config = tiny_config("llama", 6)
    config.intermediate_size = 256  # the layout's widths are multiples of 256
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "source")
    tiny_tokenizer().save_pretrained(root / "source")
    assert main(["-q", "prune", "--model", str(root / "source"), "--granularity", "sublayer", "--layers",
                 "2.attn,3.mlp", "--calib", "arithmetic", "-o", str(root / "pruned")]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"what is {i} + 7?", "answer": str(i + 7)}) + "\n"
                               for i in range(12)))
    return root / "pruned", prompts


@pytest.mark.parametrize("method", ["lora", "full", "kd"])
def test_a_sublayer_pruned_student_recovers_and_keeps_its_layout(nas_student, tmp_path, method):
    pruned, prompts = nas_student
    out = tmp_path / method
    assert main(["recover", "--model", str(pruned), "--method", method, "--prompts", str(prompts), "-o", str(out),
                 *FAST]) == 0
    assert carries_our_layout(out)
    config = json.loads((out / "config.json").read_text())
    assert config["block_configs"] == json.loads((pruned / "config.json").read_text())["block_configs"]
    report = json.loads((out / "recover_report.json").read_text())
    before, after = report["held_out_loss"]["before"], report["held_out_loss"]["after"]
    assert after < before
    AutoModelForCausalLM.from_pretrained(out)  # layerprune's class reads it
    card = (out / "README.md").read_text()  # the card says which sublayers went, not "dropped blocks: []"
    assert "- removed sublayers (original numbering): 2.attn, 3.mlp; whole blocks gone: none" in card, card


def test_the_run_report_names_the_removed_sublayers(nas_student):
    from layerprune.models.lineage import read_lineage
    from layerprune.pipeline.report import _prune_lines

    text = "\n".join(_prune_lines(read_lineage(nas_student[0])))
    assert "## Removed sublayers" in text and "Dropped (original numbering)" not in text
    assert "Removed sublayers (original numbering): 2.attn, 3.mlp; whole blocks gone: none; KV cache kept:" in text


def test_merge_refuses_a_sublayer_pruned_student_in_one_line(nas_student, tmp_path, capsys):
    pruned, prompts = nas_student
    out = tmp_path / "merge"
    code, _, err = run_cli(capsys, ["recover", "--model", str(pruned), "--method", "merge", "--prompts",
                                    str(prompts), "-o", str(out), *FAST])
    assert_one_line_error(code, err, "merge")
    assert not out.exists()


def test_local_trains_each_block_that_lost_a_sublayer_and_keeps_the_layout(nas_student, tmp_path):
    """Blocks 2 (attention removed) and 3 (MLP removed): each block's kept sublayer learns to map the teacher's
    state entering the block to the teacher's state after it; the hidden-state error falls and the layout is kept."""
    pruned, prompts = nas_student
    out = tmp_path / "local"
    assert main(["recover", "--model", str(pruned), "--method", "local", "--prompts", str(prompts), "-o", str(out),
                 *FAST, "--local-steps", "16", "--local-learning-rate", "1e-3"]) == 0
    assert carries_our_layout(out)
    config = json.loads((out / "config.json").read_text())
    assert config["block_configs"] == json.loads((pruned / "config.json").read_text())["block_configs"]
    report = json.loads((out / "recover_report.json").read_text())
    fits = report["data"]["local"]
    assert [fit["removed_sublayer"] for fit in fits] == ["2.attn", "3.mlp"]
    assert all(fit["mse_after"] < fit["mse_before"] for fit in fits), fits
    AutoModelForCausalLM.from_pretrained(out)  # layerprune's class reads it
